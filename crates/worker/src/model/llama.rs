//! Llama-family transformers (GGUF `llama`, `qwen2`, `qwen3`, `gemma3`) with a batched, ragged
//! forward pass.
//!
//! The families differ in a few places, each a field of [`Family`]'s traits rather than a copy of
//! the forward: how rotary pairs dimensions, per-head norms of q and k (Qwen3, Gemma 3), norms
//! after attention and after the MLP (Gemma 3), a scaled embedding, the MLP's activation, biases
//! on q/k/v (Qwen2, where the file has them), and sliding-window layers with their own rope base
//! (Gemma 3: five local layers of 512 positions to each global one). Each family is checked
//! against llama.cpp on a file (`tests/engine_real_model.rs`): greedy tokens on real weights for
//! llama and Gemma 3; logits along llama.cpp's greedy sequence for Qwen2 and Qwen3, on files of
//! their shape made by `synth` (no Qwen3 weights are in the package registries this project can
//! reach, and a real Qwen2 is too large for CI).
//!
//! Why our own forward rather than candle's stock models: those keep one KV cache per model and
//! fail on batched prefill, so they cannot serve many sequences at once. Here every linear layer
//! runs once over *all* tokens of a step (decode tokens and prefill chunks together), so batching
//! shares each weight read; attention runs per sequence over its own paged KV: on the host
//! (`attention`, bit-exact) or, on a GPU, as device tensors (`device_attention`).
//!
//! Loading re-quantizes formats whose CPU matmul has no SIMD kernel (Q4_1, Q5_0, Q5_1) to Q8_0 (on
//! the CPU; a GPU keeps the file's format), and fuses Q/K/V and gate/up into one matmul each by
//! concatenating quantized rows (exact: a GGUF row is a whole number of quantization blocks).

use std::{fs::File, path::Path};

use anyhow::{Context, Result, bail};
use candle_core::{
    D, Device, Module, Tensor,
    quantized::{GgmlDType, QMatMul, QStorage, QTensor, gguf_file},
};

use super::{
    Backend, BatchRow, DeviceChoice, ModelSpec,
    attention::{Attention, Heads, KvDtype, LayerKv, Rope, RopeStyle, paged_attention},
    device_attention::{DeviceKv, DeviceRope, StepPlan, paged_attention_on_device},
    int8_matmul::{self, Int8Weights},
    rms_norm,
    rows::{RowFill, map_rows, on_host, split_columns},
    swiglu,
};

/// Load-time choices.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Re-quantize Q4_1/Q5_0/Q5_1 weights to Q8_0 (faster matmuls on x86, slightly more memory);
    /// Q4_1 stays as it is where our int8 kernels take it.
    pub requantize: bool,
    /// Zero-pad matmul inputs so candle's repacked Q8_0 kernels apply, where the CPU has them and
    /// our int8 kernels do not take the matrix (about 1.5x faster decode on the default model;
    /// activations are then quantized per 256 values instead of per 32).
    pub repack: bool,
    /// Show a progress bar on stderr while loading (hidden when stderr is not a terminal).
    pub progress: bool,
    /// Run every Q8_0 and Q4_1 matmul on our own kernels (`int8_matmul`) where the CPU has them
    /// (AVX-512 VNNI or AVX2).
    pub own_matmul: bool,
    /// Keep the KV pool as tensors on the model's device and attend with candle's ops
    /// (`device_attention`), even on the CPU: how CI tests the path a GPU runs. A CUDA device
    /// always takes it (the host kernel would copy q, k and v to the host in every layer).
    pub device_attention: bool,
    /// What the host KV cache stores keys and values as (the device path keeps f32).
    pub kv_dtype: KvDtype,
    /// Where the model runs.
    pub device: DeviceChoice,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            requantize: true,
            repack: true,
            progress: false,
            own_matmul: true,
            device_attention: false,
            kv_dtype: KvDtype::F32,
            device: DeviceChoice::Auto,
        }
    }
}

/// The architectures this forward runs (GGUF `general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
}

