//! The one definition of a KV block's identity, shared by router and worker.
//!
//! A full block of `block_size` tokens is named by a chained hash:
//! `hash(block i) = xxh3(tokens of block i, seed = hash(block i-1))`, with the chain rooted at
//! `xxh3(salt)`. Chaining makes a block's hash stand for the *whole prefix* up to its end, so two
//! prompts share a block hash only if they share every token before it: equal hashes mean the
//! worker's cached KV for that block is valid for the new prompt. The salt (model id, plus the
//! tenant when its cache is isolated) keeps different models or tenants from ever matching.
//!
//! The router hashes prompts with this function to predict cache hits; the worker hashes the blocks
//! it stores with it. If the two ever disagreed, placement would silently lose all affinity, so
//! there is exactly one implementation and the router never re-derives it.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The identity of a full KV block: a hash of every token up to the block's end, and the salt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockHash(pub u64);

/// Where a hash chain starts: model id and (optionally) tenant, so chains of different salts never
/// meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainRoot(u64);

impl ChainRoot {
    pub fn new(salt: &[u8]) -> Self {
        ChainRoot(xxh3_64(salt))
    }

    /// Root for a model, optionally isolated per tenant.
    pub fn for_model(model_id: &str, tenant_salt: Option<&str>) -> Self {
        let mut salt = Vec::with_capacity(model_id.len() + 64);
        salt.extend_from_slice(model_id.as_bytes());
        if let Some(t) = tenant_salt {
            salt.push(0); // separator: ("ab", "c") and ("a", "bc") must differ
            salt.extend_from_slice(t.as_bytes());
        }
        Self::new(&salt)
    }
}

/// Hash of the block that follows `parent` (or the root) and holds `tokens`.
pub fn block_hash(parent: Option<BlockHash>, root: ChainRoot, tokens: &[u32]) -> BlockHash {
    let seed = parent.map_or(root.0, |p| p.0);
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    BlockHash(xxh3_64_with_seed(&bytes, seed))
}

/// Hashes of every *full* block of `tokens`; a trailing partial block has no hash.
pub fn prefix_block_hashes(tokens: &[u32], block_size: usize, root: ChainRoot) -> Vec<BlockHash> {
    assert!(block_size > 0, "block size must be positive");
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut parent = None;
    for chunk in tokens.chunks_exact(block_size) {
        let h = block_hash(parent, root, chunk);
        out.push(h);
        parent = Some(h);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> ChainRoot {
        ChainRoot::for_model("m", None)
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        let t: Vec<u32> = (0..40).collect();
        assert_eq!(prefix_block_hashes(&t, 16, root()).len(), 2);
        assert!(prefix_block_hashes(&t[..15], 16, root()).is_empty());
    }

    #[test]
    fn a_block_hash_depends_on_every_earlier_token() {
        let a: Vec<u32> = (0..32).collect();
        let mut b = a.clone();
        b[3] = 999;
        let ha = prefix_block_hashes(&a, 16, root());
        let hb = prefix_block_hashes(&b, 16, root());
        assert_ne!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1], "second block must differ although its own tokens are equal");
    }

    #[test]
    fn shared_prefixes_share_hashes_and_diverge_after() {
        let a: Vec<u32> = (0..48).collect();
        let mut b = a.clone();
        b[40] = 7;
        let ha = prefix_block_hashes(&a, 16, root());
        let hb = prefix_block_hashes(&b, 16, root());
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
    }

    #[test]
    fn salts_separate_models_and_tenants() {
        let t: Vec<u32> = (0..16).collect();
        let h = |r| prefix_block_hashes(&t, 16, r)[0];
        assert_ne!(h(ChainRoot::for_model("a", None)), h(ChainRoot::for_model("b", None)));
        assert_ne!(h(ChainRoot::for_model("a", None)), h(ChainRoot::for_model("a", Some("t1"))));
        assert_ne!(h(ChainRoot::for_model("ab", Some("c"))), h(ChainRoot::for_model("a", Some("bc"))));
    }

    #[test]
    fn the_definition_is_stable() {
        // Router and worker binaries of different builds must agree: pin one value.
        let t: Vec<u32> = (0..16).collect();
        let h = prefix_block_hashes(&t, 16, ChainRoot::for_model("m", None))[0];
        assert_eq!(h, block_hash(None, ChainRoot::new(b"m"), &t));
    }
}
