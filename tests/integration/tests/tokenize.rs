//! `/v1/tokenize` and `/v1/detokenize` over simulated workers: what they count is what a
//! generation is charged, ids come back as the text they were made from, bad bodies are 400s
//! naming the field, and no worker is used. (The real model's tokenizer: `real_model.rs`.)

use bellows_integration::{Router, Worker, sim};
use serde_json::{Value, json};

async fn cluster() -> (Worker, Router) {
    let w = Worker::start(&sim("{}")).await;
    let router = Router::with_workers(&[&w], &[] as &[&str]).await;
    (w, router)
}

#[tokio::test]
async fn tokenize_counts_what_a_generation_is_charged_and_detokenize_gives_the_text_back() {
    let (_w, router) = cluster().await;
    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]);
    for path in ["/v1/tokenize", "/tokenize"] {
        let (status, _, chat) = router.post(path, &json!({"model": "sim", "messages": messages})).await;
        assert_eq!(status, 200, "{chat}");
        let (_, _, answer) =
            router.post("/v1/chat/completions", &json!({"model": "sim", "messages": messages, "max_tokens": 1})).await;
        assert_eq!(chat["count"], answer["usage"]["prompt_tokens"], "{path}: the count a chat request is charged");
        assert_eq!(chat["count"], chat["tokens"].as_array().unwrap().len());
        assert_eq!(chat["token_strs"], Value::Null, "only when asked");
        let (_, _, models) = router.post("/v1/tokenize", &json!({"prompt": "x"})).await;
        assert!(models["max_model_len"].as_u64().unwrap() > 0, "{models}");
    }

    let body = json!({"model": "sim", "prompt": "the river t17 runs", "return_token_strs": true});
    let (status, _, text) = router.post("/v1/tokenize", &body).await;
    assert_eq!(status, 200, "{text}");
    let (_, _, completion) =
        router.post("/v1/completions", &json!({"model": "sim", "prompt": "the river t17 runs", "max_tokens": 1})).await;
    assert_eq!(text["count"], completion["usage"]["prompt_tokens"]);
    assert_eq!(text["tokens"][2], 17, "the simulated vocabulary spells t17 as token 17");
    assert_eq!(text["token_strs"].as_array().unwrap().len(), 4);

    for path in ["/v1/detokenize", "/detokenize"] {
        let (status, _, back) = router.post(path, &json!({"model": "sim", "tokens": text["tokens"]})).await;
        assert_eq!(status, 200, "{back}");
        let (_, _, again) = router.post("/v1/tokenize", &json!({"model": "sim", "prompt": back["prompt"]})).await;
        assert_eq!(again["tokens"], text["tokens"], "{path}: the text tokenizes back to the same ids");
    }
}

#[tokio::test]
async fn bad_tokenize_bodies_are_400s_naming_the_field_and_use_no_worker() {
    let (_w, router) = cluster().await;
    let cases = [
        ("/v1/tokenize", json!({"model": "sim"}), "prompt"),
        ("/v1/tokenize", json!({"model": "sim", "prompt": "x", "messages": []}), "prompt"),
        ("/v1/tokenize", json!({"model": "sim", "prompt": 5}), "prompt"),
        (
            "/v1/tokenize",
            json!({"model": "sim", "prompt": "x", "add_generation_prompt": true}),
            "add_generation_prompt",
        ),
        ("/v1/tokenize", json!({"model": "sim", "messages": []}), "messages"),
        ("/v1/tokenize", json!({"model": "sim", "messages": [{"role": "robot", "content": "x"}]}), "messages[0].role"),
        (
            "/v1/tokenize",
            json!({"model": "sim", "messages": [{"role": "user", "content": "x"}], "continue_final_message": true}),
            "continue_final_message",
        ),
        (
            "/v1/tokenize",
            json!({"model": "sim", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "retrieval"}]}),
            "tools[0].type",
        ),
        ("/v1/detokenize", json!({"model": "sim", "tokens": [1, -2]}), "tokens[1]"),
        ("/v1/detokenize", json!({"model": "sim", "tokens": [1, 1_000_000]}), "tokens[1]"),
        ("/v1/detokenize", json!({"model": "sim"}), "tokens"),
    ];
    for (path, body, param) in cases {
        let (status, _, reply) = router.post(path, &body).await;
        assert_eq!(status, 400, "{path} {body}: {reply}");
        assert_eq!(reply["error"]["param"], param, "{path} {body}: {reply}");
    }
    let (status, _, reply) = router.post("/v1/tokenize", &json!({"model": "nope", "prompt": "x"})).await;
    assert_eq!((status, &reply["error"]["code"]), (404, &json!("model_not_found")), "{reply}");
    assert_eq!(router.metric("bellows_router_placements_total").await, 0.0, "no worker was used");
}
