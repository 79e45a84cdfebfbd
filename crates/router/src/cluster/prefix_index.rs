//! Which worker holds which KV block, as far as this router knows.
//!
//! Fed by two sources only: the workers' own KV events (confirmed entries, kept until the
//! worker says it evicted the block or its stream breaks), and this router's recent placements
//! (provisional entries that expire after the placement memory). Provisional entries make a
//! burst of requests sharing a new prefix land together: without them every request of the
//! burst would be placed before the first one's blocks are reported, and would scatter.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use bellows_common::prefix_hash::BlockHash;
use bellows_proto::worker::v1 as pb;

use super::WorkerId;

#[derive(Debug, Clone, Copy)]
struct Holder {
    worker: WorkerId,
    /// `None`: reported by the worker. `Some(t)`: placed here by this router, assumed until `t`.
    until: Option<Instant>,
}

impl Holder {
    fn holds(&self, now: Instant) -> bool {
        self.until.is_none_or(|t| t > now)
    }
}

#[derive(Debug, Default)]
pub struct PrefixIndex {
    blocks: HashMap<u64, Vec<Holder>>,
    last_sweep: Option<Instant>,
}

impl PrefixIndex {
    /// Apply one load-stream message: its snapshot (replacing what the worker had), then its
    /// events in order.
    pub fn apply(&mut self, worker: WorkerId, msg: &pb::WatchLoadResponse) {
        if let Some(snapshot) = &msg.kv_snapshot {
            self.forget_worker(worker);
            for &h in &snapshot.block_hashes {
                self.stored(worker, h);
            }
        }
        for event in &msg.kv_events {
            match event.kind {
                Some(pb::kv_event::Kind::Stored(h)) => self.stored(worker, h),
                Some(pb::kv_event::Kind::Evicted(h)) => self.evicted(worker, h),
                None => {}
            }
        }
    }

    /// The worker reported it cached this block.
    pub fn stored(&mut self, worker: WorkerId, hash: u64) {
        let holders = self.blocks.entry(hash).or_default();
        match holders.iter_mut().find(|h| h.worker == worker) {
            Some(h) => h.until = None,
            None => holders.push(Holder { worker, until: None }),
        }
    }

    /// The worker reported it evicted this block.
    pub fn evicted(&mut self, worker: WorkerId, hash: u64) {
        if let Some(holders) = self.blocks.get_mut(&hash) {
            holders.retain(|h| h.worker != worker);
            if holders.is_empty() {
                self.blocks.remove(&hash);
            }
        }
    }

    /// Everything known about a worker is void (it left, or its stream broke).
    pub fn forget_worker(&mut self, worker: WorkerId) {
        self.blocks.retain(|_, holders| {
            holders.retain(|h| h.worker != worker);
            !holders.is_empty()
        });
    }

    /// This router just placed a prompt with these blocks on `worker`.
    pub fn remember(&mut self, worker: WorkerId, hashes: &[BlockHash], memory: Duration, now: Instant) {
        let until = now + memory;
        for h in hashes {
            let holders = self.blocks.entry(h.0).or_default();
            match holders.iter_mut().find(|h| h.worker == worker) {
                Some(Holder { until: Some(t), .. }) => *t = until,
                Some(Holder { until: None, .. }) => {}
                None => holders.push(Holder { worker, until: Some(until) }),
            }
        }
        // Expired provisional entries are dropped in one pass per memory period, which bounds
        // them to what was placed in the last two periods.
        if self.last_sweep.is_none_or(|t| now.duration_since(t) >= memory) {
            self.blocks.retain(|_, holders| {
                holders.retain(|h| h.holds(now));
                !holders.is_empty()
            });
            self.last_sweep = Some(now);
        }
    }

    /// For each of `workers`, how many of the prompt's leading blocks it holds. A block counts
    /// only if every block before it does too: a worker reuses a cached prefix, not islands.
    pub fn leading_matches(&self, hashes: &[BlockHash], workers: &[WorkerId], now: Instant, out: &mut Vec<usize>) {
        out.clear();
        out.resize(workers.len(), 0);
        for (i, h) in hashes.iter().enumerate() {
            let Some(holders) = self.blocks.get(&h.0) else { break };
            let mut alive = 0;
            for (w, matched) in workers.iter().zip(out.iter_mut()) {
                if *matched == i && holders.iter().any(|x| x.worker == *w && x.holds(now)) {
                    *matched = i + 1;
                    alive += 1;
                }
            }
            if alive == 0 {
                break;
            }
        }
    }

    /// Distinct blocks known.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.blocks.len()
    }

    /// The workers holding this block now (reported, or placed there within the memory).
    pub fn holders(&self, hash: u64, now: Instant) -> Vec<WorkerId> {
        self.blocks.get(&hash).map_or_else(Vec::new, |h| h.iter().filter(|h| h.holds(now)).map(|h| h.worker).collect())
    }

    /// (block, worker) entries held: what the index's memory grows with.
    pub fn entries(&self) -> usize {
        self.blocks.values().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(xs: &[u64]) -> Vec<BlockHash> {
        xs.iter().map(|&x| BlockHash(x)).collect()
    }

    const A: WorkerId = WorkerId(1);
    const B: WorkerId = WorkerId(2);

    fn matches(index: &PrefixIndex, hashes: &[u64], now: Instant) -> Vec<usize> {
        let mut out = Vec::new();
        index.leading_matches(&h(hashes), &[A, B], now, &mut out);
        out
    }

    #[test]
    fn only_a_leading_run_of_held_blocks_counts() {
        let mut index = PrefixIndex::default();
        let now = Instant::now();
        for x in [10, 11, 13] {
            index.stored(A, x);
        }
        index.stored(B, 10);
        // A lacks block 12, so block 13 is no use to it.
        assert_eq!(matches(&index, &[10, 11, 12, 13], now), vec![2, 1]);
        index.evicted(A, 10);
        assert_eq!(matches(&index, &[10, 11], now), vec![0, 1]);
    }

    #[test]
    fn a_placement_counts_until_the_memory_expires_and_a_report_confirms_it_for_good() {
        let mut index = PrefixIndex::default();
        let now = Instant::now();
        let memory = Duration::from_secs(2);
        index.remember(B, &h(&[1, 2]), memory, now);
        assert_eq!(matches(&index, &[1, 2], now), vec![0, 2]);
        assert_eq!(matches(&index, &[1, 2], now + memory * 2), vec![0, 0], "provisional entries expire");
        index.stored(B, 1);
        assert_eq!(matches(&index, &[1, 2], now + memory * 2), vec![0, 1], "reported blocks do not expire");
    }

    #[test]
    fn forgetting_a_worker_leaves_the_others_and_drops_empty_entries() {
        let mut index = PrefixIndex::default();
        index.stored(A, 1);
        index.stored(B, 1);
        index.stored(A, 2);
        index.forget_worker(A);
        assert_eq!(index.len(), 1);
        assert_eq!(matches(&index, &[1, 2], Instant::now()), vec![0, 1]);
    }

    #[test]
    fn expired_placements_are_swept_so_the_index_stays_bounded() {
        let mut index = PrefixIndex::default();
        let memory = Duration::from_secs(1);
        let t0 = Instant::now();
        index.remember(A, &h(&[1, 2, 3]), memory, t0);
        index.remember(A, &h(&[4]), memory, t0 + memory * 3);
        assert_eq!(index.len(), 1, "only the live placement remains");
    }
}
