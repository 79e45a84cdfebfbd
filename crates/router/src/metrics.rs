//! The router's Prometheus metrics (`GET /metrics`). Label sets are bounded: endpoints, status
//! codes, reasons and policies are closed sets, and a model label only ever names a model the
//! cluster serves.

use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

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

pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub refusals: Family<ReasonLabels, Counter>,
    pub retries: Counter,
    pub migrations: Counter,
    pub placements: Family<PolicyLabels, Counter>,
    pub prompt_tokens: Counter,
    pub predicted_cached_tokens: Counter,
    pub cached_tokens: Counter,
    pub completion_tokens: Counter,
    pub workers: Gauge,
    pub placeable_workers: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("bellows_router");
        let m = Metrics {
            requests: Family::default(),
            refusals: Family::default(),
            retries: Counter::default(),
            migrations: Counter::default(),
            placements: Family::default(),
            prompt_tokens: Counter::default(),
            predicted_cached_tokens: Counter::default(),
            cached_tokens: Counter::default(),
            completion_tokens: Counter::default(),
            workers: Gauge::default(),
            placeable_workers: Gauge::default(),
            registry: Registry::default(),
        };
        registry.register("requests", "Requests answered, by endpoint, model and HTTP status", m.requests.clone());
        registry.register("refusals", "Requests refused for lack of capacity, by reason", m.refusals.clone());
        registry.register(
            "retries",
            "Worker attempts retried on another worker before the first token",
            m.retries.clone(),
        );
        registry.register(
            "migrations",
            "Streams moved to another worker after their worker failed",
            m.migrations.clone(),
        );
        registry.register("placements", "Placement decisions, by policy", m.placements.clone());
        registry.register("prompt_tokens", "Prompt tokens of placed requests", m.prompt_tokens.clone());
        registry.register(
            "predicted_cached_tokens",
            "Prompt tokens placement expected the chosen worker to have cached",
            m.predicted_cached_tokens.clone(),
        );
        registry.register(
            "cached_tokens",
            "Prompt tokens workers served from their prefix cache",
            m.cached_tokens.clone(),
        );
        registry.register("completion_tokens", "Tokens generated", m.completion_tokens.clone());
        registry.register("workers", "Worker links known (placeable or not)", m.workers.clone());
        registry.register(
            "placeable_workers",
            "Workers that can take work (load stream up, not draining)",
            m.placeable_workers.clone(),
        );
        Metrics { registry, ..m }
    }
}

impl Metrics {
    pub fn encode(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}
