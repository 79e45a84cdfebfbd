//! The OpenAI-compatible HTTP API.

pub mod completions;
pub mod error;
pub mod request;
pub mod response;

use std::sync::Arc;

use axum::{
    Json, Router,
    extract::State,
    http::{Method, StatusCode, Uri, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use serde_json::json;

use crate::{admission::Admission, cluster::Cluster, dispatch::Dispatcher, metrics::Metrics, tokenize::TokenizerPool};
use error::ApiError;

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
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(completions::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
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
    state.metrics.workers.set(state.cluster.node_ids().len() as i64);
    state.metrics.placeable_workers.set(state.cluster.placeable_workers() as i64);
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], state.metrics.encode())
        .into_response()
}

async fn unknown_route(method: Method, uri: Uri) -> ApiError {
    ApiError::UnknownRoute { method: method.to_string(), path: uri.path().to_string() }
}
