//! Opening a GGUF file into a model and its tokenizer, and finding the default model.

use std::{
    fs::File,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use candle_core::quantized::gguf_file;

use crate::{
    model::{
        DeviceChoice,
        attention::KvDtype,
        llama::{LlamaModel, LoadOptions},
    },
    tokenizer::ModelTokenizer,
};

/// File name of the default model (SmolLM2-135M-Instruct), as `scripts/fetch-model.sh` stores it.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$BELLOWS_MODEL`, else the default model in `$BELLOWS_MODEL_DIR` or `~/.cache/bellows/models`.
pub fn default_model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("BELLOWS_MODEL") {
        return PathBuf::from(p);
    }
    cached_model_path(DEFAULT_MODEL_FILE)
}

/// Where `scripts/fetch-model.sh` puts a model file: `$BELLOWS_MODEL_DIR`, else
/// `~/.cache/bellows/models`.
pub fn cached_model_path(file: &str) -> PathBuf {
    let dir = std::env::var_os("BELLOWS_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/bellows/models"));
    dir.join(file)
}

/// The flags that choose and load a GGUF model, shared by every subcommand that loads one.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// GGUF model file [default: $BELLOWS_MODEL or ~/.cache/bellows/models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long, env = "BELLOWS_MODEL")]
    pub model: Option<PathBuf>,
    /// A tokenizer.json that overrides the GGUF's vocabulary.
    #[arg(long, env = "BELLOWS_TOKENIZER_JSON")]
    pub tokenizer_json: Option<PathBuf>,
    /// Keep Q4_1/Q5_0/Q5_1 weights as they are instead of re-quantizing them to Q8_0.
    #[arg(long, env = "BELLOWS_NO_REQUANTIZE")]
    pub no_requantize: bool,
    /// Do not zero-pad matmul inputs for candle's repacked Q8_0 kernels (slower, finer activation
    /// quantization; only where those kernels run: with `--candle-matmul` on a CPU with VNNI).
    #[arg(long, env = "BELLOWS_NO_REPACK")]
    pub no_repack: bool,
    /// Run Q8_0 matmuls on candle's kernels instead of ours (slower; for comparisons: Q4_1 is then
    /// re-quantized to Q8_0, and candle's repacked kernels quantize activations per 256 values
    /// rather than per 32).
    #[arg(long, env = "BELLOWS_CANDLE_MATMUL")]
    pub candle_matmul: bool,
    /// Keep the KV pool as tensors on the model's device and attend with candle's ops, as a GPU
    /// does, even on the CPU (slower there; for testing and comparing that path).
    #[arg(long, env = "BELLOWS_DEVICE_ATTENTION")]
    pub device_attention: bool,
    /// What the KV cache stores keys and values as: f32 (exact: greedy output matches llama.cpp's),
    /// f16 (half the memory a token, so twice the tokens in the same pool, and faster decode over
    /// long contexts; each key and value rounded once as it is stored) or bf16 (f16's memory, and
    /// attention's products in bfloat16 as well: prompts over a long history, such as a chat's
    /// next turn, prefill faster on CPUs with AVX-512 BF16). Host cache only.
    #[arg(long, env = "BELLOWS_KV_CACHE_DTYPE", value_enum, default_value_t = KvDtype::F32)]
    pub kv_cache_dtype: KvDtype,
    /// Where the model runs: auto (the GPU when this build has CUDA and CUDA starts, else the
    /// CPU, with a warning that gives CUDA's error), cpu, or cuda (the GPU or a startup error,
    /// never the CPU instead). The startup log says which device serves.
    #[arg(long, env = "BELLOWS_DEVICE", value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
}

impl ModelArgs {
    pub fn path(&self) -> PathBuf {
        self.model.clone().unwrap_or_else(default_model_path)
    }

    /// Load weights and tokenizer as these flags say.
    pub fn load(&self, progress: bool) -> Result<(LlamaModel, ModelTokenizer)> {
        let opts = LoadOptions {
            requantize: !self.no_requantize,
            repack: !self.no_repack,
            progress,
            own_matmul: !self.candle_matmul,
            device_attention: self.device_attention,
            kv_dtype: self.kv_cache_dtype,
            device: self.device,
        };
        load_gguf(&self.path(), &opts, self.tokenizer_json.as_deref())
    }
}

/// Load weights and tokenizer from one GGUF file (`tokenizer_json` overrides the vocabulary).
pub fn load_gguf(
    path: &Path,
    opts: &LoadOptions,
    tokenizer_json: Option<&Path>,
) -> Result<(LlamaModel, ModelTokenizer)> {
    let mut f = File::open(path).with_context(|| {
        format!("cannot open model {} (the default model comes from scripts/fetch-model.sh)", path.display())
    })?;
    let content = gguf_file::Content::read(&mut f).with_context(|| format!("{} is not a GGUF file", path.display()))?;
    let tokenizer = match tokenizer_json {
        Some(j) => ModelTokenizer::from_tokenizer_json(j, &content)?,
        None => ModelTokenizer::from_gguf(&content)?,
    };
    let model = LlamaModel::load(path, &content, opts)?;
    Ok((model, tokenizer))
}
