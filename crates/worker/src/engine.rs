//! The engine: a scheduler and a model on their own thread, and a handle any thread can use.
//!
//! Submission validates everything it can before any model work (empty prompt, unknown tokens,
//! context length, parameter ranges) and checks the waiting cap with one atomic update, so any
//! number of concurrent submitters can never push the queue past its cap. A request's events
//! arrive on its own channel; dropping the receiver cancels the request and frees its blocks on
//! the next tick.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering::Relaxed},
        mpsc,
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{Context, Result};
use bellows_common::prefix_hash::{BlockHash, ChainRoot};
use tokio::sync::{mpsc as tmpsc, oneshot};

use crate::{
    constraint::GrammarCompiler,
    kv_cache::{BlockPool, KvEvent},
    model::{Backend, ModelSpec},
    request::{Event, GenerateRequest, MAX_TOP_LOGPROBS, SubmitError},
    sampling::Sampler,
    scheduler::{Scheduler, SchedulerConfig, Sequence, SequenceInit},
    stats::{Stats, StatsSnapshot},
    vocab::Vocab,
};

/// Engine sizing: the KV memory budget and the scheduler's knobs.
#[derive(Debug, Clone, Default)]
pub struct EngineConfig {
    /// KV cache budget in MiB; the pool gets as many blocks as fit. None: the backend's default
    /// (512 MiB on the CPU; on a GPU a share of the memory free after loading).
    pub kv_cache_mb: Option<usize>,
    pub scheduler: SchedulerConfig,
}

/// A request's stream of events.
pub type EventStream = tmpsc::UnboundedReceiver<Event>;

/// A router-side mirror starts from `snapshot`, then applies `events` in order.
pub struct KvSubscription {
    pub snapshot: Vec<BlockHash>,
    pub events: tmpsc::UnboundedReceiver<Vec<KvEvent>>,
}

enum Command {
    Submit(Box<Sequence>),
    SubscribeKv(oneshot::Sender<KvSubscription>),
    Shutdown,
}

struct Shared {
    stats: Arc<Stats>,
    spec: ModelSpec,
    /// min(model context, KV pool capacity): no single request may need more.
    context: usize,
    block_size: usize,
    /// The KV pool's size in bytes (whole blocks).
    kv_cache_bytes: usize,
    max_waiting: usize,
    next_id: AtomicU64,
    /// For replaying a resumed request's earlier output at submission.
    vocab: Arc<dyn Vocab>,
    grammars: GrammarCompiler,
}

/// Owns the engine thread; dropping it stops the thread (in-flight requests fail).
pub struct Engine {
    handle: EngineHandle,
    thread: Option<JoinHandle<()>>,
}

/// Cheap to clone; usable from any thread or task.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    shared: Arc<Shared>,
}

impl Engine {
    pub fn start(mut backend: Box<dyn Backend>, vocab: Arc<dyn Vocab>, cfg: EngineConfig) -> Result<Engine> {
        let spec = backend.spec().clone();
        let s = cfg.scheduler;
        let block_bytes = spec.kv_bytes_per_token * s.block_size;
        let kv_bytes = match cfg.kv_cache_mb {
            Some(mb) => mb << 20,
            None => backend.default_kv_cache_bytes()?,
        };
        let num_blocks = kv_bytes / block_bytes;
        anyhow::ensure!(num_blocks >= 1, "a KV budget of {kv_bytes} bytes holds no block of {block_bytes} bytes");
        anyhow::ensure!(s.max_running <= s.max_batch_tokens, "max_running must not exceed max_batch_tokens");
        backend.allocate_kv(num_blocks, s.block_size)?;
        let stats = Arc::new(Stats::default());
        let shared = Arc::new(Shared {
            stats: stats.clone(),
            context: spec.context_length.min(num_blocks * s.block_size),
            block_size: s.block_size,
            kv_cache_bytes: num_blocks * block_bytes,
            max_waiting: s.max_waiting,
            next_id: AtomicU64::new(1),
            grammars: GrammarCompiler::new(vocab.clone(), spec.vocab_size),
            spec,
            vocab: vocab.clone(),
        });
        let (tx, rx) = mpsc::channel();
        let mut sched = Scheduler::new(s, BlockPool::new(num_blocks, shared.block_size), vocab, stats.clone());
        let thread = std::thread::Builder::new()
            .name("bellows-engine".into())
            .spawn(move || run(&mut sched, backend.as_mut(), rx, &stats))
            .context("spawning the engine thread")?;
        Ok(Engine { handle: EngineHandle { tx, shared }, thread: Some(thread) })
    }

    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.handle.tx.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(sched: &mut Scheduler, backend: &mut dyn Backend, rx: mpsc::Receiver<Command>, stats: &Stats) {
    let mut subscribers: Vec<tmpsc::UnboundedSender<Vec<KvEvent>>> = Vec::new();
    loop {
        // Block only when there is nothing to run.
        let first = if sched.is_idle() { rx.recv().ok() } else { rx.try_recv().ok() };
        let mut next = first;
        while let Some(cmd) = next {
            match cmd {
                Command::Submit(s) => sched.add(*s),
                Command::SubscribeKv(reply) => {
                    // Publish pending events first so the snapshot and the stream do not overlap.
                    publish(sched, &mut subscribers);
                    let (etx, erx) = tmpsc::unbounded_channel();
                    if reply.send(KvSubscription { snapshot: sched.cached_hashes(), events: erx }).is_ok() {
                        subscribers.push(etx);
                    }
                }
                Command::Shutdown => {
                    sched.abort_all("the engine is shutting down");
                    return;
                }
            }
            next = rx.try_recv().ok();
        }
        if sched.is_idle() && matches!(rx.try_recv(), Err(mpsc::TryRecvError::Disconnected)) {
            return;
        }
        sched.step(backend);
        publish(sched, &mut subscribers);
        stats.touch();
    }
}

fn publish(sched: &mut Scheduler, subscribers: &mut Vec<tmpsc::UnboundedSender<Vec<KvEvent>>>) {
    let events = sched.take_kv_events();
    if !events.is_empty() {
        subscribers.retain(|s| s.send(events.clone()).is_ok());
    }
}

impl EngineHandle {
    pub fn spec(&self) -> &ModelSpec {
        &self.shared.spec
    }