impl Family {
    fn from_architecture(arch: &str) -> Result<Self> {
        Ok(match arch {
            "llama" => Family::Llama,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            "gemma3" => Family::Gemma3,
            other => bail!("unsupported architecture {other:?} (supported: llama, qwen2, qwen3, gemma3)"),
        })
    }

    fn rope_style(self) -> RopeStyle {
        match self {
            Family::Llama => RopeStyle::Interleaved,
            Family::Qwen2 | Family::Qwen3 | Family::Gemma3 => RopeStyle::Halves,
        }
    }

    /// Qwen3 and Gemma 3 normalize q and k per head, before rotary.
    fn qk_norms(self) -> bool {
        matches!(self, Family::Qwen3 | Family::Gemma3)
    }

    /// Gemma also normalizes each sub-layer's output before the residual add.
    fn post_norms(self) -> bool {
        self == Family::Gemma3
    }

    /// Gemma multiplies the embedding by sqrt(hidden).
    fn embed_scale(self, hidden: usize) -> Option<f64> {
        (self == Family::Gemma3).then(|| (hidden as f64).sqrt())
    }

    fn activation(self) -> Activation {
        if self == Family::Gemma3 { Activation::GeluTanh } else { Activation::Silu }
    }
}

/// The MLP's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Activation {
    Silu,
    /// GELU, tanh approximation (Gemma's `gelu_pytorch_tanh`; llama.cpp's `ggml_gelu`).
    GeluTanh,
}

/// Sliding-window attention on some layers (Gemma 3): layer `i` is local unless
/// `(i + 1) % period == 0`; local layers see the last `window` positions and use their own rope base.
#[derive(Debug, Clone, Copy)]
pub struct SlidingWindow {
    pub window: usize,
    pub period: usize,
    pub rope_theta: f32,
}

impl SlidingWindow {
    fn is_local(&self, layer: usize) -> bool {
        !(layer + 1).is_multiple_of(self.period)
    }
}

/// Hyper-parameters read from GGUF metadata.
#[derive(Debug, Clone)]
pub struct LlamaConfig {
    pub architecture: String,
    pub family: Family,
    pub n_layer: usize,
    pub hidden: usize,
    pub heads: Heads,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub context_length: usize,
    pub vocab_size: usize,
    pub sliding: Option<SlidingWindow>,
}

impl LlamaConfig {
    pub fn from_gguf(c: &gguf_file::Content) -> Result<Self> {
        let arch =
            c.metadata.get("general.architecture").context("GGUF has no general.architecture")?.to_string()?.clone();
        let family = Family::from_architecture(&arch)?;
        let get = |k: &str| c.metadata.get(&format!("{arch}.{k}")).with_context(|| format!("GGUF lacks {arch}.{k}"));
        let n_head = get("attention.head_count")?.to_u32()? as usize;
        let hidden = get("embedding_length")?.to_u32()? as usize;
        let n_kv_head = match get("attention.head_count_kv") {
            Ok(v) => v.to_u32()? as usize,
            Err(_) => n_head,
        };
        // Gemma's heads are wider than hidden / heads; the GGUF says so.
        let head_dim = match get("attention.key_length") {
            Ok(v) => v.to_u32()? as usize,
            Err(_) => hidden / n_head,
        };
        let vocab_size =
            c.tensor_infos.get("token_embd.weight").context("GGUF lacks token_embd.weight")?.shape.dims()[0];
        // llama.cpp's Gemma 3 constants: every sixth layer global, local layers at rope base 10^4.
        let sliding = match (family, get("attention.sliding_window")) {
            (Family::Gemma3, Ok(w)) => {
                Some(SlidingWindow { window: w.to_u32()? as usize, period: 6, rope_theta: 10_000.0 })
            }
            _ => None,
        };
        Ok(LlamaConfig {
            family,
            n_layer: get("block_count")?.to_u32()? as usize,
            hidden,
            heads: Heads { n_head, n_kv_head, head_dim },
            rope_theta: get("rope.freq_base").and_then(|v| Ok(v.to_f32()?)).unwrap_or(10000.0),
            rms_eps: get("attention.layer_norm_rms_epsilon")?.to_f32()?,
            context_length: get("context_length")?.to_u32()? as usize,
            vocab_size,
            sliding,
            architecture: arch,
        })
    }

