//! Scheduler properties on the simulated model: the real scheduler, block pool and prefix cache,
//! with the arithmetic replaced by a cost model. Fast, so these run on every `cargo test`.

use std::{
    sync::{Arc, Barrier},
    time::{Duration, Instant},
};

use bellows_common::{
    prefix_hash::{ChainRoot, prefix_block_hashes},
    priority::Priority,
};
use bellows_worker::{
    engine::{Engine, EngineConfig, EngineHandle},
    kv_cache::KvEvent,
    model::sim::{SimConfig, SimModel, SimVocab},
    request::{Event, FinishReason, GenerateRequest, SubmitError, Usage},
    sampling::SamplingParams,
    scheduler::SchedulerConfig,
};

fn sim_engine(sim: SimConfig, cfg: EngineConfig) -> Engine {
    let vocab = Arc::new(SimVocab::new(sim.vocab_size));
    Engine::start(Box::new(SimModel::new(sim)), vocab, cfg).expect("engine starts")
}

fn fast() -> SimConfig {
    SimConfig { base_us: 200, per_token_us: 5, per_sequence_us: 5, ..Default::default() }
}

fn req(prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
    GenerateRequest::new(prompt, SamplingParams::greedy(), max_tokens)
}

struct Outcome {
    tokens: Vec<u32>,
    text: String,
    reason: FinishReason,
    usage: Usage,
    first_token_at: Option<Instant>,
}

fn collect(mut rx: bellows_worker::engine::EventStream) -> Outcome {
    let (mut tokens, mut text, mut first) = (Vec::new(), String::new(), None);
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { id, text: t, .. } => {
                first.get_or_insert_with(Instant::now);
                tokens.push(id);
                text += &t;
            }
            Event::Finished { text: t, reason, usage, .. } => {
                return Outcome { tokens, text: text + &t, reason, usage, first_token_at: first };
            }
            Event::Failed { message } => panic!("request failed: {message}"),
            Event::Progress(_) => {}
        }
    }
    panic!("stream closed without a final event")
}

