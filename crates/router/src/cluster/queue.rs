//! The cluster-wide queue, kept as running totals.
//!
//! Admission reads the queue on every request; summing every link's load there would cost a
//! pass over the fleet per request (8.6% of the router's profile with 1,000 workers). Instead
//! each link publishes what it adds (its worker's waiting work while placeable, nothing
//! otherwise) whenever that changes, as a difference against what it published before, so a
//! read costs three loads whatever the fleet's size. The totals are exact: every link withdraws
//! what it published when it goes down or is dropped.

use std::sync::atomic::{AtomicI64, Ordering};

/// Requests waiting for a worker across the cluster, for admission.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct QueueView {
    pub waiting_requests: u64,
    pub waiting_tokens: u64,
    /// Summed recent prefill rate of the placeable workers.
    pub prefill_tokens_per_s: f64,
}

/// One link's share of the queue, as last published. The prefill rate is kept in thousandths
/// of a token a second, so adding and withdrawing it is exact.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Share {
    pub requests: i64,
    pub tokens: i64,
    pub prefill_milli: i64,
}

impl Share {
    pub fn new(requests: u64, tokens: u64, prefill_tokens_per_s: f64) -> Share {
        Share {
            requests: requests as i64,
            tokens: tokens as i64,
            prefill_milli: (prefill_tokens_per_s.max(0.0) * 1000.0) as i64,
        }
    }
}

#[derive(Debug, Default)]
pub struct QueueTotals {
    requests: AtomicI64,
    tokens: AtomicI64,
    prefill_milli: AtomicI64,
}

impl QueueTotals {
    /// A link's share changed from `before` to `after`.
    pub(super) fn shift(&self, before: Share, after: Share) {
        self.requests.fetch_add(after.requests - before.requests, Ordering::Relaxed);
        self.tokens.fetch_add(after.tokens - before.tokens, Ordering::Relaxed);
        self.prefill_milli.fetch_add(after.prefill_milli - before.prefill_milli, Ordering::Relaxed);
    }

    pub fn view(&self) -> QueueView {
        let get = |a: &AtomicI64| a.load(Ordering::Relaxed).max(0) as u64;
        QueueView {
            waiting_requests: get(&self.requests),
            waiting_tokens: get(&self.tokens),
            prefill_tokens_per_s: get(&self.prefill_milli) as f64 / 1000.0,
        }
    }
}
