//! `POST /v1/chat/completions` and `POST /v1/completions`, and the pipeline every generating
//! endpoint runs, generic over its `Protocol` (`api::protocol`): OpenAI's `/v1/responses` and
//! Anthropic's `/v1/messages` too, which parse and render their own way in `api::responses` and
//! `api::anthropic`.
//!
//! The order of the steps is the point: admission first (a refusal costs nothing, not even
//! reading the body), then the body's size, its validation, the model, tokenization off the
//! async threads, the context check; only then are workers involved.

use std::{convert::Infallible, sync::Arc, time::Instant};

use axum::{
    body::Body,
    extract::State,
    http::{HeaderMap, StatusCode, header},
    response::{
        IntoResponse, Response,
        sse::{Event, KeepAlive, Sse},
    },
};
use bellows_common::{
    chat_template::{ChatTemplate, TemplateKwargs},
    prefix_hash::BlockHash,
    priority::Priority,
    telemetry,
};
use futures_util::{Stream, StreamExt, stream};
use serde_json::Value;
use tokio::sync::mpsc;
use tracing::{Instrument, Span, field::Empty};

use super::{
    AppState,
    error::{ApiError, Overload, ratelimit_headers},
    protocol::Protocol,
    reply::{Accounting, Reply, Timing},
    request::{self, Endpoint, Input, Job, Prompt},
    response::{self, Header, UsageOut},
    tool_request,
};
use crate::{
    admission::Ticket,
    answer::{AnswerParser, AnswerShape, Piece, Start},
    cluster::ModelPool,
    dispatch::{Choice, ChoiceEvent},
    generation::Structured,
    metrics::{ReasonLabels, RequestLabels},
    tenants::{QueueRejection, Tenant},
    tools::{CallParsing, Family, ParsedCall, Tools},
};

pub async fn chat_completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    serve::<Chat>(&state, &headers, body).await
}

pub async fn completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    serve::<Completions>(&state, &headers, body).await
}

/// OpenAI's chat completions (`messages` in, `chat.completion` or its chunks out) and, with
/// `CHAT` false, its legacy completions (`prompt`, text or token ids, in; `text_completion` out):
/// one parser and one renderer, which the endpoint steers.
pub(super) struct OpenAi<const CHAT: bool>;
pub(super) type Chat = OpenAi<true>;
pub(super) type Completions = OpenAi<false>;

impl<const CHAT: bool> Protocol for OpenAi<CHAT> {
    type Turn = ();
    const ENDPOINT: Endpoint = if CHAT { Endpoint::ChatCompletions } else { Endpoint::Completions };
    const SPAN_NAME: &'static str = if CHAT { "POST /v1/chat/completions" } else { "POST /v1/completions" };
    const ROUTE: &'static str = if CHAT { "/v1/chat/completions" } else { "/v1/completions" };
    const OPERATION: &'static str = if CHAT { "chat" } else { "text_completion" };

    async fn parse(_: &AppState, _: &Tenant, body: &[u8]) -> Result<(Job, ()), ApiError> {
        Ok((request::parse(Self::ENDPOINT, body)?, ()))
    }

    async fn whole(reply: Reply, _: (), rx: mpsc::Receiver<ChoiceEvent>) -> Result<Response, ApiError> {
        reply.whole(rx).await
    }

    async fn stream(reply: Reply, _: (), rx: mpsc::Receiver<ChoiceEvent>, usage: bool) -> Result<Response, ApiError> {
        reply.stream(rx, usage).await
    }
}

