//! The KV block pool: fixed-size blocks, reference counts, and a content-addressed prefix cache.
//!
//! Invariants (each prevents a real failure):
//! - A block is in exactly one of three states: *referenced* (refcount > 0, by one or more
//!   sequences), *cached* (refcount 0, holds a registered hash, evictable), or *free*
//!   (refcount 0, no hash). A block is never handed out while referenced, so no sequence can
//!   overwrite another's KV.
//! - A hash names at most one block, and only a block whose KV is fully computed: a prompt that
//!   matches a hash may skip that block's prefill and its output does not change.
//! - Cached blocks are evicted least-recently-used, and only when no free block is left, so a hot
//!   prefix survives as long as memory allows.
//! - Every registration and eviction of a hash is recorded as a [`KvEvent`], so routers that
//!   mirror this cache never believe in blocks that are gone.

use std::collections::{BTreeSet, HashMap};

use bellows_common::prefix_hash::BlockHash;

/// Index of a block in the pool (and in the model's KV storage).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(u32);

impl BlockId {
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// Any block id, for code that reads a layer's storage without a pool (tests, the attention
    /// benchmark).
    pub fn new(index: u32) -> Self {
        BlockId(index)
    }
}

/// A change to the set of cached block hashes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum KvEvent {
    Stored(BlockHash),
    Evicted(BlockHash),
}

#[derive(Debug, Clone, Copy, Default)]
struct BlockMeta {
    refs: u32,
    hash: Option<BlockHash>,
    last_used: u64,
}

