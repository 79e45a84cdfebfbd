//! Which worker holds which KV block, as far as this router knows.
//!
//! Fed by two sources only: the workers' own KV events (reported entries, kept until the worker
//! says it evicted the block, its stream breaks, or the memory bound below trims them), and this
//! router's recent placements (provisional entries that expire after the placement memory).
//! Provisional entries make a burst of requests sharing a new prefix land together: without them
//! every request of the burst would be placed before the first one's blocks are reported, and
//! would scatter.
//!
//! **Memory bound.** Reported entries are bounded per worker and so for the whole router: a
//! worker keeps at most its *cap*, the smaller of its KV pool's size in blocks and its share of
//! the router's budget (`--prefix-index-entries` divided by the number of workers). Past its cap,
//! a worker's least recently used entries go first, approximated by a clock (second chance): an
//! entry is used when the worker reports it stored or when this router places a prompt on that
//! worker through it, and trimming passes over used entries once, clearing their mark, before
//! it forgets any. Marking an entry used costs a flag, so placement never pays for the order,
//! and the order is tidied only on the link's task, as reports arrive. A worker's
//! own evictions keep it under its pool size, so the pool bound bites only on a worker that
//! misreports; the share bites when the fleet's caches together outgrow the budget, and then the
//! router forgets each worker's coldest blocks, which costs placement a few hits, never a wrong
//! answer. A cap that shrinks (a worker joined) is applied at the worker's next report.
//! Provisional entries are outside the budget: they are bounded by what this router placed
//! within the placement memory, and leave in the order they expire.
//!
//! Every operation costs in proportion to the blocks it names: forgetting a worker walks that
//! worker's entries, not the index, and the sizes are counted, not summed at scrape time.

use std::{
    collections::{HashMap, VecDeque},
    time::{Duration, Instant},
};

use bellows_common::prefix_hash::BlockHash;
use bellows_proto::worker::v1 as pb;
use smallvec::SmallVec;

use super::WorkerId;

/// Block hashes are already uniform: a fast hasher is enough.
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

#[derive(Debug, Clone, Copy)]
enum Held {
    /// Reported by the worker; `stamp` names the entry in its worker's [`Clock`], and `used`
    /// is its second chance.
    Reported { stamp: u64, used: bool },
    /// Placed here by this router, assumed until then.
    Placed { until: Instant },
}

#[derive(Debug, Clone, Copy)]
struct Holder {
    worker: WorkerId,
    held: Held,
}

impl Holder {
    fn holds(&self, now: Instant) -> bool {
        match self.held {
            Held::Reported { .. } => true,
            Held::Placed { until } => until > now,
        }
    }
}

/// One worker's reported entries in the order the clock passes them, oldest first. An
/// `(hash, stamp)` whose block was since evicted (or evicted and stored again under a new
/// stamp) is stale: skipped when trimming, and dropped when stale ones outnumber live ones.
#[derive(Debug, Default)]
struct Clock {
    order: VecDeque<(u64, u64)>,
    live: usize,
    /// The worker's KV pool in blocks, from its last report (0: not known yet).
    pool_blocks: usize,
}

#[derive(Debug, Default)]
pub struct PrefixIndex {
    blocks: Map<u64, SmallVec<[Holder; 1]>>,
    workers: Map<WorkerId, Clock>,
    next_stamp: u64,
    reported: usize,
    placed: usize,
    /// Provisional entries by expiry, oldest first; one whose holder was since confirmed or
    /// extended is skipped when it comes due.
    expiries: VecDeque<(Instant, u64, WorkerId)>,
}

impl PrefixIndex {
    /// Apply one load-stream message (its snapshot, replacing what the worker had, then its
    /// events in order) and trim the worker to its cap: the smaller of its pool and `share`.
    /// Returns how many entries the cap trimmed.
    pub fn apply(&mut self, worker: WorkerId, msg: &pb::WatchLoadResponse, share: usize) -> usize {
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
        if let (Some(load), Some(clock)) = (&msg.load, self.workers.get_mut(&worker)) {
            clock.pool_blocks = load.kv_blocks_total as usize;
        }
        self.trim(worker, share)
    }

    /// The worker reported it cached this block (or used it again).
    pub fn stored(&mut self, worker: WorkerId, hash: u64) {
        let holders = self.blocks.entry(hash).or_default();
        let holder = holders.iter_mut().find(|h| h.worker == worker);
        if let Some(Holder { held: Held::Reported { used, .. }, .. }) = holder {
            *used = true;
            return;
        }
        self.next_stamp += 1;
        let held = Held::Reported { stamp: self.next_stamp, used: false };
        match holder {
            Some(h) => {
                h.held = held;
                self.placed -= 1;
            }
            None => holders.push(Holder { worker, held }),
        }
        self.reported += 1;
        let clock = self.workers.entry(worker).or_default();
        clock.live += 1;
        clock.order.push_back((hash, self.next_stamp));
    }

