//! `bellows-bench store`: the response store's write and read latency, as a router sees it.
//!
//! `--concurrency` tasks each write `--ops` / `--concurrency` responses of `--bytes` of
//! conversation, then read them back in a shuffled order; each call is timed alone. The
//! backends run one after another in one process: the embedded memory store, the PostgreSQL
//! store (`--url`), and, as the floor beside it, the same SQL sent by plain tokio-postgres on
//! one connection per task (no pool, no deadline, no JSON encoding). One JSON line.

use std::{path::PathBuf, sync::Arc, time::Duration, time::Instant};

use bellows_router::api::responses::{
    postgres::{PgConfig, PgStore},
    store::{MemoryStore, ResponseStore, Stored},
};
use rand::seq::SliceRandom;
use serde::Serialize;
use serde_json::json;

use crate::stats::{Summary, summarize};

#[derive(clap::Args)]
pub struct Args {
    /// PostgreSQL to measure (`postgres://user@host:port/db`); without it, memory only.
    #[arg(long)]
    url: Option<String>,
    #[arg(long)]
    password_file: Option<PathBuf>,
    /// Calls in flight at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Writes (and as many reads) per backend.
    #[arg(long, default_value_t = 4000)]
    ops: usize,
    /// Size of each stored conversation, in bytes of JSON.
    #[arg(long, default_value_t = 8192)]
    bytes: usize,
}

#[derive(Serialize)]
struct Latency {
    put_ms: Summary,
    get_ms: Summary,
}

#[derive(Serialize)]
struct Report {
    bytes: usize,
    concurrency: usize,
    ops: usize,
    memory: Latency,
    postgres: Option<Latency>,
    raw_tokio_postgres: Option<Latency>,
}

/// A conversation of about `bytes` of JSON: alternating turns of `turn`-byte messages.
fn conversation(bytes: usize) -> Stored {
    let turn = 400;
    let items = (0..bytes.div_ceil(turn + 60))
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            json!({"type": "message", "role": role, "content": [{"type": "input_text", "text": "w".repeat(turn)}]})
        })
        .collect::<Vec<_>>();
    Stored {
        response: json!({"object": "response", "output": [items[0].clone()]}),
        input_items: vec![],
        context: items,
    }
}

/// Time `call` once per id on `concurrency` tasks; the samples in milliseconds.
async fn timed<F, Fut>(ids: &[String], concurrency: usize, call: F) -> anyhow::Result<Summary>
where
    F: Fn(usize, String) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send,
{
    let chunk = ids.len().div_ceil(concurrency);
    let mut tasks = Vec::new();
    for (task, part) in ids.chunks(chunk).enumerate() {
        let (part, call) = (part.to_vec(), call.clone());
        tasks.push(tokio::spawn(async move {
            let mut ms = Vec::with_capacity(part.len());
            for id in part {
                let t = Instant::now();
                call(task, id).await?;
                ms.push(t.elapsed().as_secs_f64() * 1e3);
            }
            anyhow::Ok(ms)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    summarize(&mut all).ok_or_else(|| anyhow::anyhow!("no calls"))
}

async fn measure(store: Arc<dyn ResponseStore>, args: &Args, stored: &Stored) -> anyhow::Result<Latency> {
    let ids: Vec<String> = (0..args.ops).map(|i| format!("resp_{i:08}_{}", rand::random::<u32>())).collect();
    let (s, v) = (store.clone(), stored.clone());
    let put_ms = timed(&ids, args.concurrency, move |_, id| {
        let (s, v) = (s.clone(), v.clone());
        async move { Ok(s.put("bench", &id, v).await?) }
    })
    .await?;
    let mut shuffled = ids.clone();
    shuffled.shuffle(&mut rand::rng());
    let get_ms = timed(&shuffled, args.concurrency, move |_, id| {
        let s = store.clone();
        async move {
            s.get("bench", &id).await?.ok_or_else(|| anyhow::anyhow!("{id} was not read back"))?;
            Ok(())
        }
    })
    .await?;
    Ok(Latency { put_ms, get_ms })
}

/// The same statements as the store's, on plain connections, one per task, each statement
/// prepared once per connection (as the store's pool caches them): the floor under the store.
async fn measure_raw(config: &tokio_postgres::Config, args: &Args, stored: &Stored) -> anyhow::Result<Latency> {
    let mut conns = Vec::new();
    for _ in 0..args.concurrency {
        let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
        tokio::spawn(connection);
        let insert = client
            .prepare(
                "INSERT INTO bellows_responses (tenant, id, stored, bytes, expires_at)
                 VALUES ($1, $2, $3, $4, now() + make_interval(secs => $5))",
            )
            .await?;
        let select = client
            .prepare("SELECT stored FROM bellows_responses WHERE tenant = $1 AND id = $2 AND expires_at > now()")
            .await?;
        conns.push(Arc::new((client, insert, select)));
    }
    let conns = Arc::new(conns);
    let text = Arc::new(serde_json::to_string(stored)?);
    let ids: Vec<String> = (0..args.ops).map(|i| format!("raw_{i:08}_{}", rand::random::<u32>())).collect();
    let c = conns.clone();
    let put_ms = timed(&ids, args.concurrency, move |task, id| {
        let (c, text) = (c[task].clone(), text.clone());
        async move {
            let (client, insert, _) = &*c;
            client
                .execute(insert, &[&"bench-raw", &id.as_str(), &text.as_str(), &(text.len() as i64), &3600f64])
                .await?;
            Ok(())
        }
    })
    .await?;
    let mut shuffled = ids.clone();
    shuffled.shuffle(&mut rand::rng());
    let get_ms = timed(&shuffled, args.concurrency, move |task, id| {
        let c = conns[task].clone();
        async move {
            let (client, _, select) = &*c;
            let row = client.query_one(select, &[&"bench-raw", &id.as_str()]).await?;
            anyhow::ensure!(!row.get::<_, &str>(0).is_empty());
            Ok(())
        }
    })
    .await?;
    Ok(Latency { put_ms, get_ms })
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let stored = conversation(args.bytes);
    let memory = measure(Arc::new(MemoryStore::new(Duration::from_secs(3600), usize::MAX)), &args, &stored).await?;
    let (mut postgres, mut raw_tokio_postgres) = (None, None);
    if let Some(url) = &args.url {
        let config = PgConfig {
            url: url.clone(),
            password_file: args.password_file.clone(),
            ttl: Duration::from_secs(3600),
            max_bytes: usize::MAX >> 1,
            timeout: Duration::from_secs(5),
            sweep_every: Duration::from_secs(3600),
        };
        let store = PgStore::start(&config)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while store.put("bench", "probe", stored.clone()).await.is_err() {
            anyhow::ensure!(Instant::now() < deadline, "the store did not become ready within 30 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        postgres = Some(measure(store, &args, &stored).await?);
        let mut raw: tokio_postgres::Config = url.parse()?;
        if let Some(path) = &args.password_file {
            raw.password(std::fs::read_to_string(path)?.trim_end_matches('\n'));
        }
        raw_tokio_postgres = Some(measure_raw(&raw, &args, &stored).await?);
    }
    let report = Report {
        bytes: args.bytes,
        concurrency: args.concurrency,
        ops: args.ops,
        memory,
        postgres,
        raw_tokio_postgres,
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}
