//! The shared response store on a real PostgreSQL server: router replicas continue, read and
//! delete each other's responses; the store keeps tenants apart, expires and stays bounded; and
//! a store that is down or hung fails only the requests that read it.

use std::{sync::Arc, time::Duration};

use bellows_integration::{Router, Worker, eventually, postgres::Postgres, sim, sse_named};
use bellows_router::api::responses::{
    postgres::{PgConfig, PgStore},
    store::{ResponseStore, Stored},
};
use serde_json::{Value, json};

fn turn(input: &str, previous: Option<&str>) -> Value {
    let mut b = json!({"model": "sim", "input": input, "max_output_tokens": 8, "temperature": 0});
    if let Some(id) = previous {
        b["previous_response_id"] = json!(id);
    }
    b
}

async fn call(router: &Router, method: reqwest::Method, path: &str, body: Option<&Value>) -> (u16, Value) {
    let mut r = reqwest::Client::new().request(method, router.url(path));
    if let Some(b) = body {
        r = r.json(b);
    }
    let r = r.send().await.expect("the router answers");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn create(router: &Router, body: &Value) -> Value {
    let (status, r) = call(router, reqwest::Method::POST, "/v1/responses", Some(body)).await;
    assert_eq!(status, 200, "{r}");
    r
}

/// Wait until the router's store has its schema (it is applied in the background at start).
async fn until_stored(router: &Router) -> Value {
    eventually("the router stores a response", Duration::from_secs(30), || async {
        let r = create(router, &turn("Is the store up?", None)).await;
        let id = r["id"].as_str().unwrap();
        let (status, _) = call(router, reqwest::Method::GET, &format!("/v1/responses/{id}"), None).await;
        (status == 200).then_some(r)
    })
    .await
}

#[tokio::test]
async fn a_second_router_continues_reads_and_deletes_what_the_first_stored() {
    let pg = Postgres::start().await;
    let worker = Worker::start(&sim(r#"{"base_us": 200}"#)).await;
    let first = Router::with_workers(&[&worker], &pg.router_flags()).await;
    let second = Router::with_workers(&[&worker], &pg.router_flags()).await;
    until_stored(&first).await;
    until_stored(&second).await;

    let one = create(&first, &turn("My name is Ada. Remember it.", None)).await;
    let id = one["id"].as_str().unwrap();
    let (status, read) = call(&second, reqwest::Method::GET, &format!("/v1/responses/{id}"), None).await;
    assert_eq!(status, 200, "{read}");
    assert_eq!(read, one, "the second replica reads the response the first stored, as it was returned");

    let two = create(&second, &turn("What is my name?", Some(id))).await;
    assert_eq!(two["previous_response_id"], json!(id));
    let (first_in, first_out) =
        (one["usage"]["input_tokens"].as_u64().unwrap(), one["usage"]["output_tokens"].as_u64().unwrap());
    assert!(
        two["usage"]["input_tokens"].as_u64().unwrap() > first_in + first_out,
        "the continuation's prompt holds the first turn and its answer: {two}"
    );
    let (status, items) =
        call(&first, reqwest::Method::GET, &format!("/v1/responses/{}/input_items", two["id"].as_str().unwrap()), None)
            .await;
    assert_eq!(status, 200, "{items}");
    assert_eq!(items["data"][0]["content"][0]["text"], "What is my name?", "{items}");

    let (status, deleted) = call(&second, reqwest::Method::DELETE, &format!("/v1/responses/{id}"), None).await;
    assert_eq!((status, &deleted["deleted"]), (200, &json!(true)), "{deleted}");
    let (status, gone) = call(&first, reqwest::Method::GET, &format!("/v1/responses/{id}"), None).await;
    assert_eq!(status, 404, "a response deleted on one replica is gone on every replica: {gone}");
    let (status, refused) =
        call(&first, reqwest::Method::POST, "/v1/responses", Some(&turn("And now?", Some(id)))).await;
    assert_eq!(status, 404, "{refused}");
    assert_eq!(refused["error"]["param"], "previous_response_id", "{refused}");
}

/// The model answered (the sim engine runs to `max_output_tokens`, so the status is incomplete).
fn assert_answered(r: &Value) {
    assert_eq!((&r["status"], &r["error"]), (&json!("incomplete"), &Value::Null), "{r}");
    assert_eq!(r["usage"]["output_tokens"], 8, "{r}");
}

#[tokio::test]
async fn a_store_that_is_down_or_hung_fails_only_the_requests_that_read_it() {
    let mut pg = Postgres::start().await;
    let worker = Worker::start(&sim(r#"{"base_us": 200}"#)).await;
    pg.kill();
    let mut flags = pg.router_flags();
    flags.extend(["--responses-store-timeout".into(), "500ms".into()]);
    let router = Router::with_workers(&[&worker], &flags).await;

    // Down since before the router started: it serves, and a write that fails is not an error.
    let plain = create(&router, &turn("Hello there.", None)).await;
    assert_answered(&plain);
    let r = reqwest::Client::new()
        .post(router.url("/v1/responses"))
        .json(&json!({"model": "sim", "input": "Hello again.", "max_output_tokens": 8, "stream": true}))
        .send()
        .await
        .unwrap();
    let events = sse_named(r).await;
    let (last, response) = events.last().expect("events");
    assert_eq!(last, "response.incomplete", "ended by max_output_tokens, not failed: {events:?}");
    assert_answered(&response["response"]);
    let (status, refused) = call(
        &router,
        reqwest::Method::POST,
        "/v1/responses",
        Some(&turn("More.", Some(plain["id"].as_str().unwrap()))),
    )
    .await;
    assert_eq!(status, 503, "a continuation needs the store: {refused}");
    assert_eq!(refused["error"]["code"], "store_unavailable", "{refused}");

    // Back: the router applies the schema by itself and stores again.
    pg.restart().await;
    let stored = until_stored(&router).await;

    // Hung (SIGSTOP, connections open): writes give up at the deadline, the answer still comes.
    pg.freeze();
    assert_answered(&create(&router, &turn("Are you there?", None)).await);
    let (status, refused) = call(
        &router,
        reqwest::Method::POST,
        "/v1/responses",
        Some(&turn("More.", Some(stored["id"].as_str().unwrap()))),
    )
    .await;
    assert_eq!(status, 503, "{refused}");
    pg.thaw();
    let again = create(&router, &turn("More.", Some(stored["id"].as_str().unwrap()))).await;
    assert_eq!(again["previous_response_id"], stored["id"], "{again}");
}

fn config(pg: &Postgres, ttl: Duration, max_bytes: usize) -> PgConfig {
    PgConfig {
        url: pg.url(),
        password_file: Some(pg.password_file()),
        ttl,
        max_bytes,
        timeout: Duration::from_secs(5),
        sweep_every: Duration::from_secs(3600),
    }
}

fn stored(text: &str) -> Stored {
    Stored { response: json!({"text": text}), input_items: vec![json!(text)], context: vec![json!(text)] }
}

async fn ready(store: &PgStore) {
    eventually("the store's schema is applied", Duration::from_secs(30), || async {
        store.put("probe", "resp_probe", stored("probe")).await.ok()
    })
    .await;
    store.delete("probe", "resp_probe").await.unwrap();
}

#[tokio::test]
async fn replicas_starting_together_apply_the_schema_once_and_share_rows_by_tenant() {
    let pg = Postgres::start().await;
    let stores: Vec<Arc<PgStore>> =
        (0..4).map(|_| PgStore::start(&config(&pg, Duration::from_secs(60), 1 << 20)).unwrap()).collect();
    for s in &stores {
        ready(s).await;
    }
    stores[0].put("a", "resp_1", stored("x")).await.unwrap();
    assert_eq!(stores[1].get("a", "resp_1").await.unwrap(), Some(stored("x")));
    assert_eq!(stores[2].get("b", "resp_1").await.unwrap(), None, "another tenant's id is unknown");
    assert!(!stores[2].delete("b", "resp_1").await.unwrap(), "nor can it be deleted");
    stores[3].put("a", "resp_1", stored("y")).await.unwrap();
    assert_eq!(stores[0].get("a", "resp_1").await.unwrap(), Some(stored("y")), "a second write replaces the first");
    assert!(stores[1].delete("a", "resp_1").await.unwrap());
    assert_eq!(stores[0].get("a", "resp_1").await.unwrap(), None);
    let versions = pg.client().await.query("SELECT version FROM refinery_schema_history", &[]).await.unwrap();
    assert_eq!(versions.len(), 1, "four replicas applied the one migration once");
}

#[tokio::test]
async fn expired_responses_are_unreadable_and_the_sweep_keeps_the_newest_within_the_bound() {
    let pg = Postgres::start().await;
    let expiring = PgStore::start(&config(&pg, Duration::ZERO, 1 << 20)).unwrap();
    ready(&expiring).await;
    expiring.put("a", "resp_old", stored("x")).await.unwrap();
    assert_eq!(expiring.get("a", "resp_old").await.unwrap(), None, "expired on read");
    assert!(!expiring.delete("a", "resp_old").await.unwrap());

    let one = serde_json::to_string(&stored("0123456789")).unwrap().len();
    let bounded = PgStore::start(&config(&pg, Duration::from_secs(60), one * 3)).unwrap();
    ready(&bounded).await;
    for i in 0..5 {
        bounded.put("a", &format!("resp_{i}"), stored("0123456789")).await.unwrap();
    }
    assert!(bounded.sweep().await.unwrap() >= 3, "the expired row and the two oldest go");
    assert!(bounded.bytes().await.unwrap() <= (one * 3) as u64);
    for (i, kept) in [false, false, true, true, true].into_iter().enumerate() {
        assert_eq!(bounded.get("a", &format!("resp_{i}")).await.unwrap().is_some(), kept, "resp_{i}");
    }
    let too_big = Stored { context: vec![json!("x".repeat(one * 3))], ..stored("y") };
    assert!(bounded.put("a", "big", too_big).await.is_err(), "larger than the whole store");
}
