//! Round-robin placement: each placeable worker in turn, blind to load and cache.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::PolicyKind;
use super::{Candidate, Policy, PromptShape};

#[derive(Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn kind(&self) -> PolicyKind {
        PolicyKind::RoundRobin
    }

    fn choose(&self, candidates: &[Candidate], _prompt: PromptShape<'_>) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % candidates.len()
    }
}
