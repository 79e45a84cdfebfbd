//! The node's Prometheus metrics: `GET /metrics` (OpenMetrics text) on a port of its own
//! (`--metrics-listen`), apart from the gRPC port so scrapers need no HTTP/2 and a scrape can
//! never queue behind model traffic. The same plaintext port answers `GET /ready` (200 while
//! serving, 503 while loading or draining: the gRPC health's verdict), for probes that cannot
//! present the client certificate the gRPC port asks for under mutual TLS.
//!
//! Nothing is counted here twice: the engine already keeps its counters and gauges in
//! [`Stats`](crate::stats::Stats) (the same numbers feed the routers' load reports), and each
//! scrape reads one [`StatsSnapshot`] and encodes it. The only count kept here is the refusals:
//! a Generate call answered with an error status never reached the scheduler (model still
//! loading, draining, malformed or invalid request, waiting queue full), so [`Counted`] counts
//! them around the service. Before the model is loaded the engine's metrics read zero.
//!
//! Names follow Prometheus conventions: `bellows_worker_` prefix, base units (seconds, tokens),
//! `_total` on counters, and labels from closed sets only (`outcome`, `kind`).

use std::{
    fmt,
    net::SocketAddr,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
};

use anyhow::{Context, Result};
use axum::{
    Router,
    extract::State,
    http::{StatusCode, header},
    response::IntoResponse,
    routing::get,
};
use bellows_proto::worker::v1::{self as pb, worker_server::Worker};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder, NoLabelSet},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
    registry::Registry,
};
use tokio::task::JoinHandle;
use tonic::{Request, Response, Status, Streaming};

use super::{
    drain::{Lifecycle, Phase},
    grpc::{GenerateStream, WorkerService},
    load_report::LoadStream,
    session::SessionStream,
};
use crate::{
    engine::EngineHandle,
    stats::{Histogram, StatsSnapshot, StepKind},
};

/// Where metrics are served when `--metrics-listen` is not given.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:9091";

const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Why a request was refused before it reached the engine, from its gRPC status.
#[derive(Debug, Clone, Copy)]
enum Refusal {
    /// The waiting cap is full (RESOURCE_EXHAUSTED): a router should try elsewhere.
    Busy,
    /// The node is draining (UNAVAILABLE).
    Draining,
    /// The request itself is wrong (INVALID_ARGUMENT and the like).
    Invalid,
    Other,
}

impl Refusal {
    const ALL: [Refusal; 4] = [Refusal::Busy, Refusal::Draining, Refusal::Invalid, Refusal::Other];

    fn of(code: tonic::Code) -> Refusal {
        match code {
            tonic::Code::ResourceExhausted => Refusal::Busy,
            tonic::Code::Unavailable => Refusal::Draining,
            tonic::Code::InvalidArgument | tonic::Code::OutOfRange | tonic::Code::FailedPrecondition => {
                Refusal::Invalid
            }
            _ => Refusal::Other,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Refusal::Busy => "busy",
            Refusal::Draining => "draining",
            Refusal::Invalid => "invalid",
            Refusal::Other => "other",
        }
    }
}

/// What a scrape reads: the engine (once loaded) and the node's refusals by reason. Refusals
/// are logged at debug level only: under a retry storm they are counted, not written out.
#[derive(Default)]
pub struct NodeMetrics {
    engine: OnceLock<EngineHandle>,
    refused: [AtomicU64; Refusal::ALL.len()],
    /// Session streams open now (see [`OpenSession`]).
    sessions: AtomicU64,
}

/// One open Session stream, counted in `bellows_worker_sessions` until it is dropped: each
/// router thread holds one (a router that died holds none).
pub struct OpenSession(Arc<NodeMetrics>);

impl OpenSession {
    pub fn new(metrics: &Arc<NodeMetrics>) -> Self {
        metrics.sessions.fetch_add(1, Relaxed);
        OpenSession(metrics.clone())
    }
}

impl Drop for OpenSession {
    fn drop(&mut self) {
        self.0.sessions.fetch_sub(1, Relaxed);
    }
}

