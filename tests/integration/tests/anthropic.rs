//! Anthropic's Messages API through the whole cluster, over simulated workers: a message is the
//! chat pipeline's answer in Anthropic's shape, whole or as the named-event stream its SDK
//! accumulates; tools come back as `tool_use` blocks whose input fits the schema; bad bodies are
//! Anthropic-shaped errors naming the field and cost no worker time; `x-api-key` authenticates;
//! `count_tokens` counts what a message is charged.

use bellows_integration::{Router, Worker, schemas, sim, sse_named};
use serde_json::{Value, json};

async fn cluster(extra: &[&str]) -> (Worker, Router) {
    let w = Worker::start(&sim(r#"{"base_us": 200}"#)).await;
    let router = Router::with_workers(&[&w], extra).await;
    (w, router)
}

/// Long enough (in the simulated vocabulary's words) to fill a KV block, so a second ask reads
/// the cache.
const SYSTEM: &str = "You are terse. Answer every question in one short sentence, name your sources when you \
                      have any, and never write more than the question needs or repeat the question back.";

fn weather_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": false,
    })
}

fn tools() -> Value {
    json!([{"name": "get_weather", "description": "Weather in a city", "input_schema": weather_schema()}])
}

fn message_body(extra: Value) -> Value {
    let mut body = json!({
        "model": "sim",
        "system": SYSTEM,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "max_tokens": 12,
        "temperature": 0,
    });
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// The whole prompt a message was charged for: Anthropic counts cache reads apart.
fn prompt_size(usage: &Value) -> u64 {
    usage["input_tokens"].as_u64().unwrap() + usage["cache_read_input_tokens"].as_u64().unwrap()
}

async fn post(router: &Router, path: &str, key: Option<&str>, body: &Value) -> (u16, Value) {
    let mut r = reqwest::Client::new().post(router.url(path)).json(body);
    if let Some(k) = key {
        r = r.header("x-api-key", k);
    }
    let r = r.send().await.expect("the router answers");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn stream(router: &Router, body: &Value) -> Vec<(String, Value)> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = reqwest::Client::new().post(router.url("/v1/messages")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    sse_named(r).await
}

/// A message's tool_use blocks: name and input, each input checked against the schema.
fn checked_tool_uses(content: &Value) -> Vec<(String, Value)> {
    content
        .as_array()
        .expect("content blocks")
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .map(|b| {
            assert!(b["id"].as_str().is_some_and(|id| id.starts_with("toolu_")), "{b}");
            assert_eq!(b["name"], "get_weather");
            schemas::check_output(&weather_schema(), &b["input"].to_string()).unwrap_or_else(|e| panic!("{e}"));
            (b["name"].as_str().unwrap().to_string(), b["input"].clone())
        })
        .collect()
}

#[tokio::test]
async fn a_message_is_the_equivalent_chat_completions_answer_in_anthropics_shape() {
    let (_w, router) = cluster(&[]).await;
    let chat = json!({
        "model": "sim",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is the weather in Paris?"},
        ],
        "max_tokens": 12,
        "temperature": 0,
    });
    let (status, _, chat) = router.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{chat}");
    let (status, message) = post(&router, "/v1/messages", None, &message_body(json!({}))).await;
    assert_eq!(status, 200, "{message}");

    assert!(message["id"].as_str().is_some_and(|id| id.starts_with("msg_")), "{message}");
    assert_eq!(
        (&message["type"], &message["role"], &message["model"]),
        (&json!("message"), &json!("assistant"), &json!("sim"))
    );
    let content = message["content"].as_array().unwrap();
    assert_eq!(content.len(), 1, "{message}");
    assert_eq!(content[0]["type"], "text");
    assert_eq!(content[0]["text"], chat["choices"][0]["message"]["content"], "the same prompt, greedy: the same text");
    assert_eq!(message["stop_reason"], "max_tokens");
    assert_eq!(message["stop_sequence"], Value::Null);
    let usage = &message["usage"];
    assert_eq!(usage["output_tokens"], 12);
    assert_eq!(prompt_size(usage), chat["usage"]["prompt_tokens"].as_u64().unwrap());
    assert!(usage["cache_read_input_tokens"].as_u64().unwrap() > 0, "the second ask of one prompt reads the cache");
}

#[tokio::test]
async fn the_event_stream_names_each_event_by_its_type_and_adds_up_to_the_whole_message() {
    let (_w, router) = cluster(&[]).await;
    let body = message_body(json!({}));
    let (_, whole) = post(&router, "/v1/messages", None, &body).await;
    let events = stream(&router, &body).await;

    for (name, data) in &events {
        assert_eq!(data["type"], json!(name), "the event line names the data's type");
    }
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[..3], ["message_start", "ping", "content_block_start"], "{names:?}");
    assert_eq!(names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"], "{names:?}");
    assert!(names[3..names.len() - 3].iter().all(|n| *n == "content_block_delta"), "{names:?}");

    let start = &events[0].1["message"];
    assert!(start["id"].as_str().is_some_and(|id| id.starts_with("msg_")));
    assert_eq!((&start["content"], &start["stop_reason"]), (&json!([]), &Value::Null));
    assert!(start["usage"]["input_tokens"].as_u64().unwrap() > 0, "message_start carries the prompt's size");
    assert_eq!(events[2].1["content_block"], json!({"type": "text", "text": ""}));

    let text: String = events
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| {
            assert_eq!((&d["index"], &d["delta"]["type"]), (&json!(0), &json!("text_delta")));
            d["delta"]["text"].as_str().unwrap()
        })
        .collect();
    assert_eq!(text, whole["content"][0]["text"].as_str().unwrap());
    let delta = &events[events.len() - 2].1;
    assert_eq!(delta["delta"], json!({"stop_reason": "max_tokens", "stop_sequence": null}));
    assert_eq!(delta["usage"]["output_tokens"], 12);
}

