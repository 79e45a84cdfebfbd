//! Usage per tenant and model: requests, prompt, cached and completion tokens, and refusals by
//! reason; exported as Prometheus counters and as JSON for the admin endpoint.
//!
//! One set of counters serves both: the JSON view reads the same atomics the metrics export, so
//! the two never disagree. Labels stay bounded: tenants come from the tenants file, reasons are
//! static strings of closed sets, and model labels are capped ([`MAX_MODEL_LABELS`]; later ones
//! count as `other`) so a client cannot grow the series by inventing model names. Callers should
//! still only pass a model the cluster serves, and `None` before that is known.

use std::{
    collections::{BTreeMap, HashSet},
    sync::Mutex,
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};
use serde_json::{Map, Value, json};

/// Distinct model labels kept; beyond, a model is counted as [`OTHER_MODEL`].
pub const MAX_MODEL_LABELS: usize = 64;
pub const OTHER_MODEL: &str = "other";
/// The label for "not known": no tenant (a refused key), or no model yet.
pub const UNKNOWN: &str = "-";

#[derive(Debug, Clone, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct UsageLabels {
    pub tenant: String,
    pub model: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct RefusalLabels {
    pub tenant: String,
    pub model: String,
    pub reason: &'static str,
}

/// The counters of one tenant and model; cheap to clone and to update (atomics), so a stream
/// holds one and counts its tokens as they come.
#[derive(Debug, Clone, Default)]
pub struct ModelUsage {
    requests: Counter,
    prompt_tokens: Counter,
    cached_tokens: Counter,
    completion_tokens: Counter,
}

impl ModelUsage {
    /// A request admitted, with its prompt (of which `cached_tokens` were in a worker's cache).
    pub fn request(&self, prompt_tokens: u64, cached_tokens: u64) {
        self.requests.inc();
        self.prompt_tokens.inc_by(prompt_tokens);
        self.cached_tokens.inc_by(cached_tokens);
    }

    /// Prompt tokens a worker reported cached after admission (when known only then).
    pub fn cached(&self, tokens: u64) {
        self.cached_tokens.inc_by(tokens);
    }

    /// Completion tokens produced since the last call.
    pub fn completion(&self, tokens: u64) {
        self.completion_tokens.inc_by(tokens);
    }
}

#[derive(Debug, Default)]
pub struct Usage {
    requests: Family<UsageLabels, Counter>,
    prompt_tokens: Family<UsageLabels, Counter>,
    cached_tokens: Family<UsageLabels, Counter>,
    completion_tokens: Family<UsageLabels, Counter>,
    refusals: Family<RefusalLabels, Counter>,
    /// The same counters, indexed for the JSON view (a Family cannot be iterated).
    rows: Mutex<BTreeMap<UsageLabels, ModelUsage>>,
    refusal_rows: Mutex<BTreeMap<RefusalLabels, Counter>>,
    models: Mutex<HashSet<String>>,
}

impl Usage {
    pub fn new() -> Self {
        Self::default()
    }

    /// Register the counters (`tenant_*_total`) in the router's registry.
    pub fn register(&self, registry: &mut Registry) {
        registry.register("tenant_requests", "Requests admitted, by tenant and model", self.requests.clone());
        registry.register(
            "tenant_prompt_tokens",
            "Prompt tokens of admitted requests, by tenant and model",
            self.prompt_tokens.clone(),
        );
        registry.register(
            "tenant_cached_tokens",
            "Prompt tokens found in a worker's prefix cache, by tenant and model",
            self.cached_tokens.clone(),
        );
        registry.register(
            "tenant_completion_tokens",
            "Completion tokens produced, by tenant and model",
            self.completion_tokens.clone(),
        );
        registry.register(
            "tenant_refusals",
            "Requests refused, by tenant (- when the key was refused), model (- when not known yet) and reason",
            self.refusals.clone(),
        );
    }

    /// The model label for `model`: itself while fewer than [`MAX_MODEL_LABELS`] are known.
    fn model_label(&self, model: Option<&str>) -> String {
        let Some(model) = model else { return UNKNOWN.to_string() };
        let mut models = self.models.lock().expect("usage lock");
        if models.contains(model) {
            return model.to_string();
        }
        if models.len() < MAX_MODEL_LABELS {
            models.insert(model.to_string());
            return model.to_string();
        }
        OTHER_MODEL.to_string()
    }

    /// The counters of `tenant` and `model`.
    pub fn model(&self, tenant: &str, model: &str) -> ModelUsage {
        let labels = UsageLabels { tenant: tenant.to_string(), model: self.model_label(Some(model)) };
        let mut rows = self.rows.lock().expect("usage lock");
        if let Some(row) = rows.get(&labels) {
            return row.clone();
        }
        let row = ModelUsage {
            requests: self.requests.get_or_create(&labels).clone(),
            prompt_tokens: self.prompt_tokens.get_or_create(&labels).clone(),
            cached_tokens: self.cached_tokens.get_or_create(&labels).clone(),
            completion_tokens: self.completion_tokens.get_or_create(&labels).clone(),
        };
        rows.insert(labels, row.clone());
        row
    }

