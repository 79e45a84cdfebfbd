//! Thinking kept apart from the answer in every protocol, on a model whose template thinks:
//! DeepSeek-R1-Distill-Qwen's own vocabulary and chat template (scripts/fetch-model.sh
//! qwen-vocab) on small random weights made by `bellows-worker synth-model`. Its text is noise,
//! but its think tags are the real model's tokens and its template is the real one, which never
//! opens `<think>`: the model always thinks first, so its answer starts inside thinking.

use std::{path::PathBuf, process::Command};

use bellows_integration::{ANTHROPIC, OPENAI, Router, Worker, binary, sse, sse_named};
use serde_json::{Value, json};
use tempfile::TempDir;

struct Thinker {
    router: Router,
    _worker: Worker,
    _dir: TempDir,
}

/// A worker on an R1-shaped model (two layers: its text is noise, its vocabulary real) and a
/// router in front of it.
async fn thinker() -> Thinker {
    let home = std::env::var("HOME").unwrap();
    let models = std::env::var("BELLOWS_MODEL_DIR").unwrap_or_else(|_| format!("{home}/.cache/bellows/models"));
    let like = PathBuf::from(models).join("DeepSeek-R1-Distill-Qwen-7B-Q4_K_M.head.gguf");
    assert!(like.exists(), "{} is missing: run scripts/fetch-model.sh qwen-vocab", like.display());
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("r1-shaped.gguf");
    let shape = ["--layers", "2", "--hidden", "64", "--ffn", "128", "--heads", "2", "--kv-heads", "1"];
    let made = Command::new(binary("bellows-worker"))
        .args(["synth-model", "--arch", "qwen2", "--context", "2048", "--like"])
        .arg(&like)
        .arg("--out")
        .arg(&model)
        .args(shape)
        .output()
        .unwrap();
    assert!(made.status.success(), "synth-model failed: {}", String::from_utf8_lossy(&made.stderr));
    let model = model.to_str().unwrap();
    let worker = Worker::start(&["--engine", "gguf", "--model", model, "--model-id", "r1"]).await;
    let router = Router::with_workers(&[&worker], &[] as &[&str]).await;
    Thinker { router, _worker: worker, _dir: dir }
}

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "model": "r1",
        "messages": [{"role": "user", "content": "Is 7 prime?"}],
        "max_tokens": 60,
        "temperature": 0,
    });
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// A streamed chat answer's thinking and text, joined from its deltas.
async fn streamed_chat(router: &Router, body: &Value) -> (String, String, Vec<Value>) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let response = reqwest::Client::new().post(router.url("/v1/chat/completions")).json(&body).send().await.unwrap();
    let chunks = sse(response).await;
    let (mut reasoning, mut content) = (String::new(), String::new());
    for delta in chunks.iter().filter_map(|c| c.get("choices")?.get(0)).map(|c| &c["delta"]) {
        reasoning += delta["reasoning_content"].as_str().unwrap_or("");
        content += delta["content"].as_str().unwrap_or("");
    }
    (reasoning, content, chunks)
}

fn matches(pattern: &str, text: &str) -> bool {
    regex::Regex::new(pattern).unwrap().is_match(text)
}

#[tokio::test]
async fn thinking_and_answer_part_at_the_close_tag_whole_and_streamed_and_no_tag_reaches_the_client() {
    let t = thinker().await;
    // The client's grammar (which covers the whole output, thinking included) makes the noise
    // think four words, close, and answer three: the split is then known without the words.
    let body = chat(
        json!({"guided_grammar": r"start: /[a-z]{2,6}( [a-z]{2,6}){3}\n<\/think>\n\n[A-Z][a-z]{2,6}( [a-z]{2,6}){2}\./"}),
    );
    let (status, _, whole) = t.router.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{whole}");
    let message = &whole["choices"][0]["message"];
    let (reasoning, content) = (message["reasoning_content"].as_str().unwrap(), message["content"].as_str().unwrap());
    assert!(matches(r"^[a-z]{2,6}( [a-z]{2,6}){3}\n$", reasoning), "thinking: {reasoning:?}");
    assert!(matches(r"^[A-Z][a-z]{2,6}( [a-z]{2,6}){2}\.$", content), "answer: {content:?}");
    let usage = &whole["usage"];
    let thought = usage["completion_tokens_details"]["reasoning_tokens"].as_u64().unwrap();
    assert!(thought > 0 && thought < usage["completion_tokens"].as_u64().unwrap(), "{usage}");

    let (streamed_reasoning, streamed_content, chunks) = streamed_chat(&t.router, &body).await;
    assert_eq!((streamed_reasoning.as_str(), streamed_content.as_str()), (reasoning, content));
    let last = chunks.iter().rev().find(|c| c.get("usage").is_some_and(|u| !u.is_null())).unwrap();
    assert_eq!(last["usage"]["completion_tokens_details"]["reasoning_tokens"], json!(thought));
    assert!(chunks.iter().all(|c| !c.to_string().contains("think>")), "a tag reached the client");
}

