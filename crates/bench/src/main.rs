//! `bellows-bench`: the tools behind `scripts/bench-router.sh`, which measures what a router
//! costs (CPU and latency per request) and how well it places work (throughput and prefix-cache
//! hits on a skewed shared-prefix workload), for `bellows-router` and for the reference routers
//! (sglang-router, vllm-router) side by side.
//!
//! - [`load`]: a closed-loop load generator that drives a router over HTTP or, to measure what
//!   a router adds, simulated workers directly over gRPC.
//! - [`fake`]: an OpenAI-compatible HTTP server with fixed timing and no model, for the reference
//!   routers in the overhead benchmark.
//! - [`shim`]: an OpenAI-compatible HTTP face for simulated workers, so the HTTP-only reference
//!   routers can be compared on the same workers (scheduler, KV cache) as `bellows-router`.
//! - [`placement`] and [`ingest`]: the router's own placement decision and KV-event ingestion,
//!   timed through its library over a fleet (`scripts/bench-fleet.sh`).

mod fake;
mod http;
mod ingest;
mod load;
mod openai;
mod placement;
mod procstat;
mod shim;
mod stats;
mod store;
mod watch;
mod workload;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "bellows-bench", version, about = "Router benchmarks: load generator and stand-in workers")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a fixed-timing fake of an OpenAI-compatible worker (overhead benchmarks only).
    FakeOpenai(fake::Args),
    /// Serve OpenAI-compatible HTTP in front of simulated Bellows workers (one port each).
    SimOpenai(shim::Args),
    /// Drive a router (or workers directly) and print one JSON line of results.
    Load(load::Args),
    /// Time the router's placement decision alone over a running fleet; one JSON line.
    Placement(placement::Args),
    /// Measure the router's KV-event ingestion (decode and index) on one thread; one JSON line.
    KvIngest(ingest::Args),
    /// Time the response store's writes and reads (memory, PostgreSQL, and plain SQL beside it).
    Store(store::Args),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    match cli.command {
        Command::FakeOpenai(args) => rt.block_on(fake::run(args)),
        Command::SimOpenai(args) => rt.block_on(shim::run(args)),
        Command::Load(args) => rt.block_on(load::run(args)),
        Command::Placement(args) => placement::run(&rt, args),
        Command::KvIngest(args) => ingest::run(args),
        Command::Store(args) => rt.block_on(store::run(args)),
    }
}