#[tokio::test]
async fn a_stop_sequence_that_ends_the_answer_is_named_whole_and_streamed() {
    let (_w, router) = cluster(&[]).await;
    let (_, free) = post(&router, "/v1/messages", None, &message_body(json!({}))).await;
    let text = free["content"][0]["text"].as_str().unwrap();
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let before = &text[..text.find(&stop).unwrap()];
    let body = message_body(json!({"stop_sequences": ["never in the answer", stop]}));

    let (status, whole) = post(&router, "/v1/messages", None, &body).await;
    assert_eq!(status, 200, "{whole}");
    assert_eq!((&whole["stop_reason"], &whole["stop_sequence"]), (&json!("stop_sequence"), &json!(stop)), "{whole}");
    assert_eq!(whole["content"][0]["text"], before, "the text ends before the stop string");
    let events = stream(&router, &body).await;
    let delta = events.iter().find(|(n, _)| n == "message_delta").expect("message_delta");
    assert_eq!(delta.1["delta"], json!({"stop_reason": "stop_sequence", "stop_sequence": stop}));
    let streamed: String = events.iter().filter_map(|(_, d)| d["delta"]["text"].as_str()).collect();
    assert_eq!(streamed, before);
    assert_eq!(free["stop_sequence"], Value::Null, "no stop string, none named");
}

#[tokio::test]
async fn tool_choice_any_gives_tool_use_blocks_that_fit_the_schema_whole_and_streamed() {
    let (_w, router) = cluster(&[]).await;
    let body = message_body(json!({
        "max_tokens": 200,
        "tools": tools(),
        "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
    }));
    let (status, whole) = post(&router, "/v1/messages", None, &body).await;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["stop_reason"], "tool_use", "{whole}");
    let want = checked_tool_uses(&whole["content"]);
    assert_eq!(want.len(), 1, "disable_parallel_tool_use: one call");

    let events = stream(&router, &body).await;
    let mut streamed = Vec::new();
    for (name, data) in &events {
        match name.as_str() {
            "content_block_start" if data["content_block"]["type"] == "tool_use" => {
                let b = &data["content_block"];
                assert_eq!(b["input"], json!({}), "input arrives in deltas");
                streamed.push(json!({"type": "tool_use", "id": b["id"], "name": b["name"], "json": ""}));
            }
            "content_block_delta" if data["delta"]["type"] == "input_json_delta" => {
                let last = streamed.last_mut().expect("a delta inside a started tool_use block");
                let json = last["json"].as_str().unwrap().to_string() + data["delta"]["partial_json"].as_str().unwrap();
                last["json"] = json!(json);
            }
            _ => {}
        }
    }
    for b in &mut streamed {
        b["input"] = serde_json::from_str(b["json"].as_str().unwrap()).expect("the input's fragments are JSON");
    }
    assert_eq!(checked_tool_uses(&Value::Array(streamed)), want);
    let delta = events.iter().find(|(n, _)| n == "message_delta").expect("message_delta");
    assert_eq!(delta.1["delta"]["stop_reason"], "tool_use");
}

#[tokio::test]
async fn a_tool_result_answers_its_tool_use_and_the_conversation_goes_on() {
    let (_w, router) = cluster(&[]).await;
    let ask = message_body(json!({"max_tokens": 200, "tools": tools(), "tool_choice": {"type": "any"}}));
    let (_, first) = post(&router, "/v1/messages", None, &ask).await;
    let call = first["content"].as_array().unwrap().iter().find(|b| b["type"] == "tool_use").unwrap().clone();
    let mut next = message_body(json!({"max_tokens": 8, "tools": tools()}));
    next["messages"] = json!([
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call["id"], "content": [{"type": "text", "text": "21 C"}]},
            {"type": "text", "text": "Thanks."},
        ]},
    ]);
    let (status, answer) = post(&router, "/v1/messages", None, &next).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["stop_reason"], "max_tokens");
    assert_eq!(answer["content"][0]["type"], "text");
    assert!(prompt_size(&answer["usage"]) > prompt_size(&first["usage"]), "the call and its result are in the prompt");
}

