//! A llama-shaped model of any size with random weights, written as GGUF (`bellows-worker
//! synth-model`): for benchmarks where a real file cannot travel. A GPU machine here takes 64 MiB
//! per call, so a 7B-shaped model is made there, in seconds, instead of carried. It also writes
//! the `qwen2` and `qwen3` layouts (q/k/v biases; per-head q/k norms), so a family whose weights
//! no reachable registry holds can still be checked against llama.cpp on the same file.
//!
//! Its vocabulary, tokenizer and chat template are copied from a real GGUF (the default model),
//! so it loads, tokenizes and serves like any model; its text is noise. `--vocab-only` writes just
//! that part of a GGUF (its `tokenizer.*` metadata, no tensors: 1.8 MB of the default model's 98 MB),
//! which `--like` takes as it takes the whole file, so a machine the weights cannot travel to still
//! makes a model with the real vocabulary. Weights are Q8_0, random
//! quants with one scale per matrix chosen so each output has about the variance of its input
//! (activations neither vanish nor explode through the layers); norms are ones. Speed depends only
//! on the shapes and the format, so its rows measure the engine as a real model of that shape
//! would.

use std::{
    fs::File,
    io::BufWriter,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use candle_core::{
    Device,
    quantized::{GgmlDType, QStorage, QTensor, gguf_file},
};
use rand::{Rng, SeedableRng};

use crate::load::default_model_path;

/// The GGUF architecture to write.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthArch {
    Llama,
    /// Biases on q, k and v.
    Qwen2,
    /// Per-head RMS norms of q and k, no biases.
    Qwen3,
}

impl SynthArch {
    fn name(self) -> &'static str {
        match self {
            SynthArch::Llama => "llama",
            SynthArch::Qwen2 => "qwen2",
            SynthArch::Qwen3 => "qwen3",
        }
    }
}

/// The shape of the model to make; the defaults are Llama 2 7B's.
#[derive(clap::Args, Debug, Clone)]
pub struct SynthArgs {
    #[arg(long, value_enum, default_value_t = SynthArch::Llama)]
    pub arch: SynthArch,
    /// The GGUF whose vocabulary, tokenizer and chat template the new model takes [default: the
    /// default model].
    #[arg(long)]
    pub like: Option<PathBuf>,
    /// Where to write the model.
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 32)]
    pub layers: usize,
    #[arg(long, default_value_t = 4096)]
    pub hidden: usize,
    /// The MLP's inner width.
    #[arg(long, default_value_t = 11008)]
    pub ffn: usize,
    #[arg(long, default_value_t = 32)]
    pub heads: usize,
    #[arg(long, default_value_t = 32)]
    pub kv_heads: usize,
    /// The width of a head [default: hidden / heads]; Qwen3's and Gemma's are wider.
    #[arg(long)]
    pub head_dim: Option<usize>,
    #[arg(long, default_value_t = 4096)]
    pub context: usize,
    /// The rotary embedding's base (`rope.freq_base`); the default model's is 100000.
    #[arg(long, default_value_t = 10_000.0)]
    pub rope_base: f32,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write no model: only the vocabulary of `--like` (its `tokenizer.*` metadata: tokens, merges,
    /// special ids, chat template) and its architecture's name, no tensors. `--like` on that file
    /// makes the same model as `--like` on the source.
    #[arg(long, conflicts_with_all = [
        "arch", "layers", "hidden", "ffn", "heads", "kv_heads", "head_dim", "context", "rope_base", "seed",
    ])]
    pub vocab_only: bool,
}

/// Bytes of one Q8_0 block: an f16 scale and 32 signed quants.
const Q8_0_BLOCK: usize = 34;
const Q8_0_WEIGHTS: usize = 32;

impl SynthArgs {
    fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden / self.heads)
    }
}

