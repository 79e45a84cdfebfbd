//! The one place where a worker's load and cache become a cost. Every policy that compares
//! workers uses these functions, so "load" means the same thing to all of them.
//!
//! The unit is prompt tokens of prefill work ahead of the new request's first token:
//! - the prompt tokens the worker would have to prefill (those not in its cache), plus
//! - the prompt tokens already waiting there (reported, or sent by this router since), plus
//! - a charge per sequence running or waiting there: each shares every forward pass it takes
//!   part in with the new request, for as long as it decodes.
//!
//! Comparing cache and load in the same unit is what lets load win: a worker holding a hot
//! prefix stops being chosen once its queue costs more than prefilling the prefix elsewhere,
//! and the worker that takes the overflow then caches the prefix too.

use super::{Candidate, PromptShape};

/// Prompt-token equivalent of one sequence running or waiting: each decode step spends one token
/// of the worker's batch budget per running sequence, for many steps, and a waiting one will do
/// the same once admitted (its prefill is counted in tokens; a prefix-cache hit leaves little).
/// 16 makes a worker running 64 sequences cost as much as about two 2 KB prompts waiting, which
/// is about what it delays a new prompt on the machines measured (docs/BENCHMARKS.md).
pub const SEQUENCE_COST: f64 = 16.0;

/// Work queued ahead of a new request, in prompt tokens.
pub fn queued_work(c: &Candidate) -> f64 {
    c.load.waiting_tokens as f64 + SEQUENCE_COST * f64::from(c.load.running + c.load.waiting_requests)
}

/// Prompt tokens the candidate would have to prefill for this prompt.
pub fn uncached_tokens(c: &Candidate, prompt: PromptShape<'_>) -> f64 {
    prompt.tokens.saturating_sub(c.cached_blocks * prompt.block_size) as f64
}

/// Queue plus own prefill: what the cache-aware policy minimizes.
pub fn total_cost(c: &Candidate, prompt: PromptShape<'_>) -> f64 {
    uncached_tokens(c, prompt) + queued_work(c)
}