    /// The attention scale. Gemma 3 27B scales by hidden / heads, not by the head width
    /// (llama.cpp, after gemma_pytorch's config).
    fn attention_scale(&self) -> f32 {
        let width = if self.family == Family::Gemma3 && self.n_layer == 62 {
            self.hidden / self.heads.n_head
        } else {
            self.heads.head_dim
        };
        1.0 / (width as f32).sqrt()
    }
}

/// A quantized matmul. For Q8_0 and Q4_1 weights, our tiled kernels where the CPU has AVX-512 VNNI
/// or AVX2 (`int8_matmul`: any input width that is a whole number of blocks, weights at their
/// file's size, the same bits on either); without ours (`--candle-matmul`), candle's repacked
/// Q8_0 kernels where it has VNNI of some kind, on every matrix whose outputs are a multiple of 16,
/// with the input zero-padded to a multiple of 256 columns where it is not one already (zero
/// columns add exact zeros); else candle's generic kernels. Every kernel works row by row, so
/// batch invariance holds.
enum Linear {
    Candle { mm: QMatMul, pad: usize },
    Int8(Int8Weights),
}

impl Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Linear::Int8(w) => w.forward(x),
            Linear::Candle { mm, pad: 0 } => Ok(mm.forward(x)?),
            Linear::Candle { mm, pad } => Ok(mm.forward(&x.pad_with_zeros(D::Minus1, 0, *pad)?)?),
        }
    }

    /// The product with the `m` rows, `k` wide, that `fill` writes (a norm's or a gate's): our
    /// int8 kernels quantize each as it is made; candle's take them whole.
    fn forward_rows(&self, m: usize, k: usize, fill: &RowFill<'_>) -> Result<Tensor> {
        match self {
            Linear::Int8(w) => w.forward_rows(m, k, fill),
            _ => self.forward(&Tensor::from_vec(map_rows(m, k, fill), (m, k), &Device::Cpu)?),
        }
    }
}