/// One request through [`complete`], in its span, with its refusal counted, its tenant's
/// rate-limit headers and its status in the metrics, errors in the protocol's own shape.
pub(super) async fn serve<P: Protocol>(state: &Arc<AppState>, headers: &HeaderMap, body: Body) -> Response {
    let span = tracing::info_span!(
        "http.request",
        otel.name = P::SPAN_NAME,
        otel.kind = "server",
        otel.status_code = Empty,
        http.request.method = "POST",
        http.route = P::ROUTE,
        http.response.status_code = Empty,
        gen_ai.operation.name = P::OPERATION,
        gen_ai.request.model = Empty,
        gen_ai.request.max_tokens = Empty,
        gen_ai.response.id = Empty,
        gen_ai.response.finish_reasons = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        gen_ai.usage.cached_input_tokens = Empty,
        bellows.tenant = Empty,
        bellows.priority = Empty,
        bellows.request_id = Empty,
        trace_id = Empty,
    );
    telemetry::continue_trace(&span, headers);
    if let Some(id) = telemetry::trace_id(&span) {
        span.record("trace_id", id);
    }
    let mut who = Caller::default();
    let mut response = match complete::<P>(state, headers, body, &mut who, &span).instrument(span.clone()).await {
        Ok(r) => r,
        Err(e) => {
            if let Some(reason) = e.refusal_reason() {
                state.metrics.refusals.get_or_create(&ReasonLabels { reason }).inc();
                let tenant = who.tenant.as_ref().map(|t| t.name.as_str());
                state.usage.refused(tenant, who.model.as_deref(), reason);
            }
            P::error_response(e)
        }
    };
    // Every answer to a known tenant carries its rate-limit state, errors included.
    if let Some(tenant) = &who.tenant {
        response.headers_mut().extend(ratelimit_headers(&state.tenants.limits().quotas(tenant)));
    }
    let labels = RequestLabels {
        endpoint: P::ENDPOINT.as_str(),
        model: who.model.unwrap_or_default(),
        status: response.status().as_u16(),
    };
    state.metrics.requests.get_or_create(&labels).inc();
    span.record("http.response.status_code", response.status().as_u16());
    if response.status().is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    if response.status() != StatusCode::OK
        && let Some(skipped) = state.refusal_log.sample()
    {
        let _enter = span.enter();
        tracing::info!(status = response.status().as_u16(), skipped, "request refused (at most one line a second)");
    }
    response
}

/// Who asked, as far as the request got: for metrics, accounting and headers.
#[derive(Default)]
struct Caller {
    tenant: Option<Arc<Tenant>>,
    /// Set once the model is known to be served (so labels stay bounded).
    model: Option<String>,
}

/// A prompt ready for the workers.
struct Tokenized {
    tokens: Arc<Vec<u32>>,
    hashes: Arc<Vec<BlockHash>>,
}

/// A request from arrival to its answer: authenticate and admit, parse, tokenize, charge the
/// tenant, dispatch the choices, answer (whole or streamed).
async fn complete<P: Protocol>(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
    who: &mut Caller,
    span: &Span,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let tenant = state.tenants.authenticate(authorization(headers).as_deref()).map_err(|_| ApiError::Unauthorized)?;
    span.record("bellows.tenant", tenant.name.as_str());
    who.tenant = Some(tenant.clone());
    let ticket = admit_at_cap(state, tenant.most_urgent())?;
    let bytes = read_body(state, headers, body).await?;
    let (mut job, turn) = P::parse(state, &tenant, &bytes).await?;
    let endpoint = P::ENDPOINT;
    let class = tenant.class(job.priority)?;
    span.record("bellows.priority", class.as_str());
    if ticket.is_some() {
        let queue = state.cluster.queue();
        state
            .admission
            .recheck(queue, class)
            .map_err(|retry_after| ApiError::Overloaded { reason: Overload::QueueFull, retry_after })?;
    }
    span.record("gen_ai.request.model", job.model.as_str());
    if let Some(m) = job.params.max_tokens {
        span.record("gen_ai.request.max_tokens", m);
    }
    let pool = state.cluster.model(&job.model).ok_or_else(|| ApiError::ModelNotFound(job.model.clone()))?;
    who.model = Some(pool.name.clone());
    // With active tools: how to read the calls out of the answer.
    let tool_parsing = job
        .tools
        .as_ref()
        .filter(|t| t.active())
        .map(|t| CallParsing::of(Family::of_template(pool.tokenizer.template().map(ChatTemplate::source)), t));
    check_constraints(state, tool_parsing.as_ref().map(|p| p.family), &mut job).await?;
    if tool_parsing.as_ref().is_some_and(|p| p.family.opens_with_a_control_token()) {
        job.params.keep_special_tokens = true;
    }
    let cache_salt = tenant.prefix_salt(job.cache_salt.as_deref());
    let tokenized = tokenize_job(state, &pool, &mut job, &cache_salt).await?;
    check_against_model(&pool, &job, &tokenized)?;
    let thinking = thinking_start(endpoint, &pool, &tokenized);
    if thinking == Some(Start::Thinking) {
        constrain_after_thinking(&mut job);
    }
    let accounting = charge(state, &tenant, class, &pool, &mut job, &tokenized).await?;

    let id = new_id(endpoint);
    span.record("gen_ai.response.id", id.as_str());
    span.record("bellows.request_id", id.as_str());
    let choices = choices(&job, class, &tokenized, &id, &cache_salt, ticket, span);
    let reply = Reply {
        endpoint,
        id,
        model: pool.name.clone(),
        created: super::unix_seconds(),
        priority: class,
        n: job.n,
        choices: tokenized.len() * job.n as usize,
        prompt_tokens: tokenized.first().map_or(0, |t| t.tokens.len() as u32),
        logprobs: job.params.top_logprobs.is_some(),
        answer: AnswerShape { thinking, calls: tool_parsing },
        span: span.clone(),
        trace_text: state.trace_text,
        arrived,
        latencies: state.metrics.latencies(&pool.name),
        accounting,
    };
    answer::<P>(state, &pool, choices, reply, turn, &job).await
}

