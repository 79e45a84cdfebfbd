//! Models the scheduler can drive: a real GGUF transformer and a simulated one.
//!
//! Both take a *ragged* batch: each row is one sequence's run of new tokens at its own positions
//! (one token for a decoding sequence, a chunk for a prefilling one), attending to that sequence's
//! own KV blocks. Rows are identified by their blocks, never by their index in the batch, so a
//! sequence leaving between steps cannot make another read the wrong cache.

pub mod attention;
pub mod device_attention;
pub(crate) mod exp;
pub mod int8_matmul;
pub mod llama;
pub mod rms_norm;
pub(crate) mod rows;
pub mod sim;
pub mod swiglu;

use crate::kv_cache::BlockId;

/// One sequence's share of a forward pass.
#[derive(Debug, Clone, Copy)]
pub struct BatchRow<'a> {
    /// New tokens to run, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: &'a [u32],
    pub start_pos: usize,
    /// The sequence's KV blocks, covering at least `start_pos + tokens.len()` positions.
    pub blocks: &'a [BlockId],
    /// Return logits for the row's last token (it will be sampled).
    pub want_logits: bool,
}

impl BatchRow<'_> {
    pub fn end_pos(&self) -> usize {
        self.start_pos + self.tokens.len()
    }
}

/// What the engine needs to know about a model, whatever runs it.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    pub model_id: String,
    pub architecture: String,
    pub vocab_size: usize,
    pub context_length: usize,
    /// Bytes of KV cache one token occupies (all layers, K and V).
    pub kv_bytes_per_token: usize,
    /// Where the forward pass and the KV pool run: "cpu", "cuda", or "sim".
    pub device: String,
}

/// Where models run: the first GPU when built with `cuda` and one is present, else the CPU.
pub fn default_device() -> candle_core::Device {
    #[cfg(feature = "cuda")]
    if let Ok(d) = candle_core::Device::new_cuda(0) {
        return d;
    }
    candle_core::Device::Cpu
}

/// The KV budget on the CPU when none is given, in MiB.
pub const DEFAULT_KV_CACHE_MB: usize = 512;

/// A model the scheduler can step. Implementations own their KV storage; the scheduler owns
/// which block belongs to whom.
pub trait Backend: Send {
    fn spec(&self) -> &ModelSpec;

    /// Serve the model under another name (the `model` clients ask for, and the prefix-hash
    /// salt). Called before the engine starts.
    fn set_model_id(&mut self, model_id: String);

    /// Bytes the KV pool takes when no budget is given: [`DEFAULT_KV_CACHE_MB`] unless the
    /// backend knows better (a GPU sizes it from its free memory).
    fn default_kv_cache_bytes(&self) -> anyhow::Result<usize> {
        Ok(DEFAULT_KV_CACHE_MB << 20)
    }

    /// Size the KV storage. Called once, before the first forward.
    fn allocate_kv(&mut self, num_blocks: usize, block_size: usize) -> anyhow::Result<()>;

    /// Run one step. Returns the last-token logits of every row with `want_logits`, in row order.
    fn forward(&mut self, rows: &[BatchRow<'_>]) -> anyhow::Result<Vec<Vec<f32>>>;
}
