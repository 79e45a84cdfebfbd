//! The etcd key schema of a Bellows cluster: where workers register and what they write there.
//!
//! A worker owns one key, `/bellows/<cluster>/workers/<node-id>`, attached to a lease it keeps
//! alive: when the worker dies the lease expires and the key disappears, so a router watching
//! the prefix sees membership without any health polling of its own. The value is a
//! [`WorkerRecord`] in JSON. Everything else a router needs to know about a worker (load, cache)
//! comes from the worker's own WatchLoad stream, not from etcd: etcd carries membership only.
//!
//! Worker and router build keys with these functions only, so the two can never disagree on a
//! prefix (a missing trailing slash would make cluster "a" also list the workers of "ab").

use serde::{Deserialize, Serialize};

/// The root of every Bellows key.
pub const ROOT: &str = "/bellows";

/// Why a cluster name or node id cannot be used in a key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the {what} is empty")]
    Empty { what: &'static str },
    #[error("the {what} {value:?} contains '/' or a control character")]
    BadChar { what: &'static str, value: String },
}

fn check(what: &'static str, value: &str) -> Result<(), KeyError> {
    if value.is_empty() {
        return Err(KeyError::Empty { what });
    }
    if value.chars().any(|c| c == '/' || c.is_control()) {
        return Err(KeyError::BadChar { what, value: value.to_string() });
    }
    Ok(())
}

/// `/bellows/<cluster>/workers/`: list or watch this prefix to see the cluster's workers. Ends
/// with `/`, so one cluster's prefix never matches another's keys.
pub fn workers_prefix(cluster: &str) -> Result<String, KeyError> {
    check("cluster name", cluster)?;
    Ok(format!("{ROOT}/{cluster}/workers/"))
}

/// `/bellows/<cluster>/workers/<node-id>`: the key one worker registers under.
pub fn worker_key(cluster: &str, node_id: &str) -> Result<String, KeyError> {
    check("node id", node_id)?;
    Ok(format!("{}{node_id}", workers_prefix(cluster)?))
}

/// `/bellows/<cluster>/routers/`: routers register here (membership only), so each knows how
/// many share the cluster's per-tenant limits.
pub fn routers_prefix(cluster: &str) -> Result<String, KeyError> {
    check("cluster name", cluster)?;
    Ok(format!("{ROOT}/{cluster}/routers/"))
}

/// `/bellows/<cluster>/routers/<router-id>`.
pub fn router_key(cluster: &str, router_id: &str) -> Result<String, KeyError> {
    check("router id", router_id)?;
    Ok(format!("{}{router_id}", routers_prefix(cluster)?))
}

/// This host's name (for default node and router ids).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// The node id of a key under [`workers_prefix`]; `None` for any other key.
pub fn node_id_of<'k>(cluster: &str, key: &'k str) -> Option<&'k str> {
    let prefix = workers_prefix(cluster).ok()?;
    let id = key.strip_prefix(prefix.as_str())?;
    check("node id", id).ok().map(|_| id)
}

/// What a worker writes under its key (JSON): enough to connect to it and to know which model
/// and prefix-hash geometry it serves before asking it anything.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    /// `host:port` of the worker's gRPC endpoint (plain HTTP/2, no scheme).
    pub address: String,
    /// The served model; also the salt of its prefix-hash chain.
    pub model_id: String,
    /// Tokens per KV block (prefix-hash granularity).
    pub block_size: u32,
    /// The longest prompt + completion one request may use.
    pub context_length: u32,
    /// Sequences the worker runs at once (its `--max-running`).
    pub capacity: u32,
    /// The worker's build version.
    pub version: String,
}

impl WorkerRecord {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a WorkerRecord always serializes")
    }

    pub fn from_json(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_clusters_prefix_never_lists_another_clusters_workers() {
        let a = workers_prefix("a").unwrap();
        let ab_key = worker_key("ab", "n1").unwrap();
        assert!(!ab_key.starts_with(&a));
        assert_eq!(node_id_of("a", &ab_key), None);
        assert_eq!(node_id_of("ab", &ab_key), Some("n1"));
    }

    #[test]
    fn names_that_would_break_the_key_layout_are_refused() {
        assert_eq!(workers_prefix(""), Err(KeyError::Empty { what: "cluster name" }));
        assert!(matches!(worker_key("c", "a/b"), Err(KeyError::BadChar { .. })));
        assert!(matches!(worker_key("c/d", "n"), Err(KeyError::BadChar { .. })));
        assert_eq!(node_id_of("c", "/bellows/c/workers/x/y"), None, "nested keys are not workers");
    }

    #[test]
    fn the_key_layout_is_stable() {
        // Routers and workers of different builds must agree: pin it.
        assert_eq!(worker_key("default", "node-1").unwrap(), "/bellows/default/workers/node-1");
    }

    #[test]
    fn a_record_round_trips_through_json() {
        let r = WorkerRecord {
            address: "10.0.0.1:50051".into(),
            model_id: "m".into(),
            block_size: 16,
            context_length: 8192,
            capacity: 64,
            version: "0.1.0".into(),
        };
        assert_eq!(WorkerRecord::from_json(r.to_json().as_bytes()).unwrap(), r);
    }
}