impl fmt::Debug for NodeMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeMetrics")
            .field("loaded", &self.engine.get().is_some())
            .field("refused", &self.refusals())
            .finish()
    }
}

impl NodeMetrics {
    pub fn new() -> Arc<Self> {
        Arc::new(NodeMetrics::default())
    }

    /// Called once, when the model is loaded.
    pub fn set_engine(&self, engine: EngineHandle) {
        let _ = self.engine.set(engine);
    }

    /// A request refused before it reached the engine, with this status.
    pub fn refused(&self, code: tonic::Code) {
        self.refused[Refusal::of(code) as usize].fetch_add(1, Relaxed);
    }

    /// Refusals by reason, in [`Refusal::ALL`]'s order.
    fn refusals(&self) -> [u64; Refusal::ALL.len()] {
        std::array::from_fn(|i| self.refused[i].load(Relaxed))
    }

    /// The node's metrics registry (`bellows_worker_*`).
    pub fn registry(self: &Arc<Self>) -> Registry {
        let mut registry = Registry::with_prefix("bellows_worker");
        registry.register_collector(Box::new(self.clone()));
        registry
    }

    /// The OpenMetrics text of `registry`.
    pub fn encode(registry: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, registry).expect("writing to a String cannot fail");
        out
    }
}

impl Collector for NodeMetrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let s = self.engine.get().map(EngineHandle::stats).unwrap_or_default();
        encode_snapshot(&mut enc, &s, self.refusals())?;
        gauge(
            &mut enc,
            "sessions",
            "Session streams open from routers (one per router thread)",
            self.sessions.load(Relaxed),
        )
    }
}

fn gauge(enc: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> fmt::Result {
    let g = ConstGauge::new(v);
    g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)
}

