//! WatchLoad: the node's load and prefix-cache changes, pushed to every router that listens.
//!
//! Routers place requests from these reports alone (no polling, no /metrics scraping), so a
//! report must be prompt and a cache mirror must be exact:
//! - One sampler per node reads the engine's counters when the engine says they may have changed
//!   (a submission, a step) or the node starts draining, at most every [`SAMPLE_EVERY`] and at
//!   least every [`REFRESH`], and
//!   publishes a new report when a gauge changed (queue, running, KV use, draining). Rates and
//!   step-time percentiles ride along but do not by themselves count as a change: they move
//!   every step. An idle engine says nothing, so an idle node's sampler sleeps.
//! - Each subscriber gets a message on every published change, on every batch of KV events, and
//!   at least every [`HEARTBEAT`] otherwise, so a silent stream means a dead worker.
//! - The first message carries the snapshot of cached block hashes taken together with the event
//!   subscription (the engine takes both in one step), so snapshot + events is exactly the cache:
//!   nothing is missed or counted twice.

use std::{pin::Pin, sync::Arc, time::Duration};

use bellows_common::priority::Priority;
use bellows_proto::worker::v1 as pb;
use tokio::{
    sync::{mpsc, watch},
    time::Instant,
};
use tokio_stream::{Stream, wrappers::ReceiverStream};
use tonic::Status;

use super::drain::{Lifecycle, Phase};
use crate::{
    engine::{EngineHandle, KvSubscription},
    kv_cache::KvEvent,
    stats::StatsSnapshot,
};

/// The sampler reads the engine's counters at most this often (a busy engine changes them every
/// step)...
pub const SAMPLE_EVERY: Duration = Duration::from_millis(10);
/// ... and at least this often, so the rates a report carries stay fresh.
pub const REFRESH: Duration = Duration::from_secs(1);
/// The longest a subscriber waits between two messages.
pub const HEARTBEAT: Duration = Duration::from_millis(250);

pub type LoadStream = Pin<Box<dyn Stream<Item = Result<pb::WatchLoadResponse, Status>> + Send>>;

/// The node's caps, reported with every load report.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    pub max_waiting: u32,
    pub max_running: u32,
}

pub fn report(s: &StatsSnapshot, caps: Caps, draining: bool) -> pb::LoadReport {
    pb::LoadReport {
        waiting_requests: s.waiting_requests as u32,
        waiting_prompt_tokens: s.waiting_prompt_tokens,
        running_requests: s.running_requests as u32,
        kv_blocks_used: s.kv_blocks_used as u32,
        kv_blocks_total: s.kv_blocks_total as u32,
        decode_step_p50_ms: s.decode_step_p50_ms,
        decode_step_p99_ms: s.decode_step_p99_ms,
        prefill_tokens_per_s: s.prefill_tokens_per_s,
        decode_tokens_per_s: s.decode_tokens_per_s,
        max_waiting: caps.max_waiting,
        max_running: caps.max_running,
        draining,
        sequence: 0,
        waiting_by_priority: Priority::ALL
            .into_iter()
            .zip(s.waiting_by_priority)
            .filter(|(_, (n, _))| *n > 0)
            .map(|(p, (n, tokens))| pb::ClassQueue {
                priority: pb::Priority::from(p) as i32,
                waiting_requests: n as u32,
                waiting_prompt_tokens: tokens,
            })
            .collect(),
    }
}

/// The gauges whose change triggers a report.
fn gauges(r: &pb::LoadReport) -> (u32, u64, u32, u32, u32, bool) {
    (r.waiting_requests, r.waiting_prompt_tokens, r.running_requests, r.kv_blocks_used, r.kv_blocks_total, r.draining)
}

/// Start the node's sampler; it stops when the node closes.
pub fn spawn_sampler(engine: EngineHandle, caps: Caps, lifecycle: Arc<Lifecycle>) -> watch::Receiver<pb::LoadReport> {
    let mut phase = lifecycle.watch();
    let watched = engine.clone();
    let sample = move || report(&engine.stats(), caps, lifecycle.phase() >= Phase::Draining);
    let (tx, rx) = watch::channel(sample());
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = watched.stats_changed() => {}
                r = phase.changed() => if r.is_err() { return },
                _ = tokio::time::sleep(REFRESH) => {}
                _ = tx.closed() => return,
            }
            let next = sample();
            // Rates are refreshed silently; a changed gauge wakes the subscribers.
            tx.send_if_modified(|cur| {
                let changed = gauges(cur) != gauges(&next);
                *cur = next;
                changed
            });
            // A change during this pause is kept by the notification, not lost.
            tokio::time::sleep(SAMPLE_EVERY).await;
        }
    });
    rx
}

/// One subscriber's stream: snapshot first, then reports and KV events until the node closes or
/// the subscriber goes away.
pub async fn subscribe(
    engine: &EngineHandle,
    mut load: watch::Receiver<pb::LoadReport>,
    lifecycle: Arc<Lifecycle>,
) -> Result<LoadStream, super::status::NodeError> {
    let KvSubscription { snapshot, mut events } =
        engine.subscribe_kv().await.map_err(super::status::NodeError::Submit)?;
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        let mut phase = lifecycle.watch();
        let mut sequence = 0u64;
        let mut snapshot = Some(pb::KvSnapshot { block_hashes: snapshot.iter().map(|h| h.0).collect() });
        let mut pending: Vec<pb::KvEvent> = Vec::new();
        loop {
            let mut msg = pb::WatchLoadResponse {
                load: Some(load.borrow_and_update().clone()),
                kv_snapshot: snapshot.take(),
                kv_events: std::mem::take(&mut pending),
            };
            sequence += 1;
            if let Some(l) = msg.load.as_mut() {
                l.sequence = sequence;
            }
            tokio::select! {
                sent = tx.send(Ok(msg)) => if sent.is_err() {
                    return; // the subscriber went away; dropping `events` unsubscribes
                },
                _ = phase.wait_for(|&p| p == Phase::Closed) => return,
            }
            let heartbeat = tokio::time::sleep_until(Instant::now() + HEARTBEAT);
            tokio::select! {
                _ = heartbeat => {}
                r = load.changed() => if r.is_err() { return },
                batch = events.recv() => match batch {
                    Some(batch) => {
                        pending.extend(batch.iter().map(kv_event));
                        while let Ok(more) = events.try_recv() {
                            pending.extend(more.iter().map(kv_event));
                        }
                    }
                    None => return, // the engine stopped
                },
                _ = phase.wait_for(|&p| p == Phase::Closed) => return,
                _ = tx.closed() => return,
            }
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

fn kv_event(e: &KvEvent) -> pb::KvEvent {
    use pb::kv_event::Kind;
    pb::KvEvent {
        kind: Some(match e {
            KvEvent::Stored(h) => Kind::Stored(h.0),
            KvEvent::Evicted(h) => Kind::Evicted(h.0),
        }),
    }
}
