//! Engine benchmarks (`bellows-worker bench`): single-stream decode, aggregate decode under
//! concurrency, time to first token cold and with a cached prefix, turn after turn of a cached
//! conversation against prefilling only the new tokens, and inter-token latency of
//! running streams while a long prompt arrives, chunked against unchunked, and decode under a JSON
//! Schema against unconstrained decode in the same run (with the mask time per token); and the
//! matmul and attention kernels alone, and the machine's own ceilings (`bench/peak.rs`). Prints one JSON
//! object.
//!
//! Timestamps are taken where a client would see them: when each event leaves the engine's
//! channel. Numbers are only comparable within one run on a quiet machine.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use bellows_common::constraint::{Constraint, JsonBounds};

mod peak;

use crate::{
    constraint::GrammarCompiler,
    engine::{Engine, EngineConfig, EngineHandle},
    load::ModelArgs,
    request::{Event, GenerateRequest, Usage},
    sampling::SamplingParams,
    scheduler::SchedulerConfig,
    tokenizer::ModelTokenizer,
};

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Which benchmarks: all, decode, batch, ttft, multiturn, itl, constrained, matmul, attention,
    /// sampler, peak (comma-separated).
    #[arg(long, default_value = "all")]
    pub suite: String,
    /// Tokens per stream for the decode benchmarks.
    #[arg(long, default_value_t = 128)]
    pub decode_tokens: u32,
    /// Concurrency levels for the aggregate decode benchmark.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16,32")]
    pub concurrency: Vec<usize>,
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// The TTFT benchmark's prompt length; the cached case holds all but its last 10%.
    #[arg(long, default_value_t = 1000)]
    pub ttft_prompt_tokens: usize,
    /// Prefill token budget per step for the chunked ITL case.
    #[arg(long, default_value_t = 64)]
    pub itl_chunk: usize,
    /// Step-time bound for the governed ITL case (multiple of a decode-only step).
    #[arg(long, default_value_t = 1.5)]
    pub itl_slowdown: f64,
    /// Which ITL cases to run.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "governed,chunked,unchunked")]
    pub itl_cases: Vec<ItlCase>,
    /// Prompt tokens per stream of the batch benchmark (0: a story's short opening), to measure
    /// batched decode over a long context, where attention reads each stream's whole history.
    /// The prompts are put in the prefix cache first; the KV pool is then 4 GiB (64 streams of
    /// 1,000 tokens of SmolLM2: more would be preempted).
    #[arg(long, default_value_t = 0)]
    pub batch_context: usize,
    /// Sampling temperature of the decode and batch benchmarks' streams (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus (top-p) of the decode and batch benchmarks' streams, when they sample.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
}

/// The scheduling cases of the ITL benchmark.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ItlCase {
    /// Chunked, with the prefill governor at `--itl-slowdown`.
    Governed,
    /// `--itl-chunk` prefill tokens a step, no governor.
    Chunked,
    /// The whole long prompt in one step.
    Unchunked,
}

/// What one stream saw.
struct Trace {
    submitted: Instant,
    tokens: Vec<Instant>,
    ids: Vec<u32>,
    usage: Usage,
}

fn greedy(prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
    let mut r = GenerateRequest::new(prompt, SamplingParams::greedy(), max_tokens);
    r.ignore_eos = true;
    r
}

/// A decode benchmark's stream: greedy, or sampled as `--temperature` and `--top-p` say (seeded,
/// so runs repeat).
fn decode_request(prompt: Vec<u32>, a: &BenchArgs, seed: u64) -> GenerateRequest {
    let mut r = greedy(prompt, a.decode_tokens);
    if a.temperature > 0.0 {
        r.params =
            SamplingParams { temperature: a.temperature, top_p: a.top_p, seed: Some(seed), ..Default::default() };
    }
    r
}

/// Run one request to its end (or until `stop` is set), recording token arrival times.
fn run_stream(h: &EngineHandle, req: GenerateRequest, stop: Option<&AtomicBool>) -> Result<Trace> {
    let submitted = Instant::now();
    let mut rx = h.submit(req)?;
    let (mut tokens, mut ids) = (Vec::new(), Vec::new());
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { id, .. } => {
                tokens.push(Instant::now());
                ids.push(id);
                if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
                    return Ok(Trace { submitted, tokens, ids, usage: Usage::default() });
                }
            }
            Event::Finished { usage, .. } => return Ok(Trace { submitted, tokens, ids, usage }),
            Event::Failed { message } => bail!("request failed: {message}"),
            Event::Progress(_) => {}
        }
    }
    bail!("stream ended without finishing")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

