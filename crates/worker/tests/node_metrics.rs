//! The node's Prometheus endpoint (`--metrics-listen`, `GET /metrics`) against a
//! `bellows-worker serve` process on the simulated engine: counters move by exactly what the
//! requests did, every outcome is counted once, and the step histograms have samples.

mod common;

use std::time::Duration;

use common::{eventually, generate, greedy, sim, spawn_node, start_node};
use tonic::Code;

async fn scrape(addr: &str) -> String {
    let response = reqwest::get(format!("http://{addr}/metrics")).await.expect("the metrics endpoint answers");
    assert!(response.status().is_success(), "{}", response.status());
    let kind = response.headers()[reqwest::header::CONTENT_TYPE].to_str().unwrap().to_string();
    assert!(kind.starts_with("application/openmetrics-text"), "{kind}");
    response.text().await.unwrap()
}

/// The value of the sample named exactly `series` (name and labels as written).
fn value(text: &str, series: &str) -> f64 {
    let found = text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse::<f64>().ok());
    found.unwrap_or_else(|| panic!("no sample {series} in:\n{text}"))
}

fn outcome(text: &str, outcome: &str) -> f64 {
    value(text, &format!("bellows_worker_requests_total{{outcome=\"{outcome}\"}}"))
}

fn steps(text: &str, kind: &str) -> f64 {
    value(text, &format!("bellows_worker_step_duration_seconds_count{{kind=\"{kind}\"}}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_count_exactly_what_the_node_did() {
    // Port 0: the kernel picks a free port (no other test can take it first); the log says which.
    let mut args = sim(r#"{"base_us": 2000, "poison_token": 999}"#);
    args.extend(["--metrics-listen".to_string(), "127.0.0.1:0".to_string()]);
    let node = start_node(&args).await;
    let log = node.log();
    let addr = log
        .lines()
        .find(|l| l.contains("metrics listening"))
        .and_then(|l| l.split("address=").nth(1)?.split_whitespace().next())
        .unwrap_or_else(|| panic!("the metrics address is logged:\n{log}"))
        .to_string();

    let idle = scrape(&addr).await;
    assert!(value(&idle, "bellows_worker_kv_blocks_capacity") > 0.0);
    for series in [
        "bellows_worker_prompt_tokens_total",
        "bellows_worker_generated_tokens_total",
        "bellows_worker_prefix_cache_hit_tokens_total",
        "bellows_worker_running_requests",
        "bellows_worker_batch_tokens_count",
    ] {
        assert_eq!(value(&idle, series), 0.0, "{series} before any request");
    }

    // Two requests that finish; the second shares the first's leading 32 tokens (two blocks).
    let mut client = node.client().await;
    let first: Vec<u32> = (1..=40).collect();
    let second: Vec<u32> = (1..=40).chain(100..110).collect();
    let a = generate(&mut client, greedy(first.clone(), 8)).await.expect("finishes");
    let b = generate(&mut client, greedy(second.clone(), 5)).await.expect("finishes");
    let (ua, ub) = (a.finished.usage.unwrap(), b.finished.usage.unwrap());
    assert_eq!((ua.completion_tokens, ub.completion_tokens), (8, 5));
    assert!(ub.cached_prompt_tokens > 0, "the second request reuses the first one's blocks");

    // The engine counts a request finished just after sending its last message.
    let done = eventually("both requests counted", Duration::from_secs(10), || {
        let addr = addr.clone();
        async move {
            let text = scrape(&addr).await;
            (outcome(&text, "finished") == 2.0).then_some(text)
        }
    })
    .await;
    assert_eq!(value(&done, "bellows_worker_prompt_tokens_total"), (first.len() + second.len()) as f64);
    assert_eq!(value(&done, "bellows_worker_generated_tokens_total"), 13.0);
    assert_eq!(
        value(&done, "bellows_worker_prefix_cache_hit_tokens_total"),
        (ua.cached_prompt_tokens + ub.cached_prompt_tokens) as f64
    );
    for other in ["cancelled", "failed", "refused"] {
        assert_eq!(outcome(&done, other), 0.0, "{other}");
    }
    assert_eq!(value(&done, "bellows_worker_running_requests"), 0.0);
    assert_eq!(value(&done, "bellows_worker_waiting_requests"), 0.0);
    assert_eq!(value(&done, "bellows_worker_preemptions_total"), 0.0);

    // Every step is in exactly one kind, and in both batch histograms.
    let all_steps = steps(&done, "prefill") + steps(&done, "decode") + steps(&done, "mixed");
    assert!(steps(&done, "prefill") >= 1.0, "each prompt was prefilled alone:\n{done}");
    assert!(steps(&done, "decode") >= 1.0, "and then decoded alone:\n{done}");
    assert_eq!(value(&done, "bellows_worker_batch_tokens_count"), all_steps);
    assert_eq!(value(&done, "bellows_worker_batch_sequences_count"), all_steps);
    assert_eq!(
        value(&done, "bellows_worker_step_duration_seconds_bucket{le=\"+Inf\",kind=\"decode\"}"),
        steps(&done, "decode")
    );
    assert!(value(&done, "bellows_worker_step_duration_seconds_sum{kind=\"decode\"}") > 0.0);
    // Computed tokens: the uncached prompt tails and one per decode step row (every generated
    // token but the last is fed back).
    let uncached = (first.len() + second.len()) as u32 - ua.cached_prompt_tokens - ub.cached_prompt_tokens;
    assert_eq!(value(&done, "bellows_worker_batch_tokens_sum"), f64::from(uncached + 7 + 4));

    // One refused (a token outside the vocabulary), one failed (the simulated model's poison
    // token), one cancelled by its client.
    let refused = generate(&mut client, greedy(vec![1, 5000], 4)).await.expect_err("refused");
    assert_eq!(refused.code(), Code::InvalidArgument);
    generate(&mut client, greedy(vec![1, 999], 4)).await.expect_err("the model fails");
    let mut stream = client.generate(greedy((1..=20).collect(), 5000)).await.unwrap().into_inner();
    stream.message().await.unwrap().expect("a first delta");
    drop(stream);
    let after = eventually("the cancellation counted", Duration::from_secs(10), || {
        let addr = addr.clone();
        async move {
            let text = scrape(&addr).await;
            (outcome(&text, "cancelled") == 1.0).then_some(text)
        }
    })
    .await;
    assert_eq!(outcome(&after, "refused"), 1.0);
    assert_eq!(value(&after, "bellows_worker_refusals_total{reason=\"invalid\"}"), 1.0);
    assert_eq!(outcome(&after, "failed"), 1.0);
    assert_eq!(outcome(&after, "finished"), 2.0);
    assert_eq!(value(&after, "bellows_worker_running_requests"), 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_explicit_metrics_address_in_use_stops_the_node() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let mut args = sim("{}");
    args.extend(["--metrics-listen".to_string(), addr.clone()]);
    let mut node = spawn_node(&args);
    let status = node.0.wait_exit(Duration::from_secs(30));
    assert!(!status.success(), "the node must not run without the metrics it was asked for");
    assert!(node.log().contains(&format!("binding the metrics address {addr}")), "{}", node.log());
}
