//! `POST /v1/chat/completions` and `POST /v1/completions`.
//!
//! The order of the steps is the point: admission first (a refusal costs nothing, not even
//! reading the body), then the body's size, its validation, the model, tokenization off the
//! async threads, the context check; only then are workers involved.

use std::{
    convert::Infallible,
    sync::Arc,
    time::{SystemTime, UNIX_EPOCH},
};

use axum::{
    body::Body,
    extract::State,
    http::{HeaderMap, StatusCode, header},
    response::{
        IntoResponse, Response,
        sse::{Event, KeepAlive, Sse},
    },
};
use bellows_common::prefix_hash::BlockHash;
use futures_util::{Stream, StreamExt, stream};
use tokio::sync::mpsc;

use super::{
    AppState,
    error::{ApiError, Overload},
    request::{self, Endpoint, Input, Job, Prompt},
    response::{self, Header, UsageOut},
};
use crate::{
    cluster::ModelPool,
    dispatch::{Choice, ChoiceEvent},
    metrics::{ReasonLabels, RequestLabels},
};

pub async fn chat_completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    serve(&state, Endpoint::ChatCompletions, &headers, body).await
}

pub async fn completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    serve(&state, Endpoint::Completions, &headers, body).await
}

async fn serve(state: &Arc<AppState>, endpoint: Endpoint, headers: &HeaderMap, body: Body) -> Response {
    let mut model = None;
    let response = match complete(state, endpoint, headers, body, &mut model).await {
        Ok(r) => r,
        Err(e) => {
            if let ApiError::Overloaded { reason, .. } = &e {
                state.metrics.refusals.get_or_create(&ReasonLabels { reason: reason.as_str() }).inc();
            }
            e.into_response()
        }
    };
    let labels = RequestLabels {
        endpoint: endpoint.as_str(),
        model: model.unwrap_or_default(),
        status: response.status().as_u16(),
    };
    state.metrics.requests.get_or_create(&labels).inc();
    response
}

/// A prompt ready for the workers.
struct Tokenized {
    tokens: Arc<Vec<u32>>,
    hashes: Arc<Vec<BlockHash>>,
}