fn percentile(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[((v.len() - 1) as f64 * q).round() as usize] }
}

struct Ctx {
    model: ModelArgs,
    tok: Arc<ModelTokenizer>,
}

impl Ctx {
    fn engine(&self, cfg: EngineConfig) -> Result<Engine> {
        let (model, _) = self.model.load(false)?;
        Engine::start(Box::new(model), self.tok.clone(), cfg)
    }

    /// `n` tokens of varied English text (so the prefix cache only hits what we make it hit).
    fn long_prompt(&self, n: usize, seed: usize) -> Result<Vec<u32>> {
        let mut text = String::new();
        let mut i = seed * 1000;
        let mut ids = Vec::new();
        while ids.len() < n {
            for _ in 0..50 {
                text.push_str(&format!(
                    "Report {i}: the river station measured {} millimetres of rain and {} visitors. ",
                    i * 7 % 113,
                    i * 13 % 997
                ));
                i += 1;
            }
            ids = self.tok.encode(&text, false)?;
        }
        ids.truncate(n);
        Ok(ids)
    }
}

pub fn run(a: BenchArgs) -> Result<()> {
    let (model, tok) = a.model.load(false)?;
    let (device, device_attention) =
        (crate::model::Backend::spec(&model).device.clone(), model.uses_device_attention());
    drop(model);
    let ctx = Ctx { model: a.model.clone(), tok: Arc::new(tok) };
    let all = a.suite == "all";
    let want = |s: &str| all || a.suite.split(',').any(|x| x == s);
    let mut out = json!({
        "model": ctx.model.path().file_name().map(|f| f.to_string_lossy().into_owned()),
        "requantize": !ctx.model.no_requantize,
        "repack": !ctx.model.no_repack,
        "own_matmul": !ctx.model.candle_matmul,
        "threads": candle_core::utils::get_num_threads(),
        "device": device,
        "device_attention": device_attention,
    });
    if want("decode") {
        out["single_stream"] = bench_decode(&ctx, &a)?;
        eprintln!("single_stream: {}", out["single_stream"]);
    }
    if want("batch") {
        out["aggregate"] = bench_batch(&ctx, &a)?;
        eprintln!("aggregate: {}", out["aggregate"]);
    }
    if want("ttft") {
        out["ttft"] = bench_ttft(&ctx, &a)?;
        eprintln!("ttft: {}", out["ttft"]);
    }
    if want("multiturn") {
        out["multiturn"] = bench_multiturn(&ctx, &a)?;
        eprintln!("multiturn: {}", out["multiturn"]);
    }
    if want("constrained") {
        out["constrained"] = bench_constrained(&ctx, &a)?;
        eprintln!("constrained: {}", out["constrained"]);
    }
    if want("itl") {
        out["itl_during_long_prefill"] = bench_itl(&ctx, &a)?;
        eprintln!("itl: {}", out["itl_during_long_prefill"]);
    }
    if want("matmul") {
        out["matmul"] = bench_matmul()?;
        eprintln!("matmul: {}", out["matmul"]);
    }
    if want("attention") {
        out["attention"] = bench_attention();
        eprintln!("attention: {}", out["attention"]);
    }
    if want("sampler") {
        out["sampler"] = bench_sampler(&ctx)?;
        eprintln!("sampler: {}", out["sampler"]);
    }
    if want("peak") {
        out["peak"] = peak::run();
        eprintln!("peak: {}", out["peak"]);
    }
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

fn bench_decode(ctx: &Ctx, a: &BenchArgs) -> Result<Value> {
    let engine = ctx.engine(EngineConfig::default())?;
    let prompt = ctx.tok.encode("Once upon a time", false)?;
    let mut rates = Vec::new();
    for _ in 0..a.repeat {
        let t = run_stream(&engine.handle(), decode_request(prompt.clone(), a, 0), None)?;
        let span = (*t.tokens.last().context("no tokens")? - t.tokens[0]).as_secs_f64();
        rates.push((t.tokens.len() - 1) as f64 / span);
    }
    Ok(
        json!({ "prompt_tokens": prompt.len(), "decode_tokens": a.decode_tokens, "decode_tok_s": median(rates.clone()), "runs": rates }),
    )
}

/// A schema no answer of `--decode-tokens` can complete: JSON structure, free text and numbers
/// mixed, as a model writing a long structured answer produces. Unbounded numbers, as users
/// write them; the bench compiles them with the router's default bounds.
fn endless_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "readings": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "note": {"type": "string", "maxLength": 80},
                        "level": {"type": "number"},
                        "count": {"type": "integer"},
                    },
                    "required": ["note", "level", "count"],
                    "additionalProperties": false,
                },
                "minItems": 64,
            },
        },
        "required": ["title", "readings"],
        "additionalProperties": false,
    })
}

