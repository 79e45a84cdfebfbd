//! Structured outputs through the whole cluster: `response_format` and the `guided_*` fields over
//! HTTP, the router's schema check, and simulated workers that mask their tokens by the grammar.

use bellows_integration::{Router, Worker, schemas, sim};
use futures_util::{StreamExt, stream};
use serde_json::{Value, json};

/// Two fast simulated workers (0.2 ms a step) behind one router.
async fn cluster() -> (Vec<Worker>, Router) {
    let config = r#"{"base_us": 200, "per_token_us": 5}"#;
    let a = Worker::start(&sim(config)).await;
    let b = Worker::start(&sim(config)).await;
    let router = Router::with_workers(&[&a, &b], &[] as &[&str]).await;
    (vec![a, b], router)
}

/// A one-turn chat request with these fields added.
fn chat(max_tokens: u32, extra: Value) -> Value {
    let mut body = json!({"model": "sim", "messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// A `strict` json_schema format.
fn strict(schema: Value) -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": true}})
}

/// Not `strict`: the generated schemas leave properties optional, which strict refuses.
fn schema_format(schema: &Value) -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
}

#[tokio::test]
async fn outputs_of_200_generated_schemas_validate_whole_and_streamed_with_n_choices() {
    let (_workers, router) = cluster().await;
    let router = &router;
    let results: Vec<(u64, Vec<(String, String)>)> = stream::iter(0..200u64)
        .map(|i| async move {
            let schema = schemas::schema(i);
            let mut body = json!({
                "model": "sim", "max_tokens": 600, "n": 2, "stream": i % 2 == 1, "seed": i,
                "temperature": if i % 3 == 0 { 0.0 } else { 1.0 },
            });
            let path = if i % 4 < 2 {
                body["messages"] = json!([{"role": "user", "content": format!("answer {i} in JSON")}]);
                body["response_format"] = schema_format(&schema);
                "/v1/chat/completions"
            } else {
                body["prompt"] = json!(format!("answer {i}"));
                body["guided_json"] = schema.clone();
                "/v1/completions"
            };
            (i, router.choices(path, &body).await)
        })
        .buffer_unordered(8)
        .collect()
        .await;
    let mut stopped = 0;
    for (i, choices) in results {
        assert_eq!(choices.len(), 2);
        for (text, finish) in choices {
            assert!(finish == "stop" || finish == "length", "schema {i}: finish {finish:?}");
            if finish == "stop" {
                stopped += 1;
                schemas::check_output(&schemas::schema(i), &text).unwrap_or_else(|e| panic!("schema {i}: {e}"));
            }
        }
    }
    assert!(stopped >= 360, "only {stopped} of 400 choices finished within max_tokens");
}

#[tokio::test]
async fn json_object_regex_grammar_and_choice_constrain_the_answer() {
    let (_workers, router) = cluster().await;
    let chat = |extra: Value| chat(200, extra);
    let (text, finish) = router
        .choices("/v1/chat/completions", &chat(json!({"response_format": {"type": "json_object"}})))
        .await
        .remove(0);
    if finish == "stop" {
        assert!(serde_json::from_str::<Value>(&text).unwrap_or_else(|e| panic!("{e}: {text}")).is_object());
    }
    let (text, finish) =
        router.choices("/v1/chat/completions", &chat(json!({"guided_regex": "(cat|dog)-[0-9]{2}"}))).await.remove(0);
    assert_eq!(finish, "stop");
    assert!(text.len() == 6 && (text.starts_with("cat-") || text.starts_with("dog-")), "{text:?}");
    let lark = "start: \"<\" word (\" \" word)* \">\"\nword: /[a-z]{1,5}/";
    let (text, finish) =
        router.choices("/v1/chat/completions", &chat(json!({"guided_grammar": lark, "stream": true}))).await.remove(0);
    assert_eq!(finish, "stop");
    assert!(text.starts_with('<') && text.ends_with('>'), "{text:?}");
    let choices = ["yes", "no", "a+b (maybe)"];
    let body = chat(json!({"guided_choice": choices, "n": 6, "temperature": 1.0, "seed": 7}));
    for (text, finish) in router.choices("/v1/chat/completions", &body).await {
        assert_eq!(finish, "stop");
        assert!(choices.contains(&text.as_str()), "{text:?} is one of {choices:?}");
    }
    let (text, _) =
        router.choices("/v1/chat/completions", &chat(json!({"response_format": {"type": "text"}}))).await.remove(0);
    assert!(text.starts_with(" t"), "text is free: {text:?}");
}

/// A simulated worker picks among the allowed tokens at random, so it takes any open path: with
/// the default bounds an integer fits an i64 and a number stays short; `bounded_json: false` lifts
/// them.
#[tokio::test]
async fn json_numbers_are_bounded_by_default_and_bounded_json_false_lifts_the_bounds() {
    let (_workers, router) = cluster().await;
    let router = &router;
    let answers = |schema: Value, bounded: bool| async move {
        let body =
            chat(40, json!({"guided_json": schema, "n": 16, "temperature": 1.0, "seed": 3, "bounded_json": bounded}));
        router.choices("/v1/chat/completions", &body).await
    };
    for (text, finish) in answers(json!({"type": "integer"}), true).await {
        assert_eq!(finish, "stop", "{text}");
        text.parse::<i64>().unwrap_or_else(|e| panic!("{text:?} is not an i64: {e}"));
    }
    for (text, finish) in answers(json!({"type": "number"}), true).await {
        assert_eq!(finish, "stop", "{text}");
        let (whole, fraction) = text.trim_start_matches('-').split_once('.').unwrap_or((&text, ""));
        assert!(whole.len() <= 16 && fraction.len() <= 10 && !text.contains(['e', 'E']), "{text:?}");
    }
    let unbounded = answers(json!({"type": "integer"}), false).await;
    assert!(unbounded.iter().any(|(text, _)| text.parse::<i64>().is_err()), "{unbounded:?}");
    let (status, _, body) =
        router.post("/v1/chat/completions", &chat(5, json!({"guided_json": {}, "bounded_json": "no"}))).await;
    assert_eq!((status, &body["error"]["param"]), (400, &json!("bounded_json")), "{body}");
}

#[tokio::test]
async fn a_bad_constraint_is_a_400_naming_its_field_and_pointer_before_any_worker_is_used() {
    let (_workers, router) = cluster().await;
    let chat = |extra: Value| chat(5, extra);
    let bad_schema = json!({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "strin"}}}});
    let cases = [
        (json!({"response_format": schema_format(&bad_schema)}), "response_format", Some("/properties/a/items")),
        (json!({"response_format": {"type": "xml"}}), "response_format.type", None),
        (json!({"response_format": "json"}), "response_format", None),
        (json!({"response_format": {"type": "json_schema"}}), "response_format", None),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}}),
            "response_format.json_schema.name",
            None,
        ),
        (
            json!({"guided_json": {"type": "object", "properties": {"d": {"format": "nope", "type": "string"}}}}),
            "guided_json",
            Some("/properties/d"),
        ),
        (json!({"guided_regex": "(unclosed"}), "guided_regex", None),
        (json!({"guided_grammar": "start: missing_rule"}), "guided_grammar", None),
        (json!({"guided_regex": "a", "response_format": {"type": "json_object"}}), "guided_regex", None),
        (json!({"guided_choice": []}), "guided_choice", None),
        (json!({"guided_choice": "yes"}), "guided_choice", None),
        (json!({"guided_choice": ["yes"], "guided_regex": "a"}), "guided_choice", None),
        // strict: true means what it means at OpenAI: every object closed, every property required.
        (
            json!({"response_format": strict(json!({"type": "object", "properties": {"a": {}}}))}),
            "response_format",
            None,
        ),
        (
            json!({"response_format": strict(json!({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a"], "additionalProperties": false}))}),
            "response_format",
            Some("\"b\""),
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "strict": true, "parameters": {"type": "object", "properties": {"x": {"type": "object"}}, "required": ["x"], "additionalProperties": false}}}]}),
            "tools[0].function.parameters",
            Some("/properties/x"),
        ),
    ];
    for (extra, param, pointer) in cases {
        let (status, _, body) = router.post("/v1/chat/completions", &chat(extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {body}");
        assert_eq!(body["error"]["param"], param, "{extra}: {body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        if let Some(p) = pointer {
            let message = body["error"]["message"].as_str().unwrap();
            assert!(message.contains(p), "{extra}: the message names {p}: {message}");
        }
    }
    let (status, _, body) =
        router.post("/v1/completions", &json!({"model": "sim", "prompt": "x", "guided_json": bad_schema})).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(router.metric("bellows_router_placements_total").await, 0.0, "no worker was used");
    // A misspelt keyword is refused, naming it and where it is; the same schema asking for
    // llguidance's lenient mode has it ignored.
    let misspelt =
        json!({"type": "object", "properties": {"n": {"type": "string", "maxLenght": 3}}, "required": ["n"]});
    let (status, _, body) = router.post("/v1/chat/completions", &chat(json!({"guided_json": misspelt}))).await;
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert_eq!((status, &body["error"]["param"]), (400, &json!("guided_json")), "{body}");
    assert!(message.contains("'maxLenght'") && message.contains("'/properties/n'"), "{message}");
    let mut lenient = misspelt;
    lenient["x-guidance"] = json!({"lenient": true});
    let (status, _, body) = router.post("/v1/chat/completions", &chat(json!({"guided_json": lenient}))).await;
    assert_eq!(status, 200, "{body}");
}
