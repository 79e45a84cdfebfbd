//! Driving one choice of a request through the workers, surviving their failures.
//!
//! - Before the first token, a worker that refuses (queue full), is unreachable or fails is
//!   replaced by another one, up to `--max-retries`, with the same request.
//! - After it, a failed worker's stream continues on another worker: the prompt plus every
//!   token generated so far is sent as the new prompt, marked as `resumed_tokens`, for the tokens
//!   still allowed, up to `--max-migrations`. The new worker replays those tokens through the
//!   request's detokenizer, stop strings, penalties and RNG, so the client sees one stream: same
//!   id, no text twice or missing, a stop string spanning the handover still stops, and a
//!   greedy or seeded request continues exactly as it would have.
//! - The client going away (the receiver dropped) ends the worker call, which cancels the
//!   request on the worker and frees its KV blocks.
//!
//! Each choice runs as its own task and reports [`ChoiceEvent`]s through a channel.

use std::{sync::Arc, time::Duration};

use bellows_common::telemetry;
use bellows_common::{prefix_hash::BlockHash, priority::Priority};
use bellows_proto::worker::v1 as pb;
use tokio::sync::mpsc;
use tracing::field::Empty;

use crate::{
    admission::Ticket,
    cluster::{ModelPool, Reply, WorkerError, WorkerId, WorkerLink},
    generation::{Finish, GenerationParams, TokenLogprobs, Usage},
    metrics::{Metrics, PolicyLabels},
    placement::{self, Placement, Policy, PromptShape},
    wire,
};

/// Why a choice could not be generated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DispatchError {
    /// No worker of the model could take it (none placeable, or every one tried).
    #[error("no worker is available")]
    NoWorkers,
    /// The last worker's refusal or failure, once retries and migrations are used up (or at
    /// once when the request itself is at fault).
    #[error(transparent)]
    Worker(#[from] WorkerError),
}

/// What happens to one choice, in order: `Started` (unless it failed before any worker took
/// it), any number of `Text`, then one `Done` or `Failed`.
#[derive(Debug)]
pub enum ChoiceEvent {
    /// A worker accepted the request (once per choice, at its first acceptance).
    Started {
        index: u32,
    },
    /// Text and the number of tokens it took (text may lag its tokens, or come without any),
    /// with one logprobs entry per token when the request asked for them. With an attempt's
    /// first token, how long the worker held it (a whole answer's first token waits for more).
    Text {
        index: u32,
        text: String,
        tokens: u32,
        logprobs: Vec<TokenLogprobs>,
        first_token_held: Duration,
    },
    Done {
        index: u32,
        finish: Finish,
        /// The request's stop string that ended the choice, when one did.
        stop_sequence: Option<String>,
        usage: Usage,
    },
    Failed {
        index: u32,
        error: DispatchError,
    },
}

/// How long a worker may hold tokens of an answer the client gets whole, its first included, to
/// send them in fewer messages: each message costs both sides a frame, a wake-up and a copy (a
/// short answer comes in one Delta beside its Finished). A worker that fails costs at most this
/// much of the answer, unseen by the client: re-done by a migration, or by a retry if no token
/// had come yet.
const WHOLE_ANSWER_DELTA_INTERVAL_MS: u32 = 200;

/// One choice to generate.
pub struct Choice {
    pub index: u32,
    pub request_id: String,
    pub prompt: Arc<Vec<u32>>,
    pub hashes: Arc<Vec<BlockHash>>,
    pub params: GenerationParams,
    pub cache_salt: Option<String>,
    /// The client reads the answer as it streams (not only whole).
    pub stream: bool,
    /// Its class, which the worker orders its queue by.
    pub priority: Priority,
    /// The request's place under the global cap (on its first choice): given back the moment
    /// the choice is counted as pending at its worker, so the request is never counted twice
    /// and never missed.
    pub ticket: Option<Ticket>,
    /// The request's span: every worker attempt is a child of it, so retries and migrations
    /// show as sibling spans.
    pub span: tracing::Span,
}

pub struct Dispatcher {
    pub policy: Box<dyn Policy>,
    pub max_retries: u32,
    pub max_migrations: u32,
    pub worker_timeout: Duration,
    pub placement_memory: Duration,
    pub metrics: Arc<Metrics>,
}