/// Where a thinking model's answer starts, on the endpoints that keep thinking apart (a raw
/// completion's text is the model's, tags and all).
fn thinking_start(endpoint: Endpoint, pool: &ModelPool, tokenized: &[Tokenized]) -> Option<Start> {
    let thinking = pool.thinking.filter(|_| endpoint != Endpoint::Completions)?;
    Some(thinking.start(&tokenized.first()?.tokens))
}

/// A constraint (structured output, a forced call) holds a thinking model's answer, not its
/// thinking: the model thinks freely to `</think>`, then answers as constrained. A client's own
/// grammar is left as it is (it covers the whole output).
fn constrain_after_thinking(job: &mut Job) {
    if let Some(s) = &mut job.params.structured
        && let Some(nested) = s.constraint.after_thinking()
    {
        s.constraint = nested;
    }
}

/// The job's prompts as tokens and block hashes: on the tokenizer pool when there is text or
/// a chat to render, in place for token ids (hashing costs less than the hop to the pool).
async fn tokenize_job(
    state: &AppState,
    pool: &Arc<ModelPool>,
    job: &mut Job,
    cache_salt: &Option<String>,
) -> Result<Vec<Tokenized>, ApiError> {
    let input = std::mem::replace(&mut job.input, Input::Prompts(Vec::new()));
    let tools = job.tools.clone();
    let kwargs = job.chat_template_kwargs.clone();
    let trace_text = state.trace_text;
    let span = tracing::info_span!("tokenize", bellows.prompt_tokens = Empty, bellows.prompt = Empty);
    let result = if needs_tokenizer(&input) {
        let (pool, cache_salt, in_pool) = (pool.clone(), cache_salt.clone(), span.clone());
        state
            .tokenizers
            .run(move || {
                in_pool.in_scope(|| {
                    tokenize(&pool, input, tools.as_ref(), kwargs.as_ref(), cache_salt.as_deref(), trace_text)
                })
            })
            .await
            .map_err(|_| tokenizer_busy())??
    } else {
        span.in_scope(|| tokenize(pool, input, tools.as_ref(), kwargs.as_ref(), cache_salt.as_deref(), trace_text))?
    };
    span.record("bellows.prompt_tokens", result.iter().map(|t| t.tokens.len()).sum::<usize>());
    Ok(result)
}

