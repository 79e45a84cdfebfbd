//! Rotary embedding and causal attention over a paged KV cache, on host memory.
//!
//! Every query's scores are summed in position order 0..=pos, whatever the batch or chunk it came
//! in: that fixed order is what makes a request's output independent of chunk size and of its
//! batch neighbours (bit-exact, not merely close). Work is split across threads by (tile of a
//! row's tokens, KV head), which changes who computes a value, never the order of its sums. The
//! kernels below compute several positions, columns, heads or rows' sums at once for speed (up to
//! three heads of a KV group share each key load, and up to two tokens' heads each value load over
//! the blocks every query of a tile sees whole; keys lie transposed within each block,
//! so a block's scores fill the lanes of a register with no sum across lanes; the key scores,
//! the value tiles and the exponential take AVX-512 registers where the CPU has them, chosen at
//! run time, and the key scores AVX2's where it has only those), and each is tested to give the
//! very bits of the plain one-at-a-time loop. Tried and
//! dropped: the key sums in another order (two chains over the halves of a head), which moved a
//! near-tie of the tests' prompts away from llama.cpp's greedy tokens.
//!
//! The cache is f32 by default, for that same reason. A half-precision cache ([`KvDtype::F16`])
//! is an option: each key and value is rounded once as it is stored and widened as the kernels
//! load it, so attention over it gives the bits of the f32 kernels over the rounded values (the
//! same fixed order: still independent of chunk and batch), for half the bytes a token. A
//! bfloat16 cache ([`KvDtype::Bf16`], module `bf16`) also multiplies in bfloat16, with its own
//! kernels and fixed orders: twice the multiply-adds an instruction where the CPU has AVX-512
//! BF16. Both paths share the tasks (`Step`, `Task`): the tiles, the zeroing, the walk over
//! the key blocks.

use std::{array::from_fn, ops::Range};

use half::{f16, vec::HalfBitsVecExt};

use super::{BatchRow, exp::exp_shifted};

/// `$call` with `$rows` a constant equal to the count `$n`, among the counts a kernel is built
/// for (the last one takes any other count; the callers' counts are among these): the count is
/// known at run time, the kernel keeps that many rows' sums in registers.
macro_rules! with_rows {
    ($n:expr, [$($k:literal)*] $last:literal, |$rows:ident| $call:expr) => {
        match $n {
            $($k => {
                const $rows: usize = $k;
                $call
            })*
            _ => {
                const $rows: usize = $last;
                $call
            }
        }
    };
}

mod bf16;

/// Below this many multiply-adds a step's attention runs on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 18;

/// How the model pairs dimensions for rotary embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (`x[2i]`, `x[2i+1]`): GGUF llama (weights were permuted at conversion).
    Interleaved,
    /// Halves (`x[i]`, `x[i + d/2]`): GGUF qwen2 (GPT-NeoX style).
    Halves,
}

/// Precomputed cos/sin per position, for positions up to the context length.
pub struct Rope {
    style: RopeStyle,
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    pub fn new(style: RopeStyle, head_dim: usize, theta: f32, max_pos: usize) -> Self {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for i in 0..half {
                let freq = 1.0 / theta.powf(2.0 * i as f32 / head_dim as f32);
                let a = p as f32 * freq;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        Rope { style, half, cos, sin }
    }

    /// The style, `head_dim / 2`, and the cos and sin tables (`[position][head_dim / 2]`).
    pub fn tables(&self) -> (RopeStyle, usize, &[f32], &[f32]) {
        (self.style, self.half, &self.cos, &self.sin)
    }

    /// Rotate one head vector in place for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let (c, s) =
            (&self.cos[pos * self.half..(pos + 1) * self.half], &self.sin[pos * self.half..(pos + 1) * self.half]);
        match self.style {
            RopeStyle::Interleaved => {
                for i in 0..self.half {
                    let (a, b) = (x[2 * i], x[2 * i + 1]);
                    x[2 * i] = a * c[i] - b * s[i];
                    x[2 * i + 1] = a * s[i] + b * c[i];
                }
            }
            RopeStyle::Halves => {
                for i in 0..self.half {
                    let (a, b) = (x[i], x[i + self.half]);
                    x[i] = a * c[i] - b * s[i];
                    x[i + self.half] = a * s[i] + b * c[i];
                }
            }
        }
    }
}

/// Head geometry of one attention layer.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
}

impl Heads {
    /// Query heads sharing each KV head.
    pub fn group(&self) -> usize {
        self.n_head / self.n_kv_head
    }
}

/// What one layer's attention computes: its heads, the score scale, and for a sliding-window
/// layer how many of the latest positions (the query's own included) each query sees.
#[derive(Debug, Clone, Copy)]
pub struct Attention {
    pub heads: Heads,
    pub scale: f32,
    pub window: Option<usize>,
}

impl Attention {
    /// Causal attention over every earlier position, scaled by 1/sqrt(head_dim).
    pub fn causal(heads: Heads) -> Self {
        Attention { heads, scale: 1.0 / (heads.head_dim as f32).sqrt(), window: None }
    }

    /// The positions `first..end` a query at `pos` attends to.
    #[inline]
    fn visible(&self, pos: usize) -> (usize, usize) {
        Self::visible_with(self.window, pos)
    }

    /// The positions `first..end` a query at `pos` attends to under `window` (None: all earlier).
    #[inline]
    pub fn visible_with(window: Option<usize>, pos: usize) -> (usize, usize) {
        let end = pos + 1;
        (window.map_or(0, |w| end.saturating_sub(w)), end)
    }
}

/// What the host KV cache stores each key and value element as.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum KvDtype {
    /// Single precision: attention's bits do not depend on the cache (the engine's greedy output
    /// matches llama.cpp's token for token).
    #[default]
    F32,
    /// Half precision (IEEE binary16, rounded to nearest): half the bytes, so twice the tokens in
    /// the same memory and half the reads for a long context's decode, which those reads bound.
    /// Each key and value is rounded once as it is stored; queries, weights and sums stay f32.
    F16,
    /// bfloat16, and attention's products in bfloat16 too (queries and softmax weights rounded
    /// as well; sums in f32, as FlashAttention's bf16 arithmetic): the bytes of f16, and on CPUs
    /// with AVX-512 BF16 twice the multiply-adds an instruction, for prompts over a long history.
    Bf16,
}

impl KvDtype {
    /// Bytes one element takes.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => size_of::<f32>(),
            KvDtype::F16 => size_of::<f16>(),
            KvDtype::Bf16 => size_of::<half::bf16>(),
        }
    }
}

/// One layer's paged K and V storage. Values lie as `[block][slot][kv_head][head_dim]`: the
/// weighted sum reads a position's row. Keys lie transposed within each block,
/// `[block][kv_head][head_dim][slot]`: the key kernel (`qk_block`) takes a block's positions as
/// vector lanes.
pub struct LayerKv {
    planes: Planes,
    block_size: usize,
}

/// The keys and values in the cache's element type.
enum Planes {
    F32(Plane<f32>),
    F16(Plane<f16>),
    Bf16(bf16::Plane),
}

/// Keys and values of one element type, laid out as [`LayerKv`] says.
struct Plane<E> {
    k: Vec<E>,
    v: Vec<E>,
}

impl LayerKv {
    /// A single-precision cache (see [`KvDtype::F32`]).
    pub fn new(num_blocks: usize, block_size: usize, heads: Heads) -> Self {
        Self::with_dtype(num_blocks, block_size, heads, KvDtype::F32)
    }

    /// A cache of `num_blocks` blocks of `block_size` positions, its elements `dtype`.
    pub fn with_dtype(num_blocks: usize, block_size: usize, heads: Heads, dtype: KvDtype) -> Self {
        let n = num_blocks * block_size * heads.n_kv_head * heads.head_dim;
        // Zeroed allocations: the pages are mapped when first written, not here.
        let planes = match dtype {
            KvDtype::F32 => Planes::F32(Plane { k: vec![0.0; n], v: vec![0.0; n] }),
            KvDtype::F16 => {
                Planes::F16(Plane { k: vec![0u16; n].reinterpret_into(), v: vec![0u16; n].reinterpret_into() })
            }
            KvDtype::Bf16 => {
                assert!(
                    block_size.is_multiple_of(2) && heads.head_dim.is_multiple_of(2),
                    "bf16 pairs slots and dimensions"
                );
                Planes::Bf16(bf16::Plane::new(n))
            }
        };
        LayerKv { planes, block_size }
    }

    /// Store one position's keys and values (all KV heads, `[kv_head][head_dim]` each) in `slot`
    /// of `block`.
    fn write(&mut self, block: crate::kv_cache::BlockId, slot: usize, k: &[f32], v: &[f32]) {
        match &mut self.planes {
            Planes::F32(plane) => plane.write(self.block_size, block, slot, k, v),
            Planes::F16(plane) => plane.write(self.block_size, block, slot, k, v),
            Planes::Bf16(plane) => plane.write(self.block_size, block, slot, k, v),
        }
    }

    /// A step's new positions, block by block across the pool where there are many (on the
    /// calling thread, a prefill's stores were 0.5% of its samples, the other threads waiting).
    fn write_all(&mut self, writes: &[SlotWrite<'_>]) {
        if writes.len() < PARALLEL_TOKENS {
            return writes.iter().for_each(|&(block, slot, k, v)| self.write(block, slot, k, v));
        }
        let bs = self.block_size;
        match &mut self.planes {
            Planes::F32(p) => write_by_block(&mut p.k, &mut p.v, bs, writes, Plane::write_slot),
            Planes::F16(p) => write_by_block(&mut p.k, &mut p.v, bs, writes, Plane::write_slot),
            Planes::Bf16(p) => {
                let (k, v) = p.planes_mut();
                write_by_block(k, v, bs, writes, bf16::Plane::write_slot)
            }
        }
    }
}

impl<E: KvElement> Plane<E> {
    fn write(&mut self, bs: usize, block: crate::kv_cache::BlockId, slot: usize, k: &[f32], v: &[f32]) {
        let at = block.index() * bs * v.len()..(block.index() + 1) * bs * v.len();
        Self::write_slot(&mut self.k[at.clone()], &mut self.v[at], bs, slot, k, v);
    }

