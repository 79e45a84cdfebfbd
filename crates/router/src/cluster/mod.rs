//! The router's view of the cluster: which workers exist (from etcd or a static list), which
//! model each serves, and the links that follow their load.
//!
//! Membership changes only through [`Cluster::join`] and [`Cluster::leave`]; a worker's model
//! is learnt from its own ModelInfo, not trusted from etcd, so a pool's tokenizer and hashing
//! always come from a worker that really serves it.

pub mod call;
pub mod discovery;
pub mod link;
pub mod peers;
pub mod pool;
pub mod prefix_index;
pub mod queue;
pub mod ring;
pub mod session;

use std::{
    collections::HashMap,
    sync::{
        Arc, RwLock,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
};

use bellows_common::{priority::Priority, tls::ClusterTls};
use bellows_proto::worker::v1 as pb;

use crate::{
    metrics::{ChangeLabels, Metrics, ModelLabels, PriorityLabels, ShardLabels, WorkerLabels},
    shards::Shards,
};

pub use call::{Reply, WorkerCall, WorkerError};
pub use link::{Dispatched, Load, WorkerLink};
pub use pool::ModelPool;
use queue::QueueTotals;
pub use queue::QueueView;

/// A link's identity: never reused, so state keyed by it cannot leak to a later worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u64);

pub struct Cluster {
    metrics: Arc<Metrics>,
    next_id: AtomicU64,
    /// By node id.
    links: RwLock<HashMap<String, Arc<WorkerLink>>>,
    /// By model name.
    models: RwLock<HashMap<String, Arc<ModelPool>>>,
    /// `links.len()`, read without the lock.
    link_count: AtomicUsize,
    /// Reported prefix-index entries this router keeps at most, over every worker.
    index_budget: usize,
    queue: Arc<QueueTotals>,
    /// Mutual TLS to the workers; `None`: plaintext.
    tls: Option<ClusterTls>,
    /// Each link opens a session on every shard.
    shards: Arc<Shards>,
}

impl Cluster {
    /// `index_budget`: see [`prefix_index`]'s memory bound.
    pub fn new(metrics: Arc<Metrics>, index_budget: usize, tls: Option<ClusterTls>, shards: Arc<Shards>) -> Arc<Self> {
        Arc::new(Cluster {
            tls,
            shards,
            metrics,
            next_id: AtomicU64::new(0),
            links: RwLock::default(),
            models: RwLock::default(),
            link_count: AtomicUsize::new(0),
            index_budget,
            queue: Arc::default(),
        })
    }

    /// Each worker's share of the prefix-index budget.
    pub(crate) fn index_share(&self) -> usize {
        self.index_budget / self.link_count.load(Ordering::Relaxed).max(1)
    }

    /// A worker joined (or moved to a new address).
    pub fn join(self: &Arc<Self>, node_id: &str, address: &str) {
        let mut links = self.links.write().expect("links lock");
        if links.get(node_id).is_some_and(|l| l.address == address) {
            return;
        }
        let id = WorkerId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let tls = match self.tls.as_ref().map(|t| t.connector(&expected_names(node_id, address))).transpose() {
            Ok(tls) => tls,
            Err(e) => {
                tracing::error!(worker = node_id, address, "cannot check this worker's certificate: {e}");
                return;
            }
        };
        let (cluster, queue, shards) = (Arc::downgrade(self), self.queue.clone(), self.shards.clone());
        match WorkerLink::spawn(id, node_id, address, tls, cluster, queue, shards) {
            Ok(link) => {
                tracing::info!(worker = node_id, address, "worker joined");
                self.metrics.membership_changes.get_or_create(&ChangeLabels { change: "join" }).inc();
                if let Some(old) = links.insert(node_id.to_string(), link) {
                    self.detach(&old);
                }
                self.link_count.store(links.len(), Ordering::Relaxed);
            }
            Err(e) => tracing::error!(worker = node_id, address, "cannot reach worker at this address: {e:#}"),
        }
    }

    /// A worker's link failed TLS (see [`link`]'s module docs).
    pub(crate) fn count_tls_failure(&self) {
        self.metrics.worker_tls_failures.inc();
    }

    /// A worker left: stop placing there at once.
    pub fn leave(&self, node_id: &str) {
        let removed = {
            let mut links = self.links.write().expect("links lock");
            let removed = links.remove(node_id);
            self.link_count.store(links.len(), Ordering::Relaxed);
            removed
        };
        if let Some(link) = removed {
            tracing::info!(worker = node_id, "worker left");
            self.metrics.membership_changes.get_or_create(&ChangeLabels { change: "leave" }).inc();
            self.detach(&link);
        }
    }

    /// Node ids currently known.
    pub fn node_ids(&self) -> Vec<String> {
        self.links.read().expect("links lock").keys().cloned().collect()
    }

    fn detach(&self, link: &Arc<WorkerLink>) {
        link.close();
        let mut models = self.models.write().expect("models lock");
        models.retain(|_, pool| !pool.remove(link));
    }

    /// Called by a link once its worker described its model: the pool it serves in.
    pub(crate) fn attach(
        &self,
        link: &Arc<WorkerLink>,
        info: &pb::ModelInfoResponse,
    ) -> anyhow::Result<Arc<ModelPool>> {
        let mut models = self.models.write().expect("models lock");
        // A link closed meanwhile must not come back into a pool. `detach` closes the link
        // before it takes this lock, so one of the two always sees the other.
        anyhow::ensure!(!link.is_closed(), "worker {} left", link.node_id);
        let pool = match models.get(&info.model_id) {
            Some(pool) => {
                pool.check_compatible(info)?;
                pool.clone()
            }
            None => {
                let pool = Arc::new(ModelPool::new(info)?);
                models.insert(info.model_id.clone(), pool.clone());
                pool
            }
        };
        pool.add(link);
        Ok(pool)
    }

    /// A link lost its load stream: its cached blocks are unknown until it reconnects.
    pub(crate) fn forget_blocks(&self, link: &WorkerLink) {
        let models = self.models.read().expect("models lock");
        for pool in models.values() {
            pool.index.lock().expect("prefix index lock").forget_worker(link.id);
        }
    }

    pub fn model(&self, name: &str) -> Option<Arc<ModelPool>> {
        self.models.read().expect("models lock").get(name).cloned()
    }

    pub fn models(&self) -> Vec<Arc<ModelPool>> {
        let mut m: Vec<_> = self.models.read().expect("models lock").values().cloned().collect();
        m.sort_by(|a, b| a.name.cmp(&b.name));
        m
    }

    /// Refresh the per-worker gauges (at scrape time).
    pub fn export_worker_gauges(&self) {
        let links = self.links.read().expect("links lock");
        self.metrics.workers.set(links.len() as i64);
        self.metrics.placeable_workers.set(links.values().filter(|l| l.load().is_some()).count() as i64);
        self.metrics.worker_waiting.clear();
        self.metrics.worker_running.clear();
        for link in links.values() {
            let load = link.load().unwrap_or_default();
            let labels = WorkerLabels { worker: link.node_id.clone() };
            self.metrics.worker_waiting.get_or_create(&labels).set(i64::from(load.waiting_requests));
            self.metrics.worker_running.get_or_create(&labels).set(i64::from(load.running));
        }
        drop(links);
        let models = self.models();
        let entries: usize = models.iter().map(|p| p.index.lock().expect("prefix index lock").entries()).sum();
        self.metrics.prefix_index_entries.set(entries as i64);
        self.export_queue(&models);
        for shard in 0..self.shards.count() {
            let labels = ShardLabels { shard };
            self.metrics.shard_busy.get_or_create(&labels).set(self.shards.busy(shard));
            self.metrics.shard_connections.get_or_create(&labels).set(self.shards.connections(shard) as i64);
        }
    }

    /// Each model's queue and capacity, summed over its placeable workers (at scrape time, so a
    /// pass over the pool is fine here).
    fn export_queue(&self, models: &[Arc<ModelPool>]) {
        let q = &self.metrics.queue;
        for family in [&q.waiting_requests, &q.waiting_tokens, &q.running_requests, &q.max_running_requests] {
            family.clear();
        }
        q.placeable_workers.clear();
        q.waiting_requests_by_priority.clear();
        q.waiting_tokens_by_priority.clear();
        q.prefill_tokens_per_second.clear();
        for pool in models {
            let labels = ModelLabels { model: pool.name.clone() };
            let loads: Vec<Load> = pool.with_workers(|w| w.iter().filter_map(|l| l.load()).collect());
            let sum = |f: fn(&Load) -> u64| loads.iter().map(f).sum::<u64>() as i64;
            q.waiting_requests.get_or_create(&labels).set(sum(|l| u64::from(l.waiting_requests)));
            q.waiting_tokens.get_or_create(&labels).set(sum(|l| l.waiting_tokens));
            q.running_requests.get_or_create(&labels).set(sum(|l| u64::from(l.running)));
            q.max_running_requests.get_or_create(&labels).set(sum(|l| u64::from(l.max_running)));
            q.placeable_workers.get_or_create(&labels).set(loads.len() as i64);
            q.prefill_tokens_per_second.get_or_create(&labels).set(loads.iter().map(|l| l.prefill_tokens_per_s).sum());
            let mut by_class = [(0u64, 0u64); 3];
            pool.with_workers(|w| {
                for reported in w.iter().filter_map(|l| l.waiting_by_priority()) {
                    for (sum, (n, tokens)) in by_class.iter_mut().zip(reported) {
                        sum.0 += n;
                        sum.1 += tokens;
                    }
                }
            });
            for (class, (n, tokens)) in Priority::ALL.into_iter().zip(by_class) {
                let labels = PriorityLabels { model: pool.name.clone(), priority: class.as_str() };
                q.waiting_requests_by_priority.get_or_create(&labels).set(n as i64);
                q.waiting_tokens_by_priority.get_or_create(&labels).set(tokens as i64);
            }
        }
    }

    /// At least one model has a worker that can take work.
    pub fn ready(&self) -> bool {
        self.models.read().expect("models lock").values().any(|p| p.has_placeable_worker())
    }

    /// The cluster-wide queue: every placeable worker's reported waiting work plus what this
    /// router sent that the reports do not show yet (running totals, see [`queue`]).
    pub fn queue(&self) -> QueueView {
        self.queue.view()
    }
}

/// The names a worker's certificate may carry, one of them: the node id it registered under or
/// the host of the address it registered; for a `--workers` entry (no registration), the host
/// it was given as.
fn expected_names<'a>(node_id: &'a str, address: &'a str) -> Vec<&'a str> {
    let host = address.rsplit_once(':').map_or(address, |(host, _)| host).trim_matches(['[', ']']);
    match node_id.strip_prefix(discovery::STATIC_PREFIX) {
        Some(_) => vec![host],
        None => vec![node_id, host],
    }
}
