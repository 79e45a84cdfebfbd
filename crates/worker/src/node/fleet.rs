//! `bellows-worker fleet`: many nodes in one process, for tests and benchmarks of a large cluster.
//!
//! Each node is the real node (what `serve` runs): its own gRPC listener, node id, engine
//! thread, scheduler and KV pool, its own etcd registration and drain. Only the process is
//! shared: one async runtime, one set of signal handlers (a signal stops every node, each
//! draining as a lone node would), no `/metrics` port per node. With the simulated engine a
//! thousand nodes fit on a small machine, since an idle node costs next to nothing.

use std::{
    io::Write,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
};

use anyhow::{Context, Result};
use clap::Args;
use tokio::{sync::watch, task::JoinSet};

use super::{
    ServeArgs,
    drain::{Signals, Stops},
    on_runtime, serve_node,
};

#[derive(Debug, Clone, Args)]
pub struct FleetArgs {
    /// How many nodes to run.
    #[arg(long, default_value_t = 100)]
    pub nodes: u16,
    /// The address every node listens on (each on its own port).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Node i listens on this port + i; 0: each on any free port.
    #[arg(long, default_value_t = 0)]
    pub base_port: u16,
    /// Node ids are `<prefix>-<i>`.
    #[arg(long, default_value = "fleet")]
    pub node_prefix: String,
    /// Write the nodes' addresses here, comma-separated (a router's `--workers`), once all
    /// are listening.
    #[arg(long)]
    pub addresses_file: Option<PathBuf>,
    /// Every node's settings (`--engine sim`, `--sim-config`, `--etcd`, ...); `--listen` and
    /// `--node-id` are set per node, and `--metrics-listen` is ignored (no node serves /metrics).
    #[command(flatten)]
    pub serve: ServeArgs,
}

pub fn run(args: FleetArgs) -> Result<()> {
    on_runtime(args.serve.log_format, fleet(args))
}

async fn fleet(args: FleetArgs) -> Result<()> {
    let mut signals = Signals::install().context("installing signal handlers")?;
    let mut listeners = Vec::with_capacity(usize::from(args.nodes));
    for i in 0..args.nodes {
        let port = if args.base_port == 0 { 0 } else { args.base_port.checked_add(i).context("ports past 65535")? };
        let addr = SocketAddr::new(args.host, port);
        listeners.push(tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?);
    }
    let addresses: Vec<String> =
        listeners.iter().map(|l| l.local_addr().map(|a| a.to_string())).collect::<Result<_, _>>()?;
    if let Some(path) = &args.addresses_file {
        let mut f = std::fs::File::create(path).with_context(|| format!("writing {}", path.display()))?;
        f.write_all(addresses.join(",").as_bytes())?;
    }
    let (stop, stops) = watch::channel(None);
    let mut nodes = JoinSet::new();
    for (i, listener) in listeners.into_iter().enumerate() {
        let mut node = args.serve.clone();
        node.listen = listener.local_addr()?;
        node.node_id = Some(format!("{}-{i}", args.node_prefix));
        nodes.spawn(serve_node(node, listener, Stops::Fleet(stops.clone()), false));
    }
    tracing::info!(nodes = args.nodes, "fleet started");
    let mut failed = 0usize;
    loop {
        tokio::select! {
            sig = signals.next() => {
                stop.send_replace(Some(sig));
            }
            done = nodes.join_next() => match done {
                None => break,
                Some(Ok(Ok(()))) => {}
                Some(Ok(Err(e))) => { failed += 1; tracing::error!("a node failed: {e:#}") }
                Some(Err(e)) => { failed += 1; tracing::error!("a node panicked: {e}") }
            },
        }
    }
    anyhow::ensure!(failed == 0, "{failed} of {} nodes failed", args.nodes);
    Ok(())
}
