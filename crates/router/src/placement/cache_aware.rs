//! Cache-aware placement: keep each prompt prefix on the workers that hold it, as long as that
//! costs the cluster little balance.
//!
//! Picking the lowest [`score::total_cost`] alone fails in practice: a cold tenant's prompt
//! wanders to whichever worker is momentarily shortest, is computed and cached again there, and
//! evicts other tenants' prompts (docs/BENCHMARKS.md measured 78% of the achievable hits). So the
//! policy is bounded-load affinity with stable homes:
//! - A worker is *eligible* while its queued work is at most [`SPILL_FACTOR`] times the mean plus
//!   one whole prompt. The least loaded worker is always eligible, and no worker is given work
//!   far past its share.
//! - A *holder* holds the prompt's *home block*: the block at depth [`HOME_BLOCK`], past any
//!   chat-template header that tenants share. The best holder is the eligible one with the lowest
//!   total cost, so a hot prefix is balanced across the workers that hold it.
//! - The prompt's *home* is the eligible non-holder ranked first by a rendezvous hash of the home
//!   block and the worker's node id. Every router ranks alike, so a prefix's overflow settles on
//!   the same next worker instead of scattering, and a prefix evicted everywhere returns to where
//!   it was.
//! - The best holder wins unless the home's total cost is lower, that is, unless the holder's
//!   queue is longer by more than the prefill the cache saves. That spill keeps one tenant sending
//!   half the traffic from piling onto its first worker.
//!
//! Workers report their waiting tokens net of cache hits, and this router counts its pending
//! requests the same way, so queue noise is a few tokens per request, not a whole prompt.

use std::sync::atomic::{AtomicUsize, Ordering};

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::PolicyKind;
use super::{Candidate, Policy, PromptShape, lowest, score};

/// How far past the mean queue an eligible worker may be (plus one prompt).
pub const SPILL_FACTOR: f64 = 1.25;
/// The home block's depth in blocks (prompts with fewer full blocks use their last one).
pub const HOME_BLOCK: usize = 8;

#[derive(Default)]
pub struct CacheAware {
    tie_break: AtomicUsize,
}

impl Policy for CacheAware {
    fn kind(&self) -> PolicyKind {
        PolicyKind::CacheAware
    }

    fn uses_prefix_cache(&self) -> bool {
        true
    }

    /// Probe by the home block: its holders, and the workers its rendezvous ranks first, among
    /// them the home. A prompt shorter than a block probes a random few.
    fn probe_key(&self, prompt: PromptShape<'_>) -> Option<u64> {
        let depth = prompt.hashes.len().min(HOME_BLOCK);
        Some(if depth == 0 { rand::random() } else { prompt.hashes[depth - 1].0 })
    }

    fn choose(&self, candidates: &[Candidate], prompt: PromptShape<'_>) -> usize {
        let start = self.tie_break.fetch_add(1, Ordering::Relaxed);
        let cost = |c: &Candidate| score::total_cost(c, prompt);
        let depth = prompt.hashes.len().min(HOME_BLOCK);
        if depth == 0 {
            // Shorter than a block: nothing to keep together.
            return lowest(candidates, start, cost);
        }
        let mean = candidates.iter().map(score::queued_work).sum::<f64>() / candidates.len() as f64;
        let bound = SPILL_FACTOR * mean + prompt.tokens as f64;
        let eligible = |c: &Candidate| score::queued_work(c) <= bound;
        let holds_home = |c: &Candidate| c.cached_blocks >= depth;

        let holder = candidates
            .iter()
            .any(|c| eligible(c) && holds_home(c))
            .then(|| lowest(candidates, start, |c| if eligible(c) && holds_home(c) { cost(c) } else { f64::INFINITY }));
        let key = prompt.hashes[depth - 1].0;
        let home = (0..candidates.len())
            .filter(|&i| eligible(&candidates[i]) && !holds_home(&candidates[i]))
            .max_by_key(|&i| xxh3_64_with_seed(&candidates[i].stable_id.to_le_bytes(), key));
        match (holder, home) {
            (Some(h), Some(n)) if cost(&candidates[n]) < cost(&candidates[h]) => n,
            (Some(h), _) => h,
            (None, Some(n)) => n,
            (None, None) => unreachable!("the least loaded worker is always eligible"),
        }
    }
}
