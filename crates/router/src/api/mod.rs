//! The HTTP API: OpenAI's (chat and text completions, responses, models), Anthropic's Messages,
//! and vLLM's tokenize and detokenize.

pub mod anthropic;
pub mod completions;
pub mod error;
mod protocol;
pub mod refusal_log;
mod reply;
pub mod request;
pub mod response;
pub mod responses;
pub mod strict_schema;
pub mod tls_listener;
pub mod tokenize;
pub mod tool_request;

use std::sync::Arc;

use axum::{
    Json, Router,
    extract::State,
    http::{HeaderMap, Method, StatusCode, Uri, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use serde_json::json;

use crate::{
    admission::Admission,
    cluster::Cluster,
    dispatch::Dispatcher,
    metrics::Metrics,
    tenants::{FairQueue, Tenants, Usage},
    tokenize::TokenizerPool,
};
use error::ApiError;

/// Now, in whole Unix seconds (the `created` of OpenAI's objects).
pub fn unix_seconds() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Everything a request handler needs; shared by all connections.
pub struct AppState {
    pub cluster: Arc<Cluster>,
    pub dispatcher: Arc<Dispatcher>,
    pub admission: Admission,
    pub tokenizers: TokenizerPool,
    pub max_body_bytes: usize,
    pub metrics: Arc<Metrics>,
    /// Unix seconds the router started (the `created` of its model list).
    pub started_at: u64,
    /// Put prompt and completion text on spans (`--trace-text`).
    pub trace_text: bool,
    /// Who may call, and their limits (auth off: everyone is the anonymous tenant).
    pub tenants: Arc<Tenants>,
    pub usage: Arc<Usage>,
    /// Fair sharing at the global cap (with a tenants file); `None`: refuse at the cap at once.
    pub fair_queue: Option<Arc<FairQueue>>,
    pub refusal_log: refusal_log::RefusalLog,
    /// Stored Responses (`store: true`), for `previous_response_id` and `GET /v1/responses/{id}`.
    pub responses: Arc<dyn responses::store::ResponseStore>,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(completions::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::retrieve).delete(responses::delete))
        .route("/v1/responses/{id}/input_items", get(responses::input_items))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/tokenize", post(tokenize::tokenize))
        .route("/v1/detokenize", post(tokenize::detokenize))
        // vLLM serves them without the version prefix.
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/admin/usage", get(admin_usage))
        .fallback(unknown_route)
        .method_not_allowed_fallback(unknown_route)
        .with_state(state)
}

async fn models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let data: Vec<_> = state
        .cluster
        .models()
        .iter()
        .map(|m| {
            json!({
                "id": m.name,
                "object": "model",
                "created": state.started_at,
                "owned_by": "bellows",
                "max_model_len": m.context_length(),
            })
        })
        .collect();
    Json(json!({ "object": "list", "data": data }))
}

/// Liveness: the process serves HTTP.
async fn health() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

/// Readiness: some model has a worker that can take work.
async fn ready(State(state): State<Arc<AppState>>) -> Response {
    if state.cluster.ready() {
        Json(json!({ "status": "ready" })).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({ "status": "no worker available" }))).into_response()
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    state.cluster.export_worker_gauges();
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], state.metrics.encode())
        .into_response()
}

/// Usage per tenant and model, for the holder of the admin key.
async fn admin_usage(State(state): State<Arc<AppState>>, method: Method, uri: Uri, headers: HeaderMap) -> Response {
    if !state.tenants.admin_enabled() {
        return unknown_route(method, uri).await.into_response();
    }
    let authorization = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    if !state.tenants.check_admin(authorization) {
        return ApiError::Unauthorized.into_response();
    }
    Json(state.usage.snapshot_json()).into_response()
}

async fn unknown_route(method: Method, uri: Uri) -> ApiError {
    ApiError::UnknownRoute { method: method.to_string(), path: uri.path().to_string() }
}
