//! `load`: a closed-loop load generator. Each of `--connections` keeps exactly one request in
//! flight (HTTP/1.1 keep-alive, or one gRPC stream each on a shared channel per worker), so the
//! offered load adapts to what the system under test sustains and requests/s is its capacity.
//!
//! Targets:
//! - `http://host:port`: a router or an OpenAI worker, `POST /v1/completions`, streaming (SSE,
//!   with `stream_options.include_usage`) or not.
//! - `grpc://host:port[,host:port...]`: simulated Bellows workers called directly with the
//!   Generate RPC the router would send (connection `i` uses worker `i mod n`): the baseline that
//!   "what a router adds" is measured against.
//!
//! It prints one JSON object: requests/s, latency and TTFT percentiles, usage summed over the
//! requests (prompt and cached tokens), optionally the CPU time of given processes per request
//! (`--cpu-pid`, from /proc, over the measured phase only; the generator's own CPU always, as
//! `client_cpu`) and per-worker load (`--watch`).

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context;
use bellows_proto::worker::v1::{self as pb, worker_client::WorkerClient};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode, client::conn::http1::SendRequest, header};
use hyper_util::rt::TokioIo;
use rand::{SeedableRng, rngs::StdRng};
use serde::Deserialize;
use serde_json::json;
use tokio::net::TcpStream;
use tonic::transport::Channel;