    /// A refusal: `tenant` `None` when the key itself was refused, `model` `None` when the
    /// request's model is not known (or not served); `reason` from a closed set (the `reason()`
    /// of the limit and queue errors, `unauthorized`, the router's overload reasons).
    pub fn refused(&self, tenant: Option<&str>, model: Option<&str>, reason: &'static str) {
        let labels =
            RefusalLabels { tenant: tenant.unwrap_or(UNKNOWN).to_string(), model: self.model_label(model), reason };
        let mut rows = self.refusal_rows.lock().expect("usage lock");
        if let Some(counter) = rows.get(&labels) {
            counter.inc();
            return;
        }
        let counter = self.refusals.get_or_create(&labels).clone();
        counter.inc();
        rows.insert(labels, counter);
    }

    /// Everything, for the admin endpoint: per tenant its totals and refusals by reason, and
    /// the same per model:
    /// `{"tenants": {name: {"requests", "prompt_tokens", "cached_tokens", "completion_tokens",
    /// "refusals": {reason: n}, "models": {model: {the same but models}}}}}`.
    pub fn snapshot_json(&self) -> Value {
        let mut tenants: BTreeMap<String, (Counts, BTreeMap<String, Counts>)> = BTreeMap::new();
        for (labels, row) in self.rows.lock().expect("usage lock").iter() {
            let values =
                [row.requests.get(), row.prompt_tokens.get(), row.cached_tokens.get(), row.completion_tokens.get()];
            let (total, models) = tenants.entry(labels.tenant.clone()).or_default();
            let model = models.entry(labels.model.clone()).or_default();
            for (i, n) in values.into_iter().enumerate() {
                total.values[i] += n;
                model.values[i] += n;
            }
        }
        for (labels, counter) in self.refusal_rows.lock().expect("usage lock").iter() {
            let n = counter.get();
            let (total, models) = tenants.entry(labels.tenant.clone()).or_default();
            *total.refusals.entry(labels.reason).or_default() += n;
            *models.entry(labels.model.clone()).or_default().refusals.entry(labels.reason).or_default() += n;
        }
        let tenants: Map<String, Value> = tenants
            .into_iter()
            .map(|(name, (total, models))| {
                let mut t = total.to_json();
                let models: Map<String, Value> =
                    models.into_iter().map(|(model, counts)| (model, Value::Object(counts.to_json()))).collect();
                t.insert("models".into(), Value::Object(models));
                (name, Value::Object(t))
            })
            .collect();
        json!({ "tenants": tenants })
    }
}

#[derive(Default)]
struct Counts {
    /// requests, prompt_tokens, cached_tokens, completion_tokens
    values: [u64; 4],
    refusals: BTreeMap<&'static str, u64>,
}

impl Counts {
    fn to_json(&self) -> Map<String, Value> {
        let mut m: Map<String, Value> = ["requests", "prompt_tokens", "cached_tokens", "completion_tokens"]
            .iter()
            .zip(self.values)
            .map(|(k, n)| (k.to_string(), json!(n)))
            .collect();
        m.insert("refusals".into(), json!(self.refusals));
        m
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::text::encode;

    use super::*;

    #[test]
    fn the_same_counts_reach_the_metrics_and_the_json() {
        let usage = Usage::new();
        let mut registry = Registry::with_prefix("bellows_router");
        usage.register(&mut registry);
        let a = usage.model("team-a", "m1");
        a.request(100, 40);
        a.completion(7);
        a.completion(5);
        usage.model("team-a", "m1").request(10, 0);
        usage.model("team-b", "m2").request(1, 1);
        usage.refused(Some("team-a"), Some("m1"), "tokens");
        usage.refused(Some("team-a"), None, "tokens");
        usage.refused(None, None, "unauthorized");

        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        for line in [
            "bellows_router_tenant_requests_total{tenant=\"team-a\",model=\"m1\"} 2",
            "bellows_router_tenant_prompt_tokens_total{tenant=\"team-a\",model=\"m1\"} 110",
            "bellows_router_tenant_cached_tokens_total{tenant=\"team-a\",model=\"m1\"} 40",
            "bellows_router_tenant_completion_tokens_total{tenant=\"team-a\",model=\"m1\"} 12",
            "bellows_router_tenant_refusals_total{tenant=\"team-a\",model=\"m1\",reason=\"tokens\"} 1",
            "bellows_router_tenant_refusals_total{tenant=\"-\",model=\"-\",reason=\"unauthorized\"} 1",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }

        let json = usage.snapshot_json();
        let a = &json["tenants"]["team-a"];
        assert_eq!(a["requests"], 2);
        assert_eq!(a["prompt_tokens"], 110);
        assert_eq!(a["completion_tokens"], 12);
        assert_eq!(a["refusals"]["tokens"], 2);
        assert_eq!(a["models"]["m1"]["cached_tokens"], 40);
        assert_eq!(a["models"]["m1"]["refusals"]["tokens"], 1);
        assert_eq!(a["models"]["-"]["refusals"]["tokens"], 1);
        assert_eq!(json["tenants"]["team-b"]["models"]["m2"]["requests"], 1);
        assert_eq!(json["tenants"]["-"]["refusals"]["unauthorized"], 1);
    }

    #[test]
    fn model_labels_are_bounded() {
        let usage = Usage::new();
        for i in 0..MAX_MODEL_LABELS + 10 {
            usage.refused(Some("t"), Some(&format!("made-up-{i}")), "model_not_allowed");
        }
        let json = usage.snapshot_json();
        let models = json["tenants"]["t"]["models"].as_object().unwrap();
        assert_eq!(models.len(), MAX_MODEL_LABELS + 1);
        assert_eq!(models[OTHER_MODEL]["refusals"]["model_not_allowed"], 10);
    }
}