/// Aggregate decode rate of one stream per prompt, from when every stream has its first token to
/// when the first one ends (the steady state); returns the rate and every stream's trace.
fn steady_decode(
    h: &EngineHandle,
    prompts: &[Vec<u32>],
    make: impl Fn(Vec<u32>) -> GenerateRequest + Sync,
) -> Result<(f64, Vec<Trace>)> {
    let traces = std::thread::scope(|s| {
        let hs: Vec<_> = prompts.iter().map(|p| s.spawn(|| run_stream(h, make(p.clone()), None))).collect();
        hs.into_iter().map(|h| h.join().expect("stream thread")).collect::<Result<Vec<_>>>()
    })?;
    let from = traces.iter().map(|t| t.tokens[0]).max().context("no streams")?;
    let to = traces.iter().map(|t| *t.tokens.last().expect("tokens")).min().context("no streams")?;
    let n: usize = traces.iter().map(|t| t.tokens.iter().filter(|&&x| x > from && x <= to).count()).sum();
    Ok((n as f64 / (to - from).as_secs_f64(), traces))
}

/// Decode under a JSON Schema against unconstrained decode, alternating in one run, at each
/// `--concurrency` level; then the grammar's own cost, timed apart from the engine: one mask
/// per token of a constrained answer, replayed through a fresh grammar.
fn bench_constrained(ctx: &Ctx, a: &BenchArgs) -> Result<Value> {
    let engine = ctx.engine(EngineConfig::default())?;
    let h = engine.handle();
    let schema_json = endless_schema();
    let schema = Constraint::json_schema(schema_json.clone(), JsonBounds::Bounded);
    let constrained = |p: Vec<u32>| GenerateRequest { constraint: Some(schema.clone()), ..greedy(p, a.decode_tokens) };
    let free = |p: Vec<u32>| greedy(p, a.decode_tokens);
    let mut rows = Vec::new();
    let mut answer = Vec::new();
    for &c in &a.concurrency {
        let prompts: Vec<Vec<u32>> = (0..c)
            .map(|i| ctx.tok.encode(&format!("Write report {i} about the river station, as JSON."), false))
            .collect::<Result<_>>()?;
        let (mut with, mut without) = (Vec::new(), Vec::new());
        for _ in 0..a.repeat {
            without.push(steady_decode(&h, &prompts, free)?.0);
            let (rate, traces) = steady_decode(&h, &prompts, constrained)?;
            with.push(rate);
            answer = traces.into_iter().next().map(|t| t.ids).unwrap_or_default();
        }
        let (w, wo) = (median(with.clone()), median(without.clone()));
        eprintln!("  {c} streams: {w:.1} tok/s constrained, {wo:.1} unconstrained ({:.3}x)", w / wo);
        rows.push(json!({"streams": c, "constrained_tok_s": w, "unconstrained_tok_s": wo, "ratio": w / wo,
            "constrained_runs": with, "unconstrained_runs": without}));
    }
    let compiler = GrammarCompiler::new(ctx.tok.clone(), ctx.tok.vocab_size());
    let t = Instant::now();
    let mut grammar = compiler.compile(&schema)?;
    let first_compile_ms = t.elapsed().as_secs_f64() * 1000.0;
    let t = Instant::now();
    let mut g2 = compiler.compile(&schema)?;
    let compile_ms = t.elapsed().as_secs_f64() * 1000.0;
    drop(g2.mask());
    let mut mask_us = Vec::new();
    for &tok in &answer {
        let t = Instant::now();
        let m = grammar.mask()?;
        mask_us.push(t.elapsed().as_secs_f64() * 1e6);
        anyhow::ensure!(m.allows(tok), "the engine produced token {tok}, which the mask forbids");
        grammar.commit(tok)?;
    }
    Ok(json!({
        "schema": schema_json, "decode_tokens": a.decode_tokens,
        "rows": rows,
        "mask_us": {"p50": percentile(&mask_us, 0.5), "p99": percentile(&mask_us, 0.99), "max": percentile(&mask_us, 1.0), "tokens": mask_us.len()},
        "compile_ms": {"first_with_token_table": first_compile_ms, "next": compile_ms},
    }))
}