fn run(h: &EngineHandle, r: GenerateRequest) -> Outcome {
    collect(h.submit(r).expect("accepted"))
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn every_invalid_request_is_refused_with_its_own_error_before_any_work() {
    let e = sim_engine(fast(), EngineConfig { kv_cache_mb: Some(1), ..Default::default() });
    let h = e.handle();
    let ctx = h.context_length();
    assert_eq!(h.submit(req(vec![], 4)).unwrap_err(), SubmitError::EmptyPrompt);
    assert_eq!(
        h.submit(req(vec![1, 5000], 4)).unwrap_err(),
        SubmitError::TokenOutOfVocabulary { token: 5000, vocab: 1024 }
    );
    assert_eq!(h.submit(req(vec![1], 0)).unwrap_err(), SubmitError::ZeroMaxTokens);
    assert_eq!(
        h.submit(req(vec![1; 10], ctx as u32)).unwrap_err(),
        SubmitError::ContextExceeded { prompt: 10, completion: ctx, context: ctx }
    );
    let mut bad = req(vec![1], 4);
    bad.params.top_p = 1.5;
    assert!(matches!(h.submit(bad).unwrap_err(), SubmitError::InvalidParameter { param: "top_p", .. }));
    let mut all_resumed = req(vec![1, 2], 4);
    all_resumed.resumed_tokens = 2;
    assert!(matches!(
        h.submit(all_resumed).unwrap_err(),
        SubmitError::InvalidParameter { param: "resumed_tokens", .. }
    ));
    assert_eq!(h.stats().steps, 0, "refusals must not run the model");
}

#[test]
fn the_context_is_bounded_by_the_kv_pool_so_no_lone_request_can_exhaust_it() {
    // 1 MiB at 1 KiB/token (sim) = 1024 tokens, below the model's 8192.
    let e = sim_engine(fast(), EngineConfig { kv_cache_mb: Some(1), ..Default::default() });
    assert_eq!(e.handle().context_length(), 1024);
    let out = run(&e.handle(), GenerateRequest { max_tokens: None, ..req(vec![1; 1000], 1) });
    assert_eq!(out.usage.completion_tokens, 24, "max_tokens defaults to what the context leaves");
    assert_eq!(out.reason, FinishReason::Length);
}

#[test]
fn concurrent_submitters_never_push_the_queue_past_its_cap() {
    // One slow step keeps the engine from admitting anything while 8 threads race to submit.
    let sim = SimConfig { base_us: 1_500_000, ..fast() };
    let e = sim_engine(
        sim,
        EngineConfig {
            scheduler: SchedulerConfig { max_waiting: 10, max_running: 1, ..Default::default() },
            ..Default::default()
        },
    );
    let h = e.handle();
    let _busy = h.submit(req(vec![1, 2, 3], 2)).unwrap();
    wait_until("first request admitted", || h.stats().running_requests == 1 && h.stats().steps == 0);
    let barrier = Arc::new(Barrier::new(8));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (h, b) = (h.clone(), barrier.clone());
            std::thread::spawn(move || {
                b.wait();
                (0..25).map(|_| h.submit(req(vec![4, 5], 1))).collect::<Vec<_>>()
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
    let accepted = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(accepted, 10);
    for r in results.iter().filter_map(|r| r.as_ref().err()) {
        match r {
            SubmitError::QueueFull { cap: 10, retry_after } => assert!(*retry_after > Duration::ZERO),
            other => panic!("unexpected refusal {other:?}"),
        }
    }
    assert!(h.stats().waiting_requests <= 10);
}

#[test]
fn a_panic_in_the_model_fails_only_that_steps_requests_and_the_engine_lives_on() {
    let e = sim_engine(SimConfig { poison_token: Some(666), ..fast() }, EngineConfig::default());
    let h = e.handle();
    let mut rx = h.submit(req(vec![1, 666, 2], 4)).unwrap();
    let ev = rx.blocking_recv().expect("an event");
    assert!(matches!(&ev, Event::Failed { message } if message.contains("poison")), "got {ev:?}");
    let ok = run(&h, req(vec![1, 2, 3], 5));
    assert_eq!(ok.tokens.len(), 5);
    assert_eq!(h.stats().requests_failed, 1);
    wait_until("blocks of the failed request freed", || h.stats().kv_blocks_used == 0);
}

#[test]
fn dropping_the_receiver_cancels_the_request_and_frees_its_blocks() {
    let e = sim_engine(SimConfig { base_us: 2000, ..fast() }, EngineConfig::default());
    let h = e.handle();
    let mut rx = h.submit(req(vec![7; 100], 1000)).unwrap();
    for _ in 0..3 {
        rx.blocking_recv().unwrap();
    }
    assert!(h.stats().kv_blocks_used > 0);
    drop(rx);
    wait_until("cancelled request reaped", || {
        let s = h.stats();
        s.kv_blocks_used == 0 && s.running_requests == 0 && s.requests_cancelled == 1
    });
}

#[test]
fn a_long_prompt_neither_starves_a_short_one_nor_freezes_running_streams() {
    // 32 tokens a step: the 2,000-token prompt needs ~63 steps of prefill.
    let e = sim_engine(
        fast(),
        EngineConfig {
            scheduler: SchedulerConfig { max_batch_tokens: 32, max_running: 8, ..Default::default() },
            ..Default::default()
        },
    );
    let h = e.handle();
    let mut running = h.submit(req(vec![3; 8], 500)).unwrap();
    running.blocking_recv().unwrap(); // decoding
    let long = h.submit(req(vec![5; 2000], 1)).unwrap();
    let short = h.submit(req(vec![6; 10], 1)).unwrap();
    let steps_before = h.stats().steps;
    let long = std::thread::spawn(move || collect(long));
    let short = collect(short);
    let long = long.join().unwrap();
    assert!(short.first_token_at < long.first_token_at, "the short prompt must not wait behind the long one");
    let steps = h.stats().steps - steps_before;
    let mut got = 0;
    while let Ok(Event::Token { .. }) = running.try_recv() {
        got += 1;
    }
    // One token per step while the long prompt prefilled (allow the first and last step).
    assert!(got as u64 + 2 >= steps, "running stream got {got} tokens over {steps} steps");
}

#[test]
fn prefix_hits_skip_prefill_and_report_cached_tokens() {
    let e = sim_engine(fast(), EngineConfig::default());
    let h = e.handle();
    let prompt: Vec<u32> = (1..=100).collect();
    let cold = run(&h, req(prompt.clone(), 8));
    assert_eq!(cold.usage.cached_tokens, 0);
    let before = h.stats().prefill_tokens;
    let warm = run(&h, req(prompt.clone(), 8));
    assert_eq!(warm.usage.cached_tokens, 96, "6 full blocks of 16");
    assert_eq!(h.stats().prefill_tokens - before, 4, "only the uncached tail is prefilled");
    assert_eq!(cold.tokens, warm.tokens);

    // A tenant salt isolates the cache.
    let mut salted = req(prompt, 8);
    salted.cache_salt = Some("tenant-b".into());
    assert_eq!(run(&h, salted).usage.cached_tokens, 0);
}

#[test]
fn a_queued_request_counts_only_the_prefill_its_cached_prefix_leaves() {
    // One running slot held by a slow request, so everything after it waits.
    let sim = SimConfig { base_us: 50_000, ..fast() };
    let cfg =
        EngineConfig { scheduler: SchedulerConfig { max_running: 1, ..Default::default() }, ..Default::default() };
    let e = sim_engine(sim, cfg);
    let h = e.handle();
    let shared: Vec<u32> = (1..=100).collect();
    run(&h, req(shared.clone(), 1)); // caches 6 blocks of 16
    let _busy = h.submit(req(vec![9; 4], 1000)).unwrap();
    wait_until("slot taken", || h.stats().running_requests == 1);
    let hit = h.submit(req([shared.clone(), vec![500; 20]].concat(), 1)).unwrap();
    let cold = h.submit(req((200..300).collect(), 1)).unwrap();
    wait_until("both queued in the scheduler", || h.stats().waiting_prompt_tokens >= 124);
    // The hit waits for 120 - 96 tokens of prefill, the cold one for all 100.
    assert_eq!(h.stats().waiting_prompt_tokens, 24 + 100);
    drop((hit, cold));
}

#[test]
fn kv_events_carry_the_same_hashes_the_router_computes() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let e = sim_engine(fast(), EngineConfig::default());
    let h = e.handle();
    let mut sub = rt.block_on(h.subscribe_kv()).unwrap();
    assert!(sub.snapshot.is_empty());
    let prompt: Vec<u32> = (1..=40).collect();
    let out = run(&h, req(prompt.clone(), 1));
    assert_eq!(out.usage.completion_tokens, 1);

    let root = ChainRoot::for_model("sim", None);
    let expected = prefix_block_hashes(&prompt, 16, root);
    // The engine publishes a step's events after the step, so they may trail its Finished.
    let mut stored = Vec::new();
    while stored.len() < expected.len() {
        let batch = rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(20), sub.events.recv()).await })
            .expect("the step's KV events arrive")
            .expect("the engine is running");
        stored.extend(batch.into_iter().filter_map(|e| match e {
            KvEvent::Stored(h) => Some(h),
            KvEvent::Evicted(_) => None,
        }));
    }
    assert_eq!(stored, expected);

    let late = rt.block_on(h.subscribe_kv()).unwrap();
    let mut want = expected.clone();
    want.sort();
    assert_eq!(late.snapshot, want, "a late subscriber starts from the cache as it is");
}