    /// One position's keys and values into `slot` of one block's keys and values (`bs` slots).
    fn write_slot(keys: &mut [E], values: &mut [E], bs: usize, slot: usize, k: &[f32], v: &[f32]) {
        let row = v.len();
        for (to, &x) in values[slot * row..][..row].iter_mut().zip(v) {
            *to = E::from_f32(x);
        }
        // The block's heads' [head_dim][slot] matrices one after another: element `d` of the
        // position's keys (all heads) is row `d` of them.
        for (d, &x) in k.iter().enumerate() {
            keys[d * bs + slot] = E::from_f32(x);
        }
    }
}

/// A step's new positions' keys and values: (block, slot, keys, values) for each.
type SlotWrite<'a> = (crate::kv_cache::BlockId, usize, &'a [f32], &'a [f32]);

/// `writes` into a plane's `keys` and `values` (blocks of `bs × row` elements each), block by
/// block across the pool: each block is memory of its own, so each goes whole to one thread.
fn write_by_block<E: Send>(
    keys: &mut [E],
    values: &mut [E],
    bs: usize,
    writes: &[SlotWrite<'_>],
    write_slot: impl Fn(&mut [E], &mut [E], usize, usize, &[f32], &[f32]) + Sync,
) {
    let Some(&(_, _, _, v)) = writes.first() else { return };
    let size = bs * v.len();
    let mut order: Vec<usize> = (0..writes.len()).collect();
    order.sort_by_key(|&i| writes[i].0.index());
    // (block, its writes' indices), blocks ascending.
    let groups = order.chunk_by(|&a, &b| writes[a].0 == writes[b].0);
    let mut blocks = keys.chunks_mut(size).zip(values.chunks_mut(size));
    let mut next = 0;
    let mut work: Vec<_> = groups
        .map(|group| {
            let block = writes[group[0]].0.index();
            let (k, v) = blocks.nth(block - next).expect("a block of the cache");
            next = block + 1;
            (k, v, group)
        })
        .collect();
    super::rows::for_each_mut(&mut work, |(k, v, group)| {
        for &i in group.iter() {
            let (_, slot, kt, vt) = writes[i];
            write_slot(k, v, bs, slot, kt, vt);
        }
    });
}

/// An element type of the cache: how the kernels read it as f32.
trait KvElement: Copy + Send + Sync + 'static {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;

    /// The sixteen elements at `p` as floats; lanes outside `mask` are zero and not read.
    ///
    /// SAFETY: the CPU has AVX-512F, BW and VL; every element in `mask` is readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self, mask: std::arch::x86_64::__mmask16) -> std::arch::x86_64::__m512;

    /// The eight elements at `p` as floats.
    ///
    /// SAFETY: the CPU has AVX2, FMA and F16C; eight elements are readable at `p`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl KvElement for f32 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16(p: *const Self, mask: std::arch::x86_64::__mmask16) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_maskz_loadu_ps(mask, p) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl KvElement for f16 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self.to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16(p: *const Self, mask: std::arch::x86_64::__mmask16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract; binary16 widens to f32 exactly.
        unsafe { _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p.cast())) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract; binary16 widens to f32 exactly.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

/// Lanes of one AVX register: `dot` sums in this many lanes.
const LANES: usize = 8;
/// Output columns [`weighted_run`] keeps in registers at once.
const TILE: usize = 64;
/// Query tokens of one sequence that one task serves together: each K/V block is read once for
/// all of them, while it is in cache, instead of once per token (prefill was bound by those
/// reads).
const QUERY_TILE: usize = 16;

#[inline(always)]
fn fold(acc: &[f32; LANES]) -> f32 {
    (acc[0] + acc[4]) + (acc[1] + acc[5]) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// The dot product every attention score is: eight lanes (dimension `d` in lane `d % 8`), each
/// summed in order with fused multiply-adds, folded in a fixed tree, then the dimensions past the
/// last whole eight in order. [`qk_block`] computes these very bits many at once; this one at a
/// time is the tests' reference.
#[cfg(test)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ac, ar) = a.as_chunks::<LANES>();
    let (bc, br) = b.as_chunks::<LANES>();
    for (x, y) in ac.iter().zip(bc) {
        for l in 0..LANES {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    let mut s = fold(&acc);
    for (x, y) in ar.iter().zip(br) {
        s = x.mul_add(*y, s);
    }
    s
}

/// Softmax in place: [`exp_shifted`], summed in position order. (A sum in lanes was tried;
/// it moved a near-tie in the tests' fixed greedy continuations.) The engine runs
/// [`softmax_rows`], which gives these bits for many rows at once; this is its reference.
#[cfg(test)]
fn softmax(row: &mut [f32]) {
    exp_shifted(row);
    let sum: f32 = row.iter().fold(0.0, |s, &x| s + x);
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|x| *x *= inv);
}

/// Rows whose sums [`softmax_rows`] runs side by side: the lanes of one 16-wide register.
const SUM_ROWS: usize = 16;

/// Softmax of many rows in place: row `r` of `scores` (rows of `n` floats) holds its scores at
/// `range(r)` and zeros around them. Each row gets the bits `softmax` (the tests' reference)
/// gives it alone: its sum still runs in position order from its first position, but
/// [`SUM_ROWS`] rows' sums run side by side (see [`sums_in_order`]) instead of one long chain of
/// dependent adds (the zeros around a shorter row add nothing: every term is at least zero). A
/// group's rows go through all three passes (exponential, sum, scaling) before the next group's
/// start, while they are in L1: a tile's score rows (48 of up to a few thousand) lie in L2 at
/// best, and each pass over all of them was a trip there and back.
fn softmax_rows(scores: &mut [f32], n: usize, range: impl Fn(usize) -> (usize, usize)) {
    let rows = scores.len() / n;
    for first in (0..rows).step_by(SUM_ROWS) {
        let group = first..rows.min(first + SUM_ROWS);
        for r in group.clone() {
            let (lo, hi) = range(r);
            exp_shifted(&mut scores[r * n + lo..r * n + hi]);
        }
        let lo = group.clone().map(|r| range(r).0).min().unwrap_or(0);
        let hi = group.clone().map(|r| range(r).1).max().unwrap_or(0);
        // Each of the group's rows over lo..hi; past the last row, the first again (its sum
        // unused), so every lane has a row.
        let row: [&[f32]; SUM_ROWS] = from_fn(|i| {
            let r = if first + i < group.end { first + i } else { first };
            &scores[r * n + lo..r * n + hi]
        });
        let sums = sums_in_order(&row);
        for (i, r) in group.enumerate() {
            let (lo, hi) = range(r);
            let inv = 1.0 / sums[i];
            scores[r * n + lo..r * n + hi].iter_mut().for_each(|x| *x *= inv);
        }
    }
}

/// Each row's sum, its floats added one after another from zero (the rows of one length, at
/// least zero each). On AVX-512, [`sums_avx512`]; the compiler's own vectors for this loop
/// gathered eight rows' floats one by one into a register for every position.
fn sums_in_order(rows: &[&[f32]; SUM_ROWS]) -> [f32; SUM_ROWS] {
    let len = rows[0].len();
    assert!(rows.iter().all(|r| r.len() == len), "rows of one length");
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: AVX-512F is present (checked at run time); the rows are of one length.
        return unsafe { sums_avx512(rows) };
    }
    let mut sums = [0f32; SUM_ROWS];
    for p in 0..len {
        for (sum, row) in sums.iter_mut().zip(rows) {
            *sum += row[p];
        }
    }
    sums
}

/// [`sums_in_order`] with a lane a row: sixteen floats of each row loaded, the 16 x 16 square
/// transposed in registers, then each position's vector added to the sums in order (lanes past
/// the rows' end load as zeros, which leave a sum unchanged).
///
/// SAFETY: the CPU has AVX-512F; the rows are of one length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sums_avx512(rows: &[&[f32]; SUM_ROWS]) -> [f32; SUM_ROWS] {
    use std::arch::x86_64::*;
    let len = rows[0].len();
    let mut sums = _mm512_setzero_ps();
    for c in (0..len).step_by(SLOT_LANES) {
        let mask = (u32::MAX >> (32 - (len - c).min(SLOT_LANES))) as __mmask16;
        // SAFETY: the mask's lanes lie inside each row (all of `len` floats).
        let square = from_fn(|i| unsafe { _mm512_maskz_loadu_ps(mask, rows[i].as_ptr().add(c)) });
        for position in transpose16(square) {
            sums = _mm512_add_ps(sums, position);
        }
    }
    let mut out = [0f32; SUM_ROWS];
    // SAFETY: sixteen floats.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), sums) };
    out
}

/// The 16 x 16 square `rows` (a register a row) transposed: register `p` holds every row's
/// element `p`. Element pairs, then 64-bit pairs within each 128-bit lane, then the lanes across
/// registers: 64 shuffles.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn transpose16(rows: [std::arch::x86_64::__m512; 16]) -> [std::arch::x86_64::__m512; 16] {
    use std::arch::x86_64::*;
    // Per 128-bit lane `k`: `pairs[2j]` holds rows 2j, 2j + 1 at elements 4k, 4k + 1 interleaved,
    // `pairs[2j + 1]` at 4k + 2, 4k + 3.
    let pairs: [__m512; 16] = from_fn(|i| {
        let (x, y) = (rows[i & !1], rows[i | 1]);
        if i % 2 == 0 { _mm512_unpacklo_ps(x, y) } else { _mm512_unpackhi_ps(x, y) }
    });
    // `quads[4q + c]`, lane `k`: element 4k + c of rows 4q..4q + 4.
    let quads: [__m512; 16] = from_fn(|i| {
        let (q, c) = (i / 4, i % 4);
        let (x, y) = (_mm512_castps_pd(pairs[4 * q + c / 2]), _mm512_castps_pd(pairs[4 * q + 2 + c / 2]));
        _mm512_castpd_ps(if c % 2 == 0 { _mm512_unpacklo_pd(x, y) } else { _mm512_unpackhi_pd(x, y) })
    });
    // Element 4k + c of all rows: lane k of quads[c], quads[4 + c], quads[8 + c], quads[12 + c].
    let mut out = [_mm512_setzero_ps(); 16];
    for c in 0..4 {
        let q = |i: usize| quads[4 * i + c];
        let (low01, high01) = (_mm512_shuffle_f32x4::<0x44>(q(0), q(1)), _mm512_shuffle_f32x4::<0xEE>(q(0), q(1)));
        let (low23, high23) = (_mm512_shuffle_f32x4::<0x44>(q(2), q(3)), _mm512_shuffle_f32x4::<0xEE>(q(2), q(3)));
        out[c] = _mm512_shuffle_f32x4::<0x88>(low01, low23);
        out[4 + c] = _mm512_shuffle_f32x4::<0xDD>(low01, low23);
        out[8 + c] = _mm512_shuffle_f32x4::<0x88>(high01, high23);
        out[12 + c] = _mm512_shuffle_f32x4::<0xDD>(high01, high23);
    }
    out
}

/// One sequence's keys or values for one KV head, in position order: [`PagedRows::runs`] yields,
/// block by block, the element offset where the head's part of the block starts (with `head` the
/// head's offset within a block: its row offset for values, its matrix's for the transposed keys)
/// and how many of the block's positions are below `n`.
struct PagedRows<'a> {
    blocks: &'a [crate::kv_cache::BlockId],
    block_size: usize,
    /// Elements from one position's row to the next (all KV heads).
    stride: usize,
    /// Offset of this KV head within a row.
    head: usize,
}

impl PagedRows<'_> {
    fn runs(&self, n: usize) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        // (first position, element offset, rows) per block.
        self.blocks
            .iter()
            .enumerate()
            .map(move |(i, b)| (i * self.block_size, b.index() * self.block_size * self.stride + self.head))
            .take_while(move |&(p, _)| p < n)
            .map(move |(p, off)| (p, off, self.block_size.min(n - p)))
    }
}

/// The scores of `R` queries (heads sharing a KV head) against one block's keys of one KV head,
/// stored transposed (`keys[d * block_size + slot]`), for the slots `slots`: `out[r][i]` is
/// `dot(q[r], key of slot slots.start + i) * scale`, bit for bit `dot`. Slots are the vector
/// lanes: each of `dot`'s eight lane sums is a register of sixteen slots' sums, and its fold is
/// seven adds of registers, where keys laid in rows needed a sum across lanes for every score
/// (which cost as much as the multiplies).
fn qk_block<E: KvElement, const R: usize>(
    q: [&[f32]; R],
    keys: &[E],
    block_size: usize,
    slots: Range<usize>,
    scale: f32,
    out: [&mut [f32]; R],
) {
    let hd = q[0].len();
    assert!(q.iter().all(|q| q.len() == hd), "one head size for all queries");
    assert!(out.iter().all(|o| o.len() == slots.len()), "a score for each slot");
    assert!(slots.end <= block_size && keys.len() >= hd * block_size, "slots inside the block's keys");
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        let (q, out) = (q.map(<[f32]>::as_ptr), out.map(<[f32]>::as_mut_ptr));
        // SAFETY: AVX-512F, BW and VL are present (checked at run time); every key read is below
        // `hd * block_size` (asserted above); each output holds `slots.len()` floats of its own.
        unsafe { qk_block_avx512(q, keys.as_ptr(), block_size, hd, slots, scale, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        let mut out = out;
        let (qp, op) = (q.map(<[f32]>::as_ptr), out.each_mut().map(|o| o.as_mut_ptr()));
        // SAFETY: AVX2, FMA and F16C are present (checked at run time); every key read is below
        // `hd * block_size` (asserted above); each output holds `slots.len()` floats of its own.
        let done = unsafe { qk_block_avx2(qp, keys.as_ptr(), block_size, hd, slots.clone(), scale, op) };
        // The last slots, fewer than a register's eight, on the portable loop.
        let out = out.map(|o| &mut o[done..]);
        qk_block_portable(q, keys, block_size, slots.start + done..slots.end, scale, out);
        return;
    }
    qk_block_portable(q, keys, block_size, slots, scale, out);
}

/// [`qk_block`] on any CPU: `dot`'s lane sums for eight slots at a time, in fixed-size arrays
/// the compiler turns into vector registers where it can, then its fold and tail per slot.
fn qk_block_portable<E: KvElement, const R: usize>(
    q: [&[f32]; R],
    keys: &[E],
    block_size: usize,
    slots: Range<usize>,
    scale: f32,
    mut out: [&mut [f32]; R],
) {
    const W: usize = 8;
    let hd = q[0].len();
    let whole = hd - hd % LANES;
    for c in slots.clone().step_by(W) {
        let n = (slots.end - c).min(W);
        // Dimension `d` of the chunk's keys (zeros past its last slot: their sums are not stored).
        let key = |d: usize| {
            let mut k = [0f32; W];
            for (k, x) in k.iter_mut().zip(&keys[d * block_size + c..][..n]) {
                *k = x.to_f32();
            }
            k
        };
        for (q, out) in q.iter().zip(out.iter_mut()) {
            let mut acc = [[0f32; W]; LANES];
            for d in 0..whole {
                let (k, lane) = (key(d), &mut acc[d % LANES]);
                for (a, k) in lane.iter_mut().zip(k) {
                    *a = q[d].mul_add(k, *a);
                }
            }
            for (s, o) in out[c - slots.start..][..n].iter_mut().enumerate() {
                let mut score = fold(&from_fn(|l| acc[l][s]));
                for d in whole..hd {
                    score = q[d].mul_add(keys[d * block_size + c + s].to_f32(), score);
                }
                *o = score * scale;
            }
        }
    }
}

/// Slots one [`qk_block_avx512`] register holds.
const SLOT_LANES: usize = 16;

/// [`qk_block`] sixteen slots to a register: `dot`'s lane sums, fold and tail, so its bits.
///
/// SAFETY: the CPU has AVX-512F, BW and VL; `hd` floats are readable at each `q[r]`, and
/// `hd * block_size` elements at `keys`; `slots.len()` floats are writable at each `out[r]`,
/// overlapping nothing else; `slots.end <= block_size`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn qk_block_avx512<E: KvElement, const R: usize>(
    q: [*const f32; R],
    keys: *const E,
    block_size: usize,
    hd: usize,
    slots: Range<usize>,
    scale: f32,
    out: [*mut f32; R],
) {
    use std::arch::x86_64::*;
    let whole = hd - hd % LANES;
    // SAFETY: lanes past `slots.end` are masked off in every load and store; the rest lie inside
    // what the caller promises.
    unsafe {
        for c in slots.clone().step_by(SLOT_LANES) {
            let mask = (u32::MAX >> (32 - (slots.end - c).min(SLOT_LANES))) as __mmask16;
            let k = keys.add(c);
            let key = |d: usize| E::load16(k.add(d * block_size), mask);
            let term = |r: usize, d: usize| _mm512_set1_ps(*q[r].add(d));
            // Lane sum `l` of `dot` for every head: dimensions l, l + 8, ... in order.
            let mut acc = [[_mm512_setzero_ps(); LANES]; R];
            for d0 in (0..whole).step_by(LANES) {
                for (l, d) in (d0..d0 + LANES).enumerate() {
                    let k = key(d);
                    for (r, acc) in acc.iter_mut().enumerate() {
                        acc[l] = _mm512_fmadd_ps(term(r, d), k, acc[l]);
                    }
                }
            }
            for r in 0..R {
                let a = &acc[r];
                let add = |x, y| _mm512_add_ps(x, y);
                // `fold`'s tree, then the dimensions past the last whole eight, in order.
                let mut score = add(add(add(a[0], a[4]), add(a[1], a[5])), add(add(a[2], a[6]), add(a[3], a[7])));
                for d in whole..hd {
                    score = _mm512_fmadd_ps(term(r, d), key(d), score);
                }
                _mm512_mask_storeu_ps(out[r].add(c - slots.start), mask, _mm512_mul_ps(score, _mm512_set1_ps(scale)));
            }
        }
    }
}

