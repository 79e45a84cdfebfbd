//! One multiplexed Session stream per worker: what it must keep true that one stream per request
//! gave for free. A router that dies frees its work on the worker at once; one slow client on the
//! stream does not hold up the others; a worker that speaks only the older protocol is still
//! served, per request. A router opens one session per thread, each serving its own share of
//! the HTTP connections.

use std::time::{Duration, Instant};

use bellows_integration::{Router, Worker, eventually, free_port, metric_at, sim};
use bellows_proto::worker::v1 as pb;
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn a_router_that_dies_frees_its_requests_on_the_worker_at_once() {
    // 4 requests of 8,000 tokens at 5 ms a step would run for 40 s if nothing cancelled them.
    let worker = Worker::start(&sim(r#"{"base_us": 5000, "per_token_us": 0, "per_sequence_us": 0}"#)).await;
    let mut router = Router::with_workers(&[&worker], &[] as &[&str]).await;
    let request = json!({"model": "sim", "prompt": [3, 4, 5], "max_tokens": 8000, "ignore_eos": true, "stream": true});
    let mut streams = Vec::new();
    for _ in 0..4 {
        let response = reqwest::Client::new().post(router.url("/v1/completions")).json(&request).send().await.unwrap();
        assert_eq!(response.status(), 200);
        let mut body = response.bytes_stream();
        body.next().await.expect("a first event").expect("it reads");
        streams.push(body);
    }
    let load = worker.load().await;
    assert_eq!(load.running_requests, 4, "{load:?}");
    assert!(load.kv_blocks_used > 0);

    router.process.kill();
    let load = eventually("the worker freed the dead router's sequences", Duration::from_secs(5), || async {
        let load = worker.load().await;
        (load.running_requests == 0 && load.waiting_requests == 0 && load.kv_blocks_used == 0).then_some(load)
    })
    .await;
    assert_eq!(load.kv_blocks_used, 0);
    drop(streams);
}

/// Open a streamed completion on a raw socket with a small receive buffer and read nothing, so
/// the router soon cannot write to it.
async fn slow_reader(router: &Router, body: &Value) -> tokio::net::TcpStream {
    let addr: std::net::SocketAddr = router.url.trim_start_matches("http://").parse().unwrap();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(addr).await.unwrap();
    let body = body.to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body.as_bytes()).await.unwrap();
    stream
}

/// A streamed completion read to its end: (seconds taken, completion tokens in its usage).
async fn timed_stream(router: &Router, max_tokens: u32) -> (f64, u64) {
    let body = json!({"model": "sim", "prompt": [7, 8], "max_tokens": max_tokens, "ignore_eos": true,
                      "stream": true, "stream_options": {"include_usage": true}});
    let started = Instant::now();
    let response = reqwest::Client::new().post(router.url("/v1/completions")).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let events = bellows_integration::sse(response).await;
    let usage = events.iter().rev().find_map(|e| e["usage"]["completion_tokens"].as_u64()).expect("a usage chunk");
    (started.elapsed().as_secs_f64(), usage)
}

#[tokio::test]
async fn a_slow_reader_does_not_hold_up_other_requests_on_the_same_worker() {
    // One worker, so every request shares its one session stream. Fast steps: the slow
    // reader's 30,000 tokens (about 4.5 MB of events) outgrow every socket buffer on the way.
    let worker = Worker::start(&sim(
        r#"{"base_us": 200, "per_token_us": 0, "per_sequence_us": 0, "context_length": 40000, "kv_bytes_per_token": 16}"#,
    ))
    .await;
    let router = Router::with_workers(&[&worker], &[] as &[&str]).await;
    let (unloaded, tokens) = timed_stream(&router, 200).await;
    assert_eq!(tokens, 200);

    let slow = json!({"model": "sim", "prompt": [3, 4], "max_tokens": 30000, "ignore_eos": true, "stream": true,
                      "stream_options": {"include_usage": true}});
    let mut stalled = slow_reader(&router, &slow).await;
    // Its answers pile up in the router: the client reads none and the sockets are full.
    eventually("the slow reader's answers wait in the router", Duration::from_secs(30), || async {
        (router.metric("bellows_router_session_buffered_messages").await >= 1000.0).then_some(())
    })
    .await;

    let (loaded, tokens) = tokio::time::timeout(Duration::from_secs(20), timed_stream(&router, 200))
        .await
        .expect("a request on the same stream is not stalled behind the slow reader");
    assert_eq!(tokens, 200);
    let still = router.metric("bellows_router_session_buffered_messages").await;
    assert!(still > 0.0, "the slow reader was still stalled while the other request ran");
    eprintln!("200-token stream: {unloaded:.3} s unloaded, {loaded:.3} s beside a stalled reader");
    // The bound: within 10x of unloaded, plus half a second for the shared 2 cores.
    assert!(loaded < unloaded * 10.0 + 0.5, "{loaded:.3} s beside the slow reader, {unloaded:.3} s alone");

    // The slow reader loses nothing: it reads its whole answer once it reads.
    let mut text = Vec::new();
    stalled.read_to_end(&mut text).await.unwrap();
    let text = String::from_utf8_lossy(&text);
    assert!(text.contains(r#""completion_tokens":30000"#), "its usage counts every token");
    assert!(text.contains("data: [DONE]"), "it ends as every stream does");
    assert_eq!(router.metric("bellows_router_session_buffered_messages").await, 0.0);
}

#[tokio::test]
async fn a_worker_speaking_only_generate_is_served_with_a_call_per_request() {
    let mut args = sim("{}");
    args.extend(["--protocol-version".to_string(), "1".to_string()]);
    let old = Worker::start(&args).await;
    // It really is an old peer: no Session RPC.
    let (_, outgoing) = tokio::sync::mpsc::unbounded_channel::<pb::SessionRequest>();
    let refused = old.client().await.session(tokio_stream::wrappers::UnboundedReceiverStream::new(outgoing)).await;
    assert_eq!(refused.err().map(|s| s.code()), Some(tonic::Code::Unimplemented));

    let router = Router::with_workers(&[&old], &[] as &[&str]).await;
    for stream in [false, true] {
        let body = json!({"model": "sim", "prompt": [5, 6], "max_tokens": 12, "temperature": 0, "stream": stream});
        let choices = router.choices("/v1/completions", &body).await;
        assert_eq!(choices[0].1, "length", "{choices:?}");
        assert_eq!(choices[0].0.split_whitespace().count(), 12, "{choices:?}");
    }
}

/// The worker's `bellows_worker_sessions` gauge, from its metrics port.
async fn open_sessions(metrics: &str) -> f64 {
    metric_at(&format!("http://{metrics}/metrics"), "bellows_worker_sessions").await
}

#[tokio::test]
async fn each_router_thread_opens_a_session_of_its_own_and_a_dead_routers_sessions_close_at_once() {
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut args = sim(r#"{"base_us": 2000, "per_token_us": 0, "per_sequence_us": 0}"#);
    args.extend(["--metrics-listen".to_string(), metrics.clone()]);
    let worker = Worker::start(&args).await;
    let mut router = Router::with_workers(&[&worker], &["--threads", "3"]).await;
    eventually("one session per router thread", Duration::from_secs(10), || async {
        (open_sessions(&metrics).await == 3.0).then_some(())
    })
    .await;

    // Connections go to the threads in turn: six clients of their own cover every thread twice,
    // and every answer arrives whole, side by side.
    let answers = futures_util::future::join_all((0..6).map(|i| {
        let router = &router;
        async move {
            let body = json!({"model": "sim", "prompt": [i + 1, 2], "max_tokens": 40, "ignore_eos": true,
                              "stream": i % 2 == 0, "stream_options": {"include_usage": true}});
            let client = reqwest::Client::new();
            let response = client.post(router.url("/v1/completions")).json(&body).send().await.unwrap();
            assert_eq!(response.status(), 200);
            if i % 2 == 0 {
                let events = bellows_integration::sse(response).await;
                events.iter().rev().find_map(|e| e["usage"]["completion_tokens"].as_u64())
            } else {
                let answer: Value = response.json().await.unwrap();
                answer["usage"]["completion_tokens"].as_u64()
            }
        }
    }))
    .await;
    assert_eq!(answers, vec![Some(40); 6]);
    assert_eq!(open_sessions(&metrics).await, 3.0, "no session was opened again");

    router.process.kill();
    eventually("the dead router's sessions are closed", Duration::from_secs(5), || async {
        (open_sessions(&metrics).await == 0.0).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_whole_answers_time_to_first_token_leaves_out_the_time_its_worker_held_the_token() {
    // 40 steps of 10 ms: the worker holds the first token until the 200 ms hold runs out, so
    // counting the hold would put the first token past 210 ms; without it, about 10 ms.
    let worker = Worker::start(&sim(r#"{"base_us": 10000, "per_token_us": 0, "per_sequence_us": 0}"#)).await;
    let router = Router::with_workers(&[&worker], &[] as &[&str]).await;
    let sums = || async {
        let metric = |name: &'static str| router.metric(name);
        [
            metric("bellows_router_time_to_first_token_seconds_count").await,
            metric("bellows_router_time_to_first_token_seconds_sum").await,
            metric("bellows_router_request_duration_seconds_sum").await,
        ]
    };
    let before = sums().await;
    let body = json!({"model": "sim", "prompt": [5, 6], "max_tokens": 40, "ignore_eos": true});
    let choices = router.choices("/v1/completions", &body).await;
    assert_eq!(choices[0].0.split_whitespace().count(), 40, "{choices:?}");
    let after = sums().await;

    let (count, ttft, whole) = (after[0] - before[0], after[1] - before[1], after[2] - before[2]);
    assert_eq!(count, 1.0, "one first token observed");
    assert!(whole > 0.3, "the answer outlasted the hold: {whole:.3} s");
    assert!(ttft > 0.0 && ttft < 0.11, "time to first token {ttft:.3} s of a {whole:.3} s answer");
}
