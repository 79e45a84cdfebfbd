//! `bellows-worker fleet`: many real nodes in one process, followed by one router like separate
//! workers, and stopped by one signal with every node draining.

use std::time::Duration;

use bellows_integration::{Process, Router, binary, eventually};
use serde_json::json;

#[tokio::test]
async fn a_fleet_in_one_process_serves_as_that_many_workers_and_stops_on_one_signal() {
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("addresses");
    let args = ["fleet", "--nodes", "40", "--engine", "sim", "--addresses-file", list.to_str().unwrap()];
    let mut fleet = Process::spawn("fleet", binary("bellows-worker"), args.map(String::from).to_vec(), "-".into(), &[]);
    let addresses = eventually("the fleet lists its nodes", Duration::from_secs(30), || async {
        std::fs::read_to_string(&list).ok().filter(|a| a.split(',').count() == 40)
    })
    .await;
    let router = Router::start(&["--workers", addresses.as_str(), "--policy", "round_robin"]).await;
    router.wait_placeable(40).await;
    for _ in 0..40 {
        let (status, _, reply) =
            router.post("/v1/completions", &json!({"model": "sim", "prompt": [1, 2, 3], "max_tokens": 3})).await;
        assert_eq!(status, 200, "{reply}");
    }
    // Each is a worker of its own to the router: 40 links.
    let per_worker = reqwest::get(router.url("/metrics")).await.unwrap().text().await.unwrap();
    let nodes = per_worker.lines().filter(|l| l.starts_with("bellows_router_worker_running_requests{")).count();
    assert_eq!(nodes, 40, "{per_worker}");

    fleet.signal(libc::SIGTERM);
    let status = fleet.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "every node drained and stopped: {status:?}\n{}", fleet.log());
}
