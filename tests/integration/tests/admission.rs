//! The global queue cap: above `--max-waiting` requests waiting cluster-wide, new requests get
//! an immediate 503 with Retry-After; routers that share no state still share the cap, through
//! what the workers report; a retry storm against the cap is counted in full and logged a line
//! a second.

use std::time::Duration;

use bellows_integration::{Router, Worker, eventually, sim};
use futures_util::{StreamExt, stream};
use serde_json::json;

/// A worker that runs one sequence at a time, 20 ms per step.
async fn one_slot_worker() -> Worker {
    Worker::start(&[&sim(r#"{"base_us": 20000}"#)[..], &["--max-running".into(), "1".into()]].concat()).await
}

/// Start a streaming request that occupies the worker for about `tokens` x 20 ms; returns the
/// open response (dropping it cancels the request).
async fn occupy(router: &Router, tokens: u32) -> reqwest::Response {
    let body = json!({"model": "sim", "prompt": "a b c", "max_tokens": tokens, "stream": true});
    let r = reqwest::Client::new().post(router.url("/v1/completions")).json(&body).send();
    tokio::time::timeout(Duration::from_secs(60), r).await.expect("answers").expect("sends")
}

/// Wait until the router counts `n` requests waiting at its workers.
async fn settled(router: &Router, n: f64) {
    let what = format!("the router to see {n} waiting");
    eventually(&what, Duration::from_secs(10), || async {
        (router.metric("bellows_router_worker_waiting_requests").await == n).then_some(())
    })
    .await
}

/// Queue two short requests behind the one running, each sent once the router's view has
/// settled, so no count is in flight between the router's bookkeeping and the worker's reports.
async fn queue_two(router: &Router) -> Vec<tokio::task::JoinHandle<u16>> {
    settled(router, 0.0).await;
    let mut waiting = Vec::new();
    for n in 1..=2 {
        let url = router.url("/v1/completions");
        waiting.push(tokio::spawn(async move {
            let body = json!({"model": "sim", "prompt": "d e", "max_tokens": 2});
            reqwest::Client::new().post(url).json(&body).send().await.unwrap().status().as_u16()
        }));
        settled(router, f64::from(n)).await;
    }
    waiting
}

#[tokio::test]
async fn the_cap_refuses_with_retry_after_and_admits_again_once_drained() {
    let worker = one_slot_worker().await;
    let router = Router::with_workers(&[&worker], &["--max-waiting", "2"]).await;
    // One request runs (first token seen), two wait behind it: the queue is at its cap.
    let running = occupy(&router, 100).await;
    let waiting = queue_two(&router).await;
    assert_eq!(worker.load().await.waiting_requests, 2);

    let started = std::time::Instant::now();
    let (status, headers, body) =
        router.post("/v1/completions", &json!({"model": "sim", "prompt": "f", "max_tokens": 2})).await;
    let refused_in = started.elapsed();
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "queue_full");
    let retry_after: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry_after));
    assert!(refused_in < Duration::from_secs(1), "a refusal is immediate, not a timeout ({refused_in:?})");
    assert_eq!(router.metric("bellows_router_refusals_total").await, 1.0);

    // Once the running request is gone and the queue drains, requests are admitted again.
    drop(running);
    for w in waiting {
        assert_eq!(w.await.unwrap(), 200, "admitted requests complete");
    }
    eventually("the cap to admit again", Duration::from_secs(10), || async {
        let (status, _, _) =
            router.post("/v1/completions", &json!({"model": "sim", "prompt": "g", "max_tokens": 1})).await;
        (status == 200).then_some(())
    })
    .await;
}

#[tokio::test]
async fn two_routers_share_the_cap_through_the_workers_reports() {
    let worker = one_slot_worker().await;
    let a = Router::with_workers(&[&worker], &["--max-waiting", "2"]).await;
    let b = Router::with_workers(&[&worker], &["--max-waiting", "2"]).await;
    let _running = occupy(&a, 200).await;
    let _waiting = queue_two(&a).await;
    eventually("two requests waiting at the worker", Duration::from_secs(10), || async {
        (worker.load().await.waiting_requests == 2).then_some(())
    })
    .await;
    // Router b sent nothing; it learns of a's queue from the worker's load reports alone.
    settled(&b, 2.0).await;
    let (status, headers, body) =
        b.post("/v1/completions", &json!({"model": "sim", "prompt": "f", "max_tokens": 1})).await;
    assert_eq!(status, 503, "{body}");
    assert!(headers.contains_key("retry-after"));
}

#[tokio::test]
async fn a_storm_of_refusals_is_counted_in_full_and_logged_at_most_a_line_a_second() {
    const STORM: usize = 3000;
    let worker = one_slot_worker().await;
    let router = Router::with_workers(&[&worker], &["--max-waiting", "2"]).await;
    // The queue is full for the next 20 s (1,000 steps of 20 ms), whatever the storm's pace.
    let _running = occupy(&router, 1000).await;
    let _waiting = queue_two(&router).await;
    let started = std::time::Instant::now();
    let body = json!({"model": "sim", "prompt": "f", "max_tokens": 1});
    let refused = stream::iter(0..STORM)
        .map(|_| async { router.post("/v1/completions", &body).await.0 })
        .buffer_unordered(64)
        .filter(|&status| async move { status == 503 })
        .count()
        .await;
    let seconds = started.elapsed().as_secs();
    assert_eq!(refused, STORM);
    assert_eq!(router.metric("bellows_router_refusals_total").await, STORM as f64, "every refusal is counted");
    let log = router.process.log();
    let lines = log.lines().filter(|l| l.contains("request refused")).count() as u64;
    assert!((1..=seconds + 2).contains(&lines), "{lines} refusal lines for {STORM} refusals in {seconds} s:\n{log}");
}
