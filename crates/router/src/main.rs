use bellows_router::args::RouterArgs;
use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = RouterArgs::parse();
    let telemetry = bellows_common::telemetry::init("bellows-router", args.log_format);
    let result = bellows_router::run(args).await;
    // Flushing blocks on the exporter: off the async threads.
    let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
    result
}