/// Write the model `a` describes; returns its weight bytes.
pub fn write(a: &SynthArgs) -> Result<u64> {
    anyhow::ensure!(!a.vocab_only, "--vocab-only writes no model: call write_vocab");
    anyhow::ensure!(
        a.head_dim.is_some() || a.hidden.is_multiple_of(a.heads),
        "--hidden {} is no multiple of --heads {} (or give --head-dim)",
        a.hidden,
        a.heads
    );
    anyhow::ensure!(
        a.heads.is_multiple_of(a.kv_heads),
        "--heads {} is no multiple of --kv-heads {}",
        a.heads,
        a.kv_heads
    );
    for (name, width) in [("--hidden", a.hidden), ("--ffn", a.ffn), ("--heads x --head-dim", a.heads * a.head_dim())] {
        anyhow::ensure!(width.is_multiple_of(Q8_0_WEIGHTS), "{name} {width} is no multiple of {Q8_0_WEIGHTS}");
    }
    let (source, vocab) = read_source(a)?;
    let metadata = metadata(a, &source);
    let tensors = tensors(a, vocab)?;
    let bytes = tensors.iter().map(|(_, t)| t.storage_size_in_bytes() as u64).sum();
    write_gguf(&a.out, &metadata, &tensors)?;
    Ok(bytes)
}

/// `--vocab-only`: write the vocabulary of `--like` (its `tokenizer.*` metadata) with its
/// architecture's name and no tensors; returns the number of tokens.
pub fn write_vocab(a: &SynthArgs) -> Result<usize> {
    let (source, vocab) = read_source(a)?;
    let name = match source.metadata.get("general.name") {
        Some(gguf_file::Value::String(n)) => n.clone(),
        _ => "a model".to_string(),
    };
    let mut metadata = vec![("general.name".to_string(), gguf_file::Value::String(format!("vocabulary of {name}")))];
    if let Some(arch) = source.metadata.get("general.architecture") {
        metadata.insert(0, ("general.architecture".to_string(), arch.clone()));
    }
    metadata.extend(tokenizer_metadata(&source));
    write_gguf(&a.out, &metadata, &[])?;
    Ok(vocab)
}

/// The source GGUF's header (`--like`, else the default model) and its vocabulary size.
fn read_source(a: &SynthArgs) -> Result<(gguf_file::Content, usize)> {
    let like = a.like.clone().unwrap_or_else(default_model_path);
    let mut file = File::open(&like).with_context(|| format!("opening {}", like.display()))?;
    let source = gguf_file::Content::read(&mut file).with_context(|| format!("reading {}", like.display()))?;
    let vocab = match source.metadata.get("tokenizer.ggml.tokens") {
        Some(gguf_file::Value::Array(tokens)) => tokens.len(),
        _ => anyhow::bail!("{} has no tokenizer.ggml.tokens", like.display()),
    };
    Ok((source, vocab))
}