#[tokio::test]
async fn an_answer_cut_off_while_thinking_is_the_same_thinking_in_every_protocol_whole_and_streamed() {
    let t = thinker().await;
    let (_, _, chat_whole) = t.router.post("/v1/chat/completions", &chat(json!({"max_tokens": 12}))).await;
    let thinking = chat_whole["choices"][0]["message"]["reasoning_content"].as_str().unwrap().to_string();
    assert!(!thinking.is_empty(), "{chat_whole}");
    assert_eq!(chat_whole["choices"][0]["message"]["content"], "", "nothing was answered yet");
    assert_eq!(chat_whole["usage"]["completion_tokens_details"]["reasoning_tokens"], 12);

    let responses = json!({"model": "r1", "input": "Is 7 prime?", "max_output_tokens": 12, "temperature": 0});
    let (status, _, whole) = t.router.post("/v1/responses", &responses).await;
    assert_eq!((status, whole["status"].as_str()), (200, Some("incomplete")), "{whole}");
    let output = whole["output"].as_array().unwrap();
    assert_eq!(output.len(), 1, "only the reasoning item: {whole}");
    assert_eq!(
        (output[0]["type"].as_str(), output[0]["content"][0]["text"].as_str()),
        (Some("reasoning"), Some(&*thinking))
    );
    assert_eq!(whole["usage"]["output_tokens_details"]["reasoning_tokens"], 12);
    let mut streamed = responses.clone();
    streamed["stream"] = json!(true);
    let response = reqwest::Client::new().post(t.router.url("/v1/responses")).json(&streamed).send().await.unwrap();
    let events = sse_named(response).await;
    let deltas: String = events
        .iter()
        .filter(|(name, _)| name == "response.reasoning_text.delta")
        .map(|(_, e)| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, thinking);
    let (_, done) = events.last().unwrap();
    assert_eq!(done["response"]["output"][0]["content"][0]["text"], json!(thinking), "the final response carries it");

    let messages = json!({"model": "r1", "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "Is 7 prime?"}]});
    let (status, _, whole) = t.router.post("/v1/messages", &messages).await;
    assert_eq!((status, whole["stop_reason"].as_str()), (200, Some("max_tokens")), "{whole}");
    assert_eq!(whole["content"], json!([{"type": "thinking", "thinking": thinking, "signature": ""}]));
    let mut streamed = messages.clone();
    streamed["stream"] = json!(true);
    let response = reqwest::Client::new().post(t.router.url("/v1/messages")).json(&streamed).send().await.unwrap();
    let events = sse_named(response).await;
    let deltas: String = events.iter().filter_map(|(_, e)| e["delta"]["thinking"].as_str()).collect();
    assert_eq!(deltas, thinking);
    let starts: Vec<&Value> =
        events.iter().filter(|(n, _)| n == "content_block_start").map(|(_, e)| &e["content_block"]["type"]).collect();
    assert_eq!(starts, [&json!("thinking")]);
}

#[tokio::test]
async fn the_official_clients_read_thinking_apart_from_the_answer() {
    let t = thinker().await;
    t.router.run_official_client("reasoning_clients.py", "r1", &[OPENAI, ANTHROPIC]);
}

#[tokio::test]
async fn a_constrained_answer_follows_the_thinking_instead_of_replacing_it() {
    let t = thinker().await;
    let (_, _, ids) =
        t.router.post("/v1/tokenize", &json!({"model": "r1", "prompt": "</think>", "add_special_tokens": false})).await;
    assert_eq!(ids["tokens"].as_array().map(Vec::len), Some(1), "the close tag is one token: {ids}");
    let close = ids["tokens"][0].to_string();
    // The noise would think to max_tokens: a bias on the close tag ends its thinking at once,
    // and the schema then holds the answer (without the thinking before it, the grammar would
    // force JSON from the first token, which would all read as thinking).
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": false});
    let format = json!({"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": true}});
    let body = chat(json!({"max_tokens": 40, "logit_bias": {close: 100}, "response_format": format}));
    let (status, _, whole) = t.router.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{whole}");
    let content = whole["choices"][0]["message"]["content"].as_str().unwrap();
    let answer: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {whole}"));
    assert!(answer["n"].is_i64(), "{answer}");
    assert_eq!(whole["choices"][0]["finish_reason"], "stop", "{whole}");
}
