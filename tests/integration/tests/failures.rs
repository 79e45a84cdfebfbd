//! Worker failures are not client failures: a worker that fails before the first token is
//! replaced by another; one that dies mid-stream hands the stream to another worker, and the
//! client sees one uninterrupted, exact completion.

use std::time::{Duration, Instant};

use bellows_integration::{Router, Worker, eventually, schemas, sim};
use bellows_router::cluster::link::REPORT_SILENCE;
use futures_util::StreamExt;
use serde_json::{Value, json};

#[tokio::test]
async fn a_worker_failing_before_the_first_token_is_retried_on_another() {
    // Worker `a` fails every step that carries token 999 (a model panic: INTERNAL before any
    // token); `b` is healthy. Round-robin sends at least one of two requests to `a` first.
    let a = Worker::start(&sim(r#"{"poison_token": 999}"#)).await;
    let b = Worker::start(&sim("{}")).await;
    let router = Router::with_workers(&[&a, &b], &["--policy", "round_robin"]).await;
    for _ in 0..2 {
        let (status, _, body) =
            router.post("/v1/completions", &json!({"model": "sim", "prompt": [5, 999, 7], "max_tokens": 4})).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 4);
    }
    let retries = router.metric("bellows_router_retries_total").await;
    assert!((1.0..=2.0).contains(&retries), "each request went to `a` at most once: {retries} retries");
}

#[tokio::test]
async fn when_every_worker_fails_the_client_gets_a_502_not_a_hang() {
    let a = Worker::start(&sim(r#"{"poison_token": 999}"#)).await;
    let router = Router::with_workers(&[&a], &[] as &[&str]).await;
    let (status, _, body) =
        router.post("/v1/completions", &json!({"model": "sim", "prompt": [999], "max_tokens": 4})).await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(body["error"]["code"], "worker_failed");
}

/// Read SSE `data:` payloads (with arrival times) until `pred` holds for the ones read so far.
async fn read_until(
    body: &mut (impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin),
    buf: &mut String,
    events: &mut Vec<(Instant, Value)>,
    pred: impl Fn(&[(Instant, Value)]) -> bool,
) {
    while !pred(events) {
        let chunk = body
            .next()
            .await
            .unwrap_or_else(|| {
                panic!("the stream ended early, after {:?}", events.iter().map(|e| &e.1).collect::<Vec<_>>())
            })
            .expect("the stream reads");
        buf.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            // Named events (Anthropic's) put an `event:` line before the data.
            if let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) {
                let value = serde_json::from_str(data).unwrap_or(Value::String(data.to_string()));
                events.push((Instant::now(), value));
            }
        }
    }
}

#[tokio::test]
async fn a_stream_survives_the_sigkill_of_its_worker_and_continues_exactly() {
    migrate_mid_stream(
        json!({"model": "sim", "prompt": [11, 12, 13], "max_tokens": 60, "temperature": 0}),
        Fault::Kill,
    )
    .await;
}

#[tokio::test]
async fn a_seeded_sampled_stream_continues_on_the_same_random_draws_after_a_migration() {
    // At temperature 2 the simulated model's favourite token has about 96% of the mass, so a
    // 60-token answer holds a few other draws: which ones depends on the RNG's state, which the
    // new worker must take up where the dead one left it.
    let request = json!({"model": "sim", "prompt": [11, 12, 13], "max_tokens": 60, "temperature": 2, "seed": 11});
    migrate_mid_stream(request, Fault::Kill).await;
}

#[tokio::test]
async fn a_constrained_stream_migrates_with_its_grammar_and_still_matches_its_schema() {
    // A long string first, so the stream is mid-JSON when its worker dies; sampled, so the
    // output depends on the new worker rebuilding both the grammar and the RNG from the replay.
    let schema = json!({
        "type": "object",
        "properties": {
            "note": {"type": "string", "minLength": 120, "maxLength": 160},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        },
        "required": ["note", "count", "tags"],
        "additionalProperties": false,
    });
    let request = json!({
        "model": "sim", "prompt": [11, 12, 13], "max_tokens": 200, "temperature": 1, "seed": 3,
        "guided_json": schema,
    });
    let migrated = migrate_mid_stream(request, Fault::Kill).await;
    schemas::check_output(&schema, &migrated.text).unwrap();
}

#[tokio::test]
async fn a_migrated_stream_reports_the_same_logprobs_as_an_undisturbed_one() {
    let request =
        json!({"model": "sim", "prompt": [11, 12, 13], "max_tokens": 60, "temperature": 1, "seed": 5, "logprobs": 3});
    let migrated = migrate_mid_stream(request.clone(), Fault::Kill).await;
    let mut tokens = Vec::new();
    let mut logprobs = Vec::new();
    for c in migrated.chunks.iter().filter_map(|c| c["choices"].get(0)) {
        tokens.extend(c["logprobs"]["tokens"].as_array().into_iter().flatten().cloned());
        logprobs.extend(c["logprobs"]["token_logprobs"].as_array().into_iter().flatten().cloned());
    }
    // The new worker's logits are bit-exact with the old one's: the same numbers, not close ones.
    let undisturbed = Worker::start(&sim("{}")).await;
    let router = Router::with_workers(&[&undisturbed], &[] as &[&str]).await;
    let (_, _, reference) = router.post("/v1/completions", &request).await;
    let lp = &reference["choices"][0]["logprobs"];
    assert_eq!(Value::Array(tokens), lp["tokens"]);
    assert_eq!(Value::Array(logprobs), lp["token_logprobs"]);
}

#[tokio::test]
async fn a_stream_on_a_frozen_worker_moves_on_once_its_load_reports_stop_and_the_worker_is_used_again_once_thawed() {
    // SIGSTOP: alive, sockets open, silent (a hung GPU, a deadlock). Nothing breaks on the
    // wire, so only the worker's silence on its load stream (REPORT_SILENCE) shows it; the stream must then
    // continue elsewhere, long before HTTP/2 keep-alive would give up (10 s + 5 s).
    let request = json!({"model": "sim", "prompt": [11, 12, 13], "max_tokens": 100, "temperature": 0});
    let mut migrated = migrate_mid_stream(request, Fault::Freeze).await;
    eprintln!("the stream stalled {:?} when its worker froze", migrated.stall);
    assert!(
        migrated.stall < REPORT_SILENCE + Duration::from_secs(1),
        "the stream stalled on the frozen worker for {:?}",
        migrated.stall
    );
    // Thawed, it reports again and is placed on: with the other worker gone, it serves alone.
    let thawed = migrated.serving;
    migrated.workers[thawed].signal(libc::SIGCONT);
    migrated.router.wait_placeable(2).await;
    migrated.workers[1 - thawed].kill();
    migrated.router.wait_placeable(1).await;
    let (status, _, reply) =
        migrated.router.post("/v1/completions", &json!({"model": "sim", "prompt": [5], "max_tokens": 2})).await;
    assert_eq!(status, 200, "{reply}");
}

/// How the worker running the stream fails.
enum Fault {
    /// SIGKILL: its connections close at once.
    Kill,
    /// SIGSTOP: it stays connected and says nothing.
    Freeze,
}

/// A stream that moved to another worker, and the cluster it ran on.
struct Migrated {
    text: String,
    chunks: Vec<Value>,
    /// The longest wait for the stream's next event after the fault.
    stall: Duration,
    workers: [Worker; 2],
    /// Which of `workers` was faulted.
    serving: usize,
    router: Router,
}

/// Fault whichever of `workers` runs the one stream: its index, and when.
async fn fault_the_serving_worker(workers: &mut [Worker; 2], fault: Fault) -> (usize, Instant) {
    let mut serving = None;
    for (i, w) in workers.iter().enumerate() {
        if w.load().await.running_requests == 1 {
            serving = Some(i);
        }
    }
    let serving = serving.expect("one worker runs the stream");
    let faulted = Instant::now();
    match fault {
        Fault::Kill => workers[serving].kill(),
        Fault::Freeze => workers[serving].signal(libc::SIGSTOP),
    }
    (serving, faulted)
}

/// Two simulated workers slow enough (20 ms a step: a 60-token answer takes over a second) to
/// fault one mid-stream, and a router over both.
async fn slow_pair() -> ([Worker; 2], Router) {
    let config = r#"{"base_us": 20000}"#;
    let workers = [Worker::start(&sim(config)).await, Worker::start(&sim(config)).await];
    let router = Router::with_workers(&[&workers[0], &workers[1]], &[] as &[&str]).await;
    (workers, router)
}

/// Run `request` at `path` whole, then streamed while its worker is SIGKILLed mid-way: the
/// events up to the one `is_end` names, and the whole answer.
async fn kill_mid_named_stream(path: &str, request: Value, is_end: fn(&Value) -> bool) -> (Vec<Value>, Value, Router) {
    let (mut workers, router) = slow_pair().await;
    let (status, _, reference) = router.post(path, &request).await;
    assert_eq!(status, 200, "{reference}");
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let response = reqwest::Client::new().post(router.url(path)).json(&streamed).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.bytes_stream();
    let (mut buf, mut events) = (String::new(), Vec::new());
    read_until(&mut body, &mut buf, &mut events, |e| e.len() >= 8).await;
    fault_the_serving_worker(&mut workers, Fault::Kill).await;
    read_until(&mut body, &mut buf, &mut events, |e| e.last().is_some_and(|l| is_end(&l.1))).await;
    let events: Vec<Value> = events.into_iter().map(|e| e.1).collect();
    assert!(events.iter().all(|e| e["type"] != "error"), "{events:?}");
    assert_eq!(router.metric("bellows_router_migrations_total").await, 1.0);
    (events, reference, router)
}

#[tokio::test]
async fn an_anthropic_message_stream_survives_the_sigkill_of_its_worker_and_continues_exactly() {
    let request = json!({
        "model": "sim", "max_tokens": 60, "temperature": 0,
        "messages": [{"role": "user", "content": "Tell me a story."}],
    });
    let (events, reference, _router) =
        kill_mid_named_stream("/v1/messages", request, |e| e["type"] == "message_stop").await;
    let text: String = events.iter().filter_map(|e| e["delta"]["text"].as_str()).collect();
    assert_eq!(text, reference["content"][0]["text"].as_str().unwrap(), "no token lost or repeated");
    let delta = events.iter().find(|e| e["type"] == "message_delta").expect("message_delta");
    assert_eq!(delta["usage"]["output_tokens"], reference["usage"]["output_tokens"]);
    assert_eq!(delta["delta"]["stop_reason"], reference["stop_reason"]);
}

#[tokio::test]
async fn a_responses_stream_survives_the_sigkill_of_its_worker_and_continues_exactly() {
    let request = json!({"model": "sim", "max_output_tokens": 60, "temperature": 0, "input": "Tell me a story."});
    let (events, reference, router) =
        kill_mid_named_stream("/v1/responses", request, |e| e["type"] == "response.incomplete").await;
    let text: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .filter_map(|e| e["delta"].as_str())
        .collect();
    let whole = reference["output"][0]["content"][0]["text"].as_str().unwrap();
    assert_eq!(text, whole, "no token lost or repeated");
    let last = &events.last().unwrap()["response"];
    assert_eq!(last["usage"]["output_tokens"], reference["usage"]["output_tokens"]);
    let numbers: Vec<u64> = events.iter().map(|e| e["sequence_number"].as_u64().unwrap()).collect();
    assert!(numbers.iter().enumerate().all(|(i, &n)| n == i as u64), "one numbered stream across the move");
    // The stream's response was stored whole: what a continuation will read.
    let (status, stored) = router.get(&format!("/v1/responses/{}", last["id"].as_str().unwrap())).await;
    assert_eq!(status, 200);
    assert_eq!(stored["output"][0]["content"][0]["text"], whole);
}

/// Run `request` undisturbed, then streamed while its worker fails mid-way: the client must see
/// one stream with exactly the undisturbed text.
async fn migrate_mid_stream(request: serde_json::Value, fault: Fault) -> Migrated {
    let (mut workers, router) = slow_pair().await;

    // What an undisturbed run produces (the simulated model is deterministic).
    let (status, _, reference) = router.post("/v1/completions", &request).await;
    assert_eq!(status, 200, "{reference}");
    let reference_tokens = reference["usage"]["completion_tokens"].clone();
    let reference = reference["choices"][0]["text"].as_str().unwrap().to_string();

    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let response = reqwest::Client::new().post(router.url("/v1/completions")).json(&streamed).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.bytes_stream();
    let (mut buf, mut events) = (String::new(), Vec::new());
    read_until(&mut body, &mut buf, &mut events, |e| e.len() >= 5).await;

    let (serving, faulted) = fault_the_serving_worker(&mut workers, fault).await;

    read_until(&mut body, &mut buf, &mut events, |e| e.last().is_some_and(|l| l.1 == "[DONE]")).await;
    let after: Vec<Instant> = events.iter().map(|e| e.0).filter(|&t| t > faulted).collect();
    let stall = [faulted].iter().chain(&after).zip(&after).map(|(a, b)| *b - *a).max().unwrap_or_default();
    let events: Vec<Value> = events.into_iter().map(|e| e.1).collect();
    let id = events[0]["id"].clone();
    let chunks = &events[..events.len() - 1];
    assert!(chunks.iter().all(|c| c["id"] == id), "one id for the whole stream");
    let text: String = chunks.iter().filter_map(|c| c["choices"].get(0)?["text"].as_str()).collect();
    assert_eq!(text, reference, "no token lost or repeated across the migration");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], reference_tokens);
    assert_eq!(usage["prompt_tokens"], 3);
    assert_eq!(router.metric("bellows_router_migrations_total").await, 1.0);
    Migrated { text, chunks: chunks.to_vec(), stall, workers, serving, router }
}

#[tokio::test]
async fn a_dead_worker_leaves_placement_and_the_rest_serve() {
    let mut a = Worker::start(&sim("{}")).await;
    let b = Worker::start(&sim("{}")).await;
    let router = Router::with_workers(&[&a, &b], &["--policy", "round_robin"]).await;
    a.kill();
    eventually("the router to notice", Duration::from_secs(5), || async {
        (router.metric("bellows_router_placeable_workers").await == 1.0).then_some(())
    })
    .await;
    for _ in 0..4 {
        let (status, _, body) =
            router.post("/v1/completions", &json!({"model": "sim", "prompt": "x", "max_tokens": 2})).await;
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(
        router.metric("bellows_router_retries_total").await,
        0.0,
        "no request was even tried on the dead worker"
    );
}
