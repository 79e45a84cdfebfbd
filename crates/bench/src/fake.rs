//! `fake-openai`: an OpenAI-compatible worker with no model, answering with fixed timing (the
//! first token after `--ttft-ms`, then `--tokens-per-s`), unlimited concurrency and no prefix
//! cache.
//!
//! It exists only to measure router overhead: the reference routers (sglang-router, vllm-router)
//! forward OpenAI HTTP, and in front of a worker this cheap and this predictable, what changes
//! between "direct" and "through a router" is the router. It says nothing about placement (every
//! worker is equally fast and nothing is cached); the placement benchmark uses simulated
//! workers through [`crate::shim`] instead.
//!
//! Besides the completions endpoints it answers what the reference routers probe when a worker
//! joins: `GET /health`, `/v1/models`, and sglang-router's `/server_info` and `/model_info`.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use hyper::{Method, Request, Response, StatusCode, body::Incoming};
use serde_json::json;
use tokio::time::{Instant, sleep_until};

use crate::{
    http::{self, Body},
    openai::{self, Endpoint, Prompt, Reply, Usage},
};

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Address to serve on; repeat for several fake workers in one process.
    #[arg(long, required = true)]
    listen: Vec<SocketAddr>,
    /// Tokens per second of each response after the first token.
    #[arg(long, default_value_t = 500.0)]
    tokens_per_s: f64,
    /// Time to the first token.
    #[arg(long, default_value_t = 3.0)]
    ttft_ms: f64,
    /// The model name reported.
    #[arg(long, default_value = "sim")]
    model: String,
}

struct Fake {
    ttft: Duration,
    per_token: Duration,
    model: String,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(args.tokens_per_s > 0.0 && args.ttft_ms >= 0.0, "timing must be positive");
    let fake = Arc::new(Fake {
        ttft: Duration::from_secs_f64(args.ttft_ms / 1000.0),
        per_token: Duration::from_secs_f64(1.0 / args.tokens_per_s),
        model: args.model,
    });
    let mut servers = tokio::task::JoinSet::new();
    for addr in args.listen {
        let fake = fake.clone();
        servers.spawn(http::serve(addr, move |req| handle(fake.clone(), req)));
    }
    match servers.join_next().await {
        Some(r) => r?,
        None => Ok(()),
    }
}

async fn handle(fake: Arc<Fake>, req: Request<Incoming>) -> Response<Body> {
    let start = Instant::now();
    let path = req.uri().path().to_string();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/health" | "/health_generate") => http::json(StatusCode::OK, "{}"),
        (&Method::GET, "/v1/models") => http::json(
            StatusCode::OK,
            json!({"object": "list", "data": [{"id": fake.model, "object": "model", "owned_by": "bench"}]}).to_string(),
        ),
        (&Method::GET, "/server_info" | "/model_info" | "/get_server_info" | "/get_model_info") => http::json(
            StatusCode::OK,
            json!({"model_path": fake.model, "tokenizer_path": null, "is_generation": true}).to_string(),
        ),
        (&Method::POST, p) => match Endpoint::from_path(p) {
            Some(endpoint) => complete(&fake, endpoint, req, start).await,
            None => http::error(StatusCode::NOT_FOUND, "unknown route"),
        },
        _ => http::error(StatusCode::NOT_FOUND, "unknown route"),
    }
}

async fn complete(fake: &Arc<Fake>, endpoint: Endpoint, req: Request<Incoming>, start: Instant) -> Response<Body> {
    let Some(body) = http::body_bytes(req).await else {
        return http::error(StatusCode::BAD_REQUEST, "could not read the body");
    };
    let request: openai::Request = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return http::error(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    let tokens = request.max_tokens(16);
    let prompt_tokens = match &request.prompt {
        Some(Prompt::Tokens(t)) => t.len(),
        Some(Prompt::Text(t)) => t.split_whitespace().count(),
        None => request.messages.iter().map(|m| m.content.as_str().map_or(0, |c| c.split_whitespace().count())).sum(),
    } as u32;
    let usage = Usage { prompt_tokens, completion_tokens: tokens, cached_tokens: 0 };
    let id = format!("cmpl-fake-{:016x}", rand::random::<u64>());
    let model = if request.model.is_empty() { fake.model.clone() } else { request.model.clone() };
    // Token i (from 0) is due at ttft + i * per_token.
    let (ttft, per_token) = (fake.ttft, fake.per_token);
    let due = move |i: u32| start + ttft + per_token * i;
    if !request.stream {
        sleep_until(due(tokens - 1)).await;
        let reply = Reply { endpoint, id: &id, model: &model, created: openai::unix_now() };
        return http::json(StatusCode::OK, reply.whole(&" x".repeat(tokens as usize), "length", usage));
    }
    let include_usage = request.include_usage();
    let (tx, response) = http::sse();
    tokio::spawn(async move {
        let reply = Reply { endpoint, id: &id, model: &model, created: openai::unix_now() };
        for i in 0..tokens {
            sleep_until(due(i)).await;
            let finish = (i + 1 == tokens).then_some("length");
            if tx.send(reply.chunk(" x", finish)).await.is_err() {
                return;
            }
        }
        if include_usage {
            let _ = tx.send(reply.usage_chunk(usage)).await;
        }
        let _ = tx.send(openai::DONE.into()).await;
    });
    response
}
