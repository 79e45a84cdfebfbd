//! `bellows-worker serve`: the engine as a cluster node.
//!
//! A node serves the `bellows.worker.v1.Worker` gRPC contract (Generate, ModelInfo, WatchLoad)
//! and standard gRPC health, registers itself in etcd, and stops without losing a request:
//!
//! 1. bind the port and serve at once (health NOT_SERVING, calls refused with UNAVAILABLE), so
//!    orchestrators see a live process while the model loads;
//! 2. load the model, then health SERVING, then register in etcd: a router can only find a
//!    node that is able to serve;
//! 3. on SIGTERM/SIGINT: deregister first (routers stop sending), refuse new work, let in-flight
//!    requests finish (up to `--drain-timeout`), close the streams that never end by themselves,
//!    exit 0. A second signal skips the wait.
//!
//! `bellows-worker fleet` runs many such nodes in one process ([`fleet`]), for tests and
//! benchmarks of a large cluster.
//!
//! One concern per module: [`args`] (flags), [`model`] (starting the engine, ModelInfo),
//! [`grpc`] (the service), [`load_report`] (WatchLoad), [`registration`] (etcd), [`drain`]
//! (lifecycle and admission), [`status`] (errors to gRPC codes), [`metrics`] (Prometheus
//! `/metrics` on its own port).

pub mod args;
pub mod drain;
pub mod fleet;
pub mod grpc;
pub mod load_report;
pub mod metrics;
pub mod model;
pub mod registration;
pub mod session;
pub mod status;

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context, Result};
use bellows_common::{
    cluster::{WorkerRecord, hostname, worker_key},
    tls::RELOAD_EVERY,
};
use bellows_proto::worker::v1::worker_server::WorkerServer;
use tonic::transport::{Server, server::TcpIncoming};
use tonic_health::{ServingStatus, server::HealthReporter};

pub use args::ServeArgs;
use drain::{Lifecycle, Phase, Signals, Stops};
use grpc::{Ready, WorkerService};
use metrics::{Counted, NodeMetrics};
use registration::{Registration, RegistrationConfig};

/// How long the server may take to close its connections once every request is done.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Run a node until it is stopped by a signal.
pub fn run(args: ServeArgs) -> Result<()> {
    let log_format = args.log_format;
    on_runtime(log_format, serve(args))
}

/// Run `body` on a runtime of its own, with the node's logging and tracing set up first and
/// flushed after.
pub(crate) fn on_runtime(
    log_format: bellows_common::telemetry::LogFormat,
    body: impl Future<Output = Result<()>>,
) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let result = rt.block_on(async {
        let telemetry = bellows_common::telemetry::init("bellows-worker", log_format);
        let result = body.await;
        // Flushing blocks on the exporter: off the async threads.
        let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
        result
    });
    // A model load interrupted by a signal is still running on a blocking thread: do not wait.
    rt.shutdown_timeout(Duration::from_millis(100));
    result
}

async fn serve(args: ServeArgs) -> Result<()> {
    let signals = Signals::install().context("installing signal handlers")?;
    let listener =
        tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
    serve_node(args, listener, Stops::Signals(signals), true).await
}