/// `name` without `_total`: the encoder appends it to counters.
fn counter(enc: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> fmt::Result {
    let c = ConstCounter::new(v);
    c.encode(enc.encode_descriptor(name, help, None, c.metric_type())?)
}

fn histogram(mut m: MetricEncoder, h: &Histogram) -> fmt::Result {
    // The encoder accumulates per-bucket counts; f64::MAX is its +Inf.
    let buckets: Vec<(f64, u64)> = h.bounds.iter().copied().chain([f64::MAX]).zip(h.counts.iter().copied()).collect();
    m.encode_histogram::<NoLabelSet>(h.sum, h.count(), &buckets, None)
}

fn encode_snapshot(enc: &mut DescriptorEncoder, s: &StatsSnapshot, refused: [u64; Refusal::ALL.len()]) -> fmt::Result {
    gauge(
        enc,
        "waiting_requests",
        "Requests accepted and not yet admitted (preempted sequences excluded)",
        s.waiting_requests,
    )?;
    gauge(
        enc,
        "waiting_prompt_tokens",
        "Tokens still to prefill of everything waiting (net of prefix-cache hits at enqueue), preempted sequences included",
        s.waiting_prompt_tokens,
    )?;
    gauge(enc, "running_requests", "Sequences admitted: prefilling or decoding", s.running_requests)?;
    gauge(enc, "kv_blocks_used", "KV cache blocks held by running sequences", s.kv_blocks_used)?;
    gauge(enc, "kv_blocks_capacity", "KV cache blocks in the pool (its capacity)", s.kv_blocks_total)?;
    counter(enc, "prompt_tokens", "Prompt tokens of admitted requests (counted at first admission)", s.prompt_tokens)?;
    counter(
        enc,
        "prefix_cache_hit_tokens",
        "Prompt tokens served from the prefix cache instead of being prefilled",
        s.prefix_hit_tokens,
    )?;
    counter(
        enc,
        "prefill_tokens",
        "Tokens computed by prefill (cache hits excluded, recomputation after preemption included)",
        s.prefill_tokens,
    )?;
    counter(enc, "generated_tokens", "Tokens generated and streamed to requests", s.generated_tokens)?;
    counter(enc, "preemptions", "Sequences preempted because the KV cache was full", s.preemptions)?;

    let mut m = enc.encode_descriptor(
        "requests",
        "Requests by outcome: finished, cancelled by the client, failed in the model, or refused before reaching the engine",
        None,
        MetricType::Counter,
    )?;
    for (outcome, v) in [
        ("finished", s.requests_finished),
        ("cancelled", s.requests_cancelled),
        ("failed", s.requests_failed),
        ("refused", refused.iter().sum()),
    ] {
        ConstCounter::new(v).encode(m.encode_family(&[("outcome", outcome)])?)?;
    }
    let mut m = enc.encode_descriptor(
        "refusals",
        "Requests refused before reaching the engine, by reason: busy (waiting cap), draining, invalid, other",
        None,
        MetricType::Counter,
    )?;
    for (reason, v) in Refusal::ALL.iter().zip(refused) {
        ConstCounter::new(v).encode(m.encode_family(&[("reason", reason.label())])?)?;
    }

    let h = &s.histograms;
    let mut m = enc.encode_descriptor(
        "step_duration_seconds",
        "Wall time of one forward pass, by what it computed: prefill only, decode only, or mixed",
        None,
        MetricType::Histogram,
    )?;
    for kind in StepKind::ALL {
        histogram(m.encode_family(&[("kind", kind.as_str())])?, h.step_seconds(kind))?;
    }
    let m = enc.encode_descriptor(
        "batch_tokens",
        "Tokens one forward pass computed (prefill chunks plus decode tokens)",
        None,
        MetricType::Histogram,
    )?;
    histogram(m, &h.batch_tokens)?;
    let m =
        enc.encode_descriptor("batch_sequences", "Sequences (rows) in one forward pass", None, MetricType::Histogram)?;
    histogram(m, &h.batch_sequences)
}

/// Bind the metrics port and serve `/metrics` and `/ready` until the returned task is aborted.
///
/// An address given explicitly (flag or environment) that cannot be bound is an error, like the
/// gRPC port. The default one is not: several nodes on one host (tests, benchmarks) would all
/// want 9091, and the node then serves without metrics, saying so.
pub async fn serve(
    listen: Option<SocketAddr>,
    metrics: Arc<NodeMetrics>,
    lifecycle: Arc<Lifecycle>,
) -> Result<Option<JoinHandle<()>>> {
    let addr: SocketAddr = match listen {
        Some(a) => a,
        None => DEFAULT_LISTEN.parse().expect("a valid default"),
    };
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) if listen.is_none() => {
            tracing::warn!(address = %addr, error = %e, "cannot bind the default metrics address: serving without /metrics (set --metrics-listen)");
            return Ok(None);
        }
        Err(e) => return Err(e).with_context(|| format!("binding the metrics address {addr}")),
    };
    let local = listener.local_addr()?;
    let registry = Arc::new(metrics.registry());
    let app = Router::new()
        .route("/metrics", get(scrape))
        .with_state(registry)
        .route("/ready", get(ready))
        .with_state(lifecycle);
    tracing::info!(address = %local, "metrics listening (GET /metrics, GET /ready)");
    Ok(Some(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the metrics server failed");
        }
    })))
}

async fn ready(State(lifecycle): State<Arc<Lifecycle>>) -> (StatusCode, &'static str) {
    match lifecycle.phase() {
        Phase::Serving => (StatusCode::OK, "serving\n"),
        Phase::Loading => (StatusCode::SERVICE_UNAVAILABLE, "loading the model\n"),
        Phase::Draining | Phase::Closed => (StatusCode::SERVICE_UNAVAILABLE, "draining\n"),
    }
}

async fn scrape(State(registry): State<Arc<Registry>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], NodeMetrics::encode(&registry))
}

/// The Worker service with its refusals counted: a Generate call answered with an error status
/// never reached the engine. (Failures after the stream started are the engine's to count.)
#[derive(Clone)]
pub struct Counted {
    pub inner: WorkerService,
    pub metrics: Arc<NodeMetrics>,
}

#[tonic::async_trait]
impl Worker for Counted {
    type GenerateStream = GenerateStream;
    type SessionStream = SessionStream;
    type WatchLoadStream = LoadStream;

    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<GenerateStream>, Status> {
        let answer = self.inner.generate(request).await;
        if let Err(status) = &answer {
            self.metrics.refused(status.code());
        }
        answer
    }

