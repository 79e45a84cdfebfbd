//! Opening a GGUF file into a model and its tokenizer, and finding the default model.

use std::{
    fs::File,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use candle_core::quantized::gguf_file;

use crate::{
    model::llama::{LlamaModel, LoadOptions},
    tokenizer::ModelTokenizer,
};

/// File name of the default model (SmolLM2-135M-Instruct), as `scripts/fetch-model.sh` stores it.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$BELLOWS_MODEL`, else the default model in `$BELLOWS_MODEL_DIR` or `~/.cache/bellows/models`.
pub fn default_model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("BELLOWS_MODEL") {
        return PathBuf::from(p);
    }
    let dir = std::env::var_os("BELLOWS_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/bellows/models"));
    dir.join(DEFAULT_MODEL_FILE)
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