/// Whether candle 0.11's repacked Q8_0 matmul runs on this CPU (it needs VNNI; plain AVX2 falls
/// back to the generic kernel, where padding would only cost).
pub(crate) fn cpu_has_repacked_q8_0() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avxvnni")
            || (std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512vnni"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Row widths the repacked kernels take.
const REPACK_K: usize = 256;
const REPACK_N: usize = 16;

/// One or more projections that share an input, run as a single matmul.
struct Fused {
    mm: Linear,
    bias: Option<Tensor>,
    widths: Vec<usize>,
}

impl Fused {
    /// The outputs side by side, as the one matmul gives them.
    fn whole(&self, x: &Tensor) -> Result<Tensor> {
        self.with_bias(self.mm.forward(x)?)
    }

    /// `whole` of `x`'s rows RMS-normed by `weight`: on the host the matmul takes each row as it
    /// is normed (see `Linear::forward_rows`), the normed rows never written out.
    fn whole_normed(&self, x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
        let k = weight.dims1()?;
        match rms_norm::with_rows(x, weight, eps, |m, fill| self.with_bias(self.mm.forward_rows(m, k, fill)?))? {
            Some(y) => Ok(y),
            None => self.whole(&rms_norm::rms_norm(x, weight, eps)?),
        }
    }

    fn with_bias(&self, y: Tensor) -> Result<Tensor> {
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// Each output's rows in host memory, one vector each: read in one pass from a host tensor
    /// (where narrowing each out and copying it to a vector read everything twice), copied
    /// from a device's.
    fn host_parts(&self, y: Tensor) -> Result<Vec<Vec<f32>>> {
        if let Some(parts) = on_host(&y, |v| split_columns(v, &self.widths)) {
            return Ok(parts);
        }
        self.split(y)?.iter().map(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?)).collect()
    }

    /// Each output on its own.
    fn split(&self, y: Tensor) -> Result<Vec<Tensor>> {
        if self.widths.len() == 1 {
            return Ok(vec![y]);
        }
        let mut out = Vec::with_capacity(self.widths.len());
        let mut at = 0;
        for &w in &self.widths {
            out.push(y.narrow(D::Minus1, at, w)?.contiguous()?);
            at += w;
        }
        Ok(out)
    }
}

/// Per-head norms of q and k (Qwen3, Gemma 3).
struct QkNorms {
    q: Tensor,
    k: Tensor,
}

/// Norms of each sub-layer's output (Gemma 3).
struct PostNorms {
    attention: Tensor,
    ffn: Tensor,
}

struct Layer {
    attn_norm: Tensor,
    qkv: Fused,
    wo: Linear,
    ffn_norm: Tensor,
    gate_up: Fused,
    down: Linear,
    qk_norms: Option<QkNorms>,
    post_norms: Option<PostNorms>,
    /// The positions this layer attends to (None: all); a sliding-window layer also takes the
    /// second rope table.
    window: Option<usize>,
}

pub struct LlamaModel {
    spec: ModelSpec,
    cfg: LlamaConfig,
    device: Device,
    embed: QTensor,
    /// Gemma multiplies the embedding by sqrt(hidden).
    embed_scale: Option<f64>,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    /// One table per rope base: global layers use the first, sliding-window layers the second.
    ropes: Vec<Rope>,
    /// Whether `allocate_kv` puts the pool on the device (see [`LoadOptions::device_attention`]).
    device_attention: bool,
    /// What a host pool stores (see [`LoadOptions::kv_dtype`]).
    kv_dtype: KvDtype,
    kv: KvStore,
}

/// Where the KV pool lives, and so which attention runs over it.
enum KvStore {
    /// Not yet sized: `allocate_kv` comes first.
    Unallocated,
    /// Host memory and the host kernel (`attention`): bit-exact whatever the batch or chunk.
    Host(Vec<LayerKv>),
    /// Tensors on the model's device and the device-generic path (`device_attention`), with the
    /// rope tables there too and the distinct windows of the layers (each step's masks).
    Device { layers: Vec<DeviceKv>, ropes: Vec<DeviceRope>, windows: Vec<Option<usize>>, block_size: usize },
}

/// One layer's share of the KV pool, as a step sees it.
enum LayerStore<'a> {
    Host(&'a mut LayerKv),
    Device { kv: &'a DeviceKv, plan: &'a StepPlan },
}

struct Loader<'a> {
    content: &'a gguf_file::Content,
    file: File,
    device: Device,
    requantize: bool,
    pad: bool,
    /// Our int8 kernels take Q8_0 and Q4_1 matrices.
    own_int8: bool,
}

