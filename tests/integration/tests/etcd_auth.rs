//! etcd's own password auth over real processes (docs/security.md): routers and workers log in
//! with `--etcd-user` and `--etcd-password-file` to an etcd with `auth enable` on, whose user
//! may read and write `/bellows/` only. Plaintext: etcd takes passwords without TLS.
//!
//! What is defended: a cluster that logs in is discovered and serves; a wrong password (or
//! none) stops the process at start, naming authentication, rather than being retried
//! forever; and a login token that etcd has dropped (its TTL passed while the processes only
//! streamed) neither stops discovery nor the worker's lease, and is renewed for the next plain
//! call (the lease revoke at shutdown).

use std::time::Duration;

use bellows_integration::{ETCD_USER, Etcd, Process, Router, Worker, binary, eventually, free_port, sim};
use serde_json::json;

/// A worker on the simulated engine registered in `etcd` as `node` with a lease of `lease_ttl`,
/// logging in with the right password or a wrong one.
fn worker_args(etcd: &Etcd, node: &str, lease_ttl: &str, right_password: bool) -> Vec<String> {
    let mut args = sim("{}");
    args.extend(["--etcd-endpoints", &etcd.endpoint(), "--node-id", node, "--lease-ttl", lease_ttl].map(String::from));
    args.extend(etcd.auth_flags(right_password));
    args
}

fn router_args(etcd: &Etcd, right_password: bool) -> Vec<String> {
    let mut args = vec!["--etcd-endpoints".to_string(), etcd.endpoint()];
    args.extend(etcd.auth_flags(right_password));
    args
}

async fn completes(router: &Router) -> bool {
    let (status, _, _) = router.post("/v1/completions", &json!({"model": "sim", "prompt": "x", "max_tokens": 2})).await;
    status == 200
}

/// The lease `node`'s key hangs on, if the key is there.
async fn lease_of(etcd: &Etcd, node: &str) -> Option<i64> {
    let key = format!("/bellows/default/workers/{node}");
    let got = etcd.client().await.get(key, None).await.unwrap();
    got.kvs().first().map(|kv| kv.lease())
}

/// A process started with `args` that must exit at start; its exit status and log.
fn exits_at_start(name: &'static str, bin: &str, args: Vec<String>) -> (std::process::ExitStatus, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut all = match bin {
        "bellows-worker" => vec!["serve".to_string(), "--listen".into(), addr.clone()],
        _ => vec!["--listen".to_string(), addr.clone()],
    };
    all.extend(args);
    let mut process = Process::spawn(name, binary(bin), all, addr, &[]);
    let status = process.wait_exit(Duration::from_secs(30));
    (status, process.log())
}

#[tokio::test]
async fn a_router_and_worker_that_log_in_to_an_auth_enabled_etcd_serve() {
    let etcd = Etcd::start_auth(Duration::from_secs(300)).await;
    let _worker = Worker::start(&worker_args(&etcd, "a", "3s", true)).await;
    let router = Router::start(&router_args(&etcd, true)).await;
    // Registered (a put under the user's role) and found (a list and a watch under it).
    eventually("the worker's key in etcd", Duration::from_secs(20), || lease_of(&etcd, "a")).await;
    router.wait_placeable(1).await;
    assert!(completes(&router).await, "a request through the discovered worker");
    // The router registered itself too (its share of the tenants' limits).
    eventually("the router counted in etcd", Duration::from_secs(20), || async {
        (router.metric("bellows_router_live_routers").await == 1.0).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_wrong_etcd_password_stops_the_worker_and_the_router_at_start_naming_authentication() {
    let etcd = Etcd::start_auth(Duration::from_secs(300)).await;
    let refused = format!("etcd authentication failed for user \"{ETCD_USER}\"");

    let (status, log) = exits_at_start("worker", "bellows-worker", worker_args(&etcd, "wrong", "3s", false));
    assert!(!status.success(), "the worker exited 0; log:\n{log}");
    assert!(log.contains(&refused), "the worker's exit does not name authentication; log:\n{log}");
    assert!(!log.contains("model loaded"), "the worker got as far as loading the model; log:\n{log}");
    assert_eq!(lease_of(&etcd, "wrong").await, None, "a refused worker is registered");

    let (status, log) = exits_at_start("router", "bellows-router", router_args(&etcd, false));
    assert!(!status.success(), "the router exited 0; log:\n{log}");
    assert!(log.contains(&refused), "the router's exit does not name authentication; log:\n{log}");
    assert!(!log.contains("bellows-router listening"), "the router listened; log:\n{log}");

    // No credentials at all against an etcd that requires them: said as such.
    let (status, log) = exits_at_start("router", "bellows-router", vec!["--etcd-endpoints".into(), etcd.endpoint()]);
    assert!(!status.success(), "the router without credentials exited 0; log:\n{log}");
    assert!(log.contains("etcd requires authentication"), "log:\n{log}");
}

#[tokio::test]
async fn after_etcd_drops_the_login_tokens_the_cluster_discovers_serves_keeps_its_lease_and_deregisters() {
    let etcd = Etcd::start_auth(Duration::from_secs(2)).await;
    // A lease of 3 s, renewed each second: the wait below outlasts it, so the key is only still
    // on the same lease after it if the keep-alive went on.
    let mut first = Worker::start(&worker_args(&etcd, "first", "3s", true)).await;
    let router = Router::start(&router_args(&etcd, true)).await;
    router.wait_placeable(1).await;
    let lease = eventually("the first worker's key", Duration::from_secs(20), || lease_of(&etcd, "first")).await;

    // From here on the router and the worker only stream (a watch, keep-alives): etcd lets
    // their tokens die.
    etcd.wait_tokens_expired().await;

    assert_eq!(lease_of(&etcd, "first").await, Some(lease), "the first worker's lease lapsed or was replaced");
    let _second = Worker::start(&worker_args(&etcd, "second", "3s", true)).await;
    router.wait_placeable(2).await;
    for _ in 0..4 {
        assert!(completes(&router).await, "the router serves after the tokens expired");
    }
    assert_eq!(lease_of(&etcd, "first").await, Some(lease), "the first worker's lease lapsed or was replaced");

    // The revoke at shutdown is the first plain call since the token died: it must log in
    // again, or the key is left to expire with its lease.
    first.signal(libc::SIGTERM);
    assert!(first.wait_exit(Duration::from_secs(30)).success(), "log:\n{}", first.log());
    let log = first.log();
    assert!(log.contains("deregistered"), "the lease revoke failed after the token expired; log:\n{log}");
    assert_eq!(lease_of(&etcd, "first").await, None, "the key outlived its worker");
    router.wait_placeable(1).await;
    assert!(completes(&router).await);
}
