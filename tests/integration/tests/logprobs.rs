//! Logprobs through the whole cluster: chat's `logprobs`/`top_logprobs` and completions'
//! legacy `logprobs: k`, whole and streamed, over simulated workers.

use bellows_integration::{Router, Worker, sim, sse};
use serde_json::{Value, json};

async fn cluster() -> (Worker, Router) {
    let w = Worker::start(&sim(r#"{"base_us": 200}"#)).await;
    let router = Router::with_workers(&[&w], &[] as &[&str]).await;
    (w, router)
}

fn chat(extra: Value) -> Value {
    let mut body =
        json!({"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "temperature": 0});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

#[tokio::test]
async fn chat_logprobs_spell_the_answer_and_put_the_greedy_choice_first() {
    let (_w, router) = cluster().await;
    let (status, _, body) =
        router.post("/v1/chat/completions", &chat(json!({"logprobs": true, "top_logprobs": 3}))).await;
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    let content = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len() as u64, body["usage"]["completion_tokens"].as_u64().unwrap());
    let spelled: String = content.iter().map(|e| e["token"].as_str().unwrap()).collect();
    assert_eq!(spelled, choice["message"]["content"].as_str().unwrap());
    for e in content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["token"], e["token"], "greedy picks the most likely token: {e}");
        assert_eq!(top[0]["logprob"], e["logprob"]);
        let bytes: Vec<u8> = serde_json::from_value(e["bytes"].clone()).unwrap();
        assert_eq!(bytes, e["token"].as_str().unwrap().as_bytes());
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
    }

    // Streamed, the chunks' entries add up to the same list.
    let response = reqwest::Client::new()
        .post(router.url("/v1/chat/completions"))
        .json(&chat(json!({"logprobs": true, "top_logprobs": 3, "stream": true})))
        .send()
        .await
        .unwrap();
    let streamed: Vec<Value> = sse(response)
        .await
        .iter()
        .filter_map(|c| c.get("choices")?.get(0)?.get("logprobs")?.get("content")?.as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&streamed, content);

    // Without logprobs, none.
    let (_, _, plain) = router.post("/v1/chat/completions", &chat(json!({}))).await;
    assert_eq!(plain["choices"][0]["logprobs"], Value::Null);
    assert_eq!(plain["choices"][0]["message"], choice["message"], "asking for logprobs changes no token");
}

#[tokio::test]
async fn completion_logprobs_have_the_legacy_shape_with_running_text_offsets() {
    let (_w, router) = cluster().await;
    let body = json!({"model": "sim", "prompt": [3, 4], "max_tokens": 6, "temperature": 0, "logprobs": 2, "n": 2});
    let (status, _, whole) = router.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{whole}");
    for choice in whole["choices"].as_array().unwrap() {
        let lp = &choice["logprobs"];
        let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        assert_eq!(tokens.concat(), choice["text"].as_str().unwrap());
        let mut at = 0;
        for (t, off) in tokens.iter().zip(lp["text_offset"].as_array().unwrap()) {
            assert_eq!(off.as_u64().unwrap(), at);
            at += t.chars().count() as u64;
        }
        for (t, top) in tokens.iter().zip(lp["top_logprobs"].as_array().unwrap()) {
            assert_eq!(top.as_object().unwrap().len(), 2);
            assert!(top.get(*t).is_some(), "the chosen token is among the top 2: {top}");
        }
    }
    let mut streamed_body = body.clone();
    streamed_body["stream"] = json!(true);
    let response =
        reqwest::Client::new().post(router.url("/v1/completions")).json(&streamed_body).send().await.unwrap();
    let mut offsets = [Vec::new(), Vec::new()];
    for c in sse(response).await.iter().filter_map(|c| c.get("choices")?.get(0).cloned()) {
        if let Some(o) = c["logprobs"]["text_offset"].as_array() {
            offsets[c["index"].as_u64().unwrap() as usize].extend(o.iter().cloned());
        }
    }
    for (i, o) in offsets.iter().enumerate() {
        assert_eq!(o, whole["choices"][i]["logprobs"]["text_offset"].as_array().unwrap(), "choice {i}");
    }
}

#[tokio::test]
async fn out_of_range_or_orphan_logprob_parameters_are_400s_naming_them() {
    let (_w, router) = cluster().await;
    let cases = [
        ("/v1/chat/completions", chat(json!({"logprobs": true, "top_logprobs": 21})), "top_logprobs"),
        ("/v1/chat/completions", chat(json!({"logprobs": true, "top_logprobs": -1})), "top_logprobs"),
        ("/v1/chat/completions", chat(json!({"top_logprobs": 2})), "top_logprobs"),
        ("/v1/chat/completions", chat(json!({"logprobs": 3})), "logprobs"),
        ("/v1/completions", json!({"model": "sim", "prompt": "x", "logprobs": 21}), "logprobs"),
        ("/v1/completions", json!({"model": "sim", "prompt": "x", "logprobs": true}), "logprobs"),
    ];
    for (path, body, param) in cases {
        let (status, _, reply) = router.post(path, &body).await;
        assert_eq!(status, 400, "{body}: {reply}");
        assert_eq!(reply["error"]["param"], param, "{body}: {reply}");
    }
    assert_eq!(router.metric("bellows_router_placements_total").await, 0.0, "no worker was used");
}
