//! The continuous batcher: one forward pass per tick under a token budget.
//!
//! Each tick:
//! 1. drops requests whose caller went away (their blocks return to the pool at once);
//! 2. admits waiting requests, by class and then oldest first, while running slots and KV blocks
//!    allow, reusing every cached leading block of the prompt. A request that does not fit may
//!    take the slot and blocks of lower-class requests that have produced no token yet (they wait
//!    again, first in their class, and start over: a client that has seen nothing loses
//!    nothing); a streaming one is never taken. Batch requests leave the last
//!    [`batch_reserve`] running slots free, so an arrival of a higher class finds a slot even when
//!    batch work fills the worker;
//! 3. gives every decoding sequence one token, growing its blocks; when the pool is empty the
//!    *newest* running sequence of the lowest class is preempted (blocks freed, re-prefilled
//!    later), never an out-of-memory and never the oldest, which is closest to done;
//! 4. fills the rest of `max_batch_tokens` with prefill chunks, starting at a different
//!    prefilling sequence each tick, so a long prompt can neither starve a short one nor hold
//!    running streams for more than one chunk. With `itl_slowdown` set, the prefill share of a
//!    step that also decodes is steered so the step takes at most that multiple of a decode-only
//!    step: running streams keep their pace, long prompts take longer;
//! 5. runs the model once, samples every row that reached its end, and streams each request's
//!    text to its own channel. Rows with a grammar (structured outputs) have their token masks
//!    computed on the compute pool before the forward pass, and applied before sampling; a
//!    step with no such row does no mask work, so unconstrained traffic pays nothing.
//!
//! All per-request state lives in [`Sequence`], found by position only within one tick; a
//! request finishing mid-batch cannot shift another's sampler, stop strings or channel.

use std::{
    collections::{HashMap, VecDeque},
    panic::{AssertUnwindSafe, catch_unwind},
    sync::{Arc, atomic::Ordering::Relaxed},
    time::Instant,
};

use bellows_common::{
    constraint::ConstraintError,
    prefix_hash::{BlockHash, ChainRoot, block_hash, prefix_block_hashes},
    priority::Priority,
};
use tokio::sync::mpsc::UnboundedSender;

use crate::{
    constraint::{Grammar, TokenMask},
    kv_cache::{BlockId, BlockPool, KvEvent},
    model::{Backend, BatchRow, rows::for_each_mut},
    request::{Event, FinishReason, Progress, TokenLogprobs, Usage},
    sampling::{Sampler, logprobs},
    stats::Stats,
    stop::{StopCheck, StopMatcher},
    tokenizer::Detokenizer,
    vocab::Vocab,
};

/// One row's mask for a step, or why its grammar allows nothing.
type MaskResult = Result<TokenMask, ConstraintError>;

/// Scheduling knobs.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct SchedulerConfig {
    /// Tokens per KV block (the prefix-cache granularity, shared with the router). Default 16.
    pub block_size: usize,
    /// Tokens one forward pass may carry: decode tokens plus prefill chunks. Default 256.
    /// Smaller keeps inter-token latency steadier while long prompts arrive; larger prefills faster.
    pub max_batch_tokens: usize,
    /// Sequences admitted at once (prefilling or decoding). Default 64; at most `max_batch_tokens`.
    pub max_running: usize,
    /// New requests that may wait for admission; more are refused at once. Default 256.
    pub max_waiting: usize,
    /// When set (e.g. 1.5), a step that mixes prefill with decoding may take at most this multiple
    /// of a decode-only step; the prefill tokens per step adapt to hold it. Default off: prefill
    /// takes whatever `max_batch_tokens` leaves.
    pub itl_slowdown: Option<f64>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig { block_size: 16, max_batch_tokens: 256, max_running: 64, max_waiting: 256, itl_slowdown: None }
    }
}

/// Running slots batch requests leave free for higher classes: an eighth of `max_running`, at
/// least one when there are two or more.
pub fn batch_reserve(max_running: usize) -> usize {
    if max_running < 2 { 0 } else { max_running.div_ceil(8) }
}