/// How one attempt on one worker ended.
enum Outcome {
    /// The choice finished; its `Done` event is sent.
    Done,
    /// The client went away: stop (dropping the call cancels it on the worker).
    Cancelled,
    /// The worker refused or failed before any token: try another with the same request.
    Retry(WorkerError),
    /// The worker failed mid-stream: continue on another from the tokens so far.
    Migrate(WorkerError),
    /// The request itself is at fault: tell the client.
    Final(WorkerError),
}

/// What a choice has been through so far, across its attempts.
struct Progress {
    tried: Vec<WorkerId>,
    /// Tokens the client has the text of (as far as the worker released it): a migration
    /// appends them to the prompt as `resumed_tokens`, and the next worker releases the rest.
    generated: Vec<u32>,
    retries: u32,
    migrations: u32,
    started: bool,
}

impl Dispatcher {
    /// Generate `choice` on its own task.
    pub fn spawn(self: &Arc<Self>, pool: Arc<ModelPool>, choice: Choice, tx: mpsc::Sender<ChoiceEvent>) {
        let this = self.clone();
        tokio::spawn(async move { this.run_choice(&pool, choice, tx).await });
    }

    /// Generate `choice`, reporting on `tx` until it is done, failed, or `tx`'s receiver goes.
    pub async fn run_choice(&self, pool: &ModelPool, choice: Choice, tx: mpsc::Sender<ChoiceEvent>) {
        let index = choice.index;
        if let Err(error) = self.run(pool, choice, &tx).await {
            let _ = tx.send(ChoiceEvent::Failed { index, error }).await;
        }
    }

    /// Attempts until one ends the choice; retries and migrations within their limits.
    async fn run(
        &self,
        pool: &ModelPool,
        mut choice: Choice,
        tx: &mpsc::Sender<ChoiceEvent>,
    ) -> Result<(), DispatchError> {
        let mut progress =
            Progress { tried: Vec::new(), generated: Vec::new(), retries: 0, migrations: 0, started: false };
        let mut last_error = DispatchError::NoWorkers;
        loop {
            let (prompt, hashes) = self.prompt(pool, &choice, &progress.generated);
            let shape = PromptShape { tokens: prompt.len(), block_size: pool.block_size, hashes: &hashes };
            // Nobody left to try: the last worker's error, or "no workers" if none was tried.
            let placed = self.place(pool, &choice, shape, &progress).ok_or(last_error)?;
            progress.tried.push(placed.worker.id);
            let error = match self.attempt(pool, &mut choice, &mut progress, &prompt, placed, tx).await {
                Outcome::Done | Outcome::Cancelled => return Ok(()),
                Outcome::Final(e) => return Err(e.into()),
                Outcome::Retry(e) => {
                    progress.retries += 1;
                    if progress.retries > self.max_retries {
                        return Err(e.into());
                    }
                    self.metrics.retries.inc();
                    e
                }
                Outcome::Migrate(e) => {
                    progress.migrations += 1;
                    if progress.migrations > self.max_migrations {
                        return Err(e.into());
                    }
                    self.metrics.migrations.inc();
                    if choice.params.max_tokens.is_some_and(|m| progress.generated.len() as u32 >= m) {
                        // Everything asked for was generated; only the Finished message was lost.
                        let usage = usage(&choice, &progress, 0);
                        let _ = tx
                            .send(ChoiceEvent::Done {
                                index: choice.index,
                                finish: Finish::Length,
                                stop_sequence: None,
                                usage,
                            })
                            .await;
                        return Ok(());
                    }
                    e
                }
            };
            last_error = DispatchError::Worker(error);
        }
    }

    /// The prompt of the next attempt: the choice's own, plus what was generated (a migration).
    fn prompt(&self, pool: &ModelPool, choice: &Choice, generated: &[u32]) -> (Arc<Vec<u32>>, Arc<Vec<BlockHash>>) {
        if generated.is_empty() {
            return (choice.prompt.clone(), choice.hashes.clone());
        }
        let tokens: Vec<u32> = choice.prompt.iter().chain(generated).copied().collect();
        let hashes = pool.block_hashes(&tokens, choice.cache_salt.as_deref());
        (Arc::new(tokens), Arc::new(hashes))
    }

