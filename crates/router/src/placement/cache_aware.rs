//! Cache-aware placement: the worker where the request's first token is expected soonest,
//! counting both the prompt it would have to prefill there and the work queued there
//! ([`super::score::total_cost`]). Affinity wins while queues are even; load wins once a hot
//! worker's queue costs more than a cold prefill elsewhere.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Candidate, Policy, PromptShape, lowest, score};
use crate::args::PolicyKind;

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

    fn choose(&self, candidates: &[Candidate], prompt: PromptShape<'_>) -> usize {
        let start = self.tie_break.fetch_add(1, Ordering::Relaxed);
        lowest(candidates, start, |c| score::total_cost(c, prompt))
    }
}
