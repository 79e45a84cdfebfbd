//! `bellows-bench kv-ingest`: how many KV block events one router thread takes in a second.
//!
//! The load-stream messages of `--workers` workers are encoded up front, as a worker sends
//! them: each carries `--events` events, half blocks stored and half the oldest blocks of that
//! worker evicted, so every worker's cache stays at `--pool-blocks` (the steady state of a full
//! KV cache under churn). The timed loop does what the router's link task does with each: decode
//! the protobuf, take the model's index lock and apply the events, under the index's memory bound
//! (`--budget` entries over all workers). gRPC framing and the socket are not included.

use std::{sync::Mutex, time::Instant};

use bellows_proto::worker::v1 as pb;
use bellows_router::cluster::{WorkerId, prefix_index::PrefixIndex};
use prost::Message;
use serde::Serialize;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value_t = 1000)]
    workers: u64,
    /// Each worker's KV pool, in blocks.
    #[arg(long, default_value_t = 2000)]
    pool_blocks: u64,
    /// Events per load-stream message.
    #[arg(long, default_value_t = 64)]
    events: u64,
    /// Messages per worker, timed.
    #[arg(long, default_value_t = 100)]
    messages: u64,
    /// The index's budget over all workers (`--prefix-index-entries`).
    #[arg(long, default_value_t = 1_500_000)]
    budget: usize,
}

#[derive(Serialize)]
struct Report {
    events: u64,
    seconds: f64,
    events_per_s: f64,
    prefix_index_entries: usize,
    trimmed: usize,
}

/// A block hash of worker `w`, numbered `n` in the order it cached them.
fn block(w: u64, n: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&[w.to_le_bytes(), n.to_le_bytes()].concat())
}

fn message(w: u64, first: u64, args: &Args) -> Vec<u8> {
    let stored = (first..first + args.events / 2).map(|n| pb::kv_event::Kind::Stored(block(w, n)));
    let evicted = (first..first + args.events / 2).map(|n| pb::kv_event::Kind::Evicted(block(w, n - args.pool_blocks)));
    let load = pb::LoadReport { kv_blocks_total: args.pool_blocks as u32, ..Default::default() };
    pb::WatchLoadResponse {
        load: Some(load),
        kv_snapshot: None,
        kv_events: stored.chain(evicted).map(|k| pb::KvEvent { kind: Some(k) }).collect(),
    }
    .encode_to_vec()
}

pub fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(args.events >= 2 && args.workers > 0, "need at least two events and one worker");
    let index = Mutex::new(PrefixIndex::default());
    let share = args.budget / args.workers as usize;
    // Every worker's cache starts full.
    for w in 0..args.workers {
        let snapshot = pb::KvSnapshot { block_hashes: (0..args.pool_blocks).map(|n| block(w, n)).collect() };
        let msg = pb::WatchLoadResponse { load: None, kv_snapshot: Some(snapshot), kv_events: Vec::new() };
        index.lock().expect("index lock").apply(WorkerId(w), &msg, share);
    }
    let per_message = args.events / 2;
    let wire: Vec<(u64, Vec<u8>)> = (0..args.messages)
        .flat_map(|m| (0..args.workers).map(move |w| (w, m)))
        .map(|(w, m)| (w, message(w, args.pool_blocks + m * per_message, &args)))
        .collect();
    let (started, mut trimmed) = (Instant::now(), 0);
    for (w, bytes) in &wire {
        let msg = pb::WatchLoadResponse::decode(bytes.as_slice())?;
        trimmed += index.lock().expect("index lock").apply(WorkerId(*w), &msg, share);
    }
    let seconds = started.elapsed().as_secs_f64();
    let events = wire.len() as u64 * per_message * 2;
    let report = Report {
        events,
        seconds,
        events_per_s: events as f64 / seconds,
        prefix_index_entries: index.lock().expect("index lock").entries(),
        trimmed,
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}