    /// Choose a worker not tried yet, recording the decision in a span and the metrics.
    fn place(
        &self,
        pool: &ModelPool,
        choice: &Choice,
        shape: PromptShape<'_>,
        progress: &Progress,
    ) -> Option<Placement> {
        let span = tracing::info_span!(
            parent: &choice.span,
            "placement",
            bellows.policy = self.policy.kind().as_str(),
            bellows.candidates = Empty,
            bellows.worker = Empty,
            bellows.matched_blocks = Empty,
            bellows.cost.uncached_tokens = Empty,
            bellows.cost.queued_work = Empty,
        );
        let tokens = shape.tokens;
        let started = std::time::Instant::now();
        let placed = placement::place(pool, self.policy.as_ref(), shape, &progress.tried, self.placement_memory);
        self.metrics.placement_duration.observe(started.elapsed().as_secs_f64());
        let placed = placed?;
        span.record("bellows.candidates", placed.candidates);
        span.record("bellows.worker", placed.worker.node_id.as_str());
        span.record("bellows.matched_blocks", placed.cached_blocks);
        span.record("bellows.cost.uncached_tokens", placed.uncached_tokens);
        span.record("bellows.cost.queued_work", placed.queued_work);
        self.metrics.placements.get_or_create(&PolicyLabels { policy: self.policy.kind().as_str() }).inc();
        if progress.generated.is_empty() {
            self.metrics.prompt_tokens.inc_by(tokens as u64);
            self.metrics.predicted_cached_tokens.inc_by((placed.cached_blocks * pool.block_size) as u64);
        }
        Some(placed)
    }

    /// One worker's attempt at the choice: open the call, relay its answers to `tx`.
    async fn attempt(
        &self,
        pool: &ModelPool,
        choice: &mut Choice,
        progress: &mut Progress,
        prompt: &[u32],
        placed: Placement,
        tx: &mpsc::Sender<ChoiceEvent>,
    ) -> Outcome {
        let worker = placed.worker;
        let span = attempt_span(choice, &worker, progress);
        let request = self.request(choice, prompt, &progress.generated);
        // Until the worker's reports show it, the request adds the prefill it will really cost
        // there: the prompt minus the blocks placement expects it to find cached.
        let mut pending = Some(worker.dispatch(prompt.len().saturating_sub(placed.cached_blocks * pool.block_size)));
        choice.ticket = None; // the pending entry counts it now
        let opened = tokio::select! {
            r = tokio::time::timeout(self.worker_timeout, worker.open(request, &span)) => r,
            _ = tx.closed() => return Outcome::Cancelled,
        };
        let outcome = 'call: {
            let mut call = match opened {
                Err(_) => break 'call failed(WorkerError::Timeout, progress),
                Ok(Err(e)) => break 'call failed(e, progress),
                Ok(Ok(call)) => call,
            };
            if let Some(p) = &pending {
                p.accepted();
            }
            if !progress.started {
                progress.started = true;
                if tx.send(ChoiceEvent::Started { index: choice.index }).await.is_err() {
                    return Outcome::Cancelled;
                }
            }
            loop {
                let reply = tokio::select! {
                    r = call.next() => r,
                    _ = tx.closed() => return Outcome::Cancelled,
                };
                match reply {
                    Ok(Some(Reply::Delta(delta))) => {
                        pending = None; // started: no longer waiting, whatever the reports say
                        if !relay(choice.index, delta, progress, tx).await {
                            return Outcome::Cancelled;
                        }
                    }
                    Ok(Some(Reply::Finished(f))) => {
                        span.record("bellows.outcome", "finished");
                        self.finish(choice, progress, f, tx).await;
                        return Outcome::Done;
                    }
                    Ok(None) => break 'call failed(WorkerError::Failed("stream ended early".into()), progress),
                    Err(e) => break 'call failed(e, progress),
                }
            }
        };
        drop(pending);
        self.record_failure(&span, choice, &worker, progress, &outcome);
        outcome
    }

    /// The worker's request for this attempt.
    fn request(&self, choice: &Choice, prompt: &[u32], generated: &[u32]) -> pb::GenerateRequest {
        wire::Attempt {
            request_id: format!("{}-{}", choice.request_id, choice.index),
            prompt,
            params: &choice.params,
            generated: generated.len(),
            cache_salt: choice.cache_salt.clone(),
            stream: choice.stream,
            whole_delta_interval_ms: WHOLE_ANSWER_DELTA_INTERVAL_MS,
            priority: choice.priority,
        }
        .request()
    }

    async fn finish(&self, choice: &Choice, progress: &Progress, f: pb::Finished, tx: &mpsc::Sender<ChoiceEvent>) {
        let reported = f.usage.unwrap_or_default().cached_prompt_tokens;
        let usage = usage(choice, progress, reported);
        self.metrics.completion_tokens.inc_by(u64::from(usage.completion_tokens));
        self.metrics.cached_tokens.inc_by(u64::from(usage.cached_prompt_tokens));
        let finish = wire::finish(f.reason);
        let done = ChoiceEvent::Done { index: choice.index, finish, stop_sequence: f.stop_sequence, usage };
        let _ = tx.send(done).await;
    }

    fn record_failure(
        &self,
        span: &tracing::Span,
        choice: &Choice,
        worker: &WorkerLink,
        progress: &Progress,
        outcome: &Outcome,
    ) {
        span.record("otel.status_code", "ERROR");
        let error = match outcome {
            Outcome::Final(_) => {
                span.record("bellows.outcome", "refused");
                return;
            }
            Outcome::Retry(e) | Outcome::Migrate(e) => e,
            Outcome::Done | Outcome::Cancelled => return,
        };
        span.record("bellows.outcome", "failed");
        tracing::warn!(
            parent: span,
            request_id = %choice.request_id,
            trace_id = telemetry::trace_id(&choice.span).as_deref(),
            worker = %worker.node_id,
            generated = progress.generated.len(),
            "worker attempt failed: {error}"
        );
    }
}

