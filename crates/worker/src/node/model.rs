//! Starting the engine a node serves, and describing it to routers (ModelInfo).
//!
//! ModelInfo carries everything a router needs to tokenize, render chat prompts and hash
//! prefixes exactly as this worker does, so routers never need model files. The simulated engine
//! has no tokenizer: its ModelInfo has empty tokenizer bytes and no chat template, and a router
//! in front of simulated workers must send token ids it made up itself.

use std::sync::Arc;

use anyhow::{Context, Result};
use bellows_proto::worker::v1 as pb;

use super::args::{EngineKind, ServeArgs};
use crate::{
    engine::Engine,
    model::{
        Backend,
        sim::{SimModel, SimVocab},
    },
    tokenizer::ModelTokenizer,
    vocab::Vocab,
};

/// A started engine and what the node says about it.
pub struct LoadedModel {
    pub engine: Engine,
    pub info: pb::ModelInfoResponse,
    /// For `--log-prompts` (none for the simulated engine).
    pub tokenizer: Option<Arc<ModelTokenizer>>,
}

/// Load the model and start the engine (blocking: seconds for a real model).
pub fn load(args: &ServeArgs) -> Result<LoadedModel> {
    let cfg = args.engine_config();
    match args.engine {
        EngineKind::Gguf => {
            let (mut model, tok) = args.model.load(false)?;
            if let Some(id) = &args.model_id {
                model.set_model_id(id.clone());
            }
            let tok = Arc::new(tok);
            let tokenizer_json = tok.tokenizer_json().context("serializing the tokenizer for ModelInfo")?;
            let info = describe(
                model.spec(),
                tok.as_ref(),
                tok.bos_id(),
                tokenizer_json.into_bytes(),
                tok.chat_template().map(str::to_string),
            );
            let engine = Engine::start(Box::new(model), tok.clone(), cfg)?;
            Ok(LoadedModel { info: finish(info, &engine), engine, tokenizer: Some(tok) })
        }
        EngineKind::Sim => {
            let sim = args.sim_config()?;
            let mut model = SimModel::new(sim.clone());
            if let Some(id) = &args.model_id {
                model.set_model_id(id.clone());
            }
            let vocab = Arc::new(SimVocab::new(sim.vocab_size));
            let info = describe(model.spec(), vocab.as_ref(), None, Vec::new(), None);
            let engine = Engine::start(Box::new(model), vocab, cfg)?;
            Ok(LoadedModel { info: finish(info, &engine), engine, tokenizer: None })
        }
    }
}

fn describe(
    spec: &crate::model::ModelSpec,
    vocab: &dyn Vocab,
    bos: Option<u32>,
    tokenizer_json: Vec<u8>,
    chat_template: Option<String>,
) -> pb::ModelInfoResponse {
    pb::ModelInfoResponse {
        model_id: spec.model_id.clone(),
        architecture: spec.architecture.clone(),
        vocab_size: spec.vocab_size as u32,
        eos_token_ids: vocab.eos_ids().to_vec(),
        bos_token_id: bos,
        tokenizer_json,
        chat_template,
        worker_version: env!("CARGO_PKG_VERSION").to_string(),
        ..Default::default()
    }
}

/// What only the started engine knows: the usable context (bounded by the KV pool) and the
/// block size.
fn finish(mut info: pb::ModelInfoResponse, engine: &Engine) -> pb::ModelInfoResponse {
    let h = engine.handle();
    info.context_length = h.context_length() as u32;
    info.kv_block_size = h.block_size() as u32;
    info.kv_cache_bytes = h.kv_cache_bytes() as u64;
    info.device = h.spec().device.clone();
    info
}
