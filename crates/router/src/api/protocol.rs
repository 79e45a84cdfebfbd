//! A generating protocol, as the pipeline sees it: how its body becomes the pipeline's [`Job`],
//! and how the choices' events become its answer and its errors. The pipeline
//! (`api::completions::serve`) is generic over it, so each protocol's own code sits in its own
//! module, and a protocol added is one implementation and one route, never a branch in the
//! pipeline: admission, limits, charging, placement, migration, tracing and metrics come with it.

use std::future::Future;

use axum::response::{IntoResponse, Response};
use tokio::sync::mpsc;

use super::{
    AppState,
    error::ApiError,
    reply::Reply,
    request::{Endpoint, Job},
};
use crate::{dispatch::ChoiceEvent, tenants::Tenant};

pub(super) trait Protocol: Send + Sync + 'static {
    /// What its answer needs beyond the job (the Responses API's turn; nothing for the others).
    type Turn: Send + 'static;
    const ENDPOINT: Endpoint;
    /// The request span's `otel.name` (`POST /v1/...`), `http.route` and
    /// `gen_ai.operation.name`.
    const SPAN_NAME: &'static str;
    const ROUTE: &'static str;
    const OPERATION: &'static str;

    /// The body, validated, for `tenant`.
    fn parse(
        state: &AppState,
        tenant: &Tenant,
        body: &[u8],
    ) -> impl Future<Output = Result<(Job, Self::Turn), ApiError>> + Send;

    /// The answer once every choice is done.
    fn whole(
        reply: Reply,
        turn: Self::Turn,
        rx: mpsc::Receiver<ChoiceEvent>,
    ) -> impl Future<Output = Result<Response, ApiError>> + Send;

    /// The answer as it streams (`include_usage`: chat's `stream_options.include_usage`).
    fn stream(
        reply: Reply,
        turn: Self::Turn,
        rx: mpsc::Receiver<ChoiceEvent>,
        include_usage: bool,
    ) -> impl Future<Output = Result<Response, ApiError>> + Send;

    /// An error in the protocol's own shape, with the status every protocol gives it.
    fn error_response(e: ApiError) -> Response {
        e.into_response()
    }
}
