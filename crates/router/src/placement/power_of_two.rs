//! Power-of-two-choices placement: the less loaded ([`super::score::queued_work`]) of two
//! workers drawn at random. Nearly as balanced as least-load, without every router herding
//! onto the same momentarily idle worker.

use rand::Rng;

use super::PolicyKind;
use super::{Candidate, Policy, PromptShape, score};

pub struct PowerOfTwo;

impl Policy for PowerOfTwo {
    fn kind(&self) -> PolicyKind {
        PolicyKind::PowerOfTwo
    }

    fn choose(&self, candidates: &[Candidate], _prompt: PromptShape<'_>) -> usize {
        let n = candidates.len();
        if n == 1 {
            return 0;
        }
        let mut rng = rand::rng();
        let a = rng.random_range(0..n);
        let b = (a + rng.random_range(1..n)) % n;
        if score::queued_work(&candidates[b]) < score::queued_work(&candidates[a]) { b } else { a }
    }
}
