//! The `bellows.worker.v1.Worker` service over the engine.
//!
//! A Generate call's response stream *owns* the engine's event receiver: when the client cancels
//! (or the connection dies) tonic drops the stream, the receiver goes with it, and the scheduler
//! frees the request's KV blocks on its next tick. No task sits between the two, so there is no
//! second place where a cancellation could be lost. Tokens already waiting in the receiver when
//! the stream is polled are sent as one Delta, so a slow reader gets fewer, larger messages
//! instead of an ever longer backlog.

use std::{
    collections::VecDeque,
    pin::Pin,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use bellows_common::{constraint::Constraint, telemetry};
use bellows_proto::worker::v1::{self as pb, generate_response::Kind, worker_server::Worker};
use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use super::{
    drain::{InFlight, Lifecycle},
    load_report::{self, LoadStream},
    session::SessionStream,
    status::NodeError,
};
use crate::{
    engine::{EngineHandle, EventStream},
    request::{Event, FinishReason, GenerateRequest, Progress, TokenLogprobs, Usage},
    sampling::SamplingParams,
    tokenizer::ModelTokenizer,
    vocab::Vocab,
};

/// What the service needs once the model is loaded.
pub struct Ready {
    pub engine: EngineHandle,
    pub info: pb::ModelInfoResponse,
    pub tokenizer: Option<Arc<ModelTokenizer>>,
    pub load: watch::Receiver<pb::LoadReport>,
}

struct Shared {
    node_id: String,
    lifecycle: Arc<Lifecycle>,
    ready: OnceLock<Ready>,
    log_prompts: bool,
    next_request: AtomicU64,
    /// What ModelInfo advertises; below 2 the Session RPC is refused (an old peer, for tests).
    protocol_version: u32,
}

/// The gRPC service. Serves (refusing with UNAVAILABLE) before the model is loaded, so health
/// checks and connections work from the start.
#[derive(Clone)]
pub struct WorkerService(Arc<Shared>);

impl WorkerService {
    pub fn new(node_id: String, lifecycle: Arc<Lifecycle>, log_prompts: bool, protocol_version: u32) -> Self {
        WorkerService(Arc::new(Shared {
            node_id,
            lifecycle,
            ready: OnceLock::new(),
            log_prompts,
            next_request: AtomicU64::new(1),
            protocol_version,
        }))
    }

    /// Called once, when the model is loaded (before the node advances to Serving).
    pub fn set_ready(&self, ready: Ready) {
        if self.0.ready.set(ready).is_err() {
            panic!("the model is loaded once");
        }
    }

    fn ready(&self) -> Result<&Ready, NodeError> {
        self.0.ready.get().ok_or(NodeError::Loading)
    }

    /// Accept one request: admit it, check it, submit it to the engine. The stream it returns
    /// owns the request (see the module docs), whichever RPC carries it.
    pub(super) async fn open(&self, req: pb::GenerateRequest, span: tracing::Span) -> Result<GenerateStream, Status> {
        let in_flight = self.0.lifecycle.admit()?;
        let ready = self.ready()?;
        let id = if req.request_id.is_empty() {
            format!("{}-{}", self.0.node_id, self.0.next_request.fetch_add(1, Relaxed))
        } else {
            req.request_id.clone()
        };
        let hold = (req.delta_interval_ms > 0).then(|| Hold {
            interval: Duration::from_millis(u64::from(req.delta_interval_ms)),
            first_token: req.hold_first_token,
        });
        let engine_req =
            engine_request(req).inspect_err(|e| tracing::debug!(request_id = %id, error = %e, "refused"))?;
        let prompt_text = self.0.log_prompts.then(|| match &ready.tokenizer {
            Some(t) => t.decode(&engine_req.prompt),
            None => format!("{:?}", engine_req.prompt),
        });
        span.record("bellows.request_id", id.as_str());
        let submitted = if engine_req.constraint.is_some() {
            // Compiling a grammar takes up to milliseconds: not on the async threads.
            let engine = ready.engine.clone();
            tokio::task::spawn_blocking(move || engine.submit(engine_req))
                .await
                .map_err(|e| Status::internal(format!("submitting: {e}")))?
        } else {
            ready.engine.submit(engine_req)
        };
        let events = submitted.map_err(|e| {
            tracing::debug!(request_id = %id, error = %e, "refused");
            span.record("otel.status_code", "ERROR");
            NodeError::Submit(e)
        })?;
        let phase = Some(tracing::info_span!(parent: &span, "queue"));
        Ok(GenerateStream {
            events,
            out: VecDeque::new(),
            done: false,
            hold,
            flush: None,
            delta_sent: false,
            vocab: ready.engine.vocab(),
            log: RequestLog {
                id,
                trace_id: telemetry::trace_id(&span),
                prompt_text,
                started: Instant::now(),
                first_token: None,
                tokens: 0,
            },
            span,
            phase,
            _in_flight: in_flight,
        })
    }

    /// A Session call; `refused` is called for each request the worker refuses on it.
    pub async fn session_counted(
        &self,
        request: Request<Streaming<pb::SessionRequest>>,
        refused: Arc<dyn Fn(tonic::Code) + Send + Sync>,
    ) -> Result<Response<SessionStream>, Status> {
        if self.0.protocol_version < bellows_proto::SESSION_PROTOCOL {
            return Err(Status::unimplemented("this worker speaks protocol version 1: Generate only"));
        }
        self.ready()?;
        let closed = self.0.lifecycle.clone();
        let closed = Box::pin(async move { closed.closed().await });
        Ok(Response::new(SessionStream::new(self.clone(), request.into_inner(), closed, refused)))
    }

    pub(super) fn node_id(&self) -> &str {
        &self.0.node_id
    }
}

/// The span of one request on this worker, under whichever RPC carries it.
pub(super) fn request_span(node_id: &str, request: &pb::GenerateRequest, method: &'static str) -> tracing::Span {
    tracing::info_span!(
        "worker.generate",
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        rpc.system = "grpc",
        rpc.service = "bellows.worker.v1.Worker",
        rpc.method = method,
        bellows.node = %node_id,
        bellows.request_id = tracing::field::Empty,
        bellows.prompt_tokens = request.prompt_token_ids.len(),
        gen_ai.request.max_tokens = request.max_tokens,
        gen_ai.usage.cached_input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
        gen_ai.response.finish_reasons = tracing::field::Empty,
    )
}

#[tonic::async_trait]
impl Worker for WorkerService {
    type GenerateStream = GenerateStream;
    type SessionStream = SessionStream;
    type WatchLoadStream = LoadStream;

    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<GenerateStream>, Status> {
        let span = request_span(&self.0.node_id, request.get_ref(), "Generate");
        telemetry::continue_grpc_trace(&span, request.metadata());
        Ok(Response::new(self.open(request.into_inner(), span).await?))
    }

    async fn session(
        &self,
        request: Request<Streaming<pb::SessionRequest>>,
    ) -> Result<Response<SessionStream>, Status> {
        self.session_counted(request, Arc::new(|_| {})).await
    }

    async fn model_info(&self, _: Request<pb::ModelInfoRequest>) -> Result<Response<pb::ModelInfoResponse>, Status> {
        let mut info = self.ready()?.info.clone();
        info.protocol_version = self.0.protocol_version;
        Ok(Response::new(info))
    }

    async fn watch_load(&self, _: Request<pb::WatchLoadRequest>) -> Result<Response<LoadStream>, Status> {
        let ready = self.ready()?;
        let stream = load_report::subscribe(&ready.engine, ready.load.clone(), self.0.lifecycle.clone()).await?;
        Ok(Response::new(stream))
    }
}

/// The wire request as an engine request. Absent sampling fields take the engine's defaults
/// (which are OpenAI's); ranges are checked by the engine, so there is one validation.
pub fn engine_request(r: pb::GenerateRequest) -> Result<GenerateRequest, NodeError> {
    if r.stop.iter().any(String::is_empty) {
        return Err(NodeError::Malformed("invalid stop: stop strings must not be empty".into()));
    }
    let priority = r.priority().into();
    let d = SamplingParams::default();
    let s = r.sampling.unwrap_or_default();
    let mut logit_bias: Vec<(u32, f32)> = s.logit_bias.into_iter().collect();
    logit_bias.sort_by_key(|&(t, _)| t);
    let params = SamplingParams {
        temperature: s.temperature.unwrap_or(d.temperature),
        top_p: s.top_p.unwrap_or(d.top_p),
        top_k: s.top_k.unwrap_or(d.top_k),
        min_p: s.min_p.unwrap_or(d.min_p),
        repetition_penalty: s.repetition_penalty.unwrap_or(d.repetition_penalty),
        presence_penalty: s.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: s.frequency_penalty.unwrap_or(d.frequency_penalty),
        logit_bias,
        seed: s.seed,
    };
    let constraint = r.constraint.and_then(|c| c.kind).map(constraint).transpose()?;
    Ok(GenerateRequest {
        constraint,
        top_logprobs: r.top_logprobs,
        prompt: r.prompt_token_ids,
        params,
        max_tokens: r.max_tokens,
        stop: r.stop,
        stop_token_ids: r.stop_token_ids,
        ignore_eos: r.ignore_eos,
        cache_salt: r.cache_salt,
        progress: true,
        resumed_tokens: r.resumed_tokens as usize,
        priority,
        keep_special_tokens: r.keep_special_tokens,
    })
}

fn constraint(kind: pb::constraint::Kind) -> Result<Constraint, NodeError> {
    use pb::constraint::Kind;
    Ok(match kind {
        Kind::JsonSchema(text) => Constraint::JsonSchema(
            serde_json::from_str(&text)
                .map_err(|e| NodeError::Malformed(format!("invalid constraint: json_schema is not JSON: {e}")))?,
        ),
        Kind::JsonObject(_) => Constraint::JsonObject,
        Kind::Regex(rx) => Constraint::Regex(rx),
        Kind::Lark(lark) => Constraint::Lark(lark),
    })
}

/// What the per-request log line reports.
struct RequestLog {
    id: String,
    /// The trace this request belongs to (when traces are exported), so a log line leads to it.
    trace_id: Option<String>,
    /// Only with `--log-prompts`.
    prompt_text: Option<String>,
    started: Instant,
    first_token: Option<Instant>,
    tokens: u32,
}

impl RequestLog {
    fn ms(&self, at: Option<Instant>) -> u64 {
        at.map_or(0, |t| (t - self.started).as_millis() as u64)
    }

    fn finished(&self, reason: FinishReason, usage: &Usage) {
        tracing::info!(
            request_id = %self.id,
            trace_id = self.trace_id.as_deref(),
            prompt_tokens = usage.prompt_tokens,
            completion_tokens = usage.completion_tokens,
            cached_tokens = usage.cached_tokens,
            ttft_ms = self.ms(self.first_token),
            total_ms = self.ms(Some(Instant::now())),
            finish = ?reason,
            prompt = self.prompt_text.as_deref(),
            "request finished"
        );
    }
}

/// A Generate response stream (see the module docs: it owns the engine's receiver).
pub struct GenerateStream {
    events: EventStream,
    /// Messages ready to send, in order.
    out: VecDeque<Result<pb::GenerateResponse, Status>>,
    /// The engine's last event for this request has been taken.
    done: bool,
    /// `delta_interval_ms` and `hold_first_token`: which Deltas may wait for more tokens.
    hold: Option<Hold>,
    /// When the Delta being held must go out.
    flush: Option<Pin<Box<tokio::time::Sleep>>>,
    /// A Delta went out: later ones may be held.
    delta_sent: bool,
    /// For the bytes of tokens in logprobs.
    vocab: Arc<dyn Vocab>,
    log: RequestLog,
    /// The request's span (a child of the router's, when it sent a trace context), and the
    /// phase it is in: `queue` until admitted, `prefill` until the first token, then `decode`.
    /// Replacing the phase ends the previous one.
    span: tracing::Span,
    phase: Option<tracing::Span>,
    _in_flight: InFlight,
}

/// Which Deltas may wait for more tokens, and for how long (see the request's fields).
#[derive(Clone, Copy)]
struct Hold {
    interval: Duration,
    first_token: bool,
}

impl GenerateStream {
    /// The Delta at the back of the queue, appended to, or a new one.
    fn delta(&mut self) -> &mut pb::Delta {
        let fresh = !matches!(self.out.back(), Some(Ok(pb::GenerateResponse { kind: Some(Kind::Delta(_)) })));
        if fresh {
            self.out.push_back(Ok(pb::GenerateResponse { kind: Some(Kind::Delta(pb::Delta::default())) }));
        }
        match self.out.back_mut() {
            Some(Ok(pb::GenerateResponse { kind: Some(Kind::Delta(d)) })) => d,
            _ => unreachable!("a Delta was just ensured at the back"),
        }
    }

    fn logprobs_frame(&self, id: u32, l: TokenLogprobs) -> pb::TokenLogprobs {
        let bytes = |t: u32| self.vocab.token_bytes(t).to_vec();
        pb::TokenLogprobs {
            logprob: l.logprob,
            token: bytes(id),
            top: l
                .top
                .into_iter()
                .map(|t| pb::TopLogprob { token_id: t.token, logprob: t.logprob, token: bytes(t.token) })
                .collect(),
        }
    }

    fn absorb(&mut self, ev: Event) {
        match ev {
            Event::Progress(Progress::Admitted { cached_tokens }) => {
                self.span.record("gen_ai.usage.cached_input_tokens", cached_tokens);
                self.phase =
                    Some(tracing::info_span!(parent: &self.span, "prefill", bellows.cached_tokens = cached_tokens));
            }
            Event::Progress(Progress::Prefilled { tokens }) => {
                if let Some(phase) = &self.phase {
                    telemetry::span_event(phase, "prefill_chunk", &[("tokens", i64::from(tokens))]);
                }
            }
            Event::Token { id, text, logprobs } => {
                if self.log.first_token.is_none() {
                    let decode =
                        tracing::info_span!(parent: &self.span, "decode", bellows.tokens = tracing::field::Empty);
                    telemetry::span_event(&decode, "first_token", &[]);
                    self.phase = Some(decode);
                }
                self.log.first_token.get_or_insert_with(Instant::now);
                self.log.tokens += 1;
                let logprobs = logprobs.map(|l| self.logprobs_frame(id, l));
                let d = self.delta();
                d.token_ids.push(id);
                d.text.push_str(&text);
                d.logprobs.extend(logprobs);
            }
            Event::Finished { text, reason, stop_sequence, usage } => {
                if !text.is_empty() {
                    self.delta().text.push_str(&text);
                }
                self.log.finished(reason, &usage);
                self.span.record("gen_ai.usage.output_tokens", usage.completion_tokens);
                self.span.record("gen_ai.response.finish_reasons", format!("{reason:?}").to_lowercase());
                if let Some(phase) = self.phase.take() {
                    phase.record("bellows.tokens", usage.completion_tokens);
                }
                let finished = pb::Finished {
                    reason: finish_reason(reason) as i32,
                    usage: Some(pb::Usage {
                        prompt_tokens: usage.prompt_tokens,
                        completion_tokens: usage.completion_tokens,
                        cached_prompt_tokens: usage.cached_tokens,
                    }),
                    stop_sequence,
                };
                self.out.push_back(Ok(pb::GenerateResponse { kind: Some(Kind::Finished(finished)) }));
                self.done = true;
            }
            Event::Failed { message } => {
                tracing::warn!(
                    request_id = %self.log.id,
                    trace_id = self.log.trace_id.as_deref(),
                    error = %message,
                    "request failed"
                );
                self.span.record("otel.status_code", "ERROR");
                self.phase = None;
                self.out.push_back(Err(NodeError::ModelFailed(message).into()));
                self.done = true;
            }
        }
    }
}

impl Stream for GenerateStream {
    type Item = Result<pb::GenerateResponse, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        // Take every event there is (progress events send nothing).
        while !this.done {
            match this.events.poll_recv(cx) {
                Poll::Pending => break,
                Poll::Ready(None) => this.absorb(Event::Failed { message: "the engine stopped".into() }),
                Poll::Ready(Some(ev)) => this.absorb(ev),
            }
        }
        // A lone Delta after the first (or the first too) may wait, up to the hold's interval,
        // for the next steps' tokens.
        let lone_delta = this.out.len() == 1
            && matches!(this.out.front(), Some(Ok(pb::GenerateResponse { kind: Some(Kind::Delta(_)) })));
        if let Some(hold) = this.hold
            && lone_delta
            && !this.done
            && (this.delta_sent || hold.first_token)
        {
            let flush = this.flush.get_or_insert_with(|| Box::pin(tokio::time::sleep(hold.interval)));
            if flush.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
        match this.out.pop_front() {
            Some(mut message) => {
                this.flush = None;
                if let Ok(pb::GenerateResponse { kind: Some(Kind::Delta(d)) }) = &mut message
                    && !this.delta_sent
                {
                    this.delta_sent = true;
                    d.first_token_held_us = this.log.first_token.map_or(0, |t| t.elapsed().as_micros() as u64);
                }
                Poll::Ready(Some(message))
            }
            None if this.done => Poll::Ready(None),
            None => Poll::Pending,
        }
    }
}

impl Drop for GenerateStream {
    fn drop(&mut self) {
        if !self.done {
            tracing::info!(
                request_id = %self.log.id,
                trace_id = self.log.trace_id.as_deref(),
                completion_tokens = self.log.tokens,
                ttft_ms = self.log.ms(self.log.first_token),
                total_ms = self.log.ms(Some(Instant::now())),
                "request cancelled by the client"
            );
        }
    }
}

fn finish_reason(r: FinishReason) -> pb::FinishReason {
    match r {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Cancelled => pb::FinishReason::Cancelled,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_sampling_fields_take_the_openai_defaults_not_zero() {
        let r = engine_request(pb::GenerateRequest { prompt_token_ids: vec![1], ..Default::default() }).unwrap();
        assert_eq!(r.params, SamplingParams::default());
        assert_eq!(r.max_tokens, None);
        let greedy = pb::SamplingParams { temperature: Some(0.0), ..Default::default() };
        let r = engine_request(pb::GenerateRequest { sampling: Some(greedy), ..Default::default() }).unwrap();
        assert_eq!(r.params.temperature, 0.0);
        assert_eq!(r.params.top_p, 1.0);
    }

    #[test]
    fn an_empty_stop_string_is_refused_rather_than_stopping_at_once() {
        let r = engine_request(pb::GenerateRequest { stop: vec![String::new()], ..Default::default() });
        assert!(matches!(r, Err(NodeError::Malformed(_))));
    }
}