fn bench_batch(ctx: &Ctx, a: &BenchArgs) -> Result<Value> {
    // Room for every stream of the highest level to run at once (a GPU's 256).
    let most = a.concurrency.iter().copied().max().unwrap_or(1);
    let defaults = SchedulerConfig::default();
    let scheduler = SchedulerConfig {
        max_running: defaults.max_running.max(most),
        max_batch_tokens: defaults.max_batch_tokens.max(most),
        max_waiting: defaults.max_waiting.max(most),
        ..defaults
    };
    // Long contexts take a larger KV pool: 4 GiB holds 64 streams of 1,000 tokens of SmolLM2.
    let kv_cache_mb = (a.batch_context > 0).then_some(4096);
    let engine = ctx.engine(EngineConfig { scheduler, kv_cache_mb })?;
    let mut rows = Vec::new();
    for &c in &a.concurrency {
        let mut rates = Vec::new();
        for r in 0..a.repeat {
            let prompts: Vec<Vec<u32>> = (0..c)
                .map(|i| match a.batch_context {
                    0 => ctx.tok.encode(&format!("Story {r}-{i}: Once upon a time"), false),
                    n => ctx.long_prompt(n, 300 + r * most + i),
                })
                .collect::<Result<_>>()?;
            // A long context goes into the prefix cache first, so the streams start decoding
            // together instead of one after another's prefill.
            if a.batch_context > 0 {
                for p in &prompts {
                    run_stream(&engine.handle(), greedy(p.clone(), 1), None)?;
                }
            }
            let seed = std::sync::atomic::AtomicU64::new(0);
            let make = |p| decode_request(p, a, seed.fetch_add(1, Ordering::Relaxed));
            rates.push(steady_decode(&engine.handle(), &prompts, make)?.0);
        }
        let agg = median(rates);
        rows.push(json!({ "streams": c, "aggregate_tok_s": agg }));
        eprintln!("  {c} streams: {agg:.1} tok/s");
    }
    let single = rows.first().and_then(|r| r["aggregate_tok_s"].as_f64()).unwrap_or(0.0);
    for r in &mut rows {
        let x = r["aggregate_tok_s"].as_f64().unwrap_or(0.0);
        r["x_single"] = json!(if single > 0.0 { x / single } else { 0.0 });
    }
    Ok(Value::Array(rows))
}

fn bench_ttft(ctx: &Ctx, a: &BenchArgs) -> Result<Value> {
    let engine = ctx.engine(EngineConfig::default())?;
    let h = engine.handle();
    let (mut cold, mut warm, mut cached) = (Vec::new(), Vec::new(), 0);
    for r in 0..a.repeat {
        let prompt = ctx.long_prompt(a.ttft_prompt_tokens, r)?;
        let ttft = |t: &Trace| (t.tokens[0] - t.submitted).as_secs_f64() * 1000.0;
        let mut req = greedy(prompt.clone(), 1);
        req.cache_salt = Some(format!("cold-{r}"));
        cold.push(ttft(&run_stream(&h, req, None)?));

        let salt = Some(format!("warm-{r}"));
        let mut fill = greedy(prompt[..prompt.len() * 9 / 10].to_vec(), 1);
        fill.cache_salt = salt.clone();
        run_stream(&h, fill, None)?;
        let mut req = greedy(prompt, 1);
        req.cache_salt = salt;
        let t = run_stream(&h, req, None)?;
        cached = t.usage.cached_tokens;
        warm.push(ttft(&t));
    }
    let (c, w) = (median(cold.clone()), median(warm.clone()));
    Ok(json!({
        "prompt_tokens": a.ttft_prompt_tokens, "cached_prefix_tokens": cached,
        "cold_ms": c, "cached_ms": w, "speedup": c / w, "cold_runs": cold, "cached_runs": warm,
    }))
}

