//! Engine counters: what the scheduler did, not what it intended.
//!
//! The engine thread is the only writer; any thread may read a [`StatsSnapshot`] at any time (a
//! service exports it as metrics and in load reports). Plain atomics: a reader may see one
//! counter a step newer than another, never a torn value.

use std::{
    collections::VecDeque,
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::Duration,
};

/// Recent step durations kept for percentiles.
const WINDOW: usize = 256;

#[derive(Default)]
pub struct Stats {
    /// Requests accepted and never admitted: the engine's waiting cap counts these (one atomic
    /// update at submission). Preempted sequences waiting to resume are not included.
    pub waiting_requests: AtomicU64,
    /// Tokens still to prefill of everything waiting, preempted sequences included.
    pub waiting_prompt_tokens: AtomicU64,
    pub running_requests: AtomicU64,
    pub kv_blocks_used: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    pub prefix_hit_tokens: AtomicU64,
    pub prefill_tokens: AtomicU64,
    pub decode_tokens: AtomicU64,
    pub steps: AtomicU64,
    pub decode_only_steps: AtomicU64,
    pub preemptions: AtomicU64,
    pub requests_finished: AtomicU64,
    pub requests_failed: AtomicU64,
    pub requests_cancelled: AtomicU64,
    /// Cumulative step time in microseconds, split by whether the step ran any prefill.
    pub prefill_step_us: AtomicU64,
    pub decode_step_us: AtomicU64,
    /// Recent decode-only step times (µs) and recent (tokens, µs) for rates.
    recent: Mutex<Recent>,
}

#[derive(Default)]
struct Recent {
    decode_step_us: VecDeque<u64>,
    /// (prefill tokens, decode tokens, step µs) of recent steps.
    steps: VecDeque<(u64, u64, u64)>,
}

/// A consistent-enough copy of the counters, plus derived rates.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StatsSnapshot {
    pub waiting_requests: u64,
    pub waiting_prompt_tokens: u64,
    pub running_requests: u64,
    pub kv_blocks_used: u64,
    pub kv_blocks_total: u64,
    pub prefix_hit_tokens: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    pub steps: u64,
    pub decode_only_steps: u64,
    pub preemptions: u64,
    pub requests_finished: u64,
    pub requests_failed: u64,
    pub requests_cancelled: u64,
    pub prefill_step_seconds: f64,
    pub decode_step_seconds: f64,
    pub decode_step_p50_ms: f64,
    pub decode_step_p99_ms: f64,
    /// Over the recent window of steps.
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
}

impl Stats {
    pub fn record_step(&self, prefill_tokens: usize, decode_tokens: usize, took: Duration) {
        let us = took.as_micros() as u64;
        self.steps.fetch_add(1, Relaxed);
        self.prefill_tokens.fetch_add(prefill_tokens as u64, Relaxed);
        self.decode_tokens.fetch_add(decode_tokens as u64, Relaxed);
        let mut r = self.recent.lock().expect("stats lock");
        if prefill_tokens == 0 {
            self.decode_only_steps.fetch_add(1, Relaxed);
            self.decode_step_us.fetch_add(us, Relaxed);
            r.decode_step_us.push_back(us);
            if r.decode_step_us.len() > WINDOW {
                r.decode_step_us.pop_front();
            }
        } else {
            self.prefill_step_us.fetch_add(us, Relaxed);
        }
        r.steps.push_back((prefill_tokens as u64, decode_tokens as u64, us));
        if r.steps.len() > WINDOW {
            r.steps.pop_front();
        }
    }

    pub fn snapshot(&self) -> StatsSnapshot {
        let r = self.recent.lock().expect("stats lock");
        let mut d: Vec<u64> = r.decode_step_us.iter().copied().collect();
        d.sort_unstable();
        let pct = |q: f64| {
            if d.is_empty() { 0.0 } else { d[((d.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0 }
        };
        let (p, dt, us) = r.steps.iter().fold((0, 0, 0), |a, s| (a.0 + s.0, a.1 + s.1, a.2 + s.2));
        let rate = |n: u64| if us == 0 { 0.0 } else { n as f64 * 1e6 / us as f64 };
        StatsSnapshot {
            waiting_requests: self.waiting_requests.load(Relaxed),
            waiting_prompt_tokens: self.waiting_prompt_tokens.load(Relaxed),
            running_requests: self.running_requests.load(Relaxed),
            kv_blocks_used: self.kv_blocks_used.load(Relaxed),
            kv_blocks_total: self.kv_blocks_total.load(Relaxed),
            prefix_hit_tokens: self.prefix_hit_tokens.load(Relaxed),
            prefill_tokens: self.prefill_tokens.load(Relaxed),
            decode_tokens: self.decode_tokens.load(Relaxed),
            steps: self.steps.load(Relaxed),
            decode_only_steps: self.decode_only_steps.load(Relaxed),
            preemptions: self.preemptions.load(Relaxed),
            requests_finished: self.requests_finished.load(Relaxed),
            requests_failed: self.requests_failed.load(Relaxed),
            requests_cancelled: self.requests_cancelled.load(Relaxed),
            prefill_step_seconds: self.prefill_step_us.load(Relaxed) as f64 / 1e6,
            decode_step_seconds: self.decode_step_us.load(Relaxed) as f64 / 1e6,
            decode_step_p50_ms: pct(0.5),
            decode_step_p99_ms: pct(0.99),
            prefill_tokens_per_s: rate(p),
            decode_tokens_per_s: rate(dt),
        }
    }
}
