//! The Bellows router: an OpenAI-compatible gateway in front of Bellows workers.
//!
//! A request's way through: [`api`] (admission, validation, tokenization) → [`dispatch`]
//! (placement, retries, migration) → a worker's gRPC stream → back out as JSON or SSE.
//! [`cluster`] keeps the view of the workers that [`placement`] and [`admission`] decide on.
//! The router holds no state that matters: any number may run side by side.

pub mod admission;
pub mod answer;
pub mod api;
pub mod args;
pub mod cluster;
pub mod dispatch;
pub mod generation;
pub mod metrics;
pub mod placement;
pub mod shards;
pub mod tenants;
pub mod tokenize;
pub mod tools;
pub mod wire;

use std::sync::Arc;

use anyhow::Context;
use bellows_common::{
    priority::Priority,
    tls::{HttpTls, RELOAD_EVERY},
};
use tokio::sync::watch;

use crate::{
    admission::Admission,
    api::{
        AppState,
        responses::{
            postgres::{PgConfig, PgStore},
            store::{MemoryStore, ResponseStore},
        },
        tls_listener::TlsListener,
    },
    args::RouterArgs,
    cluster::Cluster,
    dispatch::Dispatcher,
    metrics::Metrics,
    shards::{ShardListener, Shards},
    tenants::{AdminKey, FairQueue, FairQueueConfig, RELOAD_INTERVAL, Tenants, Usage},
    tokenize::TokenizerPool,
};

/// How often the fair queue looks for room freed under the global cap.
const FAIR_QUEUE_TICK: std::time::Duration = std::time::Duration::from_millis(10);

/// How long the start-up check of etcd's credentials waits for etcd.
const ETCD_CHECK_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Build the router's state and start discovery (needs a tokio runtime: shard 0 of `shards`).
/// `port` is the HTTP port, for the default router id.
pub fn start(args: &RouterArgs, port: u16, shards: Arc<Shards>) -> anyhow::Result<Arc<AppState>> {
    let usage = Arc::new(Usage::new());
    let metrics = Metrics::new(&usage);
    let tls = args.tls.load()?;
    match &tls {
        None => {
            tracing::warn!("links to workers are plaintext gRPC (set --tls-ca, --tls-cert, --tls-key for mutual TLS)")
        }
        Some(tls) => tls.spawn_reloader(RELOAD_EVERY),
    }
    let cluster = Cluster::new(metrics.clone(), args.prefix_index_entries, tls, shards);
    cluster::discovery::join_static(&cluster, &args.static_workers());

    let admin = args.admin_key_file.as_deref().map(AdminKey::from_file).transpose()?;
    let tenants = match &args.tenants_file {
        Some(path) => Tenants::from_file(path)?,
        None => Tenants::disabled(),
    };
    let tenants = Arc::new(tenants.with_admin_key(admin));
    tenants.spawn_reloader(RELOAD_INTERVAL);

    follow_etcd(args, port, &cluster, &tenants, &metrics)?;

    let admission = Admission::new(args.max_waiting as u64);
    let fair_queue = fair_queue(args, &tenants, &cluster, &admission);
    let threads = args.tokenizer_threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
    Ok(Arc::new(AppState {
        dispatcher: Arc::new(Dispatcher {
            policy: placement::policy(args.policy),
            max_retries: args.max_retries,
            max_migrations: args.max_migrations,
            worker_timeout: args.worker_timeout,
            placement_memory: args.placement_memory,
            metrics: metrics.clone(),
        }),
        cluster,
        admission,
        tokenizers: TokenizerPool::new(threads, args.tokenizer_queue),
        max_body_bytes: args.max_body_bytes,
        metrics,
        started_at: api::unix_seconds(),
        trace_text: args.trace_text,
        tenants,
        usage,
        fair_queue,
        refusal_log: Default::default(),
        responses: response_store(args)?,
    }))
}

/// The store for `store: true` responses: the shared database when one is given, else memory.
fn response_store(args: &RouterArgs) -> anyhow::Result<Arc<dyn ResponseStore>> {
    let Some(url) = &args.responses_store_url else {
        return Ok(Arc::new(MemoryStore::new(args.responses_ttl, args.responses_max_bytes)));
    };
    Ok(PgStore::start(&PgConfig {
        url: url.clone(),
        password_file: args.responses_store_password_file.clone(),
        ttl: args.responses_ttl,
        max_bytes: args.responses_max_bytes,
        timeout: args.responses_store_timeout,
        sweep_every: args.responses_sweep_interval,
    })?)
}