impl Loader<'_> {
    fn qtensor(&mut self, name: &str) -> Result<QTensor> {
        let t = self.content.tensor(&mut self.file, name, &self.device)?;
        // Slow only on the CPU: a GPU's kernels take these formats, and fewer bytes are faster there.
        let slow = self.device.is_cpu() && matches!(t.dtype(), GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1);
        // Our int8 kernels run Q4_1 as it is: fewer bytes than Q8_0, and no second rounding.
        let kept = self.own_int8 && Int8Weights::takes(t.dtype());
        if self.requantize && slow && !kept {
            let f = t.dequantize(&self.device)?;
            return Ok(QTensor::quantize(&f, GgmlDType::Q8_0)?);
        }
        Ok(t)
    }

    /// A matmul over `t`, padded for the repacked kernels where that helps.
    fn linear(&self, t: QTensor) -> Result<Linear> {
        let (n, k) = t.shape().dims2()?;
        if self.own_int8 && Int8Weights::takes(t.dtype()) {
            return Ok(Linear::Int8(Int8Weights::from_qtensor(&t)?));
        }
        if self.pad && self.device.is_cpu() && t.dtype() == GgmlDType::Q8_0 && n % REPACK_N == 0 {
            // A width already a multiple of 256 (SmolLM2's MLP down projection) needs no padding.
            let pad = k.next_multiple_of(REPACK_K) - k;
            let t = match pad {
                0 => t,
                _ => {
                    QTensor::quantize(&t.dequantize(&self.device)?.pad_with_zeros(D::Minus1, 0, pad)?, GgmlDType::Q8_0)?
                }
            };
            let lin = Linear::Candle { mm: QMatMul::from_qtensor(t)?, pad };
            // The kernels repack weights on first use: do it now, not in the first request.
            lin.forward(&Tensor::zeros((1, k), candle_core::DType::F32, &self.device)?)?;
            return Ok(lin);
        }
        Ok(Linear::Candle { mm: QMatMul::from_qtensor(t)?, pad: 0 })
    }

    fn f32(&mut self, name: &str) -> Result<Tensor> {
        Ok(self.content.tensor(&mut self.file, name, &self.device)?.dequantize(&self.device)?)
    }

    fn optional_f32(&mut self, name: &str) -> Result<Option<Tensor>> {
        if self.content.tensor_infos.contains_key(name) { self.f32(name).map(Some) } else { Ok(None) }
    }

    /// Concatenate the rows of same-typed quantized matrices into one matmul.
    fn fused(&mut self, names: &[String], biases: &[String]) -> Result<Fused> {
        let parts = names.iter().map(|n| self.qtensor(n)).collect::<Result<Vec<_>>>()?;
        let k = parts[0].shape().dims2()?.1;
        let widths: Vec<usize> =
            parts.iter().map(|p| p.shape().dims2().map(|d| d.0)).collect::<candle_core::Result<_>>()?;
        let dtype = parts[0].dtype();
        let mm = if parts.iter().all(|p| p.dtype() == dtype) && parts.len() > 1 {
            let mut bytes = Vec::new();
            for p in &parts {
                bytes.extend_from_slice(&p.data()?);
            }
            let storage = QStorage::from_data(bytes.into(), &self.device, dtype)?;
            self.linear(QTensor::new(storage, (widths.iter().sum::<usize>(), k))?)?
        } else if parts.len() == 1 {
            self.linear(parts.into_iter().next().expect("one part"))?
        } else {
            // Mixed types: dequantize and re-quantize the whole as Q8_0.
            let f = parts.iter().map(|p| p.dequantize(&self.device)).collect::<candle_core::Result<Vec<_>>>()?;
            self.linear(QTensor::quantize(&Tensor::cat(&f, 0)?, GgmlDType::Q8_0)?)?
        };
        let bias = if biases.is_empty() {
            None
        } else {
            let b = biases.iter().map(|n| self.optional_f32(n)).collect::<Result<Vec<_>>>()?;
            if b.iter().all(Option::is_some) {
                Some(Tensor::cat(&b.into_iter().flatten().collect::<Vec<_>>(), 0)?)
            } else {
                None
            }
        };
        Ok(Fused { mm, bias, widths })
    }
}

impl LlamaModel {
    /// Whether attention runs over device tensors (`device_attention`) rather than the host kernel.
    pub fn uses_device_attention(&self) -> bool {
        self.device_attention
    }

    pub fn load(path: &Path, content: &gguf_file::Content, opts: &LoadOptions) -> Result<Self> {
        let cfg = LlamaConfig::from_gguf(content)?;
        let device = super::select_device(opts.device)?;
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let mut l = Loader {
            content,
            file,
            device: device.clone(),
            requantize: opts.requantize,
            pad: opts.repack && cpu_has_repacked_q8_0(),
            own_int8: opts.own_matmul && device.is_cpu() && int8_matmul::available(),
        };

        let bar = if opts.progress {
            indicatif::ProgressBar::new(cfg.n_layer as u64 + 2)
        } else {
            indicatif::ProgressBar::hidden()
        };
        bar.set_style(
            indicatif::ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} layers")
                .expect("static template"),
        );
        bar.set_message(path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default());