    /// The worker reported it evicted this block.
    pub fn evicted(&mut self, worker: WorkerId, hash: u64) {
        let Some(holders) = self.blocks.get_mut(&hash) else { return };
        let Some(i) = holders.iter().position(|h| h.worker == worker) else { return };
        match holders.swap_remove(i).held {
            Held::Reported { .. } => {
                self.reported -= 1;
                if let Some(clock) = self.workers.get_mut(&worker) {
                    clock.live -= 1;
                }
            }
            Held::Placed { .. } => self.placed -= 1,
        }
        if holders.is_empty() {
            self.blocks.remove(&hash);
        }
    }

    /// Everything the worker reported is void (it left, or its stream broke). Its provisional
    /// entries are left to expire.
    pub fn forget_worker(&mut self, worker: WorkerId) {
        let Some(clock) = self.workers.remove(&worker) else { return };
        for (hash, stamp) in clock.order {
            self.remove_if_current(worker, hash, stamp);
        }
    }

    /// The worker's reported entry for `hash`, if `stamp` names it (else the order entry is stale).
    fn current(&mut self, worker: WorkerId, hash: u64, stamp: u64) -> Option<&mut Holder> {
        let holders = self.blocks.get_mut(&hash)?;
        holders
            .iter_mut()
            .find(|h| h.worker == worker && matches!(h.held, Held::Reported { stamp: s, .. } if s == stamp))
    }

    /// Remove the worker's reported entry for `hash` if `stamp` names it.
    fn remove_if_current(&mut self, worker: WorkerId, hash: u64, stamp: u64) -> bool {
        if self.current(worker, hash, stamp).is_none() {
            return false;
        }
        let holders = self.blocks.get_mut(&hash).expect("just found");
        holders.retain(|h| h.worker != worker);
        if holders.is_empty() {
            self.blocks.remove(&hash);
        }
        self.reported -= 1;
        true
    }

    /// Trim the worker to its cap by the clock (a used entry loses its mark and goes to the
    /// back once; an unused one is forgotten), and drop stale order entries once they outnumber
    /// live ones (so the order stays within twice the live entries).
    fn trim(&mut self, worker: WorkerId, share: usize) -> usize {
        let Some(mut clock) = self.workers.remove(&worker) else { return 0 };
        let cap = if clock.pool_blocks > 0 { clock.pool_blocks.min(share) } else { share };
        let mut trimmed = 0;
        while clock.live > cap {
            let Some((hash, stamp)) = clock.order.pop_front() else { break };
            match self.current(worker, hash, stamp) {
                Some(Holder { held: Held::Reported { used: used @ true, .. }, .. }) => {
                    *used = false;
                    clock.order.push_back((hash, stamp));
                }
                Some(_) => {
                    self.remove_if_current(worker, hash, stamp);
                    clock.live -= 1;
                    trimmed += 1;
                }
                None => {}
            }
        }
        if clock.order.len() > 2 * clock.live + 64 {
            clock.order.retain(|&(hash, stamp)| self.current(worker, hash, stamp).is_some());
        }
        self.workers.insert(worker, clock);
        trimmed
    }

    /// This router just placed a prompt with these blocks on `worker`: blocks it reported are
    /// marked used, the others count as held there until the memory expires.
    pub fn remember(&mut self, worker: WorkerId, hashes: &[BlockHash], memory: Duration, now: Instant) {
        let until = now + memory;
        for h in hashes {
            let holders = self.blocks.entry(h.0).or_default();
            match holders.iter_mut().find(|x| x.worker == worker) {
                Some(Holder { held: Held::Reported { used, .. }, .. }) => {
                    *used = true;
                    continue;
                }
                Some(Holder { held: Held::Placed { until: t }, .. }) => *t = until,
                None => {
                    holders.push(Holder { worker, held: Held::Placed { until } });
                    self.placed += 1;
                }
            }
            self.expiries.push_back((until, h.0, worker));
        }
        self.expire(now);
    }

