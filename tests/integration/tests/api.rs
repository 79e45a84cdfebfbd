//! The OpenAI API over real HTTP, in front of real (simulated-engine) workers: shapes, streaming,
//! usage, and one status with an OpenAI error body for every kind of bad request.

use std::time::Duration;

use bellows_integration::{Router, Worker, eventually, sim, sse};
use serde_json::{Value, json};

async fn cluster() -> (Vec<Worker>, Router) {
    let a = Worker::start(&sim("{}")).await;
    let b = Worker::start(&sim("{}")).await;
    let router = Router::with_workers(&[&a, &b], &["--max-body-bytes", "65536"]).await;
    (vec![a, b], router)
}

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({"model": "sim", "messages": [{"role": "user", "content": content}], "max_tokens": 8});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

#[tokio::test]
async fn models_health_and_ready_reflect_the_workers() {
    let (_workers, router) = cluster().await;
    let (status, models) = router.get("/v1/models").await;
    assert_eq!(status, 200);
    assert_eq!(models["object"], "list");
    let ids: Vec<&str> = models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["sim"]);
    assert_eq!(models["data"][0]["max_model_len"], 8192);
    assert_eq!(router.get("/health").await.0, 200);
    assert_eq!(router.get("/ready").await.0, 200);
    let (status, _) = router.get("/metrics").await;
    assert_eq!(status, 200);
    assert_eq!(router.metric("bellows_router_placeable_workers").await, 2.0);
}

#[tokio::test]
async fn a_router_without_reachable_workers_is_live_but_not_ready() {
    let router = Router::start(&["--workers", "127.0.0.1:1"]).await;
    assert_eq!(router.get("/health").await.0, 200);
    let (status, body) = router.get("/ready").await;
    assert_eq!(status, 503, "{body}");
    let (status, _, body) = router.post("/v1/chat/completions", &chat("hi", json!({}))).await;
    assert_eq!(status, 404, "no worker serves any model yet: {body}");
}

#[tokio::test]
async fn chat_and_text_completions_have_openais_shape_and_usage() {
    let (_workers, router) = cluster().await;
    let (status, _, body) = router.post("/v1/chat/completions", &chat("hello there", json!({}))).await;
    assert_eq!(status, 200, "{body}");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "sim");
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    // Sim token i reads " t{i}": 8 tokens, 8 words.
    assert_eq!(choice["message"]["content"].as_str().unwrap().split_whitespace().count(), 8);
    let usage = &body["usage"];
    assert_eq!(usage["completion_tokens"], 8);
    assert_eq!(usage["total_tokens"], usage["prompt_tokens"].as_u64().unwrap() + 8);
    assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64());

    let (status, _, body) =
        router.post("/v1/completions", &json!({"model": "sim", "prompt": [5, 6, 7], "max_tokens": 3})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["usage"]["prompt_tokens"], 3);
    assert_eq!(body["choices"][0]["text"].as_str().unwrap().split_whitespace().count(), 3);
}

#[tokio::test]
async fn a_stream_ends_with_done_and_carries_usage_when_asked() {
    let (_workers, router) = cluster().await;
    let body = chat("stream me", json!({"stream": true, "stream_options": {"include_usage": true}}));
    let response = reqwest::Client::new().post(router.url("/v1/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let events = sse(response).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks = &events[..events.len() - 1];
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(chunks.iter().all(|c| c["id"] == id && c["object"] == "chat.completion.chunk"), "one id throughout");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant", "the first chunk opens the assistant turn");
    let text: String =
        chunks.iter().filter_map(|c| c["choices"].get(0)?["delta"]["content"].as_str()).collect::<String>();
    assert_eq!(text.split_whitespace().count(), 8);
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]), "the usage chunk has no choices");
    assert_eq!(usage["usage"]["completion_tokens"], 8);

    // Without include_usage, no usage chunk.
    let response = reqwest::Client::new()
        .post(router.url("/v1/completions"))
        .json(&json!({"model": "sim", "prompt": "x y", "max_tokens": 2, "stream": true}))
        .send()
        .await
        .unwrap();
    let events = sse(response).await;
    assert!(events.iter().all(|e| e.get("usage").is_none()));
    assert_eq!(events.last().unwrap(), "[DONE]");
}

#[tokio::test]
async fn n_choices_differ_and_a_seed_repeats_them() {
    let (_workers, router) = cluster().await;
    // The simulated model is deterministic in (previous token, position); sampling at
    // temperature 1 with a seed makes the choices differ from each other and repeat per seed.
    let body = chat("pick", json!({"n": 3, "seed": 42, "temperature": 1.0, "logit_bias": {"5": 30, "6": 30, "7": 30}}));
    let (status, _, first) = router.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{first}");
    let texts = |v: &Value| -> Vec<String> {
        v["choices"].as_array().unwrap().iter().map(|c| c["message"]["content"].as_str().unwrap().to_string()).collect()
    };
    let a = texts(&first);
    assert_eq!(a.len(), 3);
    assert_eq!(first["choices"][2]["index"], 2);
    assert!(a[0] != a[1] || a[1] != a[2], "choices of one request differ: {a:?}");
    let (_, _, second) = router.post("/v1/chat/completions", &body).await;
    assert_eq!(texts(&second), a, "the same seed gives the same choices");
    assert_eq!(first["usage"]["completion_tokens"], 24);
    assert_eq!(
        first["usage"]["prompt_tokens"], second["usage"]["prompt_tokens"],
        "the prompt is counted once, not per choice"
    );
}