        let embed = l.content.tensor(&mut l.file, "token_embd.weight", &device)?;
        let lm_head = if content.tensor_infos.contains_key("output.weight") {
            l.qtensor("output.weight")?
        } else {
            l.qtensor("token_embd.weight")? // tied embeddings
        };
        let lm_head = l.linear(lm_head)?;
        let norm = l.f32("output_norm.weight")?;
        bar.inc(2);
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = |s: &str| format!("blk.{i}.{s}");
            let qkv = l.fused(
                &[p("attn_q.weight"), p("attn_k.weight"), p("attn_v.weight")],
                &[p("attn_q.bias"), p("attn_k.bias"), p("attn_v.bias")],
            )?;
            let qk_norms = if cfg.family.qk_norms() {
                Some(QkNorms { q: l.f32(&p("attn_q_norm.weight"))?, k: l.f32(&p("attn_k_norm.weight"))? })
            } else {
                None
            };
            let post_norms = if cfg.family.post_norms() {
                Some(PostNorms {
                    attention: l.f32(&p("post_attention_norm.weight"))?,
                    ffn: l.f32(&p("post_ffw_norm.weight"))?,
                })
            } else {
                None
            };
            let local = cfg.sliding.filter(|s| s.is_local(i));
            layers.push(Layer {
                qk_norms,
                post_norms,
                window: local.map(|s| s.window),
                attn_norm: l.f32(&p("attn_norm.weight"))?,
                qkv,
                wo: {
                    let t = l.qtensor(&p("attn_output.weight"))?;
                    l.linear(t)?
                },
                ffn_norm: l.f32(&p("ffn_norm.weight"))?,
                gate_up: l.fused(&[p("ffn_gate.weight"), p("ffn_up.weight")], &[])?,
                down: {
                    let t = l.qtensor(&p("ffn_down.weight"))?;
                    l.linear(t)?
                },
            });
            bar.inc(1);
        }
        bar.finish_and_clear();

        let style = cfg.family.rope_style();
        let ropes = std::iter::once(cfg.rope_theta)
            .chain(cfg.sliding.map(|s| s.rope_theta))
            .map(|theta| Rope::new(style, cfg.heads.head_dim, theta, cfg.context_length))
            .collect();
        let embed_scale = cfg.family.embed_scale(cfg.hidden);
        let model_id = default_model_id(path);
        let spec = ModelSpec {
            model_id,
            architecture: cfg.architecture.clone(),
            vocab_size: cfg.vocab_size,
            context_length: cfg.context_length,
            kv_bytes_per_token: cfg.n_layer * 2 * cfg.heads.n_kv_head * cfg.heads.head_dim * opts.kv_dtype.bytes(),
            device: device_name(&device).into(),
        };
        // A GPU always attends on the device: the host kernel would copy q, k and v every layer.
        let device_attention = opts.device_attention || !device.is_cpu();
        if device_attention && opts.kv_dtype != KvDtype::F32 {
            bail!(
                "a 16-bit KV cache (f16, bf16) is for the host kernel; the device path (a GPU, or device attention) keeps f32"
            );
        }
        Ok(LlamaModel {
            spec,
            cfg,
            device,
            embed,
            embed_scale,
            layers,
            norm,
            lm_head,
            ropes,
            device_attention,
            kv_dtype: opts.kv_dtype,
            kv: KvStore::Unallocated,
        })
    }
}

/// RMS norm of each `head_dim`-wide head of `x` (`[tokens, heads * head_dim]`).
fn per_head_norm(x: &Tensor, weight: &Tensor, head_dim: usize, eps: f32) -> Result<Tensor> {
    let (t, w) = x.dims2()?;
    let heads = x.reshape((t * w / head_dim, head_dim))?;
    Ok(rms_norm::rms_norm(&heads, weight, eps)?.reshape((t, w))?)
}

/// What every layer of one forward step shares.
struct Step<'a> {
    heads: Heads,
    eps: f32,
    scale: f32,
    activation: Activation,
    ropes: &'a [Rope],
    device: &'a Device,
}