/// Turn after turn of one conversation, each turn's prompt the last one's plus its answer and a
/// new message, the earlier turns cached: each turn's TTFT against a cold prefill of only the
/// tokens the cache did not hold (the floor a cache could reach were attention over the history
/// free). Turn 1 opens with a 1,200-token document; each turn adds a 24-token message and the
/// 32-token answer, so turn 5 is about 1,420 tokens.
fn bench_multiturn(ctx: &Ctx, a: &BenchArgs) -> Result<Value> {
    const TURNS: usize = 5;
    const MESSAGE: usize = 24;
    const ANSWER: u32 = 32;
    let engine = ctx.engine(EngineConfig::default())?;
    let h = engine.handle();
    let ttft = |t: &Trace| (t.tokens[0] - t.submitted).as_secs_f64() * 1000.0;
    let mut per_turn: Vec<Vec<(usize, usize, f64, f64)>> = vec![Vec::new(); TURNS];
    for r in 0..a.repeat {
        let mut history = ctx.long_prompt(1200, 100 + r)?;
        let messages = ctx.long_prompt(MESSAGE * TURNS, 200 + r)?;
        for (turn, message) in messages.chunks(MESSAGE).enumerate() {
            history.extend_from_slice(message);
            let mut req = greedy(history.clone(), ANSWER);
            req.cache_salt = Some(format!("chat-{r}"));
            let t = run_stream(&h, req, None)?;
            let cached = t.usage.cached_tokens as usize;
            let new = history.len() - cached;
            let mut alone = greedy(history[history.len() - new..].to_vec(), 1);
            alone.cache_salt = Some(format!("alone-{r}-{turn}"));
            let base = ttft(&run_stream(&h, alone, None)?);
            per_turn[turn].push((history.len(), cached, ttft(&t), base));
            history.extend_from_slice(&t.ids);
        }
    }
    let rows: Vec<Value> = per_turn
        .iter()
        .enumerate()
        .map(|(turn, runs)| {
            let (ttfts, bases): (Vec<f64>, Vec<f64>) = runs.iter().map(|&(_, _, t, b)| (t, b)).unzip();
            let ratios = runs.iter().map(|&(_, _, t, b)| t / b).collect::<Vec<_>>();
            json!({
                "turn": turn + 1, "prompt_tokens": runs[0].0, "cached_tokens": runs[0].1,
                "ttft_ms": median(ttfts), "new_tokens_alone_ms": median(bases), "ratio": median(ratios),
            })
        })
        .collect();
    Ok(json!(rows))
}

/// The 8 streams of the ITL benchmark: same prompts in every run, so token `j` of stream `i` is
/// decoded at the same context length in the run with the long prompt and in its control.
fn itl_streams(ctx: &Ctx) -> Result<Vec<Vec<u32>>> {
    (0..8).map(|i| ctx.tok.encode(&format!("Stream {i}: Once upon a time"), false)).collect()
}

/// Gaps (ms) between consecutive tokens, with the index of the later token.
fn gaps(t: &Trace) -> impl Iterator<Item = (usize, Instant, Instant, f64)> + '_ {
    t.tokens.windows(2).enumerate().map(|(k, w)| (k + 1, w[0], w[1], (w[1] - w[0]).as_secs_f64() * 1000.0))
}

