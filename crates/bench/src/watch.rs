//! Per-worker load during a run, from the workers' own WatchLoad streams (the same reports
//! `bellows-router` places on), sampled at a fixed interval so busy and idle periods weigh the
//! same. It shows where a policy put the work (which no router response says), for any router
//! in front of simulated workers.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use bellows_proto::worker::v1::{self as pb, worker_client::WorkerClient};
use serde::Serialize;
use tokio::task::JoinHandle;

const SAMPLE_EVERY: Duration = Duration::from_millis(100);

#[derive(Default)]
struct Latest {
    report: pb::LoadReport,
    stored: u64,
    evicted: u64,
}

/// Averages over the samples taken while the watch ran.
#[derive(Debug, Clone, Default, Serialize)]
pub struct WorkerLoad {
    pub address: String,
    pub running: f64,
    pub waiting_requests: f64,
    pub kv_blocks_used: f64,
    pub kv_blocks_total: u32,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    /// KV events over the whole watch: blocks newly cached and blocks evicted.
    pub blocks_stored: u64,
    pub blocks_evicted: u64,
}

pub struct Watch {
    tasks: Vec<JoinHandle<()>>,
    sampler: JoinHandle<Vec<WorkerLoad>>,
    stop: tokio::sync::watch::Sender<bool>,
}

impl Watch {
    pub async fn start(addresses: &[String]) -> anyhow::Result<Self> {
        let mut tasks = Vec::new();
        let mut latest = Vec::new();
        for address in addresses {
            let mut client = WorkerClient::connect(format!("http://{address}")).await?;
            let mut stream = client.watch_load(pb::WatchLoadRequest {}).await?.into_inner();
            let state = Arc::new(Mutex::new(Latest::default()));
            latest.push(state.clone());
            tasks.push(tokio::spawn(async move {
                while let Ok(Some(msg)) = stream.message().await {
                    let mut s = state.lock().expect("watch lock");
                    for e in &msg.kv_events {
                        match e.kind {
                            Some(pb::kv_event::Kind::Stored(_)) => s.stored += 1,
                            Some(pb::kv_event::Kind::Evicted(_)) => s.evicted += 1,
                            None => {}
                        }
                    }
                    if let Some(r) = msg.load {
                        s.report = r;
                    }
                }
            }));
        }
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let addresses = addresses.to_vec();
        let sampler = tokio::spawn(async move {
            let mut sums: Vec<WorkerLoad> =
                addresses.iter().map(|a| WorkerLoad { address: a.clone(), ..WorkerLoad::default() }).collect();
            let (base_stored, base_evicted): (Vec<u64>, Vec<u64>) = latest
                .iter()
                .map(|l| {
                    let s = l.lock().expect("watch lock");
                    (s.stored, s.evicted)
                })
                .unzip();
            let mut samples = 0u32;
            let mut tick = tokio::time::interval(SAMPLE_EVERY);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stopped.changed() => break,
                }
                samples += 1;
                for (sum, l) in sums.iter_mut().zip(&latest) {
                    let s = l.lock().expect("watch lock");
                    let r = &s.report;
                    sum.running += f64::from(r.running_requests);
                    sum.waiting_requests += f64::from(r.waiting_requests);
                    sum.kv_blocks_used += f64::from(r.kv_blocks_used);
                    sum.kv_blocks_total = r.kv_blocks_total;
                    sum.prefill_tokens_per_s += r.prefill_tokens_per_s;
                    sum.decode_tokens_per_s += r.decode_tokens_per_s;
                }
            }
            let n = f64::from(samples.max(1));
            for (i, (sum, l)) in sums.iter_mut().zip(&latest).enumerate() {
                let s = l.lock().expect("watch lock");
                sum.blocks_stored = s.stored - base_stored[i];
                sum.blocks_evicted = s.evicted - base_evicted[i];
                for x in [
                    &mut sum.running,
                    &mut sum.waiting_requests,
                    &mut sum.kv_blocks_used,
                    &mut sum.prefill_tokens_per_s,
                ] {
                    *x = (*x / n * 10.0).round() / 10.0;
                }
                sum.decode_tokens_per_s = (sum.decode_tokens_per_s / n).round();
            }
            sums
        });
        Ok(Watch { tasks, sampler, stop })
    }

    pub async fn finish(self) -> Vec<WorkerLoad> {
        let _ = self.stop.send(true);
        let loads = self.sampler.await.unwrap_or_default();
        for t in self.tasks {
            t.abort();
        }
        loads
    }
}
