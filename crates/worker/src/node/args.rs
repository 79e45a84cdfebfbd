//! `bellows-worker serve` flags. Every flag also reads a `BELLOWS_*` environment variable, so a
//! container or a Helm chart configures a node without a command line.

use std::{net::SocketAddr, time::Duration};

use bellows_common::{
    duration::parse_duration,
    telemetry::LogFormat,
    tls::{EtcdAuthArgs, TlsArgs},
};
use clap::{Args, ValueEnum};

use crate::{engine::EngineConfig, load::ModelArgs, model::sim::SimConfig, scheduler::SchedulerConfig};

/// Which engine serves requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineKind {
    /// A real model from a GGUF file.
    Gguf,
    /// A simulated model: real scheduler and KV cache, no weights, a cost model for step time.
    Sim,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Which engine runs the model: gguf (a model file) or sim (no weights; for tests and
    /// cluster benchmarks).
    #[arg(long, env = "BELLOWS_ENGINE", value_enum, default_value_t = EngineKind::Gguf)]
    pub engine: EngineKind,
    #[command(flatten)]
    pub model: ModelArgs,
    /// The name clients use for this model (`model` in API requests), also the salt of its
    /// prefix-cache hashes: every worker of one model must use the same name [default: the
    /// GGUF file name without `.gguf`; `sim` for the simulated engine].
    #[arg(long, env = "BELLOWS_MODEL_ID")]
    pub model_id: Option<String>,
    /// Settings of the simulated model (--engine sim) as JSON, e.g. '{"base_us":20000}'; fields
    /// not named keep their defaults (vocab_size, context_length, base_us, per_token_us,
    /// per_sequence_us, kv_bytes_per_token, poison_token).
    #[arg(long, env = "BELLOWS_SIM_CONFIG")]
    pub sim_config: Option<String>,
    /// Address the gRPC server listens on (port 0: any free port, logged at start).
    #[arg(long, env = "BELLOWS_LISTEN", default_value = "0.0.0.0:50051")]
    pub listen: SocketAddr,
    /// Address of the Prometheus metrics endpoint, `GET /metrics` (port 0: any free port, logged
    /// at start) [default: 0.0.0.0:9091; when that default cannot be bound the node serves
    /// without metrics and logs a warning, while an address given explicitly must bind].
    #[arg(long, env = "BELLOWS_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// host:port routers use to reach this node [default: the listen address, with this host's
    /// name in place of an unspecified IP such as 0.0.0.0].
    #[arg(long, env = "BELLOWS_ADVERTISE_ADDRESS")]
    pub advertise_address: Option<String>,
    /// etcd endpoints, comma separated (e.g. http://etcd:2379). None: the node does not register.
    #[arg(long, env = "BELLOWS_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    #[command(flatten)]
    pub etcd_auth: EtcdAuthArgs,
    /// Mutual TLS with the routers (docs/security.md).
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Cluster name: the node registers under `/bellows/<cluster>/workers/`.
    #[arg(long, env = "BELLOWS_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// This node's id in the cluster (default: `<hostname>-<port>`).
    #[arg(long, env = "BELLOWS_NODE_ID")]
    pub node_id: Option<String>,
    /// TTL of the etcd lease behind the registration: a node that dies disappears after this
    /// (etcd rounds it up to whole seconds, at least 2 s by default).
    #[arg(long, env = "BELLOWS_LEASE_TTL", default_value = "5s", value_parser = parse_duration)]
    pub lease_ttl: Duration,
    /// On SIGTERM/SIGINT, how long in-flight requests may run before the node exits anyway.
    #[arg(long, env = "BELLOWS_DRAIN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// KV cache budget in MiB [default: 512 on the CPU; on a GPU 80% of the memory free after
    /// loading the model].
    #[arg(long, env = "BELLOWS_KV_CACHE_MB")]
    pub kv_cache_mb: Option<usize>,
    /// Tokens one forward pass may carry (decode tokens plus prefill chunks).
    #[arg(long, env = "BELLOWS_MAX_BATCH_TOKENS", default_value_t = SchedulerConfig::default().max_batch_tokens)]
    pub max_batch_tokens: usize,
    /// Sequences running at once (also the capacity the node registers).
    #[arg(long, env = "BELLOWS_MAX_RUNNING", default_value_t = SchedulerConfig::default().max_running)]
    pub max_running: usize,
    /// Requests that may wait for admission; more are refused at once (RESOURCE_EXHAUSTED).
    #[arg(long, env = "BELLOWS_MAX_WAITING", default_value_t = SchedulerConfig::default().max_waiting)]
    pub max_waiting: usize,
    /// Hold steps that mix prefill with decoding to this multiple of a decode-only step (e.g.
    /// 1.5), adapting the prefill tokens per step: steadier streams, slower long prompts. Off by
    /// default.
    #[arg(long, env = "BELLOWS_ITL_SLOWDOWN")]
    pub itl_slowdown: Option<f64>,
    /// Log format: text or json.
    #[arg(long, env = "BELLOWS_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Log each request's prompt (decoded) with its summary line. Off: prompt text is never
    /// logged.
    #[arg(long, env = "BELLOWS_LOG_PROMPTS")]
    pub log_prompts: bool,
    /// The router <-> worker protocol version to speak (1: Generate only, as an old worker
    /// does; for compatibility tests).
    #[arg(long, hide = true, default_value_t = bellows_proto::PROTOCOL_VERSION,
          value_parser = clap::value_parser!(u32).range(1..=bellows_proto::PROTOCOL_VERSION as i64))]
    pub protocol_version: u32,
}

impl ServeArgs {
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            kv_cache_mb: self.kv_cache_mb,
            scheduler: SchedulerConfig {
                max_batch_tokens: self.max_batch_tokens,
                max_running: self.max_running,
                max_waiting: self.max_waiting,
                itl_slowdown: self.itl_slowdown,
                ..SchedulerConfig::default()
            },
        }
    }

    /// The simulated model's settings: defaults, overridden by the fields `--sim-config` names.
    pub fn sim_config(&self) -> anyhow::Result<SimConfig> {
        let mut merged = serde_json::to_value(SimConfig::default())?;
        if let Some(text) = &self.sim_config {
            let given: serde_json::Value =
                serde_json::from_str(text).map_err(|e| anyhow::anyhow!("--sim-config is not JSON: {e}"))?;
            let serde_json::Value::Object(fields) = given else {
                anyhow::bail!("--sim-config must be a JSON object");
            };
            let base = merged.as_object_mut().expect("SimConfig serializes to an object");
            for (k, v) in fields {
                anyhow::ensure!(base.contains_key(&k), "--sim-config: unknown field {k:?}");
                base.insert(k, v);
            }
        }
        serde_json::from_value(merged).map_err(|e| anyhow::anyhow!("--sim-config: {e}"))
    }

    /// Endpoints actually given (an empty environment variable means none).
    pub fn etcd_endpoints(&self) -> Vec<String> {
        self.etcd_endpoints.iter().map(|e| e.trim().to_string()).filter(|e| !e.is_empty()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_sim_config_keeps_the_other_defaults() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        let cli = Cli::parse_from(["x", "--engine", "sim", "--sim-config", r#"{"base_us": 7}"#]);
        let sim = cli.serve.sim_config().unwrap();
        assert_eq!(sim.base_us, 7);
        assert_eq!(sim.vocab_size, SimConfig::default().vocab_size);
        let bad = Cli::parse_from(["x", "--sim-config", r#"{"base_ms": 7}"#]);
        assert!(bad.serve.sim_config().is_err(), "a misspelt field must not be ignored");
    }
}