pub struct BlockPool {
    block_size: usize,
    meta: Vec<BlockMeta>,
    /// Unreferenced blocks without a hash.
    free: Vec<BlockId>,
    /// Every registered hash and its block (referenced or not).
    by_hash: HashMap<BlockHash, BlockId>,
    /// Unreferenced blocks with a hash, oldest use first.
    evictable: BTreeSet<(u64, BlockId)>,
    clock: u64,
    events: Vec<KvEvent>,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0 && num_blocks > 0, "empty KV pool");
        BlockPool {
            block_size,
            meta: vec![BlockMeta::default(); num_blocks],
            // Pop from the end: hand out low ids first (readable in tests and dumps).
            free: (0..num_blocks as u32).rev().map(BlockId).collect(),
            by_hash: HashMap::new(),
            evictable: BTreeSet::new(),
            clock: 0,
            events: Vec::new(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn total(&self) -> usize {
        self.meta.len()
    }

    /// Blocks that can be allocated now (free plus evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks referenced by some sequence.
    pub fn used(&self) -> usize {
        self.total() - self.available()
    }

    /// How many leading `hashes` are cached (without taking them).
    pub fn cached_prefix_len(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.by_hash.contains_key(h)).count()
    }

    /// How many of these (cached) hashes name blocks that no sequence references: taking them
    /// makes them unavailable for allocation.
    pub fn unreferenced_among(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().filter(|h| self.by_hash.get(h).is_some_and(|b| self.meta[b.index()].refs == 0)).count()
    }

    /// How many of a sequence's `blocks` releasing them would make available (those it alone
    /// references).
    pub fn freed_by(&self, blocks: &[BlockId]) -> usize {
        blocks.iter().filter(|b| self.meta[b.index()].refs == 1).count()
    }

    /// Take a reference on the blocks of the leading cached `hashes`; returns them in order.
    pub fn acquire_prefix(&mut self, hashes: &[BlockHash]) -> Vec<BlockId> {
        let mut out = Vec::new();
        for h in hashes {
            let Some(&b) = self.by_hash.get(h) else { break };
            let m = &mut self.meta[b.index()];
            if m.refs == 0 {
                self.evictable.remove(&(m.last_used, b));
            }
            m.refs += 1;
            out.push(b);
        }
        out
    }

    /// A fresh block for exclusive use, evicting the least recently used cached block if needed.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.evictable.pop_first()?;
                let h = self.meta[b.index()].hash.take().expect("evictable blocks have a hash");
                self.by_hash.remove(&h);
                self.events.push(KvEvent::Evicted(h));
                b
            }
        };
        self.meta[b.index()].refs = 1;
        Some(b)
    }

    /// Register a block whose KV is now complete under `hash`. If another block already holds that
    /// hash (two identical prompts ran side by side), this one stays anonymous and is freed when
    /// released. Returns whether the hash was newly stored.
    pub fn register(&mut self, block: BlockId, hash: BlockHash) -> bool {
        if self.by_hash.contains_key(&hash) || self.meta[block.index()].hash.is_some() {
            return false;
        }
        self.meta[block.index()].hash = Some(hash);
        self.by_hash.insert(hash, block);
        self.events.push(KvEvent::Stored(hash));
        true
    }

    /// Drop one reference on each block. Unreferenced blocks with a hash stay cached (evictable);
    /// the others return to the free list.
    pub fn release(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            self.clock += 1;
            let m = &mut self.meta[b.index()];
            assert!(m.refs > 0, "release of unreferenced block {b:?}");
            m.refs -= 1;
            m.last_used = self.clock;
            if m.refs == 0 {
                if m.hash.is_some() {
                    self.evictable.insert((m.last_used, b));
                } else {
                    self.free.push(b);
                }
            }
        }
    }

    /// Events since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Every hash currently cached (for a subscriber that joins late).
    pub fn cached_hashes(&self) -> Vec<BlockHash> {
        let mut v: Vec<_> = self.by_hash.keys().copied().collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u64) -> BlockHash {
        BlockHash(x)
    }

    #[test]
    fn a_referenced_block_is_never_handed_out_again() {
        let mut p = BlockPool::new(2, 16);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert_ne!(a, b);
        assert!(p.allocate().is_none(), "pool of 2 must be exhausted");
        p.release(&[a]);
        assert_eq!(p.allocate(), Some(a));
    }

    #[test]
    fn a_registered_block_outlives_its_sequence_and_is_reused_by_hash() {
        let mut p = BlockPool::new(4, 16);
        let a = p.allocate().unwrap();
        assert!(p.register(a, h(1)));
        p.release(&[a]);
        assert_eq!(p.available(), 4, "cached blocks still count as available");
        assert_eq!(p.cached_prefix_len(&[h(1), h(2)]), 1);
        assert_eq!(p.acquire_prefix(&[h(1), h(2)]), vec![a]);
        assert_eq!(p.used(), 1);
        assert_eq!(p.take_events(), vec![KvEvent::Stored(h(1))]);
    }

    #[test]
    fn eviction_takes_the_least_recently_used_cached_block_and_reports_it() {
        let mut p = BlockPool::new(2, 16);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        p.register(a, h(10));
        p.register(b, h(20));
        p.release(&[a]);
        p.release(&[b]);
        // Touch a again: b becomes the least recently used.
        let got = p.acquire_prefix(&[h(10)]);
        p.release(&got);
        p.take_events();
        let c = p.allocate().unwrap();
        assert_eq!(c, b);
        assert_eq!(p.take_events(), vec![KvEvent::Evicted(h(20))]);
        assert_eq!(p.cached_prefix_len(&[h(20)]), 0);
        assert_eq!(p.cached_prefix_len(&[h(10)]), 1);
    }

    #[test]
    fn free_blocks_are_used_before_any_cached_block_is_evicted() {
        let mut p = BlockPool::new(3, 16);
        let a = p.allocate().unwrap();
        p.register(a, h(1));
        p.release(&[a]);
        let _ = p.allocate().unwrap();
        let _ = p.allocate().unwrap();
        assert!(p.take_events().iter().all(|e| matches!(e, KvEvent::Stored(_))));
        assert_eq!(p.cached_prefix_len(&[h(1)]), 1);
    }

    #[test]
    fn a_duplicate_hash_stays_anonymous_and_is_freed_on_release() {
        let mut p = BlockPool::new(2, 16);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert!(p.register(a, h(5)));
        assert!(!p.register(b, h(5)));
        p.release(&[b]);
        assert_eq!(p.free.len(), 1);
        assert_eq!(p.cached_hashes(), vec![h(5)]);
    }

    #[test]
    fn a_shared_block_stays_referenced_until_its_last_holder_releases() {
        let mut p = BlockPool::new(1, 16);
        let a = p.allocate().unwrap();
        p.register(a, h(9));
        let again = p.acquire_prefix(&[h(9)]);
        p.release(&[a]);
        assert!(p.allocate().is_none(), "still held by the second sequence");
        p.release(&again);
        assert!(p.allocate().is_some());
    }
}
