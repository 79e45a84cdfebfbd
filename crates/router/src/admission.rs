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
//!
//! Each priority class has its own cap ([`Admission::cap`]), so overload refuses the lowest
//! class first: batch is refused from three quarters of `--max-waiting`, standard at it, and
//! interactive may use a reserve of an eighth more (at least one). Retry-After follows: the
//! time the queue needs to drain, halved for interactive, doubled for batch, so refused batch
//! clients come back after the others.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use bellows_common::priority::Priority;

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

    /// Admit one request of `class` if the cluster's queue, with the requests this router is
    /// admitting, is below the class's cap; `Err(retry_after)` otherwise.
    pub fn admit(&self, queue: QueueView, class: Priority) -> Result<Ticket, Duration> {
        let cap = self.cap(class);
        let admitted = self
            .admitting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |a| (queue.waiting_requests + a < cap).then_some(a + 1));
        match admitted {
            Ok(_) => Ok(Ticket(self.admitting.clone())),
            Err(_) => Err(retry_after(queue, class)),
        }
    }

    /// Check a request already holding a ticket (taken at the cap of its tenant's most urgent
    /// class, before its body said its class) against its own class's cap.
    pub fn recheck(&self, queue: QueueView, class: Priority) -> Result<(), Duration> {
        let admitting = self.admitting.load(Ordering::Acquire);
        if queue.waiting_requests + admitting <= self.cap(class) { Ok(()) } else { Err(retry_after(queue, class)) }
    }

    /// The waiting requests past which a request of `class` is refused (see the module docs).
    pub fn cap(&self, class: Priority) -> u64 {
        let m = self.max_waiting;
        match class {
            Priority::Interactive => m + (m / 8).max(1),
            Priority::Standard => m,
            Priority::Batch => (m * 3 / 4).max(1).min(m),
        }
    }

    /// How many more requests the cluster's queue has room for (for the most urgent class).
    pub fn room(&self, queue: QueueView) -> usize {
        self.cap(Priority::Interactive).saturating_sub(queue.waiting_requests) as usize
    }

    /// Of that room, the slots a request of `class` leaves to more urgent classes.
    pub fn reserve(&self, class: Priority) -> usize {
        (self.cap(Priority::Interactive) - self.cap(class)) as usize
    }
}

/// When the queue has likely drained: its prompt tokens over the cluster's prefill rate, at
/// least one second, at most a minute; halved for interactive requests, doubled for batch.
pub fn retry_after(queue: QueueView, class: Priority) -> Duration {
    let rate =
        if queue.prefill_tokens_per_s > 1.0 { queue.prefill_tokens_per_s } else { FALLBACK_PREFILL_TOKENS_PER_S };
    let factor = match class {
        Priority::Interactive => 0.5,
        Priority::Standard => 1.0,
        Priority::Batch => 2.0,
    };
    Duration::from_secs_f64(factor * queue.waiting_tokens as f64 / rate).clamp(Duration::from_secs(1), MAX_RETRY_AFTER)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_refuses_at_max_waiting_not_after() {
        let a = Admission::new(4);
        let q = |n| QueueView { waiting_requests: n, waiting_tokens: n * 100, prefill_tokens_per_s: 1000.0 };
        assert!(a.admit(q(3), Priority::Standard).is_ok());
        assert!(a.admit(q(4), Priority::Standard).is_err());
    }

    #[test]
    fn overload_refuses_batch_first_and_interactive_last() {
        let a = Admission::new(16);
        let q = |n| QueueView { waiting_requests: n, waiting_tokens: n * 100, prefill_tokens_per_s: 1000.0 };
        let admits = |n, class| a.admit(q(n), class).is_ok();
        assert_eq!([11, 12].map(|n| admits(n, Priority::Batch)), [true, false]);
        assert_eq!([15, 16].map(|n| admits(n, Priority::Standard)), [true, false]);
        assert_eq!([17, 18].map(|n| admits(n, Priority::Interactive)), [true, false]);
        assert_eq!(a.reserve(Priority::Batch), 6);
        assert_eq!(a.room(q(10)), 8);
        // The smallest cap still admits every class.
        let one = Admission::new(1);
        assert!(Priority::ALL.iter().all(|&c| one.cap(c) >= 1));
    }

    #[test]
    fn a_ticket_taken_at_the_interactive_cap_is_held_to_its_own_class_once_known() {
        let a = Admission::new(16);
        let q = QueueView { waiting_requests: 13, waiting_tokens: 1300, prefill_tokens_per_s: 1000.0 };
        let _ticket = a.admit(q, Priority::Interactive).expect("under the interactive cap");
        assert!(a.recheck(q, Priority::Standard).is_ok(), "14 of 16");
        assert!(a.recheck(q, Priority::Batch).is_err(), "14 past batch's 12");
    }

    #[test]
    fn a_refused_batch_request_is_told_to_come_back_later_than_an_interactive_one() {
        let q = QueueView { waiting_requests: 10, waiting_tokens: 20_000, prefill_tokens_per_s: 4000.0 };
        let after = Priority::ALL.map(|c| retry_after(q, c).as_secs());
        assert_eq!(after, [2, 5, 10]);
    }

    #[test]
    fn a_burst_cannot_pass_the_cap_before_its_requests_reach_a_worker() {
        let a = Admission::new(3);
        let idle = QueueView::default();
        let held: Vec<Ticket> = (0..3).map(|_| a.admit(idle, Priority::Standard).expect("room for three")).collect();
        assert!(
            a.admit(idle, Priority::Standard).is_err(),
            "the workers report nothing yet, but three are being admitted"
        );
        drop(held);
        assert!(a.admit(idle, Priority::Standard).is_ok(), "handed to workers (now in their counts), the tickets free");
    }

    #[test]
    fn retry_after_follows_the_queued_tokens_and_the_observed_rate() {
        let q = QueueView { waiting_requests: 10, waiting_tokens: 20_000, prefill_tokens_per_s: 4000.0 };
        let standard = |q| retry_after(q, Priority::Standard);
        assert_eq!(standard(q), Duration::from_secs(5));
        let idle = QueueView { waiting_tokens: 10, ..q };
        assert_eq!(standard(idle), Duration::from_secs(1));
        let huge = QueueView { waiting_tokens: u64::MAX / 2, ..q };
        assert_eq!(standard(huge), MAX_RETRY_AFTER);
    }
}
