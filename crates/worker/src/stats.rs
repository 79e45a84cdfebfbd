//! Engine counters: what the scheduler did, not what it intended.
//!
//! The engine thread is the only writer; any thread may read a [`StatsSnapshot`] at any time (a
//! service exports it as metrics and in load reports). Plain atomics: a reader may see one
//! counter a step newer than another, never a torn value. The step histograms live under the
//! same lock as the recent-steps window, so one snapshot of them is self-consistent.
//!
//! [`Stats::changed`] wakes whoever watches the gauges (the load sampler) when the engine did
//! something: a submission, or a pass of its loop. An idle engine notifies nothing, so an idle
//! node costs next to nothing to watch.

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
    /// Tokens still to prefill of everything waiting, preempted sequences included, less what the
    /// prefix cache held of each prompt when it was queued.
    pub waiting_prompt_tokens: AtomicU64,
    /// By priority class ([`bellows_common::priority::Priority::index`]): requests waiting, preempted ones included, and
    /// their tokens still to prefill (as `waiting_prompt_tokens`).
    pub waiting_by_priority: [(AtomicU64, AtomicU64); 3],
    pub running_requests: AtomicU64,
    pub kv_blocks_used: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    /// Prompt tokens served from the prefix cache, counted once per request at its first
    /// admission (a preempted sequence's re-admission is not a hit).
    pub prefix_hit_tokens: AtomicU64,
    /// Prompt tokens of admitted requests, counted at the same moment as `prefix_hit_tokens`, so
    /// their ratio is this worker's prefix-cache hit rate.
    pub prompt_tokens: AtomicU64,
    /// Tokens computed by prefill rows (cache hits excluded; recomputation after a preemption
    /// included): the forward-pass work, not the requests' prompts.
    pub prefill_tokens: AtomicU64,
    pub decode_tokens: AtomicU64,
    /// Tokens sampled and streamed to requests (a request's `completion_tokens`).
    pub generated_tokens: AtomicU64,
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
    /// Notified when the counters may have changed (see the module docs).
    changed: tokio::sync::Notify,
}

#[derive(Default)]
struct Recent {
    decode_step_us: VecDeque<u64>,
    /// (prefill tokens, decode tokens, step µs) of recent steps.
    steps: VecDeque<(u64, u64, u64)>,
    histograms: StepHistograms,
}

/// Upper bounds of the step-time buckets, seconds: 0.5 ms to about 4 s, doubling.
pub const STEP_SECONDS_BOUNDS: &[f64] =
    &[0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048, 4.096];
/// Upper bounds of the tokens-per-step buckets: 1 to 16384, doubling.
pub const BATCH_TOKENS_BOUNDS: &[f64] =
    &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0];
/// Upper bounds of the sequences-per-step buckets: 1 to 1024, doubling.
pub const BATCH_SEQUENCES_BOUNDS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0];

/// What one forward pass computed: only prefill chunks, only decode tokens, or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    Prefill,
    Decode,
    Mixed,
}

impl StepKind {
    pub const ALL: [StepKind; 3] = [StepKind::Prefill, StepKind::Decode, StepKind::Mixed];

    pub fn of(prefill_tokens: usize, decode_tokens: usize) -> StepKind {
        match (prefill_tokens, decode_tokens) {
            (0, _) => StepKind::Decode,
            (_, 0) => StepKind::Prefill,
            _ => StepKind::Mixed,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            StepKind::Prefill => "prefill",
            StepKind::Decode => "decode",
            StepKind::Mixed => "mixed",
        }
    }
}

/// A fixed-bucket histogram: counts per bucket (not cumulative; the last is above every bound,
/// i.e. +Inf), and the sum of the observed values.
#[derive(Debug, Clone)]
pub struct Histogram {
    pub bounds: &'static [f64],
    pub counts: Vec<u64>,
    pub sum: f64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: vec![0; bounds.len() + 1], sum: 0.0 }
    }

    pub fn observe(&mut self, v: f64) {
        let i = self.bounds.iter().position(|&b| v <= b).unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += v;
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }
}

/// Per-step distributions, for the metrics endpoint.
#[derive(Debug, Clone)]
pub struct StepHistograms {
    /// Step wall time in seconds, indexed like [`StepKind::ALL`].
    pub step_seconds: [Histogram; 3],
    /// Tokens one step computed (prefill chunks plus decode tokens).
    pub batch_tokens: Histogram,
    /// Rows (sequences) in one step.
    pub batch_sequences: Histogram,
}

