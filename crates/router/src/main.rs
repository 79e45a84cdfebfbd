use bellows_router::args::RouterArgs;
use clap::Parser;

// A request allocates and frees many small buffers across threads (headers, JSON, frames):
// mimalloc's thread-local free lists cost less per request than glibc's malloc.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let args = RouterArgs::parse();
    // Shard 0 (see the router's `shards`): the others are started by `run`.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let telemetry = bellows_common::telemetry::init("bellows-router", args.log_format);
        let result = bellows_router::run(args).await;
        // Flushing blocks on the exporter: off the async threads.
        let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
        result
    })
}
