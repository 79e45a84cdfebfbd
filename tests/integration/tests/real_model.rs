//! The router in front of a worker running the real default model (SmolLM2-135M): tokenization
//! at the router matches llama.cpp's, and the official OpenAI and Anthropic Python clients work
//! unchanged.

use bellows_integration::{ANTHROPIC, OPENAI, Router, Worker, schemas};
use futures_util::{StreamExt, stream};
use serde_json::{Value, json};

fn fixture() -> Value {
    serde_json::from_str(include_str!("../../../crates/worker/tests/fixtures/tokenizer_reference.json")).unwrap()
}

async fn real_cluster() -> (Worker, Router) {
    let worker = Worker::start(&["--engine", "gguf", "--model-id", "smollm2"]).await;
    let router = Router::with_workers(&[&worker], &[] as &[&str]).await;
    (worker, router)
}

/// For `n` of the fixture's lines without control tokens, a text prompt and llama.cpp's ids for it
/// give the same prompt length and the same greedy completion: the router's tokenizer (fetched
/// from the worker) agrees with the reference.
async fn assert_router_tokenizes_like_llama_cpp(router: &Router, model: &str, fixture: &Value, n: usize) {
    for case in fixture["cases"].as_array().unwrap().iter().filter(|c| c["has_special"] == false).take(n) {
        let text = case["text"].as_str().unwrap();
        let ids = &case["ids_add_special"];
        let ask = |prompt: Value| json!({"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0});
        let (s1, _, from_text) = router.post("/v1/completions", &ask(json!(text))).await;
        let (s2, _, from_ids) = router.post("/v1/completions", &ask(ids.clone())).await;
        assert_eq!((s1, s2), (200, 200), "{from_text} {from_ids}");
        assert_eq!(
            from_text["usage"]["prompt_tokens"].as_u64().unwrap(),
            ids.as_array().unwrap().len() as u64,
            "prompt length of {text:?}"
        );
        assert_eq!(from_text["choices"][0]["text"], from_ids["choices"][0]["text"], "completion of {text:?}");
    }
}

#[tokio::test]
async fn control_tokens_the_model_generates_are_written_out_only_when_asked() {
    let (_worker, router) = real_cluster().await;
    // `<|im_start|>` (id 1) forced by the bias: a control token, which prints nothing by default.
    let ask = |skip: Option<bool>| {
        let mut body =
            json!({"model": "smollm2", "prompt": "Hi", "max_tokens": 3, "temperature": 0, "logit_bias": {"1": 100}});
        if let Some(skip) = skip {
            body["skip_special_tokens"] = json!(skip);
        }
        body
    };
    let (_, _, hidden) = router.post("/v1/completions", &ask(None)).await;
    assert_eq!(hidden["choices"][0]["text"], "", "{hidden}");
    assert_eq!(hidden["usage"]["completion_tokens"], 3, "{hidden}");
    let (_, _, kept) = router.post("/v1/completions", &ask(Some(false))).await;
    assert_eq!(kept["choices"][0]["text"], "<|im_start|><|im_start|><|im_start|>", "{kept}");
}

#[tokio::test]
async fn the_router_tokenizes_text_exactly_like_llama_cpp_and_official_clients_work() {
    let (_worker, router) = real_cluster().await;

    assert_router_tokenizes_like_llama_cpp(&router, "smollm2", &fixture(), 6).await;

    router.run_official_client("openai_client.py", "smollm2", &[OPENAI]);
}

#[tokio::test]
async fn tokenize_and_detokenize_agree_with_llama_cpp_and_with_what_a_chat_request_is_charged() {
    let (_worker, router) = real_cluster().await;
    for case in fixture()["cases"].as_array().unwrap().iter().filter(|c| c["has_special"] == false) {
        let text = case["text"].as_str().unwrap();
        for (special, ids) in [(true, &case["ids_add_special"]), (false, &case["ids"])] {
            let body = json!({"model": "smollm2", "prompt": text, "add_special_tokens": special});
            let (status, _, got) = router.post("/v1/tokenize", &body).await;
            assert_eq!(status, 200, "{got}");
            assert_eq!(&got["tokens"], ids, "{text:?}, add_special_tokens {special}");
        }
        let (status, _, back) =
            router.post("/v1/detokenize", &json!({"model": "smollm2", "tokens": case["ids"]})).await;
        assert_eq!(status, 200, "{back}");
        assert_eq!(back["prompt"], case["detokenized"], "{text:?}");
    }
    let messages = json!([{"role": "user", "content": "What is the capital of France?"}]);
    let (_, _, rendered) = router.post("/v1/tokenize", &json!({"model": "smollm2", "messages": messages})).await;
    let (_, _, answer) =
        router.post("/v1/chat/completions", &json!({"model": "smollm2", "messages": messages, "max_tokens": 1})).await;
    assert_eq!(rendered["count"], answer["usage"]["prompt_tokens"], "{rendered}");
    let body =
        json!({"model": "smollm2", "messages": messages, "add_generation_prompt": false, "return_token_strs": true});
    let (_, _, bare) = router.post("/v1/tokenize", &body).await;
    let (full, bare_ids) = (rendered["tokens"].as_array().unwrap(), bare["tokens"].as_array().unwrap());
    assert!(bare_ids.len() < full.len() && full.starts_with(bare_ids), "the assistant's opening is left off");
    assert_eq!(bare["token_strs"].as_array().unwrap().len(), bare_ids.len());
}

#[tokio::test]
async fn the_official_openai_clients_responses_api_works_unchanged() {
    let (_worker, router) = real_cluster().await;
    router.run_official_client("openai_responses.py", "smollm2", &[OPENAI]);
}

#[tokio::test]
async fn the_official_anthropic_client_works_unchanged() {
    let (_worker, router) = real_cluster().await;
    router.run_official_client("anthropic_client.py", "smollm2", &[ANTHROPIC]);
}

#[tokio::test]
async fn answers_to_twenty_generated_schemas_from_the_real_model_validate_whole_and_streamed() {
    let (_worker, router) = real_cluster().await;
    let router = &router;
    let results: Vec<(u64, Vec<(String, String)>)> = stream::iter(0..20u64)
        .map(|i| async move {
            let body = json!({
                "model": "smollm2",
                "messages": [{"role": "user", "content": "Fill in this form with realistic values, as JSON."}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "form", "schema": schemas::schema(i)}},
                "max_tokens": 300,
                "n": 2,
                "stream": i % 2 == 1,
                "temperature": if i % 4 < 2 { 0.0 } else { 0.8 },
                "seed": i,
            });
            (i, router.choices("/v1/chat/completions", &body).await)
        })
        .buffer_unordered(4)
        .collect()
        .await;
    let mut stopped = 0;
    for (i, choices) in results {
        for (text, finish) in choices {
            if finish == "stop" {
                stopped += 1;
                schemas::check_output(&schemas::schema(i), &text).unwrap_or_else(|e| panic!("schema {i}: {e}"));
            }
        }
    }
    assert!(stopped >= 30, "only {stopped} of 40 answers finished within max_tokens");
}

/// Schemas whose shortest answer is short, several prompts, greedy and sampled: every answer ends
/// by itself within a few times its shortest length, and validates. Unbounded numbers and free
/// whitespace are paths that need not end; a small model takes them (docs/structured-outputs.md).
#[tokio::test]
async fn every_answer_to_a_short_schema_ends_by_itself_within_a_few_times_its_shortest_length() {
    const PROMPTS: [&str; 3] = [
        "Fill in this form with realistic values, as JSON.",
        "Describe the last thing you bought as a JSON record.",
        "Count the sheep in the field and report the totals as JSON.",
    ];
    let (_worker, router) = real_cluster().await;
    let router = &router;
    let cases: Vec<(u64, &str, f32)> =
        (0..10u64).flat_map(|i| PROMPTS.iter().flat_map(move |p| [0.0, 1.0].map(|t| (i, *p, t)))).collect();
    let total = cases.len();
    let results: Vec<(u64, usize, (String, String))> = stream::iter(cases)
        .map(|(i, prompt, temperature)| async move {
            let schema = schemas::short_schema(i);
            let budget = 4 * schemas::shortest(&schema).len();
            let body = json!({
                "model": "smollm2",
                "messages": [{"role": "user", "content": prompt}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}},
                "max_tokens": budget,
                "temperature": temperature,
                "seed": i,
            });
            (i, budget, router.choices("/v1/chat/completions", &body).await.remove(0))
        })
        .buffer_unordered(4)
        .collect()
        .await;
    let mut by_length = Vec::new();
    for (i, budget, (text, finish)) in results {
        if finish == "stop" {
            schemas::check_output(&schemas::short_schema(i), &text).unwrap_or_else(|e| panic!("short schema {i}: {e}"));
        } else {
            by_length.push(format!("schema {i} ({budget} tokens, {finish}): {text}"));
        }
    }
    assert!(by_length.is_empty(), "{} of {total} answers did not end:\n{}", by_length.len(), by_length.join("\n"));
}

