//! OpenAI's Responses API: `POST /v1/responses` (whole or streamed), and the stored responses
//! behind `previous_response_id`: `GET /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`
//! and `DELETE /v1/responses/{id}`.
//!
//! A Responses request runs the same pipeline as a chat completion (admission, tenants' limits
//! and charging, placement, retries and migration, tracing and metrics: `api::completions`);
//! its body's parsing (`request`), its answer's shape (`response`) and its stored state
//! (`store`) are its own. A continuation renders the stored conversation as the prefix of its
//! prompt, so cache-aware placement finds the worker that holds its KV.

mod items;
pub mod postgres;
mod request;
mod response;
pub mod store;

use std::sync::Arc;

use axum::{
    Json,
    body::Body,
    extract::{Path, Query, State},
    http::HeaderMap,
    response::{IntoResponse, Response},
};
use serde::Deserialize;
use serde_json::{Value, json};

use store::{ResponseStore, StoreError};
use tokio::sync::mpsc;

use super::{
    AppState,
    completions::{self, authorization},
    error::ApiError,
    protocol::Protocol,
    reply::Reply,
    request::{Endpoint, Job},
};
use crate::{dispatch::ChoiceEvent, tenants::Tenant};

/// A Responses request's own state, beside its [`Job`]: what its answer echoes, and where and
/// what it stores.
pub struct Turn {
    tenant: String,
    /// The store, when the request asked to be stored.
    store: Option<Arc<dyn ResponseStore>>,
    input_items: Vec<Value>,
    context: Vec<Value>,
    echo: request::Echo,
}

/// A fresh item id: `prefix`, `_`, 24 hex digits (`msg_…`, `fc_…`, `call_…`, `resp_…`).
pub(super) fn new_item_id(prefix: &str) -> String {
    format!("{prefix}_{:024x}", rand::random::<u128>() >> 32)
}

fn store_error(e: StoreError) -> ApiError {
    ApiError::StoreUnavailable(e.to_string())
}

/// Parse a body for `tenant`, reading the response it continues from the store.
pub(super) async fn parse(state: &AppState, tenant: &Tenant, body: &[u8]) -> Result<(Job, Turn), ApiError> {
    let raw = request::deserialize_body(body)?;
    let previous = match raw.previous_response_id.as_deref() {
        None => None,
        Some(id) => Some(
            state
                .responses
                .get(&tenant.name, id)
                .await
                .map_err(store_error)?
                .ok_or_else(|| ApiError::ResponseNotFound { id: id.into(), param: Some("previous_response_id") })?,
        ),
    };
    let (job, parsed) = request::parse(raw, previous)?;
    let turn = Turn {
        tenant: tenant.name.clone(),
        store: parsed.store.then(|| state.responses.clone()),
        input_items: parsed.input_items,
        context: parsed.context,
        echo: parsed.echo,
    };
    Ok((job, turn))
}

/// The chat checks name chat's nested tool fields; a Responses tool is flat.
pub(super) fn error_response(e: ApiError) -> Response {
    match e {
        ApiError::InvalidRequest { message, param } => {
            let flat = |s: &str| s.replace(".function.", ".");
            ApiError::InvalidRequest { message: flat(&message), param: param.map(|p| flat(&p)) }.into_response()
        }
        other => other.into_response(),
    }
}

pub async fn create(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    completions::serve::<Responses>(&state, &headers, body).await
}

/// OpenAI's Responses API: its turn is what the answer echoes and stores.
pub(super) struct Responses;

impl Protocol for Responses {
    type Turn = Turn;
    const ENDPOINT: Endpoint = Endpoint::Responses;
    const SPAN_NAME: &'static str = "POST /v1/responses";
    const ROUTE: &'static str = "/v1/responses";
    const OPERATION: &'static str = "chat";

    async fn parse(state: &AppState, tenant: &Tenant, body: &[u8]) -> Result<(Job, Turn), ApiError> {
        parse(state, tenant, body).await
    }

    async fn whole(reply: Reply, turn: Turn, rx: mpsc::Receiver<ChoiceEvent>) -> Result<Response, ApiError> {
        response::whole(reply, turn, rx).await
    }

    async fn stream(reply: Reply, turn: Turn, rx: mpsc::Receiver<ChoiceEvent>, _: bool) -> Result<Response, ApiError> {
        response::stream(reply, turn, rx).await
    }

    fn error_response(e: ApiError) -> Response {
        error_response(e)
    }
}

/// The caller's stored response `id`.
async fn stored(state: &AppState, headers: &HeaderMap, id: &str) -> Result<store::Stored, ApiError> {
    let tenant = state.tenants.authenticate(authorization(headers).as_deref()).map_err(|_| ApiError::Unauthorized)?;
    state
        .responses
        .get(&tenant.name, id)
        .await
        .map_err(store_error)?
        .ok_or_else(|| ApiError::ResponseNotFound { id: id.into(), param: None })
}

pub async fn retrieve(State(state): State<Arc<AppState>>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    match stored(&state, &headers, &id).await {
        Ok(s) => Json(s.response).into_response(),
        Err(e) => e.into_response(),
    }
}

#[derive(Debug, Deserialize)]
pub struct ItemsQuery {
    limit: Option<usize>,
    order: Option<String>,
    after: Option<String>,
}

/// A page of the response's own input items: `order` `desc` (the default) or `asc`, `limit`
/// 1 to 100 (20), starting after the item `after`.
pub async fn input_items(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<ItemsQuery>,
) -> Response {
    match list_items(&state, &headers, &id, q).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn list_items(state: &AppState, headers: &HeaderMap, id: &str, q: ItemsQuery) -> Result<Value, ApiError> {
    let limit = q.limit.unwrap_or(20);
    if !(1..=100).contains(&limit) {
        return Err(ApiError::invalid("limit", "'limit' must be between 1 and 100"));
    }
    let mut items = stored(state, headers, id).await?.input_items;
    match q.order.as_deref() {
        None | Some("desc") => items.reverse(),
        Some("asc") => {}
        Some(_) => return Err(ApiError::invalid("order", "'order' must be 'asc' or 'desc'")),
    }
    if let Some(after) = &q.after {
        let at = items
            .iter()
            .position(|i| i["id"].as_str() == Some(after))
            .ok_or_else(|| ApiError::invalid("after", format!("no input item has the id {after:?}")))?;
        items.drain(..=at);
    }
    let has_more = items.len() > limit;
    items.truncate(limit);
    let first = items.first().map(|i| i["id"].clone()).unwrap_or(Value::Null);
    let last = items.last().map(|i| i["id"].clone()).unwrap_or(Value::Null);
    Ok(json!({"object": "list", "data": items, "first_id": first, "last_id": last, "has_more": has_more}))
}

pub async fn delete(State(state): State<Arc<AppState>>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let deleted = async {
        let tenant =
            state.tenants.authenticate(authorization(&headers).as_deref()).map_err(|_| ApiError::Unauthorized)?;
        match state.responses.delete(&tenant.name, &id).await.map_err(store_error)? {
            true => Ok(json!({"id": id, "object": "response", "deleted": true})),
            false => Err(ApiError::ResponseNotFound { id: id.clone(), param: None }),
        }
    };
    match deleted.await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}
