//! Cache-aware placement over real HTTP and gRPC: the router keeps each prompt prefix on the
//! workers that hold it, so a tenant's repeated system prompt is served from cache instead of
//! being recomputed on whichever worker happens to be next.

use std::time::Duration;

use bellows_integration::{Router, Worker, sim};
use serde_json::json;

#[tokio::test]
async fn each_tenants_prefix_stays_where_it_is_cached_so_every_repeat_hits() {
    let workers = [
        Worker::start(&sim("{}")).await,
        Worker::start(&sim("{}")).await,
        Worker::start(&sim("{}")).await,
        Worker::start(&sim("{}")).await,
    ];
    let router = Router::with_workers(&workers.iter().collect::<Vec<_>>(), &["--policy", "cache_aware"]).await;
    // 7 tenants (so no rotation over 4 workers brings a tenant back to the same one), each with
    // its own 200-token system prompt (12 full blocks), asked in turn.
    let prefix = |tenant: u32| -> Vec<u32> { (0..200).map(|i| 1 + (tenant * 211 + i * 7) % 1000).collect() };
    for round in 0..4u32 {
        for tenant in 0..7u32 {
            let prompt: Vec<u32> =
                prefix(tenant).into_iter().chain((0..10).map(|i| 1 + (round * 10 + i) % 1000)).collect();
            let body = json!({"model": "sim", "prompt": prompt, "max_tokens": 2});
            let (status, _, reply) = router.post("/v1/completions", &body).await;
            assert_eq!(status, 200, "{reply}");
            let cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
            if round == 0 {
                assert_eq!(cached, 0, "tenant {tenant} is new");
            } else {
                assert!(cached >= 192, "round {round}, tenant {tenant}: only {cached} of 192 prefix tokens cached");
            }
        }
    }
}

#[tokio::test]
async fn the_router_reports_how_long_placement_takes_and_how_big_its_prefix_index_is() {
    let workers = [Worker::start(&sim("{}")).await, Worker::start(&sim("{}")).await];
    let router = Router::with_workers(&workers.iter().collect::<Vec<_>>(), &["--policy", "cache_aware"]).await;
    assert_eq!(router.metric("bellows_router_prefix_index_entries").await, 0.0, "nothing cached yet");
    // Two prompts of 5 full blocks each, on whichever workers placement picks.
    for first in [1u32, 500] {
        let prompt: Vec<u32> = (first..first + 80).collect();
        let (status, _, reply) =
            router.post("/v1/completions", &json!({"model": "sim", "prompt": prompt, "max_tokens": 1})).await;
        assert_eq!(status, 200, "{reply}");
    }
    let placed = router.metric("bellows_router_placements_total").await;
    assert_eq!(router.metric("bellows_router_placement_duration_seconds_count").await, placed);
    // Placement remembers the 10 blocks it sent, and the workers then report them stored.
    bellows_integration::eventually(
        "the prefix index holds the stored blocks",
        std::time::Duration::from_secs(10),
        || async { (router.metric("bellows_router_prefix_index_entries").await >= 10.0).then_some(()) },
    )
    .await;
}

#[tokio::test]
async fn the_prefix_index_keeps_within_its_budget_and_counts_what_it_forgets() {
    let workers = [Worker::start(&sim("{}")).await, Worker::start(&sim("{}")).await];
    // 8 entries for two workers: 4 blocks each. No provisional entries (memory 0 s).
    let args = ["--prefix-index-entries", "8", "--placement-memory", "0s"];
    let router = Router::with_workers(&workers.iter().collect::<Vec<_>>(), &args).await;
    // Four prompts of 5 full blocks each: 20 blocks stored by the workers.
    for first in [1u32, 200, 400, 600] {
        let prompt: Vec<u32> = (first..first + 80).collect();
        let (status, _, reply) =
            router.post("/v1/completions", &json!({"model": "sim", "prompt": prompt, "max_tokens": 1})).await;
        assert_eq!(status, 200, "{reply}");
    }
    bellows_integration::eventually("the workers' stored blocks reach the router", Duration::from_secs(10), || async {
        (router.metric("bellows_router_kv_events_total").await >= 20.0).then_some(())
    })
    .await;
    let entries = router.metric("bellows_router_prefix_index_entries").await;
    assert!((1.0..=8.0).contains(&entries), "{entries} entries for a budget of 8");
    let trimmed = router.metric("bellows_router_prefix_index_trimmed_total").await;
    assert!(trimmed >= 12.0, "20 blocks reported, at most 8 kept, {trimmed} trimmed");
}