impl Layer {
    /// The residual stream `x` (`[tokens, hidden]`) through attention and the MLP.
    fn forward(&self, x: Tensor, rows: &[BatchRow<'_>], kv: LayerStore<'_>, step: &Step<'_>) -> Result<Tensor> {
        let x = (&x + self.attend(&x, rows, kv, step)?)?;
        Ok((&x + self.mlp(&x, step)?)?)
    }

    fn attend(&self, x: &Tensor, rows: &[BatchRow<'_>], kv: LayerStore<'_>, step: &Step<'_>) -> Result<Tensor> {
        let (heads, eps) = (step.heads, step.eps);
        let qkv = self.qkv.whole_normed(x, &self.attn_norm, eps)?;
        let shape = Attention { heads, scale: step.scale, window: self.window };
        // Global layers take the first rope table, sliding-window layers the second.
        let table = usize::from(self.window.is_some());
        let attn = match kv {
            LayerStore::Host(kv) => {
                let [mut q, mut k, v]: [Vec<f32>; 3] =
                    self.qkv.host_parts(qkv)?.try_into().map_err(|_| anyhow::anyhow!("q, k and v"))?;
                if let Some(n) = &self.qk_norms {
                    q = rms_norm::rows(&q, &n.q.to_vec1::<f32>()?, eps);
                    k = rms_norm::rows(&k, &n.k.to_vec1::<f32>()?, eps);
                }
                let n_tok = q.len() / (heads.n_head * heads.head_dim);
                let attn = paged_attention(rows, &mut q, &mut k, &v, kv, shape, &step.ropes[table]);
                Tensor::from_vec(attn, (n_tok, heads.n_head * heads.head_dim), step.device)?
            }
            LayerStore::Device { kv, plan } => {
                let mut qkv = self.qkv.split(qkv)?;
                if let Some(n) = &self.qk_norms {
                    qkv[0] = per_head_norm(&qkv[0], &n.q, heads.head_dim, eps)?;
                    qkv[1] = per_head_norm(&qkv[1], &n.k, heads.head_dim, eps)?;
                }
                paged_attention_on_device(plan, &qkv[0], &qkv[1], &qkv[2], kv, shape, plan.rope(table))?
            }
        };
        let o = self.wo.forward(&attn)?;
        match &self.post_norms {
            Some(n) => Ok(rms_norm::rms_norm(&o, &n.attention, eps)?),
            None => Ok(o),
        }
    }

    fn mlp(&self, x: &Tensor, step: &Step<'_>) -> Result<Tensor> {
        let gu = self.gate_up.whole_normed(x, &self.ffn_norm, step.eps)?;
        let width = gu.dim(1)? / 2;
        let d = match step.activation {
            // One pass over the fused output, candle's bits (see `swiglu`), each row taken by the
            // down projection as it is gated.
            Activation::Silu => {
                match swiglu::with_rows(&gu, width, |m, fill| self.down.forward_rows(m, width, fill))? {
                    Some(d) => d,
                    None => self.down.forward(&swiglu::silu_gate(&gu, width)?)?,
                }
            }
            Activation::GeluTanh => {
                let gu = self.gate_up.split(gu)?;
                self.down.forward(&(gu[0].gelu()? * &gu[1])?)?
            }
        };
        match &self.post_norms {
            Some(n) => Ok(rms_norm::rms_norm(&d, &n.ffn, step.eps)?),
            None => Ok(d),
        }
    }
}

/// The share of a GPU's memory, free once the weights are loaded, that the KV pool takes when no
/// budget is given; the rest is for activations and cuBLAS's workspace.
#[cfg(feature = "cuda")]
const GPU_KV_SHARE: f64 = 0.8;

fn device_name(device: &Device) -> &'static str {
    match device {
        Device::Cpu => "cpu",
        Device::Cuda(_) => "cuda",
        Device::Metal(_) => "metal",
    }
}

/// The distinct windows of the model's layers (None: global attention), for a step's masks.
fn windows(layers: &[Layer]) -> Vec<Option<usize>> {
    let mut windows: Vec<Option<usize>> = layers.iter().map(|l| l.window).collect();
    windows.sort_unstable();
    windows.dedup();
    windows
}

/// A GGUF model is served under its file name without `.gguf` unless told otherwise: the name a
/// user chose when placing the file, unlike `general.name`, which is often long or missing.
pub fn default_model_id(path: &Path) -> String {
    path.file_stem().unwrap_or_default().to_string_lossy().into_owned()
}

impl Backend for LlamaModel {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn set_model_id(&mut self, model_id: String) {
        self.spec.model_id = model_id;
    }