/// The tenant's own limits, then (with fair sharing) its turn under the global cap; the
/// tenant's `max_tokens` cap stands in for an absent `max_tokens`, within the context.
async fn charge(
    state: &AppState,
    tenant: &Arc<Tenant>,
    class: Priority,
    pool: &ModelPool,
    job: &mut Job,
    tokenized: &[Tokenized],
) -> Result<Accounting, ApiError> {
    let prompt_tokens: usize = tokenized.iter().map(|t| t.tokens.len()).sum();
    let max_tokens = job.params.max_tokens.map(u64::from);
    let limits = state.tenants.limits().admit(tenant, &pool.name, prompt_tokens as u64, max_tokens)?;
    if job.params.max_tokens.is_none()
        && let Some(cap) = limits.max_tokens()
    {
        let longest = tokenized.iter().map(|t| t.tokens.len()).max().unwrap_or(0);
        let room = pool.context_length().saturating_sub(longest).max(1);
        job.params.max_tokens = Some(cap.min(room as u64) as u32);
    }
    let turn = match &state.fair_queue {
        None => None,
        Some(queue) => {
            let cost = prompt_tokens as u64 + u64::from(job.params.max_tokens.unwrap_or(0)) * u64::from(job.n);
            let waited =
                queue.wait_turn(tenant, class, cost).instrument(tracing::info_span!("admission.fair_queue")).await;
            match waited {
                Ok(turn) => Some(turn),
                Err(rejection) => {
                    limits.refund();
                    let reason = match rejection {
                        QueueRejection::Full { .. } => Overload::TenantQueueFull,
                        QueueRejection::Timeout { .. } => Overload::QueueTimeout,
                    };
                    return Err(ApiError::Overloaded { reason, retry_after: rejection.retry_after() });
                }
            }
        }
    };
    let usage = state.usage.model(&tenant.name, &pool.name);
    usage.request(prompt_tokens as u64, 0);
    Ok(Accounting { limits, usage, turn })
}

/// The request's choices (`n` per prompt). The first carries the request's admission ticket;
/// a seeded request's choices get consecutive seeds, so they differ from each other and still
/// repeat.
fn choices(
    job: &Job,
    priority: Priority,
    tokenized: &[Tokenized],
    id: &str,
    cache_salt: &Option<String>,
    mut ticket: Option<Ticket>,
    span: &Span,
) -> Vec<Choice> {
    let n = job.n;
    let mut choices = Vec::with_capacity(tokenized.len() * n as usize);
    for (p, prompt) in tokenized.iter().enumerate() {
        for j in 0..n {
            let mut params = job.params.clone();
            params.sampling.seed = params.sampling.seed.map(|s| s.wrapping_add(u64::from(j)));
            choices.push(Choice {
                index: p as u32 * n + j,
                request_id: id.to_string(),
                prompt: prompt.tokens.clone(),
                hashes: prompt.hashes.clone(),
                params,
                cache_salt: cache_salt.clone(),
                stream: job.stream,
                priority,
                ticket: ticket.take(),
                span: span.clone(),
            });
        }
    }
    choices
}

/// Generate the choices, all answering on one channel, and answer from it. A streamed answer
/// outlives this handler (its body streams on), so its choices run as tasks of their own; a
/// whole one is generated right here, its choices beside the reply that collects them: no task
/// to spawn, and no hand-off between threads for each worker message.
async fn answer<P: Protocol>(
    state: &AppState,
    pool: &Arc<ModelPool>,
    choices: Vec<Choice>,
    reply: Reply,
    turn: P::Turn,
    job: &Job,
) -> Result<Response, ApiError> {
    let (tx, rx) = mpsc::channel(64);
    if job.stream {
        for choice in choices {
            state.dispatcher.spawn(pool.clone(), choice, tx.clone());
        }
        drop(tx);
        return P::stream(reply, turn, rx, job.include_usage).await;
    }
    let work =
        futures_util::future::join_all(choices.into_iter().map(|c| state.dispatcher.run_choice(pool, c, tx.clone())));
    drop(tx);
    // The reply ends once every choice is done (or one failed): dropping its receiver then
    // stops the rest.
    let (_, answer) = tokio::join!(work, P::whole(reply, turn, rx));
    answer
}