    /// Drop the provisional entries that expired by `now`: the cost follows what expired, not
    /// the index's size.
    fn expire(&mut self, now: Instant) {
        while let Some(&(until, hash, worker)) = self.expiries.front().filter(|e| e.0 <= now) {
            self.expiries.pop_front();
            let Some(holders) = self.blocks.get_mut(&hash) else { continue };
            let due = |h: &Holder| h.worker == worker && matches!(h.held, Held::Placed { until: t } if t <= until);
            let Some(i) = holders.iter().position(due) else { continue };
            holders.swap_remove(i);
            self.placed -= 1;
            if holders.is_empty() {
                self.blocks.remove(&hash);
            }
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

    /// The workers holding this block now (reported, or placed there within the memory).
    pub fn holders(&self, hash: u64, now: Instant) -> Vec<WorkerId> {
        self.blocks.get(&hash).map_or_else(Vec::new, |h| h.iter().filter(|h| h.holds(now)).map(|h| h.worker).collect())
    }

    /// (block, worker) entries held, reported and provisional: what the index's memory grows with.
    pub fn entries(&self) -> usize {
        self.reported + self.placed
    }

    /// Reported entries of one worker.
    #[cfg(test)]
    fn reported_by(&self, worker: WorkerId) -> usize {
        self.workers.get(&worker).map_or(0, |c| c.live)
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
    const MEMORY: Duration = Duration::from_secs(2);

    fn matches(index: &PrefixIndex, hashes: &[u64], now: Instant) -> Vec<usize> {
        let mut out = Vec::new();
        index.leading_matches(&h(hashes), &[A, B], now, &mut out);
        out
    }

    /// A load-stream message storing `hashes`, from a worker whose pool has `pool` blocks.
    fn stored(hashes: impl IntoIterator<Item = u64>, pool: u32) -> pb::WatchLoadResponse {
        pb::WatchLoadResponse {
            load: Some(pb::LoadReport { kv_blocks_total: pool, ..Default::default() }),
            kv_snapshot: None,
            kv_events: hashes.into_iter().map(|x| pb::KvEvent { kind: Some(pb::kv_event::Kind::Stored(x)) }).collect(),
        }
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
        assert_eq!(index.entries(), 3);
    }

    #[test]
    fn a_placement_counts_until_the_memory_expires_and_a_report_confirms_it_for_good() {
        let mut index = PrefixIndex::default();
        let now = Instant::now();
        index.remember(B, &h(&[1, 2]), MEMORY, now);
        assert_eq!(matches(&index, &[1, 2], now), vec![0, 2]);
        assert_eq!(matches(&index, &[1, 2], now + MEMORY * 2), vec![0, 0], "provisional entries expire");
        index.stored(B, 1);
        assert_eq!(matches(&index, &[1, 2], now + MEMORY * 2), vec![0, 1], "reported blocks do not expire");
        assert_eq!(index.entries(), 2, "one reported, one provisional not yet swept");
    }

    #[test]
    fn forgetting_a_worker_leaves_the_others_and_drops_empty_entries() {
        let mut index = PrefixIndex::default();
        index.stored(A, 1);
        index.stored(B, 1);
        index.stored(A, 2);
        index.forget_worker(A);
        assert_eq!(index.blocks.len(), 1);
        assert_eq!(index.entries(), 1);
        assert_eq!(matches(&index, &[1, 2], Instant::now()), vec![0, 1]);
    }

    #[test]
    fn expired_placements_are_dropped_so_the_index_stays_bounded() {
        let mut index = PrefixIndex::default();
        let memory = Duration::from_secs(1);
        let t0 = Instant::now();
        index.remember(A, &h(&[1, 2, 3]), memory, t0);
        index.remember(A, &h(&[4]), memory, t0 + memory * 3);
        assert_eq!(index.blocks.len(), 1, "only the live placement remains");
        assert_eq!(index.entries(), 1);
    }

    #[test]
    fn a_worker_past_its_share_loses_its_least_recently_used_blocks_first() {
        let mut index = PrefixIndex::default();
        let now = Instant::now();
        assert_eq!(index.apply(A, &stored(0..4, 1000), 4), 0);
        // Block 0, the hot prefix, is placed through again: it is the most recently used now.
        index.remember(A, &h(&[0]), MEMORY, now);
        assert_eq!(index.apply(A, &stored([4, 5], 1000), 4), 2);
        assert_eq!(index.reported_by(A), 4);
        let mut held: Vec<u64> = (0..6).filter(|&x| !index.holders(x, now).is_empty()).collect();
        held.sort_unstable();
        assert_eq!(held, vec![0, 3, 4, 5], "blocks 1 and 2 were the coldest");
    }

    #[test]
    fn a_worker_reporting_more_blocks_than_its_pool_holds_is_kept_to_its_pool() {
        let mut index = PrefixIndex::default();
        let trimmed = index.apply(A, &stored(0..100, 10), usize::MAX);
        assert_eq!(trimmed, 90);
        assert_eq!((index.reported_by(A), index.entries()), (10, 10));
        // Other workers are not touched by one worker's cap.
        index.apply(B, &stored(0..50, 1000), usize::MAX);
        assert_eq!(index.reported_by(B), 50);
    }

    #[test]
    fn churn_keeps_each_workers_order_within_twice_its_entries_and_a_snapshot_replaces_them() {
        let mut index = PrefixIndex::default();
        let now = Instant::now();
        index.apply(A, &stored(0..8, 100), 100);
        for round in 0..1000u64 {
            // A block stored and evicted again and again, and a hot block placed through.
            let mut msg = stored([1000 + round], 100);
            msg.kv_events.push(pb::KvEvent { kind: Some(pb::kv_event::Kind::Evicted(1000 + round)) });
            index.apply(A, &msg, 100);
            index.remember(A, &h(&[0, 1, 2, 3]), MEMORY, now);
        }
        let clock = &index.workers[&A];
        assert_eq!(clock.live, 8);
        assert!(
            clock.order.len() <= 2 * clock.live + 64 + 1,
            "{} order entries for {} live",
            clock.order.len(),
            clock.live
        );
        // A snapshot replaces everything the worker had.
        let mut snapshot = stored([], 100);
        snapshot.kv_snapshot = Some(pb::KvSnapshot { block_hashes: vec![7, 9] });
        index.apply(A, &snapshot, 100);
        assert_eq!(index.entries(), 2);
        assert!(index.holders(0, now).is_empty() && index.holders(9, now) == vec![A]);
    }
}
