//! Discovery through a real etcd: workers join and leave the router's view as they register and
//! deregister, a worker registered before the router started is found, the router keeps
//! serving on what it knows while etcd is down, and scaling the workers up and down under load
//! (what an autoscaler does) loses no request.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

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

/// Clients sending requests back to back until `stop`; each returns the statuses it got.
fn clients(router: &Router, n: usize, stop: &Arc<AtomicBool>) -> Vec<tokio::task::JoinHandle<Vec<u16>>> {
    (0..n)
        .map(|c| {
            let (url, stop) = (router.url("/v1/completions"), stop.clone());
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                let mut statuses = Vec::new();
                for i in 0u32.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let body = json!({"model": "sim", "prompt": [1 + c as u32, 2 + i % 500, 3], "max_tokens": 10});
                    statuses.push(http.post(&url).json(&body).send().await.map_or(0, |r| r.status().as_u16()));
                }
                statuses
            })
        })
        .collect()
}

#[tokio::test]
async fn workers_scaled_up_and_down_under_load_lose_no_request_and_new_ones_take_work_at_once() {
    let etcd = Etcd::start().await;
    // 20 ms a step: every request spans ten steps, so requests are in flight through each change.
    let slow = |id: &str| {
        let mut args = sim(r#"{"base_us": 20000}"#);
        args.extend(["--etcd-endpoints", &etcd.endpoint(), "--lease-ttl", "2s", "--node-id", id].map(String::from));
        args
    };
    let mut a = Worker::start(&slow("a")).await;
    let router = Router::start(&["--etcd-endpoints", &etcd.endpoint()]).await;
    wait_placeable(&router, 1.0).await;
    let stop = Arc::new(AtomicBool::new(false));
    let load = clients(&router, 8, &stop);

    // Scale up: each new worker is given work once its load stream is up.
    let (mut b, c) = (Worker::start(&slow("b")).await, Worker::start(&slow("c")).await);
    wait_placeable(&router, 3.0).await;
    for w in [&b, &c] {
        eventually("the new worker to run requests", Duration::from_secs(10), || async {
            (w.load().await.running_requests > 0).then_some(())
        })
        .await;
    }
    // What an autoscaler reads: the model's queue and capacity over its three workers.
    let metric = |name: &'static str| {
        let router = &router;
        async move { router.metric(&format!("bellows_router_cluster_{name}")).await }
    };
    assert_eq!(metric("placeable_workers").await, 3.0);
    assert_eq!(metric("max_running_requests").await, 3.0 * f64::from(c.load().await.max_running));
    eventually("the running requests to show", Duration::from_secs(10), || async {
        (metric("running_requests").await > 0.0).then_some(())
    })
    .await;

    // Scale down to one: the two leaving deregister, finish what they run (the router keeps
    // their sessions for it) and exit.
    for w in [&mut a, &mut b] {
        w.signal(libc::SIGTERM);
    }
    for w in [&mut a, &mut b] {
        assert!(w.wait_exit(Duration::from_secs(30)).success(), "drained and exited");
    }
    wait_placeable(&router, 1.0).await;
    // Their in-flight requests finished on them: none had to move to another worker.
    assert_eq!(router.metric("bellows_router_migrations_total").await, 0.0, "a drained worker's streams migrated");
    let served = router.metric("bellows_router_requests_total").await;
    eventually("more requests on the one worker left", Duration::from_secs(10), || async {
        (router.metric("bellows_router_requests_total").await >= served + 8.0).then_some(())
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let mut statuses = Vec::new();
    for client in load {
        statuses.extend(client.await.unwrap());
    }
    let failed: Vec<&u16> = statuses.iter().filter(|&&s| s != 200).collect();
    assert!(failed.is_empty(), "{} of {} requests failed: {failed:?}", failed.len(), statuses.len());
    drop(c);
}
