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
use bellows_common::{constraint::Constraint, prefix_hash::BlockHash};
use bellows_proto::worker::v1 as pb;
use tokio::sync::mpsc;
use tonic::Code;
use tracing::field::Empty;

use crate::{
    admission::Ticket,
    api::{
        error::{ApiError, Overload},
        request::GenerationParams,
    },
    cluster::{ModelPool, WorkerId},
    metrics::{Metrics, PolicyLabels},
    placement::{self, Policy, PromptShape},
};

/// What happens to one choice, in order: `Started` (unless it failed before any worker took
/// it), any number of `Text`, then one `Done` or `Failed`.
#[derive(Debug)]
pub enum ChoiceEvent {
    /// A worker accepted the request (once per choice, at its first acceptance).
    Started {
        index: u32,
    },
    /// Text and the number of tokens it took (text may lag its tokens, or come without any),
    /// with one logprobs entry per token when the request asked for them.
    Text {
        index: u32,
        text: String,
        tokens: u32,
        logprobs: Vec<pb::TokenLogprobs>,
    },
    Done {
        index: u32,
        finish: pb::FinishReason,
        usage: pb::Usage,
    },
    Failed {
        index: u32,
        error: ApiError,
    },
}

/// How long a worker may hold tokens of an answer the client gets whole, to send them in fewer
/// messages: each message costs both sides a frame, a wake-up and a copy. A migration re-does
/// at most this much of the answer, unseen by the client.
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

/// How a worker's failure is handled.
enum Failure {
    /// Try another worker (counts against retries or migrations).
    Retry(ApiError),
    /// The request itself is at fault: tell the client.
    Final(ApiError),
}

impl Dispatcher {
    pub fn spawn(self: &Arc<Self>, pool: Arc<ModelPool>, choice: Choice, tx: mpsc::Sender<ChoiceEvent>) {
        let this = self.clone();
        tokio::spawn(async move {
            let index = choice.index;
            if let Err(error) = this.run(&pool, choice, &tx).await {
                let _ = tx.send(ChoiceEvent::Failed { index, error }).await;
            }
        });
    }