#[test]
fn a_full_pool_evicts_cached_blocks_and_says_so() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let e = sim_engine(
        SimConfig { context_length: 64, ..fast() },
        EngineConfig { kv_cache_mb: Some(1), ..Default::default() },
    );
    let h = e.handle();
    let mut sub = rt.block_on(h.subscribe_kv()).unwrap();
    // 64 blocks in 1 MiB; fill them with distinct prompts of 2 full blocks each (the first
    // token differs, so every chained hash does).
    for i in 0..40u32 {
        let prompt: Vec<u32> = (0..33).map(|t| if t == 0 { i + 1 } else { 500 + t }).collect();
        run(&h, req(prompt, 1));
    }
    let (mut stored, mut evicted) = (0, 0);
    while stored < 80 {
        let batch = rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(10), sub.events.recv()).await })
            .expect("events arrive")
            .expect("stream open");
        for ev in batch {
            match ev {
                KvEvent::Stored(_) => stored += 1,
                KvEvent::Evicted(_) => evicted += 1,
            }
        }
    }
    assert!(evicted >= 80 - 64, "stored {stored}, evicted {evicted}");
    assert_eq!(rt.block_on(h.subscribe_kv()).unwrap().snapshot.len(), stored - evicted);
}

#[test]
fn preemption_under_a_tiny_pool_still_completes_every_request_identically() {
    let prompts: Vec<Vec<u32>> = (0..6u32).map(|i| (0..20).map(|t| 1 + (i * 31 + t) % 900).collect()).collect();
    let alone: Vec<Vec<u32>> = {
        let e = sim_engine(fast(), EngineConfig::default());
        prompts.iter().map(|p| run(&e.handle(), req(p.clone(), 60)).tokens).collect()
    };
    // 1 MiB at 16 KiB/token = 64 tokens = 4 blocks; six requests of 80 tokens each must take turns.
    let sim = SimConfig { kv_bytes_per_token: 16 << 10, ..fast() };
    let e = sim_engine(sim, EngineConfig { kv_cache_mb: Some(1), ..Default::default() });
    let h = e.handle();
    let rxs: Vec<_> = prompts.iter().map(|p| h.submit(req(p.clone(), 40)).unwrap()).collect();
    let together: Vec<Vec<u32>> = rxs.into_iter().map(|rx| collect(rx).tokens).collect();
    assert_eq!(together.iter().map(|t| t.len()).collect::<Vec<_>>(), vec![40; 6]);
    assert_eq!(together, alone.iter().map(|t| t[..40].to_vec()).collect::<Vec<_>>());
    assert!(h.stats().preemptions > 0, "the pool is too small for all six at once");
    wait_until("all blocks released", || h.stats().kv_blocks_used == 0);
}