use crate::{
    procstat,
    stats::summarize,
    watch::Watch,
    workload::{Prompt, SharedPrefix, Workload, to_text},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum PromptFormat {
    /// An array of token ids (no tokenization in the router).
    Tokens,
    /// Text that tokenizes to the same ids on a simulated model (`t17 t5 ...`).
    Text,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum WorkloadKind {
    /// Short random prompts sharing nothing.
    Overhead,
    /// Tenants with long system prompts, one of them hot.
    SharedPrefix,
}

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// `http://host:port` (a router or OpenAI worker) or `grpc://host:port[,host:port...]`
    /// (simulated workers, directly).
    #[arg(long)]
    target: String,
    #[arg(long, default_value = "sim")]
    model: String,
    /// Requests in flight at any time (one per connection).
    #[arg(long, default_value_t = 64)]
    connections: usize,
    /// Requests in the measured phase.
    #[arg(long, default_value_t = 10_000)]
    requests: usize,
    /// Requests sent before the measured phase (connections warm, caches primed).
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// Stream responses (SSE); TTFT is measured only for streams.
    #[arg(long)]
    stream: bool,
    #[arg(long, default_value_t = 8)]
    max_tokens: u32,
    #[arg(long, value_enum, default_value_t = PromptFormat::Tokens)]
    prompt_format: PromptFormat,
    #[arg(long, value_enum, default_value_t = WorkloadKind::Overhead)]
    workload: WorkloadKind,
    /// Prompt length of the overhead workload.
    #[arg(long, default_value_t = 16)]
    prompt_tokens: usize,
    /// Shared-prefix workload: tenants, each with its own system prompt.
    #[arg(long, default_value_t = 50)]
    tenants: usize,
    /// Shared-prefix workload: bytes of text of each system prompt.
    #[arg(long, default_value_t = 2048)]
    system_bytes: usize,
    /// Shared-prefix workload: share of all requests sent by tenant 0.
    #[arg(long, default_value_t = 0.5)]
    hot_share: f64,
    /// Shared-prefix workload: random tokens after the system prompt.
    #[arg(long, default_value_t = 16)]
    suffix_tokens: usize,
    /// Token ids are drawn from 1..vocab (at most the workers' vocabulary).
    #[arg(long, default_value_t = 1024)]
    vocab: u32,
    /// The workers' KV block size (what a prefix cache can reuse is whole blocks).
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Processes whose CPU time (user + system, all threads) per measured request is reported.
    #[arg(long)]
    cpu_pid: Vec<u32>,
    /// gRPC addresses of the simulated workers behind the target: their load is sampled during
    /// the measured phase, and their number sets the achievable prefix-cache hits.
    #[arg(long, value_delimiter = ',')]
    watch: Vec<String>,
    /// Copied into the output.
    #[arg(long, default_value = "")]
    label: String,
    /// A request taking longer counts as an error.
    #[arg(long, default_value_t = 120)]
    timeout_s: u64,
}

/// What every connection shares.
struct Ctx {
    workload: Workload,
    model: String,
    stream: bool,
    max_tokens: u32,
    format: PromptFormat,
    timeout: Duration,
}

/// One finished request.
struct Sample {
    done_at: Duration,
    latency: Duration,
    ttft: Option<Duration>,
    tenant: Option<usize>,
    prompt_tokens: u64,
    cached_tokens: u64,
    error: Option<String>,
}

/// One connection's way to the target.
enum Client {
    Http { addr: String, sender: Option<SendRequest<Full<Bytes>>> },
    Grpc(WorkerClient<Channel>),
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(args.connections > 0 && args.requests > 0, "need connections and requests");
    let workload = match args.workload {
        WorkloadKind::Overhead => Workload::Overhead { prompt_tokens: args.prompt_tokens, vocab: args.vocab },
        WorkloadKind::SharedPrefix => Workload::SharedPrefix(SharedPrefix::new(
            args.tenants,
            args.system_bytes,
            args.hot_share,
            args.suffix_tokens,
            args.vocab,
            args.seed,
        )),
    };
    let ctx = Arc::new(Ctx {
        workload,
        model: args.model.clone(),
        stream: args.stream,
        max_tokens: args.max_tokens,
        format: args.prompt_format,
        timeout: Duration::from_secs(args.timeout_s),
    });
    let mut clients = connect(&args.target, args.connections).await?;
    if args.warmup > 0 {
        (clients, _, _) = phase(clients, args.warmup, &ctx, args.seed.wrapping_add(1 << 32)).await;
    }

    let watch = if args.watch.is_empty() { None } else { Some(Watch::start(&args.watch).await?) };
    let cpu_before = cpu_of(&args.cpu_pid)?;
    let own_before = procstat::process_cpu_s(std::process::id())?;
    let machine_before = procstat::machine_cpu_s()?;
    let (_, samples, elapsed) = phase(clients, args.requests, &ctx, args.seed).await;
    let cpu_after = cpu_of(&args.cpu_pid)?;
    let own_after = procstat::process_cpu_s(std::process::id())?;
    let machine_after = procstat::machine_cpu_s()?;
    let workers = match watch {
        Some(w) => w.finish().await,
        None => Vec::new(),
    };

    let ok: Vec<&Sample> = samples.iter().filter(|s| s.error.is_none()).collect();
    let errors = samples.len() - ok.len();
    let first_error = samples.iter().find_map(|s| s.error.clone());
    let mut latency: Vec<f64> = ok.iter().map(|s| ms(s.latency)).collect();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|s| s.ttft.map(ms)).collect();
    let prompt_tokens: u64 = ok.iter().map(|s| s.prompt_tokens).sum();
    let cached_tokens: u64 = ok.iter().map(|s| s.cached_tokens).sum();
    let elapsed_s = elapsed.as_secs_f64();
    let cpu_report = |before: (f64, f64), after: (f64, f64)| {
        let (user, system) = (after.0 - before.0, after.1 - before.1);
        let per_request = |s: f64| round3(s * 1e6 / samples.len() as f64);
        json!({
            "seconds": round3(user + system),
            "us_per_request": per_request(user + system),
            "user_us_per_request": per_request(user),
            "system_us_per_request": per_request(system),
            "cores": round3((user + system) / elapsed_s),
        })
    };
    let cpu = (!args.cpu_pid.is_empty()).then(|| {
        let mut c = cpu_report(cpu_before, cpu_after);
        c["pids"] = json!(args.cpu_pid);
        c
    });
    // This generator's own CPU: what being the client of the target costs (plus its bookkeeping).
    let client_cpu = cpu_report(own_before, own_after);
    let (busy, total) = (machine_after.0 - machine_before.0, machine_after.1 - machine_before.1);
    let mut out = json!({
        "label": args.label,
        "target": args.target,
        "workload": format!("{:?}", args.workload).to_lowercase(),
        "prompt_format": format!("{:?}", args.prompt_format).to_lowercase(),
        "stream": args.stream,
        "connections": args.connections,
        "max_tokens": args.max_tokens,
        "requests": ok.len(),
        "errors": errors,
        "first_error": first_error,
        "elapsed_s": round3(elapsed_s),
        "requests_per_s": round3(ok.len() as f64 / elapsed_s),
        "latency_ms": summarize(&mut latency),
        "ttft_ms": summarize(&mut ttft),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "cpu": cpu,
        "client_cpu": client_cpu,
        "machine_cpu_busy": round3(if total > 0.0 { busy / total } else { 0.0 }),
        "workers": workers,
    });
    if let Workload::SharedPrefix(w) = &ctx.workload {
        let placement = placement_report(w, &ok, args.watch.len(), args.block_size);
        out.as_object_mut().expect("an object").extend(placement);
    }
    println!("{out}");
    Ok(())
}

