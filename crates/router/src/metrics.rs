//! The router's Prometheus metrics (`GET /metrics`). Label sets are bounded: endpoints, status
//! codes, reasons and policies are closed sets, a model label only ever names a model the
//! cluster serves, a worker label a worker it knows, and tenants come from the tenants file.

use std::sync::{Arc, atomic::AtomicU64};

use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

use crate::tenants::Usage;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub endpoint: &'static str,
    pub model: String,
    pub status: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabels {
    pub policy: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub model: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PriorityLabels {
    pub model: String,
    pub priority: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabels {
    pub worker: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShardLabels {
    pub shard: usize,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ChangeLabels {
    pub change: &'static str,
}

type Latency = Family<ModelLabels, Histogram>;

fn seconds() -> Histogram {
    Histogram::new(SECONDS.iter().copied())
}

fn gaps() -> Histogram {
    Histogram::new(GAPS.iter().copied())
}

/// Seconds: 1 ms to 2 min, roughly doubling.
const SECONDS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];
/// Placement decisions: 1 us to 10 ms.
const PLACEMENT: &[f64] = &[1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 1e-2];
/// Inter-token gaps: 1 ms to 2 s.
const GAPS: &[f64] = &[0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0];

pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub refusals: Family<ReasonLabels, Counter>,
    pub retries: Counter,
    pub migrations: Counter,
    pub placements: Family<PolicyLabels, Counter>,
    /// How long each placement decision took (score the candidates, choose one).
    pub placement_duration: Histogram,
    pub prompt_tokens: Counter,
    pub predicted_cached_tokens: Counter,
    pub cached_tokens: Counter,
    pub completion_tokens: Counter,
    pub time_to_first_token: Latency,
    pub inter_token_latency: Latency,
    pub request_duration: Latency,
    pub queue_time: Latency,
    pub workers: Gauge,
    pub placeable_workers: Gauge,
    /// Routers live in etcd as this one last counted them (itself included; 0 without etcd).
    pub live_routers: Gauge,
    pub worker_waiting: Family<WorkerLabels, Gauge>,
    pub worker_running: Family<WorkerLabels, Gauge>,
    pub membership_changes: Family<ChangeLabels, Counter>,
    /// Connection attempts to a worker that failed TLS (its certificate or ours refused).
    pub worker_tls_failures: Counter,
    /// Worker answers received on sessions and not yet taken by their requests: what slow
    /// readers hold in this router.
    pub session_buffered: Gauge,
    /// (block, worker) entries in the prefix indexes of every model.
    pub prefix_index_entries: Gauge,
    /// Reported prefix-index entries dropped by the index's memory bound.
    pub prefix_index_trimmed: Counter,
    /// KV block events received from workers (snapshot entries included).
    pub kv_events: Counter,
    /// Each router thread's busy share and HTTP connections (see `shards`), set at scrape time.
    pub shard_busy: Family<ShardLabels, Gauge<f64, AtomicU64>>,
    pub shard_connections: Family<ShardLabels, Gauge>,
    /// Keep-alive connections a saturated thread closed so their clients reconnect elsewhere.
    pub shed_connections: Counter,
    /// The cluster's queue and capacity by model, for autoscalers.
    pub queue: QueueGauges,
}

/// What an autoscaler reads, per model: the work waiting and running at the model's placeable
/// workers (their reports plus this router's requests they do not show yet), how fast it drains,
/// and the capacity serving it. Set at scrape time.
#[derive(Default)]
pub struct QueueGauges {
    pub waiting_requests: Family<ModelLabels, Gauge>,
    pub waiting_tokens: Family<ModelLabels, Gauge>,
    pub running_requests: Family<ModelLabels, Gauge>,
    pub max_running_requests: Family<ModelLabels, Gauge>,
    pub prefill_tokens_per_second: Family<ModelLabels, Gauge<f64, AtomicU64>>,
    pub placeable_workers: Family<ModelLabels, Gauge>,
    /// As the workers last reported them, by class (without this router's unreported requests).
    pub waiting_requests_by_priority: Family<PriorityLabels, Gauge>,
    pub waiting_tokens_by_priority: Family<PriorityLabels, Gauge>,
}

impl QueueGauges {
    fn register(&self, r: &mut Registry) {
        let families = [
            (
                "waiting_requests",
                "Requests waiting for a worker of the model (queued at workers or sent and not yet reported)",
                &self.waiting_requests,
            ),
            (
                "waiting_tokens",
                "Prompt tokens still to prefill of the waiting requests, net of cache hits",
                &self.waiting_tokens,
            ),
            ("running_requests", "Sequences running at the model's placeable workers", &self.running_requests),
            (
                "max_running_requests",
                "Sequences the model's placeable workers can run at once, summed",
                &self.max_running_requests,
            ),
            ("placeable_workers", "Workers of the model that can take work", &self.placeable_workers),
        ];
        for (name, help, family) in families {
            r.register(format!("cluster_{name}"), help, family.clone());
        }
        let by_priority = [
            (
                "waiting_requests",
                "Requests waiting at the model's placeable workers",
                &self.waiting_requests_by_priority,
            ),
            ("waiting_tokens", "Prompt tokens still to prefill of those requests", &self.waiting_tokens_by_priority),
        ];
        for (name, help, family) in by_priority {
            let help = format!("{help}, by priority class, as the workers last reported them");
            r.register(format!("cluster_{name}_by_priority"), help, family.clone());
        }
        r.register(
            "cluster_prefill_tokens_per_second",
            "Recent prefill rate of the model's placeable workers, summed: how fast the waiting tokens drain",
            self.prefill_tokens_per_second.clone(),
        );
    }
}

/// One model's latency histograms, looked up once per request rather than per token.
pub struct Latencies {
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub queue_time: Histogram,
    pub request_duration: Histogram,
}

impl Metrics {
    pub fn latencies(&self, model: &str) -> Latencies {
        let labels = ModelLabels { model: model.to_string() };
        Latencies {
            time_to_first_token: self.time_to_first_token.get_or_create(&labels).clone(),
            inter_token_latency: self.inter_token_latency.get_or_create(&labels).clone(),
            queue_time: self.queue_time.get_or_create(&labels).clone(),
            request_duration: self.request_duration.get_or_create(&labels).clone(),
        }
    }

    /// The router's metrics, plus the per-tenant usage counters.
    pub fn new(usage: &Usage) -> Arc<Self> {
        let mut registry = Registry::with_prefix("bellows_router");
        let m = Metrics {
            requests: Family::default(),
            refusals: Family::default(),
            retries: Counter::default(),
            migrations: Counter::default(),
            placements: Family::default(),
            placement_duration: Histogram::new(PLACEMENT.iter().copied()),
            prompt_tokens: Counter::default(),
            predicted_cached_tokens: Counter::default(),
            cached_tokens: Counter::default(),
            completion_tokens: Counter::default(),
            time_to_first_token: Family::new_with_constructor(seconds),
            inter_token_latency: Family::new_with_constructor(gaps),
            request_duration: Family::new_with_constructor(seconds),
            queue_time: Family::new_with_constructor(seconds),
            workers: Gauge::default(),
            placeable_workers: Gauge::default(),
            live_routers: Gauge::default(),
            worker_waiting: Family::default(),
            worker_running: Family::default(),
            membership_changes: Family::default(),
            worker_tls_failures: Counter::default(),
            session_buffered: Gauge::default(),
            prefix_index_entries: Gauge::default(),
            prefix_index_trimmed: Counter::default(),
            kv_events: Counter::default(),
            shard_busy: Family::default(),
            shard_connections: Family::default(),
            shed_connections: Counter::default(),
            queue: QueueGauges::default(),
            registry: Registry::default(),
        };
        m.register_requests(&mut registry);
        m.register_cluster(&mut registry);
        m.queue.register(&mut registry);
        usage.register(&mut registry);
        Arc::new(Metrics { registry, ..m })
    }

    fn register_requests(&self, r: &mut Registry) {
        r.register("requests", "Requests answered, by endpoint, model and HTTP status", self.requests.clone());
        r.register("refusals", "Requests refused before any worker ran them, by reason", self.refusals.clone());
        r.register("retries", "Worker attempts retried on another worker before the first token", self.retries.clone());
        r.register("migrations", "Streams moved to another worker after their worker failed", self.migrations.clone());
        r.register("placements", "Placement decisions, by policy", self.placements.clone());
        r.register(
            "placement_duration_seconds",
            "Time one placement decision took: score the candidates and choose one",
            self.placement_duration.clone(),
        );
        r.register("prompt_tokens", "Prompt tokens of placed requests", self.prompt_tokens.clone());
        r.register(
            "predicted_cached_tokens",
            "Prompt tokens placement expected the chosen worker to have cached",
            self.predicted_cached_tokens.clone(),
        );
        r.register("cached_tokens", "Prompt tokens workers served from their prefix cache", self.cached_tokens.clone());
        r.register("completion_tokens", "Tokens generated", self.completion_tokens.clone());
        r.register(
            "time_to_first_token_seconds",
            "From the request's arrival to its first token",
            self.time_to_first_token.clone(),
        );
        r.register(
            "inter_token_latency_seconds",
            "Gaps between a streamed answer's token deliveries",
            self.inter_token_latency.clone(),
        );
        r.register("request_duration_seconds", "From arrival to the last token", self.request_duration.clone());
        r.register("queue_time_seconds", "From arrival until a worker accepted the request", self.queue_time.clone());
    }

    fn register_cluster(&self, r: &mut Registry) {
        r.register("workers", "Worker links known (placeable or not)", self.workers.clone());
        r.register(
            "placeable_workers",
            "Workers that can take work (load stream up, not draining)",
            self.placeable_workers.clone(),
        );
        r.register(
            "live_routers",
            "Routers registered in etcd, this one included: each enforces 1/n of every tenant's limits",
            self.live_routers.clone(),
        );
        r.register(
            "worker_waiting_requests",
            "Requests waiting at each worker, as this router sees them",
            self.worker_waiting.clone(),
        );
        r.register(
            "worker_running_requests",
            "Sequences running at each worker, as reported",
            self.worker_running.clone(),
        );
        r.register("membership_changes", "Workers joining and leaving", self.membership_changes.clone());
        r.register(
            "worker_tls_failures",
            "Connection attempts to workers that failed TLS verification (such a worker gets no request)",
            self.worker_tls_failures.clone(),
        );
        r.register(
            "prefix_index_entries",
            "Cached blocks this router believes each worker holds, summed over workers and models",
            self.prefix_index_entries.clone(),
        );
        r.register(
            "prefix_index_trimmed",
            "Reported blocks the prefix index forgot to stay within its memory bound (least recently used first)",
            self.prefix_index_trimmed.clone(),
        );
        r.register(
            "kv_events",
            "KV block events (stored, evicted, and snapshot entries) received from workers",
            self.kv_events.clone(),
        );
        r.register(
            "session_buffered_messages",
            "Worker messages received on session streams and not yet taken by their requests (slow readers)",
            self.session_buffered.clone(),
        );
        r.register(
            "shard_busy_ratio",
            "Each router thread's busy share over the last 100 ms (new connections go to the first under 0.5)",
            self.shard_busy.clone(),
        );
        r.register("shard_connections", "HTTP connections each router thread serves", self.shard_connections.clone());
        r.register(
            "shed_connections",
            "Keep-alive connections closed by a saturated router thread so that their clients reconnect to a calmer one",
            self.shed_connections.clone(),
        );
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}