    fn default_kv_cache_bytes(&self) -> Result<usize> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = &self.device {
            let (free, _total) = d.cuda_stream().context().mem_get_info()?;
            return Ok((free as f64 * GPU_KV_SHARE) as usize);
        }
        Ok(super::DEFAULT_KV_CACHE_MB << 20)
    }

    fn allocate_kv(&mut self, num_blocks: usize, block_size: usize) -> Result<()> {
        let (n_layer, heads) = (self.cfg.n_layer, self.cfg.heads);
        self.kv = if self.device_attention {
            KvStore::Device {
                layers: (0..n_layer)
                    .map(|_| DeviceKv::new(num_blocks, block_size, heads, &self.device))
                    .collect::<candle_core::Result<_>>()?,
                ropes: self
                    .ropes
                    .iter()
                    .map(|r| DeviceRope::new(r, &self.device))
                    .collect::<candle_core::Result<_>>()?,
                windows: windows(&self.layers),
                block_size,
            }
        } else {
            let dtype = self.kv_dtype;
            if dtype == KvDtype::Bf16 && !(block_size.is_multiple_of(2) && heads.head_dim.is_multiple_of(2)) {
                bail!(
                    "a bf16 KV cache pairs slots and dimensions: blocks of {block_size} and heads of {} must be even",
                    heads.head_dim
                );
            }
            KvStore::Host((0..n_layer).map(|_| LayerKv::with_dtype(num_blocks, block_size, heads, dtype)).collect())
        };
        Ok(())
    }

    fn forward(&mut self, rows: &[BatchRow<'_>]) -> Result<Vec<Vec<f32>>> {
        let ids: Vec<u32> = rows.iter().flat_map(|r| r.tokens.iter().copied()).collect();
        let n_tok = ids.len();
        let ids = Tensor::from_vec(ids, n_tok, &self.device)?;
        let mut x = self.embed.embedding(&ids)?; // [T, hidden]
        if let Some(scale) = self.embed_scale {
            x = x.affine(scale, 0.0)?;
        }
        let step = Step {
            heads: self.cfg.heads,
            eps: self.cfg.rms_eps,
            scale: self.cfg.attention_scale(),
            activation: self.cfg.family.activation(),
            ropes: &self.ropes,
            device: &self.device,
        };
        match &mut self.kv {
            KvStore::Unallocated => bail!("KV storage not allocated"),
            KvStore::Host(kv) => {
                for (layer, kv) in self.layers.iter().zip(kv.iter_mut()) {
                    x = layer.forward(x, rows, LayerStore::Host(kv), &step)?;
                }
            }
            KvStore::Device { layers, ropes, windows, block_size } => {
                let plan = StepPlan::new(rows, *block_size, step.heads, windows, ropes, &self.device)?;
                for (layer, kv) in self.layers.iter().zip(layers.iter()) {
                    x = layer.forward(x, rows, LayerStore::Device { kv, plan: &plan }, &step)?;
                }
            }
        }

        // Only the rows being sampled need the (large) vocabulary projection.
        let mut last = Vec::new();
        let mut at = 0u32;
        for r in rows {
            at += r.tokens.len() as u32;
            if r.want_logits {
                last.push(at - 1);
            }
        }
        if last.is_empty() {
            return Ok(Vec::new());
        }
        let n_last = last.len();
        let x = x.index_select(&Tensor::from_vec(last, n_last, &self.device)?, 0)?;
        let x = rms_norm::rms_norm(&x, &self.norm, self.cfg.rms_eps)?;
        let logits = self.lm_head.forward(&x)?;
        Ok(logits.to_vec2::<f32>()?)
    }
}