/// Steers the prefill tokens of mixed steps so that they stay *under* `slowdown` x the
/// decode-only step time: it bounds the tail of the streams' inter-token gaps, not their mean.
///
/// Why a model and not a plain feedback loop: on a CPU one prefill token costs a sizeable
/// fraction of a decode step (4-6 ms next to 30 ms for the default model on 2 cores), so only a few
/// tokens fit under the bound and the budget is coarse. A loop that grows the budget whenever a step
/// came in under the bound keeps retrying the one-too-many budget, and every retry is a step over
/// the bound: the mean sits at the bound and the tail above it. Instead the governor estimates
/// what one prefill token costs and takes the largest budget predicted to fit:
///
/// - `decode_step` (d): the smoothed decode-only step time. Decode steps slow down as running
///   contexts grow, and a long prefill leaves no decode-only step to measure, so every
///   `PROBE_EVERY` mixed steps one step runs without prefill to refresh it; otherwise a stale, fast
///   reference would pin prefill at one token a step while the streams themselves slow down.
/// - `token_cost` (c): the marginal cost of one prefill token, `(step - d) / prefill tokens`. A step
///   over the bound raises it at once to that step's sample; a step within the bound lowers it by
///   only 1/8 of the difference. So c follows the upper envelope of the cost (noise spikes
///   included) and drifts down slowly: the budget shrinks at once and grows cautiously.
/// - budget = floor((slowdown - 1) x d / c), between 1 (prefill must progress) and the batch budget.
///
/// Invariants (checked without a clock in the tests below): a step over the bound leaves a budget
/// smaller than that step's prefill tokens (or 1), and nothing but a probe showing slower decode
/// steps or later steps within the bound grows it again; at a steady cost the budget settles at
/// the largest one whose steps fit under the bound, and no step after that goes over.
struct PrefillGovernor {
    slowdown: f64,
    /// Smoothed decode-only step time, seconds.
    decode_step: Option<f64>,
    /// Marginal seconds per prefill token in a mixed step: raised at once, lowered slowly.
    token_cost: Option<f64>,
    budget: usize,
    mixed_since_probe: usize,
}

impl PrefillGovernor {
    /// Prefill tokens of the first mixed step, before any cost has been seen.
    const START: usize = 1;
    const PROBE_EVERY: usize = 16;
    /// How far one step within the bound moves the cost estimate toward its sample.
    const RELAX: f64 = 1.0 / 8.0;

    fn new(slowdown: f64) -> Self {
        PrefillGovernor { slowdown, decode_step: None, token_cost: None, budget: Self::START, mixed_since_probe: 0 }
    }

    /// Prefill tokens the next step (which also decodes) may carry; `None` = no limit yet.
    fn limit(&self) -> Option<usize> {
        self.decode_step?;
        Some(if self.mixed_since_probe >= Self::PROBE_EVERY { 0 } else { self.budget })
    }

    fn observe(&mut self, prefill_tokens: usize, decode_tokens: usize, secs: f64, max: usize) {
        if prefill_tokens == 0 {
            self.decode_step = Some(self.decode_step.map_or(secs, |d| 0.5 * d + 0.5 * secs));
            self.mixed_since_probe = 0;
        } else if decode_tokens > 0 {
            self.mixed_since_probe += 1;
            let Some(d) = self.decode_step else { return };
            let sample = ((secs - d) / prefill_tokens as f64).max(0.0);
            self.token_cost = Some(match self.token_cost {
                Some(c) if secs > self.slowdown * d => c.max(sample),
                Some(c) => c + Self::RELAX * (sample - c),
                None => sample,
            });
        } else {
            return; // prefill only: delays no stream, says nothing about the bound
        }
        self.refit(max);
    }

    /// The largest budget predicted to keep a mixed step within the bound.
    fn refit(&mut self, max: usize) {
        let (Some(d), Some(c)) = (self.decode_step, self.token_cost) else { return };
        let room = (self.slowdown - 1.0).max(0.0) * d;
        let fit = if c > 0.0 { (room / c).floor().min(max as f64) as usize } else { max };
        self.budget = fit.max(1);
    }
}

/// One request's whole state, from submission to its last event.
pub struct Sequence {
    pub id: u64,
    priority: Priority,
    /// Prompt followed by the generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Generation stops when `tokens` reaches this length.
    max_len: usize,
    /// Tokens whose KV is in this sequence's blocks.
    computed: usize,
    blocks: Vec<BlockId>,
    /// Hashes of the leading full blocks of `tokens[..computed]`.
    hashes: Vec<BlockHash>,
    root: ChainRoot,
    cached_tokens: usize,
    /// Leading prompt tokens the cache held when the request was queued. The waiting-tokens gauge
    /// counts only the rest: routers compare workers by the prefill still to do, and a queued
    /// request that will hit the cache must not look like a full prompt of work.
    expected_cached: usize,
    /// Still counted against the waiting cap (never admitted yet).
    counted_waiting: bool,
    sampler: Sampler,
    /// The constraint's state after every generated token; `None` = free text.
    grammar: Option<Grammar>,
    /// Alternatives to report with each token's logprob; `None` = no logprobs.
    top_logprobs: Option<usize>,
    stop: StopMatcher,
    detok: Detokenizer,
    stop_ids: Vec<u32>,
    ignore_eos: bool,
    /// Control tokens are written out in the text.
    keep_special: bool,
    /// Send [`Event::Progress`] too.
    progress: bool,
    reply: UnboundedSender<Event>,
}

/// What one generated token does to its request.
enum Advance {
    /// Send this text (possibly empty: held back) and go on.
    Go(String),
    /// The request stops at this token: send `text`, then, if `flush`, what was held back (a
    /// stop token or EOS ends the text there; a stop string's match discards what follows).
    /// A stop token's own text is never sent.
    Stop { text: String, flush: bool },
}

