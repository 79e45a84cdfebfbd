//! Every way a request can fail, each mapped to exactly one HTTP status and an OpenAI-style body
//! (`{"error": {"message", "type", "param", "code"}}`).
//!
//! Handlers return `ApiError` and never build a status themselves, so the same failure always
//! reaches a client the same way, and a client library (which branches on status and `code`)
//! can act on it: retry a 503 after `Retry-After`, fix the parameter named in a 400.
//!
//! A tenant's rate-limit state goes out here too, as OpenAI sends it: the `x-ratelimit-*`
//! headers of [`ratelimit_headers`] (on every response of a known tenant, errors included), with
//! durations in OpenAI's format ([`format_duration`]), as in the 429 messages.

use std::time::Duration;

use axum::{
    Json,
    http::{HeaderName, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde::Serialize;

use crate::{
    cluster::WorkerError,
    dispatch::DispatchError,
    tenants::{LimitError, Quota, RateLimit},
    tokenize::TokenizeError,
};

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
    /// No stored response with this id for this tenant: unknown, expired, deleted or another
    /// tenant's, which look the same (404). `param` names the field that gave the id, if one did.
    #[error("response {id:?} not found")]
    ResponseNotFound { id: String, param: Option<&'static str> },
    /// The response store could not be read (503).
    #[error("response store unavailable: {0}")]
    StoreUnavailable(String),
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

impl From<DispatchError> for ApiError {
    fn from(e: DispatchError) -> Self {
        match e {
            DispatchError::NoWorkers => {
                ApiError::Overloaded { reason: Overload::NoWorkers, retry_after: Duration::from_secs(1) }
            }
            DispatchError::Worker(WorkerError::Rejected(message)) => ApiError::InvalidRequest { message, param: None },
            DispatchError::Worker(WorkerError::Busy { retry_after }) => {
                ApiError::Overloaded { reason: Overload::WorkersBusy, retry_after }
            }
            DispatchError::Worker(WorkerError::Timeout) => ApiError::WorkerTimeout,
            DispatchError::Worker(WorkerError::Failed(message)) => ApiError::WorkerFailed(message),
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
            ApiError::ModelNotFound(_) | ApiError::UnknownRoute { .. } | ApiError::ResponseNotFound { .. } => {
                StatusCode::NOT_FOUND
            }
            ApiError::StoreUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Overloaded { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::WorkerFailed(_) => StatusCode::BAD_GATEWAY,
            ApiError::WorkerTimeout => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Limited(LimitError::ModelNotAllowed { .. } | LimitError::PriorityNotAllowed { .. }) => {
                StatusCode::FORBIDDEN
            }
            ApiError::Limited(LimitError::MaxTokens { .. }) => StatusCode::BAD_REQUEST,
            ApiError::Limited(LimitError::RateLimited { .. }) => StatusCode::TOO_MANY_REQUESTS,
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
            ApiError::ResponseNotFound { id, param } => (
                format!("Response with id '{id}' not found."),
                "invalid_request_error",
                param.map(str::to_string),
                Some("response_not_found"),
            ),
            ApiError::StoreUnavailable(detail) => (
                format!("The response store is unavailable: {detail}"),
                "server_error",
                None,
                Some("store_unavailable"),
            ),
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
            ApiError::Limited(e) => limit_body(e),
        };
        ErrorBody { error: ErrorDetail { message, kind: kind.to_string(), param, code: code.map(str::to_string) } }
    }
}

/// OpenAI's `(message, type, param, code)` for a refusal by the tenant's own limits: a rate
/// limit's `type` says which one.
fn limit_body(e: &LimitError) -> (String, &'static str, Option<String>, Option<&'static str>) {
    match e {
        LimitError::ModelNotAllowed { model } => (
            format!("This API key may not use the model `{model}`."),
            "invalid_request_error",
            Some("model".into()),
            Some("model_not_allowed"),
        ),
        LimitError::PriorityNotAllowed { class } => (
            format!(
                "This API key may not send requests of the {class} priority class (service_tier '{}').",
                class.service_tier()
            ),
            "invalid_request_error",
            Some("service_tier".into()),
            Some("priority_not_allowed"),
        ),
        LimitError::MaxTokens { requested, allowed } => (
            format!("max_tokens is {requested}, but this API key allows at most {allowed}."),
            "invalid_request_error",
            Some("max_tokens".into()),
            Some("invalid_value"),
        ),
        LimitError::RateLimited { limit, configured, retry_after } => {
            let what = match limit {
                RateLimit::Requests => "requests per minute",
                RateLimit::Tokens => "tokens per minute",
                RateLimit::Concurrency => "concurrent requests",
            };
            let message = format!(
                "Rate limit reached for {what} (limit: {configured}). Please try again in {}.",
                format_duration(*retry_after)
            );
            (message, limit.as_str(), None, Some("rate_limit_exceeded"))
        }
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

/// OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` headers for a tenant's
/// quotas, in their order.
pub fn ratelimit_headers(quotas: &[Quota]) -> Vec<(HeaderName, HeaderValue)> {
    let mut out = Vec::with_capacity(3 * quotas.len());
    for q in quotas {
        let values = [
            ("limit", q.configured.to_string()),
            ("remaining", q.remaining.to_string()),
            ("reset", format_duration(q.reset)),
        ];
        for (what, value) in values {
            let name = HeaderName::try_from(format!("x-ratelimit-{what}-{}", q.limit.as_str()));
            if let (Ok(name), Ok(value)) = (name, HeaderValue::try_from(value)) {
                out.push((name, value));
            }
        }
    }
    out
}

/// A duration as OpenAI writes it in `x-ratelimit-reset-*` (Go's format, to the millisecond):
/// `0s`, `120ms`, `1s`, `1.5s`, `6m0s`, `1h2m3s`.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_nanos().div_ceil(1_000_000);
    if ms == 0 {
        return "0s".into();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (h, m, s, frac) = (ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000);
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if h > 0 || m > 0 {
        out.push_str(&format!("{m}m"));
    }
    if frac == 0 {
        out.push_str(&format!("{s}s"));
    } else {
        out.push_str(format!("{s}.{frac:03}").trim_end_matches('0'));
        out.push('s');
    }
    out
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

    #[test]
    fn a_limit_error_maps_to_one_status_and_openais_body() {
        let rate =
            |limit, configured| LimitError::RateLimited { limit, configured, retry_after: Duration::from_millis(1500) };
        let cases = [
            (
                LimitError::ModelNotAllowed { model: "b".into() },
                StatusCode::FORBIDDEN,
                "invalid_request_error",
                Some("model"),
                "model_not_allowed",
                "This API key may not use the model `b`.",
            ),
            (
                LimitError::MaxTokens { requested: 257, allowed: 256 },
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("max_tokens"),
                "invalid_value",
                "max_tokens is 257, but this API key allows at most 256.",
            ),
            (
                rate(RateLimit::Requests, 600),
                StatusCode::TOO_MANY_REQUESTS,
                "requests",
                None,
                "rate_limit_exceeded",
                "Rate limit reached for requests per minute (limit: 600). Please try again in 1.5s.",
            ),
            (
                rate(RateLimit::Tokens, 1000),
                StatusCode::TOO_MANY_REQUESTS,
                "tokens",
                None,
                "rate_limit_exceeded",
                "Rate limit reached for tokens per minute (limit: 1000). Please try again in 1.5s.",
            ),
            (
                rate(RateLimit::Concurrency, 2),
                StatusCode::TOO_MANY_REQUESTS,
                "concurrency",
                None,
                "rate_limit_exceeded",
                "Rate limit reached for concurrent requests (limit: 2). Please try again in 1.5s.",
            ),
        ];
        for (limit, status, kind, param, code, message) in cases {
            let e = ApiError::from(limit);
            let body = e.body().error;
            assert_eq!(e.status(), status, "{e:?}");
            assert_eq!(
                (body.kind.as_str(), body.param.as_deref(), body.code.as_deref(), body.message.as_str()),
                (kind, param, Some(code), message)
            );
        }
    }

    #[test]
    fn a_rate_limit_refusal_carries_its_retry_after() {
        let e =
            LimitError::RateLimited { limit: RateLimit::Tokens, configured: 10, retry_after: Duration::from_secs(31) };
        let r = ApiError::from(e).into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "31");
    }

    #[test]
    fn ratelimit_headers_follow_openais_names_and_format() {
        let quotas = [
            Quota { limit: RateLimit::Requests, configured: 60, remaining: 59, reset: Duration::from_secs(1) },
            Quota { limit: RateLimit::Tokens, configured: 6000, remaining: 5400, reset: Duration::from_secs(6) },
        ];
        let h = ratelimit_headers(&quotas);
        let h: Vec<_> = h.iter().map(|(n, v)| (n.as_str(), v.to_str().unwrap())).collect();
        assert_eq!(
            h,
            [
                ("x-ratelimit-limit-requests", "60"),
                ("x-ratelimit-remaining-requests", "59"),
                ("x-ratelimit-reset-requests", "1s"),
                ("x-ratelimit-limit-tokens", "6000"),
                ("x-ratelimit-remaining-tokens", "5400"),
                ("x-ratelimit-reset-tokens", "6s"),
            ]
        );
        let full = Quota { limit: RateLimit::Requests, configured: 60, remaining: 60, reset: Duration::ZERO };
        assert_eq!(ratelimit_headers(&[full])[2].1, "0s");
        // No quotas, no headers.
        assert!(ratelimit_headers(&[]).is_empty());
    }

    #[test]
    fn durations_are_written_like_openais() {
        let cases = [
            (0, "0s"),
            (1, "1ms"),
            (120, "120ms"),
            (1000, "1s"),
            (1500, "1.5s"),
            (59_211, "59.211s"),
            (360_000, "6m0s"),
            (61_050, "1m1.05s"),
            (3_723_000, "1h2m3s"),
        ];
        for (millis, text) in cases {
            assert_eq!(format_duration(Duration::from_millis(millis)), text);
        }
        assert_eq!(format_duration(Duration::from_nanos(1)), "1ms", "rounded up, never to 0s");
    }
}
