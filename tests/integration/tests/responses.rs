//! OpenAI's Responses API through the whole cluster, over simulated workers: a response is the
//! chat pipeline's answer in the Responses shape, whole or as the sequenced event stream; stored
//! responses are continued with `previous_response_id` (calls and their outputs kept, placed
//! where their KV is), read, listed and deleted, by their own tenant only; bad bodies are 400s
//! naming the field and cost no worker time.

use std::time::Duration;

use bellows_integration::{Router, Worker, eventually, schemas, sim, sse_named};
use serde_json::{Value, json};

/// Long enough (in the simulated vocabulary's words) to fill KV blocks past the depth at which
/// cache-aware placement keys a prompt's home (`placement::cache_aware::HOME_BLOCK`), so a
/// continuation, whose prompt starts with this one, has the same home.
const INSTRUCTIONS: &str = "You are terse. Answer every question in one short sentence, name your sources when \
                            you have any, and never write more than the question needs or repeat it back. \
                            Prefer plain words to technical ones, numbers to adjectives, and examples to \
                            definitions. When a question is ambiguous, answer the most likely reading and say \
                            which one you chose. When you do not know, say so and stop; never guess a figure, a \
                            date, a name or a place. Keep units in the system the question uses, round to two \
                            significant digits unless asked otherwise, and give ranges rather than single \
                            values for anything that varies from day to day, such as weather, prices or the \
                            time a journey takes. Write dates as year, month and day. Do not use lists, tables \
                            or headings, and never end with a question of your own.";

