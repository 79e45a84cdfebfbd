//! WatchLoad over real gRPC: the only view a router has of a worker's load and cache, so it must
//! follow the queue as it fills and drains, and mirror the prefix cache exactly.
//! Simulated engine: the scheduler, KV pool and prefix hashing are the real ones.

mod common;

use std::{collections::BTreeSet, time::Duration};

use bellows_common::prefix_hash::{ChainRoot, prefix_block_hashes};
use bellows_proto::worker::v1::{self as pb, kv_event::Kind, worker_client::WorkerClient};
use common::{generate, greedy, sim, start_node};
use tonic::transport::Channel;

async fn watch(client: &mut WorkerClient<Channel>) -> tonic::Streaming<pb::WatchLoadResponse> {
    client.watch_load(pb::WatchLoadRequest {}).await.unwrap().into_inner()
}

async fn next(reports: &mut tonic::Streaming<pb::WatchLoadResponse>) -> pb::WatchLoadResponse {
    tokio::time::timeout(Duration::from_secs(10), reports.message())
        .await
        .expect("a load message at least every 250 ms")
        .unwrap()
        .expect("the load stream stays open")
}

#[tokio::test(flavor = "multi_thread")]
async fn watch_load_shows_a_burst_queue_up_and_drain_to_zero() {
    // 20 ms steps and two running slots: ten requests of 10 tokens queue for about a second.
    let mut args = sim(r#"{"base_us": 20000}"#);
    args.extend(["--max-running", "2", "--max-waiting", "50"].map(String::from));
    let node = start_node(&args).await;
    let mut client = node.client().await;
    let mut reports = watch(&mut client).await;

    let burst: Vec<_> = (0..10u32)
        .map(|i| {
            let mut c = client.clone();
            tokio::spawn(async move { generate(&mut c, greedy(vec![1 + i, 2, 3, 4, 5], 10)).await })
        })
        .collect();

    let (mut peak_waiting, mut peak_tokens, mut peak_running, mut last_seq) = (0, 0, 0, 0);
    loop {
        let msg = next(&mut reports).await;
        let l = msg.load.unwrap();
        assert!(l.sequence > last_seq, "sequence numbers increase");
        last_seq = l.sequence;
        assert_eq!((l.max_running, l.max_waiting, l.draining), (2, 50, false));
        peak_waiting = peak_waiting.max(l.waiting_requests);
        peak_tokens = peak_tokens.max(l.waiting_prompt_tokens);
        peak_running = peak_running.max(l.running_requests);
        if peak_waiting > 0 && l.waiting_requests == 0 && l.running_requests == 0 {
            break;
        }
    }
    assert!(peak_waiting >= 6, "ten requests on two slots must queue (peak {peak_waiting})");
    assert!(peak_tokens >= 6 * 5, "waiting prompt tokens are reported (peak {peak_tokens})");
    assert_eq!(peak_running, 2);
    for r in burst {
        let done = r.await.unwrap().expect("every burst request completes");
        assert_eq!(done.tokens.len(), 10);
    }

    // Idle, the stream still speaks (a silent stream would mean a dead worker).
    for _ in 0..3 {
        let l = next(&mut reports).await.load.unwrap();
        assert!(l.sequence > last_seq);
        last_seq = l.sequence;
    }
}

/// A router's mirror of the node's cache, from one WatchLoad stream.
#[derive(Default)]
struct Mirror(BTreeSet<u64>);

impl Mirror {
    fn apply(&mut self, msg: &pb::WatchLoadResponse) {
        if let Some(s) = &msg.kv_snapshot {
            self.0 = s.block_hashes.iter().copied().collect();
        }
        for e in &msg.kv_events {
            match e.kind.expect("an event has a kind") {
                Kind::Stored(h) => assert!(self.0.insert(h), "stored twice: {h:x}"),
                Kind::Evicted(h) => assert!(self.0.remove(&h), "evicted but never stored: {h:x}"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn kv_events_name_a_prompts_blocks_and_a_late_subscriber_starts_from_the_same_cache() {
    let node = start_node(&sim(r#"{"base_us": 500}"#)).await;
    let mut client = node.client().await;
    let info = client.model_info(pb::ModelInfoRequest {}).await.unwrap().into_inner();
    let bs = info.kv_block_size as usize;

    let mut early = watch(&mut client).await;
    let first = next(&mut early).await;
    assert_eq!(
        first.kv_snapshot.as_ref().map(|s| s.block_hashes.len()),
        Some(0),
        "the first message carries the (empty) snapshot"
    );
    let mut mirror = Mirror::default();
    mirror.apply(&first);

    // Three full blocks, one token generated: exactly the prompt's three blocks are stored.
    let prompt: Vec<u32> = (100..100 + 3 * bs as u32).collect();
    let req = pb::GenerateRequest { cache_salt: Some("tenant-a".into()), ..greedy(prompt.clone(), 1) };
    generate(&mut client, req).await.unwrap();
    let want: BTreeSet<u64> = prefix_block_hashes(&prompt, bs, ChainRoot::for_model(&info.model_id, Some("tenant-a")))
        .iter()
        .map(|h| h.0)
        .collect();
    assert_eq!(want.len(), 3);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while mirror.0 != want {
        assert!(tokio::time::Instant::now() < deadline, "mirror {:x?} never became {:x?}", mirror.0, want);
        mirror.apply(&next(&mut early).await);
    }
    let unsalted: BTreeSet<u64> =
        prefix_block_hashes(&prompt, bs, ChainRoot::for_model(&info.model_id, None)).iter().map(|h| h.0).collect();
    assert!(mirror.0.is_disjoint(&unsalted), "the tenant's salt is part of every hash");

    // A router that connects now starts from a snapshot equal to the early router's mirror.
    let mut late = watch(&mut client).await;
    let snapshot = next(&mut late).await.kv_snapshot.expect("a late subscriber's first message has the snapshot");
    assert_eq!(snapshot.block_hashes.iter().copied().collect::<BTreeSet<_>>(), mirror.0);
}