/// Inter-token latency of 8 streams while a 2,000-token prompt arrives, per scheduling case.
///
/// Two baselines. *Steady*: the same run's gaps before the long prompt (the first 3 s, at about
/// 100 tokens of context). *Control*: a second run of the same 8 streams with no long prompt,
/// over the same token positions each stream covered while the long prompt prefilled. The streams
/// grow during a long prefill, and their own decode steps slow down with them (attention), so only
/// the control compares like with like; the steady columns stay to show that growth.
fn bench_itl(ctx: &Ctx, a: &BenchArgs) -> Result<Value> {
    let mut out = serde_json::Map::new();
    let cases = [
        (ItlCase::Governed, "governed", SchedulerConfig::default().max_batch_tokens, Some(a.itl_slowdown)),
        (ItlCase::Chunked, "chunked", a.itl_chunk, None),
        (ItlCase::Unchunked, "unchunked", 2048 + 64, None),
    ];
    let prompts = itl_streams(ctx)?;
    for (_, name, budget, itl_slowdown) in cases.into_iter().filter(|(case, ..)| a.itl_cases.contains(case)) {
        // Room for 8 streams growing through a long prefill without preemption.
        let scheduler =
            SchedulerConfig { max_batch_tokens: budget, max_running: 16, itl_slowdown, ..Default::default() };
        let cfg = EngineConfig { kv_cache_mb: Some(2048), scheduler };
        let engine = ctx.engine(cfg.clone())?;
        let h = engine.handle();
        let stop = AtomicBool::new(false);
        let long = ctx.long_prompt(2000, 7)?;
        let (traces, long_trace) = std::thread::scope(|s| -> Result<_> {
            let streams: Vec<_> = prompts
                .iter()
                .map(|p| {
                    let (h, stop) = (h.clone(), &stop);
                    s.spawn(move || run_stream(&h, greedy(p.clone(), 4000), Some(stop)))
                })
                .collect();
            // Let the streams reach steady decoding, then send the long prompt.
            std::thread::sleep(Duration::from_secs(3));
            let long_trace = run_stream(&h, greedy(long.clone(), 1), None)?;
            std::thread::sleep(Duration::from_millis(500));
            stop.store(true, Ordering::Relaxed);
            let traces = streams.into_iter().map(|t| t.join().expect("stream")).collect::<Result<Vec<_>>>()?;
            Ok((traces, long_trace))
        })?;
        // Decode-only steps of the recent window: with the governor these include its probes, taken
        // while the long prompt prefilled, so they show the streams' own pace at their current length.
        let decode_only = h.stats();
        drop(engine);
        let (sent, done) = (long_trace.submitted, long_trace.tokens[0]);
        let (mut steady, mut during) = (Vec::new(), Vec::new());
        // Per stream, the token positions whose gaps fall in the during window.
        let mut window = vec![(usize::MAX, 0); traces.len()];
        for (i, t) in traces.iter().enumerate() {
            for (k, t0, t1, gap) in gaps(t).skip(4) {
                if t1 < sent {
                    steady.push(gap);
                } else if t0 >= sent && t1 <= done + Duration::from_millis(1) || (t0 < done && t1 > sent) {
                    during.push(gap);
                    window[i] = (window[i].0.min(k), window[i].1.max(k));
                }
            }
        }

        // Control: the same streams alone, decoding just past the last position of the window.
        let last = window.iter().map(|w| w.1).max().unwrap_or(0);
        let engine = ctx.engine(cfg)?;
        let h = engine.handle();
        let control_traces = std::thread::scope(|s| {
            let streams: Vec<_> = prompts
                .iter()
                .map(|p| {
                    let h = h.clone();
                    s.spawn(move || run_stream(&h, greedy(p.clone(), last as u32 + 1), None))
                })
                .collect();
            streams.into_iter().map(|t| t.join().expect("stream")).collect::<Result<Vec<_>>>()
        })?;
        drop(engine);
        let mut control = Vec::new();
        for (t, &(lo, hi)) in control_traces.iter().zip(&window) {
            control.extend(gaps(t).filter(|&(k, ..)| (lo..=hi).contains(&k)).map(|(.., gap)| gap));
        }
        let positions = (window.iter().map(|w| w.0).min().unwrap_or(0), last);
        let context = |k: usize| prompts.iter().map(|p| p.len() + k).max().unwrap_or(0);

        let (s99, d99, c99) = (percentile(&steady, 0.99), percentile(&during, 0.99), percentile(&control, 0.99));
        let (d50, c50) = (percentile(&during, 0.5), percentile(&control, 0.5));
        out.insert(
            name.into(),
            json!({
                "max_batch_tokens": budget,
                "itl_slowdown": itl_slowdown,
                "long_prompt_tokens": long.len(),
                "long_prompt_ttft_ms": (done - sent).as_secs_f64() * 1000.0,
                "steady_itl_p50_ms": percentile(&steady, 0.5), "steady_itl_p99_ms": s99,
                "during_itl_p50_ms": d50, "during_itl_p99_ms": d99,
                "during_p99_over_steady_p99": d99 / s99,
                "recent_decode_only_step_p50_ms": decode_only.decode_step_p50_ms,
                "recent_decode_only_step_p99_ms": decode_only.decode_step_p99_ms,
                "during_p99_over_recent_decode_only_p99": d99 / decode_only.decode_step_p99_ms,
                "during_token_positions": [positions.0, positions.1],
                "during_stream_context_tokens": [context(positions.0), context(positions.1)],
                "control_itl_p50_ms": c50, "control_itl_p99_ms": c99,
                "during_p50_over_control_p50": d50 / c50,
                "during_p99_over_control_p99": d99 / c99,
                "gaps_steady": steady.len(), "gaps_during": during.len(), "gaps_control": control.len(),
            }),
        );
        eprintln!("  {name}: {}", out[name]);
    }
    Ok(Value::Object(out))
}