/// Without fair sharing, the global cap refuses at once, before the body is read (at the cap of
/// the tenant's most urgent class; the request's own class is checked once the body names
/// it); the ticket holds the request's place under it. With fair sharing there is no ticket here: the request
/// queues for its fair share later, once tokenization gives its cost.
fn admit_at_cap(state: &AppState, class: Priority) -> Result<Option<Ticket>, ApiError> {
    if state.fair_queue.is_some() {
        return Ok(None);
    }
    let queue = state.cluster.queue();
    let admitted = state.admission.admit(queue, class);
    tracing::info_span!(
        "admission",
        bellows.waiting_requests = queue.waiting_requests,
        bellows.max_waiting = state.admission.max_waiting,
        bellows.admitted = admitted.is_ok(),
    )
    .in_scope(|| {});
    match admitted {
        Ok(ticket) => Ok(Some(ticket)),
        Err(retry_after) => Err(ApiError::Overloaded { reason: Overload::QueueFull, retry_after }),
    }
}

/// The body, at most `--max-body-bytes` (a declared length over it is refused before reading).
pub(super) async fn read_body(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<axum::body::Bytes, ApiError> {
    let limit = state.max_body_bytes;
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        if is_length_limit(&e) {
            ApiError::BodyTooLarge { limit }
        } else {
            ApiError::InvalidRequest { message: format!("could not read the request body: {e}"), param: None }
        }
    })
}

/// A forced tool call becomes the request's constraint; then every constraint and every tool's
/// parameters schema is compiled, as a worker would, on the tokenizer threads (milliseconds of
/// CPU each), before anything else is spent.
async fn check_constraints(state: &AppState, family: Option<Family>, job: &mut Job) -> Result<(), ApiError> {
    if let (Some(tools), Some(family)) = (&job.tools, family)
        && let Some(c) = tools.constraint(family, job.json_bounds)
    {
        job.params.structured = Some(Structured { constraint: c, param: "tool_choice" });
    }
    let (structured, tools) = (job.params.structured.clone(), job.tools.clone());
    if structured.is_none() && tools.is_none() {
        return Ok(());
    }
    let checked = state
        .tokenizers
        .run(move || {
            tools.as_ref().map_or(Ok(()), tool_request::check_parameters)?;
            structured.as_ref().map_or(Ok(()), request::check_structured)
        })
        .await;
    checked.map_err(|_| tokenizer_busy())?
}

/// The tokenizer threads' queue is full: retry shortly.
pub(super) fn tokenizer_busy() -> ApiError {
    ApiError::Overloaded { reason: Overload::TokenizerBusy, retry_after: std::time::Duration::from_secs(1) }
}

