//! Placement: which worker serves a request.
//!
//! Each policy is one file behind [`Policy`]; how a worker's load and cache turn into a number
//! is decided once, in [`score`], so policies differ only in which parts of the score they use
//! and how they pick. [`place`] gathers the candidates (placeable workers not yet tried by this
//! request), asks the policy, and remembers the choice in the prefix index.

pub mod cache_aware;
pub mod least_load;
pub mod power_of_two;
pub mod round_robin;
pub mod score;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use bellows_common::prefix_hash::BlockHash;

use crate::cluster::{Load, ModelPool, WorkerId, WorkerLink, ring::Ring};

/// How a request picks its worker among those serving its model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Prefer the worker that already holds the prompt's leading KV blocks, unless its queue
    /// costs more than prefilling elsewhere.
    CacheAware,
    /// Each worker in turn.
    RoundRobin,
    /// The worker with the least queued work.
    LeastLoad,
    /// The less loaded of two workers drawn at random.
    PowerOfTwo,
}

impl PolicyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::LeastLoad => "least_load",
            PolicyKind::PowerOfTwo => "power_of_two",
        }
    }
}

/// A worker that could take the request.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub worker: WorkerId,
    /// A hash of the worker's node id: the same on every router, unlike [`WorkerId`].
    pub stable_id: u64,
    pub load: Load,
    /// Leading prompt blocks the worker holds (0 unless the policy asks for prefix matching).
    pub cached_blocks: usize,
}

/// What placement needs to know about the prompt.
#[derive(Debug, Clone, Copy)]
pub struct PromptShape<'a> {
    pub tokens: usize,
    pub block_size: usize,
    pub hashes: &'a [BlockHash],
}

pub trait Policy: Send + Sync {
    fn kind(&self) -> PolicyKind;

    /// Whether [`Candidate::cached_blocks`] must be filled in (it costs an index lookup).
    fn uses_prefix_cache(&self) -> bool {
        false
    }