/// Prefix-cache hits against what the workload allows.
fn placement_report(
    w: &SharedPrefix,
    ok: &[&Sample],
    workers: usize,
    block_size: usize,
) -> serde_json::Map<String, serde_json::Value> {
    let mut sent = vec![0u64; w.tenants()];
    for s in ok {
        if let Some(t) = s.tenant {
            sent[t] += 1;
        }
    }
    let shareable: u64 = sent.iter().enumerate().map(|(t, &n)| n * w.shareable_tokens(t, block_size)).sum();
    let cached: u64 = ok.iter().map(|s| s.cached_tokens).sum();
    // The hit ratio over time: cached / shareable tokens in each tenth of the run (by finish).
    let mut by_time: Vec<&&Sample> = ok.iter().collect();
    by_time.sort_by_key(|s| s.done_at);
    let tenth = by_time.len().div_ceil(10).max(1);
    let over_time: Vec<f64> = by_time
        .chunks(tenth)
        .map(|c| {
            let shareable: u64 = c.iter().filter_map(|s| s.tenant.map(|t| w.shareable_tokens(t, block_size))).sum();
            let cached: u64 = c.iter().map(|s| s.cached_tokens).sum();
            round3(cached as f64 / shareable.max(1) as f64)
        })
        .collect();
    let mut m = serde_json::Map::new();
    m.insert("shareable_tokens".into(), shareable.into());
    m.insert("cached_of_shareable".into(), round3(cached as f64 / shareable.max(1) as f64).into());
    m.insert("cached_of_shareable_by_tenth".into(), over_time.into());
    if workers > 0 {
        let achievable = w.achievable_cached_tokens(&sent, workers, block_size);
        m.insert("achievable_cached_tokens".into(), achievable.into());
        m.insert("cached_of_achievable".into(), round3(cached as f64 / achievable.max(1) as f64).into());
    }
    // The hot tenant and the others apart: a policy may serve one well and not the other.
    for (name, hot) in [("hot_tenant", true), ("other_tenants", false)] {
        let group: Vec<&&Sample> = ok.iter().filter(|s| (s.tenant == Some(0)) == hot).collect();
        let shareable: u64 = group.iter().filter_map(|s| s.tenant.map(|t| w.shareable_tokens(t, block_size))).sum();
        let cached: u64 = group.iter().map(|s| s.cached_tokens).sum();
        let mut ttft: Vec<f64> = group.iter().filter_map(|s| s.ttft.map(ms)).collect();
        m.insert(
            name.into(),
            json!({
                "requests": group.len(),
                "cached_of_shareable": round3(cached as f64 / shareable.max(1) as f64),
                "ttft_ms": summarize(&mut ttft),
            }),
        );
    }
    m
}