/// With etcd: follow the workers registered there, and take this router's share of every
/// tenant's limits from the number of live routers.
fn follow_etcd(
    args: &RouterArgs,
    port: u16,
    cluster: &Arc<Cluster>,
    tenants: &Arc<Tenants>,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<()> {
    let etcd = args.etcd_endpoints();
    if etcd.is_empty() {
        return Ok(());
    }
    let options = args.etcd_auth.options()?;
    if !args.etcd_auth.encrypted() {
        tracing::warn!("the link to etcd is plaintext (set --etcd-ca, and --etcd-cert/--etcd-key for client auth)");
    }
    tokio::spawn(cluster::discovery::follow_etcd(cluster.clone(), etcd.clone(), options.clone(), args.cluster.clone()));
    let id = args.router_id.clone().unwrap_or_else(|| format!("{}-{port}", cluster::peers::hostname()));
    let (limits, metrics) = (tenants.clone(), metrics.clone());
    tokio::spawn(cluster::peers::share_with_peers(etcd, options, args.cluster.clone(), id, move |routers| {
        limits.limits().set_share(1.0 / routers.max(1) as f64);
        metrics.live_routers.set(routers as i64);
    }));
    Ok(())
}

/// The fair-share queue (with tenants and a queue timeout), pumped on its own tick.
fn fair_queue(
    args: &RouterArgs,
    tenants: &Tenants,
    cluster: &Arc<Cluster>,
    admission: &Admission,
) -> Option<Arc<FairQueue>> {
    if !tenants.auth_enabled() || args.fair_queue_timeout.is_zero() {
        return None;
    }
    let room = {
        let (cluster, admission) = (cluster.clone(), admission.clone());
        move || admission.room(cluster.queue())
    };
    let config = FairQueueConfig {
        max_queued_per_tenant: args.fair_queue_depth,
        timeout: args.fair_queue_timeout,
        reserve: Priority::ALL.map(|c| admission.reserve(c)),
        ..FairQueueConfig::default()
    };
    let queue = Arc::new(FairQueue::new(config, room));
    let pump = Arc::downgrade(&queue);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(FAIR_QUEUE_TICK);
        while let Some(q) = pump.upgrade() {
            q.pump();
            drop(q);
            tick.tick().await;
        }
    });
    Some(queue)
}

/// Serve until SIGTERM or SIGINT; in-flight requests finish first. Runs on shard 0 (see
/// [`shards`]), which starts the others.
pub async fn run(args: RouterArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !args.static_workers().is_empty() || !args.etcd_endpoints().is_empty(),
        "no workers to route to: give --workers host:port,... or --etcd-endpoints"
    );
    let http_tls = args.http_tls.load()?;
    let etcd = args.etcd_endpoints();
    if !etcd.is_empty() {
        // Refused credentials stop the router now: no retry mends them.
        let prefix = bellows_common::cluster::workers_prefix(&args.cluster)?;
        args.etcd_auth.options()?.check_access(&etcd, &prefix, ETCD_CHECK_LIMIT).await?;
    }
    let listener =
        tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr()?;
    let shards = Shards::start(args.shard_count()).context("starting the shards' threads")?;
    let state = start(&args, addr.port(), shards.clone())?;
    let scheme = if http_tls.is_some() { "https" } else { "http" };
    tracing::info!(%addr, policy = args.policy.as_str(), scheme, threads = shards.count(), "bellows-router listening");
    println!("bellows-router listening on {scheme}://{addr}");
    if let Some(tls) = &http_tls {
        tls.spawn_reloader(RELOAD_EVERY);
    }
    let (stop, stopping) = watch::channel(false);
    let (listeners, acceptor) = shards.distribute(listener)?;
    let shed = state.metrics.shed_connections.clone();
    let app = shards.shedding(api::router(state), shed);
    let served: Vec<_> = (listeners.into_iter().enumerate())
        .map(|(shard, listener)| {
            let served = serve_shard(listener, app.clone(), http_tls.clone(), stopping.clone());
            shards.handle(shard).spawn(served)
        })
        .collect();
    shutdown_signal().await;
    // New connections are refused at once; each shard finishes the requests it has.
    acceptor.abort();
    let _ = stop.send(true);
    for shard in served {
        shard.await??;
    }
    Ok(())
}

/// One shard's HTTP server, until `stopping` turns true and its connections are done.
async fn serve_shard(
    listener: ShardListener,
    app: axum::Router,
    tls: Option<HttpTls>,
    mut stopping: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let stopped = async move {
        let _ = stopping.wait_for(|stop| *stop).await;
    };
    match tls {
        Some(tls) => axum::serve(TlsListener::new(listener, &tls)?, app).with_graceful_shutdown(stopped).await,
        None => axum::serve(listener, app).with_graceful_shutdown(stopped).await,
    }
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