/// [`qk_block_avx512`] for two whole registers of slots at once (two blocks' sixteen, the keys of
/// each at `keys[i]`, `block_size` elements from one dimension to the next), writing 32 scores a
/// row: each query element is broadcast once for both registers, so five loads feed six
/// multiply-adds for three heads, where one register took four loads for three (the kernel waited
/// on its loads). `dot`'s lane sums are taken two at a time in the order its fold adds them
/// (lanes 0 and 4, then 1 and 5, ...), so only a pair's chains and the fold's partial sums are
/// live; each chain and each add is the one `dot` makes, so its bits.
///
/// SAFETY: the CPU has AVX-512F, BW and VL; `hd` floats are readable at each `q[r]`, and
/// `hd * block_size` elements at each `keys[i]` with `block_size >= 16`; 32 floats are writable
/// at each `out[r]`, overlapping nothing else.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn qk_two_avx512<E: KvElement, const R: usize>(
    q: [*const f32; R],
    keys: [*const E; 2],
    block_size: usize,
    hd: usize,
    scale: f32,
    out: [*mut f32; R],
) {
    use std::arch::x86_64::*;
    let whole = hd - hd % LANES;
    // SAFETY: every load lies inside what the caller promises (dimension below `hd`, slots below
    // 16), every store inside `out[r]`'s 32 floats.
    unsafe {
        let key = |i: usize, d: usize| E::load16(keys[i].add(d * block_size), !0);
        // Lanes `l` and `l + 4` of `dot` for every head and both registers, each summed over its
        // dimensions in order from zero, then added: the first adds of `fold`.
        let pair = |l: usize| -> [[__m512; 2]; R] {
            let (mut a, mut b) = ([[_mm512_setzero_ps(); 2]; R], [[_mm512_setzero_ps(); 2]; R]);
            for d in (l..whole).step_by(LANES) {
                for (d, acc) in [(d, &mut a), (d + LANES / 2, &mut b)] {
                    let k = [key(0, d), key(1, d)];
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let x = _mm512_set1_ps(*q[r].add(d));
                        acc[0] = _mm512_fmadd_ps(x, k[0], acc[0]);
                        acc[1] = _mm512_fmadd_ps(x, k[1], acc[1]);
                    }
                }
            }
            from_fn(|r| from_fn(|i| _mm512_add_ps(a[r][i], b[r][i])))
        };
        let sum = |x: [[__m512; 2]; R], y: [[__m512; 2]; R]| -> [[__m512; 2]; R] {
            from_fn(|r| from_fn(|i| _mm512_add_ps(x[r][i], y[r][i])))
        };
        // `fold`: ((0 + 4) + (1 + 5)) + ((2 + 6) + (3 + 7)).
        let first = sum(pair(0), pair(1));
        let second = sum(pair(2), pair(3));
        for r in 0..R {
            for i in 0..2 {
                let mut score = _mm512_add_ps(first[r][i], second[r][i]);
                for d in whole..hd {
                    score = _mm512_fmadd_ps(_mm512_set1_ps(*q[r].add(d)), key(i, d), score);
                }
                _mm512_storeu_ps(out[r].add(i * SLOT_LANES), _mm512_mul_ps(score, _mm512_set1_ps(scale)));
            }
        }
    }
}

/// Slots one [`qk_avx2`] register holds.
const SLOT_LANES_AVX2: usize = 8;

/// [`qk_block`] on AVX2, for as many of `slots` as fill whole registers of eight (sixteen at a
/// time while there are that many): returns how many it scored, from `slots.start`.
///
/// SAFETY: the CPU has AVX2, FMA and F16C; `hd` floats are readable at each `q[r]`, and
/// `hd * block_size` elements at `keys`; `slots.len()` floats are writable at each `out[r]`,
/// overlapping nothing else; `slots.end <= block_size`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qk_block_avx2<E: KvElement, const R: usize>(
    q: [*const f32; R],
    keys: *const E,
    block_size: usize,
    hd: usize,
    slots: Range<usize>,
    scale: f32,
    out: [*mut f32; R],
) -> usize {
    let mut c = slots.start;
    // SAFETY: each call reads slots `c..c + 8 S`, below `slots.end`, and writes as many scores.
    unsafe {
        let at = |c: usize| (keys.add(c), out.map(|o| o.add(c - slots.start)));
        while slots.end - c >= 2 * SLOT_LANES_AVX2 {
            let (k, o) = at(c);
            qk_avx2::<E, R, 2>(q, k, block_size, hd, scale, o);
            c += 2 * SLOT_LANES_AVX2;
        }
        if slots.end - c >= SLOT_LANES_AVX2 {
            let (k, o) = at(c);
            qk_avx2::<E, R, 1>(q, k, block_size, hd, scale, o);
            c += SLOT_LANES_AVX2;
        }
    }
    c - slots.start
}

/// `8 S` consecutive slots' scores for `R` queries, eight slots to a register: `dot`'s bits, its
/// lane sums taken two at a time in the order its fold adds them (as [`qk_two_avx512`] does), so
/// that a pair's chains, `2 R S` registers, fit AVX2's sixteen beside the loads.
///
/// SAFETY: the CPU has AVX2, FMA and F16C; `hd` floats are readable at each `q[r]`, and
/// `8 S` elements at `keys + d * block_size` for every dimension `d` below `hd`; `8 S` floats
/// are writable at each `out[r]`, overlapping nothing else.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qk_avx2<E: KvElement, const R: usize, const S: usize>(
    q: [*const f32; R],
    keys: *const E,
    block_size: usize,
    hd: usize,
    scale: f32,
    out: [*mut f32; R],
) {
    use std::arch::x86_64::*;
    let whole = hd - hd % LANES;
    // SAFETY: every load lies inside what the caller promises, every store inside `out[r]`'s
    // `8 S` floats.
    unsafe {
        let key = |i: usize, d: usize| E::load8(keys.add(d * block_size + i * SLOT_LANES_AVX2));
        // Lanes `l` and `l + 4` of `dot` for every query and register of slots, each summed over
        // its dimensions in order from zero, then added: the first adds of `fold`.
        let pair = |l: usize| -> [[__m256; S]; R] {
            let (mut a, mut b) = ([[_mm256_setzero_ps(); S]; R], [[_mm256_setzero_ps(); S]; R]);
            for d in (l..whole).step_by(LANES) {
                for (d, acc) in [(d, &mut a), (d + LANES / 2, &mut b)] {
                    let k: [__m256; S] = from_fn(|i| key(i, d));
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let x = _mm256_set1_ps(*q[r].add(d));
                        for (acc, k) in acc.iter_mut().zip(k) {
                            *acc = _mm256_fmadd_ps(x, k, *acc);
                        }
                    }
                }
            }
            from_fn(|r| from_fn(|i| _mm256_add_ps(a[r][i], b[r][i])))
        };
        let sum = |x: [[__m256; S]; R], y: [[__m256; S]; R]| -> [[__m256; S]; R] {
            from_fn(|r| from_fn(|i| _mm256_add_ps(x[r][i], y[r][i])))
        };
        // `fold`: ((0 + 4) + (1 + 5)) + ((2 + 6) + (3 + 7)).
        let first = sum(pair(0), pair(1));
        let second = sum(pair(2), pair(3));
        for r in 0..R {
            for i in 0..S {
                let mut score = _mm256_add_ps(first[r][i], second[r][i]);
                for d in whole..hd {
                    score = _mm256_fmadd_ps(_mm256_set1_ps(*q[r].add(d)), key(i, d), score);
                }
                _mm256_storeu_ps(out[r].add(i * SLOT_LANES_AVX2), _mm256_mul_ps(score, _mm256_set1_ps(scale)));
            }
        }
    }
}

/// `out[i] += weights[i][s] * V[s]` for `R` queries (heads sharing a KV head) and consecutive
/// value rows `s`, the first at element `off`, added in row order: called block after block,
/// each element is summed in position order from 0. Columns are taken [`TILE`] at a time, kept
/// in registers.
fn weighted_run<E: KvElement, const R: usize>(
    weights: [&[f32]; R],
    values: &[E],
    off: usize,
    stride: usize,
    out: [&mut [f32]; R],
) {
    let n = weights[0].len();
    assert!(weights.iter().all(|w| w.len() == n), "as many weights for each query");
    let mut out = out.map(|o| o.as_chunks_mut::<TILE>());
    for t in 0..out[0].0.len() {
        let base = off + t * TILE;
        if let Some(last) = n.checked_sub(1) {
            assert!(base + last * stride + TILE <= values.len(), "every value row inside the store");
        }
        #[cfg(target_arch = "x86_64")]
        if avx512() {
            let tiles = from_fn(|r| out[r].0[t].as_mut_ptr());
            // SAFETY: AVX-512F, BW and VL are present (checked at run time); every row read lies
            // inside `values` (asserted above); the tiles are of different outputs.
            unsafe { weighted_tile_avx512(weights.map(<[f32]>::as_ptr), values.as_ptr(), &[(base, n)], stride, tiles) };
            continue;
        }
        for r in 0..R {
            let tile = &mut out[r].0[t];
            let mut acc = *tile;
            for (s, &w) in weights[r].iter().enumerate() {
                for (a, v) in acc.iter_mut().zip(&values[base + s * stride..][..TILE]) {
                    *a = w.mul_add(v.to_f32(), *a);
                }
            }
            *tile = acc;
        }
    }
    for r in 0..R {
        let rest = &mut *out[r].1;
        if rest.is_empty() {
            continue;
        }
        let first = out[r].0.len() * TILE;
        for (s, &w) in weights[r].iter().enumerate() {
            let v = &values[off + s * stride + first..][..rest.len()];
            for (o, x) in rest.iter_mut().zip(v) {
                *o = w.mul_add(x.to_f32(), *o);
            }
        }
    }
}

/// Whether this CPU runs AVX-512F, with BW and VL for the half-precision cache's loads (the build
/// targets AVX2, so wider kernels are chosen at run time). Each column's fused multiply-adds are
/// the same at any width: the bits do not change.
#[cfg(target_arch = "x86_64")]
#[inline]
fn avx512() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx512f") && has!("avx512bw") && has!("avx512vl")
}

/// Whether this CPU runs AVX2 with FMA, and F16C for the half-precision cache's loads: the
/// kernels for CPUs without AVX-512 (eight lanes a register, the same bits).
#[cfg(target_arch = "x86_64")]
#[inline]
fn avx2() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx2") && has!("fma") && has!("f16c")
}

