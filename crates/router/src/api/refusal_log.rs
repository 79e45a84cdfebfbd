//! At most one log line a second for refused requests, however many are refused.
//!
//! A retry storm against a full cluster is refused at tens of thousands of requests a second;
//! a line for each (hundreds of bytes) would swamp the log pipeline and cost more than the
//! refusal itself. Every refusal is still counted in `/metrics`
//! (`bellows_router_requests_total{status}`, `bellows_router_refusals_total{reason}`); the log
//! keeps one example a second and says how many it stands for.

use std::sync::atomic::{AtomicU64, Ordering};

/// Logs one refusal per interval, counting the ones it leaves out.
#[derive(Debug)]
pub struct RefusalLog {
    interval_ms: u64,
    /// When the last line was written, in ms since `epoch` (0: never).
    last_ms: AtomicU64,
    /// Refusals since the last line, not logged.
    skipped: AtomicU64,
    epoch: std::time::Instant,
}

impl Default for RefusalLog {
    fn default() -> Self {
        RefusalLog::new(1000)
    }
}

impl RefusalLog {
    pub fn new(interval_ms: u64) -> Self {
        RefusalLog {
            interval_ms,
            last_ms: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            epoch: std::time::Instant::now(),
        }
    }

    /// Whether this refusal gets a line; if so, how many since the last line did not.
    pub fn sample(&self) -> Option<u64> {
        let now = self.epoch.elapsed().as_millis() as u64 + 1;
        let last = self.last_ms.load(Ordering::Relaxed);
        let due = last == 0 || now >= last + self.interval_ms;
        if due && self.last_ms.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            return Some(self.skipped.swap(0, Ordering::Relaxed));
        }
        self.skipped.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_gets_one_line_and_the_next_line_counts_the_rest() {
        let log = RefusalLog::new(60_000);
        assert_eq!(log.sample(), Some(0), "the first refusal is logged");
        for _ in 0..999 {
            assert_eq!(log.sample(), None);
        }
        // A new interval: the next line says how many it stands for.
        let later = RefusalLog { last_ms: AtomicU64::new(1), ..RefusalLog::new(0) };
        later.skipped.store(999, Ordering::Relaxed);
        assert_eq!(later.sample(), Some(999));
        assert_eq!(later.sample(), Some(0));
    }
}
