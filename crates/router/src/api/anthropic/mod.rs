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

use request::{Purpose, parse};
use response::error_response;
use tokio::sync::mpsc;

use super::{
    AppState, completions,
    error::ApiError,
    protocol::Protocol,
    reply::Reply,
    request::{Endpoint, Input, Job},
    tokenize,
};
use crate::{dispatch::ChoiceEvent, tenants::Tenant};

pub async fn messages(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    completions::serve::<Messages>(&state, &headers, body).await
}

/// Anthropic's Messages API.
pub(super) struct Messages;

impl Protocol for Messages {
    type Turn = ();
    const ENDPOINT: Endpoint = Endpoint::Messages;
    const SPAN_NAME: &'static str = "POST /v1/messages";
    const ROUTE: &'static str = "/v1/messages";
    const OPERATION: &'static str = "chat";

    async fn parse(_: &AppState, _: &Tenant, body: &[u8]) -> Result<(Job, ()), ApiError> {
        Ok((parse(body, Purpose::Generate)?, ()))
    }

    async fn whole(reply: Reply, _: (), rx: mpsc::Receiver<ChoiceEvent>) -> Result<Response, ApiError> {
        response::whole(reply, rx).await
    }

    async fn stream(reply: Reply, _: (), rx: mpsc::Receiver<ChoiceEvent>, _: bool) -> Result<Response, ApiError> {
        response::stream(reply, rx).await
    }

    fn error_response(e: ApiError) -> Response {
        error_response(e)
    }
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