/// [`weighted_run`]'s tile of [`TILE`] columns for each of `R` rows of weights (heads sharing
/// a KV head, of one token or two), in four 16-lane registers each, over the value rows of `runs`
/// one after another: `(element offset of its first row, rows)`, rows `stride` apart, weight `i`
/// of a row for the `i`-th row of the runs. The sums stay in registers from the first run to the
/// last, and each value load serves every row of weights (with six rows, 24 independent chains).
///
/// SAFETY: the CPU has AVX-512F, BW and VL; `values + off + s * stride .. + TILE` is readable
/// for every run and `s` below its rows; each `weights[r]` holds a weight for every row of the
/// runs; each `tiles[r]` is `TILE` writable floats, overlapping no other.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn weighted_tile_avx512<E: KvElement, const R: usize>(
    mut weights: [*const f32; R],
    values: *const E,
    runs: &[(usize, usize)],
    stride: usize,
    tiles: [*mut f32; R],
) {
    use std::arch::x86_64::*;
    const W: usize = 16;
    // SAFETY: loads and stores of the tiles are in bounds (TILE = 4 x 16); row and weight reads
    // by the caller's contract.
    unsafe {
        let mut acc: [[__m512; TILE / W]; R] = from_fn(|r| from_fn(|c| _mm512_loadu_ps(tiles[r].add(c * W))));
        for (k, &(off, rows)) in runs.iter().enumerate() {
            // The next run's rows lie elsewhere in the pool (cold in a decode step, where the
            // CPU's prefetcher starts over at each block): row `s` of it starts loading as row
            // `s` of this one is weighed.
            let (next, next_rows) = runs.get(k + 1).copied().unwrap_or((0, 0));
            for s in 0..rows {
                if s < next_rows {
                    prefetch_row::<E, true>(values.add(next + s * stride), TILE);
                }
                let v = values.add(off + s * stride);
                let vs: [__m512; TILE / W] = from_fn(|c| E::load16(v.add(c * W), u16::MAX));
                for r in 0..R {
                    let w = _mm512_set1_ps(*weights[r].add(s));
                    for c in 0..TILE / W {
                        acc[r][c] = _mm512_fmadd_ps(w, vs[c], acc[r][c]);
                    }
                }
            }
            weights = weights.map(|w| w.add(rows));
        }
        for (tile, acc) in tiles.iter().zip(&acc) {
            for (c, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(tile.add(c * W), *a);
            }
        }
    }
}

/// The queries one attention task serves: `m` consecutive tokens' heads of one KV group, and
/// their score rows (`m × group` rows of `n_max`, token-major). For a block every query sees
/// whole, the key kernel runs for all of them in one call ([`QueryTile::scores`]): the slices,
/// checks and dispatch that the per-query path makes for every query and block were a third of
/// that kernel's time.
struct QueryTile<'a> {
    q: &'a [f32],
    /// Where the first token's first head of the group starts in `q`.
    first: usize,
    q_row: usize,
    hd: usize,
    m: usize,
    group: usize,
    n_max: usize,
}

impl QueryTile<'_> {
    /// Every query's scores against a run of blocks every query sees whole (one, or two full
    /// ones), `len` slots from position `p`: [`qk_block`]'s bits (on AVX-512 its kernels, two
    /// blocks at once where there are two, with the bounds checked once for the whole tile).
    fn scores<E: KvElement>(
        &self,
        blocks: &[&[E]],
        block_size: usize,
        p: usize,
        len: usize,
        scale: f32,
        scores: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if avx512() {
            let (n_max, hd, group) = (self.n_max, self.hd, self.group);
            // Two full blocks of one register's slots each go to the two-register kernel, else
            // block by block (a decode step's last block is most often part full).
            let two = blocks.len() == 2 && block_size == SLOT_LANES && len == 2 * SLOT_LANES;
            assert!(!blocks.is_empty() && len <= block_size * blocks.len(), "slots inside the blocks");
            assert!(blocks.iter().all(|b| b.len() >= hd * block_size), "each block's keys");
            assert!(p + len <= n_max && scores.len() >= self.m * group * n_max, "scores inside the rows");
            assert!(self.first + (self.m - 1) * self.q_row + group * hd <= self.q.len(), "queries inside q");
            let (q, s) = (self.q.as_ptr(), scores.as_mut_ptr());
            for j in 0..self.m {
                for (h, n) in head_runs(group) {
                    // SAFETY: AVX-512F, BW and VL are present (checked at run time); each q row
                    // and score row lies inside its buffer (asserted above), the score rows are
                    // distinct; with `two`, `len` is the kernel's 32 scores.
                    unsafe {
                        let qr = |i: usize| q.add(self.first + j * self.q_row + (h + i) * hd);
                        let sr = |i: usize, p: usize| s.add((j * group + h + i) * n_max + p);
                        if two {
                            with_rows!(n, [3 2] 1, |R| qk_two_avx512::<_, R>(
                                from_fn(qr),
                                [blocks[0].as_ptr(), blocks[1].as_ptr()],
                                block_size,
                                hd,
                                scale,
                                from_fn(|i| sr(i, p))
                            ));
                            continue;
                        }
                        for (b, keys) in blocks.iter().enumerate() {
                            with_rows!(n, [3 2] 1, |R| qk_block_avx512::<_, R>(
                                from_fn(qr),
                                keys.as_ptr(),
                                block_size,
                                hd,
                                run_slots(len, block_size, b),
                                scale,
                                from_fn(|i| sr(i, p + b * block_size))
                            ))
                        }
                    }
                }
            }
            return;
        }
        for (b, keys) in blocks.iter().enumerate() {
            for j in 0..self.m {
                self.query_scores(
                    j,
                    keys,
                    block_size,
                    p + b * block_size,
                    run_slots(len, block_size, b),
                    scale,
                    scores,
                );
            }
        }
    }

    /// Query `j`'s scores against the block's slots `slots` (the block's first at position `p`),
    /// its group's heads in runs that read the same keys: [`qk_block`] for each run.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn query_scores<E: KvElement>(
        &self,
        j: usize,
        keys: &[E],
        block_size: usize,
        p: usize,
        slots: Range<usize>,
        scale: f32,
        scores: &mut [f32],
    ) {
        let (n_max, hd, group) = (self.n_max, self.hd, self.group);
        let q = |h: usize| &self.q[self.first + j * self.q_row + h * hd..][..hd];
        let heads = &mut scores[j * group * n_max..(j + 1) * group * n_max];
        let cols = p + slots.start..p + slots.end;
        for (h, n) in head_runs(group) {
            let run = &mut heads[h * n_max..(h + n) * n_max];
            let (slots, cols) = (slots.clone(), cols.clone());
            let q = |i| q(h + i);
            with_rows!(n, [3 2] 1, |R| qk_block::<_, R>(from_fn(q), keys, block_size, slots, scale, rows_mut(run, n_max, cols)))
        }
    }

    /// Query `j`'s outputs plus its weights of the block's value rows `slots` (the block's first
    /// row at `values[off..]` and position `p`, rows `stride` apart): [`weighted_run`] for each run
    /// of heads. `out` is laid out as `q` (the task's heads, zeroed at its start, its own).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn query_weigh<E: KvElement>(
        &self,
        j: usize,
        scores: &[f32],
        values: &[E],
        off: usize,
        stride: usize,
        p: usize,
        slots: Range<usize>,
        out: &DisjointOut,
    ) {
        let (n_max, hd, group) = (self.n_max, self.hd, self.group);
        // SAFETY: the task's heads of token j: its own, zeroed at its start (the caller's).
        let o = |h: usize| unsafe { out.slice(self.first + j * self.q_row + h * hd, hd) };
        let w = |h: usize| &scores[(j * group + h) * n_max + p + slots.start..][..slots.len()];
        let first_row = off + slots.start * stride;
        for (h, n) in head_runs(group) {
            let (w, o) = (|i| w(h + i), |i| o(h + i));
            with_rows!(n, [3 2] 1, |R| weighted_run::<_, R>(from_fn(w), values, first_row, stride, from_fn(o)))
        }
    }

    /// Every query's outputs plus its weights of `runs`: blocks that every query of the tile sees
    /// whole, `(element offset of the head's first row, rows)` in position order from position
    /// `p`, rows `stride` apart. Each output element gets its terms in position order, as from
    /// [`QueryTile::query_weigh`] block after block, so the same bits. On AVX-512, two tokens'
    /// heads share each value load and the sums stay in registers across all the blocks (a call
    /// per query and block, with its checks and its tile's loads and stores, cost a fifth of the
    /// weighing).
    fn weigh_span<E: KvElement>(
        &self,
        scores: &[f32],
        values: &[E],
        runs: &[(usize, usize)],
        stride: usize,
        p: usize,
        out: &DisjointOut,
    ) {
        #[cfg(target_arch = "x86_64")]
        if avx512() && self.hd.is_multiple_of(TILE) {
            let (n_max, hd, group, m) = (self.n_max, self.hd, self.group, self.m);
            let rows: usize = runs.iter().map(|&(_, rows)| rows).sum();
            assert!(
                runs.iter().all(|&(off, rows)| rows == 0 || off + (rows - 1) * stride + hd <= values.len()),
                "value rows inside the store"
            );
            assert!(p + rows <= n_max && scores.len() >= m * group * n_max, "weights inside the score rows");
            assert!(self.first + (m - 1) * self.q_row + group * hd <= out.len, "outputs inside the step's");
            let (v, s) = (values.as_ptr(), scores.as_ptr());
            for j0 in (0..m).step_by(2) {
                let tokens = 2.min(m - j0);
                for (h, n) in head_runs(group) {
                    // Row i of the call: token j0 + i / n, head h + i % n.
                    let at = |i: usize| (j0 + i / n, h + i % n);
                    for t in (0..hd).step_by(TILE) {
                        // SAFETY: AVX-512F, BW and VL are present (checked at run time); the
                        // weights, value rows and outputs lie inside their buffers (asserted
                        // above); the outputs are this task's (the caller's), of different
                        // (token, head).
                        unsafe {
                            let w = |i: usize| {
                                let (j, h) = at(i);
                                s.add((j * group + h) * n_max + p)
                            };
                            let o = |i: usize| {
                                let (j, h) = at(i);
                                out.slice(self.first + j * self.q_row + h * hd + t, TILE).as_mut_ptr()
                            };
                            let v = v.add(t);
                            with_rows!(tokens * n, [6 4 3 2] 1, |R| weighted_tile_avx512::<_, R>(
                                from_fn(w),
                                v,
                                runs,
                                stride,
                                from_fn(o)
                            ))
                        }
                    }
                }
            }
            return;
        }
        let mut at = p;
        for &(off, rows) in runs {
            for j in 0..self.m {
                self.query_weigh(j, scores, values, off, stride, at, 0..rows, out);
            }
            at += rows;
        }
    }
}

/// A KV group's heads as runs `(first head, heads)` that the kernels serve together, sharing each
/// key and value load: threes, and pairs where a three would leave a head alone (4 = 2 + 2); a
/// lone head only in a group of one. (A lone head's kernel has half a pair's independent chains
/// and waits on their latency: with SmolLM2's groups of three, the third head was one.)
fn head_runs(group: usize) -> impl Iterator<Item = (usize, usize)> {
    let mut first = 0;
    std::iter::from_fn(move || {
        let n = match group - first {
            0 => return None,
            4 => 2,
            left @ (1 | 2) => left,
            _ => 3,
        };
        first += n;
        Some((first - n, n))
    })
}

/// The slots of block `b` of a run of consecutive blocks holding `len` slots in all (every block
/// full but perhaps the last).
fn run_slots(len: usize, block_size: usize, b: usize) -> Range<usize> {
    0..(len - b * block_size).min(block_size)
}

/// `R` consecutive rows of `n` floats from `run`, each cut to `cols`.
fn rows_mut<const R: usize>(run: &mut [f32], n: usize, cols: std::ops::Range<usize>) -> [&mut [f32]; R] {
    let mut rows = run.chunks_mut(n);
    from_fn(|_| &mut rows.next().expect("a row for each head")[cols.clone()])
}

/// The output of a step, written by many tasks at once, each to its own places: each zeroes its
/// places first (`zero`), then adds into them (`slice`).
struct DisjointOut {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: tasks only write through `zero` and `slice`, whose contracts keep their regions apart.
unsafe impl Sync for DisjointOut {}

impl DisjointOut {
    /// Zero `start..start + len`, which may not be initialized yet.
    ///
    /// SAFETY: no live slice from this value may overlap `start..start + len`.
    unsafe fn zero(&self, start: usize, len: usize) {
        assert!(start + len <= self.len, "inside the output");
        // SAFETY: in bounds (asserted); exclusive by the caller's contract.
        unsafe { self.ptr.add(start).write_bytes(0, len) }
    }