/// Our int8 matmuls against candle's, on the default model's shapes (random weights): microseconds
/// per call and GMAC/s for 1 to 256 rows. candle's is timed as the engine would run it without
/// ours: where the CPU has VNNI, the input zero-padded to a multiple of 256 for its repacked
/// kernels. Ours (on the kernels `int8_kernels` names): the same matrix as Q8_0 and as Q4_1.
fn bench_matmul() -> Result<Value> {
    use candle_core::{
        D, Device, Module, Tensor,
        quantized::{GgmlDType, QMatMul, QTensor},
    };

    use crate::model::int8_matmul::{self, Int8Weights};
    let Some(kernels) = int8_matmul::kernels() else {
        return Ok(json!("neither AVX-512 VNNI nor AVX2: our kernels do not run here"));
    };
    let time = |f: &dyn Fn() -> Result<()>, iters: usize| -> Result<f64> {
        for _ in 0..3 {
            f()?;
        }
        let start = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        Ok(start.elapsed().as_secs_f64() / iters as f64)
    };
    let repacked = crate::model::llama::cpu_has_repacked_q8_0();
    let mut rows = Vec::new();
    // Fused Q/K/V, fused gate/up, down, and the tied LM head.
    for (n, k) in [(960, 576), (3072, 576), (576, 1536), (49152, 576)] {
        let f = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
        let q8_0 = Int8Weights::from_qtensor(&QTensor::quantize(&f, GgmlDType::Q8_0)?)?;
        let q4_1 = Int8Weights::from_qtensor(&QTensor::quantize(&f, GgmlDType::Q4_1)?)?;
        let pad = if repacked { k.next_multiple_of(256) - k } else { 0 };
        let candle = QMatMul::from_qtensor(QTensor::quantize(&f.pad_with_zeros(D::Minus1, 0, pad)?, GgmlDType::Q8_0)?)?;
        for m in [1usize, 4, 16, 64, 256] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
            let iters = (200_000_000 / (m * k * n)).clamp(3, 2000);
            let theirs =
                time(&|| candle.forward(&x.pad_with_zeros(D::Minus1, 0, pad)?).map(drop).map_err(Into::into), iters)?;
            let ours_q8_0 = time(&|| q8_0.forward(&x).map(drop), iters)?;
            let ours_q4_1 = time(&|| q4_1.forward(&x).map(drop), iters)?;
            let gmac = |s: f64| (m * k * n) as f64 / s / 1e9;
            rows.push(json!({
                "n": n, "k": k, "rows": m, "int8_kernels": kernels, "candle_input_padding": pad,
                "candle_us": theirs * 1e6, "candle_gmac_s": gmac(theirs),
                "int8_q8_0_us": ours_q8_0 * 1e6, "int8_q8_0_gmac_s": gmac(ours_q8_0),
                "int8_q4_1_us": ours_q4_1 * 1e6, "int8_q4_1_gmac_s": gmac(ours_q4_1),
                "int8_q8_0_speedup_over_candle": theirs / ours_q8_0,
            }));
        }
    }
    Ok(Value::Array(rows))
}

/// The sampler's time for one token on its own (the engine's thread runs it once a row a step),
/// on the model's own next-token logits: those after a story's opening and the next 15 greedy
/// tokens, each timed in turn.
fn bench_sampler(ctx: &Ctx) -> Result<Value> {
    use crate::{
        kv_cache::BlockId,
        model::{Backend, BatchRow},
        sampling::{Sampler, argmax, logprobs},
    };
    const STEPS: usize = 16;
    const CALLS: usize = 25;
    let (mut model, _) = ctx.model.load(false)?;
    model.allocate_kv(8, 16)?;
    let blocks: Vec<BlockId> = (0..8).map(BlockId::new).collect();
    let mut tokens = ctx.tok.encode("Once upon a time, in a small village by the sea, there lived", false)?;
    let mut rows = Vec::new();
    let mut done = 0;
    for _ in 0..STEPS {
        let row = BatchRow { tokens: &tokens[done..], start_pos: done, blocks: &blocks, want_logits: true };
        let logits = model.forward(&[row])?.pop().context("no logits")?;
        done = tokens.len();
        tokens.push(argmax(&logits));
        rows.push(logits);
    }
    let time = |f: &mut dyn FnMut(&mut [f32])| {
        let mut row = rows[0].clone();
        let started = Instant::now();
        for _ in 0..CALLS {
            for logits in &rows {
                row.copy_from_slice(logits);
                f(&mut row);
            }
        }
        started.elapsed().as_secs_f64() * 1e6 / (CALLS * STEPS) as f64
    };
    let cases = [
        ("greedy", SamplingParams::greedy()),
        ("temperature_0.8", SamplingParams { temperature: 0.8, ..Default::default() }),
        ("top_p_0.95", SamplingParams { temperature: 0.8, top_p: 0.95, ..Default::default() }),
        ("top_k_40", SamplingParams { temperature: 0.8, top_k: 40, ..Default::default() }),
        ("min_p_0.05", SamplingParams { temperature: 0.8, min_p: 0.05, ..Default::default() }),
    ];
    let mut out = json!({ "vocab": rows[0].len(), "calls": CALLS * STEPS });
    for (name, p) in cases {
        let mut sampler = Sampler::new(SamplingParams { seed: Some(1), ..p }, &[]);
        out[format!("{name}_us")] = json!(time(&mut |row| {
            std::hint::black_box(sampler.sample(row));
        }));
    }
    out["top_logprobs_5_us"] = json!(time(&mut |row| {
        std::hint::black_box(logprobs(row.to_vec(), 0, 5));
    }));
    Ok(out)
}