impl Default for StepHistograms {
    fn default() -> Self {
        StepHistograms {
            step_seconds: StepKind::ALL.map(|_| Histogram::new(STEP_SECONDS_BOUNDS)),
            batch_tokens: Histogram::new(BATCH_TOKENS_BOUNDS),
            batch_sequences: Histogram::new(BATCH_SEQUENCES_BOUNDS),
        }
    }
}

impl StepHistograms {
    pub fn step_seconds(&self, kind: StepKind) -> &Histogram {
        &self.step_seconds[kind as usize]
    }
}

/// A consistent-enough copy of the counters, plus derived rates.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StatsSnapshot {
    pub waiting_requests: u64,
    pub waiting_prompt_tokens: u64,
    /// Requests and tokens waiting, by [`bellows_common::priority::Priority::index`].
    pub waiting_by_priority: [(u64, u64); 3],
    pub running_requests: u64,
    pub kv_blocks_used: u64,
    pub kv_blocks_total: u64,
    pub prefix_hit_tokens: u64,
    pub prompt_tokens: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    pub generated_tokens: u64,
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
    /// Distributions since the start (for metrics; not part of the JSON view).
    #[serde(skip)]
    pub histograms: StepHistograms,
}

impl Stats {
    /// The counters may have changed. Cheap with nobody waiting (a permit is stored, so the
    /// next wait returns at once: no change is missed).
    pub fn touch(&self) {
        self.changed.notify_one();
    }

    /// Wait until [`Stats::touch`] was called since the last wait returned.
    pub async fn changed(&self) {
        self.changed.notified().await;
    }

    /// One forward pass: its prefill and decode tokens, its rows, and how long it took.
    pub fn record_step(&self, prefill_tokens: usize, decode_tokens: usize, rows: usize, took: Duration) {
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
        let h = &mut r.histograms;
        h.step_seconds[StepKind::of(prefill_tokens, decode_tokens) as usize].observe(took.as_secs_f64());
        h.batch_tokens.observe((prefill_tokens + decode_tokens) as f64);
        h.batch_sequences.observe(rows as f64);
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
            waiting_by_priority: self.waiting_by_priority.each_ref().map(|(n, t)| (n.load(Relaxed), t.load(Relaxed))),
            running_requests: self.running_requests.load(Relaxed),
            kv_blocks_used: self.kv_blocks_used.load(Relaxed),
            kv_blocks_total: self.kv_blocks_total.load(Relaxed),
            prefix_hit_tokens: self.prefix_hit_tokens.load(Relaxed),
            prompt_tokens: self.prompt_tokens.load(Relaxed),
            prefill_tokens: self.prefill_tokens.load(Relaxed),
            decode_tokens: self.decode_tokens.load(Relaxed),
            generated_tokens: self.generated_tokens.load(Relaxed),
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
            histograms: r.histograms.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_lands_in_its_kind_and_in_the_first_bucket_that_holds_it() {
        let s = Stats::default();
        s.record_step(0, 8, 8, Duration::from_micros(1500)); // decode only
        s.record_step(100, 0, 1, Duration::from_millis(40)); // prefill only
        s.record_step(64, 8, 9, Duration::from_secs(10)); // both; above every bound
        let h = s.snapshot().histograms;
        let decode = h.step_seconds(StepKind::Decode);
        assert_eq!((decode.count(), decode.counts[2]), (1, 1), "1.5 ms falls in le=0.002");
        assert_eq!(h.step_seconds(StepKind::Prefill).counts[7], 1, "40 ms falls in le=0.064");
        let mixed = h.step_seconds(StepKind::Mixed);
        assert_eq!(mixed.counts[STEP_SECONDS_BOUNDS.len()], 1, "10 s is only in +Inf");
        assert!((mixed.sum - 10.0).abs() < 1e-9);
        assert_eq!(h.batch_tokens.count(), 3);
        assert_eq!(h.batch_tokens.sum, 180.0);
        assert_eq!(h.batch_tokens.counts[3], 1, "8 tokens fall in le=8");
        assert_eq!(h.batch_sequences.sum, 18.0);
        assert_eq!(h.batch_sequences.counts[0], 1, "one row falls in le=1");
    }
}