    /// SAFETY: `start..start + len` was zeroed (or written); no other live slice from this value
    /// may overlap it.
    #[allow(clippy::mut_from_ref)] // the caller's contract is what makes this sound
    unsafe fn slice(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(start + len <= self.len, "inside the output");
        // SAFETY: in bounds (asserted); exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

/// Tokens from which a step's rotary embedding and key/value stores go across the pool: fewer (a
/// decode step's) take less time than waking it (a round guess, not tuned).
const PARALLEL_TOKENS: usize = 64;

/// Apply rotary embedding to q and k, store k and v in the paged cache, then compute causal
/// attention for every new token (over its window, on a sliding-window layer). `q` is
/// `[tokens][n_head*head_dim]`, `k`/`v` are `[tokens][n_kv_head*head_dim]`, rows concatenated in
/// batch order. Returns `[tokens][n_head*head_dim]`.
pub fn paged_attention(
    rows: &[BatchRow<'_>],
    q: &mut [f32],
    k: &mut [f32],
    v: &[f32],
    kv: &mut LayerKv,
    shape: Attention,
    rope: &Rope,
) -> Vec<f32> {
    let Heads { n_head, n_kv_head, head_dim: hd } = shape.heads;
    let block_size = kv.block_size;
    let (q_row, kv_row) = (n_head * hd, n_kv_head * hd);

    // Token index -> (row, position): flat list so threads can take any token.
    let mut token_pos = Vec::with_capacity(q.len() / q_row);
    for (r, row) in rows.iter().enumerate() {
        for p in row.start_pos..row.end_pos() {
            token_pos.push((r, p));
        }
    }

    // Each token's query and key rows are its own: a prefill's tokens go across the pool (on the
    // calling thread alone, 0.5% of a cold prefill's samples, the other threads waiting).
    let mut tokens: Vec<(&mut [f32], &mut [f32], usize)> = q
        .chunks_mut(q_row)
        .zip(k.chunks_mut(kv_row))
        .zip(&token_pos)
        .map(|((qt, kt), &(_, pos))| (qt, kt, pos))
        .collect();
    let rope_token = |(qt, kt, pos): &mut (&mut [f32], &mut [f32], usize)| {
        for h in qt.chunks_mut(hd).chain(kt.chunks_mut(hd)) {
            rope.apply(h, *pos);
        }
    };
    if tokens.len() < PARALLEL_TOKENS {
        tokens.iter_mut().for_each(rope_token);
    } else {
        super::rows::for_each_mut(&mut tokens, rope_token);
    }

    let writes: Vec<SlotWrite<'_>> = (k.chunks(kv_row).zip(v.chunks(kv_row)).zip(&token_pos))
        .map(|((kt, vt), &(r, pos))| (rows[r].blocks[pos / block_size], pos % block_size, kt, vt))
        .collect();
    kv.write_all(&writes);

    match &kv.planes {
        Planes::F32(plane) => attend(rows, q, &token_pos, plane, block_size, shape),
        Planes::F16(plane) => attend(rows, q, &token_pos, plane, block_size, shape),
        Planes::Bf16(plane) => bf16::attend(rows, q, &token_pos, plane, block_size, shape),
    }
}

/// Every new token's attention (`q`, roped, its keys and values already stored) over the cache's
/// `plane`: `token_pos` gives each token's (row, position).
fn attend<E: KvElement>(
    rows: &[BatchRow<'_>],
    q: &[f32],
    token_pos: &[(usize, usize)],
    kv: &Plane<E>,
    block_size: usize,
    shape: Attention,
) -> Vec<f32> {
    let Heads { n_head, n_kv_head, head_dim: hd } = shape.heads;
    let (q_row, kv_row, group, scale) = (n_head * hd, n_kv_head * hd, shape.heads.group(), shape.scale);
    let mut out = Vec::<f32>::with_capacity(q.len());
    let step = Step::new(rows, token_pos, shape, block_size, &mut out);
    step.run(|i, Scratch { scores, span, .. }| {
        let task = step.task(i);
        // The next task (most often this thread's next) starts loading what it reads first.
        if i + 1 < step.tasks() {
            step.peek(i + 1).prefetch_first_keys(&kv.k);
        }
        let tile = QueryTile { q, first: task.first, q_row, hd, m: task.m, group, n_max: task.n_max };
        task.clear_scores(scores);
        task.score_blocks(
            &kv.k,
            Some(&kv.v),
            scores,
            |blocks, p, len, scores| tile.scores(blocks, block_size, p, len, scale, scores),
            |j, keys, p, slots, scores| tile.query_scores(j, keys, block_size, p, slots, scale, scores),
        );
        task.softmax(scores);
        // Blocks every query sees whole are weighed as one span, from position `span_start`;
        // the others query by query.
        span.clear();
        let mut span_start = 0;
        let value_rows = task.value_rows();
        let mut value_runs = value_rows.runs(task.n_max).peekable();
        while let Some((p, off, len)) = value_runs.next() {
            if task.whole(p, len) {
                if span.is_empty() {
                    span_start = p;
                }
                span.push((off, len));
                continue;
            }
            if !span.is_empty() {
                tile.weigh_span(scores, &kv.v, span, kv_row, span_start, &step.out);
                span.clear();
            }
            // The next block's value rows of this KV head start loading while this one is used.
            if let Some(&(_, next, rows)) = value_runs.peek() {
                (0..rows).for_each(|s| prefetch::<_, true>(&kv.v, next + s * kv_row, hd));
            }
            for j in 0..task.m {
                let (first, count) = task.part(j, p, len);
                if count > 0 {
                    tile.query_weigh(j, scores, &kv.v, off, kv_row, p, first..first + count, &step.out);
                }
            }
        }
        if !span.is_empty() {
            tile.weigh_span(scores, &kv.v, span, kv_row, span_start, &step.out);
        }
    });
    // SAFETY: the tasks zeroed, then added into, every (token, head): each of the tiles, which
    // cover every token, ran once for each KV group, which together hold every head.
    unsafe { out.set_len(q.len()) };
    out
}

/// What every task of a step's attention shares: the batch, its tiles, and the output they write
/// (each task its own tokens' heads of one KV group: a task per tile and KV head).
struct Step<'a> {
    rows: &'a [BatchRow<'a>],
    token_pos: &'a [(usize, usize)],
    tiles: Vec<(usize, usize, usize)>,
    shape: Attention,
    block_size: usize,
    out: DisjointOut,
}

impl<'a> Step<'a> {
    /// A step writing `token_pos.len()` tokens' heads into `out`'s spare capacity (not zeroed
    /// here: each task zeroes its own part; a memset of the whole output was work for one thread
    /// while the others waited). The caller sets `out`'s length once [`Step::run`] returns.
    fn new(
        rows: &'a [BatchRow<'a>],
        token_pos: &'a [(usize, usize)],
        shape: Attention,
        block_size: usize,
        out: &mut Vec<f32>,
    ) -> Self {
        let len = token_pos.len() * shape.heads.n_head * shape.heads.head_dim;
        out.reserve_exact(len);
        let threads = candle_core::utils::barrier_pool().n_workers() + 1;
        let tiles = query_tiles(rows, shape.heads.n_kv_head, threads);
        Step { rows, token_pos, tiles, shape, block_size, out: DisjointOut { ptr: out.as_mut_ptr(), len } }
    }

    /// Run `task(i, scratch)` for every task, the latest tiles (the most positions) first; small
    /// steps (decode) on this thread: waking the pool costs more than the work.
    fn run(&self, task: impl Fn(usize, &mut Scratch) + Sync) {
        let Heads { n_head, head_dim, .. } = self.shape.heads;
        let seen = |p: usize| {
            let (lo, hi) = self.shape.visible(p);
            hi - lo
        };
        let work: usize = self.token_pos.iter().map(|&(_, p)| seen(p)).sum::<usize>() * n_head * head_dim;
        run_tasks(self.tasks(), work >= PARALLEL_MIN_WORK, task);
    }

    /// Task `i`, its outputs zeroed.
    fn task(&self, i: usize) -> Task<'_> {
        let task = self.peek(i);
        let Heads { n_head, head_dim: hd, .. } = self.shape.heads;
        for j in 0..task.m {
            // SAFETY: the heads of the task's KV group of its token j are this task's alone (and
            // contiguous); no slice of them lives yet.
            unsafe { self.out.zero(task.first + j * n_head * hd, self.shape.heads.group() * hd) };
        }
        task
    }

    /// Task `i`, its outputs untouched (to look ahead at what it will read).
    fn peek(&self, i: usize) -> Task<'_> {
        let Heads { n_head, n_kv_head, head_dim: hd } = self.shape.heads;
        let (r, t0, m) = self.tiles[self.tiles.len() - 1 - i / n_kv_head];
        let (g, group, q_row) = (i % n_kv_head, self.shape.heads.group(), n_head * hd);
        let first = t0 * q_row + g * group * hd;
        let p0 = self.token_pos[t0].1;
        Task { step: self, r, m, g, p0, n_max: p0 + m, first }
    }

    /// How many tasks the step runs: one per tile and KV head.
    fn tasks(&self) -> usize {
        self.tiles.len() * self.shape.heads.n_kv_head
    }
}

/// One task of a [`Step`]: the `m` consecutive tokens of batch row `r` at positions `p0..`, their
/// heads of KV group `g`; their score rows are `m × group` rows of `n_max`, token-major.
struct Task<'a> {
    step: &'a Step<'a>,
    r: usize,
    m: usize,
    g: usize,
    p0: usize,
    n_max: usize,
    /// Where the first token's first head of the group starts in `q` (and in the output).
    first: usize,
}

impl Task<'_> {
    /// Of the block run `(p, len)`, the part `(first, count)` query `j` sees (`first` counted
    /// from `p`).
    fn part(&self, j: usize, p: usize, len: usize) -> (usize, usize) {
        let (lo, hi) = self.step.shape.visible(self.p0 + j);
        let (a, b) = (p.max(lo), (p + len).min(hi));
        (a - p, b.saturating_sub(a))
    }

    /// Whether every query of the tile sees the block run whole (all but the diagonal's and a
    /// window's edge; lo and hi grow with j).
    fn whole(&self, p: usize, len: usize) -> bool {
        self.part(0, p, len) == (0, len) && self.part(self.m - 1, p, len) == (0, len)
    }

    /// This KV head's keys (a `head_dim × block_size` matrix per KV head within a block) by block.
    fn key_rows(&self) -> PagedRows<'_> {
        let (hd, bs) = (self.step.shape.heads.head_dim, self.step.block_size);
        PagedRows { head: self.g * hd * bs, ..self.value_rows() }
    }

    /// Start loading the first block of keys this task reads: it lies anywhere in the pool, cold
    /// in a decode step, where a task (one sequence's KV head) reads only a few blocks and the
    /// look-ahead within a task misses its first.
    fn prefetch_first_keys<E>(&self, keys: &[E]) {
        if let Some((_, off, _)) = self.key_rows().runs(self.n_max).next() {
            prefetch::<_, true>(keys, off, self.step.shape.heads.head_dim * self.step.block_size);
        }
    }

    /// This KV head's value rows (`[slot][kv_head][head_dim]` within a block) by block.
    fn value_rows(&self) -> PagedRows<'_> {
        let Heads { n_kv_head, head_dim: hd, .. } = self.step.shape.heads;
        let rows = self.step.rows[self.r].blocks;
        PagedRows { blocks: rows, block_size: self.step.block_size, stride: n_kv_head * hd, head: self.g * hd }
    }

    /// The score rows, with zeros around what each query sees: every score a query sees is
    /// written by [`Task::score_blocks`], and [`softmax_rows`] needs zeros around them (a whole
    /// new buffer each task was a memset of every score).
    fn clear_scores(&self, scores: &mut Vec<f32>) {
        let group = self.step.shape.heads.group();
        scores.resize(self.m * group * self.n_max, 0.0);
        for (r, row) in scores.chunks_mut(self.n_max).enumerate() {
            let (lo, hi) = self.step.shape.visible(self.p0 + r / group);
            row[..lo].fill(0.0);
            row[hi..].fill(0.0);
        }
    }

    /// Every query's scores against its visible keys, block by block from `keys` (the layer's
    /// keys, each KV head's part of a block `head_dim × block_size` elements, whatever their
    /// order inside): `whole(blocks, p, len, scores)` for a run of blocks every query sees whole
    /// (its kernel runs for all of them at once; two blocks where a full one is followed by
    /// another every query sees whole, else one), `len` slots from position `p`;
    /// `part(j, keys, p, slots, scores)` for query `j`'s part of the others. `values`, where they
    /// lie as [`Task::value_rows`] says, start loading block by block as the keys are scored.
    fn score_blocks<E, V>(
        &self,
        keys: &[E],
        values: Option<&[V]>,
        scores: &mut [f32],
        whole: impl Fn(&[&[E]], usize, usize, &mut [f32]),
        part: impl Fn(usize, &[E], usize, Range<usize>, &mut [f32]),
    ) {
        let (hd, bs) = (self.step.shape.heads.head_dim, self.step.block_size);
        let (key_blocks, value_blocks) = (self.key_rows(), self.value_rows());
        let mut key_runs = key_blocks.runs(self.n_max).peekable();
        let mut value_runs = value_blocks.runs(self.n_max);
        let block = |off: usize| &keys[off..off + hd * bs];
        // The next block's keys, one contiguous matrix, start loading while this one is used; this
        // block's value rows start for L2, to be there when the weighing comes to them after the
        // softmax (a value kernel that waits on memory for each block in turn took three times
        // the key kernel's time in a decode step).
        let load_ahead = |next_keys: Option<&(usize, usize, usize)>, values_now: Option<(usize, usize, usize)>| {
            if let Some(&(_, next, _)) = next_keys {
                prefetch::<_, true>(keys, next, hd * bs);
            }
            if let (Some(values), Some((_, off, rows))) = (values, values_now) {
                (0..rows).for_each(|s| prefetch::<_, false>(values, off + s * value_blocks.stride, hd));
            }
        };
        while let Some((p, off, len)) = key_runs.next() {
            load_ahead(key_runs.peek(), value_runs.next());
            if self.whole(p, len) {
                let pair = key_runs.next_if(|&(next, _, next_len)| len == bs && self.whole(next, next_len));
                match pair {
                    Some((_, next, next_len)) => {
                        load_ahead(key_runs.peek(), value_runs.next());
                        whole(&[block(off), block(next)], p, len + next_len, scores);
                    }
                    None => whole(&[block(off)], p, len, scores),
                }
                continue;
            }
            for j in 0..self.m {
                let (first, count) = self.part(j, p, len);
                if count > 0 {
                    part(j, block(off), p, first..first + count, scores);
                }
            }
        }
    }

    /// Each score row's softmax over what its query sees, in place.
    fn softmax(&self, scores: &mut [f32]) {
        let group = self.step.shape.heads.group();
        softmax_rows(scores, self.n_max, |r| self.step.shape.visible(self.p0 + r / group));
    }
}

