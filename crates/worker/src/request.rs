//! What a caller submits to the engine, what it gets back, and every way a submission is refused.

use std::time::Duration;

use bellows_common::{constraint::Constraint, priority::Priority};

use crate::sampling::SamplingParams;

/// A generation request, already tokenized.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Tokens to generate at most; `None` = up to the context length.
    pub max_tokens: Option<u32>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// Isolates this request's prefix-cache entries (per-tenant salt); `None` = shared.
    pub cache_salt: Option<String>,
    /// Also stream [`Event::Progress`] (admission, prefill chunks), for tracing.
    pub progress: bool,
    /// The last this-many prompt tokens are this request's own output from an earlier attempt:
    /// they are replayed through the detokenizer, stop strings and sampler without being sent, so
    /// the request continues exactly where that attempt stopped. Less than the prompt's length.
    pub resumed_tokens: usize,
    /// The output must match this (structured outputs); `None` = free text.
    pub constraint: Option<Constraint>,
    /// Report each token's log-probability and this many alternatives (at most
    /// [`MAX_TOP_LOGPROBS`]); `None` = no logprobs.
    pub top_logprobs: Option<u32>,
    /// Its class in the waiting queue and in preemption (see [`crate::scheduler`]).
    pub priority: Priority,
    /// Control tokens it generates are written out in its text (their vocabulary spelling).
    pub keep_special_tokens: bool,
}

/// The most alternatives a request may ask for per token (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// A generated token's log-probability under the model's own distribution (log-softmax of its
/// raw logits: before penalties, bias, temperature and constraint masks), and the most likely
/// tokens at that step.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// Most likely first; ties by lower id.
    pub top: Vec<TopLogprob>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TopLogprob {
    pub token: u32,
    pub logprob: f32,
}

impl GenerateRequest {
    pub fn new(prompt: Vec<u32>, params: SamplingParams, max_tokens: u32) -> Self {
        GenerateRequest {
            prompt,
            params,
            max_tokens: Some(max_tokens),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            cache_salt: None,
            progress: false,
            resumed_tokens: 0,
            constraint: None,
            top_logprobs: None,
            priority: Priority::Standard,
            keep_special_tokens: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the context length reached.
    Length,
    /// The caller went away.
    Cancelled,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache (OpenAI `prompt_tokens_details.cached_tokens`).
    pub cached_tokens: u32,
}

/// What a request's stream carries.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// One generated token and the text it released (may be empty: a partial UTF-8 character or
    /// text held back while it could still begin a stop string).
    Token { id: u32, text: String, logprobs: Option<TokenLogprobs> },
    /// The last event of a successful stream: remaining text, why it ended (with the stop
    /// string, when one ended it), and usage.
    Finished { text: String, reason: FinishReason, stop_sequence: Option<String>, usage: Usage },
    /// The model failed while running this request; nothing more follows.
    Failed { message: String },
    /// Scheduling milestones before the first token, only when the request asked for them.
    Progress(Progress),
}

/// What happened to a request before its first token (see [`GenerateRequest::progress`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Left the waiting queue for the running set; its leading cached tokens are reused.
    Admitted { cached_tokens: u32 },
    /// A chunk of its prompt was prefilled in one step.
    Prefilled { tokens: u32 },
}

/// Why a submission was refused before any model work. One variant per cause, so a service can
/// map each to one status code.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error(
        "this model's maximum context length is {context} tokens; you requested {} tokens \
         ({prompt} in the prompt, {completion} for the completion)", prompt + completion
    )]
    ContextExceeded { prompt: usize, completion: usize, context: usize },
    #[error("token id {token} is outside the vocabulary (size {vocab})")]
    TokenOutOfVocabulary { token: u32, vocab: usize },
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("invalid {param}: {reason}")]
    InvalidParameter { param: &'static str, reason: String },
    #[error("invalid constraint: {0}")]
    InvalidConstraint(String),
    #[error("too many requests waiting ({cap}); retry after {retry_after:?}")]
    QueueFull { cap: usize, retry_after: Duration },
    #[error("the engine is shutting down")]
    ShuttingDown,
}