fn write_gguf(path: &Path, metadata: &[(String, gguf_file::Value)], tensors: &[(String, QTensor)]) -> Result<()> {
    let mut out = BufWriter::new(File::create(path).with_context(|| format!("creating {}", path.display()))?);
    let metadata: Vec<(&str, &gguf_file::Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut out, &metadata, &tensors)?;
    out.into_inner().map_err(|e| e.into_error()).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// The hyper-parameters of `a` under its architecture's keys, and every `tokenizer.*` entry of
/// the source.
fn metadata(a: &SynthArgs, source: &gguf_file::Content) -> Vec<(String, gguf_file::Value)> {
    use gguf_file::Value::{F32, String as Text, U32};
    let u = |n: usize| U32(n as u32);
    let arch = a.arch.name();
    let key = |k: &str| format!("{arch}.{k}");
    let mut m = vec![
        ("general.architecture".to_string(), Text(arch.into())),
        ("general.name".to_string(), Text(format!("synthetic {arch} {}x{}", a.layers, a.hidden))),
        (key("block_count"), u(a.layers)),
        (key("embedding_length"), u(a.hidden)),
        (key("feed_forward_length"), u(a.ffn)),
        (key("attention.head_count"), u(a.heads)),
        (key("attention.head_count_kv"), u(a.kv_heads)),
        (key("attention.key_length"), u(a.head_dim())),
        (key("attention.value_length"), u(a.head_dim())),
        (key("context_length"), u(a.context)),
        (key("rope.freq_base"), F32(a.rope_base)),
        (key("attention.layer_norm_rms_epsilon"), F32(1e-5)),
    ];
    m.extend(tokenizer_metadata(source));
    m
}

/// Every `tokenizer.*` entry of `source`, sorted by key (so the same vocabulary always writes the
/// same bytes, whichever file it came from).
fn tokenizer_metadata(source: &gguf_file::Content) -> Vec<(String, gguf_file::Value)> {
    let mut tokenizer: Vec<_> = source
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    tokenizer.sort_by(|x, y| x.0.cmp(&y.0));
    tokenizer
}

/// Every tensor of the model, named as GGUF llama files name them.
fn tensors(a: &SynthArgs, vocab: usize) -> Result<Vec<(String, QTensor)>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(a.seed);
    let (q, kv) = (a.heads * a.head_dim(), a.kv_heads * a.head_dim());
    let mut t = vec![
        ("token_embd.weight".to_string(), random_q8_0(&mut rng, vocab, a.hidden)?),
        ("output_norm.weight".to_string(), ones(a.hidden)?),
    ];
    for i in 0..a.layers {
        let p = |s: &str| format!("blk.{i}.{s}");
        t.push((p("attn_norm.weight"), ones(a.hidden)?));
        t.push((p("ffn_norm.weight"), ones(a.hidden)?));
        for (name, rows, cols) in [
            ("attn_q.weight", q, a.hidden),
            ("attn_k.weight", kv, a.hidden),
            ("attn_v.weight", kv, a.hidden),
            ("attn_output.weight", a.hidden, q),
            ("ffn_gate.weight", a.ffn, a.hidden),
            ("ffn_up.weight", a.ffn, a.hidden),
            ("ffn_down.weight", a.hidden, a.ffn),
        ] {
            t.push((p(name), random_q8_0(&mut rng, rows, cols)?));
        }
        // Norm weights and biases away from one and zero, so a weight applied to the wrong place
        // changes the output.
        match a.arch {
            SynthArch::Llama => {}
            SynthArch::Qwen2 => {
                for (name, n) in [("attn_q.bias", q), ("attn_k.bias", kv), ("attn_v.bias", kv)] {
                    t.push((p(name), random_f32(&mut rng, n, -0.5..0.5)?));
                }
            }
            SynthArch::Qwen3 => {
                for name in ["attn_q_norm.weight", "attn_k_norm.weight"] {
                    t.push((p(name), random_f32(&mut rng, a.head_dim(), 0.5..1.5)?));
                }
            }
        }
    }
    Ok(t)
}

fn f32_tensor(values: impl Iterator<Item = f32>) -> Result<QTensor> {
    let bytes: Vec<u8> = values.flat_map(f32::to_le_bytes).collect();
    let n = bytes.len() / 4;
    Ok(QTensor::new(QStorage::from_data(bytes.into(), &Device::Cpu, GgmlDType::F32)?, n)?)
}

fn random_f32(rng: &mut impl Rng, n: usize, range: std::ops::Range<f32>) -> Result<QTensor> {
    f32_tensor((0..n).map(|_| rng.random_range(range.clone())))
}

fn ones(n: usize) -> Result<QTensor> {
    f32_tensor(std::iter::repeat_n(1.0, n))
}

