//! The token bucket behind every per-minute limit. What it holds to: the refill is exact integer
//! arithmetic (600 a minute gives one more request every 100 ms, not 99 or 101), the level may
//! go below zero (a debt), and it can be read without taking from it.
//!
//! Why not the governor crate: its GCRA cannot go into debt (completion tokens must be charged,
//! not asked for), cannot be read without taking from it (the headers go on every response),
//! and cannot change its rate without losing its state (a reload or a change of share must not
//! hand out a fresh minute). The bucket here is a few lines of integer arithmetic: levels are
//! kept in units of 1/(1000 × 60e9) token, so a refill over any number of nanoseconds is exact
//! for a whole limit (and within a thousandth of a token per minute for a share of one), and
//! the tests below and in [`super::limits`] check it to the token.

use std::time::{Duration, Instant};

const NANOS_PER_MINUTE: i128 = 60_000_000_000;
/// Rates are kept in thousandths of a token per minute, so a share (1/3 of 100) keeps its
/// fraction.
const MILLI: f64 = 1000.0;
const UNITS_PER_TOKEN: i128 = 1000 * NANOS_PER_MINUTE;
/// The wait reported for a limit of 0 (the tenant is suspended): nothing will free.
pub(super) const SUSPENDED_RETRY_AFTER: Duration = Duration::from_secs(60);

/// A continuous token bucket holding one minute of `limit × share`, in fixed point.
#[derive(Debug, Clone)]
pub(super) struct Bucket {
    /// Per minute, for all routers together (the file's number).
    pub(super) limit: u64,
    share: f64,
    /// Units per nanosecond (= thousandths of a token per minute).
    rate: i128,
    capacity: i128,
    /// Below zero: a debt.
    level: i128,
    at: Instant,
}

impl Bucket {
    pub(super) fn new(limit: u64, share: f64, now: Instant) -> Self {
        let rate = rate_of(limit, share);
        let capacity = rate * NANOS_PER_MINUTE;
        Bucket { limit, share, rate, capacity, level: capacity, at: now }
    }

    pub(super) fn advance(&mut self, now: Instant) {
        if now > self.at {
            let dt = i128::try_from(now.duration_since(self.at).as_nanos()).unwrap_or(i128::MAX);
            self.level = self.level.saturating_add(dt.saturating_mul(self.rate)).min(self.capacity);
            self.at = now;
        }
    }

    /// New limits (a reload) or a new share (routers joined or left), keeping what was spent:
    /// the amount used in the last minute stays used, scaled to the new share.
    pub(super) fn reconfigure(&mut self, limit: u64, share: f64, now: Instant) {
        if limit == self.limit && share == self.share {
            return;
        }
        self.advance(now);
        let used = (self.capacity - self.level) as f64 * (share / self.share);
        self.rate = rate_of(limit, share);
        self.capacity = self.rate * NANOS_PER_MINUTE;
        self.level = (self.capacity - used.round() as i128).min(self.capacity);
        self.limit = limit;
        self.share = share;
    }

    /// What taking `n` needs in the bucket: `n`, or a full bucket when `n` is more than it holds.
    fn need(&self, n: u64) -> i128 {
        (i128::from(n) * UNITS_PER_TOKEN).min(self.capacity)
    }

    /// `None` when `n` can be taken now, else how long until it can.
    pub(super) fn wait(&self, n: u64) -> Option<Duration> {
        if self.rate == 0 {
            return Some(SUSPENDED_RETRY_AFTER);
        }
        let missing = self.need(n) - self.level;
        (missing > 0).then(|| nanos(ceil_div(missing, self.rate)))
    }

    pub(super) fn take(&mut self, n: u64) {
        self.level = self.level.saturating_sub(i128::from(n) * UNITS_PER_TOKEN);
    }

    pub(super) fn give_back(&mut self, n: u64) {
        self.level = self.level.saturating_add(i128::from(n) * UNITS_PER_TOKEN).min(self.capacity);
    }

    /// Whole tokens left, scaled to the whole limit (all routers), at most the limit.
    pub(super) fn remaining_overall(&self) -> u64 {
        if self.level <= 0 {
            return 0;
        }
        let local = self.level as f64 / UNITS_PER_TOKEN as f64;
        ((local / self.share).floor() as u64).min(self.limit)
    }

    pub(super) fn until_full(&self) -> Duration {
        if self.rate == 0 { Duration::ZERO } else { nanos(ceil_div(self.capacity - self.level, self.rate)) }
    }
}

fn rate_of(limit: u64, share: f64) -> i128 {
    if limit == 0 { 0 } else { ((limit as f64 * share * MILLI).round() as i128).max(1) }
}

fn ceil_div(a: i128, b: i128) -> i128 {
    (a + b - 1).div_euclid(b)
}

fn nanos(n: i128) -> Duration {
    Duration::from_nanos(u64::try_from(n.max(0)).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refill_is_exact_to_the_nanosecond() {
        let t0 = Instant::now();
        let mut b = Bucket::new(7, 1.0, t0);
        b.take(7);
        // 7 a minute: one every 60/7 s, rounded up to the nanosecond.
        let one = b.wait(1).unwrap();
        assert_eq!(one, Duration::from_nanos(8_571_428_572));
        b.advance(t0 + one - Duration::from_nanos(1));
        assert!(b.wait(1).is_some());
        b.advance(t0 + one);
        assert_eq!(b.wait(1), None);
    }

    #[test]
    fn an_overdraft_is_a_debt_the_refill_pays_back_first() {
        let t0 = Instant::now();
        let mut b = Bucket::new(60, 1.0, t0);
        b.take(90);
        assert_eq!(b.remaining_overall(), 0);
        // 30 owed plus the 1 asked for, at one a second.
        assert_eq!(b.wait(1), Some(Duration::from_secs(31)));
        assert_eq!(b.until_full(), Duration::from_secs(90));
    }
}