#[tokio::test]
async fn bad_messages_bodies_are_anthropic_errors_naming_the_field_and_use_no_worker() {
    let (_w, router) = cluster(&[]).await;
    let text = |t: &str| json!([{"role": "user", "content": t}]);
    let cases = [
        (json!({"max_tokens": null}), "max_tokens"),
        (json!({"max_tokens": "12"}), "max_tokens"),
        (json!({"temperature": 1.5}), "temperature"),
        (json!({"top_p": 2}), "top_p"),
        (json!({"messages": []}), "messages"),
        (json!({"messages": [{"role": "system", "content": "x"}]}), "messages[0].role"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}),
            "messages[0].content[0]",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure"}]}),
            "messages[1]",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]}),
            "messages[0].content[0].tool_use_id",
        ),
        (json!({"thinking": {"type": "enabled", "budget_tokens": 1024}}), "thinking"),
        (json!({"system": 5}), "system"),
        (json!({"stop_sequences": [""]}), "stop_sequences"),
        (json!({"tools": [{"name": "f", "input_schema": {"type": "strin"}}]}), "tools[0].input_schema"),
        (json!({"tools": [{"name": "has space", "input_schema": {"type": "object"}}]}), "tools[0].name"),
        (json!({"tools": tools(), "tool_choice": {"type": "tool"}}), "tool_choice.name"),
        (json!({"tools": tools(), "tool_choice": {"type": "tool", "name": "nope"}}), "tool_choice"),
        (json!({"service_tier": "priority"}), "service_tier"),
        (json!({"messages": text("x"), "max_tokens": 0}), "max_tokens"),
    ];
    for (extra, field) in cases {
        let (status, body) = post(&router, "/v1/messages", None, &message_body(extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {body}");
        assert_eq!(body["type"], "error", "{body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{extra}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().contains(field), "{extra} names {field}: {body}");
    }
    let (status, body) = post(&router, "/v1/messages", None, &message_body(json!({"model": "nope"}))).await;
    assert_eq!((status, &body["error"]["type"]), (404, &json!("not_found_error")), "{body}");
    let r = reqwest::Client::new().post(router.url("/v1/messages")).body("{\"model\": ").send().await.unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert_eq!(router.metric("bellows_router_placements_total").await, 0.0, "no worker was used");
}

#[tokio::test]
async fn a_key_in_x_api_key_authenticates_and_a_missing_one_is_an_authentication_error() {
    let dir = tempfile::TempDir::new().unwrap();
    let tenants = dir.path().join("tenants.yaml");
    // sha256("key-a")
    let key = "f10f781241e2246678b6b45c857069208152a53863e47fac33f607ab405006f4";
    std::fs::write(&tenants, format!("tenants:\n- name: team-a\n  key_sha256: [{key}]\n")).unwrap();
    let (_w, router) = cluster(&["--tenants-file", tenants.to_str().unwrap()]).await;
    for wrong in [None, Some("key-zzz")] {
        let (status, body) = post(&router, "/v1/messages", wrong, &message_body(json!({}))).await;
        assert_eq!(status, 401, "{body}");
        assert_eq!(body["error"]["type"], "authentication_error", "{body}");
        let (status, _) = post(&router, "/v1/messages/count_tokens", wrong, &message_body(json!({}))).await;
        assert_eq!(status, 401);
    }
    let (status, body) = post(&router, "/v1/messages", Some("key-a"), &message_body(json!({}))).await;
    assert_eq!(status, 200, "{body}");
    let chat = json!({"model": "sim", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2});
    let (status, body) = post(&router, "/v1/chat/completions", Some("key-a"), &chat).await;
    assert_eq!(status, 200, "x-api-key is taken on the OpenAI routes too: {body}");
}

#[tokio::test]
async fn count_tokens_is_the_prompt_a_message_is_charged_for() {
    let (_w, router) = cluster(&[]).await;
    let count = |body: Value| {
        let router = &router;
        async move {
            let mut body = body;
            body.as_object_mut().unwrap().remove("max_tokens");
            let (status, reply) = post(router, "/v1/messages/count_tokens", None, &body).await;
            assert_eq!(status, 200, "{reply}");
            reply["input_tokens"].as_u64().unwrap()
        }
    };
    for extra in [json!({}), json!({"tools": tools()})] {
        let body = message_body(extra);
        let (_, message) = post(&router, "/v1/messages", None, &body).await;
        assert_eq!(count(body).await, prompt_size(&message["usage"]));
    }
    let plain = count(message_body(json!({}))).await;
    assert!(count(message_body(json!({"tools": tools()}))).await > plain, "the tools are part of the prompt");
    let (status, body) =
        post(&router, "/v1/messages/count_tokens", None, &json!({"model": "sim", "messages": []})).await;
    assert_eq!((status, &body["error"]["type"]), (400, &json!("invalid_request_error")), "{body}");
    assert_eq!(router.metric("bellows_router_placements_total").await, 2.0, "counting places nothing");
}
