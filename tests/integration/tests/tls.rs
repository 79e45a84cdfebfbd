//! Security below the HTTP API, over real processes and certificates made at run time
//! (docs/security.md): mutual TLS between routers and workers, and etcd with TLS and
//! client-certificate auth.
//!
//! Of the whole-cluster behaviour, this subset runs over TLS: discovery through etcd, streamed and
//! whole completions and chat, static `--workers`, and a certificate rotation under a running
//! stream; everything else runs in plaintext.

use std::time::Duration;

use bellows_integration::{
    Etcd, Router, Worker, eventually, free_port,
    pki::{Issued, Pki},
    sim,
};
use bellows_proto::worker::v1::{self as pb, worker_client::WorkerClient};
use serde_json::{Value, json};
use tonic::transport::{ClientTlsConfig, Endpoint};

/// A worker on the simulated engine registered in `etcd` as `node`, serving TLS from `pki`
/// with a certificate for `named`.
async fn tls_worker(etcd: &Etcd, pki: &Pki, node: &str, named: &str) -> Worker {
    let mut args = sim("{}");
    args.extend(["--etcd-endpoints".into(), etcd.endpoint(), "--node-id".into(), node.into()]);
    args.extend(etcd.tls().expect("a TLS etcd").flags());
    args.extend(pki.flags(&pki.issue(node, &[named])));
    let harness = pki.issue(&format!("{node}-harness"), &["harness"]);
    Worker::start_tls(&args, pki.client(named, Some(&harness))).await
}

/// A router following `etcd`, with its certificate from `pki`.
async fn tls_router(etcd: &Etcd, pki: &Pki) -> Router {
    let mut args = vec!["--etcd-endpoints".to_string(), etcd.endpoint()];
    args.extend(etcd.tls().unwrap().flags());
    args.extend(pki.flags(&pki.issue("router", &["router"])));
    Router::start(&args).await
}

/// Wait until `joined` workers are known, `placeable` of them placeable and every other one
/// refused at least once for its certificate.
async fn wait_verified(router: &Router, joined: usize, placeable: usize) {
    let what = format!("{joined} workers joined, {placeable} placeable, the others refused");
    eventually(&what, Duration::from_secs(20), || async {
        let known = router.metric("bellows_router_workers").await as usize;
        let ok = router.metric("bellows_router_placeable_workers").await as usize;
        let refused = router.metric("bellows_router_worker_tls_failures_total").await as usize;
        (known == joined && ok == placeable && refused >= joined - placeable).then_some(())
    })
    .await;
}

async fn post(router: &Router, path: &str, body: Value) -> (u16, String) {
    let r = reqwest::Client::new().post(router.url(path)).json(&body).send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test]
