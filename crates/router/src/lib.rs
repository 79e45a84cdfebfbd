//! The Bellows router: an OpenAI-compatible gateway in front of Bellows workers.
//!
//! A request's way through: [`api`] (admission, validation, tokenization) → [`dispatch`]
//! (placement, retries, migration) → a worker's gRPC stream → back out as JSON or SSE.
//! [`cluster`] keeps the view of the workers that [`placement`] and [`admission`] decide on.
//! The router holds no state that matters: any number may run side by side.

pub mod admission;
pub mod api;
pub mod args;
pub mod cluster;
pub mod dispatch;
pub mod metrics;
pub mod placement;
pub mod tokenize;

use std::{
    sync::Arc,
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::Context;

use crate::{
    admission::Admission, api::AppState, args::RouterArgs, cluster::Cluster, dispatch::Dispatcher, metrics::Metrics,
    tokenize::TokenizerPool,
};

/// Build the router's state and start discovery (needs a tokio runtime).
pub fn start(args: &RouterArgs) -> Arc<AppState> {
    let metrics = Arc::new(Metrics::default());
    let cluster = Cluster::new();
    cluster::discovery::join_static(&cluster, &args.static_workers());
    let etcd = args.etcd_endpoints();
    if !etcd.is_empty() {
        tokio::spawn(cluster::discovery::follow_etcd(cluster.clone(), etcd, args.cluster.clone()));
    }
    let threads = args.tokenizer_threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
    Arc::new(AppState {
        dispatcher: Arc::new(Dispatcher {
            policy: placement::policy(args.policy),
            max_retries: args.max_retries,
            max_migrations: args.max_migrations,
            worker_timeout: args.worker_timeout,
            placement_memory: args.placement_memory,
            metrics: metrics.clone(),
        }),
        cluster,
        admission: Admission { max_waiting: args.max_waiting as u64 },
        tokenizers: TokenizerPool::new(threads, args.tokenizer_queue),
        max_body_bytes: args.max_body_bytes,
        metrics,
        started_at: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
    })
}

/// Serve until SIGTERM or SIGINT; in-flight requests finish first.
pub async fn run(args: RouterArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !args.static_workers().is_empty() || !args.etcd_endpoints().is_empty(),
        "no workers to route to: give --workers host:port,... or --etcd-endpoints"
    );
    let state = start(&args);
    let listener =
        tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, policy = args.policy.as_str(), "bellows-router listening");
    println!("bellows-router listening on http://{addr}");
    axum::serve(listener, api::router(state)).with_graceful_shutdown(shutdown_signal()).await?;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down: finishing in-flight requests");
}