/// What a worker's refusal or failure means for the choice.
fn failed(error: WorkerError, progress: &Progress) -> Outcome {
    match error {
        WorkerError::Rejected(_) => Outcome::Final(error),
        _ if progress.generated.is_empty() => Outcome::Retry(error),
        _ => Outcome::Migrate(error),
    }
}

/// Pass a Delta on to the client; `false` when the client went away.
async fn relay(index: u32, delta: pb::Delta, progress: &mut Progress, tx: &mpsc::Sender<ChoiceEvent>) -> bool {
    progress.generated.extend_from_slice(&delta.token_ids);
    let tokens = delta.token_ids.len() as u32;
    if delta.text.is_empty() && tokens == 0 {
        return true;
    }
    let first_token_held = Duration::from_micros(delta.first_token_held_us);
    let logprobs = wire::logprobs(delta.logprobs);
    let text = ChoiceEvent::Text { index, text: delta.text, tokens, logprobs, first_token_held };
    tx.send(text).await.is_ok()
}

/// The choice's usage: its own prompt (not a migration's), every token generated, and the
/// cached tokens the worker reported, bounded by the prompt.
fn usage(choice: &Choice, progress: &Progress, cached: u32) -> Usage {
    Usage {
        prompt_tokens: choice.prompt.len() as u32,
        completion_tokens: progress.generated.len() as u32,
        cached_prompt_tokens: cached.min(choice.prompt.len() as u32),
    }
}

fn attempt_span(choice: &Choice, worker: &WorkerLink, progress: &Progress) -> tracing::Span {
    let kind = match (progress.generated.is_empty(), progress.tried.len()) {
        (true, 1) => "first",
        (true, _) => "retry",
        (false, _) => "migration",
    };
    tracing::info_span!(
        parent: &choice.span,
        "worker.attempt",
        otel.kind = "client",
        otel.status_code = Empty,
        rpc.system = "grpc",
        rpc.method = worker.rpc_method(),
        server.address = %worker.address,
        bellows.worker = %worker.node_id,
        bellows.attempt = progress.tried.len(),
        bellows.attempt.kind = kind,
        bellows.outcome = Empty,
    )
}
