//! Structured outputs in the engine, on the simulated model: the real scheduler, sampler and
//! grammar masks, with a model whose every logit is a pseudo-random function of its context.

use std::sync::Arc;

use bellows_common::constraint::Constraint;
use bellows_integration::schemas;
use bellows_worker::{
    engine::{Engine, EngineConfig, EngineHandle, EventStream},
    model::sim::{SimConfig, SimModel, SimVocab},
    request::{Event, FinishReason, GenerateRequest, SubmitError},
    sampling::SamplingParams,
};
use serde_json::json;

fn engine() -> Engine {
    let sim = SimConfig { base_us: 100, per_token_us: 2, per_sequence_us: 2, ..Default::default() };
    Engine::start(
        Box::new(SimModel::new(sim.clone())),
        Arc::new(SimVocab::new(sim.vocab_size)),
        EngineConfig::default(),
    )
    .expect("engine starts")
}

fn constrained(prompt: Vec<u32>, c: Constraint, params: SamplingParams, max_tokens: u32) -> GenerateRequest {
    GenerateRequest { constraint: Some(c), ..GenerateRequest::new(prompt, params, max_tokens) }
}

struct Outcome {
    tokens: Vec<u32>,
    text: String,
    reason: FinishReason,
}

fn collect(mut rx: EventStream) -> Outcome {
    let (mut tokens, mut text) = (Vec::new(), String::new());
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { id, text: t, .. } => {
                tokens.push(id);
                text += &t;
            }
            Event::Finished { text: t, reason, .. } => return Outcome { tokens, text: text + &t, reason },
            Event::Failed { message } => panic!("request failed: {message}"),
            Event::Progress(_) => {}
        }
    }
    panic!("stream closed without a final event")
}

fn run(h: &EngineHandle, r: GenerateRequest) -> Outcome {
    collect(h.submit(r).expect("accepted"))
}

#[test]
fn every_output_that_stops_matches_its_schema_over_200_generated_schemas() {
    let e = engine();
    let h = e.handle();
    let mut stopped = 0;
    // Sixteen at a time, so constrained rows share batches with each other.
    for batch in (0..200u64).collect::<Vec<_>>().chunks(16) {
        let streams: Vec<_> = batch
            .iter()
            .map(|&i| {
                let params = if i % 2 == 0 {
                    SamplingParams::greedy()
                } else {
                    SamplingParams { seed: Some(i), ..Default::default() }
                };
                let c = Constraint::JsonSchema(schemas::schema(i));
                (i, h.submit(constrained(vec![1 + i as u32, 7, 9], c, params, 600)).expect("accepted"))
            })
            .collect();
        for (i, rx) in streams {
            let out = collect(rx);
            if out.reason == FinishReason::Stop {
                stopped += 1;
                schemas::check_output(&schemas::schema(i), &out.text).unwrap_or_else(|e| panic!("schema {i}: {e}"));
                // JSON strings hold no raw newline: one here would be free whitespace.
                assert!(!out.text.contains('\n'), "schema {i}: JSON on one line: {:?}", out.text);
            }
        }
    }
    assert!(stopped >= 180, "only {stopped} of 200 finished within max_tokens");
}

#[test]
fn a_constrained_row_gives_the_same_tokens_alone_and_in_a_crowd() {
    let e = engine();
    let h = e.handle();
    let schema = schemas::schema(11);
    let sampled = SamplingParams { seed: Some(5), ..Default::default() };
    let alone = run(&h, constrained(vec![3, 4, 5], Constraint::JsonSchema(schema.clone()), sampled.clone(), 400));
    let crowd: Vec<_> = (0..8u32)
        .map(|k| {
            let r = if k % 2 == 0 {
                GenerateRequest::new(vec![20 + k, 4], SamplingParams::greedy(), 64)
            } else {
                constrained(vec![20 + k], Constraint::JsonObject, SamplingParams::greedy(), 64)
            };
            h.submit(r).expect("accepted")
        })
        .collect();
    let again = run(&h, constrained(vec![3, 4, 5], Constraint::JsonSchema(schema), sampled, 400));
    crowd.into_iter().for_each(|rx| drop(collect(rx)));
    assert_eq!(alone.tokens, again.tokens);
}

