//! Compiles the worker contract. Needs `protoc` (scripts/install-deps.sh installs it).
//!
//! The path is read when the script runs, not baked in when it is compiled: a build script
//! compiled in another checkout that shares the target directory would otherwise look there.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = format!("{}/../../proto", std::env::var("CARGO_MANIFEST_DIR")?);
    let file = format!("{root}/bellows/worker/v1/worker.proto");
    println!("cargo:rerun-if-changed={file}");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(&[file.as_str()], &[root.as_str()])?;
    Ok(())
}
