//! The global queue cap: refuse new requests while the cluster already has `--max-waiting`
//! requests waiting for a worker.
//!
//! The count is the workers' own reports plus what this router sent that those reports do not
//! show yet ([`crate::cluster::Cluster::queue`]). The check runs before the body is even read,
//! so a refusal costs no parsing, tokenization or worker time, and answers at once: under
//! overload a fast 503 with a useful Retry-After beats a slow timeout, and leaves the capacity
//! to the requests already admitted. Several routers share no state: each may overshoot the cap
//! by what it sends between two load reports (docs/BENCHMARKS.md measures it). Each worker's
//! own `--max-waiting` stays the hard backstop.

use std::time::Duration;

use crate::cluster::QueueView;

/// Prefill rate assumed when workers have not measured one yet (idle since start).
const FALLBACK_PREFILL_TOKENS_PER_S: f64 = 1000.0;
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy)]
pub struct Admission {
    pub max_waiting: u64,
}

impl Admission {
    /// How many more requests the cluster's queue has room for.
    pub fn room(&self, queue: QueueView) -> usize {
        self.max_waiting.saturating_sub(queue.waiting_requests) as usize
    }

    /// `Err(retry_after)` when the cluster's queue is full.
    pub fn check(&self, queue: QueueView) -> Result<(), Duration> {
        if queue.waiting_requests < self.max_waiting { Ok(()) } else { Err(retry_after(queue)) }
    }
}

/// When the queue has likely drained: its prompt tokens over the cluster's prefill rate, at
/// least one second, at most a minute.
pub fn retry_after(queue: QueueView) -> Duration {
    let rate =
        if queue.prefill_tokens_per_s > 1.0 { queue.prefill_tokens_per_s } else { FALLBACK_PREFILL_TOKENS_PER_S };
    Duration::from_secs_f64(queue.waiting_tokens as f64 / rate).clamp(Duration::from_secs(1), MAX_RETRY_AFTER)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_refuses_at_max_waiting_not_after() {
        let a = Admission { max_waiting: 4 };
        let q = |n| QueueView { waiting_requests: n, waiting_tokens: n * 100, prefill_tokens_per_s: 1000.0 };
        assert!(a.check(q(3)).is_ok());
        assert!(a.check(q(4)).is_err());
    }

    #[test]
    fn retry_after_follows_the_queued_tokens_and_the_observed_rate() {
        let q = QueueView { waiting_requests: 10, waiting_tokens: 20_000, prefill_tokens_per_s: 4000.0 };
        assert_eq!(retry_after(q), Duration::from_secs(5));
        let idle = QueueView { waiting_tokens: 10, ..q };
        assert_eq!(retry_after(idle), Duration::from_secs(1));
        let huge = QueueView { waiting_tokens: u64::MAX / 2, ..q };
        assert_eq!(retry_after(huge), MAX_RETRY_AFTER);
    }
}
