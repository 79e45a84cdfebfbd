//! Generate and ModelInfo over real gRPC against a `bellows-worker serve` process.
//!
//! The real model is used where the model is the point (the node must generate exactly what the
//! engine generates, and describe its tokenizer exactly); the simulated engine everywhere else.

mod common;

use std::{sync::Arc, time::Duration};

use bellows_proto::worker::v1 as pb;
use bellows_worker::{
    engine::{Engine, EngineConfig},
    load::{default_model_path, load_gguf},
    model::llama::LoadOptions,
    request::{Event, GenerateRequest},
    sampling::SamplingParams,
};
use common::{eventually, generate, greedy, report_where, sim, spawn_node, start_node, watch};
use tonic::Code;

#[tokio::test(flavor = "multi_thread")]
async fn generate_over_grpc_gives_the_engines_own_greedy_tokens_and_model_info_tokenizes_alike() {
    let path = default_model_path();
    assert!(path.exists(), "model {} is missing: run scripts/fetch-model.sh", path.display());
    let mut node = spawn_node(&["--model", path.to_str().unwrap()]);

    // The same model, in process, with the node's default load options.
    let (model, tok) = load_gguf(&path, &LoadOptions::default(), None).expect("model loads");
    let tok = Arc::new(tok);
    let engine = Engine::start(Box::new(model), tok.clone(), EngineConfig::default()).expect("engine starts");
    let prompt = tok.encode("Once upon a time, there was a", false).unwrap();
    let mut req = GenerateRequest::new(prompt.clone(), SamplingParams::greedy(), 16);
    req.ignore_eos = true;
    let mut rx = engine.handle().submit(req).unwrap();
    let (mut want_tokens, mut want_text) = (Vec::new(), String::new());
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token { id, text, .. } => {
                want_tokens.push(id);
                want_text += &text;
            }
            Event::Finished { text, .. } => {
                want_text += &text;
                break;
            }
            Event::Failed { message } => panic!("in-process engine failed: {message}"),
            Event::Progress(_) => {}
        }
    }
    drop(engine);

    node.wait_serving().await;
    let mut client = node.client().await;
    let got = generate(
        &mut client,
        pb::GenerateRequest { request_id: "real-1".into(), ignore_eos: true, ..greedy(prompt.clone(), 16) },
    )
    .await
    .expect("the node generates");
    assert_eq!(got.tokens, want_tokens, "token ids over gRPC differ from the engine's");
    assert_eq!(got.text, want_text);
    assert_eq!(got.finished.reason(), pb::FinishReason::Length);
    let usage = got.finished.usage.unwrap();
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (prompt.len() as u32, 16));

    // One summary line per request, and no prompt text without --log-prompts.
    let log = node.log();
    let line = log.lines().find(|l| l.contains("request finished") && l.contains("real-1"));
    let line = line.unwrap_or_else(|| panic!("no summary line for real-1 in:\n{log}"));
    for field in ["prompt_tokens=", "completion_tokens=16", "cached_tokens=", "ttft_ms=", "total_ms="] {
        assert!(line.contains(field), "{field} missing from {line:?}");
    }
    assert!(!log.contains("Once upon"), "the prompt text was logged:\n{log}");

    // A router with only ModelInfo tokenizes, and renders chat, exactly as the worker does.
    let info = client.model_info(pb::ModelInfoRequest {}).await.unwrap().into_inner();
    let router_tok = tokenizers::Tokenizer::from_bytes(&info.tokenizer_json).expect("tokenizer.json loads");
    let text = "Digits 12345, code `fn main() {}` and <|im_start|>user\nhi<|im_end|>";
    assert_eq!(router_tok.encode(text, false).unwrap().get_ids(), tok.encode(text, false).unwrap().as_slice());
    assert_eq!(info.chat_template.as_deref(), tok.chat_template());
    assert_eq!(info.eos_token_ids, tok.eos_ids());
    assert_eq!(info.bos_token_id, tok.bos_id());
    assert_eq!(info.kv_block_size, 16);
    assert_eq!(info.context_length, 8192);
    assert_eq!(info.architecture, "llama");
    // The default pool (512 MiB on the CPU) in whole blocks of 16 tokens.
    let block = 16 * 30 * 2 * 3 * 64 * 4;
    assert_eq!((info.kv_cache_bytes, info.device.as_str()), ((512 << 20) / block * block, "cpu"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_delta_interval_batches_tokens_without_changing_them_and_holds_the_first_only_when_asked() {
    // 5 ms steps: 40 tokens take about 200 ms, well inside one 30 s hold.
    let node = start_node(&sim(r#"{"base_us": 5000}"#)).await;
    let mut client = node.client().await;
    let messages = |mut stream: tonic::Streaming<pb::GenerateResponse>| async move {
        let mut out = Vec::new();
        while let Some(m) = stream.message().await.unwrap() {
            out.push(m.kind.expect("a response has a kind"));
        }
        out
    };
    let tokens = |ms: &[pb::generate_response::Kind]| -> Vec<u32> {
        ms.iter()
            .flat_map(|m| match m {
                pb::generate_response::Kind::Delta(d) => d.token_ids.clone(),
                pb::generate_response::Kind::Finished(_) => Vec::new(),
            })
            .collect()
    };
    let each = messages(client.generate(greedy((1..=20).collect(), 40)).await.unwrap().into_inner()).await;
    let held = pb::GenerateRequest { delta_interval_ms: 30_000, ..greedy((1..=20).collect(), 40) };
    let held = messages(client.generate(held).await.unwrap().into_inner()).await;
    let all =
        pb::GenerateRequest { delta_interval_ms: 30_000, hold_first_token: true, ..greedy((1..=20).collect(), 40) };
    let started = std::time::Instant::now();
    let all = messages(client.generate(all).await.unwrap().into_inner()).await;
    let took = started.elapsed();

    assert_eq!(tokens(&held), tokens(&each), "the same tokens either way");
    assert_eq!(tokens(&all), tokens(&each), "the same tokens either way");
    assert!(each.len() > 10, "without a hold, tokens go out step by step ({} messages)", each.len());
    // The first tokens go out at once; the rest wait for Finished, which flushes them.
    assert_eq!(held.len(), 3, "{held:?}");
    assert!(matches!(&held[0], pb::generate_response::Kind::Delta(d) if !d.token_ids.is_empty()));
    assert!(matches!(&held[1], pb::generate_response::Kind::Delta(_)));
    assert!(matches!(&held[2], pb::generate_response::Kind::Finished(_)));
    // Holding the first token too: one Delta beside Finished, saying how long its first token
    // waited (39 more steps of at least 5 ms came after it, and the whole call took `took`).
    assert_eq!(all.len(), 2, "{all:?}");
    let pb::generate_response::Kind::Delta(d) = &all[0] else { panic!("a Delta first: {all:?}") };
    assert_eq!(d.token_ids.len(), 40);
    let held_for = Duration::from_micros(d.first_token_held_us);
    assert!(held_for > Duration::ZERO && held_for < took, "held {held_for:?} of a {took:?} call");
    assert!(matches!(&all[1], pb::generate_response::Kind::Finished(_)));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_stream_frees_its_kv_blocks() {
    let node = start_node(&sim(r#"{"base_us": 20000}"#)).await;
    let mut client = node.client().await;
    let mut reports = watch(&mut client).await;

    let mut stream = client.generate(greedy((1..=40).collect(), 5000)).await.unwrap().into_inner();
    stream.message().await.unwrap().expect("a first delta");
    let busy = report_where(&mut reports, "the request holds blocks", |l| l.kv_blocks_used > 0).await;
    assert!(busy.kv_blocks_used >= 3, "40 prompt tokens need 3 blocks of 16");

    drop(stream); // the client cancels: nothing else tells the node
    report_where(&mut reports, "the blocks are free again", |l| l.kv_blocks_used == 0 && l.running_requests == 0).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn every_refusal_maps_to_its_status_code() {
    // Vocabulary 1024, context 1024 (1 MiB of simulated KV), one running and one waiting slot;
    // token 999 makes the simulated model fail.
    let mut args = sim(r#"{"base_us": 20000, "poison_token": 999}"#);
    args.extend(["--kv-cache-mb", "1", "--max-running", "1", "--max-waiting", "1"].map(String::from));
    let node = start_node(&args).await;
    let mut client = node.client().await;

    let refused = |r: Result<common::Completion, tonic::Status>| r.expect_err("must be refused");
    let invalid = [
        (greedy(vec![], 4), "prompt is empty"),
        (greedy(vec![1; 10], 1024), "maximum context length is 1024"),
        (greedy(vec![1, 5000], 4), "token id 5000 is outside the vocabulary"),
        (greedy(vec![1], 0), "max_tokens must be at least 1"),
        (
            pb::GenerateRequest {
                sampling: Some(pb::SamplingParams { top_p: Some(1.5), ..Default::default() }),
                ..greedy(vec![1], 4)
            },
            "top_p",
        ),
        (pb::GenerateRequest { stop: vec![String::new()], ..greedy(vec![1], 4) }, "stop"),
    ];
    for (req, reason) in invalid {
        let s = refused(generate(&mut client, req).await);
        assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
        assert!(s.message().contains(reason), "{:?} should say {reason:?}", s.message());
    }

    // Fill the one running and the one waiting slot; the next request finds the queue full.
    let mut reports = watch(&mut client).await;
    let running = client.generate(greedy(vec![1, 2, 3], 1000)).await.unwrap().into_inner();
    report_where(&mut reports, "one running", |l| l.running_requests == 1).await;
    let waiting = client.generate(greedy(vec![4, 5, 6], 1000)).await.unwrap().into_inner();
    report_where(&mut reports, "one waiting", |l| l.waiting_requests == 1).await;
    let full = refused(generate(&mut client, greedy(vec![7], 4)).await);
    assert_eq!(full.code(), Code::ResourceExhausted, "{full:?}");
    let retry_after: u64 =
        full.metadata().get("retry-after").expect("retry-after metadata").to_str().unwrap().parse().unwrap();
    assert!(retry_after >= 1);
    drop((running, waiting));
    report_where(&mut reports, "idle again", |l| l.running_requests == 0 && l.waiting_requests == 0).await;

    // A model failure mid-request ends the stream with INTERNAL.
    let failed = refused(generate(&mut client, greedy(vec![1, 999, 2], 4)).await);
    assert_eq!(failed.code(), Code::Internal, "{failed:?}");
    assert!(failed.message().contains("poison"), "{:?}", failed.message());

    // The node survives it.
    let ok = eventually("a request to succeed after the failure", Duration::from_secs(10), || {
        let mut c = client.clone();
        async move { generate(&mut c, greedy(vec![1, 2], 3)).await.ok() }
    })
    .await;
    assert_eq!(ok.tokens.len(), 3);
}
