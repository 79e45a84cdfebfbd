//! A graceful stop loses no request: SIGTERM while streams run lets them finish, refuses new
//! work with UNAVAILABLE (so a router retries elsewhere), and exits 0.

mod common;

use std::time::Duration;

use bellows_proto::worker::v1 as pb;
use common::{complete, eventually, generate, greedy, sim, start_node};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_running_streams_finish_refuses_new_work_and_exits_zero() {
    // 30 ms steps: 60 tokens take about two seconds, far longer than the steps below.
    let mut node = start_node(&sim(r#"{"base_us": 30000}"#)).await;
    let mut client = node.client().await;

    let mut streams = Vec::new();
    for i in 0..4u32 {
        let mut s = client.generate(greedy(vec![10 + i, 20, 30], 60)).await.unwrap().into_inner();
        let first = s.message().await.unwrap().expect("a first delta");
        let Some(pb::generate_response::Kind::Delta(first)) = first.kind else { panic!("a delta comes first") };
        streams.push((first.token_ids.len(), s));
    }
    let running: Vec<_> =
        streams.into_iter().map(|(n, s)| tokio::spawn(async move { (n, complete(s).await) })).collect();

    let mut reports = client.watch_load(pb::WatchLoadRequest {}).await.unwrap().into_inner();
    node.signal(libc::SIGTERM);
    let refusal = eventually("new requests to be refused", Duration::from_secs(10), || {
        let mut c = client.clone();
        async move { generate(&mut c, greedy(vec![1, 2], 1)).await.err() }
    })
    .await;
    assert_eq!(refusal.code(), Code::Unavailable, "{refusal:?}");
    assert_eq!(node.health().await, Some(ServingStatus::NotServing), "health says it is going away");

    let draining = async {
        while let Some(msg) = reports.message().await.unwrap() {
            if msg.load.unwrap().draining {
                return;
            }
        }
        panic!("the load stream ended before it reported draining");
    };
    tokio::time::timeout(Duration::from_secs(10), draining).await.expect("routers are told the node is draining");

    for r in running {
        let (before, done) = r.await.unwrap();
        let done = done.expect("an in-flight stream completes during the drain");
        assert_eq!(before + done.tokens.len(), 60);
        assert_eq!(done.finished.reason(), pb::FinishReason::Length);
    }
    assert_eq!(node.wait_exit(Duration::from_secs(20)).code(), Some(0));
}