/// One layer's attention alone, on the default model's heads (9 query heads over 3 KV heads of
/// 64): a cold 1,000-token prompt in the scheduler's 256-token chunks, 48 new tokens after 1,400
/// cached (a conversation's next turn), and a decode step of 16 rows at 512 positions.
/// Microseconds per layer and GMAC/s (query-key and weight-value multiply-adds).
fn bench_attention() -> Value {
    use crate::{
        kv_cache::BlockId,
        model::{
            BatchRow,
            attention::{Attention, Heads, KvDtype, LayerKv, Rope, RopeStyle, paged_attention},
        },
    };
    let heads = Heads { n_head: 9, n_kv_head: 3, head_dim: 64 };
    let (q_row, kv_row, block) = (heads.n_head * heads.head_dim, heads.n_kv_head * heads.head_dim, 16);
    let shape = Attention::causal(heads);
    let rope = Rope::new(RopeStyle::Interleaved, 64, 10000.0, 2048);
    let wave = |n: usize, f: f32| (0..n).map(|i| ((i as f32) * f).sin()).collect::<Vec<f32>>();
    // (case, rows, cached positions per row, new tokens per row)
    let cases: [(&str, usize, usize, usize); 4] = [
        ("prefill_1000_cold", 1, 0, 1000),
        ("turn_48_after_1400", 1, 1400, 48),
        ("decode_16_rows_at_512", 16, 512, 1),
        // Every row's history read once a step: bound by the cache's bytes.
        ("decode_64_rows_at_1000", 64, 1000, 1),
    ];
    let mut out = Vec::new();
    for (dtype, (name, rows, cached, new)) in
        [KvDtype::F32, KvDtype::F16, KvDtype::Bf16].into_iter().flat_map(|d| cases.map(|c| (d, c)))
    {
        let per_row = (cached + new).div_ceil(block);
        let mut kv = LayerKv::with_dtype(rows * per_row, block, heads, dtype);
        let blocks: Vec<Vec<BlockId>> =
            (0..rows).map(|r| (0..per_row).map(|b| BlockId::new((b * rows + r) as u32)).collect()).collect();
        let ids = vec![0u32; cached + new];
        // Steps of at most 256 tokens, as the scheduler cuts a prompt: (start, tokens).
        let steps: Vec<(usize, usize)> =
            (cached..cached + new).step_by(256).map(|s| (s, 256.min(cached + new - s))).collect();
        let most = 256.max(cached);
        let (q, k, v) =
            (wave(rows * most * q_row, 0.031), wave(rows * most * kv_row, 0.023), wave(rows * most * kv_row, 0.017));
        let step = |kv: &mut LayerKv, start: usize, len: usize| {
            let batch: Vec<BatchRow> = blocks
                .iter()
                .map(|b| BatchRow { tokens: &ids[..len], start_pos: start, blocks: b, want_logits: false })
                .collect();
            let (mut q, mut k) = (q[..rows * len * q_row].to_vec(), k[..rows * len * kv_row].to_vec());
            let v = &v[..rows * len * kv_row];
            std::hint::black_box(paged_attention(&batch, &mut q, &mut k, v, kv, shape, &rope));
        };
        if cached > 0 {
            step(&mut kv, 0, cached); // fill the cache once; not timed
        }
        let mut runs = Vec::new();
        for _ in 0..7 {
            let t = Instant::now();
            for &(start, len) in &steps {
                step(&mut kv, start, len);
            }
            runs.push(t.elapsed().as_secs_f64());
        }
        let seconds = median(runs);
        let macs: usize = (cached..cached + new).map(|p| p + 1).sum::<usize>() * rows * q_row * 2;
        let kv = format!("{dtype:?}").to_lowercase();
        out.push(json!({"case": name, "kv": kv, "us": seconds * 1e6, "gmac_s": macs as f64 / seconds / 1e9}));
    }
    Value::Array(out)
}