async fn cluster(workers: usize, extra: &[&str]) -> (Vec<Worker>, Router) {
    let mut ws = Vec::new();
    for _ in 0..workers {
        ws.push(Worker::start(&sim(r#"{"base_us": 200}"#)).await);
    }
    let refs: Vec<&Worker> = ws.iter().collect();
    let router = Router::with_workers(&refs, extra).await;
    (ws, router)
}

fn body(extra: Value) -> Value {
    let mut b = json!({"model": "sim", "instructions": INSTRUCTIONS, "input": "What is the weather in Paris?", "max_output_tokens": 12, "temperature": 0});
    b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    b
}

fn weather() -> Value {
    json!({"type": "function", "name": "get_weather", "strict": true, "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": false,
    }})
}

async fn send(
    router: &Router,
    method: reqwest::Method,
    path: &str,
    key: Option<&str>,
    body: Option<&Value>,
) -> (u16, Value) {
    let mut r = reqwest::Client::new().request(method, router.url(path));
    if let Some(b) = body {
        r = r.json(b);
    }
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let r = r.send().await.expect("the router answers");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn create(router: &Router, body: &Value) -> Value {
    let (status, r) = send(router, reqwest::Method::POST, "/v1/responses", None, Some(body)).await;
    assert_eq!(status, 200, "{r}");
    r
}

fn output_text(r: &Value) -> String {
    r["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "message")
        .flat_map(|i| i["content"].as_array().unwrap().iter().map(|p| p["text"].as_str().unwrap().to_string()))
        .collect()
}

#[tokio::test]
async fn a_response_is_the_equivalent_chat_answer_in_the_responses_shape() {
    let (_w, router) = cluster(1, &[]).await;
    let chat = json!({"model": "sim", "max_tokens": 12, "temperature": 0, "messages": [
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "What is the weather in Paris?"}]});
    let (_, _, chat) = router.post("/v1/chat/completions", &chat).await;
    let r = create(&router, &body(json!({}))).await;
    assert!(r["id"].as_str().unwrap().starts_with("resp_"), "{r}");
    assert_eq!((&r["object"], &r["model"]), (&json!("response"), &json!("sim")));
    assert_eq!(r["status"], "incomplete", "max_output_tokens ended it");
    assert_eq!(r["incomplete_details"], json!({"reason": "max_output_tokens"}));
    let item = &r["output"][0];
    assert_eq!(
        (&item["type"], &item["role"], &item["status"]),
        (&json!("message"), &json!("assistant"), &json!("completed"))
    );
    assert!(item["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(item["content"][0]["type"], "output_text");
    assert_eq!(output_text(&r), chat["choices"][0]["message"]["content"].as_str().unwrap());
    let u = &r["usage"];
    assert_eq!(u["input_tokens"], chat["usage"]["prompt_tokens"]);
    assert_eq!(u["output_tokens"], 12);
    assert_eq!(u["total_tokens"], u["input_tokens"].as_u64().unwrap() + 12);
    assert_eq!((&r["instructions"], &r["store"], &r["temperature"]), (&json!(INSTRUCTIONS), &json!(true), &json!(0.0)));
}

#[tokio::test]
async fn the_event_stream_is_numbered_in_order_and_completes_with_the_whole_response() {
    let (_w, router) = cluster(1, &[]).await;
    let whole = create(&router, &body(json!({}))).await;
    let r = reqwest::Client::new()
        .post(router.url("/v1/responses"))
        .json(&body(json!({"stream": true})))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let events = sse_named(r).await;
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], json!(name), "the event line names the data's type");
        assert_eq!(data["sequence_number"], i, "sequence numbers count from 0");
    }
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let head =
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"];
    assert_eq!(names[..4], head, "{names:?}");
    let tail =
        ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"];
    assert_eq!(names[names.len() - 4..], tail, "{names:?}");
    assert!(names[4..names.len() - 4].iter().all(|n| *n == "response.output_text.delta"), "{names:?}");
    let text: String = events[4..events.len() - 4].iter().map(|(_, d)| d["delta"].as_str().unwrap()).collect();
    assert_eq!(text, output_text(&whole));
    assert_eq!(events[0].1["response"]["status"], "in_progress");
    let last = &events.last().unwrap().1["response"];
    assert_eq!(output_text(last), text, "the terminal event carries the whole output");
    assert_eq!(last["usage"]["output_tokens"], 12);
    let item_id = &events[2].1["item"]["id"];
    let parts = events.iter().filter(|(_, d)| d.get("item_id").is_some());
    assert!(
        parts.clone().count() > 4 && parts.clone().all(|(_, d)| &d["item_id"] == item_id && d["output_index"] == 0)
    );
}

#[tokio::test]
async fn a_continuation_sees_the_stored_conversation_and_is_placed_where_its_kv_is() {
    let (_w, router) = cluster(2, &[]).await;
    let first = create(&router, &body(json!({}))).await;
    // A client continues after reading the answer; by then the worker's stored blocks have
    // reached the router (its KV events), which is what placement goes by.
    eventually("the first turn's blocks reach the router", Duration::from_secs(10), || async {
        (router.metric("bellows_router_kv_events_total").await >= 2.0).then_some(())
    })
    .await;
    // Instructions are not carried over: a client that wants them sends them again.
    let next = json!({"model": "sim", "instructions": INSTRUCTIONS, "input": "And in Rome?", "max_output_tokens": 12,
        "temperature": 0, "previous_response_id": first["id"]});
    let second = create(&router, &next).await;
    let u = &second["usage"];
    let prompt = u["input_tokens"].as_u64().unwrap();
    assert!(prompt > first["usage"]["input_tokens"].as_u64().unwrap(), "{u}");
    let cached = u["input_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let history = first["usage"]["input_tokens"].as_u64().unwrap();
    assert!(cached + 15 >= history, "the first turn's full blocks were read where they were made: {u}");
    assert_eq!(second["previous_response_id"], first["id"]);
    let mut bare = next.clone();
    bare.as_object_mut().unwrap().remove("instructions");
    let third = create(&router, &bare).await;
    assert_eq!(third["instructions"], Value::Null);
    assert!(third["usage"]["input_tokens"].as_u64().unwrap() < prompt, "the first turn's instructions stay behind");

    let (status, items) = send(
        &router,
        reqwest::Method::GET,
        &format!("/v1/responses/{}/input_items", second["id"].as_str().unwrap()),
        None,
        None,
    )
    .await;
    assert_eq!(status, 200, "{items}");
    assert_eq!(items["data"].as_array().unwrap().len(), 1, "the request's own input items");
    assert_eq!(items["data"][0]["content"], json!([{"type": "input_text", "text": "And in Rome?"}]));
}

#[tokio::test]
async fn a_function_call_round_trip_continues_from_the_stored_call() {
    let (_w, router) = cluster(1, &[]).await;
    let first = create(&router, &body(json!({"tools": [weather()], "tool_choice": "required", "parallel_tool_calls": false, "max_output_tokens": 200}))).await;
    assert_eq!(first["status"], "completed", "{first}");
    let call =
        first["output"].as_array().unwrap().iter().find(|i| i["type"] == "function_call").expect("a call").clone();
    assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
    schemas::check_output(&weather()["parameters"], call["arguments"].as_str().unwrap()).unwrap();

    let answer = json!({"model": "sim", "tools": [weather()], "max_output_tokens": 8, "previous_response_id": first["id"],
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "21 C"}]});
    let second = create(&router, &answer).await;
    assert_eq!(second["output"][0]["type"], "message", "{second}");

    let streamed = body(
        json!({"tools": [weather()], "tool_choice": "required", "parallel_tool_calls": false, "max_output_tokens": 200, "stream": true}),
    );
    let r = reqwest::Client::new().post(router.url("/v1/responses")).json(&streamed).send().await.unwrap();
    let events = sse_named(r).await;
    let args: String = events
        .iter()
        .filter(|(n, _)| n == "response.function_call_arguments.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(args, call["arguments"].as_str().unwrap(), "greedy: the same call, streamed");
    let done = &events.last().unwrap().1;
    assert_eq!(done["type"], "response.completed");
    assert_eq!(done["response"]["output"][0]["arguments"], call["arguments"]);

    let unanswered = json!({"model": "sim", "input": [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}], "previous_response_id": first["id"]});
    let (status, e) = send(&router, reqwest::Method::POST, "/v1/responses", None, Some(&unanswered)).await;
    assert_eq!((status, &e["error"]["param"]), (400, &json!("input[0].call_id")), "{e}");
}

#[tokio::test]
async fn stored_responses_are_read_listed_and_deleted_by_their_own_tenant_only() {
    let dir = tempfile::TempDir::new().unwrap();
    let tenants = dir.path().join("tenants.yaml");
    // sha256("key-a"), sha256("key-b")
    std::fs::write(
        &tenants,
        "tenants:\n- name: team-a\n  key_sha256: [f10f781241e2246678b6b45c857069208152a53863e47fac33f607ab405006f4]\n\
         - name: team-b\n  key_sha256: [a30534a53b23547377ddccbd1ac85a8a84c13db43493c16e55a6abc7b0eba634]\n",
    )
    .unwrap();
    let (_w, router) = cluster(1, &["--tenants-file", tenants.to_str().unwrap()]).await;
    let post = reqwest::Method::POST;
    let (status, r) = send(&router, post.clone(), "/v1/responses", Some("key-a"), Some(&body(json!({})))).await;
    assert_eq!(status, 200, "{r}");
    let path = format!("/v1/responses/{}", r["id"].as_str().unwrap());
    let (status, got) = send(&router, reqwest::Method::GET, &path, Some("key-a"), None).await;
    assert_eq!(status, 200);
    assert_eq!(got, r, "the stored response is the one returned");
    for (key, want) in [(Some("key-b"), 404), (None, 401)] {
        let (status, _) = send(&router, reqwest::Method::GET, &path, key, None).await;
        assert_eq!(status, want, "{key:?}");
        let (status, e) =
            send(&router, post.clone(), "/v1/responses", key, Some(&body(json!({"previous_response_id": r["id"]}))))
                .await;
        assert_eq!(status, want, "{key:?}: {e}");
    }
    let (status, e) = send(&router, reqwest::Method::DELETE, &path, Some("key-b"), None).await;
    assert_eq!((status, &e["error"]["code"]), (404, &json!("response_not_found")), "another tenant cannot delete it");
    let (status, d) = send(&router, reqwest::Method::DELETE, &path, Some("key-a"), None).await;
    assert_eq!((status, d), (200, json!({"id": r["id"], "object": "response", "deleted": true})));
    let (status, _) = send(&router, reqwest::Method::GET, &path, Some("key-a"), None).await;
    assert_eq!(status, 404, "deleted");

    let (_, unstored) = send(&router, post, "/v1/responses", Some("key-a"), Some(&body(json!({"store": false})))).await;
    let (status, _) = send(
        &router,
        reqwest::Method::GET,
        &format!("/v1/responses/{}", unstored["id"].as_str().unwrap()),
        Some("key-a"),
        None,
    )
    .await;
    assert_eq!(status, 404, "store: false stores nothing");
}

#[tokio::test]
async fn bad_responses_bodies_are_400s_naming_the_field_and_use_no_worker() {
    let (_w, router) = cluster(1, &[]).await;
    let cases = [
        (json!({"input": [{"type": "item_reference", "id": "x"}]}), "input[0].type"),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input[0].content[0]",
        ),
        (json!({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}), "input[0].call_id"),
        (json!({"input": null}), "input"),
        (json!({"tools": [{"type": "function", "name": "f", "parameters": {"type": "strin"}}]}), "tools[0].parameters"),
        (json!({"tools": [{"type": "file_search"}]}), "tools[0].type"),
        (json!({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}}), "text.format"),
        (json!({"text": {"format": {"type": "yaml"}}}), "text.format"),
        (json!({"temperature": 2.5}), "temperature"),
        (json!({"max_output_tokens": "12"}), "max_output_tokens"),
        (json!({"background": true}), "background"),
        (json!({"metadata": {"k": 1}}), "metadata"),
    ];
    for (extra, param) in cases {
        let (status, e) = send(&router, reqwest::Method::POST, "/v1/responses", None, Some(&body(extra.clone()))).await;
        assert_eq!(status, 400, "{extra}: {e}");
        assert_eq!(e["error"]["param"], param, "{extra}: {e}");
    }
    let (status, e) = send(
        &router,
        reqwest::Method::POST,
        "/v1/responses",
        None,
        Some(&body(json!({"previous_response_id": "resp_nope"}))),
    )
    .await;
    assert_eq!((status, &e["error"]["param"]), (404, &json!("previous_response_id")), "{e}");
    let (status, _) = send(&router, reqwest::Method::GET, "/v1/responses/resp_nope/input_items", None, None).await;
    assert_eq!(status, 404);
    assert_eq!(router.metric("bellows_router_placements_total").await, 0.0, "no worker was used");
}
