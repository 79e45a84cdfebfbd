//! Discovery through a real etcd: workers join and leave the router's view as they register and
//! deregister, a worker registered before the router started is found, and the router keeps
//! serving on what it knows while etcd is down.

use std::time::Duration;

use bellows_integration::{Etcd, Router, Worker, eventually, sim};
use serde_json::json;

fn registered(etcd: &Etcd, extra: &[&str]) -> Vec<String> {
    let mut args = sim("{}");
    args.extend(["--etcd-endpoints".into(), etcd.endpoint(), "--lease-ttl".into(), "2s".into()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

async fn wait_placeable(router: &Router, n: f64) {
    eventually(&format!("{n} placeable workers"), Duration::from_secs(20), || async {
        (router.metric("bellows_router_placeable_workers").await == n).then_some(())
    })
    .await;
}

async fn completes(router: &Router) -> bool {
    let (status, _, _) = router.post("/v1/completions", &json!({"model": "sim", "prompt": "x", "max_tokens": 2})).await;
    status == 200
}

#[tokio::test]
async fn workers_join_and_leave_through_etcd() {
    let etcd = Etcd::start().await;
    // Registered before the router starts: found by the initial list.
    let early = Worker::start(&registered(&etcd, &["--node-id", "early"])).await;
    let router = Router::start(&["--etcd-endpoints", &etcd.endpoint()]).await;
    wait_placeable(&router, 1.0).await;
    assert!(completes(&router).await);

    // Joins later: seen through the watch.
    let mut late = Worker::start(&registered(&etcd, &["--node-id", "late"])).await;
    wait_placeable(&router, 2.0).await;

    // SIGTERM: the worker deregisters (drain) and the router stops using it.
    late.signal(libc::SIGTERM);
    late.wait_exit(Duration::from_secs(30));
    wait_placeable(&router, 1.0).await;
    assert!(completes(&router).await);
    assert_eq!(router.metric("bellows_router_workers").await, 1.0, "the link itself is gone");
    drop(early);
}

#[tokio::test]
async fn the_router_keeps_serving_while_etcd_is_down_and_catches_up_after() {
    let mut etcd = Etcd::start().await;
    let _a = Worker::start(&registered(&etcd, &["--node-id", "a"])).await;
    let router = Router::start(&["--etcd-endpoints", &etcd.endpoint()]).await;
    wait_placeable(&router, 1.0).await;

    etcd.kill();
    for _ in 0..3 {
        assert!(completes(&router).await, "serving on the last known membership");
    }
    etcd.restart().await;
    // A worker that registers once etcd is back is picked up by the re-list or the watch.
    let _b = Worker::start(&registered(&etcd, &["--node-id", "b"])).await;
    wait_placeable(&router, 2.0).await;
    assert!(completes(&router).await);
}
