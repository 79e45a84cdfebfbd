//! Compiles the worker contract. Needs `protoc` (scripts/install-deps.sh installs it).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../proto");
    let file = format!("{root}/bellows/worker/v1/worker.proto");
    println!("cargo:rerun-if-changed={file}");
    tonic_prost_build::configure().build_client(true).build_server(true).compile_protos(&[file.as_str()], &[root])?;
    Ok(())
}