/// Everything needed to build a [`Sequence`].
pub struct SequenceInit {
    pub id: u64,
    pub priority: Priority,
    pub prompt: Vec<u32>,
    pub max_len: usize,
    pub root: ChainRoot,
    pub sampler: Sampler,
    pub grammar: Option<Grammar>,
    pub top_logprobs: Option<usize>,
    pub stop: Vec<String>,
    pub stop_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub keep_special: bool,
    pub progress: bool,
    pub reply: UnboundedSender<Event>,
}

impl Sequence {
    pub fn new(i: SequenceInit) -> Self {
        Sequence {
            id: i.id,
            priority: i.priority,
            prompt_len: i.prompt.len(),
            tokens: i.prompt,
            max_len: i.max_len,
            computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            root: i.root,
            cached_tokens: 0,
            expected_cached: 0,
            counted_waiting: true,
            sampler: i.sampler,
            grammar: i.grammar,
            top_logprobs: i.top_logprobs,
            stop: StopMatcher::new(i.stop),
            detok: Detokenizer::new(),
            stop_ids: i.stop_ids,
            ignore_eos: i.ignore_eos,
            keep_special: i.keep_special,
            progress: i.progress,
            reply: i.reply,
        }
    }

    /// Pass generated token `t` (already committed to the grammar, if any) through the stop
    /// tokens, the detokenizer, the stop strings and the grammar's completeness.
    fn advance(&mut self, t: u32, vocab: &dyn Vocab) -> Advance {
        if self.stop_ids.contains(&t) || (!self.ignore_eos && vocab.eos_ids().contains(&t)) {
            return Advance::Stop { text: String::new(), flush: true };
        }
        let bytes = match vocab.token_bytes(t) {
            [] if self.keep_special => vocab.special_text(t),
            bytes => bytes,
        };
        let text = self.detok.push(bytes);
        match self.stop.push(&text) {
            StopCheck::Stopped(text) => Advance::Stop { text, flush: false },
            // A complete grammar allows nothing after it: the request ends here.
            StopCheck::Continue(text) if self.grammar.as_ref().is_some_and(Grammar::is_complete) => {
                Advance::Stop { text, flush: true }
            }
            StopCheck::Continue(text) => Advance::Go(text),
        }
    }

    /// Replay the last `n` prompt tokens as this request's own earlier output (see
    /// [`crate::request::GenerateRequest::resumed_tokens`]): their text is not sent again, but
    /// what the earlier attempt held back stays held here, and the grammar (if any) is rebuilt
    /// by committing them. Returns true, after sending Finished, if they already stopped the
    /// request; an error if they leave the request's constraint.
    pub fn resume(&mut self, n: usize, vocab: &dyn Vocab) -> Result<bool, ConstraintError> {
        for i in self.tokens.len() - n..self.tokens.len() {
            let t = self.tokens[i];
            self.sampler.replay(t);
            if let Some(g) = &mut self.grammar {
                g.commit(t).map_err(|e| ConstraintError(format!("resumed token {t} at {i}: {e}")))?;
            }
            if let Advance::Stop { flush, .. } = self.advance(t, vocab) {
                self.finish(FinishReason::Stop, flush);
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Send the last event: `Finished`, with the text held back if `flush`. A stop string that
    /// matched, even in that held-back text, is why the request stopped.
    fn finish(&mut self, reason: FinishReason, flush: bool) {
        let text = if flush { self.flush() } else { String::new() };
        let stop_sequence = self.stop.matched().map(str::to_string);
        let reason = if stop_sequence.is_some() { FinishReason::Stop } else { reason };
        let _ = self.reply.send(Event::Finished { text, reason, stop_sequence, usage: self.usage() });
    }

    /// Text still held back at the end of a stream that did not end on a stop string.
    fn flush(&mut self) -> String {
        let tail = self.detok.finish();
        match self.stop.push(&tail) {
            StopCheck::Continue(x) => x + &self.stop.finish(),
            StopCheck::Stopped(x) => x,
        }
    }

    fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// It produced a token here: its client may be reading it, so it is never preempted for
    /// another request's sake.
    fn streaming(&self) -> bool {
        self.tokens.len() > self.prompt_len
    }

    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_len as u32,
            completion_tokens: (self.tokens.len() - self.prompt_len) as u32,
            cached_tokens: self.cached_tokens as u32,
        }
    }
}

/// This step's token masks, by running-sequence index.
type Masks = HashMap<usize, Result<TokenMask, ConstraintError>>;

/// A row that takes a token this step: its sequence's index, its logits, its grammar's mask.
struct Draw {
    seq: usize,
    logits: Vec<f32>,
    mask: Option<Result<TokenMask, ConstraintError>>,
}

/// A drawn token and its log-probabilities if asked for, or why the grammar refused it.
type Sampled = Result<(u32, Option<TokenLogprobs>), ConstraintError>;

/// One row of the planned step: which running sequence, how many of its pending tokens.
struct Planned {
    seq: usize,
    len: usize,
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: BlockPool,
    waiting: VecDeque<Sequence>,
    /// Admitted sequences, oldest admission first.
    running: Vec<Sequence>,
    vocab: Arc<dyn Vocab>,
    stats: Arc<Stats>,
    rr: usize,
    governor: Option<PrefillGovernor>,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, pool: BlockPool, vocab: Arc<dyn Vocab>, stats: Arc<Stats>) -> Self {
        assert!(cfg.max_running <= cfg.max_batch_tokens, "max_running must not exceed max_batch_tokens");
        assert_eq!(cfg.block_size, pool.block_size(), "pool and scheduler disagree on the block size");
        stats.kv_blocks_total.store(pool.total() as u64, Relaxed);
        let governor = cfg.itl_slowdown.map(PrefillGovernor::new);
        Scheduler { cfg, pool, waiting: VecDeque::new(), running: Vec::new(), vocab, stats, rr: 0, governor }
    }

