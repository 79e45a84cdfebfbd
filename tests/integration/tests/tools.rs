//! Tool calls through the whole cluster, over simulated workers: `tool_choice` `required` and
//! named are enforced by a grammar, so even the simulated model returns well-formed calls whose
//! arguments match the function's schema; calls come back whole and streamed (arguments in
//! fragments, in every protocol), with no markup in the content; bad tool input is a 400 that costs no worker time.

use bellows_integration::{Router, Worker, schemas, sim, sse, sse_named};
use serde_json::{Value, json};

async fn cluster() -> (Worker, Router) {
    let w = Worker::start(&sim(r#"{"base_us": 200}"#)).await;
    let router = Router::with_workers(&[&w], &[] as &[&str]).await;
    (w, router)
}

fn weather_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "unit"],
        "additionalProperties": false,
    })
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": weather_schema()}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": false}}},
    ])
}

fn request(extra: Value) -> Value {
    let mut body = json!({
        "model": "sim", "messages": [{"role": "user", "content": "weather in Paris?"}],
        "max_tokens": 300, "tools": tools(),
    });
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// Every call of a choice: its name and parsed arguments, checked against the declared schema.
fn checked_calls(calls: &Value) -> Vec<(String, Value)> {
    let tools = tools();
    calls
        .as_array()
        .expect("tool_calls")
        .iter()
        .map(|c| {
            assert_eq!(c["type"], "function");
            assert!(c["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{c}");
            let name = c["function"]["name"].as_str().unwrap().to_string();
            let args = c["function"]["arguments"].as_str().expect("arguments are JSON text");
            let schema =
                tools.as_array().unwrap().iter().find(|t| t["function"]["name"] == name).expect("a declared function")
                    ["function"]["parameters"]
                    .clone();
            schemas::check_output(&schema, args).unwrap_or_else(|e| panic!("{name}: {e}"));
            (name, serde_json::from_str(args).unwrap())
        })
        .collect()
}

#[tokio::test]
async fn required_and_named_tool_choices_always_return_well_formed_calls() {
    let (_w, router) = cluster().await;
    for seed in 0..6 {
        // One call per answer ends it; with parallel calls the simulated model may go on adding
        // calls until max_tokens (a real model stops): the complete ones still come back.
        let parallel = seed % 2 == 1;
        let body = request(
            json!({"tool_choice": "required", "n": 2, "seed": seed, "temperature": 1, "parallel_tool_calls": parallel}),
        );
        let (status, _, reply) = router.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{reply}");
        for choice in reply["choices"].as_array().unwrap() {
            let finish = choice["finish_reason"].as_str().unwrap();
            assert!(finish == "tool_calls" || (parallel && finish == "length"), "{choice}");
            assert_eq!(choice["message"]["content"], Value::Null, "{choice}");
            assert!(!checked_calls(&choice["message"]["tool_calls"]).is_empty());
        }
    }
    let named =
        json!({"tool_choice": {"type": "function", "function": {"name": "get_time"}}, "parallel_tool_calls": false});
    let (status, _, reply) = router.post("/v1/chat/completions", &request(named)).await;
    assert_eq!(status, 200, "{reply}");
    let calls = checked_calls(&reply["choices"][0]["message"]["tool_calls"]);
    assert_eq!(calls.len(), 1, "parallel_tool_calls: false");
    assert_eq!(calls[0].0, "get_time");
}

#[tokio::test]
async fn streamed_tool_call_deltas_reassemble_to_the_whole_answers_calls() {
    let (_w, router) = cluster().await;
    let body = request(json!({"tool_choice": "required", "temperature": 0, "parallel_tool_calls": false}));
    let (_, _, whole) = router.post("/v1/chat/completions", &body).await;
    let want: Vec<(String, Value)> = checked_calls(&whole["choices"][0]["message"]["tool_calls"]);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let response =
        reqwest::Client::new().post(router.url("/v1/chat/completions")).json(&streamed).send().await.unwrap();
    let (content, calls, finish, fragments) = join_chat_stream(&sse(response).await);
    assert_eq!(content, "", "no tool markup in the streamed content");
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    assert!(fragments > 1, "the arguments stream as they are generated, not in one piece");
    assert_eq!(checked_calls(&Value::Array(calls)), want);
}

/// A streamed chat answer joined as the `openai` SDK joins it: a tool-call delta with an id
/// opens the call at its index, later ones append to its arguments. The content, the calls, the
/// finish reason, and how many argument fragments came.
fn join_chat_stream(chunks: &[Value]) -> (String, Vec<Value>, Option<String>, usize) {
    let (mut content, mut calls, mut finish, mut fragments) = (String::new(), Vec::<Value>::new(), None, 0);
    for c in chunks.iter().filter_map(|c| c.get("choices")?.get(0)) {
        content += c["delta"]["content"].as_str().unwrap_or("");
        for t in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let index = t["index"].as_u64().unwrap() as usize;
            if t.get("id").is_some() {
                assert_eq!(index, calls.len(), "calls are numbered in order");
                calls.push(t.clone());
            } else {
                let args = t["function"]["arguments"].as_str().expect("a fragment of arguments");
                let call = &mut calls[index]["function"]["arguments"];
                *call = json!(format!("{}{args}", call.as_str().unwrap()));
                fragments += 1;
            }
        }
        finish = c["finish_reason"].as_str().map(str::to_string).or(finish);
    }
    (content, calls, finish, fragments)
}

#[tokio::test]
async fn a_tool_round_trip_ends_in_an_answer_and_auto_leaves_free_text_alone() {
    let (_w, router) = cluster().await;
    let (_, _, first) = router.post("/v1/chat/completions", &request(json!({"tool_choice": "required"}))).await;
    let message = first["choices"][0]["message"].clone();
    let call_id = message["tool_calls"][0]["id"].clone();
    let mut body = request(json!({"max_tokens": 8}));
    body["messages"] = json!([
        {"role": "user", "content": "weather in Paris?"},
        message,
        {"role": "tool", "tool_call_id": call_id, "content": "{\"temperature\": 21}"},
    ]);
    let (status, _, answer) = router.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    let choice = &answer["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert!(choice["message"]["content"].as_str().is_some_and(|c| c.starts_with(" t")), "{choice}");
    assert!(choice["message"].get("tool_calls").is_none(), "{choice}");
}

#[tokio::test]
async fn tool_markup_from_a_constraint_without_tools_stays_content() {
    let (_w, router) = cluster().await;
    let markup = r#"<tool_call>\n\{"name": "get_time", "arguments": \{\}\}\n</tool_call>"#;
    let body = json!({"model": "sim", "messages": [{"role": "user", "content": "x"}], "max_tokens": 80, "guided_regex": markup});
    let (status, _, reply) = router.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{reply}");
    let choice = &reply["choices"][0];
    assert_eq!(choice["finish_reason"], "stop");
    assert!(choice["message"]["content"].as_str().unwrap().starts_with("<tool_call>"), "{choice}");
    assert!(choice["message"].get("tool_calls").is_none(), "no tools, no tool calls: {choice}");
}

#[tokio::test]
async fn a_truncated_forced_call_leaks_no_markup() {
    let (_w, router) = cluster().await;
    let mut answers = Vec::new();
    for stream in [false, true] {
        let body = request(json!({"tool_choice": "required", "max_tokens": 12, "temperature": 0, "stream": stream}));
        let response =
            reqwest::Client::new().post(router.url("/v1/chat/completions")).json(&body).send().await.unwrap();
        let (content, finish, calls) = if stream {
            let (content, calls, finish, _) = join_chat_stream(&sse(response).await);
            (content, finish, calls)
        } else {
            let reply: Value = response.json().await.unwrap();
            let c = &reply["choices"][0];
            let content = c["message"]["content"].as_str().unwrap_or("").to_string();
            let calls = c["message"]["tool_calls"].as_array().cloned().unwrap_or_default();
            (content, c["finish_reason"].as_str().map(str::to_string), calls)
        };
        assert_eq!(finish.as_deref(), Some("length"), "stream={stream}");
        assert_eq!(content, "", "stream={stream}: no markup in the content");
        // A call whose arguments had begun streaming ends as far as it got (as OpenAI's does):
        // its arguments are a prefix of a valid object, never complete JSON.
        let args: Vec<String> =
            calls.iter().map(|c| c["function"]["arguments"].as_str().unwrap().to_string()).collect();
        answers.push(args.clone());
        for a in args {
            assert!(a.starts_with('{') && serde_json::from_str::<Value>(&a).is_err(), "stream={stream}: {a}");
        }
    }
    assert_eq!(answers[0], answers[1], "whole and streamed answers cut off alike");
}

#[tokio::test]
async fn bad_tool_input_is_a_400_naming_the_field_before_any_worker_is_used() {
    let (_w, router) = cluster().await;
    let mut bad_params = tools();
    bad_params[1]["function"]["parameters"] = json!({"type": "object", "properties": {"zone": {"type": "strin"}}});
    let mut dup = tools();
    dup[1]["function"]["name"] = json!("get_weather");
    let cases = [
        (json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}), "tool_choice"),
        (json!({"tool_choice": "sometimes"}), "tool_choice"),
        (json!({"tools": [{"type": "retrieval"}]}), "tools[0].type"),
        (json!({"tools": [{"type": "function", "function": {"name": "has space"}}]}), "tools[0].function.name"),
        (json!({"tools": dup}), "tools[1].function.name"),
        (json!({"tools": bad_params}), "tools[1].function.parameters"),
        (
            json!({"messages": [{"role": "tool", "tool_call_id": "call_x", "content": "42"}]}),
            "messages[0].tool_call_id",
        ),
        (json!({"messages": [{"role": "tool", "content": "42"}]}), "messages[0].tool_call_id"),
        (json!({"tool_choice": "required", "response_format": {"type": "json_object"}}), "response_format"),
    ];
    for (extra, param) in cases {
        let body = request(extra.clone());
        let (status, _, reply) = router.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{extra}: {reply}");
        assert_eq!(reply["error"]["param"], param, "{extra}: {reply}");
    }
    let (status, _, reply) = router
        .post(
            "/v1/chat/completions",
            &json!({"model": "sim", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
        )
        .await;
    assert_eq!((status, reply["error"]["param"].clone()), (400, json!("tool_choice")), "{reply}");
    assert_eq!(router.metric("bellows_router_placements_total").await, 0.0, "no worker was used");
}

/// Joins one protocol's streamed events into a call's arguments, with the fragment count.
type JoinArguments = fn(&[(String, Value)]) -> (String, usize);

/// The forced call's arguments: whole, and joined from the stream's fragments with their count.
async fn call_arguments(router: &Router, path: &str, body: Value, join: JoinArguments) -> (String, String, usize) {
    let (status, _, whole) = router.post(path, &body).await;
    assert_eq!(status, 200, "{whole}");
    let whole = match path {
        "/v1/chat/completions" => whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"].clone(),
        "/v1/responses" => {
            whole["output"].as_array().unwrap().iter().find(|i| i["type"] == "function_call").unwrap()["arguments"]
                .clone()
        }
        _ => json!(
            whole["content"].as_array().unwrap().iter().find(|b| b["type"] == "tool_use").unwrap()["input"].to_string()
        ),
    };
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let response = reqwest::Client::new().post(router.url(path)).json(&streamed).send().await.unwrap();
    let (joined, fragments) = join(&sse_named(response).await);
    (whole.as_str().unwrap().to_string(), joined, fragments)
}

#[tokio::test]
async fn streamed_arguments_arrive_in_fragments_that_join_to_the_whole_call_in_every_protocol() {
    let (_w, router) = cluster().await;
    for city in ["Paris", "Oslo", "Lima"] {
        let user = json!([{"role": "user", "content": format!("weather in {city}?")}]);
        let chat = request(
            json!({"messages": user, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "temperature": 0}),
        );
        let (whole, joined, fragments) = call_arguments(&router, "/v1/chat/completions", chat, |events| {
            let chunks: Vec<Value> = events.iter().map(|(_, v)| v.clone()).collect();
            let (_, calls, _, fragments) = join_chat_stream(&chunks);
            (calls[0]["function"]["arguments"].as_str().unwrap().to_string(), fragments)
        })
        .await;
        assert_eq!(joined, whole, "chat, {city}");
        assert!(fragments > 1, "chat, {city}");

        let function = json!({"type": "function", "name": "get_weather", "parameters": weather_schema()});
        let responses = json!({"model": "sim", "input": user, "tools": [function], "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 300, "temperature": 0});
        let (whole, joined, fragments) = call_arguments(&router, "/v1/responses", responses, |events| {
            let done = events.iter().find(|(name, _)| name == "response.function_call_arguments.done").unwrap();
            let deltas: Vec<&str> = events
                .iter()
                .filter(|(name, e)| {
                    name == "response.function_call_arguments.delta" && e["item_id"] == done.1["item_id"]
                })
                .map(|(_, e)| e["delta"].as_str().unwrap())
                .collect();
            assert_eq!(
                done.1["arguments"].as_str().unwrap(),
                deltas.concat(),
                "the done event holds the joined deltas"
            );
            (deltas.concat(), deltas.len())
        })
        .await;
        assert_eq!(joined, whole, "responses, {city}");
        assert!(fragments > 1, "responses, {city}");

        let tool = json!({"name": "get_weather", "input_schema": weather_schema()});
        let messages = json!({"model": "sim", "messages": user, "tools": [tool], "tool_choice": {"type": "tool", "name": "get_weather"}, "max_tokens": 300, "temperature": 0});
        let (whole, joined, fragments) = call_arguments(&router, "/v1/messages", messages, |events| {
            let first = events.iter().find(|(_, e)| e["content_block"]["type"] == "tool_use").unwrap();
            let deltas: Vec<&str> = events
                .iter()
                .filter(|(_, e)| e["delta"]["type"] == "input_json_delta" && e["index"] == first.1["index"])
                .map(|(_, e)| e["delta"]["partial_json"].as_str().unwrap())
                .collect();
            (deltas.concat(), deltas.len())
        })
        .await;
        let (whole, joined): (Value, Value) =
            (serde_json::from_str(&whole).unwrap(), serde_json::from_str(&joined).unwrap());
        assert_eq!(joined, whole, "messages, {city} (its whole answer holds the input as an object)");
        assert!(fragments > 1, "messages, {city}");
    }
}