/// User and system CPU seconds of `pids`, summed.
fn cpu_of(pids: &[u32]) -> anyhow::Result<(f64, f64)> {
    pids.iter().try_fold((0.0, 0.0), |(u, s), &p| {
        let (pu, ps) = procstat::process_cpu_s(p)?;
        Ok((u + pu, s + ps))
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

async fn connect(target: &str, connections: usize) -> anyhow::Result<Vec<Client>> {
    if let Some(addr) = target.strip_prefix("http://") {
        let addr = addr.trim_end_matches('/').to_string();
        let mut clients = Vec::with_capacity(connections);
        for _ in 0..connections {
            let sender = open_http(&addr).await.with_context(|| format!("connecting to {addr}"))?;
            clients.push(Client::Http { addr: addr.clone(), sender: Some(sender) });
        }
        Ok(clients)
    } else if let Some(list) = target.strip_prefix("grpc://") {
        let mut channels = Vec::new();
        for addr in list.split(',').filter(|a| !a.is_empty()) {
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
                .tcp_nodelay(true)
                .connect()
                .await
                .with_context(|| format!("connecting to {addr}"))?;
            channels.push(WorkerClient::new(channel));
        }
        anyhow::ensure!(!channels.is_empty(), "no worker address in {target}");
        Ok((0..connections).map(|i| Client::Grpc(channels[i % channels.len()].clone())).collect())
    } else {
        anyhow::bail!("--target must start with http:// or grpc://")
    }
}

async fn open_http(addr: &str) -> anyhow::Result<SendRequest<Full<Bytes>>> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// Send `n` requests over `clients`, each connection one at a time; the clients come back for
/// the next phase.
async fn phase(clients: Vec<Client>, n: usize, ctx: &Arc<Ctx>, seed: u64) -> (Vec<Client>, Vec<Sample>, Duration) {
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, mut client)| {
            let (next, ctx) = (next.clone(), ctx.clone());
            let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(1_000_003).wrapping_add(i as u64));
            tokio::spawn(async move {
                let mut samples = Vec::new();
                while next.fetch_add(1, Ordering::Relaxed) < n {
                    let prompt = ctx.workload.next(&mut rng);
                    let mut sample = match tokio::time::timeout(ctx.timeout, client.send(&ctx, &prompt)).await {
                        Ok(s) => s,
                        Err(_) => {
                            client.reset();
                            Sample::failed("timed out".into())
                        }
                    };
                    sample.tenant = prompt.tenant;
                    sample.done_at = start.elapsed();
                    samples.push(sample);
                }
                (client, samples)
            })
        })
        .collect();
    let mut clients = Vec::new();
    let mut samples = Vec::with_capacity(n);
    for t in tasks {
        let (c, s) = t.await.expect("a connection task panicked");
        clients.push(c);
        samples.extend(s);
    }
    (clients, samples, start.elapsed())
}

impl Sample {
    fn blank() -> Self {
        Sample {
            done_at: Duration::ZERO,
            latency: Duration::ZERO,
            ttft: None,
            tenant: None,
            prompt_tokens: 0,
            cached_tokens: 0,
            error: None,
        }
    }

    fn failed(error: String) -> Self {
        Sample { error: Some(error), ..Sample::blank() }
    }
}

/// The parts of a response (whole, or one SSE event) the generator reads.
#[derive(Deserialize)]
struct Answer {
    #[serde(default)]
    choices: Vec<AnswerChoice>,
    usage: Option<AnswerUsage>,
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct AnswerChoice {
    #[serde(default)]
    text: String,
}

#[derive(Deserialize)]
struct AnswerUsage {
    prompt_tokens: u64,
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl AnswerUsage {
    fn cached(&self) -> u64 {
        self.prompt_tokens_details.as_ref().and_then(|d| d.cached_tokens).unwrap_or(0)
    }
}

impl Client {
    /// Forget a connection whose request was abandoned: its response may still arrive.
    fn reset(&mut self) {
        if let Client::Http { sender, .. } = self {
            *sender = None;
        }
    }