fn is_length_limit(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// Whether turning `input` into token ids takes the tokenizer (text or chat), not only hashing.
fn needs_tokenizer(input: &Input) -> bool {
    match input {
        Input::Chat(_) => true,
        Input::Prompts(prompts) => prompts.iter().any(|p| matches!(p, Prompt::Text(_))),
    }
}

fn tokenize(
    pool: &ModelPool,
    input: Input,
    tools: Option<&Tools>,
    kwargs: Option<&TemplateKwargs>,
    cache_salt: Option<&str>,
    trace_text: bool,
) -> Result<Vec<Tokenized>, ApiError> {
    if trace_text {
        let text = match &input {
            Input::Chat(messages) => serde_json::to_string(messages).unwrap_or_default(),
            Input::Prompts(prompts) => format!("{prompts:?}"),
        };
        Span::current().record("bellows.prompt", text);
    }
    let prompts: Vec<Vec<u32>> = match input {
        Input::Chat(messages) => vec![pool.tokenizer.encode_chat(&messages, tools, kwargs)?],
        Input::Prompts(prompts) => prompts
            .into_iter()
            .map(|p| match p {
                Prompt::Text(text) => pool.tokenizer.encode_text(&text),
                Prompt::Tokens(tokens) => Ok(tokens),
            })
            .collect::<Result<_, _>>()?,
    };
    Ok(prompts
        .into_iter()
        .map(|tokens| {
            let hashes = pool.block_hashes(&tokens, cache_salt);
            Tokenized { tokens: Arc::new(tokens), hashes: Arc::new(hashes) }
        })
        .collect())
}

/// What only the model can tell: token ids within its vocabulary, prompts within its context.
fn check_against_model(pool: &ModelPool, job: &Job, prompts: &[Tokenized]) -> Result<(), ApiError> {
    let vocab = pool.vocab_size;
    if let Some(bad) = job.params.sampling.logit_bias.keys().find(|&&id| id >= vocab) {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("token id {bad} is outside the vocabulary ({vocab} tokens)"),
        ));
    }
    if let Some(bad) = job.params.stop_token_ids.iter().find(|&&id| id >= vocab) {
        return Err(ApiError::invalid(
            "stop_token_ids",
            format!("token id {bad} is outside the vocabulary ({vocab} tokens)"),
        ));
    }
    let context_length = pool.context_length();
    if context_length == 0 {
        return Err(ApiError::Overloaded {
            reason: Overload::NoWorkers,
            retry_after: std::time::Duration::from_secs(1),
        });
    }
    for p in prompts {
        if let Some(bad) = p.tokens.iter().find(|&&id| id >= vocab) {
            return Err(ApiError::invalid(
                "prompt",
                format!("token id {bad} is outside the vocabulary ({vocab} tokens)"),
            ));
        }
        if p.tokens.is_empty() {
            return Err(ApiError::invalid(job.prompt_param(), "the prompt is empty"));
        }
        let over = match job.params.max_tokens {
            Some(m) => p.tokens.len() + m as usize > context_length,
            None => p.tokens.len() >= context_length,
        };
        if over {
            return Err(ApiError::ContextLengthExceeded {
                prompt_tokens: p.tokens.len(),
                max_tokens: job.params.max_tokens,
                context_length,
                param: job.prompt_param(),
            });
        }
    }
    Ok(())
}

fn new_id(endpoint: Endpoint) -> String {
    let random = rand::random::<u128>() >> 32;
    match endpoint {
        Endpoint::ChatCompletions => format!("chatcmpl-{random:024x}"),
        Endpoint::Completions => format!("cmpl-{random:024x}"),
        Endpoint::Responses => format!("resp_{random:024x}"),
        Endpoint::Messages => format!("msg_{random:024x}"),
    }
}

/// The caller's key as an `Authorization` value: that header, or Anthropic's `x-api-key`
/// (`Bearer <key>`), so a tenant's key works from either protocol's clients.
pub(super) fn authorization(headers: &HeaderMap) -> Option<String> {
    if let Some(v) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        return Some(v.to_string());
    }
    headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(|key| format!("Bearer {key}"))
}

impl Reply {
    fn header(&self, chunk: bool) -> Header<'_> {
        let object = match (self.endpoint, chunk) {
            (Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::Responses, true) => "chat.completion.chunk",
            (Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::Responses, false) => "chat.completion",
            (Endpoint::Completions, _) => "text_completion",
        };
        Header {
            id: &self.id,
            object,
            created: self.created,
            model: &self.model,
            service_tier: self.priority.service_tier(),
        }
    }

    async fn whole(mut self, rx: mpsc::Receiver<ChoiceEvent>) -> Result<Response, ApiError> {
        let (texts, usage) = self.collect(rx).await?;
        let body = response::completion(self.endpoint, &self.header(false), &texts, usage);
        Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
    }

    /// Stream the choices as server-sent events. The HTTP status is decided by the first
    /// event: a request that fails before any output gets its proper error status, not a 200
    /// with an error inside.
    async fn stream(mut self, mut rx: mpsc::Receiver<ChoiceEvent>, include_usage: bool) -> Result<Response, ApiError> {
        let mut timing = Timing { streamed: true, ..Timing::default() };
        let first = self.first_output(&mut rx, &mut timing).await?;
        let parsers = (0..self.choices).map(|_| self.answer.parser()).collect();
        let state = StreamState {
            parsers,
            calls: vec![0; self.choices],
            text_offsets: vec![0; self.choices],
            reply: self,
            rx,
            timing,
            pending: Some(first),
            opened: Vec::new(),
            finishes: Vec::new(),
            usage: UsageOut::default(),
            include_usage,
            closed: 0,
            finished: false,
        };
        Ok((StatusCode::OK, Sse::new(events(state)).keep_alive(KeepAlive::default())).into_response())
    }
}