async fn complete(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Body,
    model_label: &mut Option<String>,
) -> Result<Response, ApiError> {
    if let Err(retry_after) = state.admission.check(state.cluster.queue()) {
        return Err(ApiError::Overloaded { reason: Overload::QueueFull, retry_after });
    }
    let limit = state.max_body_bytes;
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    let bytes = axum::body::to_bytes(body, limit).await.map_err(|e| {
        if is_length_limit(&e) {
            ApiError::BodyTooLarge { limit }
        } else {
            ApiError::InvalidRequest { message: format!("could not read the request body: {e}"), param: None }
        }
    })?;
    let mut job = request::parse(endpoint, &bytes)?;
    let pool = state.cluster.model(&job.model).ok_or_else(|| ApiError::ModelNotFound(job.model.clone()))?;
    *model_label = Some(pool.name.clone());

    let input = std::mem::replace(&mut job.input, Input::Prompts(Vec::new()));
    let tokenized = {
        let pool = pool.clone();
        state.tokenizers.run(move || tokenize(&pool, input, None)).await.map_err(|_| ApiError::Overloaded {
            reason: Overload::TokenizerBusy,
            retry_after: std::time::Duration::from_secs(1),
        })??
    };
    check_against_model(&pool, &job, &tokenized)?;

    let id = new_id(endpoint);
    let (tx, rx) = mpsc::channel(64);
    let n = job.n;
    for (p, prompt) in tokenized.iter().enumerate() {
        for j in 0..n {
            let mut params = job.params.clone();
            // Choices of one seeded request must differ from each other, and still repeat.
            params.sampling.seed = params.sampling.seed.map(|s| s.wrapping_add(u64::from(j)));
            let choice = Choice {
                index: p as u32 * n + j,
                request_id: id.clone(),
                prompt: prompt.tokens.clone(),
                hashes: prompt.hashes.clone(),
                params,
                cache_salt: None,
            };
            state.dispatcher.spawn(pool.clone(), choice, tx.clone());
        }
    }
    drop(tx);
    let choices = tokenized.len() * n as usize;
    let reply = Reply {
        endpoint,
        id,
        model: pool.name.clone(),
        created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        n,
        choices,
    };
    if job.stream { reply.stream(rx, job.include_usage).await } else { reply.whole(rx).await }
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

fn tokenize(pool: &ModelPool, input: Input, cache_salt: Option<&str>) -> Result<Vec<Tokenized>, ApiError> {
    let prompts: Vec<Vec<u32>> = match input {
        Input::Chat(messages) => vec![pool.tokenizer.encode_chat(&messages)?],
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
    let prefix = match endpoint {
        Endpoint::ChatCompletions => "chatcmpl",
        Endpoint::Completions => "cmpl",
    };
    format!("{prefix}-{:024x}", rand::random::<u128>() >> 32)
}

/// The answer being assembled from the choices' events.
struct Reply {
    endpoint: Endpoint,
    id: String,
    model: String,
    created: u64,
    n: u32,
    choices: usize,
}

impl Reply {
    fn header(&self, chunk: bool) -> Header<'_> {
        let object = match (self.endpoint, chunk) {
            (Endpoint::ChatCompletions, true) => "chat.completion.chunk",
            (Endpoint::ChatCompletions, false) => "chat.completion",
            (Endpoint::Completions, _) => "text_completion",
        };
        Header { id: &self.id, object, created: self.created, model: &self.model }
    }

    async fn whole(self, mut rx: mpsc::Receiver<ChoiceEvent>) -> Result<Response, ApiError> {
        let mut texts = vec![(String::new(), "stop"); self.choices];
        let mut usage = UsageOut::default();
        let mut open = self.choices;
        while open > 0 {
            match rx.recv().await {
                Some(ChoiceEvent::Text { index, text }) => texts[index as usize].0.push_str(&text),
                Some(ChoiceEvent::Done { index, finish, usage: u }) => {
                    texts[index as usize].1 = response::finish_reason(finish);
                    usage.add(&u, index % self.n == 0);
                    open -= 1;
                }
                Some(ChoiceEvent::Failed { error, .. }) => return Err(error),
                None => return Err(ApiError::WorkerFailed("a choice ended without an answer".into())),
            }
        }
        let body = response::completion(self.endpoint, &self.header(false), &texts, usage);
        Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
    }

    /// Stream the choices as server-sent events. The HTTP status is decided by the first
    /// event: a request that fails before any output gets its proper error status, not a 200
    /// with an error inside.
    async fn stream(self, mut rx: mpsc::Receiver<ChoiceEvent>, include_usage: bool) -> Result<Response, ApiError> {
        let first = match rx.recv().await {
            Some(ChoiceEvent::Failed { error, .. }) => return Err(error),
            Some(event) => event,
            None => return Err(ApiError::WorkerFailed("no choice produced anything".into())),
        };
        let state = StreamState {
            reply: self,
            rx,
            pending: Some(first),
            opened: Vec::new(),
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
    pending: Option<ChoiceEvent>,
    /// Chat choices whose opening chunk (the role) was sent.
    opened: Vec<u32>,
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
        match event {
            Some(ChoiceEvent::Text { index, text }) => {
                self.open(index, &mut out);
                out.push(response::chunk(endpoint, &self.reply.header(true), index, false, Some(&text), None));
            }
            Some(ChoiceEvent::Done { index, finish, usage }) => {
                self.open(index, &mut out);
                let finish = response::finish_reason(finish);
                out.push(response::chunk(endpoint, &self.reply.header(true), index, false, None, Some(finish)));
                self.usage.add(&usage, index % self.reply.n == 0);
                self.closed += 1;
                if self.closed == self.reply.choices {
                    if self.include_usage {
                        out.push(response::usage_chunk(&self.reply.header(true), self.usage));
                    }
                    out.push("[DONE]".to_string());
                    self.finished = true;
                }
            }
            Some(ChoiceEvent::Failed { error, .. }) => {
                out.push(serde_json::to_string(&error.body()).expect("error bodies serialize"));
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

    /// A chat choice's first chunk carries the assistant role.
    fn open(&mut self, index: u32, out: &mut Vec<String>) {
        if self.reply.endpoint == Endpoint::ChatCompletions && !self.opened.contains(&index) {
            self.opened.push(index);
            out.push(response::chunk(self.reply.endpoint, &self.reply.header(true), index, true, Some(""), None));
        }
    }
}