    async fn send(&mut self, ctx: &Ctx, prompt: &Prompt) -> Sample {
        let start = Instant::now();
        let result = match self {
            Client::Http { addr, sender } => http_request(addr, sender, ctx, prompt, start).await,
            Client::Grpc(client) => grpc_request(client, ctx, prompt, start).await,
        };
        match result {
            Ok(mut s) => {
                s.latency = start.elapsed();
                s
            }
            Err(e) => {
                self.reset();
                Sample::failed(format!("{e:#}"))
            }
        }
    }
}

async fn http_request(
    addr: &str,
    sender: &mut Option<SendRequest<Full<Bytes>>>,
    ctx: &Ctx,
    prompt: &Prompt,
    start: Instant,
) -> anyhow::Result<Sample> {
    let prompt_json = match ctx.format {
        PromptFormat::Tokens => json!(prompt.tokens),
        PromptFormat::Text => json!(to_text(&prompt.tokens)),
    };
    let mut body = json!({
        "model": ctx.model,
        "prompt": prompt_json,
        "max_tokens": ctx.max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": ctx.stream,
    });
    if ctx.stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    let request = Request::post("/v1/completions")
        .header(header::HOST, addr)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    if let Some(s) = sender
        && s.ready().await.is_err()
    {
        // The server closed the kept-alive connection: open another one.
        *sender = None;
    }
    let s = match sender {
        Some(s) => s,
        None => sender.insert(open_http(addr).await?),
    };
    let response = s.send_request(request).await?;
    let status = response.status();
    let mut body = response.into_body();
    let mut sample = Sample::blank();
    if status != StatusCode::OK {
        let bytes = body.collect().await?.to_bytes();
        anyhow::bail!("HTTP {status}: {}", String::from_utf8_lossy(&bytes[..bytes.len().min(300)]));
    }
    if !ctx.stream {
        let bytes = body.collect().await?.to_bytes();
        let answer: Answer = serde_json::from_slice(&bytes).context("the response is not a completion")?;
        anyhow::ensure!(answer.choices.iter().any(|c| !c.text.is_empty()), "a completion without text");
        let usage = answer.usage.context("a completion without usage")?;
        (sample.prompt_tokens, sample.cached_tokens) = (usage.prompt_tokens, usage.cached());
        return Ok(sample);
    }
    let mut buf: Vec<u8> = Vec::new();
    let mut done = false;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else { continue };
        buf.extend_from_slice(&data);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            for line in event.split(|&b| b == b'\n') {
                let Some(payload) = line.strip_prefix(b"data:") else { continue };
                let payload = payload.trim_ascii();
                if payload == b"[DONE]" {
                    done = true;
                    continue;
                }
                let answer: Answer = serde_json::from_slice(payload).context("an SSE event is not a chunk")?;
                if let Some(e) = answer.error {
                    anyhow::bail!("error in the stream: {e}");
                }
                if sample.ttft.is_none() && answer.choices.iter().any(|c| !c.text.is_empty()) {
                    sample.ttft = Some(start.elapsed());
                }
                if let Some(u) = answer.usage {
                    (sample.prompt_tokens, sample.cached_tokens) = (u.prompt_tokens, u.cached());
                }
            }
        }
    }
    anyhow::ensure!(done, "the stream ended without [DONE]");
    anyhow::ensure!(sample.ttft.is_some(), "a stream without text");
    Ok(sample)
}

async fn grpc_request(
    client: &mut WorkerClient<Channel>,
    ctx: &Ctx,
    prompt: &Prompt,
    start: Instant,
) -> anyhow::Result<Sample> {
    let request = pb::GenerateRequest {
        prompt_token_ids: prompt.tokens.clone(),
        sampling: Some(pb::SamplingParams { temperature: Some(0.0), ..Default::default() }),
        max_tokens: Some(ctx.max_tokens),
        ignore_eos: true,
        ..Default::default()
    };
    let mut stream = client.generate(request).await?.into_inner();
    let mut sample = Sample::blank();
    while let Some(message) = stream.message().await? {
        match message.kind {
            Some(pb::generate_response::Kind::Delta(d)) if sample.ttft.is_none() && !d.token_ids.is_empty() => {
                sample.ttft = Some(start.elapsed());
            }
            Some(pb::generate_response::Kind::Finished(f)) => {
                let u = f.usage.unwrap_or_default();
                (sample.prompt_tokens, sample.cached_tokens) =
                    (u64::from(u.prompt_tokens), u64::from(u.cached_prompt_tokens));
                return Ok(sample);
            }
            _ => {}
        }
    }
    anyhow::bail!("the worker's stream ended without Finished")
}