    pub fn add(&mut self, mut seq: Sequence) {
        seq.expected_cached = self.pool.cached_prefix_len(&self.matchable_hashes(&seq)) * self.cfg.block_size;
        // Last of its class: behind every request of its class or a higher one.
        let at = self.waiting.partition_point(|w| w.priority <= seq.priority);
        self.waiting.insert(at, seq);
        self.publish_gauges();
    }

    /// Put a preempted sequence back: first of its class, since it was admitted before the
    /// others of its class that wait.
    fn requeue(&mut self, seq: Sequence) {
        let at = self.waiting.partition_point(|w| w.priority < seq.priority);
        self.waiting.insert(at, seq);
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.pool.take_events()
    }

    pub fn cached_hashes(&self) -> Vec<BlockHash> {
        self.pool.cached_hashes()
    }

    /// Fail every request (engine shutdown).
    pub fn abort_all(&mut self, message: &str) {
        for mut s in self.running.drain(..).chain(self.waiting.drain(..)) {
            self.pool.release(&s.blocks);
            s.blocks.clear();
            let _ = s.reply.send(Event::Failed { message: message.to_string() });
            self.stats.requests_failed.fetch_add(1, Relaxed);
        }
        self.publish_gauges();
    }

    /// One tick. Returns false when there was nothing to run.
    pub fn step(&mut self, backend: &mut dyn Backend) -> bool {
        self.reap_cancelled();
        self.admit();
        self.grow_decoders();
        let plan = self.plan();
        if plan.is_empty() {
            self.publish_gauges();
            return false;
        }

        self.publish_gauges();
        let started = Instant::now();
        let mut grammars = self.take_grammars(&plan);
        let rows: Vec<BatchRow<'_>> = plan
            .iter()
            .map(|p| {
                let s = &self.running[p.seq];
                BatchRow {
                    tokens: &s.tokens[s.computed..s.computed + p.len],
                    start_pos: s.computed,
                    blocks: &s.blocks,
                    want_logits: s.computed + p.len == s.tokens.len(),
                }
            })
            .collect();
        let masks = Self::masks(&mut grammars);
        let result = catch_unwind(AssertUnwindSafe(|| backend.forward(&rows)));
        drop(rows);
        for (seq, g) in grammars.drain(..) {
            self.running[seq].grammar = Some(g);
        }
        let (mut prefill_tokens, mut decode_tokens) = (0, 0);
        for p in &plan {
            if self.running[p.seq].pending() == 1 { decode_tokens += 1 } else { prefill_tokens += p.len }
        }

        match result {
            Ok(Ok(logits)) => self.apply(&plan, logits, masks),
            Ok(Err(e)) => self.fail_step(&plan, &format!("model error: {e:#}")),
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                tracing::error!(error = %msg, "model panicked; failing this step's requests");
                self.fail_step(&plan, &format!("model panicked: {msg}"));
            }
        }
        let took = started.elapsed();
        if let Some(g) = &mut self.governor {
            g.observe(prefill_tokens, decode_tokens, took.as_secs_f64(), self.cfg.max_batch_tokens);
        }
        self.stats.record_step(prefill_tokens, decode_tokens, plan.len(), took);
        self.publish_gauges();
        true
    }

    /// Each constrained row's mask, the rows split across the compute pool, before the forward.
    /// A mask depends only on its row's committed tokens. Not on a thread beside the forward: the
    /// pool's threads meet at barriers, so a thread that takes a core from one of them stalls the
    /// whole pass (docs/BENCHMARKS.md, structured outputs).
    fn masks(grammars: &mut [(usize, Grammar)]) -> HashMap<usize, MaskResult> {
        if grammars.is_empty() {
            return HashMap::new(); // an unconstrained step wakes no pool thread
        }
        let mut work: Vec<(&mut (usize, Grammar), Option<MaskResult>)> =
            grammars.iter_mut().map(|g| (g, None)).collect();
        for_each_mut(&mut work, |(g, out)| *out = Some(g.1.mask()));
        work.into_iter().map(|(g, out)| (g.0, out.expect("every grammar was masked"))).collect()
    }

    /// The grammars of this step's constrained rows that will sample, moved out of their
    /// sequences for the mask computation (and put back after the forward).
    fn take_grammars(&mut self, plan: &[Planned]) -> Vec<(usize, Grammar)> {
        let mut taken = Vec::new();
        for p in plan {
            let s = &mut self.running[p.seq];
            if s.computed + p.len == s.tokens.len()
                && let Some(g) = s.grammar.take()
            {
                taken.push((p.seq, g));
            }
        }
        taken
    }

    fn reap_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].reply.is_closed() {
                let s = self.running.remove(i);
                self.pool.release(&s.blocks);
                self.stats.requests_cancelled.fetch_add(1, Relaxed);
            } else {
                i += 1;
            }
        }
        let before = self.waiting.len();
        let mut uncounted = 0;
        self.waiting.retain(|s| {
            let keep = !s.reply.is_closed();
            if !keep && s.counted_waiting {
                uncounted += 1;
            }
            keep
        });
        self.stats.requests_cancelled.fetch_add((before - self.waiting.len()) as u64, Relaxed);
        self.stats.waiting_requests.fetch_sub(uncounted, Relaxed);
    }

    /// Move waiting requests into the running set while slots and blocks allow (in queue order:
    /// a request that does not fit blocks those behind it, so large prompts are not starved by
    /// small ones). One that does not fit may preempt lower classes (see the module docs).
    fn admit(&mut self) {
        let bs = self.cfg.block_size;
        while let Some(s) = self.waiting.front() {
            let slots = self.slots_for(s.priority);
            let hashes = self.matchable_hashes(s);
            let hit = self.pool.cached_prefix_len(&hashes);
            let need_new = s.tokens.len().div_ceil(bs) - hit;
            // Matched blocks that nobody references are counted in `available` too.
            let blocks = need_new + self.pool.unreferenced_among(&hashes[..hit]);
            if self.running.len() >= slots || self.pool.available() < blocks {
                // Preempting changes what is cached and free: look again before admitting.
                if self.preempt_for(s.priority, slots, blocks) {
                    continue;
                }
                break;
            }
            let mut s = self.waiting.pop_front().expect("front exists");
            s.blocks = self.pool.acquire_prefix(&hashes[..hit]);
            for _ in 0..need_new {
                s.blocks.push(self.pool.allocate().expect("availability checked"));
            }
            s.hashes = hashes[..hit].to_vec();
            s.computed = hit * bs;
            if s.counted_waiting {
                s.counted_waiting = false;
                s.cached_tokens = hit * bs;
                self.stats.prefix_hit_tokens.fetch_add((hit * bs) as u64, Relaxed);
                self.stats.prompt_tokens.fetch_add(s.prompt_len as u64, Relaxed);
                self.stats.waiting_requests.fetch_sub(1, Relaxed);
                if s.progress {
                    let cached_tokens = s.cached_tokens as u32;
                    let _ = s.reply.send(Event::Progress(Progress::Admitted { cached_tokens }));
                }
            }
            self.running.push(s);
        }
    }

    /// Hashes of the blocks of `s` that may come from the cache. At least one token is always left
    /// to compute: its logits give the next token.
    fn matchable_hashes(&self, s: &Sequence) -> Vec<BlockHash> {
        let bs = self.cfg.block_size;
        let matchable = (s.tokens.len() - 1) / bs;
        prefix_block_hashes(&s.tokens[..matchable * bs], bs, s.root)
    }

    /// Give each decoding sequence room for its next token, preempting when full: the newest
    /// of the lowest class running.
    fn grow_decoders(&mut self) {
        let bs = self.cfg.block_size;
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            if s.pending() == 1 && s.blocks.len() * bs < s.tokens.len() {
                match self.pool.allocate() {
                    Some(b) => self.running[i].blocks.push(b),
                    None => {
                        let victim = self.lowest_newest();
                        let s = self.running.remove(victim);
                        self.preempt(s, "KV pool full");
                        // Retry the sequence that needed the block, wherever it is now (if it
                        // was the one preempted, go on with the next).
                        if victim < i {
                            i -= 1;
                        }
                        continue;
                    }
                }
            }
            i += 1;
        }
    }

    /// The running sequence the pool takes blocks back from: of the lowest class, the newest
    /// admission (the furthest from done).
    fn lowest_newest(&self) -> usize {
        (0..self.running.len()).max_by_key(|&i| (self.running[i].priority, i)).expect("a running sequence to preempt")
    }

    /// Free a running sequence's blocks and put it back to wait; it starts over when admitted.
    fn preempt(&mut self, mut s: Sequence, why: &'static str) {
        self.pool.release(&s.blocks);
        s.blocks.clear();
        s.hashes.clear();
        s.computed = 0;
        self.stats.preemptions.fetch_add(1, Relaxed);
        tracing::debug!(request = s.id, priority = %s.priority, "preempted: {why}");
        self.requeue(s);
    }

    /// Running slots a request of `class` may fill: batch leaves [`batch_reserve`] free.
    fn slots_for(&self, class: Priority) -> usize {
        let max = self.cfg.max_running;
        if class == Priority::Batch { max - batch_reserve(max) } else { max }
    }

    /// Make room (a slot below `slots`, `blocks` free) for a waiting request of `class` by
    /// preempting lower-class sequences that have produced no token, lowest class and newest
    /// first. Preempts nothing unless all of them together would make the room. Whether it did.
    fn preempt_for(&mut self, class: Priority, slots: usize, blocks: usize) -> bool {
        let mut victims: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].priority > class && !self.running[i].streaming())
            .collect();
        // Lowest class first, then the newest admission (the back of `running`).
        victims.sort_by_key(|&i| (std::cmp::Reverse(self.running[i].priority), std::cmp::Reverse(i)));
        let freeable: usize = victims.iter().map(|&i| self.pool.freed_by(&self.running[i].blocks)).sum();
        let slot_short = (self.running.len() + 1).saturating_sub(slots);
        let block_short = blocks.saturating_sub(self.pool.available());
        if victims.is_empty() || victims.len() < slot_short || freeable < block_short {
            return false;
        }
        let (mut taken, mut freed_blocks) = (Vec::new(), 0);
        for i in victims {
            if !taken.is_empty() && taken.len() >= slot_short && freed_blocks >= block_short {
                break;
            }
            freed_blocks += self.pool.freed_by(&self.running[i].blocks);
            taken.push(i);
        }
        // Highest index first, so the indices left stay valid.
        taken.sort_unstable_by(|a, b| b.cmp(a));
        for i in taken {
            let s = self.running.remove(i);
            self.preempt(s, "a higher class needs its place");
        }
        true
    }

    fn plan(&mut self) -> Vec<Planned> {
        let mut plan: Vec<Planned> = Vec::new();
        let mut budget = self.cfg.max_batch_tokens;
        for (i, s) in self.running.iter().enumerate() {
            if s.pending() == 1 {
                plan.push(Planned { seq: i, len: 1 });
                budget -= 1;
            }
        }
        // Only steps that also decode are governed: a prefill-only step delays no stream.
        if !plan.is_empty()
            && let Some(limit) = self.governor.as_ref().and_then(PrefillGovernor::limit)
        {
            budget = budget.min(limit);
        }
        let prefilling: Vec<usize> = (0..self.running.len()).filter(|&i| self.running[i].pending() > 1).collect();
        if !prefilling.is_empty() {
            let start = self.rr % prefilling.len();
            self.rr = self.rr.wrapping_add(1);
            for k in 0..prefilling.len() {
                if budget == 0 {
                    break;
                }
                let i = prefilling[(start + k) % prefilling.len()];
                let len = self.running[i].pending().min(budget);
                budget -= len;
                plan.push(Planned { seq: i, len });
            }
        }
        plan
    }

    /// After a successful forward: advance, register full blocks, sample, stream, finish.
    fn apply(&mut self, plan: &[Planned], logits: Vec<Vec<f32>>, masks: Masks) {
        let draws = self.advance(plan, logits, masks);
        let drawn = Self::sample_rows(&mut self.running, draws);
        let mut finished: Vec<usize> = Vec::new();
        let mut failed: Vec<(usize, String)> = Vec::new();
        for (seq, outcome) in drawn {
            let (t, logprobs) = match outcome {
                Ok(t) => t,
                Err(e) => {
                    failed.push((seq, format!("constraint: {e}")));
                    continue;
                }
            };
            self.stats.generated_tokens.fetch_add(1, Relaxed);
            let s = &mut self.running[seq];
            if let Some((reason, flush)) = Self::emit(s, t, logprobs, self.vocab.as_ref()) {
                s.finish(reason, flush);
                finished.push(seq);
            }
        }
        // Remove back to front so earlier indices stay valid.
        let mut done: Vec<(usize, Option<String>)> =
            finished.into_iter().map(|i| (i, None)).chain(failed.into_iter().map(|(i, e)| (i, Some(e)))).collect();
        done.sort_unstable_by_key(|d| d.0);
        for (i, error) in done.into_iter().rev() {
            let s = self.running.remove(i);
            self.pool.release(&s.blocks);
            match error {
                None => self.stats.requests_finished.fetch_add(1, Relaxed),
                Some(message) => {
                    let _ = s.reply.send(Event::Failed { message });
                    self.stats.requests_failed.fetch_add(1, Relaxed)
                }
            };
        }
    }

    /// Count each row's computed tokens and register its newly full blocks; returns the rows that
    /// take a token this step (their prompt is all computed), in plan order, with their logits
    /// and grammar masks.
    fn advance(&mut self, plan: &[Planned], logits: Vec<Vec<f32>>, mut masks: Masks) -> Vec<Draw> {
        let bs = self.cfg.block_size;
        let mut logits = logits.into_iter();
        let mut draws = Vec::new();
        for p in plan {
            let s = &mut self.running[p.seq];
            if s.progress && s.tokens.len() == s.prompt_len {
                let _ = s.reply.send(Event::Progress(Progress::Prefilled { tokens: p.len as u32 }));
            }
            s.computed += p.len;
            while (s.hashes.len() + 1) * bs <= s.computed {
                let i = s.hashes.len();
                let h = block_hash(s.hashes.last().copied(), s.root, &s.tokens[i * bs..(i + 1) * bs]);
                self.pool.register(s.blocks[i], h);
                s.hashes.push(h);
            }
            if s.computed < s.tokens.len() {
                continue; // mid-prefill: no token yet
            }
            let logits = logits.next().expect("one logits row per finished row");
            draws.push(Draw { seq: p.seq, logits, mask: masks.remove(&p.seq) });
        }
        draws
    }

    /// Every draw's token, the rows split across the compute pool: a row's sampling reads and
    /// writes only its own sequence, so the split changes no token (on the engine's thread alone,
    /// 16 sampled rows took a millisecond of each step while the pool's threads waited).
    fn sample_rows(running: &mut [Sequence], draws: Vec<Draw>) -> Vec<(usize, Sampled)> {
        let mut free: Vec<Option<&mut Sequence>> = running.iter_mut().map(Some).collect();
        let mut work: Vec<(&mut Sequence, Draw, Option<Sampled>)> =
            draws.into_iter().map(|d| (free[d.seq].take().expect("one draw per sequence"), d, None)).collect();
        for_each_mut(&mut work, |(s, d, out)| *out = Some(Self::sample(s, &mut d.logits, d.mask.take())));
        work.into_iter().map(|(_, d, out)| (d.seq, out.expect("every draw was sampled"))).collect()
    }

    /// Pick `s`'s next token from its logits, within its grammar's mask if it has one, and
    /// record it (sampler counts, tokens, grammar state); with its logprobs if it asked, taken
    /// from the logits as the model gave them.
    fn sample(s: &mut Sequence, row: &mut [f32], mask: Option<Result<TokenMask, ConstraintError>>) -> Sampled {
        let raw = s.top_logprobs.map(|_| row.to_vec());
        if let Some(mask) = mask {
            mask?.apply(row);
        }
        let t = s.sampler.sample(row);
        s.sampler.observe(t);
        s.tokens.push(t);
        if let Some(g) = &mut s.grammar {
            g.commit(t)?;
        }
        Ok((t, raw.zip(s.top_logprobs).map(|(raw, k)| logprobs(raw, t, k))))
    }

    /// Stream token `t` of sequence `s`; returns why it finished, if it did, and whether text
    /// held back (partial characters, possible stop-string starts) must still be flushed.
    fn emit(
        s: &mut Sequence,
        t: u32,
        logprobs: Option<TokenLogprobs>,
        vocab: &dyn Vocab,
    ) -> Option<(FinishReason, bool)> {
        let (text, finish) = match s.advance(t, vocab) {
            Advance::Stop { text, flush } => (text, Some((FinishReason::Stop, flush))),
            Advance::Go(text) => (text, (s.tokens.len() >= s.max_len).then_some((FinishReason::Length, true))),
        };
        let _ = s.reply.send(Event::Token { id: t, text, logprobs });
        finish
    }

    fn fail_step(&mut self, plan: &[Planned], message: &str) {
        let mut idx: Vec<usize> = plan.iter().map(|p| p.seq).collect();
        idx.sort_unstable();
        for &i in idx.iter().rev() {
            let s = self.running.remove(i);
            self.pool.release(&s.blocks);
            let _ = s.reply.send(Event::Failed { message: message.to_string() });
            self.stats.requests_failed.fetch_add(1, Relaxed);
        }
    }

    fn publish_gauges(&self) {
        let st = &self.stats;
        st.running_requests.store(self.running.len() as u64, Relaxed);
        let mut by_class = [(0u64, 0u64); 3];
        for s in &self.waiting {
            let c = &mut by_class[s.priority.index()];
            c.0 += 1;
            c.1 += s.pending().saturating_sub(s.expected_cached) as u64;
        }
        st.waiting_prompt_tokens.store(by_class.iter().map(|c| c.1).sum(), Relaxed);
        for (gauge, (n, tokens)) in st.waiting_by_priority.iter().zip(by_class) {
            gauge.0.store(n, Relaxed);
            gauge.1.store(tokens, Relaxed);
        }
        st.kv_blocks_used.store(self.pool.used() as u64, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::PrefillGovernor;

    fn governor() -> PrefillGovernor {
        PrefillGovernor::new(1.5)
    }

    #[test]
    fn the_governor_does_not_limit_prefill_before_it_has_seen_a_decode_step() {
        let mut g = governor();
        assert_eq!(g.limit(), None);
        g.observe(100, 4, 0.5, 256);
        assert_eq!(g.limit(), None, "a mixed step alone says nothing about decode speed");
    }

    #[test]
    fn a_step_over_the_bound_shrinks_the_budget_below_its_prefill_tokens() {
        let mut g = governor();
        g.observe(0, 8, 0.010, 256); // bound 15 ms: 5 ms of room for prefill
        assert_eq!(g.limit(), Some(PrefillGovernor::START));
        g.observe(1, 8, 0.011, 256); // 1 ms a token
        assert_eq!(g.limit(), Some(5));
        g.observe(5, 8, 0.016, 256); // over: 1.2 ms a token
        assert_eq!(g.limit(), Some(4));
        g.observe(4, 8, 1.0, 256);
        assert_eq!(g.limit(), Some(1), "never below one token: prefill must progress");
    }

    #[test]
    fn steps_within_the_bound_grow_the_budget_slowly_up_to_the_batch_budget() {
        let mut g = governor();
        g.observe(0, 8, 0.010, 256);
        g.observe(1, 8, 0.011, 256);
        assert_eq!(g.limit(), Some(5));
        g.observe(5, 8, 0.010, 256); // prefill looked free, but one step moves the estimate 1/8
        assert_eq!(g.limit(), Some(5));
        for _ in 0..100 {
            g.observe(5, 8, 0.010, 256);
            g.observe(0, 8, 0.010, 256); // keep probing so the limit is the budget
        }
        assert_eq!(g.limit(), Some(256));
    }

    /// Simulated steps: a decode-only step takes `d`, each prefill token `cost` more, and the whole
    /// step is scaled by `noise()`. Returns (prefill tokens, seconds, bound, budget after) per step.
    fn drive(
        g: &mut PrefillGovernor,
        d: f64,
        cost: f64,
        steps: usize,
        mut noise: impl FnMut() -> f64,
    ) -> Vec<(usize, f64, f64, usize)> {
        let mut out = Vec::new();
        for _ in 0..steps {
            let p = g.limit().unwrap_or(0); // no reference yet: a decode-only step
            let secs = (d + cost * p as f64) * noise();
            let bound = g.decode_step.map_or(f64::INFINITY, |d| 1.5 * d);
            g.observe(p, 8, secs, 256);
            out.push((p, secs, bound, g.budget));
        }
        out
    }

    #[test]
    fn a_step_over_the_bound_never_leaves_a_larger_budget_behind() {
        // Deterministic noise of up to +-30%, with a 2x spike every 37th step.
        let mut x: u64 = 12345;
        let mut n = 0;
        let noise = move || {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            n += 1;
            let u = (x >> 11) as f64 / (1u64 << 53) as f64;
            if n % 37 == 0 { 2.0 } else { 0.7 + 0.6 * u }
        };
        let mut g = governor();
        let trace = drive(&mut g, 0.030, 0.005, 2000, noise);
        let mut overs = 0;
        for w in trace.windows(2) {
            let ((_, _, _, before), (p, secs, bound, after)) = (w[0], w[1]);
            if p > 0 && secs > bound {
                overs += 1;
                assert!(after < p || after == 1, "{p} tokens ran over, yet the budget is {after}");
                assert!(after <= before, "an overshoot grew the budget from {before} to {after}");
            }
        }
        assert!(overs > 0, "the noise must push some steps over the bound");
    }

    #[test]
    fn at_a_steady_cost_the_budget_settles_at_the_largest_that_fits_and_stays_under_the_bound() {
        // 30 ms decode steps, 4.5 ms a prefill token: 15 ms of room fits 3 tokens (13.5 ms), not 4.
        for start in [0.001, 0.005, 0.020] {
            let mut g = governor();
            g.observe(0, 8, 0.030, 256);
            g.token_cost = Some(start);
            g.refit(256);
            let trace = drive(&mut g, 0.030, 0.0045, 300, || 1.0);
            assert_eq!(g.budget, 3, "starting from {start} s a token");
            for &(p, secs, bound, _) in &trace[100..] {
                assert!(p <= 3 && secs <= bound, "{p} tokens took {secs} s (bound {bound})");
            }
        }
    }

    #[test]
    fn a_decode_only_probe_runs_every_so_often_to_keep_the_reference_current() {
        let mut g = governor();
        g.observe(0, 8, 0.010, 256);
        for _ in 0..PrefillGovernor::PROBE_EVERY {
            assert_ne!(g.limit(), Some(0));
            g.observe(8, 8, 0.012, 256);
        }
        assert_eq!(g.limit(), Some(0), "the next step must decode only");
        g.observe(0, 8, 0.030, 256); // contexts grew: decode steps are slower now
        assert_eq!(g.decode_step, Some(0.020));
        assert_ne!(g.limit(), Some(0));
    }
}