async fn over_mutual_tls_requests_complete_and_workers_that_fail_verification_get_none() {
    let (cluster, rogue_ca) = (Pki::new("cluster"), Pki::new("rogue"));
    let etcd = Etcd::start_tls(&cluster).await;
    let good = tls_worker(&etcd, &cluster, "good", "good").await;
    // Both can write to etcd (they hold etcd's client certificate) and register, and must never
    // be sent a request: one's certificate is from another CA, the other's is the cluster's
    // but names another node than the one it registered as.
    let rogue = tls_worker(&etcd, &rogue_ca, "rogue", "rogue").await;
    let impostor = tls_worker(&etcd, &cluster, "impostor", "good").await;
    let router = tls_router(&etcd, &cluster).await;
    wait_verified(&router, 3, 1).await;
    for i in 0..6 {
        let (status, body) = match i % 3 {
            0 => post(&router, "/v1/completions", json!({"model": "sim", "prompt": [1, 2, i], "max_tokens": 4})).await,
            1 => {
                let body = json!({"model": "sim", "prompt": [3, i], "max_tokens": 4, "stream": true});
                post(&router, "/v1/completions", body).await
            }
            _ => {
                let body = json!({"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
                post(&router, "/v1/chat/completions", body).await
            }
        };
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(good.log().matches("request finished").count(), 6, "every request ran on the trusted worker");
    assert_eq!(rogue.log().matches("request finished").count(), 0, "the rogue worker was sent a request");
    assert_eq!(impostor.log().matches("request finished").count(), 0, "the impostor was sent a request");
    assert_eq!(router.metric("bellows_router_placeable_workers").await, 1.0);
}

#[tokio::test]
async fn a_certificate_naming_the_registered_host_serves_for_any_node_id_there() {
    // As in the Helm chart: one certificate for `*.<headless service>` serves every worker pod,
    // whose node ids it does not list.
    let cluster = Pki::new("cluster");
    let etcd = Etcd::start_tls(&cluster).await;
    let worker_args = |node: &str, named: &str| {
        let mut args = sim("{}");
        args.extend(["--etcd-endpoints".into(), etcd.endpoint(), "--node-id".into(), node.into()]);
        args.extend(etcd.tls().unwrap().flags());
        args.extend(cluster.flags(&cluster.issue(node, &[named])));
        args
    };
    let harness = cluster.issue("harness", &["harness"]);
    let by_host = Worker::start_tls_advertising(
        &worker_args("worker-7", "localhost"),
        cluster.client("localhost", Some(&harness)),
        "localhost",
    )
    .await;
    // Registered at 127.0.0.1 as "worker-8": its certificate names neither.
    let neither = tls_worker(&etcd, &cluster, "worker-8", "localhost").await;
    let router = tls_router(&etcd, &cluster).await;
    wait_verified(&router, 2, 1).await;
    for i in 0..4 {
        let body = json!({"model": "sim", "prompt": [5, i], "max_tokens": 3, "stream": i % 2 == 0});
        let (status, body) = post(&router, "/v1/completions", body).await;
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(by_host.log().matches("request finished").count(), 4);
    assert_eq!(neither.log().matches("request finished").count(), 0, "a certificate for another host was trusted");
}

#[tokio::test]
async fn under_mutual_tls_readiness_is_served_in_plaintext_on_the_metrics_port() {
    // Kubelet's probes present no client certificate: the plaintext metrics port answers them.
    let cluster = Pki::new("cluster");
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut args = sim("{}");
    args.extend(["--metrics-listen".to_string(), metrics.clone()]);
    args.extend(cluster.flags(&cluster.issue("worker", &["127.0.0.1"])));
    let harness = cluster.issue("harness", &["harness"]);
    let worker = Worker::start_tls(&args, cluster.client("127.0.0.1", Some(&harness))).await;
    let ready = reqwest::get(format!("http://{metrics}/ready")).await.unwrap();
    assert_eq!(ready.status().as_u16(), 200);
    assert_eq!(ready.text().await.unwrap(), "serving\n");
    assert!(!can_watch(&worker, None).await, "the gRPC port served plaintext");
}

/// WatchLoad on `worker` with this TLS client (`None`: plaintext): whether it answered.
async fn can_watch(worker: &Worker, tls: Option<ClientTlsConfig>) -> bool {
    load_over(worker, tls).await.is_some()
}

/// The worker's load, through a new connection with this TLS client; `None` if refused.
async fn load_over(worker: &Worker, tls: Option<ClientTlsConfig>) -> Option<pb::LoadReport> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{}", worker.addr)).unwrap();
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).unwrap();
    }
    let channel = endpoint.connect().await.ok()?;
    let stream = WorkerClient::new(channel).watch_load(pb::WatchLoadRequest {}).await.ok()?;
    stream.into_inner().message().await.ok()??.load
}

#[tokio::test]
async fn a_client_without_the_clusters_certificate_cannot_open_a_worker_stream() {
    let (cluster, other) = (Pki::new("cluster"), Pki::new("other"));
    // A `--workers` entry has no registered name: its certificate must name the host given.
    let mut args = sim("{}");
    args.extend(cluster.flags(&cluster.issue("worker", &["127.0.0.1"])));
    let harness = cluster.issue("harness", &["harness"]);
    let worker = Worker::start_tls(&args, cluster.client("127.0.0.1", Some(&harness))).await;

    assert!(!can_watch(&worker, None).await, "plaintext was served");
    assert!(!can_watch(&worker, Some(cluster.client("127.0.0.1", None))).await, "served without a client certificate");
    let stranger = other.issue("stranger", &["stranger"]);
    let trusting_stranger = cluster.client("127.0.0.1", None).identity(tonic::transport::Identity::from_pem(
        std::fs::read(&stranger.cert).unwrap(),
        std::fs::read(&stranger.key).unwrap(),
    ));
    assert!(!can_watch(&worker, Some(trusting_stranger)).await, "served a certificate from another CA");
    assert!(can_watch(&worker, Some(cluster.client("127.0.0.1", Some(&harness)))).await);

    // A router with the cluster's certificate reaches it by its address.
    let mut args = vec!["--workers".to_string(), worker.addr.clone()];
    args.extend(cluster.flags(&cluster.issue("router", &["router"])));
    let router = Router::start(&args).await;
    router.wait_placeable(1).await;
    let (status, body) =
        post(&router, "/v1/completions", json!({"model": "sim", "prompt": [1, 2], "max_tokens": 3})).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn etcd_with_client_certificate_auth_refuses_a_client_without_one() {
    let pki = Pki::new("etcd");
    let etcd = Etcd::start_tls(&pki).await;
    let ca_only = etcd_client::TlsOptions::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(std::fs::read(pki.ca_path()).unwrap()));
    let options = etcd_client::ConnectOptions::new().with_tls(ca_only).with_timeout(Duration::from_secs(2));
    let refused = match etcd_client::Client::connect([etcd.endpoint()], Some(options)).await {
        Err(_) => true,
        Ok(mut c) => c.get("probe", None).await.is_err(),
    };
    assert!(refused, "etcd served a client without a certificate");
    let mut trusted = etcd.client().await;
    trusted.put("probe", "1", None).await.expect("a client with the certificate is served");
}

#[tokio::test]
async fn a_rotated_certificate_is_taken_for_new_connections_while_open_streams_go_on() {
    let (old, new) = (Pki::new("old"), Pki::new("new"));
    // Where a Secret is mounted: files replaced by rename, as the kubelet does.
    let mount = tempfile::TempDir::new().unwrap();
    let path = |name: &str| mount.path().join(name);
    let install = |pki: &Pki, issued: &Issued| {
        for (from, to) in [(pki.ca_path(), "ca.pem"), (issued.cert.clone(), "tls.crt"), (issued.key.clone(), "tls.key")]
        {
            let tmp = path(&format!(".{to}.tmp"));
            std::fs::copy(from, &tmp).unwrap();
            std::fs::rename(&tmp, path(to)).unwrap();
        }
    };
    install(&old, &old.issue("worker", &["127.0.0.1"]));
    let mut args = sim(r#"{"base_us": 20000}"#);
    for (flag, file) in [("--tls-ca", "ca.pem"), ("--tls-cert", "tls.crt"), ("--tls-key", "tls.key")] {
        args.extend([flag.to_string(), path(file).to_string_lossy().into_owned()]);
    }
    let old_harness = old.issue("harness", &["harness"]);
    let worker = Worker::start_tls(&args, old.client("127.0.0.1", Some(&old_harness))).await;
    let mut router_args = vec!["--workers".to_string(), worker.addr.clone()];
    router_args.extend(old.flags(&old.issue("router", &["router"])));
    let router = Router::start(&router_args).await;
    router.wait_placeable(1).await;

    // 500 steps of 20 ms: the stream runs through the rotation (looked for every 5 s).
    let url = router.url("/v1/completions");
    let stream = tokio::spawn(async move {
        let body = json!({"model": "sim", "prompt": [5, 6, 7], "max_tokens": 500, "stream": true});
        let r = reqwest::Client::new().post(url).json(&body).send().await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    });
    eventually("the stream running", Duration::from_secs(10), || async {
        (worker.load().await.running_requests == 1).then_some(())
    })
    .await;
    install(&new, &new.issue("worker", &["127.0.0.1"]));
    let new_harness = new.issue("harness", &["harness"]);
    let load = eventually("the worker to take the new certificates", Duration::from_secs(30), || async {
        load_over(&worker, Some(new.client("127.0.0.1", Some(&new_harness)))).await
    })
    .await;
    assert_eq!(load.running_requests, 1, "the stream must still be running when the new certificates apply");
    assert!(
        !can_watch(&worker, Some(old.client("127.0.0.1", Some(&old_harness)))).await,
        "the old CA is still trusted"
    );
    let (status, body) = stream.await.unwrap();
    assert_eq!(status, 200);
    assert!(!body.contains("\"error\""), "the stream broke: {body}");
    assert!(body.contains("\"finish_reason\":\"length\"") && body.trim_end().ends_with("data: [DONE]"), "{body}");
}

/// `curl` over HTTPS trusting `ca`: the status and body, or `None` if it could not connect.
fn curl(url: &str, ca: &std::path::Path, body: Option<&str>) -> Option<(u16, String)> {
    let mut cmd = std::process::Command::new("curl");
    cmd.args(["-sS", "--max-time", "20", "-w", "\n%{http_code}", "--cacert"]).arg(ca).arg(url);
    if let Some(b) = body {
        cmd.args(["-H", "content-type: application/json", "-d", b]);
    }
    let out = cmd.output().expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n')?;
    let code: u16 = code.trim().parse().ok()?;
    (code != 0).then(|| (code, body.to_string()))
}

#[tokio::test]
async fn the_routers_http_listener_serves_tls_with_its_certificate() {
    let (edge, other) = (Pki::new("edge"), Pki::new("other"));
    let worker = Worker::start(&sim("{}")).await;
    let cert = edge.issue("router-http", &["127.0.0.1"]);
    let addr = format!("127.0.0.1:{}", bellows_integration::free_port());
    let args = ["--listen", &addr, "--workers", &worker.addr, "--http-tls-cert"]
        .map(String::from)
        .into_iter()
        .chain([
            cert.cert.to_string_lossy().into_owned(),
            "--http-tls-key".into(),
            cert.key.to_string_lossy().into_owned(),
        ])
        .collect();
    let mut router = bellows_integration::Process::spawn(
        "router",
        bellows_integration::binary("bellows-router"),
        args,
        addr.clone(),
        &[],
    );
    let url = format!("https://{addr}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while curl(&format!("{url}/health"), &edge.ca_path(), None).is_none_or(|(code, _)| code != 200) {
        assert!(!router.exited(), "router exited; log:\n{}", router.log());
        assert!(std::time::Instant::now() < deadline, "no answer over TLS in 30 s; log:\n{}", router.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let answer = curl(
        &format!("{url}/v1/completions"),
        &edge.ca_path(),
        Some(r#"{"model":"sim","prompt":[1,2,3],"max_tokens":3}"#),
    );
    let (code, body) = answer.expect("a completion over TLS");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"text_completion\""), "{body}");
    // A client that does not trust its CA is refused in the handshake; plaintext gets nothing.
    assert_eq!(curl(&format!("{url}/health"), &other.ca_path(), None), None);
    let plain = reqwest::get(format!("http://{addr}/health")).await;
    assert!(plain.is_err() || !plain.unwrap().status().is_success(), "plaintext HTTP was served");
}