struct StreamState {
    reply: Reply,
    rx: mpsc::Receiver<ChoiceEvent>,
    timing: Timing,
    pending: Option<ChoiceEvent>,
    /// Per choice: characters of text its logprobs have covered (completions' `text_offset`).
    text_offsets: Vec<u32>,
    /// Per choice: its answer's parser, and the calls it sent.
    parsers: Vec<AnswerParser>,
    calls: Vec<usize>,
    /// Chat choices whose opening chunk (the role) was sent.
    opened: Vec<u32>,
    finishes: Vec<&'static str>,
    usage: UsageOut,
    include_usage: bool,
    closed: usize,
    finished: bool,
}

fn events(state: StreamState) -> impl Stream<Item = Result<Event, Infallible>> {
    stream::unfold(state, |mut s| async move {
        if s.finished {
            return None;
        }
        let event = match s.pending.take() {
            Some(e) => Some(e),
            None => s.rx.recv().await,
        };
        let out = s.step(event);
        Some((out, s))
    })
    .flat_map(|batch| stream::iter(batch.into_iter().map(|data| Ok(Event::default().data(data)))))
}

impl StreamState {
    /// The SSE data lines for one event.
    fn step(&mut self, event: Option<ChoiceEvent>) -> Vec<String> {
        let endpoint = self.reply.endpoint;
        let mut out = Vec::with_capacity(2);
        if let Some(e) = &event {
            self.reply.observe(e, &mut self.timing);
        }
        match event {
            Some(ChoiceEvent::Started { .. }) => {}
            Some(ChoiceEvent::Text { index, text, tokens, logprobs, .. }) => {
                self.open(index, &mut out);
                let logprobs = self
                    .reply
                    .logprobs
                    .then(|| response::logprobs(endpoint, &logprobs, &mut self.text_offsets[index as usize]));
                let pieces = self.parsers[index as usize].push(text, tokens);
                self.send_pieces(index, pieces, logprobs, &mut out);
            }
            Some(ChoiceEvent::Done { index, finish, usage, .. }) => {
                self.open(index, &mut out);
                let parser = &mut self.parsers[index as usize];
                let (pieces, thought) = (parser.finish(), parser.reasoning_tokens());
                self.send_pieces(index, pieces, None, &mut out);
                let made_calls = self.calls[index as usize] > 0;
                let finish = response::finish_with_calls(response::finish_reason(finish), made_calls);
                out.push(response::chunk(endpoint, &self.reply.header(true), index, false, None, None, Some(finish)));
                self.usage.add(&usage, index % self.reply.n == 0);
                self.usage.add_reasoning(thought);
                self.finishes.push(finish);
                self.closed += 1;
                if self.closed == self.reply.choices {
                    self.reply.record(&self.usage, &self.finishes, None);
                    self.reply.finished();
                    if self.include_usage {
                        out.push(response::usage_chunk(&self.reply.header(true), self.usage));
                    }
                    out.push("[DONE]".to_string());
                    self.finished = true;
                }
            }
            Some(ChoiceEvent::Failed { error, .. }) => {
                self.reply.span.record("otel.status_code", "ERROR");
                out.push(serde_json::to_string(&ApiError::from(error).body()).expect("error bodies serialize"));
                out.push("[DONE]".to_string());
                self.finished = true;
            }
            None => {
                let error = ApiError::WorkerFailed("the stream ended without finishing".into());
                out.push(serde_json::to_string(&error.body()).expect("error bodies serialize"));
                out.push("[DONE]".to_string());
                self.finished = true;
            }
        }
        out
    }