#[test]
fn unconstrained_rows_are_untouched_by_constrained_neighbours() {
    let e = engine();
    let h = e.handle();
    let free = run(&h, GenerateRequest::new(vec![8, 8, 8], SamplingParams::greedy(), 40));
    let neighbours: Vec<_> = (0..4u32)
        .map(|k| h.submit(constrained(vec![30 + k], Constraint::JsonObject, SamplingParams::greedy(), 64)).unwrap())
        .collect();
    let beside = run(&h, GenerateRequest::new(vec![8, 8, 8], SamplingParams::greedy(), 40));
    neighbours.into_iter().for_each(|rx| drop(collect(rx)));
    assert_eq!(free.tokens, beside.tokens);
    assert!(free.text.starts_with(" t"), "the sim's free text is its word tokens: {:?}", free.text);
}

#[test]
fn a_resumed_constrained_request_continues_exactly_and_stays_within_its_grammar() {
    let e = engine();
    let h = e.handle();
    let schema = schemas::schema(42);
    let params = SamplingParams { seed: Some(9), ..Default::default() };
    let prompt = vec![5u32, 6, 7];
    let whole = run(&h, constrained(prompt.clone(), Constraint::JsonSchema(schema.clone()), params.clone(), 500));
    assert_eq!(whole.reason, FinishReason::Stop);
    let k = whole.tokens.len() / 2;
    let mut resumed_prompt = prompt.clone();
    resumed_prompt.extend(&whole.tokens[..k]);
    let mut r = constrained(resumed_prompt, Constraint::JsonSchema(schema.clone()), params, 500 - k as u32);
    r.resumed_tokens = k;
    let rest = run(&h, r);
    assert_eq!(rest.tokens, whole.tokens[k..], "the continuation after the handover");
    schemas::check_output(&schema, &whole.text).unwrap();
}

#[test]
fn resumed_tokens_outside_the_grammar_are_refused() {
    let e = engine();
    let h = e.handle();
    let v = SimVocab::new(1024);
    let prompt = vec![1, v.byte_token(b'x')];
    let mut r = constrained(prompt, Constraint::JsonObject, SamplingParams::greedy(), 10);
    r.resumed_tokens = 1;
    assert!(matches!(h.submit(r), Err(SubmitError::InvalidConstraint(_))));
}

#[test]
fn a_grammar_that_cannot_finish_within_max_tokens_ends_with_length() {
    let e = engine();
    let h = e.handle();
    let c = Constraint::Regex("[a-z]{50}".into());
    let out = run(&h, constrained(vec![1, 2], c, SamplingParams::greedy(), 10));
    assert_eq!(out.reason, FinishReason::Length);
    assert_eq!(out.text.len(), 10);
    assert!(out.text.bytes().all(|b| b.is_ascii_lowercase()), "{:?}", out.text);
}

#[test]
fn a_regex_and_a_lark_grammar_constrain_the_whole_output() {
    let e = engine();
    let h = e.handle();
    let out =
        run(&h, constrained(vec![1], Constraint::Regex("(yes|no)-[0-9]{3}".into()), SamplingParams::greedy(), 20));
    assert_eq!(out.reason, FinishReason::Stop);
    assert!(out.text.len() >= 6 && (out.text.starts_with("yes-") || out.text.starts_with("no-")), "{:?}", out.text);
    let lark = "start: \"[\" num (\",\" num)* \"]\"\nnum: /[0-9]{1,2}/";
    let out = run(&h, constrained(vec![2], Constraint::Lark(lark.into()), SamplingParams::greedy(), 60));
    assert_eq!(out.reason, FinishReason::Stop);
    let v: Vec<u32> = serde_json::from_str(&out.text).unwrap_or_else(|e| panic!("{e}: {:?}", out.text));
    assert!(!v.is_empty());
}

#[test]
fn an_invalid_constraint_is_refused_at_submission() {
    let e = engine();
    let h = e.handle();
    let r = constrained(vec![1], Constraint::JsonSchema(json!({"type": "strin"})), SamplingParams::greedy(), 5);
    match h.submit(r) {
        Err(SubmitError::InvalidConstraint(m)) => assert!(m.contains("strin"), "{m}"),
        Err(other) => panic!("wrong refusal: {other}"),
        Ok(_) => panic!("an invalid schema was accepted"),
    }
    assert_eq!(h.stats().waiting_requests, 0, "a refusal holds no place in the queue");
}