    async fn session(
        &self,
        request: Request<Streaming<pb::SessionRequest>>,
    ) -> Result<Response<SessionStream>, Status> {
        // The session is not a request: only the requests it refuses count.
        let metrics = self.metrics.clone();
        let answer = self.inner.session_counted(request, Arc::new(move |code| metrics.refused(code))).await;
        answer.map(|r| r.map(|session| session.held_with(OpenSession::new(&self.metrics))))
    }

    async fn model_info(
        &self,
        request: Request<pb::ModelInfoRequest>,
    ) -> Result<Response<pb::ModelInfoResponse>, Status> {
        self.inner.model_info(request).await
    }

    async fn watch_load(&self, request: Request<pb::WatchLoadRequest>) -> Result<Response<LoadStream>, Status> {
        self.inner.watch_load(request).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Stats;

    #[test]
    fn the_text_has_every_metric_with_its_conventional_name() {
        let stats = Stats::default();
        stats.record_step(32, 0, 1, std::time::Duration::from_millis(3));
        stats.record_step(0, 4, 4, std::time::Duration::from_millis(1));
        let metrics = NodeMetrics::new();
        metrics.refused(tonic::Code::ResourceExhausted);
        let mut registry = Registry::with_prefix("bellows_worker");
        struct One(StatsSnapshot);
        impl fmt::Debug for One {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("One")
            }
        }
        impl Collector for One {
            fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
                encode_snapshot(&mut enc, &self.0, [1, 0, 2, 0])
            }
        }
        registry.register_collector(Box::new(One(stats.snapshot())));
        let text = NodeMetrics::encode(&registry);
        for line in [
            "# TYPE bellows_worker_running_requests gauge",
            "bellows_worker_kv_blocks_capacity 0",
            "bellows_worker_prefill_tokens_total 32",
            "bellows_worker_requests_total{outcome=\"refused\"} 3",
            "bellows_worker_requests_total{outcome=\"finished\"} 0",
            "bellows_worker_refusals_total{reason=\"busy\"} 1",
            "bellows_worker_refusals_total{reason=\"invalid\"} 2",
            "# TYPE bellows_worker_step_duration_seconds histogram",
            "bellows_worker_step_duration_seconds_count{kind=\"prefill\"} 1",
            "bellows_worker_step_duration_seconds_bucket{le=\"0.004\",kind=\"prefill\"} 1",
            "bellows_worker_step_duration_seconds_bucket{le=\"+Inf\",kind=\"decode\"} 1",
            "bellows_worker_step_duration_seconds_count{kind=\"mixed\"} 0",
            "bellows_worker_batch_tokens_sum 36.0",
            "bellows_worker_batch_sequences_count 2",
            "bellows_worker_batch_sequences_bucket{le=\"4.0\"} 2",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} missing from:\n{text}");
        }
        // The unloaded node: zeros, same shape.
        let empty = NodeMetrics::encode(&metrics.registry());
        assert!(empty.contains("bellows_worker_requests_total{outcome=\"refused\"} 1"), "{empty}");
        assert!(empty.contains("bellows_worker_refusals_total{reason=\"busy\"} 1"), "{empty}");
        assert!(empty.contains("bellows_worker_batch_tokens_count 0"), "{empty}");
    }

    #[tokio::test]
    async fn ready_is_ok_only_while_serving() {
        let lifecycle = Lifecycle::new();
        let status = |l: &Arc<Lifecycle>| {
            let l = l.clone();
            async move { ready(State(l)).await.0 }
        };
        assert_eq!(status(&lifecycle).await, StatusCode::SERVICE_UNAVAILABLE, "while loading");
        lifecycle.advance(Phase::Serving);
        assert_eq!(status(&lifecycle).await, StatusCode::OK);
        lifecycle.advance(Phase::Draining);
        assert_eq!(status(&lifecycle).await, StatusCode::SERVICE_UNAVAILABLE, "while draining");
    }
}
