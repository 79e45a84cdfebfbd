//! Every way a request can fail, each mapped to exactly one HTTP status and an OpenAI-style body
//! (`{"error": {"message", "type", "param", "code"}}`).
//!
//! Handlers return `ApiError` and never build a status themselves, so the same failure always
//! reaches a client the same way, and a client library (which branches on status and `code`)
//! can act on it: retry a 503 after `Retry-After`, fix the parameter named in a 400.

use std::time::Duration;

use axum::{
    Json,
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde::Serialize;

use crate::{tenants::LimitError, tokenize::TokenizeError};

/// Why the cluster could not take a request now (503). A bounded set: also a metrics label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overload {
    /// The cluster-wide waiting queue is at `--max-waiting`.
    QueueFull,
    /// Every tokenizer thread is busy and its queue is full.
    TokenizerBusy,
    /// The model is known but none of its workers can take work (all broken or draining).
    NoWorkers,
    /// Workers refused the request (their own queues are full) on every try.
    WorkersBusy,
    /// The tenant's fair-share queue at this router is full.
    TenantQueueFull,
    /// The request waited its fair-share queue's timeout without getting a turn.
    QueueTimeout,
}

impl Overload {
    pub fn as_str(self) -> &'static str {
        match self {
            Overload::QueueFull => "queue_full",
            Overload::TokenizerBusy => "tokenizer_busy",
            Overload::NoWorkers => "no_workers",
            Overload::WorkersBusy => "workers_busy",
            Overload::TenantQueueFull => "tenant_queue_full",
            Overload::QueueTimeout => "queue_timeout",
        }
    }

    fn message(self) -> &'static str {
        match self {
            Overload::QueueFull => "The cluster's request queue is full; retry after the time in Retry-After.",
            Overload::TokenizerBusy => "The gateway is overloaded (tokenizer queue full); retry shortly.",
            Overload::NoWorkers => "No worker is currently available for this model; retry shortly.",
            Overload::WorkersBusy => "Every worker for this model is at capacity; retry after the time in Retry-After.",
            Overload::TenantQueueFull => {
                "Too many of your requests are waiting for capacity; retry after the time in Retry-After."
            }
            Overload::QueueTimeout => {
                "The cluster had no capacity for this request in time; retry after the time in Retry-After."
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// Malformed JSON, a wrong type, or a parameter out of range (400).
    #[error("{message}")]
    InvalidRequest { message: String, param: Option<String> },
    /// Prompt (plus the requested completion) longer than the model's context (400).
    #[error("context length exceeded")]
    ContextLengthExceeded { prompt_tokens: usize, max_tokens: Option<u32>, context_length: usize, param: &'static str },
    /// The model is not served by this cluster (404).
    #[error("model {0:?} not found")]
    ModelNotFound(String),
    /// No such route (404).
    #[error("no route")]
    UnknownRoute { method: String, path: String },
    /// Body over `--max-body-bytes` (413).
    #[error("body too large")]
    BodyTooLarge { limit: usize },
    /// No capacity now (503 with Retry-After).
    #[error("overloaded: {}", reason.as_str())]
    Overloaded { reason: Overload, retry_after: Duration },
    /// Workers failed and the retries or migrations allowed are used up (502).
    #[error("worker failed: {0}")]
    WorkerFailed(String),
    /// Workers did not answer in time on every try (504).
    #[error("worker timed out")]
    WorkerTimeout,
    /// No API key, or not a known one (401). Says nothing about which keys exist.
    #[error("unauthorized")]
    Unauthorized,
    /// Over one of the tenant's own limits: model not allowed (403), max_tokens over its cap
    /// (400), or a rate or concurrency limit (429 with Retry-After).
    #[error("{0}")]
    Limited(#[from] LimitError),
}

impl From<TokenizeError> for ApiError {
    fn from(e: TokenizeError) -> Self {
        match e {
            TokenizeError::Template(_) | TokenizeError::NoChatTemplate => ApiError::invalid("messages", e.to_string()),
            TokenizeError::Encode(_) => ApiError::InvalidRequest { message: e.to_string(), param: None },
        }
    }
}

impl ApiError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest { message: message.into(), param: Some(param.into()) }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. } | ApiError::ContextLengthExceeded { .. } => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound(_) | ApiError::UnknownRoute { .. } => StatusCode::NOT_FOUND,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Overloaded { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::WorkerFailed(_) => StatusCode::BAD_GATEWAY,
            ApiError::WorkerTimeout => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Limited(e) => e.status(),
        }
    }

    /// A bounded label for refusal metrics; `None` for errors that are not refusals.
    pub fn refusal_reason(&self) -> Option<&'static str> {
        match self {
            ApiError::Overloaded { reason, .. } => Some(reason.as_str()),
            ApiError::Unauthorized => Some("unauthorized"),
            ApiError::Limited(e) => Some(e.reason()),
            _ => None,
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            ApiError::Overloaded { retry_after, .. } => Some(*retry_after),
            ApiError::Limited(e) => e.retry_after(),
            _ => None,
        }
    }

    /// The OpenAI-style body.
    pub fn body(&self) -> ErrorBody {
        let (message, kind, param, code): (String, &str, Option<String>, Option<&str>) = match self {
            ApiError::InvalidRequest { message, param } => {
                (message.clone(), "invalid_request_error", param.clone(), Some("invalid_value"))
            }
            ApiError::ContextLengthExceeded { prompt_tokens, max_tokens, context_length, param } => {
                let message = match max_tokens {
                    Some(m) => format!(
                        "This model's maximum context length is {context_length} tokens. However, you requested \
                         {} tokens ({prompt_tokens} in the prompt, {m} for the completion). Please reduce the \
                         length of the prompt or the completion.",
                        prompt_tokens + *m as usize
                    ),
                    None => format!(
                        "This model's maximum context length is {context_length} tokens. However, your prompt \
                         has {prompt_tokens} tokens, which leaves no room for a completion. Please reduce the \
                         length of the prompt."
                    ),
                };
                (message, "invalid_request_error", Some(param.to_string()), Some("context_length_exceeded"))
            }
            ApiError::ModelNotFound(model) => (
                format!(
                    "The model `{model}` does not exist or is not served by this cluster (GET /v1/models lists them)."
                ),
                "invalid_request_error",
                Some("model".into()),
                Some("model_not_found"),
            ),
            ApiError::UnknownRoute { method, path } => {
                (format!("Unknown request URL: {method} {path}."), "invalid_request_error", None, Some("unknown_url"))
            }
            ApiError::BodyTooLarge { limit } => (
                format!("The request body is larger than the limit of {limit} bytes."),
                "invalid_request_error",
                None,
                Some("request_too_large"),
            ),
            ApiError::Overloaded { reason, .. } => {
                (reason.message().to_string(), "server_error", None, Some(reason.as_str()))
            }
            ApiError::WorkerFailed(detail) => (
                format!("The model worker failed and no other worker could complete the request: {detail}"),
                "server_error",
                None,
                Some("worker_failed"),
            ),
            ApiError::WorkerTimeout => {
                ("No model worker answered in time.".into(), "server_error", None, Some("worker_timeout"))
            }
            ApiError::Unauthorized => (
                "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.".into(),
                "invalid_request_error",
                None,
                Some("invalid_api_key"),
            ),
            ApiError::Limited(e) => (e.message(), e.kind(), e.param().map(str::to_string), Some(e.code())),
        };
        ErrorBody { error: ErrorDetail { message, kind: kind.to_string(), param, code: code.map(str::to_string) } }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

/// Whole seconds for a Retry-After header: at least 1 (0 invites a retry storm).
pub fn retry_after_secs(d: Duration) -> u64 {
    d.as_secs_f64().ceil().max(1.0) as u64
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), Json(self.body())).into_response();
        if let Some(retry_after) = self.retry_after() {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs(retry_after)));
        }
        if let ApiError::Unauthorized = self {
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_errors_name_both_numbers() {
        let e = ApiError::ContextLengthExceeded {
            prompt_tokens: 9000,
            max_tokens: Some(100),
            context_length: 8192,
            param: "messages",
        };
        let body = e.body();
        assert!(body.error.message.contains("8192") && body.error.message.contains("9000"), "{}", body.error.message);
        assert_eq!(body.error.code.as_deref(), Some("context_length_exceeded"));
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn an_overload_carries_a_whole_second_retry_after_of_at_least_one() {
        let r = ApiError::Overloaded { reason: Overload::QueueFull, retry_after: Duration::from_millis(10) }
            .into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        let r = ApiError::Overloaded { reason: Overload::QueueFull, retry_after: Duration::from_millis(2100) }
            .into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "3");
    }
}
