//! `sim-openai`: OpenAI-compatible HTTP in front of simulated Bellows workers, one port per
//! worker.
//!
//! The reference routers only speak OpenAI HTTP to their workers, while a simulated worker
//! speaks the Bellows gRPC contract. Putting this thin face in front of each simulated worker
//! lets the placement benchmark run every router against the same workers: the same scheduler,
//! the same paged KV cache with prefix reuse, the same step-time model, so throughput and
//! `cached_tokens` are comparable across routers. Prompts are tokenized exactly as
//! `bellows-router` tokenizes them for a simulated model (`tN` is token N, other words hash into
//! the vocabulary; a chat is rendered as `role content` lines), so the same text gives the same
//! tokens, and the same cache hits, whichever router sent it.
//!
//! The extra hop costs a little latency and CPU per request; the placement benchmark is bound
//! by the simulated step time, not by that.

use std::{net::SocketAddr, sync::Arc};

use bellows_proto::worker::v1::{self as pb, worker_client::WorkerClient};
use hyper::{Method, Request, Response, StatusCode, body::Incoming};
use serde_json::json;
use tonic::{Code, transport::Channel};
use xxhash_rust::xxh3::xxh3_64;

use crate::{
    http::{self, Body},
    openai::{self, Endpoint, Prompt, Reply, Usage},
};

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// LISTEN=WORKER: serve OpenAI HTTP on LISTEN (ip:port) for the simulated worker whose gRPC
    /// endpoint is WORKER (host:port). Repeat for each worker.
    #[arg(long = "map", required = true, value_parser = parse_map)]
    maps: Vec<(SocketAddr, String)>,
}

fn parse_map(s: &str) -> Result<(SocketAddr, String), String> {
    let (listen, worker) = s.split_once('=').ok_or("expected LISTEN=WORKER")?;
    Ok((listen.parse().map_err(|e| format!("{listen}: {e}"))?, worker.to_string()))
}

struct Face {
    client: WorkerClient<Channel>,
    model: String,
    vocab_size: u32,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let mut servers = tokio::task::JoinSet::new();
    for (listen, worker) in args.maps {
        let channel =
            tonic::transport::Endpoint::from_shared(format!("http://{worker}"))?.tcp_nodelay(true).connect_lazy();
        let mut client = WorkerClient::new(channel);
        let info = model_info(&mut client, &worker).await?;
        let face = Arc::new(Face { client, model: info.model_id, vocab_size: info.vocab_size });
        servers.spawn(http::serve(listen, move |req| handle(face.clone(), req)));
    }
    match servers.join_next().await {
        Some(r) => r?,
        None => Ok(()),
    }
}

