//! Anthropic's Messages API: `POST /v1/messages` (whole or streamed) and
//! `POST /v1/messages/count_tokens`, for the official `anthropic` clients and the agents built on
//! them.
//!
//! A Messages request runs the same pipeline as a chat completion (admission, tenants' limits
//! and charging, placement, retries and migration, tracing and metrics: `api::completions`);
//! only its body's parsing (`request`) and its answer's and errors' shapes (`response`) are
//! its own. So whatever chat guarantees, a Messages request gets too.

mod request;
mod response;

use std::sync::Arc;

use axum::{
    Json,
    body::Body,
    extract::State,
    http::HeaderMap,
    response::{IntoResponse, Response},
};
use serde_json::json;

pub(super) use request::{Purpose, parse};
pub(super) use response::{error_response, stream, whole};

use super::{
    AppState, completions,
    error::ApiError,
    request::{Endpoint, Input},
    tokenize,
};

pub async fn messages(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    completions::serve(&state, Endpoint::Messages, &headers, body).await
}

/// The prompt's size as the model will see it (system, turns and tools through the chat
/// template), without generating: `{"input_tokens": n}`.
pub async fn count_tokens(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    match count(&state, &headers, body).await {
        Ok(n) => Json(json!({ "input_tokens": n })).into_response(),
        Err(e) => error_response(e),
    }
}

async fn count(state: &Arc<AppState>, headers: &HeaderMap, body: Body) -> Result<usize, ApiError> {
    let (tenant, bytes) = tokenize::authenticated_body(state, headers, body).await?;
    let job = parse(&bytes, Purpose::CountTokens)?;
    let pool = tokenize::tenant_model(state, &tenant, Some(&job.model))?;
    let Input::Chat(messages) = job.input else { unreachable!("a Messages body is a chat") };
    let tools = job.tools;
    let tokens = state
        .tokenizers
        .run(move || pool.tokenizer.encode_chat(&messages, tools.as_ref(), None))
        .await
        .map_err(|_| completions::tokenizer_busy())??;
    Ok(tokens.len())
}