    /// The longest prompt + completion one request may use.
    pub fn context_length(&self) -> usize {
        self.shared.context
    }

    /// The token bytes the engine streams text from.
    pub fn vocab(&self) -> Arc<dyn Vocab> {
        self.shared.vocab.clone()
    }

    pub fn block_size(&self) -> usize {
        self.shared.block_size
    }

    /// The KV pool's size in bytes.
    pub fn kv_cache_bytes(&self) -> usize {
        self.shared.kv_cache_bytes
    }

    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// Wait until the engine's counters may have changed (see [`Stats::touch`]).
    pub async fn stats_changed(&self) {
        self.shared.stats.changed().await;
    }

    /// Validate and enqueue a request. Refusals cost no model work. A constrained request's
    /// grammar is compiled here, on the caller's thread (bounded by the constraint limits), so
    /// the engine thread never waits on a compile.
    pub fn submit(&self, req: GenerateRequest) -> Result<EventStream, SubmitError> {
        let sh = &self.shared;
        let vocab = sh.spec.vocab_size;
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if let Some(&token) = req.prompt.iter().chain(&req.stop_token_ids).find(|&&t| t as usize >= vocab) {
            return Err(SubmitError::TokenOutOfVocabulary { token, vocab });
        }
        if req.max_tokens == Some(0) {
            return Err(SubmitError::ZeroMaxTokens);
        }
        let prompt = req.prompt.len();
        let completion = match req.max_tokens {
            Some(m) => m as usize,
            None => sh.context.saturating_sub(prompt).max(1),
        };
        if prompt + completion > sh.context {
            return Err(SubmitError::ContextExceeded { prompt, completion, context: sh.context });
        }
        req.params.validate(vocab).map_err(|(param, reason)| SubmitError::InvalidParameter { param, reason })?;
        if req.top_logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
            return Err(SubmitError::InvalidParameter {
                param: "top_logprobs",
                reason: format!("must be at most {MAX_TOP_LOGPROBS}"),
            });
        }
        if req.resumed_tokens >= prompt {
            return Err(SubmitError::InvalidParameter {
                param: "resumed_tokens",
                reason: format!("{} resumed tokens leave no prompt of the {prompt} tokens", req.resumed_tokens),
            });
        }

        let grammar = match &req.constraint {
            Some(c) => Some(sh.grammars.compile(c).map_err(|e| SubmitError::InvalidConstraint(e.0))?),
            None => None,
        };

        // The cap: one atomic step, so concurrent submitters cannot overshoot it.
        let waiting = &sh.stats.waiting_requests;
        if waiting.fetch_update(Relaxed, Relaxed, |w| (w < sh.max_waiting as u64).then_some(w + 1)).is_err() {
            return Err(SubmitError::QueueFull { cap: sh.max_waiting, retry_after: self.retry_after() });
        }

        let (reply, stream) = tmpsc::unbounded_channel();
        let root = ChainRoot::for_model(&sh.spec.model_id, req.cache_salt.as_deref());
        let mut seq = Sequence::new(SequenceInit {
            id: sh.next_id.fetch_add(1, Relaxed),
            priority: req.priority,
            sampler: Sampler::new(req.params, &req.prompt),
            grammar,
            top_logprobs: req.top_logprobs.map(|k| k as usize),
            max_len: prompt + completion,
            prompt: req.prompt,
            root,
            stop: req.stop,
            stop_ids: req.stop_token_ids,
            ignore_eos: req.ignore_eos,
            keep_special: req.keep_special_tokens,
            progress: req.progress,
            reply,
        });
        match seq.resume(req.resumed_tokens, sh.vocab.as_ref()) {
            Ok(false) => {}
            Ok(true) => {
                // The earlier attempt had already stopped; only its Finished was lost.
                waiting.fetch_sub(1, Relaxed);
                return Ok(stream);
            }
            Err(e) => {
                waiting.fetch_sub(1, Relaxed);
                return Err(SubmitError::InvalidConstraint(e.0));
            }
        }
        if self.tx.send(Command::Submit(Box::new(seq))).is_err() {
            waiting.fetch_sub(1, Relaxed);
            return Err(SubmitError::ShuttingDown);
        }
        sh.stats.touch();
        Ok(stream)
    }

    /// Current cached block hashes and every change after them.
    pub async fn subscribe_kv(&self) -> Result<KvSubscription, SubmitError> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Command::SubscribeKv(tx)).map_err(|_| SubmitError::ShuttingDown)?;
        rx.await.map_err(|_| SubmitError::ShuttingDown)
    }

    /// How long until the queue has likely drained: waiting prompt tokens over the recent
    /// prefill rate, bounded to [0.1 s, 60 s].
    pub fn retry_after(&self) -> Duration {
        let s = self.shared.stats.snapshot();
        let rate = s.prefill_tokens_per_s.max(1.0);
        Duration::from_secs_f64((s.waiting_prompt_tokens as f64 / rate).clamp(0.1, 60.0))
    }
}
