//! A simulated model: no weights, a cost model for step time, deterministic pseudo-random tokens.
//!
//! It runs behind the same [`Backend`] trait as the real model, so the scheduler, the KV block
//! accounting and prefix reuse are the real ones; only the arithmetic is replaced. That lets the
//! cluster be tested and benchmarked with hundreds of workers on one machine.
//!
//! Tokens are a pure function of (previous token, position), so identical requests give identical
//! output on any worker, as greedy decoding of a real model would.
//!
//! Constrained requests work too: besides its `" t{i}"` word tokens the vocabulary has one token
//! per byte value (so any UTF-8 text can be spelled), which the model itself never picks, and every other
//! logit is a small pseudo-random value (also a function of previous token and position). So a
//! grammar's mask leaves the sampler a pseudo-random choice among the allowed tokens: varied,
//! valid output, the same on every worker.

use std::time::Duration;

use xxhash_rust::xxh3::xxh3_64;

use super::{Backend, BatchRow, ModelSpec};
use crate::vocab::Vocab;

/// Step cost: `base + per_token * tokens + per_sequence * rows`, slept (not spun), so many
/// simulated workers can share a few cores.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SimConfig {
    pub vocab_size: usize,
    pub context_length: usize,
    pub base_us: u64,
    pub per_token_us: u64,
    pub per_sequence_us: u64,
    /// KV bytes one token "occupies": with `--kv-cache-mb`, sets the pool's size in blocks.
    pub kv_bytes_per_token: usize,
    /// A prompt containing this token makes the step panic (to exercise failure handling).
    pub poison_token: Option<u32>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            vocab_size: 1024,
            context_length: 8192,
            base_us: 2000,
            per_token_us: 50,
            per_sequence_us: 20,
            kv_bytes_per_token: 1024,
            poison_token: None,
        }
    }
}

/// Token 0 is the simulated end-of-sequence; generated tokens are never 0, so a simulated
/// request runs to `max_tokens` unless a stop condition says otherwise.
pub const SIM_EOS: u32 = 0;

pub struct SimModel {
    cfg: SimConfig,
    spec: ModelSpec,
}

impl SimModel {
    pub fn new(cfg: SimConfig) -> Self {
        let spec = ModelSpec {
            model_id: "sim".into(),
            architecture: "sim".into(),
            vocab_size: cfg.vocab_size,
            context_length: cfg.context_length,
            kv_bytes_per_token: cfg.kv_bytes_per_token,
            device: "sim".into(),
        };
        SimModel { cfg, spec }
    }

    /// The token that follows `prev` at position `pos`: a word token, never EOS or a byte token.
    pub fn next_token(&self, prev: u32, pos: usize) -> u32 {
        1 + (step_hash(prev, pos) % (u64::from(word_tokens(self.cfg.vocab_size)) - 1)) as u32
    }

    /// One row's logits: 20 for the model's own next token; for every other token a value in
    /// (-1, 0], a pseudo-random permutation of the vocabulary seeded by (prev, pos). Unconstrained,
    /// the next token wins by a margin that makes sampling pick it too; under a mask, the sampler
    /// picks among the allowed tokens by that permutation.
    fn logits(&self, prev: u32, pos: usize) -> Vec<f32> {
        let v = self.cfg.vocab_size as u64;
        let seed = step_hash(prev, pos.wrapping_add(1 << 40));
        // An odd multiplier is a bijection mod 2^k; reduce into (-1, 0] by the vocabulary size.
        let mul = (seed | 1) % v.next_power_of_two();
        let mut logits: Vec<f32> = (0..v).map(|i| -(((i * mul + seed) % v) as f32) / v as f32).collect();
        logits[self.next_token(prev, pos) as usize] = 20.0;
        logits
    }
}

fn step_hash(prev: u32, pos: usize) -> u64 {
    let mut b = [0u8; 12];
    b[..4].copy_from_slice(&prev.to_le_bytes());
    b[4..].copy_from_slice(&(pos as u64).to_le_bytes());
    xxh3_64(&b)
}

impl Backend for SimModel {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn set_model_id(&mut self, model_id: String) {
        self.spec.model_id = model_id;
    }

    fn allocate_kv(&mut self, _num_blocks: usize, _block_size: usize) -> anyhow::Result<()> {
        Ok(())
    }

    fn forward(&mut self, rows: &[BatchRow<'_>]) -> anyhow::Result<Vec<Vec<f32>>> {
        let tokens: usize = rows.iter().map(|r| r.tokens.len()).sum();
        if let Some(p) = self.cfg.poison_token {
            assert!(!rows.iter().any(|r| r.tokens.contains(&p)), "simulated model failure (poison token {p})");
        }
        let c = &self.cfg;
        std::thread::sleep(Duration::from_micros(
            c.base_us + c.per_token_us * tokens as u64 + c.per_sequence_us * rows.len() as u64,
        ));
        Ok(rows
            .iter()
            .filter(|r| r.want_logits)
            .map(|r| self.logits(*r.tokens.last().expect("non-empty row"), r.end_pos()))
            .collect())
    }
}

/// Byte tokens at the top of a simulated vocabulary: one per byte value, in order.
pub const BYTE_TOKENS: u32 = 256;

/// Ids below this are EOS (0) and word tokens.
pub fn word_tokens(vocab_size: usize) -> u32 {
    vocab_size as u32 - BYTE_TOKENS
}

/// Text for simulated tokens: word token `i` reads `" t{i}"`; the top [`BYTE_TOKENS`] ids are one
/// byte each.
pub struct SimVocab {
    bytes: Vec<Vec<u8>>,
    eos: [u32; 1],
}

impl SimVocab {
    pub fn new(vocab_size: usize) -> Self {
        assert!(vocab_size > 2 * BYTE_TOKENS as usize, "a simulated vocabulary has more than 512 tokens");
        let words =
            (0..word_tokens(vocab_size)).map(|i| if i == 0 { Vec::new() } else { format!(" t{i}").into_bytes() });
        let bytes = words.chain((0..=255u8).map(|b| vec![b])).collect();
        SimVocab { bytes, eos: [SIM_EOS] }
    }

    /// The token of one byte of text.
    pub fn byte_token(&self, byte: u8) -> u32 {
        self.bytes.len() as u32 - BYTE_TOKENS + u32::from(byte)
    }
}

impl Vocab for SimVocab {
    fn token_bytes(&self, id: u32) -> &[u8] {
        &self.bytes[id as usize]
    }

    fn eos_ids(&self) -> &[u32] {
        &self.eos
    }
}
