//! Security below the HTTP API, over real processes and certificates made at run time
//! (docs/security.md): mutual TLS between routers and workers, and etcd with TLS and
//! client-certificate auth.
//!
//! Of the whole-cluster behaviour, this subset runs over TLS: discovery through etcd, streamed and
//! whole completions and chat, and static `--workers`; everything else runs in plaintext.

use std::time::Duration;

use bellows_integration::{Etcd, Router, Worker, eventually, pki::Pki, sim};
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
    let mut args = vec!["--etcd-endpoints".to_string(), etcd.endpoint()];
    args.extend(etcd.tls().unwrap().flags());
    args.extend(cluster.flags(&cluster.issue("router", &["router"])));
    let router = Router::start(&args).await;

    eventually("three workers joined, one placeable, the others refused", Duration::from_secs(20), || async {
        let joined = router.metric("bellows_router_workers").await;
        let placeable = router.metric("bellows_router_placeable_workers").await;
        let refused = router.metric("bellows_router_worker_tls_failures_total").await;
        (joined == 3.0 && placeable == 1.0 && refused >= 2.0).then_some(())
    })
    .await;
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

/// WatchLoad on `worker` with this TLS client (`None`: plaintext): whether it answered.
async fn can_watch(worker: &Worker, tls: Option<ClientTlsConfig>) -> bool {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{}", worker.addr)).unwrap();
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).unwrap();
    }
    let Ok(channel) = endpoint.connect().await else { return false };
    let Ok(stream) = WorkerClient::new(channel).watch_load(pb::WatchLoadRequest {}).await else { return false };
    stream.into_inner().message().await.is_ok_and(|m| m.is_some())
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
