//! `bellows-worker fleet`: 1,000 real nodes in one process, registered in a real etcd and
//! followed by one router like separate workers: every link comes up and stays up under load,
//! every request completes, placement spreads prompts over the fleet while keeping each prefix
//! together, and one signal stops every node, each draining and deregistering.

use std::time::Duration;

use bellows_integration::{Etcd, Process, Router, binary, eventually};
use bellows_proto::worker::v1::{self as pb, worker_client::WorkerClient};
use futures_util::{StreamExt, stream};
use serde_json::json;

const NODES: usize = 1000;
const TENANTS: u32 = 200;
const ROUNDS: u32 = 3;

/// Tenant `t`'s shared 160-token prefix (ten 16-token blocks, past the home block), then
/// `own` tokens of the request's own.
fn prompt(t: u32, own: u32) -> Vec<u32> {
    let mut x = t.wrapping_mul(2_654_435_761).wrapping_add(1);
    let mut next = move || {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        1 + (x >> 8) % 1000
    };
    let shared: Vec<u32> = (0..160).map(|_| next()).collect();
    shared.into_iter().chain((0..8).map(|i| 1 + (own * 8 + i) % 1000)).collect()
}

/// How many of the fleet's nodes hold cached blocks: each node's first load-stream message
/// carries a snapshot of what it has cached.
async fn nodes_holding_blocks(addresses: &[String]) -> usize {
    let holds = |address: String| async move {
        let mut client = WorkerClient::connect(format!("http://{address}")).await.expect("the node answers");
        let mut load = client.watch_load(pb::WatchLoadRequest {}).await.expect("load stream").into_inner();
        let first = load.message().await.expect("a report").expect("a first message");
        first.kv_snapshot.is_some_and(|s| !s.block_hashes.is_empty())
    };
    stream::iter(addresses.iter().cloned()).map(holds).buffer_unordered(32).filter(|&h| async move { h }).count().await
}

#[tokio::test]
async fn a_router_follows_1000_fleet_nodes_through_etcd_and_spreads_prefixes_over_them() {
    let etcd = Etcd::start().await;
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("addresses");
    let nodes = NODES.to_string();
    let args = [
        "fleet",
        "--nodes",
        &nodes,
        "--engine",
        "sim",
        "--etcd-endpoints",
        &etcd.endpoint(),
        "--addresses-file",
        list.to_str().unwrap(),
    ];
    let mut fleet = Process::spawn("fleet", binary("bellows-worker"), args.map(String::from).to_vec(), "-".into(), &[]);
    let addresses: Vec<String> = eventually("the fleet lists its nodes", Duration::from_secs(60), || async {
        let text = std::fs::read_to_string(&list).ok()?;
        let addresses: Vec<String> = text.trim().split(',').map(String::from).collect();
        (addresses.len() == NODES).then_some(addresses)
    })
    .await;
    let router = Router::start(&["--etcd-endpoints", &etcd.endpoint()]).await;
    router.wait_placeable(NODES).await;

    // Every tenant's prompt ROUNDS times, 32 at a time: later rounds find their prefix cached.
    let requests = (0..ROUNDS).flat_map(|round| (0..TENANTS).map(move |t| (round, t)));
    let answers: Vec<(u32, u16, serde_json::Value)> = stream::iter(requests)
        .map(|(round, t)| {
            let router = &router;
            async move {
                let body = json!({"model": "sim", "prompt": prompt(t, round), "max_tokens": 4});
                let (status, _, reply) = router.post("/v1/completions", &body).await;
                (round, status, reply)
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    for (_, status, reply) in &answers {
        assert_eq!(*status, 200, "{reply}");
    }
    let cached = |r: &serde_json::Value| r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    let repeats: Vec<u64> = answers.iter().filter(|(round, _, _)| *round > 0).map(|(_, _, r)| cached(r)).collect();
    let hits = repeats.iter().filter(|&&c| c >= 128).count();
    assert!(hits * 10 >= repeats.len() * 9, "{hits} of {} repeated prefixes found cached", repeats.len());

    // 200 prefixes over 1,000 nodes land on about 180 distinct ones at random; far fewer means
    // placement piles on a few, and prefixes split across nodes would show as hits missed.
    let used = nodes_holding_blocks(&addresses).await;
    assert!(used >= 120, "only {used} of {NODES} nodes were given work");
    assert_eq!(router.metric("bellows_router_placeable_workers").await, NODES as f64, "every link stayed up");
    let log = router.process.log();
    assert!(!log.contains("worker link down"), "a link went down under load:\n{log}");

    // One signal: every node drains, deregisters and the process exits cleanly.
    fleet.signal(libc::SIGTERM);
    let status = fleet.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "every node drained and stopped: {status:?}\n{}", fleet.log());
    router.wait_placeable(0).await;
}
