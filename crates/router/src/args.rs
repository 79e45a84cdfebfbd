//! `bellows-router` flags. Every flag also reads a `BELLOWS_*` environment variable, so a
//! container or a Helm chart configures a router without a command line.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use bellows_common::{
    duration::parse_duration,
    telemetry::LogFormat,
    tls::{EtcdAuthArgs, HttpTlsArgs, TlsArgs},
};
use clap::Parser;

use crate::placement::PolicyKind;

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
    /// Cluster name: workers are found under `/bellows/<cluster>/workers/`.
    #[arg(long, env = "BELLOWS_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// Static workers (`host:port` or `http://host:port` of their gRPC endpoint, comma separated),
    /// for a cluster without etcd. May be combined with etcd. A malformed entry is refused at start.
    #[arg(long, env = "BELLOWS_WORKERS", value_delimiter = ',', value_parser = parse_worker_address)]
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
    /// How long a stored response (`/v1/responses` with `store: true`) can be read or continued
    /// (30 days, as OpenAI keeps them).
    #[arg(long, env = "BELLOWS_RESPONSES_TTL", default_value = "720h", value_parser = parse_duration)]
    pub responses_ttl: Duration,
    /// Bytes of stored responses kept (in this router's memory, or in the shared database);
    /// the oldest go first.
    #[arg(long, env = "BELLOWS_RESPONSES_MAX_BYTES", default_value_t = 256 << 20)]
    pub responses_max_bytes: usize,
    /// PostgreSQL that stores responses for every router replica
    /// (`postgres://user@host:5432/database`) [default: this router's memory, for one router].
    #[arg(long, env = "BELLOWS_RESPONSES_STORE_URL")]
    pub responses_store_url: Option<String>,
    /// File holding the database user's password (a trailing newline is ignored).
    #[arg(long, env = "BELLOWS_RESPONSES_STORE_PASSWORD_FILE", requires = "responses_store_url")]
    pub responses_store_password_file: Option<PathBuf>,
    /// How long one call to the database may take, connecting included; then the call fails
    /// (a request that only writes its response still succeeds).
    #[arg(long, env = "BELLOWS_RESPONSES_STORE_TIMEOUT", default_value = "2s", value_parser = parse_duration)]
    pub responses_store_timeout: Duration,
    /// How often the database's expired and oldest-past-the-bound responses are dropped.
    #[arg(long, env = "BELLOWS_RESPONSES_SWEEP_INTERVAL", default_value = "60s", value_parser = parse_duration)]
    pub responses_sweep_interval: Duration,
    /// Threads that serve HTTP and talk to workers, each with its own share of the connections
    /// and its own stream to each worker [default: the number of CPUs]. Connections fill the
    /// threads in order (the next thread takes them once one is half busy), so a light load
    /// runs on few threads. One thread serves thousands of requests a second (docs/BENCHMARKS.md).
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
    /// Cached blocks the prefix index remembers at most, over every worker (each worker gets an
    /// equal share, and past it its least recently used blocks are forgotten first).
    #[arg(long, env = "BELLOWS_PREFIX_INDEX_ENTRIES", default_value_t = 1_500_000)]
    pub prefix_index_entries: usize,
    #[command(flatten)]
    pub etcd_auth: EtcdAuthArgs,
    /// Mutual TLS with the workers (docs/security.md).
    #[command(flatten)]
    pub tls: TlsArgs,
    /// TLS on the HTTP listener (docs/security.md).
    #[command(flatten)]
    pub http_tls: HttpTlsArgs,
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
    /// (default: `<hostname>-<port>`).
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

    /// How many shards serve requests (see [`crate::shards`]).
    pub fn shard_count(&self) -> usize {
        self.threads.map_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()), usize::from)
    }

    pub fn static_workers(&self) -> Vec<String> {
        non_empty(&self.workers)
    }
}

/// A worker's gRPC address as `host:port`, from `host:port` or `http://host:port` (what every
/// peer router takes). Refused: another scheme, a path, a missing host, a port that is not 1-65535.
/// Empty stays empty (an unset environment variable), and is dropped later.
fn parse_worker_address(raw: &str) -> Result<String, String> {
    let raw = raw.trim();
    if raw.is_empty() {
        return Ok(String::new());
    }
    let rest = match raw.split_once("://") {
        Some(("http", rest)) => rest,
        Some((scheme, _)) => {
            return Err(format!("{raw:?}: only http:// worker addresses are supported, not {scheme}://"));
        }
        None => raw,
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('/') {
        return Err(format!("{raw:?}: a worker address is host:port, without a path"));
    }
    let Some((host, port)) = rest.rsplit_once(':') else {
        return Err(format!("{raw:?}: a worker address is host:port (the port is missing)"));
    };
    if host.is_empty() || host.contains(char::is_whitespace) {
        return Err(format!("{raw:?}: the host is missing or malformed"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(format!("{host}:{p}")),
        _ => Err(format!("{raw:?}: the port must be a number from 1 to 65535")),
    }
}

fn non_empty(items: &[String]) -> Vec<String> {
    items.iter().map(|e| e.trim().to_string()).filter(|e| !e.is_empty()).collect()
}

#[cfg(test)]
mod tests {
    use super::parse_worker_address;

    #[test]
    fn worker_addresses_take_an_http_url_or_host_port_and_refuse_the_malformed_at_start() {
        assert_eq!(parse_worker_address("http://10.0.0.5:50051").as_deref(), Ok("10.0.0.5:50051"));
        assert_eq!(parse_worker_address("http://worker-0:50051/").as_deref(), Ok("worker-0:50051"));
        assert_eq!(parse_worker_address(" worker-0:50051 ").as_deref(), Ok("worker-0:50051"));
        assert_eq!(parse_worker_address("[::1]:50051").as_deref(), Ok("[::1]:50051"));
        assert_eq!(parse_worker_address("").as_deref(), Ok(""));
        for bad in ["https://w:1", "w", "w:0", "w:99999", ":50051", "http://w:1/v1", "grpc://w:1"] {
            let e = parse_worker_address(bad).expect_err(bad);
            assert!(e.contains(bad), "{bad}: the message names the entry: {e}");
        }
    }

    #[test]
    fn a_malformed_worker_list_stops_the_router_before_it_starts() {
        use clap::Parser;
        let e = super::RouterArgs::try_parse_from(["bellows-router", "--workers", "127.0.0.1:1,nope"]).unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
        let ok = super::RouterArgs::try_parse_from(["bellows-router", "--workers", "http://127.0.0.1:1,127.0.0.1:2"])
            .unwrap();
        assert_eq!(ok.static_workers(), ["127.0.0.1:1", "127.0.0.1:2"]);
    }

    #[test]
    fn the_http_listeners_certificate_and_the_clusters_are_separate_flags() {
        use clap::Parser;
        let args = super::RouterArgs::try_parse_from([
            "bellows-router",
            "--http-tls-cert",
            "/edge.pem",
            "--http-tls-key",
            "/edge-key.pem",
            "--tls-cert",
            "/cluster.pem",
        ])
        .unwrap();
        assert_eq!(args.http_tls.http_cert.as_deref(), Some(std::path::Path::new("/edge.pem")));
        assert_eq!(args.http_tls.http_key.as_deref(), Some(std::path::Path::new("/edge-key.pem")));
        assert_eq!(args.tls.cert.as_deref(), Some(std::path::Path::new("/cluster.pem")));
        assert_eq!(args.tls.key, None);
    }
}