/// One node on `listener` until `stops` says stop (see the module docs); `/metrics` on its own
/// port when `metrics` (a fleet's nodes have none).
pub(crate) async fn serve_node(
    args: ServeArgs,
    listener: tokio::net::TcpListener,
    mut stops: Stops,
    metrics: bool,
) -> Result<()> {
    let local = listener.local_addr()?;
    let node_id = args.node_id.clone().unwrap_or_else(|| format!("{}-{}", hostname(), local.port()));
    let advertise = args.advertise_address.clone().unwrap_or_else(|| advertised(local));
    // Check the key before anything slow: a bad name is a configuration error.
    let key = worker_key(&args.cluster, &node_id)?;
    let tls = args.tls.load()?;
    let etcd_options = args.etcd_auth.options()?;
    let endpoints = args.etcd_endpoints();
    if !endpoints.is_empty() {
        // Refused credentials stop the node now, before the model loads: no retry mends them.
        etcd_options.check_access(&endpoints, &key, registration::CALL_TIMEOUT).await?;
    }
    // Said once per process: a fleet's nodes (no `metrics`) share its flags.
    if tls.is_none() && metrics {
        tracing::warn!(
            "plaintext gRPC: any client that reaches this port may generate (set --tls-ca, --tls-cert, --tls-key)"
        );
    }

    let lifecycle = Lifecycle::new();
    let (health, health_service) = tonic_health::server::health_reporter();
    set_health(&health, ServingStatus::NotServing).await;
    let service = WorkerService::new(node_id.clone(), lifecycle.clone(), args.log_prompts, args.protocol_version);
    let node_metrics = NodeMetrics::new();
    let metrics_server = match metrics {
        true => metrics::serve(args.metrics_listen, node_metrics.clone(), lifecycle.clone()).await?,
        false => None,
    };
    let server = {
        let closed = lifecycle.clone();
        let counted = Counted { inner: service.clone(), metrics: node_metrics.clone() };
        let router = Server::builder().add_service(health_service).add_service(WorkerServer::new(counted));
        // TCP_NODELAY: a Delta is a small write; with Nagle on it waits for the router's delayed
        // ACK (40 ms on Linux), which was most of a simulated request's latency.
        let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
        let shutdown = async move { closed.closed().await };
        match &tls {
            None => tokio::spawn(router.serve_with_incoming_shutdown(incoming, shutdown)),
            Some(tls) => {
                tls.spawn_reloader(RELOAD_EVERY);
                tokio::spawn(router.serve_with_incoming_shutdown(tls.accept(incoming), shutdown))
            }
        }
    };
    tracing::info!(address = %local, node_id, engine = ?args.engine, "listening; loading the model");

    let load_args = args.clone();
    let loaded = tokio::select! {
        r = tokio::task::spawn_blocking(move || model::load(&load_args)) => r.context("the model loader panicked")??,
        sig = stops.next() => {
            tracing::info!(signal = sig, "stopped while loading the model");
            lifecycle.advance(Phase::Closed);
            return Ok(());
        }
    };
    let engine = loaded.engine;
    let handle = engine.handle();
    let caps = load_report::Caps { max_waiting: args.max_waiting as u32, max_running: args.max_running as u32 };
    let record = WorkerRecord {
        address: advertise,
        model_id: loaded.info.model_id.clone(),
        block_size: loaded.info.kv_block_size,
        context_length: loaded.info.context_length,
        capacity: args.max_running as u32,
        version: env!("CARGO_PKG_VERSION").to_string(),
    };
    // The KV pool in tokens: what `--kv-cache-mb` buys, and what `--kv-cache-dtype f16` doubles.
    let kv_token_bytes = handle.spec().kv_bytes_per_token.max(1);
    tracing::info!(
        model_id = %record.model_id,
        device = %handle.spec().device,
        context_length = record.context_length,
        block_size = record.block_size,
        kv_cache_mib = handle.kv_cache_bytes() >> 20,
        kv_cache_tokens = handle.kv_cache_bytes() / kv_token_bytes,
        kv_bytes_per_token = kv_token_bytes,
        "model loaded"
    );
    node_metrics.set_engine(handle.clone());
    service.set_ready(Ready {
        load: load_report::spawn_sampler(handle.clone(), caps, lifecycle.clone()),
        engine: handle,
        info: loaded.info,
        tokenizer: loaded.tokenizer,
    });
    lifecycle.advance(Phase::Serving);
    set_health(&health, ServingStatus::Serving).await;

    if !endpoints.is_empty() && !args.etcd_auth.encrypted() && metrics {
        tracing::warn!("the link to etcd is plaintext (set --etcd-ca, and --etcd-cert/--etcd-key for client auth)");
    }
    let registration = (!endpoints.is_empty()).then(|| {
        let config = RegistrationConfig { endpoints, options: etcd_options, key, record, ttl: args.lease_ttl };
        Registration::spawn(config)
    });
    tracing::info!(node_id, "serving");

    let sig = stops.next().await;
    tracing::info!(signal = sig, in_flight = lifecycle.in_flight(), "draining");
    if let Some(r) = registration {
        r.deregister().await;
    }
    lifecycle.advance(Phase::Draining);
    set_health(&health, ServingStatus::NotServing).await;
    tokio::select! {
        left = lifecycle.wait_idle(args.drain_timeout) => if left > 0 {
            tracing::warn!(abandoned = left, timeout = ?args.drain_timeout, "drain timeout: abandoning requests");
        },
        sig = stops.next() => tracing::warn!(signal = sig, abandoned = lifecycle.in_flight(), "second signal: not waiting"),
    }
    lifecycle.advance(Phase::Closed);
    // Stopping the engine fails whatever is left, which ends those streams.
    tokio::task::spawn_blocking(move || drop(engine)).await?;
    match tokio::time::timeout(CLOSE_GRACE, server).await {
        Ok(served) => served?.context("the gRPC server failed")?,
        Err(_) => tracing::warn!("connections still open after the drain; closing them"),
    }
    if let Some(m) = metrics_server {
        m.abort();
    }
    tracing::info!("stopped");
    Ok(())
}

async fn set_health(health: &HealthReporter, status: ServingStatus) {
    // "" is the whole server, as orchestrators probe it; the service name for clients that ask.
    health.set_service_status("", status).await;
    health.set_service_status(<WorkerServer<WorkerService> as tonic::server::NamedService>::NAME, status).await;
}

/// The listen address, with the host's name in place of an unspecified IP.
fn advertised(local: SocketAddr) -> String {
    if local.ip().is_unspecified() { format!("{}:{}", hostname(), local.port()) } else { local.to_string() }
}