/// Each row's tokens in tiles of at most [`QUERY_TILE`] consecutive tokens, as `(row, first token
/// index in the step, tokens)`: a row's tiles as many as makes its tasks (a tile for each KV head)
/// a multiple of `threads` where it has the tokens for that, and of sizes that differ by at most
/// one. A turn's 48 tokens with three KV heads were three tiles of 16, nine tasks of equal work
/// for two threads: one thread ran five while the other waited for the last (4 tiles of 12 are
/// twelve, six each).
fn query_tiles(rows: &[BatchRow<'_>], n_kv_head: usize, threads: usize) -> Vec<(usize, usize, usize)> {
    let mut tiles = Vec::new();
    let mut t0 = 0;
    for (r, row) in rows.iter().enumerate() {
        let n = row.tokens.len();
        let fewest = n.div_ceil(QUERY_TILE);
        let k = (fewest..=n).find(|k| (k * n_kv_head).is_multiple_of(threads.max(1))).unwrap_or(fewest);
        let mut first = 0;
        for i in 0..k {
            // The first n % k tiles take one token more.
            let m = n / k + usize::from(i < n % k);
            tiles.push((r, t0 + first, m));
            first += m;
        }
        t0 += n;
    }
    tiles
}

/// Start loading `data[start..start + len]` into the cache: a hint, with no effect on any
/// result. A block of another sequence's cache is cold (in a batched decode step, every block
/// is), and the CPU's own prefetcher starts over at each block, which lies anywhere in the pool.
/// `L1`: for use now (into the first-level cache), else for later (the second level, where
/// a long history's blocks do not push out what is in use).
#[inline]
fn prefetch<E, const L1: bool>(data: &[E], start: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if start < data.len() {
        // SAFETY: the elements lie inside `data`.
        unsafe { prefetch_row::<E, L1>(data.as_ptr().add(start), len.min(data.len() - start)) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, start, len);
}

/// Start loading the `len` elements at `row` into the cache, a line at a time: a hint, with no
/// effect on any result.
///
/// SAFETY: `row .. row + len` lies inside one allocation (a prefetch never faults or writes, but
/// the pointer arithmetic must stay in bounds).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_row<E, const L1: bool>(row: *const E, len: usize) {
    use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1, _mm_prefetch};
    for at in (0..len).step_by(64 / size_of::<E>()) {
        // SAFETY: the caller's promise.
        unsafe {
            match L1 {
                true => _mm_prefetch::<_MM_HINT_T0>(row.add(at).cast()),
                false => _mm_prefetch::<_MM_HINT_T1>(row.add(at).cast()),
            }
        };
    }
}

/// What an attention task reuses from step to step on its thread.
struct Scratch {
    /// The tile's score rows, then their weights.
    scores: Vec<f32>,
    /// The value runs `(offset, rows)` of the blocks every query of the tile sees whole.
    span: Vec<(usize, usize)>,
    /// The weights in bfloat16, two to a lane, and each row's sum (the bf16 path's).
    pairs: Vec<u32>,
    sums: Vec<f32>,
}

