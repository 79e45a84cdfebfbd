//! Where the cluster's membership comes from: a static list, or etcd.
//!
//! etcd: list the workers prefix, then watch it from the revision right after the list, so no
//! join or leave between the two is missed. When etcd is unreachable the router keeps serving
//! on the membership it last saw (workers that die meanwhile still drop out, through their
//! broken load streams) and re-lists once etcd is back, reconciling what changed.

use std::{collections::HashMap, sync::Arc, time::Duration};

use bellows_common::cluster::{WorkerRecord, node_id_of, workers_prefix};
use bellows_common::tls::{EtcdAccessError, EtcdOptions};
use etcd_client::{Client, EventType, GetOptions, WatchOptions};

use super::Cluster;

/// Node ids of statically configured workers start with this, so an etcd re-list never
/// removes them.
pub(super) const STATIC_PREFIX: &str = "static:";

/// Join the `--workers` list.
pub fn join_static(cluster: &Arc<Cluster>, addresses: &[String]) {
    for address in addresses {
        cluster.join(&format!("{STATIC_PREFIX}{address}"), address);
    }
}

/// Follow the workers registered in etcd, forever.
pub async fn follow_etcd(cluster: Arc<Cluster>, endpoints: Vec<String>, options: EtcdOptions, cluster_name: String) {
    let prefix = match workers_prefix(&cluster_name) {
        Ok(p) => p,
        Err(e) => {
            tracing::error!("cannot watch etcd: {e}");
            return;
        }
    };
    let mut backoff = Duration::from_millis(100);
    loop {
        match watch_once(&cluster, &endpoints, &options, &cluster_name, &prefix).await {
            Ok(()) => backoff = Duration::from_millis(100),
            Err(e) => {
                match e.downcast_ref().and_then(|e| EtcdAccessError::of(e, options.user(), &prefix)) {
                    // Checked at start; refused now (a rotated password etcd does not know yet):
                    // said as what it is, and retried with the password file read again.
                    Some(refused) => {
                        tracing::error!("etcd refuses the router (serving on the last known workers): {refused}")
                    }
                    None => tracing::warn!("etcd watch interrupted (serving on the last known workers): {e:#}"),
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
        tokio::time::sleep(backoff).await;
    }
}

async fn watch_once(
    cluster: &Arc<Cluster>,
    endpoints: &[String],
    options: &EtcdOptions,
    name: &str,
    prefix: &str,
) -> anyhow::Result<()> {
    let mut client = Client::connect(endpoints, Some(options.current())).await?;
    let listed = client.get(prefix, Some(GetOptions::new().with_prefix())).await?;
    let revision = listed.header().map(|h| h.revision()).unwrap_or(0);
    let mut members = HashMap::new();
    for kv in listed.kvs() {
        if let Some((id, record)) = parse(name, kv.key(), kv.value()) {
            members.insert(id, record.address);
        }
    }
    for id in cluster.node_ids() {
        if !id.starts_with(STATIC_PREFIX) && !members.contains_key(&id) {
            cluster.leave(&id);
        }
    }
    for (id, address) in &members {
        cluster.join(id, address);
    }
    tracing::info!(workers = members.len(), revision, "etcd membership listed; watching");

    let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
    let mut stream = client.watch(prefix, Some(options)).await?;
    while let Some(resp) = stream.message().await? {
        if resp.canceled() {
            anyhow::bail!("watch cancelled by etcd: {}", resp.cancel_reason());
        }
        for event in resp.events() {
            let Some(kv) = event.kv() else { continue };
            match event.event_type() {
                EventType::Put => {
                    if let Some((id, record)) = parse(name, kv.key(), kv.value()) {
                        cluster.join(&id, &record.address);
                    }
                }
                EventType::Delete => {
                    if let Some(id) = std::str::from_utf8(kv.key()).ok().and_then(|k| node_id_of(name, k)) {
                        cluster.leave(id);
                    }
                }
            }
        }
    }
    anyhow::bail!("watch stream ended")
}

fn parse(cluster: &str, key: &[u8], value: &[u8]) -> Option<(String, WorkerRecord)> {
    let key = std::str::from_utf8(key).ok()?;
    let id = node_id_of(cluster, key)?;
    match WorkerRecord::from_json(value) {
        Ok(record) => Some((id.to_string(), record)),
        Err(e) => {
            tracing::warn!(key, "ignoring a worker record that is not valid JSON: {e}");
            None
        }
    }
}
