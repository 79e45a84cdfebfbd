//! The Session RPC over real gRPC against a `bellows-worker serve` process: many requests on one
//! stream, each answered under its own id; a cancel frame or the end of the stream frees exactly
//! what it names.

mod common;

use bellows_proto::worker::v1::{self as pb, session_request, session_response::Kind};
use common::{greedy, report_where, sim, start_node, watch};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Code, Streaming};

fn open(id: u64, request: pb::GenerateRequest) -> pb::SessionRequest {
    let open = pb::SessionOpen { request: Some(request), trace_context: Default::default() };
    pb::SessionRequest { id, kind: Some(session_request::Kind::Open(open)) }
}

fn cancel(id: u64) -> pb::SessionRequest {
    pb::SessionRequest { id, kind: Some(session_request::Kind::Cancel(pb::SessionCancel {})) }
}

/// Read frames until `f` says stop; every frame read, in order.
async fn read_until(
    answers: &mut Streaming<pb::SessionResponse>,
    f: impl Fn(&[(u64, Kind)]) -> bool,
) -> Vec<(u64, Kind)> {
    let mut seen = Vec::new();
    while !f(&seen) {
        let frame = answers.message().await.unwrap().expect("the session stays open");
        seen.push((frame.id, frame.kind.expect("every frame has a kind")));
    }
    seen
}

fn finished(seen: &[(u64, Kind)], id: u64) -> bool {
    seen.iter().any(|(i, k)| *i == id && matches!(k, Kind::Finished(_) | Kind::Error(_)))
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_on_one_session_are_answered_under_their_ids_and_a_cancel_frees_only_its_own() {
    let node = start_node(&sim(r#"{"base_us": 5000}"#)).await;
    let mut client = node.client().await;
    let mut reports = watch(&mut client).await;
    let (frames, outgoing) = mpsc::unbounded_channel();
    let mut answers = client.session(UnboundedReceiverStream::new(outgoing)).await.unwrap().into_inner();

    frames.send(open(7, greedy((1..=40).collect(), 5000))).unwrap();
    frames.send(open(8, greedy(vec![1, 2, 3], 6))).unwrap();
    frames.send(open(9, greedy(vec![], 4))).unwrap();
    frames.send(open(7, greedy(vec![1], 4))).unwrap();
    let seen =
        read_until(&mut answers, |s| finished(s, 8) && finished(s, 9) && s.iter().filter(|f| f.0 == 7).count() >= 3)
            .await;

    let tokens_of = |id| -> usize {
        seen.iter()
            .filter(|(i, _)| *i == id)
            .map(|(_, k)| if let Kind::Delta(d) = k { d.token_ids.len() } else { 0 })
            .sum()
    };
    assert!(matches!(seen.iter().find(|f| f.0 == 8).unwrap().1, Kind::Accepted(_)), "accepted first");
    assert_eq!(tokens_of(8), 6);
    let refusals: Vec<&pb::SessionError> =
        seen.iter().filter_map(|(_, k)| if let Kind::Error(e) = k { Some(e) } else { None }).collect();
    assert!(refusals.iter().any(|e| e.code == Code::InvalidArgument as i32 && e.message.contains("prompt is empty")));
    assert!(refusals.iter().any(|e| e.message.contains("request id 7 is in use")), "{refusals:?}");

    // Request 7 is still running; cancelling it frees its blocks, and the session goes on.
    report_where(&mut reports, "request 7 holds blocks", |l| l.kv_blocks_used >= 3).await;
    frames.send(cancel(7)).unwrap();
    report_where(&mut reports, "request 7's blocks are free", |l| l.kv_blocks_used == 0 && l.running_requests == 0)
        .await;
    frames.send(open(10, greedy(vec![4, 5], 3))).unwrap();
    let later = read_until(&mut answers, |s| finished(s, 10)).await;
    assert!(matches!(later.last().unwrap(), (10, Kind::Finished(_))), "{later:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_router_closing_its_session_cancels_everything_on_it() {
    let node = start_node(&sim(r#"{"base_us": 5000}"#)).await;
    let mut client = node.client().await;
    let mut reports = watch(&mut client).await;
    let (frames, outgoing) = mpsc::unbounded_channel();
    let mut answers = client.session(UnboundedReceiverStream::new(outgoing)).await.unwrap().into_inner();
    for id in 1..=3 {
        frames.send(open(id, greedy(vec![id as u32, 2, 3], 5000))).unwrap();
    }
    read_until(&mut answers, |s| s.iter().filter(|(_, k)| matches!(k, Kind::Delta(_))).count() >= 3).await;
    report_where(&mut reports, "three running", |l| l.running_requests == 3).await;

    // The connection stays up (the load stream shares it): only the session's end says it.
    drop(frames);
    report_where(&mut reports, "all freed", |l| l.running_requests == 0 && l.kv_blocks_used == 0).await;
    let rest = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while answers.message().await.ok().flatten().is_some() {}
    });
    rest.await.expect("the worker ends the session's answers too");
}