/// Run `f(i, scratch)` for every task `i`, in parallel on candle's matmul thread pool:
/// attention and matmuls then share one set of threads. (A second pool, such as rayon's, spins
/// beside candle's and oversubscribes the cores.) Each thread keeps its scratch from step to
/// step: a fresh one of a long prompt's size is mapped, faulted in and zeroed by the kernel every
/// time.
fn run_tasks(n: usize, parallel: bool, f: impl Fn(usize, &mut Scratch) + Sync) {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Scratch> =
            const { std::cell::RefCell::new(Scratch { scores: Vec::new(), span: Vec::new(), pairs: Vec::new(), sums: Vec::new() }) };
    }
    let run = |range: std::ops::Range<usize>| {
        SCRATCH.with_borrow_mut(|scratch| range.for_each(|i| f(i, scratch)));
    };
    if parallel {
        candle_core::utils::barrier_pool().execute_chunked(n, run);
    } else {
        run(0..n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_at_position_zero_is_identity() {
        for style in [RopeStyle::Interleaved, RopeStyle::Halves] {
            let rope = Rope::new(style, 8, 10000.0, 4);
            let mut x: Vec<f32> = (0..8).map(|i| i as f32).collect();
            let before = x.clone();
            rope.apply(&mut x, 0);
            assert_eq!(x, before);
        }
    }

    #[test]
    fn rope_preserves_norm() {
        let rope = Rope::new(RopeStyle::Halves, 8, 10000.0, 16);
        let mut x: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
        let n0: f32 = x.iter().map(|a| a * a).sum();
        rope.apply(&mut x, 11);
        let n1: f32 = x.iter().map(|a| a * a).sum();
        assert!((n0 - n1).abs() < 1e-3);
    }

    /// Where a position of a row lives in a store laid out as the values are (element offset of
    /// its row).
    fn slot_offset(blocks: &[crate::kv_cache::BlockId], block_size: usize, pos: usize, row: usize) -> usize {
        (blocks[pos / block_size].index() * block_size + pos % block_size) * row
    }

    /// The same columns of three rows.
    fn cut(rows: &mut [Vec<f32>; 3], cols: Range<usize>) -> [&mut [f32]; 3] {
        rows.each_mut().map(|r| &mut r[cols.clone()])
    }

    fn wave(n: usize, f: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32) * f).sin() * 3.0).collect()
    }

    #[test]
    fn paged_kernels_sum_every_position_in_order_across_scattered_blocks_in_runs_of_heads_or_alone() {
        use crate::kv_cache::BlockId;
        // Head sizes of whole eights and not (67: three dimensions after the fold); blocks of 4
        // (part of a register) and 20 (a whole register of slots and part of another).
        for (hd, block_size) in [(72, 4), (128, 20), (67, 4)] {
            let n_kv_head = 2;
            let stride = n_kv_head * hd;
            let blocks: Vec<BlockId> = [5, 0, 3, 7].map(BlockId::new).to_vec();
            let store = wave(8 * block_size * stride, 0.013);
            // The second KV head; the positions end mid-block.
            let (g, n) = (1, 3 * block_size + 2);
            let paged = PagedRows { blocks: &blocks, block_size, stride, head: g * hd };
            let row = |p: usize| {
                let off = slot_offset(&blocks, block_size, p, stride) + g * hd;
                &store[off..off + hd]
            };
            // The same rows as keys, through the cache's own write (transposed).
            let heads = Heads { n_head: 3 * n_kv_head, n_kv_head, head_dim: hd };
            let mut kv = LayerKv::new(8, block_size, heads);
            for p in 0..8 * block_size {
                let (b, slot) = (BlockId::new((p / block_size) as u32), p % block_size);
                let at = (b.index() * block_size + slot) * stride;
                kv.write(b, slot, &store[at..at + stride], &store[at..at + stride]);
            }
            let Planes::F32(kv) = &kv.planes else { panic!("a single-precision cache") };
            let key_blocks = PagedRows { head: g * hd * block_size, ..paged };
            // Three queries of one KV group, as the engine runs them, then two, then each alone,
            // over whole blocks and over the middle of each (where a window or a tile edge cuts).
            let queries = [wave(hd, 0.29), wave(hd, 0.47), wave(hd, 0.61)];
            let zeros = || [vec![0.0; n], vec![0.0; n], vec![0.0; n]];
            let (mut three, mut two, mut alone, mut parts) = (zeros(), zeros(), zeros(), zeros());
            for (p, off, len) in key_blocks.runs(n) {
                let keys = &kv.k[off..off + hd * block_size];
                let q: [&[f32]; 3] = queries.each_ref().map(|q| q.as_slice());
                qk_block(q, keys, block_size, 0..len, 0.5, cut(&mut three, p..p + len));
                let [a, b, _] = &mut two;
                qk_block([q[0], q[1]], keys, block_size, 0..len, 0.5, [&mut a[p..p + len], &mut b[p..p + len]]);
                for (q, s) in q.iter().zip(&mut alone) {
                    qk_block([q], keys, block_size, 0..len, 0.5, [&mut s[p..p + len]]);
                }
                for slots in [0..1.min(len), 1.min(len)..len] {
                    let cols = p + slots.start..p + slots.end;
                    qk_block(q, keys, block_size, slots, 0.5, cut(&mut parts, cols));
                }
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for (q, s) in queries.iter().zip(&three) {
                for (p, s) in s.iter().enumerate() {
                    assert_eq!(s.to_bits(), (dot(q, row(p)) * 0.5).to_bits(), "score of position {p}");
                }
            }
            let all_bits = |s: &[Vec<f32>; 3]| s.each_ref().map(|s| bits(s));
            assert_eq!(all_bits(&three), all_bits(&alone), "three heads' scores as alone");
            assert_eq!(all_bits(&three), all_bits(&parts), "a block's scores cut in two as whole");
            let mut portable = zeros();
            for (p, off, len) in key_blocks.runs(n) {
                let q: [&[f32]; 3] = queries.each_ref().map(|q| q.as_slice());
                let keys = &kv.k[off..off + hd * block_size];
                qk_block_portable(q, keys, block_size, 0..len, 0.5, cut(&mut portable, p..p + len));
            }
            assert_eq!(all_bits(&three), all_bits(&portable), "the portable path's bits");
            assert_eq!(all_bits(&two)[..2], all_bits(&alone)[..2], "paired scores as alone");
            let zeros = || [vec![0.0; hd], vec![0.0; hd], vec![0.0; hd]];
            let (mut out, mut out_two, mut out_alone) = (zeros(), zeros(), zeros());
            for (p, off, len) in paged.runs(n) {
                let w = three.each_ref().map(|s| &s[p..p + len]);
                weighted_run(w, &store, off, stride, out.each_mut().map(|o| o.as_mut_slice()));
                let [a, b, _] = &mut out_two;
                weighted_run([w[0], w[1]], &store, off, stride, [a, b]);
                for (w, o) in w.iter().zip(&mut out_alone) {
                    weighted_run([w], &store, off, stride, [o]);
                }
            }
            for (s, o) in three.iter().zip(&out) {
                let mut expected = vec![0f32; hd];
                for (p, w) in s.iter().enumerate() {
                    for (e, x) in expected.iter_mut().zip(row(p)) {
                        *e = w.mul_add(*x, *e);
                    }
                }
                assert_eq!(bits(o), bits(&expected));
            }
            assert_eq!(all_bits(&out), all_bits(&out_alone), "three heads' outputs as alone");
            assert_eq!(all_bits(&out_two)[..2], all_bits(&out_alone)[..2], "paired outputs as alone");
        }
    }

    #[test]
    fn two_blocks_scored_at_once_give_each_slot_the_bits_of_dot() {
        #[cfg(target_arch = "x86_64")]
        crate::model::kernel_check::on_cpu_with(avx512(), "AVX-512 F/BW/VL", || {
            use crate::kv_cache::BlockId;
            // Head sizes of whole eights and not (67: three dimensions after the fold), blocks of
            // one register of slots and of more (the kernel reads the first sixteen of each).
            for (hd, block_size) in [(64, 16), (72, 20), (67, 16)] {
                let heads = Heads { n_head: 3, n_kv_head: 1, head_dim: hd };
                let store = wave(4 * block_size * hd, 0.017);
                let mut kv = LayerKv::new(4, block_size, heads);
                for p in 0..4 * block_size {
                    let (b, slot) = (BlockId::new((p / block_size) as u32), p % block_size);
                    kv.write(b, slot, &store[p * hd..(p + 1) * hd], &store[p * hd..(p + 1) * hd]);
                }
                let Planes::F32(kv) = &kv.planes else { panic!("a single-precision cache") };
                let queries = [wave(hd, 0.29), wave(hd, 0.47), wave(hd, 0.61)];
                // Blocks 3 and 1, as a sequence's blocks lie anywhere in the pool.
                let keys = [3, 1].map(|b| kv.k[b * hd * block_size..].as_ptr());
                let expected = |q: &[f32], i: usize, s: usize| {
                    let p = [3, 1][i] * block_size + s;
                    (dot(q, &store[p * hd..(p + 1) * hd]) * 0.5).to_bits()
                };
                let mut out = [[0f32; 2 * SLOT_LANES]; 3];
                let q = queries.each_ref().map(|q| q.as_ptr());
                let o = out.each_mut().map(|o| o.as_mut_ptr());
                // SAFETY: AVX-512 is present; each query holds `hd` floats, each block's keys
                // `hd * block_size`, each output 32 floats.
                unsafe {
                    qk_two_avx512::<f32, 3>(q, keys, block_size, hd, 0.5, o);
                }
                let mut alone = [[0f32; 2 * SLOT_LANES]; 3];
                for (q, o) in queries.iter().zip(&mut alone) {
                    // SAFETY: as above, one query.
                    unsafe { qk_two_avx512::<f32, 1>([q.as_ptr()], keys, block_size, hd, 0.5, [o.as_mut_ptr()]) };
                }
                for (r, q) in queries.iter().enumerate() {
                    for i in 0..2 {
                        for s in 0..SLOT_LANES {
                            let at = i * SLOT_LANES + s;
                            assert_eq!(out[r][at].to_bits(), expected(q, i, s), "head {r}, block {i}, slot {s}");
                            assert_eq!(alone[r][at].to_bits(), out[r][at].to_bits(), "head {r} alone");
                        }
                    }
                }
            }
        });
    }

    #[test]
    fn eight_slots_to_a_register_give_each_slot_the_bits_of_dot_in_either_cache() {
        #[cfg(target_arch = "x86_64")]
        crate::model::kernel_check::on_cpu_with(avx2(), "AVX2/FMA/F16C", || {
            fn check<E: KvElement>() {
                // Head sizes of whole eights and not (67: three dimensions after the fold);
                // blocks of one and two registers and between; runs of slots that start and end
                // anywhere (the kernel scores whole registers of them, the rest is left).
                for (hd, block_size) in [(64, 16), (72, 20), (67, 16), (64, 27)] {
                    let keys: Vec<E> = wave(hd * block_size, 0.017).into_iter().map(E::from_f32).collect();
                    let key = |s: usize| (0..hd).map(|d| keys[d * block_size + s].to_f32()).collect::<Vec<_>>();
                    let queries = [wave(hd, 0.29), wave(hd, 0.47), wave(hd, 0.61)];
                    for slots in [0..block_size, 3..block_size, 5..13, 0..7, 1..block_size - 1] {
                        let n = slots.len();
                        let mut out = [vec![0f32; n], vec![0f32; n], vec![0f32; n]];
                        let q = queries.each_ref().map(|q| q.as_ptr());
                        let o = out.each_mut().map(|o| o.as_mut_ptr());
                        // SAFETY: AVX2, FMA and F16C are present; each query holds `hd` floats,
                        // the keys `hd * block_size`, each output `n` floats.
                        let done =
                            unsafe { qk_block_avx2::<E, 3>(q, keys.as_ptr(), block_size, hd, slots.clone(), 0.5, o) };
                        assert_eq!(done, n - n % 8, "every whole register of slots, {slots:?}");
                        for (r, q) in queries.iter().enumerate() {
                            let mut alone = vec![0f32; n];
                            // SAFETY: as above, one query.
                            let one = unsafe {
                                qk_block_avx2::<E, 1>(
                                    [q.as_ptr()],
                                    keys.as_ptr(),
                                    block_size,
                                    hd,
                                    slots.clone(),
                                    0.5,
                                    [alone.as_mut_ptr()],
                                )
                            };
                            assert_eq!(one, done);
                            for i in 0..done {
                                let expected = (dot(q, &key(slots.start + i)) * 0.5).to_bits();
                                assert_eq!(
                                    out[r][i].to_bits(),
                                    expected,
                                    "hd {hd}, head {r}, slot {}",
                                    slots.start + i
                                );
                                assert_eq!(alone[i].to_bits(), expected, "head {r} alone");
                            }
                        }
                    }
                }
            }
            check::<f32>();
            check::<f16>();
        });
    }

    #[test]
    fn a_run_of_two_blocks_the_last_part_full_writes_only_its_own_slots() {
        // A decode step's whole run: a full block, then one holding 5 positions, at the end of
        // the score rows (`n_max` = 21). Whatever kernel takes the run, nothing past it changes.
        let (hd, block_size, len) = (64, 16, 21);
        let heads = Heads { n_head: 3, n_kv_head: 1, head_dim: hd };
        let mut kv = LayerKv::new(2, block_size, heads);
        let store = wave(2 * block_size * hd, 0.017);
        for p in 0..len {
            let (b, slot) = (crate::kv_cache::BlockId::new((p / block_size) as u32), p % block_size);
            kv.write(b, slot, &store[p * hd..(p + 1) * hd], &store[p * hd..(p + 1) * hd]);
        }
        let Planes::F32(kv) = &kv.planes else { panic!("a single-precision cache") };
        let q = wave(3 * hd, 0.29);
        let tile = QueryTile { q: &q, first: 0, q_row: 3 * hd, hd, m: 1, group: 3, n_max: len };
        let blocks = [&kv.k[..hd * block_size], &kv.k[hd * block_size..2 * hd * block_size]];
        let mut scores = vec![f32::NAN; 3 * len + 2 * SLOT_LANES];
        tile.scores(&blocks, block_size, 0, len, 0.5, &mut scores);
        for (h, row) in scores[..3 * len].chunks(len).enumerate() {
            for (p, s) in row.iter().enumerate() {
                let want = dot(&q[h * hd..(h + 1) * hd], &store[p * hd..(p + 1) * hd]) * 0.5;
                assert_eq!(s.to_bits(), want.to_bits(), "head {h}, position {p}");
            }
        }
        assert!(scores[3 * len..].iter().all(|s| s.is_nan()), "nothing written past the rows");
    }

    #[test]
    fn a_prefills_positions_stored_block_by_block_across_threads_land_where_one_by_one_would() {
        use crate::kv_cache::BlockId;
        let (heads, bs) = (Heads { n_head: 6, n_kv_head: 2, head_dim: 8 }, 16);
        let row = heads.n_kv_head * heads.head_dim;
        // Two sequences' new positions in scattered blocks, more than one thread's worth.
        let blocks = [[9u32, 2, 14, 5], [0, 11, 7, 3]].map(|b| b.map(BlockId::new));
        let (keys, values) = (wave(2 * 60 * row, 0.3), wave(2 * 60 * row, 0.7));
        let writes: Vec<SlotWrite<'_>> = (0..120)
            .map(|t| {
                let (seq, pos) = (t / 60, 3 + t % 60);
                let at = t * row..(t + 1) * row;
                (blocks[seq][pos / bs], pos % bs, &keys[at.clone()], &values[at])
            })
            .collect();
        assert!(writes.len() >= PARALLEL_TOKENS, "the pool's path");
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
            let (mut together, mut alone) =
                (LayerKv::with_dtype(16, bs, heads, dtype), LayerKv::with_dtype(16, bs, heads, dtype));
            together.write_all(&writes);
            writes.iter().for_each(|&(b, slot, k, v)| alone.write(b, slot, k, v));
            let bits = |kv: &mut LayerKv| -> Vec<u32> {
                match &mut kv.planes {
                    Planes::F32(p) => p.k.iter().chain(&p.v).map(|x| x.to_bits()).collect(),
                    Planes::F16(p) => p.k.iter().chain(&p.v).map(|x| x.to_bits().into()).collect(),
                    Planes::Bf16(p) => {
                        let (k, v) = p.planes_mut();
                        k.iter().chain(v.iter()).map(|x| x.to_bits().into()).collect()
                    }
                }
            };
            let stored = bits(&mut together);
            assert!(stored.iter().any(|&b| b != 0), "{dtype:?}: something stored");
            assert_eq!(stored, bits(&mut alone), "{dtype:?}");
        }
    }

    #[test]
    fn heads_run_in_threes_and_pairs_and_never_leave_one_alone_beside_others() {
        let runs = |g: usize| head_runs(g).collect::<Vec<_>>();
        assert_eq!(runs(1), [(0, 1)]);
        assert_eq!(runs(2), [(0, 2)]);
        assert_eq!(runs(3), [(0, 3)]);
        assert_eq!(runs(4), [(0, 2), (2, 2)]);
        assert_eq!(runs(7), [(0, 3), (3, 2), (5, 2)]);
        for g in 1..40 {
            let r = runs(g);
            assert_eq!(r.iter().map(|&(_, n)| n).sum::<usize>(), g, "group {g}");
            assert!(r.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0), "group {g}: consecutive");
            assert!(g == 1 || r.iter().all(|&(_, n)| n > 1), "group {g}: a lone head");
        }
    }

    /// Attention for `tokens` new tokens after `cached`, as one step or token by token, over
    /// `window` positions (None: all); keys and values before position `stale_before` are shifted
    /// (what a window must never see).
    fn attend_with(
        heads: Heads,
        cached: usize,
        tokens: usize,
        one_by_one: bool,
        window: Option<usize>,
        stale_before: usize,
    ) -> Vec<f32> {
        attend_in(KvDtype::F32, heads, cached, tokens, one_by_one, window, stale_before)
    }

    /// [`attend_with`] on a cache of `dtype`.
    fn attend_in(
        dtype: KvDtype,
        heads: Heads,
        cached: usize,
        tokens: usize,
        one_by_one: bool,
        window: Option<usize>,
        stale_before: usize,
    ) -> Vec<f32> {
        use crate::kv_cache::BlockId;
        let (q_row, kv_row) = (heads.n_head * heads.head_dim, heads.n_kv_head * heads.head_dim);
        let shape = Attention { window, ..Attention::causal(heads) };
        let mut kv = LayerKv::with_dtype(16, 4, heads, dtype);
        let blocks: Vec<BlockId> = [9, 2, 14, 0, 5, 11, 3, 7, 1, 12].map(BlockId::new).to_vec();
        let rope = Rope::new(RopeStyle::Halves, heads.head_dim, 10000.0, 64);
        let all = cached + tokens;
        let (q, mut k, mut v) = (wave(all * q_row, 0.031), wave(all * kv_row, 0.023), wave(all * kv_row, 0.017));
        for x in k[..stale_before * kv_row].iter_mut().chain(&mut v[..stale_before * kv_row]) {
            *x += 0.75;
        }
        let ids = vec![0u32; all];
        let mut out = Vec::new();
        let steps: Vec<(usize, usize)> =
            if one_by_one { (0..all).map(|p| (p, 1)).collect() } else { vec![(0, cached), (cached, tokens)] };
        for (start, len) in steps {
            let row = BatchRow { tokens: &ids[..len], start_pos: start, blocks: &blocks, want_logits: false };
            let (mut qs, mut ks) =
                (q[start * q_row..][..len * q_row].to_vec(), k[start * kv_row..][..len * kv_row].to_vec());
            let vs = &v[start * kv_row..][..len * kv_row];
            let o = paged_attention(&[row], &mut qs, &mut ks, vs, &mut kv, shape, &rope);
            if start >= cached {
                out.extend(o);
            }
        }
        out
    }

    /// Six query heads over two KV heads: groups of three, as SmolLM2's.
    const GROUPS_OF_THREE: Heads = Heads { n_head: 6, n_kv_head: 2, head_dim: 64 };

    fn attend(cached: usize, tokens: usize, one_by_one: bool) -> Vec<f32> {
        attend_with(GROUPS_OF_THREE, cached, tokens, one_by_one, None, 0)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn a_tile_of_queries_gives_each_token_the_bits_it_gets_alone() {
        // 37 new tokens: two whole tiles and a partial one, over 3 cached positions.
        let tiled = attend(3, 37, false);
        let alone = attend(3, 37, true);
        assert_eq!(tiled.len(), alone.len());
        assert!(bits(&tiled) == bits(&alone), "tiled attention differs from token-by-token");
    }

    #[test]
    fn blocks_seen_whole_weigh_two_tokens_at_a_time_with_the_bits_of_one_alone() {
        // Groups of one, two and four heads (runs of 1, 2 and 2 + 2: the span kernel for one or
        // two tokens of each), head sizes of one and two value tiles, odd tiles (a lone token).
        for (n_head, n_kv_head, head_dim) in [(2, 2, 64), (4, 2, 64), (8, 2, 64), (6, 2, 128)] {
            let heads = Heads { n_head, n_kv_head, head_dim };
            let tiled = attend_with(heads, 21, 19, false, None, 0);
            let alone = attend_with(heads, 21, 19, true, None, 0);
            assert!(bits(&tiled) == bits(&alone), "{heads:?}: tiled attention differs from token-by-token");
        }
    }

    #[test]
    fn a_sliding_window_hides_what_lies_before_it_and_keeps_chunks_exact() {
        // The last of 40 positions, window 9: positions 31..=39 are visible, 0..31 are not.
        let (cached, tokens, window) = (39, 1, Some(9));
        let windowed = attend_with(GROUPS_OF_THREE, cached, tokens, false, window, 0);
        assert_eq!(
            bits(&windowed),
            bits(&attend_with(GROUPS_OF_THREE, cached, tokens, false, window, 31)),
            "stale keys were read"
        );
        assert_ne!(
            bits(&windowed),
            bits(&attend_with(GROUPS_OF_THREE, cached, tokens, false, window, 32)),
            "a visible key was skipped"
        );
        assert_ne!(bits(&windowed), bits(&attend(cached, tokens, false)), "the window changed nothing");
        // Every query of a chunk (tiles spanning window edges and blocks) as if alone.
        let w = Some(6);
        assert_eq!(
            bits(&attend_with(GROUPS_OF_THREE, 5, 35, false, w, 0)),
            bits(&attend_with(GROUPS_OF_THREE, 5, 35, true, w, 0))
        );
        // A window wider than the sequence is plain causal attention.
        assert_eq!(bits(&attend_with(GROUPS_OF_THREE, 5, 35, false, Some(64), 0)), bits(&attend(5, 35, false)));
    }

    #[test]
    fn bf16_attention_gives_each_token_its_bits_alone_across_tiles_windows_and_odd_blocks() {
        let bf16 = |heads, cached, tokens, one_by_one, window, stale| {
            attend_in(KvDtype::Bf16, heads, cached, tokens, one_by_one, window, stale)
        };
        // Groups of three, one, two and four heads, heads of two value tiles; 19 new tokens after
        // 21 (odd block runs at both ends), with and without a window.
        let heads = [GROUPS_OF_THREE, Heads { n_head: 2, n_kv_head: 2, head_dim: 64 }];
        let more = [Heads { n_head: 4, n_kv_head: 2, head_dim: 64 }, Heads { n_head: 8, n_kv_head: 2, head_dim: 128 }];
        for (heads, window) in heads.into_iter().chain(more).flat_map(|h| [(h, None), (h, Some(6))]) {
            let tiled = bf16(heads, 21, 19, false, window, 0);
            assert!(bits(&tiled) == bits(&bf16(heads, 21, 19, true, window, 0)), "{heads:?} {window:?}: tiled differs");
            // Near the f32 cache's result: bfloat16 keeps 8 bits of each operand.
            let exact = attend_in(KvDtype::F32, heads, 21, 19, false, window, 0);
            let scale = exact.iter().fold(0f32, |m, x| m.max(x.abs()));
            let gap = exact.iter().zip(&tiled).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
            assert!(gap > 0.0 && gap < 0.02, "{heads:?} {window:?}: {gap} off f32's");
        }
        // What lies before a window is never read: stale keys and values there change nothing.
        let (cached, window) = (39, Some(9));
        let windowed = bf16(GROUPS_OF_THREE, cached, 1, false, window, 0);
        assert_eq!(bits(&windowed), bits(&bf16(GROUPS_OF_THREE, cached, 1, false, window, 31)), "stale keys read");
        assert_ne!(bits(&windowed), bits(&bf16(GROUPS_OF_THREE, cached, 1, false, window, 32)), "a key skipped");
    }

    #[test]
    fn a_half_cache_reads_as_the_single_precision_cache_of_its_rounded_values() {
        use crate::kv_cache::BlockId;
        let blocks: Vec<BlockId> = [9, 2, 14, 0, 5, 11, 3, 7, 1, 12].map(BlockId::new).to_vec();
        let (block_size, all) = (4, 40);
        let ids = [0u32; 40];
        // Groups of three (SmolLM2's), heads of two value tiles, and a window's edge.
        let two_tiles = Heads { n_head: 4, n_kv_head: 2, head_dim: 128 };
        for (heads, window) in [(GROUPS_OF_THREE, None), (two_tiles, None), (GROUPS_OF_THREE, Some(6))] {
            let (q_row, kv_row) = (heads.n_head * heads.head_dim, heads.n_kv_head * heads.head_dim);
            let n = 16 * block_size * kv_row;
            let mut half = Plane::<f16> { k: vec![f16::ZERO; n], v: vec![f16::ZERO; n] };
            let mut rounded = Plane::<f32> { k: vec![0.0; n], v: vec![0.0; n] };
            let mut exact = Plane::<f32> { k: vec![0.0; n], v: vec![0.0; n] };
            let (k, v) = (wave(all * kv_row, 0.023), wave(all * kv_row, 0.017));
            let round = |x: &[f32]| x.iter().map(|&x| f16::from_f32(x).to_f32()).collect::<Vec<_>>();
            for p in 0..all {
                let (b, slot) = (blocks[p / block_size], p % block_size);
                let (k, v) = (&k[p * kv_row..][..kv_row], &v[p * kv_row..][..kv_row]);
                half.write(block_size, b, slot, k, v);
                rounded.write(block_size, b, slot, &round(k), &round(v));
                exact.write(block_size, b, slot, k, v);
            }
            let shape = Attention { window, ..Attention::causal(heads) };
            // One row's 19 new tokens after 21 (tiles, spans, the diagonal), then a decode step of
            // three rows at different lengths over the same blocks.
            let prefill = [BatchRow { tokens: &ids[..19], start_pos: 21, blocks: &blocks, want_logits: false }];
            let decode =
                [39, 30, 12].map(|p| BatchRow { tokens: &ids[..1], start_pos: p, blocks: &blocks, want_logits: false });
            let prefill_pos: Vec<(usize, usize)> = (21..40).map(|p| (0, p)).collect();
            for (rows, token_pos) in [(&prefill[..], &prefill_pos[..]), (&decode[..], &[(0, 39), (1, 30), (2, 12)])] {
                let q = wave(token_pos.len() * q_row, 0.031);
                let from_half = super::attend(rows, &q, token_pos, &half, block_size, shape);
                let from_rounded = super::attend(rows, &q, token_pos, &rounded, block_size, shape);
                assert!(bits(&from_half) == bits(&from_rounded), "{heads:?} {window:?}: {} rows", rows.len());
                let from_exact = super::attend(rows, &q, token_pos, &exact, block_size, shape);
                assert!(bits(&from_half) != bits(&from_exact), "{heads:?} {window:?}: nothing was rounded");
                let worst = from_half.iter().zip(&from_exact).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(worst < 1e-2, "{heads:?} {window:?}: off by {worst}");
            }
            // The portable key kernel reads half keys as their values too.
            let (q, keys) = (wave(heads.head_dim, 0.29), |i: usize| i * heads.head_dim * block_size);
            let (mut a, mut b) = (vec![0f32; block_size], vec![0f32; block_size]);
            let at = keys(blocks[1].index() * heads.n_kv_head);
            qk_block_portable([&q], &half.k[at..], block_size, 0..block_size, 0.5, [&mut a]);
            qk_block_portable([&q], &rounded.k[at..], block_size, 0..block_size, 0.5, [&mut b]);
            assert_eq!(bits(&a), bits(&b), "{heads:?}: portable key scores");
        }
    }

    #[test]
    fn dot_matches_naive_sum_closely() {
        let a: Vec<f32> = (0..67).map(|i| (i as f32).sin()).collect();
        let b: Vec<f32> = (0..67).map(|i| (i as f32).cos()).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-4);
    }

    #[test]
    fn softmax_sums_to_one_and_keeps_the_order() {
        for n in [1, 5, 8, 13, 40] {
            let mut row = wave(n, 0.7);
            let before = row.clone();
            softmax(&mut row);
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5, "n {n}");
            for i in 0..n {
                for j in 0..n {
                    assert_eq!(before[i] < before[j], row[i] < row[j], "n {n}: order of {i} and {j}");
                }
            }
        }
    }

    #[test]
    fn rows_side_by_side_get_the_softmax_each_gets_alone() {
        // 19 rows (a whole group of sums and a partial one) of different visible ranges, some
        // starting late (a window), one element long, and longer than a vector.
        let n = 45;
        let range = |r: usize| ((r * 3) % 7, (n - r * 2).max((r * 3) % 7 + 1));
        let mut many = vec![0f32; 19 * n];
        let mut alone = Vec::new();
        for r in 0..19 {
            let (lo, hi) = range(r);
            let scores = wave(hi - lo, 0.41 + r as f32 * 0.13);
            many[r * n + lo..r * n + hi].copy_from_slice(&scores);
            let mut row = scores;
            softmax(&mut row);
            alone.push(row);
        }
        softmax_rows(&mut many, n, range);
        for (r, row) in alone.iter().enumerate() {
            let (lo, hi) = range(r);
            assert_eq!(bits(&many[r * n + lo..r * n + hi]), bits(row), "row {r}");
            assert!(many[r * n..r * n + lo].iter().chain(&many[r * n + hi..(r + 1) * n]).all(|&x| x == 0.0), "row {r}");
        }
    }

    #[test]
    fn a_square_transposed_in_registers_puts_each_rows_element_in_its_lane() {
        #[cfg(target_arch = "x86_64")]
        crate::model::kernel_check::on_cpu_with(avx512(), "AVX-512 F/BW/VL", || {
            use std::arch::x86_64::*;
            let square: [[f32; 16]; 16] = from_fn(|r| from_fn(|p| (r * 16 + p) as f32));
            // SAFETY: AVX-512F is present (checked above); sixteen floats each.
            let out = unsafe {
                transpose16(square.map(|row| _mm512_loadu_ps(row.as_ptr()))).map(|v| {
                    let mut x = [0f32; 16];
                    _mm512_storeu_ps(x.as_mut_ptr(), v);
                    x
                })
            };
            for (p, lanes) in out.iter().enumerate() {
                for (r, &x) in lanes.iter().enumerate() {
                    assert_eq!(x, square[r][p], "row {r}'s element {p}");
                }
            }
        });
    }

    #[test]
    fn a_turns_tiles_give_every_thread_as_many_tasks_and_cover_each_token_once() {
        let ids = [0u32; 300];
        let blocks = [];
        let row = |n: usize| BatchRow { tokens: &ids[..n], start_pos: 7, blocks: &blocks, want_logits: false };
        // (tokens per row, KV heads, threads, tiles the rows get)
        let cases: [(&[usize], usize, usize, usize); 7] = [
            (&[48], 3, 2, 4), // three tiles of 16 would be nine tasks: four of 12
            (&[40], 3, 2, 4), // 10 each, not 16, 16, 8
            (&[32], 3, 2, 2), // already even
            (&[256], 3, 2, 16),
            (&[1], 3, 2, 1),               // a decode row cannot be split
            (&[5, 1, 1], 1, 4, 4 + 1 + 1), // decode rows beside it stay whole
            (&[300, 0, 17], 5, 1, 19 + 2),
        ];
        for (lens, n_kv_head, threads, expected) in cases {
            let rows: Vec<_> = lens.iter().map(|&n| row(n)).collect();
            let tiles = query_tiles(&rows, n_kv_head, threads);
            assert_eq!(tiles.len(), expected, "{lens:?}");
            // Every token once, in order, each row's tiles within the row and at most QUERY_TILE.
            let mut next = 0;
            for &(r, first, m) in &tiles {
                assert_eq!(first, next, "{lens:?}");
                assert!((1..=QUERY_TILE).contains(&m), "{lens:?}: a tile of {m}");
                let row_start: usize = lens[..r].iter().sum();
                assert!(first + m <= row_start + lens[r], "{lens:?}: tile past its row");
                next += m;
            }
            assert_eq!(next, lens.iter().sum::<usize>(), "{lens:?}");
        }
        // A turn's tiles are sizes one apart.
        let sizes: Vec<usize> = query_tiles(&[row(40)], 3, 2).iter().map(|t| t.2).collect();
        assert_eq!(sizes, [10, 10, 10, 10]);
        let sizes: Vec<usize> = query_tiles(&[row(50)], 3, 2).iter().map(|t| t.2).collect();
        assert_eq!(sizes, [13, 13, 12, 12]);
    }
}
