//! `bellows-bench placement`: the router's placement decision alone (admit, score, choose,
//! count the request at its worker), timed call by call over a real fleet.
//!
//! The router's own code (`bellows_router::cluster` and `placement`) follows the workers in
//! `--addresses-file` exactly as `bellows-router` would, so the links' loads are real reports
//! arriving on other threads while the decisions are timed. The prefix index is warmed with
//! `--tenants` shared system prompts, each held by two workers, and `--filler-blocks` other blocks
//! per worker, so lookups run against a full index. Timing one call at a time on an otherwise
//! idle thread is what the 50 us target is about; the router's histogram under load adds the
//! time a busy machine keeps the thread off a core.

use std::{path::PathBuf, sync::Arc, time::Duration, time::Instant};

use bellows_common::priority::Priority;
use bellows_router::{
    admission::Admission,
    cluster::{Cluster, ModelPool},
    metrics::Metrics,
    placement::{self, PolicyKind, PromptShape},
    shards::Shards,
    tenants::Usage,
};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::Serialize;

use crate::stats::{Summary, summarize};

#[derive(clap::Args)]
pub struct Args {
    /// The fleet's gRPC addresses, comma separated (as `bellows-worker fleet --addresses-file` writes).
    #[arg(long)]
    addresses_file: PathBuf,
    #[arg(long, value_enum, default_value_t = PolicyKind::CacheAware)]
    policy: PolicyKind,
    /// Placement decisions timed.
    #[arg(long, default_value_t = 20_000)]
    placements: usize,
    /// Shared system prompts, each cached on two workers.
    #[arg(long, default_value_t = 200)]
    tenants: u32,
    /// Tokens of each tenant's system prompt; every prompt adds 64 tokens of its own.
    #[arg(long, default_value_t = 512)]
    system_tokens: u32,
    /// Other cached blocks reported by each worker.
    #[arg(long, default_value_t = 1000)]
    filler_blocks: u32,
}

#[derive(Serialize)]
struct Report {
    workers: usize,
    placements: usize,
    prefix_index_entries: usize,
    /// Per decision, in microseconds.
    decision_us: Summary,
    /// Placements on a worker holding at least half of the tenant's system prompt (so its home
    /// block and on).
    on_a_holder: f64,
    /// Candidates the policy scored, on average.
    candidates: f64,
}

pub fn run(rt: &tokio::runtime::Runtime, args: Args) -> anyhow::Result<()> {
    let addresses = std::fs::read_to_string(&args.addresses_file)?;
    let addresses: Vec<&str> = addresses.trim().split(',').filter(|a| !a.is_empty()).collect();
    // The cluster's links run on `rt`: its one shard.
    let shards = {
        let _in_runtime = rt.enter();
        Shards::single()
    };
    let cluster = Cluster::new(Metrics::new(&Usage::new()), usize::MAX, None, shards);
    let pool = rt.block_on(follow(&cluster, &addresses))?;
    let tenants = warm(&pool, &args);
    let policy = placement::policy(args.policy);
    let admission = Admission::new(u64::MAX);
    let mut rng = StdRng::seed_from_u64(7);
    let (mut samples, mut on_holder, mut candidates) = (Vec::with_capacity(args.placements), 0, 0);
    for _ in 0..args.placements {
        let tenant = &tenants[rng.random_range(0..tenants.len())];
        let mut tokens = tenant.clone();
        tokens.extend((0..64).map(|_| rng.random_range(0..32_000u32)));
        let hashes = pool.block_hashes(&tokens, None);
        let shape = PromptShape { tokens: tokens.len(), block_size: pool.block_size, hashes: &hashes };
        let started = Instant::now();
        let ticket =
            admission.admit(cluster.queue(), Priority::Standard).map_err(|_| anyhow::anyhow!("admission refused"))?;
        let placed = placement::place(&pool, policy.as_ref(), shape, &[], Duration::from_secs(2))
            .ok_or_else(|| anyhow::anyhow!("no placeable worker"))?;
        let pending = placed.worker.dispatch(tokens.len() - placed.cached_blocks * pool.block_size);
        samples.push(started.elapsed().as_secs_f64() * 1e6);
        drop((pending, ticket));
        on_holder += usize::from(placed.cached_blocks * pool.block_size >= args.system_tokens as usize / 2);
        candidates += placed.candidates;
    }
    let report = Report {
        workers: addresses.len(),
        placements: args.placements,
        prefix_index_entries: pool.index.lock().expect("prefix index lock").entries(),
        decision_us: summarize(&mut samples).expect("at least one placement"),
        on_a_holder: on_holder as f64 / args.placements as f64,
        candidates: candidates as f64 / args.placements as f64,
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

/// Join every worker and wait until all are placeable in one pool.
async fn follow(cluster: &Arc<Cluster>, addresses: &[&str]) -> anyhow::Result<Arc<ModelPool>> {
    for a in addresses {
        cluster.join(a, a);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let pools = cluster.models();
        if let [pool] = pools.as_slice() {
            let placeable = pool.with_workers(|w| w.iter().filter(|l| l.load().is_some()).count());
            if placeable == addresses.len() {
                return Ok(pool.clone());
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "the fleet's links did not all come up in 60 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Fill the prefix index: each tenant's system prompt on two workers, filler on every worker.
/// Returns the tenants' system prompts.
fn warm(pool: &ModelPool, args: &Args) -> Vec<Vec<u32>> {
    let ids = pool.with_workers(|w| w.iter().map(|l| l.id).collect::<Vec<_>>());
    let mut rng = StdRng::seed_from_u64(11);
    let mut index = pool.index.lock().expect("prefix index lock");
    let tenants: Vec<Vec<u32>> =
        (0..args.tenants).map(|t| (0..args.system_tokens).map(|i| 100_000 + t * 10_000 + i).collect()).collect();
    for system in &tenants {
        let hashes = pool.block_hashes(system, None);
        for _ in 0..2 {
            let w = ids[rng.random_range(0..ids.len())];
            hashes.iter().for_each(|h| index.stored(w, h.0));
        }
    }
    for &w in &ids {
        (0..args.filler_blocks).for_each(|_| index.stored(w, rng.random()));
    }
    tenants
}