    /// The index of the chosen candidate; `candidates` is never empty.
    fn choose(&self, candidates: &[Candidate], prompt: PromptShape<'_>) -> usize;

    /// In a pool of more than [`PROBE_ABOVE`] workers, a policy may look at a few of them
    /// only: the workers holding the block this key names plus the first [`PROBES`] workers
    /// met walking the pool's ring from the key (the same on every router). `None`: look at
    /// every worker.
    fn probe_key(&self, _prompt: PromptShape<'_>) -> Option<u64> {
        None
    }
}

/// Pools up to this size are scanned whole; larger ones are probed (see [`Policy::probe_key`]),
/// so placement costs the same with a thousand workers as with a few dozen.
pub const PROBE_ABOVE: usize = 64;
/// Workers probed besides the holders.
pub const PROBES: usize = 16;

pub fn policy(kind: PolicyKind) -> Box<dyn Policy> {
    match kind {
        PolicyKind::CacheAware => Box::new(cache_aware::CacheAware::default()),
        PolicyKind::RoundRobin => Box::new(round_robin::RoundRobin::default()),
        PolicyKind::LeastLoad => Box::new(least_load::LeastLoad::default()),
        PolicyKind::PowerOfTwo => Box::new(power_of_two::PowerOfTwo),
    }
}

/// The outcome of a placement.
#[derive(Debug, Clone)]
pub struct Placement {
    pub worker: Arc<WorkerLink>,
    pub cached_blocks: usize,
    pub candidates: usize,
    /// The chosen worker's score parts (see [`score`]), for traces.
    pub uncached_tokens: f64,
    pub queued_work: f64,
}

/// Choose a worker of `pool` for a prompt, skipping `exclude` (workers this request already
/// tried). `None`: no placeable worker.
pub fn place(
    pool: &ModelPool,
    policy: &dyn Policy,
    prompt: PromptShape<'_>,
    exclude: &[WorkerId],
    memory: Duration,
) -> Option<Placement> {
    let now = Instant::now();
    let key = policy.probe_key(prompt);
    let holders = match key {
        Some(k) => pool.index.lock().expect("prefix index lock").holders(k, now),
        None => Vec::new(),
    };
    let (links, mut candidates): (Vec<Arc<WorkerLink>>, Vec<Candidate>) = pool.with_ring(|workers, ring| {
        let probed =
            key.filter(|_| workers.len() > PROBE_ABOVE).map(|k| probe(workers, ring, |w| w.id, k, &holders, exclude));
        let pick: Box<dyn Iterator<Item = &Arc<WorkerLink>>> = match &probed {
            Some(chosen) => Box::new(chosen.iter().map(|&i| &workers[i])),
            None => Box::new(workers.iter()),
        };
        pick.filter(|w| !exclude.contains(&w.id))
            .filter_map(|w| {
                w.load()
                    .map(|load| (w.clone(), Candidate { worker: w.id, stable_id: w.stable_id, load, cached_blocks: 0 }))
            })
            .unzip()
    });
    if candidates.is_empty() {
        return None;
    }
    if policy.uses_prefix_cache() && !prompt.hashes.is_empty() {
        let ids: Vec<WorkerId> = candidates.iter().map(|c| c.worker).collect();
        let mut matched = Vec::with_capacity(ids.len());
        pool.index.lock().expect("prefix index lock").leading_matches(prompt.hashes, &ids, now, &mut matched);
        for (c, m) in candidates.iter_mut().zip(matched) {
            c.cached_blocks = m;
        }
    }
    let i = policy.choose(&candidates, prompt);
    let chosen = &candidates[i];
    if policy.uses_prefix_cache() && !prompt.hashes.is_empty() {
        pool.index.lock().expect("prefix index lock").remember(chosen.worker, prompt.hashes, memory, now);
    }
    Some(Placement {
        worker: links[i].clone(),
        cached_blocks: chosen.cached_blocks,
        candidates: candidates.len(),
        uncached_tokens: score::uncached_tokens(chosen, prompt),
        queued_work: score::queued_work(chosen),
    })
}

/// The workers to look at in a large pool, as indices into `workers` (sorted by id): the first
/// [`PROBES`] met walking the ring from `key` that neither hold its block nor were tried, then
/// the holders. A retry so probes as many fresh workers, and the cost is a binary search and a
/// short walk, whatever the pool's size.
fn probe<W>(
    workers: &[W],
    ring: &Ring,
    id: impl Fn(&W) -> WorkerId,
    key: u64,
    holders: &[WorkerId],
    exclude: &[WorkerId],
) -> Vec<usize> {
    let mut chosen: Vec<usize> = Vec::with_capacity(PROBES + holders.len());
    for i in ring.walk(key) {
        if chosen.len() == PROBES {
            break;
        }
        let w = id(&workers[i]);
        if !chosen.contains(&i) && !exclude.contains(&w) && !holders.contains(&w) {
            chosen.push(i);
        }
    }
    chosen.extend(holders.iter().filter_map(|h| workers.binary_search_by_key(h, &id).ok()));
    chosen
}

/// The candidate with the lowest `cost`; ties go to the first at or after `start` (rotating
/// `start` spreads ties instead of piling them on the first worker).
pub(crate) fn lowest(candidates: &[Candidate], start: usize, cost: impl Fn(&Candidate) -> f64) -> usize {
    let n = candidates.len();
    let mut best = start % n;
    let mut best_cost = cost(&candidates[best]);
    for k in 1..n {
        let i = (start + k) % n;
        let c = cost(&candidates[i]);
        if c < best_cost {
            best = i;
            best_cost = c;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use bellows_common::prefix_hash::{ChainRoot, prefix_block_hashes};

    use super::*;

    fn cand(id: u64, waiting_tokens: u64, running: u32, cached_blocks: usize) -> Candidate {
        Candidate {
            worker: WorkerId(id),
            stable_id: 1000 + id,
            load: Load { waiting_tokens, running, max_running: 64, ..Load::default() },
            cached_blocks,
        }
    }

    const PROMPT: PromptShape<'static> = PromptShape { tokens: 600, block_size: 16, hashes: &[] };

    /// The block hashes of a 432-token prompt (27 full blocks) of tenant `tenant`.
    fn tenant_prompt(tenant: u32) -> Vec<BlockHash> {
        let tokens: Vec<u32> = (0..432).map(|i| tenant * 1000 + i).collect();
        prefix_block_hashes(&tokens, 16, ChainRoot::new(b"model"))
    }

    fn shape(hashes: &[BlockHash]) -> PromptShape<'_> {
        PromptShape { tokens: hashes.len() * 16, block_size: 16, hashes }
    }

    #[test]
    fn a_large_pool_is_probed_by_its_holders_and_the_same_first_ranked_few_on_every_router() {
        let workers: Vec<(WorkerId, u64)> = (0..1000).map(|i| (WorkerId(i), 77 + i * 31)).collect();
        let ring = Ring::new(workers.iter().map(|w| w.1));
        let holders = [WorkerId(5), WorkerId(900)];
        let chosen = probe(&workers, &ring, |w| w.0, 42, &holders, &[]);
        assert_eq!(chosen.len(), PROBES + holders.len());
        assert!(chosen.contains(&5) && chosen.contains(&900), "every holder is probed");
        // Another router knows the same workers in another order and under other ids.
        let other: Vec<(WorkerId, u64)> =
            workers.iter().rev().enumerate().map(|(k, &(_, s))| (WorkerId(5000 + k as u64), s)).collect();
        let other_ring = Ring::new(other.iter().map(|w| w.1));
        let stable = |list: &[(WorkerId, u64)], picked: &[usize]| {
            let mut s: Vec<u64> = picked.iter().map(|&i| list[i].1).collect();
            s.sort_unstable();
            s
        };
        let theirs = probe(&other, &other_ring, |w| w.0, 42, &[WorkerId(5994), WorkerId(5099)], &[]);
        assert_eq!(stable(&workers, &chosen), stable(&other, &theirs), "the same workers on every router");
        // A retry probes as many again, none of them tried.
        let tried: Vec<WorkerId> = chosen.iter().map(|&i| workers[i].0).filter(|w| !holders.contains(w)).collect();
        let retry = probe(&workers, &ring, |w| w.0, 42, &holders, &tried);
        assert_eq!(retry.len(), PROBES + holders.len());
        assert!(retry.iter().all(|&i| !tried.contains(&workers[i].0)));
        // Other keys, mostly other workers: load spreads over the pool. (Keys whose points
        // fall near each other on the ring share a run of workers; few do.)
        let mut probed = [0u32; 1000];
        let (mut shared, mut close) = (0, 0);
        for key in 43..1043 {
            let elsewhere = probe(&workers, &ring, |w| w.0, key, &[], &[]);
            let common = elsewhere.iter().filter(|i| chosen.contains(i)).count();
            shared += common;
            close += usize::from(common >= PROBES / 2);
            elsewhere.iter().for_each(|&i| probed[i] += 1);
        }
        assert!(shared < 1000, "{shared} workers shared with 1,000 other keys");
        assert!(close < 30, "{close} of 1,000 keys share half their probes");
        // 16,000 probes over 1,000 workers: 16 each on average, none left out or piled on.
        let (least, most) = (probed.iter().min().unwrap(), probed.iter().max().unwrap());
        assert!(*least >= 1 && *most <= 64, "probed between {least} and {most} times");
    }

    #[test]
    fn cache_aware_prefers_the_worker_holding_the_prefix_when_queues_are_even() {
        let p = policy(PolicyKind::CacheAware);
        let hashes = tenant_prompt(1);
        let c = [cand(0, 100, 2, 0), cand(1, 100, 2, 26), cand(2, 100, 2, 0)];
        for _ in 0..5 {
            assert_eq!(p.choose(&c, shape(&hashes)), 1);
        }
    }

    #[test]
    fn load_wins_over_affinity_once_the_holders_queue_is_far_past_the_mean() {
        let p = policy(PolicyKind::CacheAware);
        let hashes = tenant_prompt(1);
        // Worker 1 holds 416 of the 432 tokens but has 2,128 tokens of work queued; worker 0 is idle.
        let c = [cand(0, 0, 0, 0), cand(1, 2000, 8, 26)];
        assert_eq!(p.choose(&c, shape(&hashes)), 0);
        // With a short queue the cached worker still wins.
        let c = [cand(0, 0, 0, 0), cand(1, 200, 2, 26)];
        assert_eq!(p.choose(&c, shape(&hashes)), 1);
    }

    #[test]
    fn a_holder_keeps_its_prefix_until_its_extra_queue_outweighs_the_prefill_it_saves() {
        let hashes = tenant_prompt(1);
        let p = policy(PolicyKind::CacheAware);
        // The holder saves 416 tokens of prefill: 400 more tokens queued is still worth it...
        let c = [cand(0, 200, 0, 0), cand(1, 200, 0, 0), cand(2, 600, 0, 26)];
        for _ in 0..4 {
            assert_eq!(p.choose(&c, shape(&hashes)), 2);
        }
        // ...450 more is not: the prompt goes to the same one of the others every time.
        let c = [cand(0, 200, 0, 0), cand(1, 200, 0, 0), cand(2, 650, 0, 26)];
        let spill = p.choose(&c, shape(&hashes));
        assert_ne!(spill, 2);
        for _ in 0..4 {
            assert_eq!(p.choose(&c, shape(&hashes)), spill);
        }
    }

    #[test]
    fn an_overloaded_prefix_spills_to_the_same_second_worker_on_every_router() {
        let hashes = tenant_prompt(7);
        let p = policy(PolicyKind::CacheAware);
        let c = [cand(0, 5000, 0, 26), cand(1, 100, 0, 0), cand(2, 150, 0, 0), cand(3, 90, 0, 0)];
        let spill = c[p.choose(&c, shape(&hashes))].stable_id;
        assert_ne!(spill, c[0].stable_id, "the overloaded holder is skipped");
        // Another router: other local ids, another order, slightly different views of the load.
        let mut other: Vec<Candidate> = c.iter().rev().cloned().collect();
        for (k, x) in other.iter_mut().enumerate() {
            x.worker = WorkerId(40 + k as u64);
            if x.cached_blocks == 0 {
                x.load.waiting_tokens += 30 * k as u64;
            }
        }
        for _ in 0..4 {
            assert_eq!(other[p.choose(&other, shape(&hashes))].stable_id, spill);
        }
    }

    #[test]
    fn new_prefixes_get_stable_homes_spread_over_the_workers() {
        let p = policy(PolicyKind::CacheAware);
        let c = [cand(0, 0, 0, 0), cand(1, 0, 0, 0), cand(2, 0, 0, 0), cand(3, 0, 0, 0)];
        let mut per_worker = [0; 4];
        for tenant in 0..200 {
            let hashes = tenant_prompt(tenant);
            let home = p.choose(&c, shape(&hashes));
            assert_eq!(p.choose(&c, shape(&hashes)), home, "the same prefix goes home again");
            per_worker[home] += 1;
        }
        assert!(per_worker.iter().all(|&n| (25..=75).contains(&n)), "homes spread: {per_worker:?}");
    }

    #[test]
    fn ties_are_spread_rather_than_piled_on_the_first_worker() {
        for kind in [PolicyKind::CacheAware, PolicyKind::LeastLoad, PolicyKind::RoundRobin] {
            let p = policy(kind);
            let c = [cand(0, 0, 0, 0), cand(1, 0, 0, 0), cand(2, 0, 0, 0)];
            let mut seen = [0; 3];
            for _ in 0..30 {
                seen[p.choose(&c, PROMPT)] += 1;
            }
            assert_eq!(seen, [10, 10, 10], "{kind:?}");
        }
    }

    #[test]
    fn least_load_and_power_of_two_avoid_the_loaded_worker() {
        let c = [cand(0, 5000, 10, 0), cand(1, 0, 0, 0)];
        assert_eq!(policy(PolicyKind::LeastLoad).choose(&c, PROMPT), 1);
        for _ in 0..20 {
            assert_eq!(policy(PolicyKind::PowerOfTwo).choose(&c, PROMPT), 1, "with two workers both are drawn");
        }
    }
}