#[tokio::test]
async fn a_repeated_prompt_reports_cached_tokens() {
    let (_workers, router) = cluster().await;
    let prompt: Vec<u32> = (1..=100).collect();
    let body = json!({"model": "sim", "prompt": prompt, "max_tokens": 2});
    let (_, _, first) = router.post("/v1/completions", &body).await;
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // The placement memory sends the repeat to the worker that holds the blocks, once the router
    // knows them and the workers' reports no longer count the first request (a holder whose
    // queue looks longer than the prefill the cache saves is passed over).
    eventually("the blocks known, the first request gone from the reports", Duration::from_secs(10), || async {
        let known = router.metric("bellows_router_prefix_index_entries").await >= 6.0;
        let waiting = router.metric("bellows_router_cluster_waiting_tokens").await;
        let running = router.metric("bellows_router_cluster_running_requests").await;
        (known && waiting == 0.0 && running == 0.0).then_some(())
    })
    .await;
    let (_, _, second) = router.post("/v1/completions", &body).await;
    assert_eq!(second["usage"]["prompt_tokens_details"]["cached_tokens"], 96, "six full 16-token blocks");
}

#[tokio::test]
async fn every_bad_request_gets_its_status_and_an_openai_error_body() {
    let (_workers, router) = cluster().await;
    let raw = |body: &'static str| {
        let url = router.url("/v1/chat/completions");
        async move {
            let r = reqwest::Client::new()
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let check = |status: u16, body: &Value, want: u16, param: Option<&str>| {
        assert_eq!(status, want, "{body}");
        let e = &body["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
        assert!(e["type"].is_string() && e.get("code").is_some(), "{body}");
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{body}");
        }
    };

    let (s, b) = raw(r#"{"model": "sim", "messages": [{"role": "user""#).await;
    check(s, &b, 400, None);
    let (s, b) = raw(r#"{"model": "sim", "messages": [{"role": "user", "content": "x"}], "n": "two"}"#).await;
    check(s, &b, 400, Some("n"));
    let (s, _, b) = router.post("/v1/chat/completions", &chat("x", json!({"temperature": 3}))).await;
    check(s, &b, 400, Some("temperature"));
    let (s, _, b) = router.post("/v1/chat/completions", &chat("x", json!({"logit_bias": {"999999": 1}}))).await;
    check(s, &b, 400, Some("logit_bias"));
    let (s, _, b) = router.post("/v1/chat/completions", &json!({"model": "nope", "messages": []})).await;
    check(s, &b, 400, Some("messages"));
    let (s, _, b) = router
        .post("/v1/chat/completions", &json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}))
        .await;
    check(s, &b, 404, Some("model"));
    assert_eq!(b["error"]["code"], "model_not_found");
    let (s, _, b) = router.post("/v1/completions", &json!({"model": "sim", "prompt": "x ".repeat(40_000)})).await;
    check(s, &b, 413, None);
    let long: Vec<u32> = vec![3; 8000];
    let (s, _, b) = router.post("/v1/completions", &json!({"model": "sim", "prompt": long, "max_tokens": 500})).await;
    check(s, &b, 400, Some("prompt"));
    let message = b["error"]["message"].as_str().unwrap();
    assert!(message.contains("8192") && message.contains("8500"), "names the context and the request: {message}");
    assert_eq!(b["error"]["code"], "context_length_exceeded");
    let (s, _, b) = router.post("/v1/chat/completions", &chat(&"x ".repeat(8200), json!({"max_tokens": 500}))).await;
    check(s, &b, 400, Some("messages"));
    assert_eq!(b["error"]["code"], "context_length_exceeded");
    let (s, _, b) = router.post("/v1/embeddings", &json!({})).await;
    check(s, &b, 404, None);

    // None of it cost anything: a good request still works.
    let (s, _, b) = router.post("/v1/chat/completions", &chat("fine", json!({}))).await;
    assert_eq!(s, 200, "{b}");
}

#[tokio::test]
async fn a_client_that_disconnects_cancels_its_worker_request() {
    // One slow worker: 50 ms per step, so a 1000-token request would run for a minute.
    let worker = Worker::start(&sim(r#"{"base_us": 50000}"#)).await;
    let router = Router::with_workers(&[&worker], &[] as &[&str]).await;
    let body = json!({"model": "sim", "prompt": "a b c", "max_tokens": 1000, "stream": true});
    let response = reqwest::Client::new().post(router.url("/v1/completions")).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    eventually("the request to run on the worker", Duration::from_secs(10), || async {
        (worker.load().await.running_requests == 1).then_some(())
    })
    .await;
    drop(response);
    eventually("the worker to cancel it", Duration::from_secs(5), || async {
        (worker.load().await.running_requests == 0).then_some(())
    })
    .await;
}
