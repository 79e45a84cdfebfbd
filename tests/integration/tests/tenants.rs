//! Many tenants over real HTTP: keys, models, rate limits with OpenAI's headers, reload of the
//! tenants file, isolated prefix caches, the admin usage endpoint, and limits shared by routers.

use std::{path::Path, time::Duration};

use bellows_integration::{Etcd, Router, Worker, eventually, sim};
use serde_json::{Value, json};
use tempfile::TempDir;

/// sha256("key-a"), sha256("key-b"), sha256("admin-key").
const KEY_A: &str = "f10f781241e2246678b6b45c857069208152a53863e47fac33f607ab405006f4";
const KEY_B: &str = "a30534a53b23547377ddccbd1ac85a8a84c13db43493c16e55a6abc7b0eba634";
const ADMIN: &str = "69a5265506c94c77b787a7d7377b7685a0eff82e33920a71e7ee22cd6154953e";

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    // Write then rename, as a Secret update does: the reloader never sees half a file.
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    path.to_string_lossy().into_owned()
}

async fn call(router: &Router, key: Option<&str>, body: &Value) -> (u16, reqwest::header::HeaderMap, Value) {
    let mut r = reqwest::Client::new().post(router.url("/v1/completions")).json(body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (status, headers, r.json().await.unwrap_or(Value::Null))
}

fn ask(prompt: Value) -> Value {
    json!({"model": "sim", "prompt": prompt, "max_tokens": 2})
}

#[tokio::test]
async fn keys_models_and_rate_limits_are_enforced_with_openai_headers() {
    let dir = TempDir::new().unwrap();
    let tenants = write(
        dir.path(),
        "tenants.yaml",
        &format!(
            "tenants:\n\
             - name: team-a\n  key_sha256: [{KEY_A}]\n  requests_per_minute: 3\n  tokens_per_minute: 100000\n\
             - name: team-b\n  key_sha256: [{KEY_B}]\n  models: [other-model]\n"
        ),
    );
    let worker = Worker::start(&sim("{}")).await;
    let router = Router::with_workers(&[&worker], &["--tenants-file", &tenants]).await;

    // 401: no key and a wrong key get the same answer.
    let (s1, h1, b1) = call(&router, None, &ask(json!("x"))).await;
    let (s2, _, b2) = call(&router, Some("key-zzz"), &ask(json!("x"))).await;
    assert_eq!((s1, s2), (401, 401));
    assert_eq!(b1, b2, "the refusal reveals nothing about which keys exist");
    assert_eq!(b1["error"]["code"], "invalid_api_key");
    assert_eq!(h1["www-authenticate"], "Bearer");

    // 403: a model the tenant may not use.
    let (s, _, b) = call(&router, Some("key-b"), &ask(json!("x"))).await;
    assert_eq!(s, 403, "{b}");

    // Exactly three requests a minute: three pass, with the remaining count going down; the
    // fourth is refused with Retry-After and the same headers.
    for remaining in ["2", "1", "0"] {
        let (s, h, b) = call(&router, Some("key-a"), &ask(json!("x"))).await;
        assert_eq!(s, 200, "{b}");
        assert_eq!(h["x-ratelimit-limit-requests"], "3");
        assert_eq!(h["x-ratelimit-remaining-requests"], remaining);
        assert!(h.contains_key("x-ratelimit-reset-requests") && h.contains_key("x-ratelimit-limit-tokens"));
        assert!(h.contains_key("x-ratelimit-remaining-tokens") && h.contains_key("x-ratelimit-reset-tokens"));
    }
    let (s, h, b) = call(&router, Some("key-a"), &ask(json!("x"))).await;
    assert_eq!(s, 429, "{b}");
    assert_eq!(b["error"]["code"], "rate_limit_exceeded");
    let retry: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    assert_eq!(h["x-ratelimit-remaining-requests"], "0");
}

#[tokio::test]
async fn a_changed_tenants_file_is_reloaded_without_a_restart() {
    let dir = TempDir::new().unwrap();
    let one = format!("tenants:\n- name: team-a\n  key_sha256: [{KEY_A}]\n");
    let tenants = write(dir.path(), "tenants.yaml", &one);
    let worker = Worker::start(&sim("{}")).await;
    let router = Router::with_workers(&[&worker], &["--tenants-file", &tenants]).await;
    assert_eq!(call(&router, Some("key-b"), &ask(json!("x"))).await.0, 401);

    write(dir.path(), "tenants.yaml", &format!("{one}- name: team-b\n  key_sha256: [{KEY_B}]\n"));
    eventually("the new key to work", Duration::from_secs(10), || async {
        (call(&router, Some("key-b"), &ask(json!("x"))).await.0 == 200).then_some(())
    })
    .await;
    // A broken file is refused and the last good one stays in force.
    write(dir.path(), "tenants.yaml", "tenants: [{name: x, key: plain-text}]\n");
    eventually("the router to read and refuse the broken file", Duration::from_secs(10), || async {
        router.process.log().contains("tenants file changed but is invalid").then_some(())
    })
    .await;
    assert_eq!(call(&router, Some("key-a"), &ask(json!("x"))).await.0, 200);
    assert_eq!(call(&router, Some("key-b"), &ask(json!("x"))).await.0, 200);
}

#[tokio::test]
async fn an_isolated_tenant_never_hits_another_tenants_cache_and_usage_is_accounted() {
    let dir = TempDir::new().unwrap();
    let tenants = write(
        dir.path(),
        "tenants.yaml",
        &format!(
            "tenants:\n\
             - name: team-a\n  key_sha256: [{KEY_A}]\n  isolate_prefix_cache: true\n\
             - name: team-b\n  key_sha256: [{KEY_B}]\n"
        ),
    );
    let admin = write(dir.path(), "admin", ADMIN);
    let worker = Worker::start(&sim("{}")).await;
    let router = Router::with_workers(&[&worker], &["--tenants-file", &tenants, "--admin-key-file", &admin]).await;
    let prompt: Vec<u32> = (1..=100).collect();

    let (_, _, b) = call(&router, Some("key-b"), &ask(json!(prompt))).await;
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, _, a) = call(&router, Some("key-a"), &ask(json!(prompt))).await;
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "b's blocks are invisible to a");
    let (_, _, a) = call(&router, Some("key-a"), &ask(json!(prompt))).await;
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 96, "a's own blocks are reused");
    let (_, _, b) = call(&router, Some("key-b"), &ask(json!(prompt))).await;
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 96, "shared tenants share");

    // Usage per tenant on the admin endpoint, for the admin key only.
    let usage = reqwest::Client::new().get(router.url("/admin/usage"));
    assert_eq!(usage.try_clone().unwrap().bearer_auth("key-a").send().await.unwrap().status(), 401);
    let body: Value = usage.bearer_auth("admin-key").send().await.unwrap().json().await.unwrap();
    let a = &body["tenants"]["team-a"];
    assert_eq!(a["requests"], 2);
    assert_eq!(a["prompt_tokens"], 200);
    assert_eq!(a["cached_tokens"], 96);
    assert_eq!(a["completion_tokens"], 4);
    assert_eq!(body["tenants"]["team-b"]["requests"], 2);
    assert_eq!(router.metric("bellows_router_tenant_requests_total").await, 4.0);
}

