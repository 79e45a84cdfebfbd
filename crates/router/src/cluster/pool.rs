//! The workers of one model, and what they share: the tokenizer, the prefix-hash geometry and
//! the index of which worker holds which block.

use std::sync::{
    Arc, Mutex, RwLock,
    atomic::{AtomicUsize, Ordering},
};

use bellows_common::prefix_hash::{BlockHash, ChainRoot, prefix_block_hashes};
use bellows_proto::worker::v1 as pb;

use super::link::WorkerLink;
use super::prefix_index::PrefixIndex;
use super::ring::Ring;
use crate::{answer::thinking::Thinking, tokenize::PromptTokenizer};

/// The pool's workers, sorted by id, and their ring (rebuilt as they change).
#[derive(Default)]
struct Members {
    links: Vec<Arc<WorkerLink>>,
    ring: Ring,
}

impl Members {
    fn changed(&mut self) {
        self.ring = Ring::new(self.links.iter().map(|l| l.stable_id));
    }
}

pub struct ModelPool {
    pub name: String,
    pub tokenizer: Arc<PromptTokenizer>,
    /// The model's thinking tags, when its template thinks.
    pub thinking: Option<Thinking>,
    pub block_size: usize,
    pub vocab_size: u32,
    workers: RwLock<Members>,
    /// The smallest context length of the workers, kept as they join and leave (read per
    /// request, so it must not cost a pass over a large pool).
    context_length: AtomicUsize,
    pub index: Mutex<PrefixIndex>,
}

impl ModelPool {
    pub(super) fn new(info: &pb::ModelInfoResponse) -> anyhow::Result<Self> {
        anyhow::ensure!(info.kv_block_size > 0, "worker reports a KV block size of 0");
        let tokenizer = PromptTokenizer::from_model_info(info)?;
        Ok(ModelPool {
            name: info.model_id.clone(),
            thinking: Thinking::of(&tokenizer),
            tokenizer: Arc::new(tokenizer),
            block_size: info.kv_block_size as usize,
            vocab_size: info.vocab_size,
            workers: RwLock::default(),
            context_length: AtomicUsize::new(0),
            index: Mutex::new(PrefixIndex::default()),
        })
    }

    /// Whether a worker describing itself with `info` can serve in this pool: same hashing
    /// geometry and vocabulary, or placement and tokenization would be wrong for it.
    pub(super) fn check_compatible(&self, info: &pb::ModelInfoResponse) -> anyhow::Result<()> {
        anyhow::ensure!(
            info.kv_block_size as usize == self.block_size && info.vocab_size == self.vocab_size,
            "worker serves model {:?} with block size {} and vocabulary {}, but the pool has {} and {}",
            info.model_id,
            info.kv_block_size,
            info.vocab_size,
            self.block_size,
            self.vocab_size
        );
        Ok(())
    }

    pub(super) fn add(&self, link: &Arc<WorkerLink>) {
        let mut w = self.workers.write().expect("pool lock");
        if !w.links.iter().any(|l| l.id == link.id) {
            w.links.push(link.clone());
            w.links.sort_by_key(|l| l.id);
            w.changed();
        }
        // A rejoining worker may come back with another context length.
        self.update_context_length(&w.links);
    }

    fn update_context_length(&self, workers: &[Arc<WorkerLink>]) {
        let min = workers.iter().map(|l| l.context_length()).filter(|&c| c > 0).min().unwrap_or(0);
        self.context_length.store(min as usize, Ordering::Relaxed);
    }

    pub(super) fn remove(&self, link: &WorkerLink) -> bool {
        let mut w = self.workers.write().expect("pool lock");
        w.links.retain(|l| l.id != link.id);
        w.changed();
        self.update_context_length(&w.links);
        self.index.lock().expect("prefix index lock").forget_worker(link.id);
        w.links.is_empty()
    }

    /// Calls `f` with the workers (sorted by id), without copying the list.
    pub fn with_workers<T>(&self, f: impl FnOnce(&[Arc<WorkerLink>]) -> T) -> T {
        f(&self.workers.read().expect("pool lock").links)
    }

    /// Calls `f` with the workers (sorted by id) and their ring.
    pub fn with_ring<T>(&self, f: impl FnOnce(&[Arc<WorkerLink>], &Ring) -> T) -> T {
        let w = self.workers.read().expect("pool lock");
        f(&w.links, &w.ring)
    }

    /// The longest prompt + completion every worker accepts (0 with no workers).
    pub fn context_length(&self) -> usize {
        self.context_length.load(Ordering::Relaxed)
    }

    pub fn has_placeable_worker(&self) -> bool {
        self.with_workers(|w| w.iter().any(|l| l.load().is_some()))
    }

    /// The block hashes of a prompt, as the model's workers will name its cached blocks.
    pub fn block_hashes(&self, tokens: &[u32], cache_salt: Option<&str>) -> Vec<BlockHash> {
        prefix_block_hashes(tokens, self.block_size, ChainRoot::for_model(&self.name, cache_salt))
    }
}