/// A `[rows, cols]` Q8_0 matrix of uniform random quants, scaled so a row's dot product with a
/// unit-variance input has about unit variance.
fn random_q8_0(rng: &mut impl Rng, rows: usize, cols: usize) -> Result<QTensor> {
    // A uniform quant in [-127, 127] has a standard deviation of about 73.
    let scale = half::f16::from_f32(1.0 / (73.3 * (cols as f32).sqrt())).to_le_bytes();
    let blocks = rows * cols / Q8_0_WEIGHTS;
    let mut bytes = vec![0u8; blocks * Q8_0_BLOCK];
    for block in bytes.chunks_exact_mut(Q8_0_BLOCK) {
        block[..2].copy_from_slice(&scale);
        for q in &mut block[2..] {
            *q = rng.random_range(-127i8..=127) as u8;
        }
    }
    Ok(QTensor::new(QStorage::from_data(bytes.into(), &Device::Cpu, GgmlDType::Q8_0)?, (rows, cols))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        engine::{Engine, EngineConfig},
        load::load_gguf,
        model::{Backend, llama::LoadOptions},
        request::{Event, GenerateRequest},
        sampling::SamplingParams,
    };

    #[test]
    fn a_synthetic_model_loads_with_its_shape_and_generates_with_the_sources_tokenizer() {
        let like = default_model_path();
        assert!(like.exists(), "model {} is missing: run scripts/fetch-model.sh", like.display());
        let dir = tempfile::tempdir().unwrap();
        let a = SynthArgs {
            like: Some(like.clone()),
            arch: SynthArch::Llama,
            out: dir.path().join("tiny.gguf"),
            layers: 2,
            hidden: 128,
            ffn: 256,
            heads: 4,
            kv_heads: 2,
            head_dim: None,
            context: 256,
            rope_base: 10_000.0,
            seed: 7,
            vocab_only: false,
        };
        let bytes = write(&a).unwrap();
        let (model, tok) = load_gguf(&a.out, &LoadOptions::default(), None).expect("the synthetic model loads");
        let (_, source_tok) = load_gguf(&like, &LoadOptions::default(), None).unwrap();
        let spec = model.spec().clone();
        assert_eq!((spec.architecture.as_str(), spec.context_length), ("llama", 256));
        assert_eq!(spec.kv_bytes_per_token, 2 * 2 * 2 * 32 * 4, "layers x K and V x kv heads x head size x f32");
        let vocab = spec.vocab_size;
        // Embedding and two layers of q, k, v, o, gate, up, down at 34 bytes per 32 weights, plus norms.
        let q8 = (vocab * 128 + 2 * (128 * 128 * 2 + 64 * 128 * 2 + 256 * 128 * 3)) / 32 * 34;
        assert_eq!(bytes as usize, q8 + 4 * 128 * 5);
        let text = "Digits 12345 and <|im_start|>user\nhi<|im_end|>";
        assert_eq!(tok.encode(text, false).unwrap(), source_tok.encode(text, false).unwrap());

        let engine = Engine::start(Box::new(model), std::sync::Arc::new(tok), EngineConfig::default()).unwrap();
        let mut req = GenerateRequest::new(vec![1, 2, 3], SamplingParams::greedy(), 8);
        req.ignore_eos = true;
        let mut rx = engine.handle().submit(req).unwrap();
        let mut tokens = 0;
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                Event::Token { id, .. } => {
                    assert!((id as usize) < vocab);
                    tokens += 1;
                }
                Event::Finished { .. } => break,
                Event::Failed { message } => panic!("generation failed: {message}"),
                Event::Progress(_) => {}
            }
        }
        assert_eq!(tokens, 8);
    }

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: SynthArgs,
    }

    fn args(argv: &[&str]) -> Result<SynthArgs, clap::Error> {
        use clap::Parser;
        Cli::try_parse_from(std::iter::once("synth-model").chain(argv.iter().copied())).map(|c| c.a)
    }

    fn header(path: &Path) -> gguf_file::Content {
        gguf_file::Content::read(&mut File::open(path).unwrap()).unwrap()
    }

    /// A GGUF's metadata as text, key by key (candle's values have no `PartialEq`).
    fn entries(c: &gguf_file::Content, keep: impl Fn(&str) -> bool) -> Vec<(String, String)> {
        let mut e: Vec<_> =
            c.metadata.iter().filter(|(k, _)| keep(k)).map(|(k, v)| (k.clone(), format!("{v:?}"))).collect();
        e.sort();
        e
    }

    #[test]
    fn a_vocab_only_file_holds_only_the_vocabulary_and_makes_the_same_model_as_its_source() {
        let like = default_model_path();
        assert!(like.exists(), "model {} is missing: run scripts/fetch-model.sh", like.display());
        let dir = tempfile::tempdir().unwrap();
        let (like_s, vocab) = (like.to_str().unwrap(), dir.path().join("vocab.gguf"));
        let a = args(&["--vocab-only", "--like", like_s, "--out", vocab.to_str().unwrap()]).unwrap();
        assert!(write(&a).is_err(), "write makes models, never a vocabulary");
        let tokens = write_vocab(&a).unwrap();

        let (source, only) = (header(&like), header(&vocab));
        assert_eq!(tokens, 49152);
        assert!(only.tensor_infos.is_empty(), "no tensors: {:?}", only.tensor_infos.keys().take(3).collect::<Vec<_>>());
        let tokenizer = |k: &str| k.starts_with("tokenizer.");
        assert_eq!(entries(&only, tokenizer), entries(&source, tokenizer));
        assert!(entries(&source, tokenizer).iter().any(|(k, _)| k == "tokenizer.chat_template"));
        let rest: Vec<String> = entries(&only, |k| !tokenizer(k)).into_iter().map(|(k, _)| k).collect();
        assert_eq!(rest, ["general.architecture", "general.name"], "nothing of the model but its name");
        let (small, big) = (std::fs::metadata(&vocab).unwrap().len(), std::fs::metadata(&like).unwrap().len());
        assert!(small * 20 < big, "{small} bytes of vocabulary against the model's {big}");

        // A model made from the vocabulary is, byte for byte, the one made from the whole source.
        let shape = ["--layers", "2", "--hidden", "64", "--ffn", "128", "--heads", "2", "--kv-heads", "1"];
        let (from_vocab, from_source) = (dir.path().join("a.gguf"), dir.path().join("b.gguf"));
        for (from, out) in [(&vocab, &from_vocab), (&like, &from_source)] {
            let mut argv =
                vec!["--like", from.to_str().unwrap(), "--out", out.to_str().unwrap(), "--rope-base", "100000"];
            argv.extend(shape);
            write(&args(&argv).unwrap()).unwrap();
        }
        assert!(std::fs::read(&from_vocab).unwrap() == std::fs::read(&from_source).unwrap(), "the two models differ");
        let cfg = crate::model::llama::LlamaConfig::from_gguf(&header(&from_vocab)).unwrap();
        assert_eq!((cfg.rope_theta, cfg.n_layer, cfg.hidden, cfg.vocab_size), (100_000.0, 2, 64, 49152));
        let (_, tok) = load_gguf(&from_vocab, &LoadOptions::default(), None).expect("the model loads");
        let (_, source_tok) = load_gguf(&like, &LoadOptions::default(), None).unwrap();
        let text = "Digits 12345 and <|im_start|>user\nhi<|im_end|>";
        assert_eq!(tok.encode(text, false).unwrap(), source_tok.encode(text, false).unwrap());
    }

    #[test]
    fn vocab_only_refuses_the_shape_flags_it_would_ignore() {
        for flag in [["--layers", "2"], ["--rope-base", "100000"], ["--seed", "3"]] {
            let mut argv = vec!["--vocab-only", "--out", "v.gguf"];
            argv.extend(flag);
            let e = args(&argv).err().unwrap_or_else(|| panic!("{flag:?} accepted with --vocab-only"));
            assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{flag:?}: {e}");
        }
        assert_eq!(args(&["--out", "m.gguf"]).unwrap().rope_base, 10_000.0, "the default base is llama's");
    }
}