#[tokio::test]
async fn a_request_cache_salt_shares_blocks_only_with_the_same_salt() {
    let worker = Worker::start(&sim("{}")).await;
    let router = Router::with_workers(&[&worker], &[] as &[&str]).await;
    let prompt: Vec<u32> = (1..=100).collect();
    let salted = |salt: &str| {
        let mut body = ask(json!(prompt));
        body["cache_salt"] = json!(salt);
        body
    };
    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].clone();

    let (status, _, first) = call(&router, None, &salted("salt-1")).await;
    assert_eq!((status, cached(&first)), (200, json!(0)));
    let (_, _, same) = call(&router, None, &salted("salt-1")).await;
    assert_eq!(cached(&same), 96, "the same salt reuses its blocks");
    let (_, _, other) = call(&router, None, &salted("salt-2")).await;
    assert_eq!(cached(&other), 0, "another salt never sees them");
    let (_, _, plain) = call(&router, None, &ask(json!(prompt))).await;
    assert_eq!(cached(&plain), 0, "nor does a request without a salt");
    let (status, _, refused) = call(&router, None, &salted("")).await;
    assert_eq!((status, refused["error"]["param"].clone()), (400, json!("cache_salt")));
}

#[tokio::test]
async fn two_routers_each_enforce_half_of_a_tenants_rate() {
    let etcd = Etcd::start().await;
    let dir = TempDir::new().unwrap();
    let tenants = write(
        dir.path(),
        "tenants.yaml",
        &format!("tenants:\n- name: team-a\n  key_sha256: [{KEY_A}]\n  requests_per_minute: 4\n"),
    );
    let worker = Worker::start(&sim("{}")).await;
    let args = |id: &str| {
        vec![
            "--workers".to_string(),
            worker.addr.clone(),
            "--tenants-file".into(),
            tenants.clone(),
            "--etcd-endpoints".into(),
            etcd.endpoint(),
            "--router-id".into(),
            id.into(),
        ]
    };
    let r1 = Router::start(&args("r1")).await;
    let r2 = Router::start(&args("r2")).await;
    r1.wait_placeable(1).await;
    r2.wait_placeable(1).await;
    // Both routers register and see each other: each then enforces 2 of the 4 requests a minute.
    for router in [&r1, &r2] {
        eventually("each router to count both", Duration::from_secs(10), || async {
            (router.metric("bellows_router_live_routers").await == 2.0).then_some(())
        })
        .await;
    }
    let mut accepted = 0;
    for router in [&r1, &r2] {
        for _ in 0..3 {
            if call(router, Some("key-a"), &ask(json!("x"))).await.0 == 200 {
                accepted += 1;
            }
        }
    }
    assert_eq!(accepted, 4, "the cluster as a whole admits the tenant's limit, not twice it");
}