/// The worker's ModelInfo, waiting up to 10 s for a worker that is still starting.
async fn model_info(client: &mut WorkerClient<Channel>, worker: &str) -> anyhow::Result<pb::ModelInfoResponse> {
    let mut tries = 0;
    loop {
        match client.model_info(pb::ModelInfoRequest {}).await {
            Ok(info) => {
                let info = info.into_inner();
                anyhow::ensure!(info.vocab_size > 1, "worker {worker} reports no vocabulary");
                return Ok(info);
            }
            Err(e) if tries < 100 => {
                tries += 1;
                if tries == 1 {
                    eprintln!("waiting for worker {worker}: {}", e.message());
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => anyhow::bail!("worker {worker}: {e}"),
        }
    }
}

async fn handle(face: Arc<Face>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/health" | "/health_generate") => http::json(StatusCode::OK, "{}"),
        (&Method::GET, "/v1/models") => http::json(
            StatusCode::OK,
            json!({"object": "list", "data": [{"id": face.model, "object": "model", "owned_by": "bellows"}]})
                .to_string(),
        ),
        (&Method::GET, "/server_info" | "/model_info" | "/get_server_info" | "/get_model_info") => http::json(
            StatusCode::OK,
            json!({"model_path": face.model, "tokenizer_path": null, "is_generation": true}).to_string(),
        ),
        (&Method::POST, p) => match Endpoint::from_path(p) {
            Some(endpoint) => complete(&face, endpoint, req).await,
            None => http::error(StatusCode::NOT_FOUND, "unknown route"),
        },
        _ => http::error(StatusCode::NOT_FOUND, "unknown route"),
    }
}

async fn complete(face: &Face, endpoint: Endpoint, req: Request<Incoming>) -> Response<Body> {
    let Some(body) = http::body_bytes(req).await else {
        return http::error(StatusCode::BAD_REQUEST, "could not read the body");
    };
    let request: openai::Request = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return http::error(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    let prompt = match &request.prompt {
        Some(Prompt::Tokens(t)) => t.clone(),
        Some(Prompt::Text(t)) => sim_encode(t, face.vocab_size),
        None => {
            let text: String = request
                .messages
                .iter()
                .map(|m| format!("{} {}\n", m.role, m.content.as_str().unwrap_or_default()))
                .collect();
            sim_encode(&text, face.vocab_size)
        }
    };
    let generate = pb::GenerateRequest {
        prompt_token_ids: prompt,
        sampling: Some(pb::SamplingParams::default()),
        max_tokens: Some(request.max_tokens(16)),
        ..Default::default()
    };
    let mut stream = match face.client.clone().generate(generate).await {
        Ok(r) => r.into_inner(),
        Err(status) => return grpc_error(&status),
    };
    let id = format!("cmpl-sim-{:016x}", rand::random::<u64>());
    let model = if request.model.is_empty() { face.model.clone() } else { request.model.clone() };
    let created = openai::unix_now();
    if !request.stream {
        let mut text = String::new();
        loop {
            match stream.message().await {
                Ok(Some(pb::GenerateResponse { kind: Some(pb::generate_response::Kind::Delta(d)) })) => {
                    text.push_str(&d.text)
                }
                Ok(Some(pb::GenerateResponse { kind: Some(pb::generate_response::Kind::Finished(f)) })) => {
                    let reply = Reply { endpoint, id: &id, model: &model, created };
                    return http::json(StatusCode::OK, reply.whole(&text, finish(f.reason), usage(f.usage)));
                }
                Ok(Some(_)) => {}
                Ok(None) => return http::error(StatusCode::BAD_GATEWAY, "the worker's stream ended early"),
                Err(status) => return grpc_error(&status),
            }
        }
    }
    let include_usage = request.include_usage();
    let (tx, response) = http::sse();
    tokio::spawn(async move {
        let reply = Reply { endpoint, id: &id, model: &model, created };
        // Dropping the worker stream (client gone) cancels the request on the worker.
        while let Ok(Some(message)) = stream.message().await {
            let event = match message.kind {
                Some(pb::generate_response::Kind::Delta(d)) => reply.chunk(&d.text, None),
                Some(pb::generate_response::Kind::Finished(f)) => {
                    let mut last = reply.chunk("", Some(finish(f.reason))).to_vec();
                    if include_usage {
                        last.extend_from_slice(&reply.usage_chunk(usage(f.usage)));
                    }
                    last.extend_from_slice(openai::DONE);
                    let _ = tx.send(last.into()).await;
                    return;
                }
                None => continue,
            };
            if tx.send(event).await.is_err() {
                return;
            }
        }
    });
    response
}

fn finish(reason: i32) -> &'static str {
    match pb::FinishReason::try_from(reason) {
        Ok(pb::FinishReason::Length) => "length",
        _ => "stop",
    }
}

fn usage(u: Option<pb::Usage>) -> Usage {
    let u = u.unwrap_or_default();
    Usage {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
        cached_tokens: u.cached_prompt_tokens,
    }
}

/// A refusal keeps its meaning: a full worker is a 503 a router may retry elsewhere.
fn grpc_error(status: &tonic::Status) -> Response<Body> {
    let code = match status.code() {
        Code::ResourceExhausted | Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
        _ => StatusCode::BAD_GATEWAY,
    };
    http::error(code, status.message())
}

/// `bellows-router`'s tokenization for a simulated model (crates/router/src/tokenize.rs), so
/// both routes to a worker give it the same tokens.
fn sim_encode(text: &str, vocab_size: u32) -> Vec<u32> {
    text.split_whitespace()
        .map(|word| match word.strip_prefix('t').and_then(|n| n.parse::<u32>().ok()) {
            Some(id) if id > 0 && id < vocab_size => id,
            _ => 1 + (xxh3_64(word.as_bytes()) % u64::from(vocab_size - 1)) as u32,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sim_words_are_their_token_ids_and_other_words_hash_into_the_vocabulary() {
        assert_eq!(sim_encode(" t5  t17\nt999 ", 1000), vec![5, 17, 999]);
        let other = sim_encode("hello t0 t1000", 1000);
        assert!(other.iter().all(|&t| t > 0 && t < 1000), "{other:?}");
        assert_eq!(other, sim_encode("hello t0 t1000", 1000));
    }
}
