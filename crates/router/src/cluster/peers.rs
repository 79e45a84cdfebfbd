//! Routers know how many of them share the cluster: each registers under
//! `/bellows/<cluster>/routers/` with a lease and watches the prefix. A tenant's rate limits are
//! split evenly between the live routers (each enforces `1 / routers` of them), so the cluster
//! as a whole enforces about the configured limit without routers sharing any state. When etcd
//! is unreachable the last known count stays in force.

use std::{collections::HashSet, time::Duration};

pub use bellows_common::cluster::hostname;
use bellows_common::cluster::{router_key, routers_prefix};
use bellows_common::tls::{EtcdAccessError, EtcdOptions};
use etcd_client::{Client, EventType, GetOptions, PutOptions, WatchOptions};

/// Lease of a router's registration: a router that dies stops counting after this.
const LEASE_TTL_SECS: i64 = 5;

/// Register this router and report the number of live routers to `on_count` on every change,
/// forever.
pub async fn share_with_peers(
    endpoints: Vec<String>,
    options: EtcdOptions,
    cluster: String,
    id: String,
    on_count: impl Fn(usize),
) {
    let mut backoff = Duration::from_millis(200);
    loop {
        if let Err(e) = follow(&endpoints, &options, &cluster, &id, &on_count).await {
            let prefix = routers_prefix(&cluster).unwrap_or_default();
            match e.downcast_ref().and_then(|e| EtcdAccessError::of(e, options.user(), &prefix)) {
                Some(refused) => tracing::error!("etcd refuses the router (keeping the last known share): {refused}"),
                None => tracing::warn!("router registration interrupted (keeping the last known share): {e:#}"),
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

async fn follow(
    endpoints: &[String],
    options: &EtcdOptions,
    cluster: &str,
    id: &str,
    on_count: &impl Fn(usize),
) -> anyhow::Result<()> {
    let prefix = routers_prefix(cluster)?;
    let key = router_key(cluster, id)?;
    let mut client = Client::connect(endpoints, Some(options.current())).await?;
    let lease = client.lease_grant(LEASE_TTL_SECS, None).await?.id();
    client.put(key.as_str(), "{}", Some(PutOptions::new().with_lease(lease))).await?;
    let (mut keeper, mut alive) = client.lease_keep_alive(lease).await?;

    let listed = client.get(prefix.as_str(), Some(GetOptions::new().with_prefix().with_keys_only())).await?;
    let revision = listed.header().map(|h| h.revision()).unwrap_or(0);
    let mut routers: HashSet<Vec<u8>> = listed.kvs().iter().map(|kv| kv.key().to_vec()).collect();
    on_count(routers.len());
    tracing::info!(routers = routers.len(), id, "registered with the other routers");
    let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
    let mut watch = client.watch(prefix.as_str(), Some(options)).await?;
    let mut tick = tokio::time::interval(Duration::from_secs(LEASE_TTL_SECS as u64) / 3);
    loop {
        tokio::select! {
            _ = tick.tick() => keeper.keep_alive().await?,
            r = alive.message() => {
                let r = r?.ok_or_else(|| anyhow::anyhow!("lease keep-alive stream ended"))?;
                anyhow::ensure!(r.ttl() > 0, "the router's lease expired");
            }
            w = watch.message() => {
                let w = w?.ok_or_else(|| anyhow::anyhow!("watch stream ended"))?;
                anyhow::ensure!(!w.canceled(), "watch cancelled by etcd");
                for event in w.events() {
                    let Some(kv) = event.kv() else { continue };
                    match event.event_type() {
                        EventType::Put => routers.insert(kv.key().to_vec()),
                        EventType::Delete => routers.remove(kv.key()),
                    };
                }
                on_count(routers.len());
            }
        }
    }
}