    /// Content and calls of choice `index` as chunks; `logprobs` go with the first content chunk
    /// (or one of their own when all of it was call markup).
    fn send_pieces(&mut self, index: u32, pieces: Vec<Piece>, mut logprobs: Option<Value>, out: &mut Vec<String>) {
        let (endpoint, header) = (self.reply.endpoint, self.reply.header(true));
        for piece in pieces {
            match piece {
                Piece::Reasoning(text) => out.push(response::reasoning_chunk(&header, index, &text)),
                Piece::Content(text) => {
                    out.push(response::chunk(endpoint, &header, index, false, Some(&text), logprobs.take(), None));
                }
                Piece::Call(call) => {
                    let sent = &mut self.calls[index as usize];
                    out.push(response::tool_calls_chunk(&header, index, *sent, &[call]));
                    *sent += 1;
                }
                Piece::CallStarted { name } => {
                    let call = ParsedCall { name, arguments: String::new() };
                    out.push(response::tool_calls_chunk(&header, index, self.calls[index as usize], &[call]));
                }
                Piece::Arguments(fragment) => {
                    out.push(response::tool_arguments_chunk(&header, index, self.calls[index as usize], &fragment));
                }
                Piece::CallEnded => self.calls[index as usize] += 1,
            }
        }
        if logprobs.is_some() {
            out.push(response::chunk(endpoint, &header, index, false, Some(""), logprobs, None));
        }
    }

    /// A chat choice's first chunk carries the assistant role.
    fn open(&mut self, index: u32, out: &mut Vec<String>) {
        if self.reply.endpoint == Endpoint::ChatCompletions && !self.opened.contains(&index) {
            self.opened.push(index);
            out.push(response::chunk(self.reply.endpoint, &self.reply.header(true), index, true, Some(""), None, None));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenized(tokens: &[u32]) -> Tokenized {
        Tokenized { tokens: Arc::new(tokens.to_vec()), hashes: Arc::new(Vec::new()) }
    }

    #[test]
    fn choices_are_numbered_by_prompt_then_sample_and_a_seeded_requests_choices_get_consecutive_seeds() {
        let body = br#"{"model": "m", "prompt": ["a", "b"], "n": 3, "seed": 5, "max_tokens": 4}"#;
        let job = request::parse(Endpoint::Completions, body).unwrap();
        let prompts = [tokenized(&[1, 2]), tokenized(&[3])];
        let span = Span::none();
        let choices = choices(&job, Priority::Standard, &prompts, "cmpl-1", &None, None, &span);
        let shape: Vec<(u32, Vec<u32>, Option<u64>)> =
            choices.iter().map(|c| (c.index, c.prompt.to_vec(), c.params.sampling.seed)).collect();
        assert_eq!(
            shape,
            vec![
                (0, vec![1, 2], Some(5)),
                (1, vec![1, 2], Some(6)),
                (2, vec![1, 2], Some(7)),
                (3, vec![3], Some(5)),
                (4, vec![3], Some(6)),
                (5, vec![3], Some(7)),
            ]
        );
        assert!(choices.iter().all(|c| c.params.max_tokens == Some(4) && c.request_id == "cmpl-1"));
    }

    #[test]
    fn an_unseeded_request_leaves_every_choice_unseeded() {
        let job = request::parse(Endpoint::Completions, br#"{"model": "m", "prompt": "a", "n": 2}"#).unwrap();
        let choices = choices(&job, Priority::Batch, &[tokenized(&[1])], "cmpl-2", &None, None, &Span::none());
        assert!(choices.iter().all(|c| c.params.sampling.seed.is_none() && c.priority == Priority::Batch));
    }

    #[test]
    fn ids_carry_their_protocols_prefix() {
        assert!(new_id(Endpoint::ChatCompletions).starts_with("chatcmpl-"));
        assert!(new_id(Endpoint::Completions).starts_with("cmpl-"));
        assert!(new_id(Endpoint::Responses).starts_with("resp_"));
        assert!(new_id(Endpoint::Messages).starts_with("msg_"));
    }
}
