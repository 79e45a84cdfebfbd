//! Harness for the node tests: the workspace's whole-cluster harness (a real etcd, real worker
//! processes on free loopback ports), started from this package's own `bellows-worker` binary,
//! plus helpers for reading Generate streams.
#![allow(dead_code)] // each test file uses part of the harness

use std::{path::PathBuf, time::Duration};

#[allow(unused_imports)] // each test file uses part of the harness
pub use bellows_integration::{Etcd, Worker as Node, eventually, sim};
use bellows_proto::worker::v1::{self as pb, worker_client::WorkerClient};
use tonic::{Status, transport::Channel};

fn worker_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_bellows-worker"))
}

/// Start a node and wait until its health says SERVING.
pub async fn start_node<S: AsRef<str>>(args: &[S]) -> Node {
    Node::start_bin(worker_binary(), args).await
}

/// Start a node without waiting for it.
pub fn spawn_node<S: AsRef<str>>(args: &[S]) -> Node {
    Node::spawn_bin(worker_binary(), args)
}

/// A request with these token ids, greedy, at most `max_tokens`.
pub fn greedy(prompt: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt_token_ids: prompt,
        sampling: Some(pb::SamplingParams { temperature: Some(0.0), ..Default::default() }),
        max_tokens: Some(max_tokens),
        ..Default::default()
    }
}

/// A finished Generate stream.
#[derive(Debug)]
pub struct Completion {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finished: pb::Finished,
}

/// Read a Generate stream to its end; `Err` if the call was refused or failed.
pub async fn complete(mut stream: tonic::Streaming<pb::GenerateResponse>) -> Result<Completion, Status> {
    use pb::generate_response::Kind;
    let (mut tokens, mut text) = (Vec::new(), String::new());
    while let Some(msg) = stream.message().await? {
        match msg.kind.expect("a response has a kind") {
            Kind::Delta(d) => {
                tokens.extend(d.token_ids);
                text += &d.text;
            }
            Kind::Finished(finished) => {
                assert!(stream.message().await?.is_none(), "nothing follows Finished");
                return Ok(Completion { tokens, text, finished });
            }
        }
    }
    panic!("the stream ended without a Finished message")
}

/// Send one request and read its whole stream.
pub async fn generate(client: &mut WorkerClient<Channel>, req: pb::GenerateRequest) -> Result<Completion, Status> {
    let stream = client.generate(req).await?.into_inner();
    complete(stream).await
}

/// A WatchLoad stream on this client.
pub async fn watch(client: &mut WorkerClient<Channel>) -> tonic::Streaming<pb::WatchLoadResponse> {
    client.watch_load(pb::WatchLoadRequest {}).await.unwrap().into_inner()
}

/// Read load reports until one satisfies `f`.
pub async fn report_where(
    reports: &mut tonic::Streaming<pb::WatchLoadResponse>,
    what: &str,
    f: impl Fn(&pb::LoadReport) -> bool,
) -> pb::LoadReport {
    let read = async {
        loop {
            let msg = reports.message().await.unwrap().expect("the load stream stays open");
            let load = msg.load.expect("every message has a load report");
            if f(&load) {
                return load;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(20), read).await.unwrap_or_else(|_| panic!("no load report where {what}"))
}