    async fn run(&self, pool: &ModelPool, mut choice: Choice, tx: &mpsc::Sender<ChoiceEvent>) -> Result<(), ApiError> {
        let index = choice.index;
        let mut tried: Vec<WorkerId> = Vec::new();
        // Tokens the client has the text of (as far as the worker released it): a migration
        // appends them to the prompt as `resumed_tokens`, and the next worker releases the rest.
        let mut generated: Vec<u32> = Vec::new();
        let (mut retries, mut migrations) = (0u32, 0u32);
        let mut started = false;
        let mut last_error = ApiError::Overloaded { reason: Overload::NoWorkers, retry_after: Duration::from_secs(1) };
        loop {
            let (prompt, hashes) = if generated.is_empty() {
                (choice.prompt.clone(), choice.hashes.clone())
            } else {
                let tokens: Vec<u32> = choice.prompt.iter().chain(&generated).copied().collect();
                let hashes = pool.block_hashes(&tokens, choice.cache_salt.as_deref());
                (Arc::new(tokens), Arc::new(hashes))
            };
            let shape = PromptShape { tokens: prompt.len(), block_size: pool.block_size, hashes: &hashes };
            let placement_span = tracing::info_span!(
                parent: &choice.span,
                "placement",
                bellows.policy = self.policy.kind().as_str(),
                bellows.candidates = Empty,
                bellows.worker = Empty,
                bellows.matched_blocks = Empty,
                bellows.cost.uncached_tokens = Empty,
                bellows.cost.queued_work = Empty,
            );
            let Some(placed) = placement::place(pool, self.policy.as_ref(), shape, &tried, self.placement_memory)
            else {
                // Nobody left to try: the last worker's error, or "no workers" if none was tried.
                return Err(last_error);
            };
            placement_span.record("bellows.candidates", placed.candidates);
            placement_span.record("bellows.worker", placed.worker.node_id.as_str());
            placement_span.record("bellows.matched_blocks", placed.cached_blocks);
            placement_span.record("bellows.cost.uncached_tokens", placed.uncached_tokens);
            placement_span.record("bellows.cost.queued_work", placed.queued_work);
            drop(placement_span);
            self.metrics.placements.get_or_create(&PolicyLabels { policy: self.policy.kind().as_str() }).inc();
            if generated.is_empty() {
                self.metrics.prompt_tokens.inc_by(prompt.len() as u64);
                self.metrics.predicted_cached_tokens.inc_by((placed.cached_blocks * pool.block_size) as u64);
            }
            let worker = placed.worker;
            tried.push(worker.id);

            let request = pb::GenerateRequest {
                request_id: format!("{}-{index}", choice.request_id),
                prompt_token_ids: prompt.to_vec(),
                sampling: Some(choice.params.sampling.clone()),
                max_tokens: choice.params.max_tokens.map(|m| m - generated.len() as u32),
                stop: choice.params.stop.clone(),
                stop_token_ids: choice.params.stop_token_ids.clone(),
                ignore_eos: choice.params.ignore_eos,
                cache_salt: choice.cache_salt.clone(),
                delta_interval_ms: if choice.stream { 0 } else { WHOLE_ANSWER_DELTA_INTERVAL_MS },
                resumed_tokens: generated.len() as u32,
                // Sent again on a migration: the new worker replays the resumed tokens through it.
                constraint: choice.params.structured.as_ref().map(|s| constraint_frame(&s.constraint)),
                top_logprobs: choice.params.top_logprobs,
            };
            let kind = match (generated.is_empty(), tried.len()) {
                (true, 1) => "first",
                (true, _) => "retry",
                (false, _) => "migration",
            };
            let attempt = tracing::info_span!(
                parent: &choice.span,
                "worker.attempt",
                otel.kind = "client",
                otel.status_code = Empty,
                rpc.system = "grpc",
                rpc.method = "Generate",
                server.address = %worker.address,
                bellows.worker = %worker.node_id,
                bellows.attempt = tried.len(),
                bellows.attempt.kind = kind,
                bellows.outcome = Empty,
            );
            let mut request = tonic::Request::new(request);
            telemetry::inject(&attempt, request.metadata_mut());
            // Until the worker's reports show it, the request adds the prefill it will really
            // cost there: the prompt minus the blocks placement expects it to find cached.
            let mut pending =
                Some(worker.dispatch(prompt.len().saturating_sub(placed.cached_blocks * pool.block_size)));
            choice.ticket = None; // the pending entry counts it now
            let mut client = worker.client();
            let opened = tokio::select! {
                r = tokio::time::timeout(self.worker_timeout, client.generate(request)) => r,
                _ = tx.closed() => return Ok(()),
            };
            let failure = match opened {
                Err(_) => Failure::Retry(ApiError::WorkerTimeout),
                Ok(Err(status)) => classify(&status),
                Ok(Ok(response)) => {
                    if let Some(p) = &pending {
                        p.accepted();
                    }
                    if !started {
                        started = true;
                        if tx.send(ChoiceEvent::Started { index }).await.is_err() {
                            return Ok(());
                        }
                    }
                    let mut stream = response.into_inner();
                    loop {
                        let message = tokio::select! {
                            m = stream.message() => m,
                            _ = tx.closed() => return Ok(()),
                        };
                        match message {
                            Ok(Some(pb::GenerateResponse {
                                kind: Some(pb::generate_response::Kind::Delta(delta)),
                            })) => {
                                // Started: no longer waiting, whatever the reports say.
                                pending = None;
                                generated.extend_from_slice(&delta.token_ids);
                                let tokens = delta.token_ids.len() as u32;
                                if !delta.text.is_empty() || tokens > 0 {
                                    let event =
                                        ChoiceEvent::Text { index, text: delta.text, tokens, logprobs: delta.logprobs };
                                    if tx.send(event).await.is_err() {
                                        return Ok(());
                                    }
                                }
                            }
                            Ok(Some(pb::GenerateResponse { kind: Some(pb::generate_response::Kind::Finished(f)) })) => {
                                let reported = f.usage.unwrap_or_default();
                                let usage = pb::Usage {
                                    prompt_tokens: choice.prompt.len() as u32,
                                    completion_tokens: generated.len() as u32,
                                    cached_prompt_tokens: reported.cached_prompt_tokens.min(choice.prompt.len() as u32),
                                };
                                self.metrics.completion_tokens.inc_by(u64::from(usage.completion_tokens));
                                self.metrics.cached_tokens.inc_by(u64::from(usage.cached_prompt_tokens));
                                let finish = pb::FinishReason::try_from(f.reason).unwrap_or(pb::FinishReason::Stop);
                                attempt.record("bellows.outcome", "finished");
                                let _ = tx.send(ChoiceEvent::Done { index, finish, usage }).await;
                                return Ok(());
                            }
                            Ok(Some(_)) => {}
                            Ok(None) => break Failure::Retry(ApiError::WorkerFailed("stream ended early".into())),
                            Err(status) => break classify(&status),
                        }
                    }
                }
            };
            drop(pending);
            attempt.record("otel.status_code", "ERROR");
            let error = match failure {
                Failure::Final(e) => {
                    attempt.record("bellows.outcome", "refused");
                    return Err(e);
                }
                Failure::Retry(e) => e,
            };
            attempt.record("bellows.outcome", "failed");
            tracing::warn!(
                parent: &attempt,
                request_id = %choice.request_id,
                trace_id = telemetry::trace_id(&choice.span).as_deref(),
                worker = %worker.node_id,
                generated = generated.len(),
                "worker attempt failed: {error}"
            );
            if generated.is_empty() {
                retries += 1;
                if retries > self.max_retries {
                    return Err(error);
                }
                self.metrics.retries.inc();
            } else {
                migrations += 1;
                if migrations > self.max_migrations {
                    return Err(error);
                }
                self.metrics.migrations.inc();
                if choice.params.max_tokens.is_some_and(|m| generated.len() as u32 >= m) {
                    // Everything asked for was generated; only the Finished message was lost.
                    let usage = pb::Usage {
                        prompt_tokens: choice.prompt.len() as u32,
                        completion_tokens: generated.len() as u32,
                        cached_prompt_tokens: 0,
                    };
                    let _ = tx.send(ChoiceEvent::Done { index, finish: pb::FinishReason::Length, usage }).await;
                    return Ok(());
                }
            }
            last_error = error;
        }
    }
}

/// Map a worker's gRPC status to what the router does about it.
fn constraint_frame(c: &Constraint) -> pb::Constraint {
    use pb::constraint::Kind;
    let kind = match c {
        Constraint::JsonObject => Kind::JsonObject(true),
        Constraint::JsonSchema(schema) => Kind::JsonSchema(schema.to_string()),
        Constraint::Regex(rx) => Kind::Regex(rx.clone()),
        Constraint::Lark(lark) => Kind::Lark(lark.clone()),
    };
    pb::Constraint { kind: Some(kind) }
}

fn classify(status: &tonic::Status) -> Failure {
    match status.code() {
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
            Failure::Final(ApiError::InvalidRequest { message: status.message().to_string(), param: None })
        }
        Code::ResourceExhausted => {
            let retry_after = status
                .metadata()
                .get("retry-after-ms")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
                .map_or(Duration::from_secs(1), Duration::from_millis);
            Failure::Retry(ApiError::Overloaded { reason: Overload::WorkersBusy, retry_after })
        }
        Code::DeadlineExceeded => Failure::Retry(ApiError::WorkerTimeout),
        _ => Failure::Retry(ApiError::WorkerFailed(format!("{:?}: {}", status.code(), status.message()))),
    }
}
