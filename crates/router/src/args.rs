//! `bellows-router` flags. Every flag also reads a `BELLOWS_*` environment variable, so a
//! container or a Helm chart configures a router without a command line.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use bellows_common::{duration::parse_duration, telemetry::LogFormat};
use clap::{Parser, ValueEnum};

/// How a request picks its worker among those serving its model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Prefer the worker that already holds the prompt's leading KV blocks, unless its queue
    /// costs more than prefilling elsewhere.
    CacheAware,
    /// Each worker in turn.
    RoundRobin,
    /// The worker with the least queued work.
    LeastLoad,
    /// The less loaded of two workers drawn at random.
    PowerOfTwo,
}

impl PolicyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::LeastLoad => "least_load",
            PolicyKind::PowerOfTwo => "power_of_two",
        }
    }
}

#[derive(Debug, Clone, Parser)]
#[command(name = "bellows-router", version, about = "OpenAI-compatible gateway in front of Bellows workers")]
pub struct RouterArgs {
    /// Address the HTTP API listens on (port 0: any free port, logged at start).
    #[arg(long, env = "BELLOWS_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,
    /// etcd endpoints, comma separated (e.g. http://etcd:2379): workers are discovered by
    /// watching their registrations.
    #[arg(long, env = "BELLOWS_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// Cluster name: workers are found under /bellows/<cluster>/workers/.
    #[arg(long, env = "BELLOWS_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// Static workers (host:port of their gRPC endpoint, comma separated), for a cluster without
    /// etcd. May be combined with etcd.
    #[arg(long, env = "BELLOWS_WORKERS", value_delimiter = ',')]
    pub workers: Vec<String>,
    /// How requests are placed on workers.
    #[arg(long, env = "BELLOWS_POLICY", value_enum, default_value_t = PolicyKind::CacheAware)]
    pub policy: PolicyKind,
    /// Cluster-wide cap on requests waiting for a worker (as reported by workers, plus what this
    /// router sent that their reports do not show yet); above it requests get 503 at once.
    #[arg(long, env = "BELLOWS_MAX_WAITING", default_value_t = 1024)]
    pub max_waiting: usize,
    /// Largest request body accepted; larger ones get 413.
    #[arg(long, env = "BELLOWS_MAX_BODY_BYTES", default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Threads that serve HTTP and talk to workers [default: the number of CPUs]. One thread
    /// cost 17-30% less CPU per request on 2 cores (no hand-offs between threads) and serves
    /// thousands of requests a second: right for a small or shared machine (docs/BENCHMARKS.md).
    #[arg(long, env = "BELLOWS_THREADS", value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
    /// Threads that tokenize prompts (off the async runtime) [default: the number of CPUs].
    #[arg(long, env = "BELLOWS_TOKENIZER_THREADS")]
    pub tokenizer_threads: Option<usize>,
    /// Prompts that may wait for a tokenizer thread; more are refused with 503 (load shedding).
    #[arg(long, env = "BELLOWS_TOKENIZER_QUEUE", default_value_t = 1024)]
    pub tokenizer_queue: usize,
    /// Other workers tried when a worker refuses or fails before the first token.
    #[arg(long, env = "BELLOWS_MAX_RETRIES", default_value_t = 2)]
    pub max_retries: u32,
    /// Times a stream whose worker fails mid-way moves to another worker.
    #[arg(long, env = "BELLOWS_MAX_MIGRATIONS", default_value_t = 2)]
    pub max_migrations: u32,
    /// How long a worker may take to accept a request (open its stream); then the next worker
    /// is tried. Queueing time inside the worker is not limited by this.
    #[arg(long, env = "BELLOWS_WORKER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub worker_timeout: Duration,
    /// How long blocks of a just-placed prompt count as cached on its worker, before the
    /// worker's own KV events confirm them.
    #[arg(long, env = "BELLOWS_PLACEMENT_MEMORY", default_value = "2s", value_parser = parse_duration)]
    pub placement_memory: Duration,
    /// Log format: text or json.
    #[arg(long, env = "BELLOWS_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Tenants and their hashed API keys (YAML; reloaded on change). Given: every request needs
    /// `Authorization: Bearer <key>`, and tenants' limits and fair sharing apply. Not given:
    /// auth is off (a local cluster).
    #[arg(long, env = "BELLOWS_TENANTS_FILE")]
    pub tenants_file: Option<PathBuf>,
    /// File holding the SHA-256 (hex) of the admin key, which unlocks GET /admin/usage.
    #[arg(long, env = "BELLOWS_ADMIN_KEY_FILE")]
    pub admin_key_file: Option<PathBuf>,
    /// With tenants: how long a request may wait in its tenant's queue for room under the
    /// global cap before a 503 (0: no queue, refuse at the cap at once).
    #[arg(long, env = "BELLOWS_FAIR_QUEUE_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub fair_queue_timeout: Duration,
    /// With tenants: requests one tenant may have waiting in this router's queue.
    #[arg(long, env = "BELLOWS_FAIR_QUEUE_DEPTH", default_value_t = 64)]
    pub fair_queue_depth: usize,
    /// This router's id in etcd (routers register so each knows its share of tenant limits)
    /// [default: <hostname>-<port>].
    #[arg(long, env = "BELLOWS_ROUTER_ID")]
    pub router_id: Option<String>,
    /// Record prompt and completion text on trace spans (off: spans never carry text).
    #[arg(long, env = "BELLOWS_TRACE_TEXT")]
    pub trace_text: bool,
}

impl RouterArgs {
    /// Endpoints actually given (an empty environment variable means none).
    pub fn etcd_endpoints(&self) -> Vec<String> {
        non_empty(&self.etcd_endpoints)
    }

    pub fn static_workers(&self) -> Vec<String> {
        non_empty(&self.workers)
    }
}

fn non_empty(items: &[String]) -> Vec<String> {
    items.iter().map(|e| e.trim().to_string()).filter(|e| !e.is_empty()).collect()
}