#[test]
fn stop_tokens_and_stop_strings_end_the_stream_and_are_not_sent() {
    let e = sim_engine(fast(), EngineConfig::default());
    let h = e.handle();
    let free = run(&h, req(vec![1, 2, 3], 10));
    // Stop on the 4th generated token id.
    let mut r = req(vec![1, 2, 3], 10);
    r.stop_token_ids = vec![free.tokens[3]];
    let out = run(&h, r);
    assert_eq!(out.reason, FinishReason::Stop);
    assert_eq!(out.tokens, free.tokens[..4]);
    assert_eq!(out.usage.completion_tokens, 4);
    let expected: String = free.tokens[..3].iter().map(|t| format!(" t{t}")).collect();
    assert_eq!(out.text, expected);

    // A stop string that spans two tokens' text.
    let t4 = format!(" t{}", free.tokens[4]);
    let stop = format!("{}{}", &format!(" t{}", free.tokens[3])[2..], &t4[..2]);
    let mut r = req(vec![1, 2, 3], 10);
    r.stop = vec![stop.clone()];
    let out = run(&h, r);
    assert_eq!(out.reason, FinishReason::Stop);
    let cut = free.text.find(&stop).unwrap();
    assert_eq!(out.text, free.text[..cut]);
}

fn with_logprobs(prompt: Vec<u32>, top: u32) -> GenerateRequest {
    GenerateRequest { top_logprobs: Some(top), ..req(prompt, 12) }
}

