//! Priority classes over real HTTP and gRPC: the class a request names (or its tenant's
//! default) reaches the worker, which serves it ahead of lower classes; a tenant may name only
//! the classes it is allowed.

use std::time::Duration;

use bellows_integration::{Router, Worker, eventually, sim};
use serde_json::{Value, json};
use tempfile::TempDir;

/// sha256("key-a").
const KEY_A: &str = "f10f781241e2246678b6b45c857069208152a53863e47fac33f607ab405006f4";

async fn complete(url: &str, key: Option<&str>, body: Value) -> (u16, Value) {
    let mut r = reqwest::Client::new().post(url).json(&body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let r = r.send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// `bellows_router_cluster_waiting_requests_by_priority` for one class of the sim model.
async fn waiting_by_priority(router: &Router, class: &str) -> f64 {
    let text = reqwest::get(router.url("/metrics")).await.unwrap().text().await.unwrap();
    let series = format!(r#"bellows_router_cluster_waiting_requests_by_priority{{model="sim",priority="{class}"}} "#);
    text.lines().find_map(|l| l.strip_prefix(&series)?.parse().ok()).unwrap_or(f64::NAN)
}

#[tokio::test]
async fn a_tenant_naming_a_class_it_may_not_use_is_refused_with_403_and_auto_means_its_default() {
    let dir = TempDir::new().unwrap();
    let tenants = dir.path().join("tenants.yaml");
    std::fs::write(
        &tenants,
        format!("tenants:\n- name: a\n  key_sha256: [{KEY_A}]\n  priority: batch\n  priorities: [standard, batch]\n"),
    )
    .unwrap();
    let worker = Worker::start(&sim("{}")).await;
    let router = Router::with_workers(&[&worker], &["--tenants-file", tenants.to_str().unwrap()]).await;
    let url = router.url("/v1/completions");
    let ask = |extra: Value| {
        let mut body = json!({"model": "sim", "prompt": "x", "max_tokens": 2});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let (status, body) = complete(&url, Some("key-a"), ask(json!({"service_tier": "priority"}))).await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["error"]["code"], "priority_not_allowed");
    assert_eq!(body["error"]["param"], "service_tier");
    let (status, body) = complete(&url, Some("key-a"), ask(json!({"priority": -3}))).await;
    assert_eq!((status, body["error"]["code"].as_str()), (403, Some("priority_not_allowed")));
    let allowed = [
        // `auto` and no class: the tenant's default; `default`: OpenAI's standard tier.
        (json!({}), "flex"),
        (json!({"service_tier": "auto"}), "flex"),
        (json!({"service_tier": "default"}), "default"),
        (json!({"service_tier": "flex"}), "flex"),
        (json!({"priority": 0, "service_tier": "auto"}), "default"),
        (json!({"priority": 2}), "flex"),
    ];
    for (fields, tier) in allowed {
        let (status, body) = complete(&url, Some("key-a"), ask(fields.clone())).await;
        assert_eq!(status, 200, "{fields}: {body}");
        assert_eq!(body["service_tier"], tier, "the class it ran in is echoed: {fields}");
    }
    let (status, body) = complete(&url, Some("key-a"), ask(json!({"service_tier": "turbo"}))).await;
    assert_eq!((status, body["error"]["param"].as_str()), (400, Some("service_tier")));
}

#[tokio::test]
async fn an_interactive_request_overtakes_batch_work_queued_on_the_worker() {
    // 20 ms a step, two slots: batch may fill one (the other is the higher classes' reserve).
    let mut args = sim(r#"{"base_us": 20000}"#);
    args.extend(["--max-running", "2"].map(String::from));
    let worker = Worker::start(&args).await;
    let router = Router::with_workers(&[&worker], &[] as &[&str]).await;
    let url = router.url("/v1/completions");
    let batch: Vec<_> = (0..4)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move {
                let body = json!({"model": "sim", "prompt": [1 + i, 2, 3], "max_tokens": 30, "service_tier": "flex"});
                let answer = complete(&url, None, body).await;
                (answer, std::time::Instant::now())
            })
        })
        .collect();
    eventually("one batch request running and three waiting", Duration::from_secs(10), || async {
        let load = worker.load().await;
        (load.running_requests == 1 && load.waiting_requests == 3).then_some(())
    })
    .await;
    // What an autoscaler reads: the queue by class.
    eventually("the router to show three batch requests waiting", Duration::from_secs(10), || async {
        let batch = waiting_by_priority(&router, "batch").await;
        (batch == 3.0 && waiting_by_priority(&router, "interactive").await == 0.0).then_some(())
    })
    .await;
    let body = json!({"model": "sim", "prompt": [9, 9, 9], "max_tokens": 2, "service_tier": "priority"});
    let (status, answer) = complete(&url, None, body).await;
    let interactive_done = std::time::Instant::now();
    assert_eq!(status, 200, "{answer}");
    let mut finished = Vec::new();
    for b in batch {
        let ((status, answer), at) = b.await.unwrap();
        assert_eq!(status, 200, "{answer}");
        finished.push(at);
    }
    finished.sort();
    // Served at once in the reserved slot: before the batch request that was running ended.
    assert!(interactive_done < finished[0], "the interactive request waited behind batch work");
}
