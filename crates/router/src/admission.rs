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

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use crate::cluster::QueueView;

/// Prefill rate assumed when workers have not measured one yet (idle since start).
const FALLBACK_PREFILL_TOKENS_PER_S: f64 = 1000.0;
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
pub struct Admission {
    pub max_waiting: u64,
    /// Requests admitted here and not yet handed to a worker: not in any worker's load yet, so
    /// counted here. Without them a burst arriving at once would all pass the check before the
    /// first one reaches a worker.
    admitting: Arc<AtomicU64>,
}

/// A request admitted under the cap and not yet handed to a worker; dropping it stops counting
/// it here. Dispatch drops it as soon as the worker link counts the request as pending (or the
/// request fails first), so at every moment exactly one of the two counts it.
#[derive(Debug)]
pub struct Ticket(Arc<AtomicU64>);

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    pub fn new(max_waiting: u64) -> Self {
        Admission { max_waiting, admitting: Arc::default() }
    }

    /// Admit one request if the cluster's queue, with the requests this router is admitting,
    /// is below the cap; `Err(retry_after)` otherwise.
    pub fn admit(&self, queue: QueueView) -> Result<Ticket, Duration> {
        let admitted = self.admitting.fetch_update(Ordering::AcqRel, Ordering::Acquire, |a| {
            (queue.waiting_requests + a < self.max_waiting).then_some(a + 1)
        });
        match admitted {
            Ok(_) => Ok(Ticket(self.admitting.clone())),
            Err(_) => Err(retry_after(queue)),
        }
    }

    /// How many more requests the cluster's queue has room for.
    pub fn room(&self, queue: QueueView) -> usize {
        self.max_waiting.saturating_sub(queue.waiting_requests) as usize
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
        let a = Admission::new(4);
        let q = |n| QueueView { waiting_requests: n, waiting_tokens: n * 100, prefill_tokens_per_s: 1000.0 };
        assert!(a.admit(q(3)).is_ok());
        assert!(a.admit(q(4)).is_err());
    }

    #[test]
    fn a_burst_cannot_pass_the_cap_before_its_requests_reach_a_worker() {
        let a = Admission::new(3);
        let idle = QueueView::default();
        let held: Vec<Ticket> = (0..3).map(|_| a.admit(idle).expect("room for three")).collect();
        assert!(a.admit(idle).is_err(), "the workers report nothing yet, but three are being admitted");
        drop(held);
        assert!(a.admit(idle).is_ok(), "handed to workers (now in their counts), the tickets free");
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