fn logprobs_of(mut rx: bellows_worker::engine::EventStream) -> Vec<(u32, bellows_worker::request::TokenLogprobs)> {
    let mut out = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { id, logprobs, .. } => out.push((id, logprobs.expect("asked for logprobs"))),
            Event::Finished { .. } => return out,
            Event::Failed { message } => panic!("request failed: {message}"),
            Event::Progress(_) => {}
        }
    }
    panic!("stream closed without a final event")
}

#[test]
fn greedy_logprobs_put_the_chosen_token_first_and_do_not_depend_on_the_batch() {
    let e = sim_engine(fast(), EngineConfig::default());
    let h = e.handle();
    let alone = logprobs_of(h.submit(with_logprobs(vec![4, 5, 6], 5)).unwrap());
    assert_eq!(alone.len(), 12);
    for (id, lp) in &alone {
        assert_eq!(lp.top.len(), 5);
        assert_eq!(lp.top[0].token, *id, "greedy picks the most likely token");
        assert_eq!(lp.top[0].logprob, lp.logprob);
        assert!(lp.logprob <= 0.0 && lp.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
    }
    let crowd: Vec<_> = (0..6).map(|k| h.submit(req(vec![40 + k, 1], 30)).unwrap()).collect();
    let beside = logprobs_of(h.submit(with_logprobs(vec![4, 5, 6], 5)).unwrap());
    crowd.into_iter().for_each(|rx| drop(collect(rx)));
    assert_eq!(alone, beside, "bit for bit, whatever shares the batch");
    let none = collect(h.submit(req(vec![4, 5, 6], 12)).unwrap());
    assert_eq!(none.tokens, alone.iter().map(|(id, _)| *id).collect::<Vec<_>>(), "asking changes no token");
    let too_many = h.submit(with_logprobs(vec![1], 21)).unwrap_err();
    assert!(matches!(too_many, SubmitError::InvalidParameter { param: "top_logprobs", .. }), "{too_many}");
}

fn classed(prompt: Vec<u32>, max_tokens: u32, priority: Priority) -> GenerateRequest {
    GenerateRequest { priority, ..req(prompt, max_tokens) }
}

fn engine_with(sim: SimConfig, scheduler: SchedulerConfig) -> Engine {
    sim_engine(sim, EngineConfig { scheduler, ..Default::default() })
}

#[test]
fn higher_classes_take_the_slots_batch_leaves_free_and_wait_ahead_of_batch() {
    // Four slots: batch fills three, the fourth is the higher classes' reserve.
    let sim = SimConfig { base_us: 2000, ..fast() };
    let e = engine_with(sim, SchedulerConfig { max_running: 4, ..Default::default() });
    let h = e.handle();
    let running: Vec<_> = (0..3).map(|i| h.submit(classed(vec![1 + i; 4], 40, Priority::Batch)).unwrap()).collect();
    let queued: Vec<_> = (0..4).map(|i| h.submit(classed(vec![10 + i; 4], 40, Priority::Batch)).unwrap()).collect();
    wait_until("three batch requests running, four waiting", || {
        let s = h.stats();
        s.running_requests == 3 && s.waiting_requests == 4
    });
    let reserved = h.submit(classed(vec![20; 4], 4, Priority::Standard)).unwrap();
    wait_until("the standard request in the reserved slot", || h.stats().running_requests == 4);
    // No slot left: this one waits, but ahead of the four batch requests queued before it.
    let next = h.submit(classed(vec![21; 4], 4, Priority::Interactive)).unwrap();
    let queued: Vec<_> = queued.into_iter().map(|rx| std::thread::spawn(move || collect(rx))).collect();
    let (reserved, next) = (collect(reserved), collect(next));
    let batch_first = queued
        .into_iter()
        .map(|t| t.join().unwrap().first_token_at.expect("batch completes"))
        .min()
        .expect("four batch requests");
    assert!(reserved.first_token_at.unwrap() < batch_first);
    assert!(next.first_token_at.unwrap() < batch_first, "the interactive request waited behind batch work");
    running.into_iter().for_each(|rx| assert_eq!(collect(rx).tokens.len(), 40));
    assert_eq!(h.stats().preemptions, 0, "every batch request was streaming or waiting: none preempted");
}

#[test]
fn a_higher_class_arrival_preempts_a_prefilling_lower_one_which_resumes_and_completes_identically() {
    let long: Vec<u32> = (0..2000).map(|t| 1 + t % 900).collect();
    let alone = run(&sim_engine(fast(), EngineConfig::default()).handle(), req(long.clone(), 8)).tokens;
    // One slot and 32 tokens a step: the batch prompt is still prefilling when the other arrives.
    let e = engine_with(fast(), SchedulerConfig { max_running: 1, max_batch_tokens: 32, ..Default::default() });
    let h = e.handle();
    let batch = h.submit(classed(long, 8, Priority::Batch)).unwrap();
    wait_until("the batch prompt prefilling", || h.stats().prefill_tokens >= 64);
    let urgent = collect(h.submit(classed(vec![7; 8], 4, Priority::Interactive)).unwrap());
    let batch = collect(batch);
    assert!(urgent.first_token_at < batch.first_token_at, "the interactive request waited for a whole prefill");
    assert_eq!(batch.tokens, alone, "the preempted request starts over and ends as it would have");
    assert_eq!(h.stats().preemptions, 1);
}

#[test]
fn a_lower_class_request_already_streaming_keeps_its_slot_when_a_higher_class_arrives() {
    let e = engine_with(fast(), SchedulerConfig { max_running: 1, ..Default::default() });
    let h = e.handle();
    let mut batch = h.submit(classed(vec![3; 8], 200, Priority::Batch)).unwrap();
    while !matches!(batch.blocking_recv(), Some(Event::Token { .. })) {}
    let urgent = h.submit(classed(vec![7; 8], 4, Priority::Interactive)).unwrap();
    let urgent = std::thread::spawn(move || collect(urgent));
    let batch = collect(batch);
    let urgent = urgent.join().unwrap();
    assert_eq!(batch.tokens.len(), 199, "the batch stream ran to its end");
    assert!(batch.first_token_at < urgent.first_token_at, "the interactive request waited for the slot");
    assert_eq!(h.stats().preemptions, 0);
}

#[test]
fn when_the_pool_runs_out_the_lowest_class_gives_back_its_blocks_first_and_loses_no_token() {
    let alone = run(&sim_engine(fast(), EngineConfig::default()).handle(), classed(vec![3; 8], 40, Priority::Batch));
    // 4 blocks of 16 tokens; each request grows to 3 blocks: both cannot finish together.
    let sim = SimConfig { kv_bytes_per_token: 16 << 10, ..fast() };
    let e = sim_engine(sim, EngineConfig { kv_cache_mb: Some(1), ..Default::default() });
    let h = e.handle();
    let mut batch = h.submit(classed(vec![3; 8], 40, Priority::Batch)).unwrap();
    while !matches!(batch.blocking_recv(), Some(Event::Token { .. })) {}
    // Newer than the batch stream: a class-blind pool would take its blocks back first.
    let urgent = h.submit(classed(vec![4; 8], 40, Priority::Interactive)).unwrap();
    let ended = |rx| std::thread::spawn(move || (collect(rx), Instant::now()));
    let (batch, urgent) = (ended(batch), ended(urgent));
    let ((batch, batch_end), (urgent, urgent_end)) = (batch.join().unwrap(), urgent.join().unwrap());
    assert_eq!((batch.tokens.len(), urgent.tokens.len()), (39, 40));
    assert!(h.stats().preemptions > 0, "the pool is too small for both");
    assert!(urgent_end < batch_end, "the interactive stream was preempted for the batch one");
    // The batch stream was preempted while streaming: it recomputed and went on, token-exact.
    assert_eq!(batch.tokens, alone.tokens[1..], "the preempted stream lost, repeated or changed a token");
}