async fn gemma3_cluster() -> (Worker, Router) {
    let home = std::env::var("HOME").unwrap();
    let dir = std::env::var("BELLOWS_MODEL_DIR").unwrap_or_else(|_| format!("{home}/.cache/bellows/models"));
    let model = format!("{dir}/gemma-3-270m-q4_k_m.gguf");
    assert!(std::path::Path::new(&model).exists(), "{model} is missing: run scripts/fetch-model.sh gemma3");
    let worker = Worker::start(&["--engine", "gguf", "--model", &model, "--model-id", "gemma3"]).await;
    let router = Router::with_workers(&[&worker], &[] as &[&str]).await;
    (worker, router)
}

#[tokio::test]
async fn a_real_model_in_auto_mode_writes_a_call_that_comes_back_as_tool_calls_whole_and_streamed() {
    // Gemma 3 270M, shown two earlier calls and their results (in the Hermes format its template
    // gets), writes the third itself at temperature 0: nothing forces it, the parser must find it.
    let (_worker, router) = gemma3_cluster().await;
    let call = |city: &str, id: &str| {
        let arguments = json!({"city": city}).to_string();
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]})
    };
    let messages = json!([
        {"role": "user", "content": "What is the weather in Paris?"},
        call("Paris", "c1"),
        {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"},
        {"role": "assistant", "content": "It is 18C and sunny in Paris."},
        {"role": "user", "content": "What is the weather in Rome?"},
        call("Rome", "c2"),
        {"role": "tool", "tool_call_id": "c2", "content": "25C, clear"},
        {"role": "assistant", "content": "It is 25C and clear in Rome."},
        {"role": "user", "content": "What is the weather in Tokyo?"},
    ]);
    let tool = json!({"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}});
    let body = json!({"model": "gemma3", "messages": messages, "tools": [tool], "tool_choice": "auto", "max_tokens": 30, "temperature": 0});
    let (status, _, whole) = router.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{whole}");
    let calls = &whole["choices"][0]["message"]["tool_calls"];
    assert_eq!(calls.as_array().map(Vec::len), Some(1), "{whole}");
    assert_eq!(calls[0]["function"], json!({"name": "get_weather", "arguments": "{\"city\":\"Tokyo\"}"}), "{whole}");
    let content = whole["choices"][0]["message"]["content"].as_str().unwrap_or("");
    assert!(!content.contains("tool_call"), "no markup in content: {content:?}");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let response =
        reqwest::Client::new().post(router.url("/v1/chat/completions")).json(&streamed).send().await.unwrap();
    let (mut name, mut arguments) = (String::new(), String::new());
    for delta in bellows_integration::sse(response).await.iter().filter_map(|c| c.get("choices")?.get(0)) {
        for call in delta["delta"]["tool_calls"].as_array().into_iter().flatten() {
            name += call["function"]["name"].as_str().unwrap_or("");
            arguments += call["function"]["arguments"].as_str().unwrap_or("");
        }
    }
    assert_eq!((name.as_str(), arguments.as_str()), ("get_weather", "{\"city\":\"Tokyo\"}"));
}

#[tokio::test]
async fn a_gemma3_worker_serves_through_the_router_which_tokenizes_its_sentencepiece_vocabulary_like_llama_cpp() {
    // Gemma 3's tokenizer.json (262,144 pieces and their merges) is far over gRPC's default 4 MiB
    // message limit: the router must still take its ModelInfo.
    let (_worker, router) = gemma3_cluster().await;
    let fixture: Value =
        serde_json::from_str(include_str!("../../../crates/worker/tests/fixtures/tokenizer_reference_gemma3.json"))
            .unwrap();
    assert_router_tokenizes_like_llama_cpp(&router, "gemma3", &fixture, 8).await;
    // Chat renders Gemma's turns (its GGUF has no template): BOS, then user turn, then model turn.
    let chat = json!({"model": "gemma3", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
    let (status, _, body) = router.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{body}");
    // <bos> <start_of_turn> user \n Hi <end_of_turn> \n <start_of_turn> model \n
    assert_eq!(body["usage"]["prompt_tokens"], 10, "{body}");
}
