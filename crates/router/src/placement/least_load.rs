//! Least-load placement: the worker with the least queued work ([`super::score::queued_work`]),
//! ignoring caches.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::PolicyKind;
use super::{Candidate, Policy, PromptShape, lowest, score};

#[derive(Default)]
pub struct LeastLoad {
    tie_break: AtomicUsize,
}

impl Policy for LeastLoad {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LeastLoad
    }

    fn choose(&self, candidates: &[Candidate], _prompt: PromptShape<'_>) -> usize {
        let start = self.tie_break.fetch_add(1, Ordering::Relaxed);
        lowest(candidates, start, score::queued_work)
    }
}
