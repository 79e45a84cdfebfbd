//! `bellows-worker`: run the engine from a terminal (`generate`), benchmark it (`bench`), or serve
//! it as a cluster node (`serve`).

use std::{
    io::{IsTerminal, Write},
    sync::Arc,
    time::Instant,
};

use anyhow::{Result, bail};
use bellows_worker::{
    bench::{self, BenchArgs},
    engine::{Engine, EngineConfig},
    load::ModelArgs,
    model::Backend,
    node::{self, ServeArgs},
    request::{Event, GenerateRequest},
    sampling::SamplingParams,
    synth,
    tokenizer::ChatMessage,
};
use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "bellows-worker", version, about = "Bellows worker: model engine and tools")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate a completion and print it as it streams.
    Generate(GenerateArgs),
    /// Run the engine benchmarks and print JSON.
    Bench(BenchArgs),
    /// Serve the model as a cluster node: gRPC (Generate, ModelInfo, WatchLoad, health), etcd
    /// registration, graceful drain on SIGTERM/SIGINT.
    Serve(Box<ServeArgs>),
    /// Run many nodes in one process (each its own gRPC port, node id, engine and KV pool), for
    /// tests and benchmarks of a large cluster; `--engine sim` makes a thousand cheap.
    Fleet(Box<node::fleet::FleetArgs>),
    /// Write a llama-shaped GGUF of random weights (default: Llama 2 7B's shape) with a real
    /// model's tokenizer, for benchmarks where a real file cannot travel; `--vocab-only` writes
    /// just a model's vocabulary, which `--like` takes in place of the whole model.
    SynthModel(synth::SynthArgs),
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// KV cache budget in MiB [default: 512 on the CPU; on a GPU 80% of the memory free after
    /// loading the model].
    #[arg(long, env = "BELLOWS_KV_CACHE_MB")]
    kv_cache_mb: Option<usize>,
    /// The prompt text.
    #[arg(long, short)]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message (with --chat).
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 256)]
    max_tokens: u32,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop at this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
}

fn main() -> Result<()> {
    // candle's matmul workers spin 25,000 times before parking. When the worker shares its cores
    // (anything else running), that spinning starves the very thread being waited for: measured
    // here, decode fell to 8-17 tok/s with the default and 26-37 with 2,000, with no measurable
    // loss on a quiet machine (docs/BENCHMARKS.md). An explicit setting wins.
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        // SAFETY: first statement of main, before any thread exists.
        unsafe { std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", "2000") };
    }
    let cli = Cli::parse();
    // A node logs one line per request; the terminal tools only warnings.
    // A node sets up its own logging and tracing (bellows_common::telemetry) on its runtime.
    let cli = match cli.cmd {
        Cmd::Serve(a) => return node::run(*a),
        Cmd::Fleet(a) => return node::fleet::run(*a),
        cmd => Cli { cmd },
    };
    let default_filter = "warn";
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match cli.cmd {
        Cmd::Generate(a) => generate(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::SynthModel(a) if a.vocab_only => {
            let tokens = synth::write_vocab(&a)?;
            println!("{}: a vocabulary of {tokens} tokens, no weights", a.out.display());
            Ok(())
        }
        Cmd::SynthModel(a) => {
            let bytes = synth::write(&a)?;
            println!("{}: {bytes} bytes of weights", a.out.display());
            Ok(())
        }
        Cmd::Serve(_) | Cmd::Fleet(_) => unreachable!("handled above"),
    }
}

fn generate(a: GenerateArgs) -> Result<()> {
    let t0 = Instant::now();
    let (model, tok) = a.model.load(true)?;
    let load_s = t0.elapsed().as_secs_f64();
    let device = model.spec().device.clone();
    let tok = Arc::new(tok);
    let text = if a.chat {
        let mut m = Vec::new();
        if let Some(s) = &a.system {
            m.push(ChatMessage::new("system".into(), s.clone()));
        }
        m.push(ChatMessage::new("user".into(), a.prompt.clone()));
        tok.apply_chat_template(&m, true)?
    } else {
        a.prompt.clone()
    };
    let prompt = tok.encode(&text, !a.chat)?;
    let engine =
        Engine::start(Box::new(model), tok.clone(), EngineConfig { kv_cache_mb: a.kv_cache_mb, ..Default::default() })?;
    let params = SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
        ..Default::default()
    };
    let mut req = GenerateRequest::new(prompt.clone(), params, a.max_tokens);
    req.stop = a.stop;
    let mut rx = engine.handle().submit(req)?;
    if !a.chat {
        print!("{}", a.prompt);
    }
    let start = Instant::now();
    let mut first = None;
    let mut out = std::io::stdout();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { text, .. } => {
                first.get_or_insert_with(Instant::now);
                print!("{text}");
                out.flush()?;
            }
            Event::Finished { text, reason, usage, .. } => {
                println!("{text}");
                let end = Instant::now();
                let ttft = first.map_or(0.0, |f| (f - start).as_secs_f64());
                let decode = first.map_or(0.0, |f| (end - f).as_secs_f64());
                let n = usage.completion_tokens.saturating_sub(1) as f64;
                eprintln!(
                    "\n[device {device} | load {load_s:.2}s | prompt {} tokens, ttft {:.0} ms | {} tokens, {:.1} tok/s | finish: {reason:?}]",
                    usage.prompt_tokens,
                    ttft * 1000.0,
                    usage.completion_tokens,
                    if decode > 0.0 { n / decode } else { 0.0 },
                );
                return Ok(());
            }
            Event::Failed { message } => bail!("generation failed: {message}"),
            Event::Progress(_) => {}
        }
    }
    bail!("the engine stopped unexpectedly")
}
