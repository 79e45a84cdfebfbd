//! Membership in etcd, end to end: a real etcd, real `bellows-worker serve` processes (simulated
//! engine: the model is not the point here), and a real etcd client reading what a router would.
//!
//! The properties: a node is listed while it can serve and not after; a crash disappears by
//! lease expiry, a graceful stop at once; and an etcd outage loses nothing the node cannot win
//! back by itself.

mod common;

use std::time::Duration;

use bellows_common::cluster::{WorkerRecord, node_id_of, worker_key, workers_prefix};
use common::{Etcd, Node, eventually, greedy, sim, start_node};
use etcd_client::GetOptions;

/// The nodes registered under `cluster`: (node id, record, lease id).
async fn listed(etcd: &Etcd, cluster: &str) -> Vec<(String, WorkerRecord, i64)> {
    let mut c = etcd.client().await;
    let r = c.get(workers_prefix(cluster).unwrap(), Some(GetOptions::new().with_prefix())).await.unwrap();
    r.kvs()
        .iter()
        .map(|kv| {
            let id = node_id_of(cluster, kv.key_str().unwrap()).expect("only worker keys under the prefix").to_string();
            (id, WorkerRecord::from_json(kv.value()).expect("a worker record"), kv.lease())
        })
        .collect()
}

async fn node_in(etcd: &Etcd, cluster: &str, extra: &[&str]) -> Node {
    let mut args = sim("{}");
    args.extend(["--etcd-endpoints", &etcd.endpoint(), "--cluster", cluster, "--node-id", "n1"].map(String::from));
    args.extend(extra.iter().map(|s| s.to_string()));
    start_node(&args).await
}

async fn wait_listed(etcd: &Etcd, cluster: &str) -> (String, WorkerRecord, i64) {
    eventually("the node to register", Duration::from_secs(20), || async {
        listed(etcd, cluster).await.into_iter().next()
    })
    .await
}

async fn wait_unlisted(etcd: &Etcd, cluster: &str, limit: Duration) {
    eventually("the node's key to disappear", limit, || async { listed(etcd, cluster).await.is_empty().then_some(()) })
        .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_serving_node_is_listed_under_its_cluster_with_what_a_router_needs() {
    let etcd = Etcd::start().await;
    let node = node_in(&etcd, "c1", &["--max-running", "7", "--kv-cache-mb", "1"]).await;
    let (id, record, lease) = wait_listed(&etcd, "c1").await;
    assert_eq!(id, "n1");
    assert_ne!(lease, 0, "the key must hang on a lease, or a crashed node would stay listed");
    let info =
        node.client().await.model_info(bellows_proto::worker::v1::ModelInfoRequest {}).await.unwrap().into_inner();
    assert_eq!((info.kv_cache_bytes, info.device.as_str()), (1 << 20, "sim"), "the KV pool's size and where it lives");
    assert_eq!(
        record,
        WorkerRecord {
            address: node.addr.clone(),
            model_id: info.model_id,
            block_size: info.kv_block_size,
            context_length: info.context_length,
            capacity: 7,
            version: env!("CARGO_PKG_VERSION").to_string(),
        }
    );
    assert_eq!(record.context_length, 1024, "the usable context (1 MiB of simulated KV), not the model's");
    assert!(listed(&etcd, "other").await.is_empty(), "another cluster does not see it");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_node_disappears_when_its_lease_expires() {
    let etcd = Etcd::start().await;
    let node = node_in(&etcd, "crash", &["--lease-ttl", "2s"]).await;
    wait_listed(&etcd, "crash").await;
    node.signal(libc::SIGKILL);
    // Nothing deregisters a SIGKILLed process: only the 2 s lease can remove the key.
    wait_unlisted(&etcd, "crash", Duration::from_secs(15)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gracefully_stopped_node_deregisters_at_once() {
    let etcd = Etcd::start().await;
    // A lease far longer than the wait below: only revocation can explain the key going.
    let mut node = node_in(&etcd, "graceful", &["--lease-ttl", "120s"]).await;
    wait_listed(&etcd, "graceful").await;
    node.signal(libc::SIGTERM);
    wait_unlisted(&etcd, "graceful", Duration::from_secs(10)).await;
    assert_eq!(node.wait_exit(Duration::from_secs(20)).code(), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_keeps_serving_through_an_etcd_outage_and_registers_again() {
    let mut etcd = Etcd::start().await;
    let node = node_in(&etcd, "outage", &["--lease-ttl", "2s"]).await;
    let (_, _, first_lease) = wait_listed(&etcd, "outage").await;

    etcd.kill();
    let mut client = node.client().await;
    let served = common::generate(&mut client, greedy(vec![1, 2, 3], 4)).await.expect("serving without etcd");
    assert_eq!(served.tokens.len(), 4);

    etcd.restart().await;
    // The restarted etcd still holds the old lease for a while; the node must have taken a new
    // one and be keeping it alive.
    let lease = eventually("the node to register on a new lease", Duration::from_secs(30), || async {
        listed(&etcd, "outage").await.into_iter().map(|(_, _, l)| l).find(|&l| l != first_lease)
    })
    .await;
    let mut c = etcd.client().await;
    let ttl = c.lease_time_to_live(lease, None).await.unwrap().ttl();
    assert!(ttl > 0, "the new lease is alive (ttl {ttl})");
    assert_eq!(
        c.get(worker_key("outage", "n1").unwrap(), None).await.unwrap().kvs()[0].lease(),
        lease,
        "the key hangs on the lease that is kept alive"
    );
}
