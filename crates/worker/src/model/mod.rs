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
#[cfg(test)]
pub(crate) mod kernel_check;
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

/// Which device a model runs on (`--device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DeviceChoice {
    /// The first GPU when the build has CUDA and CUDA starts (a warning with CUDA's error when it
    /// does not), else the CPU.
    #[default]
    Auto,
    Cpu,
    /// The first GPU, or an error: never the CPU in its place.
    Cuda,
}

/// Why the device asked for cannot serve.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("--device cuda: this worker was built without CUDA (scripts/build-cuda.sh builds one)")]
    NotBuilt,
    #[error("--device cuda: CUDA does not start: {0}")]
    Unusable(String),
}

/// The device `choice` names. CUDA's own error is never dropped: it fails `Cuda`, and `Auto`
/// logs it as it falls back, so a GPU machine whose CUDA is broken cannot pass for a GPU run.
pub fn select_device(choice: DeviceChoice) -> Result<candle_core::Device, DeviceError> {
    match choice {
        DeviceChoice::Cpu => Ok(candle_core::Device::Cpu),
        DeviceChoice::Cuda => cuda(),
        DeviceChoice::Auto if cfg!(feature = "cuda") => Ok(cuda().unwrap_or_else(|e| {
            tracing::warn!("CUDA is not usable, so the model runs on the CPU: {e}");
            candle_core::Device::Cpu
        })),
        DeviceChoice::Auto => Ok(candle_core::Device::Cpu),
    }
}

fn cuda() -> Result<candle_core::Device, DeviceError> {
    if !cfg!(feature = "cuda") {
        return Err(DeviceError::NotBuilt);
    }
    candle_core::Device::new_cuda(0).map_err(|e| DeviceError::Unusable(e.to_string()))
}

/// The device the device-path unit tests run on: CUDA in a CUDA build (failing when CUDA does
/// not start, never passing on the CPU instead), the CPU otherwise.
#[cfg(test)]
pub(crate) fn test_device() -> candle_core::Device {
    let choice = if cfg!(feature = "cuda") { DeviceChoice::Cuda } else { DeviceChoice::Cpu };
    select_device(choice).unwrap_or_else(|e| panic!("the device tests' device: {e}"))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_asked_for_is_cuda_or_an_error_never_the_cpu() {
        assert!(select_device(DeviceChoice::Cpu).unwrap().is_cpu());
        match select_device(DeviceChoice::Cuda) {
            Ok(device) => assert!(device.is_cuda(), "--device cuda served on {device:?}"),
            Err(e) if cfg!(feature = "cuda") => assert!(matches!(e, DeviceError::Unusable(_)), "{e}"),
            Err(e) => assert!(matches!(e, DeviceError::NotBuilt), "{e}"),
        }
    }
}
