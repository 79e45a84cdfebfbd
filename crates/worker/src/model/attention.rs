//! Rotary embedding and causal attention over a paged KV cache, on host memory.
//!
//! Every query's scores are summed in position order 0..=pos, whatever the batch or chunk it came
//! in: that fixed order is what makes a request's output independent of chunk size and of its
//! batch neighbours (bit-exact, not merely close). Work is split across threads by (tile of a
//! row's tokens, KV head), which changes who computes a value, never the order of its sums. The kernels below
//! compute several positions or columns at once for speed, and each is tested to give the very
//! bits of the plain one-at-a-time loop.

use super::BatchRow;

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
        let end = pos + 1;
        (self.window.map_or(0, |w| end.saturating_sub(w)), end)
    }
}

/// One layer's paged K and V storage: `[block][slot][kv_head][head_dim]`.
pub struct LayerKv {
    k: Vec<f32>,
    v: Vec<f32>,
    block_size: usize,
}

impl LayerKv {
    pub fn new(num_blocks: usize, block_size: usize, heads: Heads) -> Self {
        let n = num_blocks * block_size * heads.n_kv_head * heads.head_dim;
        LayerKv { k: vec![0.0; n], v: vec![0.0; n], block_size }
    }
}

/// Where a position of a row lives in the paged store (element offset of its K/V vector row).
#[inline]
fn slot_offset(blocks: &[crate::kv_cache::BlockId], block_size: usize, pos: usize, row: usize) -> usize {
    (blocks[pos / block_size].index() * block_size + pos % block_size) * row
}

/// Lanes of one AVX register: every dot product sums in these lanes, then folds them in a
/// fixed tree, so its value is the same whichever kernel computed it.
const LANES: usize = 8;
/// Positions whose scores [`dot_batch`] computes together: four independent accumulator chains
/// keep the FMA units busy where one chain would wait on each add's latency (eight measured
/// slower).
const DOT_BATCH: usize = 4;
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

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent lanes in a fixed order: one AVX register, and deterministic.
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

/// `q` against [`DOT_BATCH`] key rows at once: each result is bit-for-bit [`dot`]`(q, k[j])`
/// (the same lanes, the same fused multiply-adds in the same order), computed with independent
/// chains. Left to itself the compiler vectorizes this across the keys instead of across lanes,
/// which is slower than [`dot`]; with FMA the lanes are spelt out.
#[inline(always)]
fn dot_batch(q: &[f32], k: [&[f32]; DOT_BATCH]) -> [f32; DOT_BATCH] {
    let whole = q.len() / LANES * LANES;
    let mut acc = [[0f32; LANES]; DOT_BATCH];
    #[cfg(all(target_arch = "x86_64", target_feature = "fma"))]
    {
        use std::arch::x86_64::{_mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps, _mm256_storeu_ps};
        assert!(k.iter().all(|k| k.len() >= whole), "key rows as long as the query");
        // SAFETY: FMA and AVX are enabled at compile time (the cfg above); every load reads 8 floats at
        // an index below `whole`, which no slice is shorter than (asserted above).
        unsafe {
            let mut a = [_mm256_setzero_ps(); DOT_BATCH];
            for i in (0..whole).step_by(LANES) {
                let x = _mm256_loadu_ps(q.as_ptr().add(i));
                for j in 0..DOT_BATCH {
                    a[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[j].as_ptr().add(i)), a[j]);
                }
            }
            for j in 0..DOT_BATCH {
                _mm256_storeu_ps(acc[j].as_mut_ptr(), a[j]);
            }
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "fma")))]
    for i in (0..whole).step_by(LANES) {
        for j in 0..DOT_BATCH {
            for l in 0..LANES {
                acc[j][l] = q[i + l].mul_add(k[j][i + l], acc[j][l]);
            }
        }
    }
    let mut out = [0f32; DOT_BATCH];
    for j in 0..DOT_BATCH {
        out[j] = fold(&acc[j]);
        for (x, y) in q[whole..].iter().zip(&k[j][whole..]) {
            out[j] = x.mul_add(*y, out[j]);
        }
    }
    out
}

const EXP_LOG2E: f64 = std::f64::consts::LOG2_E;
/// ln 2 in two parts, for the range reduction r = x - n ln 2 (n * EXP_LN2_HI is exact here).
const EXP_LN2_HI: f64 = f64::from_bits(0x3FE6_2E42_FEE0_0000);
const EXP_LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
/// Taylor coefficients 1/k! for k = 0..=11: the remainder is below 1e-14 for |r| <= ln2 / 2.
const EXP_C: [f64; 12] = [
    1.0,
    1.0,
    0.5,
    1.0 / 6.0,
    1.0 / 24.0,
    1.0 / 120.0,
    1.0 / 720.0,
    1.0 / 5_040.0,
    1.0 / 40_320.0,
    1.0 / 362_880.0,
    1.0 / 3_628_800.0,
    1.0 / 39_916_800.0,
];
/// exp(-110) is 0 in f32; clamping there keeps 2^n a normal f64 (and turns -inf into 0).
const EXP_LOWEST: f32 = -110.0;

/// `exp` of eight values at once, evaluated in double precision and rounded once to `f32`: so
/// close to correctly rounded that, checked once over every float in [-104, 0], it differed from
/// glibc's `expf` on 97,053 of 1.12 billion, by one ulp each. (A single-precision polynomial, within 2 ulp, differed
/// often enough to move a near-tie in the model's greedy output away from llama.cpp's.) The AVX
/// and the portable version perform the same operations, so they give the same bits.
#[inline(always)]
fn exp8(x: [f32; LANES]) -> [f32; LANES] {
    #[cfg(all(target_arch = "x86_64", target_feature = "fma", target_feature = "avx2"))]
    // SAFETY: AVX2 and FMA are enabled at compile time (the cfg above); loads and stores are of
    // whole arrays (8 floats in, 4 floats out per half).
    unsafe {
        use std::arch::x86_64::*;
        let xs = _mm256_max_ps(_mm256_loadu_ps(x.as_ptr()), _mm256_set1_ps(EXP_LOWEST));
        let mut out = [0f32; LANES];
        for (half, h) in [_mm256_castps256_ps128(xs), _mm256_extractf128_ps::<1>(xs)].into_iter().enumerate() {
            let xd = _mm256_cvtps_pd(h);
            let n = _mm256_round_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_pd(
                xd,
                _mm256_set1_pd(EXP_LOG2E),
            ));
            let r = _mm256_fnmadd_pd(n, _mm256_set1_pd(EXP_LN2_HI), xd);
            let r = _mm256_fnmadd_pd(n, _mm256_set1_pd(EXP_LN2_LO), r);
            let mut p = _mm256_set1_pd(EXP_C[11]);
            for &c in EXP_C[..11].iter().rev() {
                p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(c));
            }
            let n = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n));
            let scale = _mm256_castsi256_pd(_mm256_slli_epi64::<52>(_mm256_add_epi64(n, _mm256_set1_epi64x(1023))));
            _mm_storeu_ps(out.as_mut_ptr().add(half * 4), _mm256_cvtpd_ps(_mm256_mul_pd(p, scale)));
        }
        out
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "fma", target_feature = "avx2")))]
    exp8_portable(x)
}

/// [`exp8`] without SIMD: the same operations one lane at a time.
#[cfg_attr(all(target_arch = "x86_64", target_feature = "fma", target_feature = "avx2"), allow(dead_code))]
fn exp8_portable(x: [f32; LANES]) -> [f32; LANES] {
    x.map(|x| {
        let xd = f64::from(x.max(EXP_LOWEST));
        let n = (xd * EXP_LOG2E).round_ties_even();
        let r = (-n).mul_add(EXP_LN2_LO, (-n).mul_add(EXP_LN2_HI, xd));
        let p = EXP_C[..11].iter().rev().fold(EXP_C[11], |p, &c| p.mul_add(r, c));
        (p * f64::from_bits(((n as i64 + 1023) as u64) << 52)) as f32
    })
}

/// Softmax in place: [`exp8`] of `x - max`, summed in position order. (A sum in lanes was tried;
/// it moved a near-tie in the tests' fixed greedy continuations.)
fn softmax(row: &mut [f32]) {
    // Max is exact in any order: eight lanes, then across them.
    let (chunks, rest) = row.as_chunks::<LANES>();
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for c in chunks {
        for l in 0..LANES {
            lanes[l] = if c[l] > lanes[l] { c[l] } else { lanes[l] };
        }
    }
    let max = lanes.iter().chain(rest).fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let (chunks, rest) = row.as_chunks_mut::<LANES>();
    for c in chunks {
        *c = exp8(c.map(|x| x - max));
    }
    if !rest.is_empty() {
        let mut tail = [f32::NEG_INFINITY; LANES]; // exp gives 0 there; discarded anyway
        tail[..rest.len()].copy_from_slice(rest);
        let e = exp8(tail.map(|x| x - max));
        rest.copy_from_slice(&e[..rest.len()]);
    }
    let sum: f32 = row.iter().fold(0.0, |s, &x| s + x);
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|x| *x *= inv);
}

/// One sequence's K or V rows for one KV head, in position order: [`PagedRows::runs`] yields,
/// block by block, the element offset of each block's first row and how many of its rows are
/// below `n`.
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

/// `out[s] = dot(q, K[s]) * scale` for consecutive key rows `s`, the first at element `off`.
fn qk_run(q: &[f32], keys: &[f32], off: usize, stride: usize, scale: f32, out: &mut [f32]) {
    let hd = q.len();
    let key = |s: usize| &keys[off + s * stride..off + s * stride + hd];
    let mut s = 0;
    while s + DOT_BATCH <= out.len() {
        let d = dot_batch(q, std::array::from_fn(|j| key(s + j)));
        for j in 0..DOT_BATCH {
            out[s + j] = d[j] * scale;
        }
        s += DOT_BATCH;
    }
    for (s, o) in out.iter_mut().enumerate().skip(s) {
        *o = dot(q, key(s)) * scale;
    }
}

/// `out += weights[s] * V[s]` for consecutive value rows `s`, the first at element `off`, added
/// in row order: called block after block, each element is summed in position order from 0.
/// Columns are taken [`TILE`] at a time, kept in registers.
fn weighted_run(weights: &[f32], values: &[f32], off: usize, stride: usize, out: &mut [f32]) {
    let (tiles, rest) = out.as_chunks_mut::<TILE>();
    for (t, tile) in tiles.iter_mut().enumerate() {
        let mut acc = *tile;
        for (s, &w) in weights.iter().enumerate() {
            let v: &[f32; TILE] = values[off + s * stride + t * TILE..][..TILE].try_into().expect("a whole tile");
            for c in 0..TILE {
                acc[c] = w.mul_add(v[c], acc[c]);
            }
        }
        *tile = acc;
    }
    let first = tiles.len() * TILE;
    for (s, &w) in weights.iter().enumerate() {
        let v = &values[off + s * stride + first..][..rest.len()];
        for (o, x) in rest.iter_mut().zip(v) {
            *o = w.mul_add(*x, *o);
        }
    }
}

/// The output of a step, written by many tasks at once, each to its own places.
struct DisjointOut {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: tasks only write through `slice`, whose contract keeps their regions apart.
unsafe impl Sync for DisjointOut {}

impl DisjointOut {
    /// SAFETY: no other live slice from this value may overlap `start..start + len`.
    #[allow(clippy::mut_from_ref)] // the caller's contract is what makes this sound
    unsafe fn slice(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(start + len <= self.len, "inside the output");
        // SAFETY: in bounds (asserted); exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

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

    for ((qt, kt), &(_, pos)) in q.chunks_mut(q_row).zip(k.chunks_mut(kv_row)).zip(&token_pos) {
        for h in qt.chunks_mut(hd).chain(kt.chunks_mut(hd)) {
            rope.apply(h, pos);
        }
    }

    for (t, &(r, pos)) in token_pos.iter().enumerate() {
        let off = slot_offset(rows[r].blocks, block_size, pos, kv_row);
        kv.k[off..off + kv_row].copy_from_slice(&k[t * kv_row..(t + 1) * kv_row]);
        kv.v[off..off + kv_row].copy_from_slice(&v[t * kv_row..(t + 1) * kv_row]);
    }

    let scale = shape.scale;
    let group = n_head / n_kv_head;
    let mut out = vec![0f32; q.len()];
    let kv = &*kv;
    // Tiles of up to QUERY_TILE consecutive tokens of one row: (row, first token index, tokens).
    let mut tiles = Vec::new();
    let mut t0 = 0;
    for (r, row) in rows.iter().enumerate() {
        for first in (0..row.tokens.len()).step_by(QUERY_TILE) {
            tiles.push((r, t0 + first, QUERY_TILE.min(row.tokens.len() - first)));
        }
        t0 += row.tokens.len();
    }
    let shared = DisjointOut { ptr: out.as_mut_ptr(), len: out.len() };
    // One task per (tile, KV head), the latest tiles (the most positions) first. The tile's
    // queries of every head in the group take each K/V block in turn while it is in cache.
    let task = |i: usize, scores: &mut Vec<f32>| {
        let (r, t0, m) = tiles[tiles.len() - 1 - i / n_kv_head];
        let g = i % n_kv_head;
        let p0 = token_pos[t0].1;
        let n_max = p0 + m;
        let paged = PagedRows { blocks: rows[r].blocks, block_size, stride: kv_row, head: g * hd };
        // Query j sees positions visible(p0 + j); of the block run (p, len), the part
        // (first, count) lies there, `first` counted from p.
        let part = |j: usize, p: usize, len: usize| {
            let (lo, hi) = shape.visible(p0 + j);
            let (a, b) = (p.max(lo), (p + len).min(hi));
            (a - p, b.saturating_sub(a))
        };
        scores.clear();
        scores.resize(m * group * n_max, 0.0);
        for (p, off, len) in paged.runs(n_max) {
            for j in 0..m {
                let (first, count) = part(j, p, len);
                if count == 0 {
                    continue;
                }
                for h in 0..group {
                    let qv = &q[(t0 + j) * q_row + (g * group + h) * hd..][..hd];
                    let row = &mut scores[(j * group + h) * n_max + p + first..][..count];
                    qk_run(qv, &kv.k, off + first * kv_row, kv_row, scale, row);
                }
            }
        }
        for j in 0..m {
            let (lo, hi) = shape.visible(p0 + j);
            for h in 0..group {
                softmax(&mut scores[(j * group + h) * n_max + lo..][..hi - lo]);
            }
        }
        for (p, off, len) in paged.runs(n_max) {
            for j in 0..m {
                let (first, count) = part(j, p, len);
                if count == 0 {
                    continue;
                }
                for h in 0..group {
                    // SAFETY: head (g * group + h) of token t0 + j belongs to this task alone.
                    let o = unsafe { shared.slice((t0 + j) * q_row + (g * group + h) * hd, hd) };
                    let w = &scores[(j * group + h) * n_max + p + first..][..count];
                    weighted_run(w, &kv.v, off + first * kv_row, kv_row, o);
                }
            }
        }
    };
    // Small steps (decode) run on this thread: waking the pool costs more than the work.
    let seen = |p: usize| {
        let (lo, hi) = shape.visible(p);
        hi - lo
    };
    let work: usize = token_pos.iter().map(|&(_, p)| seen(p)).sum::<usize>() * n_head * hd;
    run_tasks(tiles.len() * n_kv_head, work >= PARALLEL_MIN_WORK, task);
    out
}

/// Run `f(i, scratch)` for every task `i`, in parallel on candle's matmul thread pool:
/// attention and matmuls then share one set of threads. (A second pool, such as rayon's, spins
/// beside candle's and oversubscribes the cores.)
fn run_tasks(n: usize, parallel: bool, f: impl Fn(usize, &mut Vec<f32>) + Sync) {
    if !parallel {
        let mut scratch = Vec::new();
        (0..n).for_each(|i| f(i, &mut scratch));
        return;
    }
    candle_core::utils::barrier_pool().execute_chunked(n, |range| {
        let mut scratch = Vec::new();
        range.for_each(|i| f(i, &mut scratch));
    });
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

    fn wave(n: usize, f: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32) * f).sin() * 3.0).collect()
    }

    #[test]
    fn a_batch_of_dots_is_bit_for_bit_dot() {
        for hd in [64, 67, 128] {
            let q = wave(hd, 0.37);
            let keys: Vec<Vec<f32>> = (0..DOT_BATCH).map(|j| wave(hd, 0.11 + j as f32 * 0.07)).collect();
            let got = dot_batch(&q, std::array::from_fn(|j| keys[j].as_slice()));
            for j in 0..DOT_BATCH {
                assert_eq!(got[j].to_bits(), dot(&q, &keys[j]).to_bits(), "hd {hd}, key {j}");
            }
        }
    }

    #[test]
    fn paged_kernels_sum_every_position_in_order_across_scattered_blocks() {
        use crate::kv_cache::BlockId;
        let (block_size, n_kv_head, hd) = (4, 2, 72);
        let stride = n_kv_head * hd;
        let blocks: Vec<BlockId> = [5, 0, 3, 7].map(BlockId::new).to_vec();
        let store = wave(8 * block_size * stride, 0.013);
        let (g, n) = (1, 14); // the second KV head; 14 positions end mid-block
        let paged = PagedRows { blocks: &blocks, block_size, stride, head: g * hd };
        let row = |p: usize| {
            let off = slot_offset(&blocks, block_size, p, stride) + g * hd;
            &store[off..off + hd]
        };
        let q = wave(hd, 0.29);
        let mut scores = vec![0.0; n];
        for (p, off, len) in paged.runs(n) {
            qk_run(&q, &store, off, stride, 0.5, &mut scores[p..p + len]);
        }
        for (p, s) in scores.iter().enumerate() {
            assert_eq!(s.to_bits(), (dot(&q, row(p)) * 0.5).to_bits(), "score of position {p}");
        }
        let mut out = vec![0.0; hd];
        for (p, off, len) in paged.runs(n) {
            weighted_run(&scores[p..p + len], &store, off, stride, &mut out);
        }
        let mut expected = vec![0f32; hd];
        for (p, w) in scores.iter().enumerate() {
            for (e, x) in expected.iter_mut().zip(row(p)) {
                *e = w.mul_add(*x, *e);
            }
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&out), bits(&expected));
    }

    /// Attention for `tokens` new tokens after `cached`, as one step or token by token, over
    /// `window` positions (None: all); keys and values before position `stale_before` are shifted
    /// (what a window must never see).
    fn attend_with(
        cached: usize,
        tokens: usize,
        one_by_one: bool,
        window: Option<usize>,
        stale_before: usize,
    ) -> Vec<f32> {
        use crate::kv_cache::BlockId;
        let heads = Heads { n_head: 6, n_kv_head: 2, head_dim: 64 };
        let (q_row, kv_row) = (6 * 64, 2 * 64);
        let shape = Attention { window, ..Attention::causal(heads) };
        let mut kv = LayerKv::new(16, 4, heads);
        let blocks: Vec<BlockId> = [9, 2, 14, 0, 5, 11, 3, 7, 1, 12].map(BlockId::new).to_vec();
        let rope = Rope::new(RopeStyle::Halves, 64, 10000.0, 64);
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

    fn attend(cached: usize, tokens: usize, one_by_one: bool) -> Vec<f32> {
        attend_with(cached, tokens, one_by_one, None, 0)
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
    fn a_sliding_window_hides_what_lies_before_it_and_keeps_chunks_exact() {
        // The last of 40 positions, window 9: positions 31..=39 are visible, 0..31 are not.
        let (cached, tokens, window) = (39, 1, Some(9));
        let windowed = attend_with(cached, tokens, false, window, 0);
        assert_eq!(bits(&windowed), bits(&attend_with(cached, tokens, false, window, 31)), "stale keys were read");
        assert_ne!(bits(&windowed), bits(&attend_with(cached, tokens, false, window, 32)), "a visible key was skipped");
        assert_ne!(bits(&windowed), bits(&attend(cached, tokens, false)), "the window changed nothing");
        // Every query of a chunk (tiles spanning window edges and blocks) as if alone.
        let w = Some(6);
        assert_eq!(bits(&attend_with(5, 35, false, w, 0)), bits(&attend_with(5, 35, true, w, 0)));
        // A window wider than the sequence is plain causal attention.
        assert_eq!(bits(&attend_with(5, 35, false, Some(64), 0)), bits(&attend(5, 35, false)));
    }

    #[test]
    fn exp8_agrees_with_libm_to_one_ulp_and_underflows_to_zero() {
        // Every 997th float in [-104, 0]; the full sweep is in exp8's doc.
        let (mut bits, mut differ, mut total) = (0x8000_0000u32, 0, 0);
        loop {
            let xs: [f32; LANES] = std::array::from_fn(|l| f32::from_bits(bits + l as u32 * 997));
            if xs[LANES - 1] < -104.0 {
                break;
            }
            for (got, x) in exp8(xs).iter().zip(xs) {
                let ulps = (got.to_bits() as i64 - x.exp().to_bits() as i64).abs();
                assert!(ulps <= 1, "exp({x}) = {got}, libm {}", x.exp());
                differ += usize::from(ulps > 0);
                total += 1;
            }
            bits += LANES as u32 * 997;
        }
        assert!(differ * 1000 < total, "{differ} of {total} differ from libm");
        assert_eq!(exp8([f32::NEG_INFINITY; LANES]), [0.0; LANES]);
        let xs: [f32; LANES] = std::array::from_fn(|l| -(l as f32) * 13.37 - 0.123);
        assert_eq!(exp8(xs).map(f32::to_bits), exp8_portable(xs).map(f32::to_bits), "the portable path's bits");
        assert_eq!(exp8([0.0; LANES]), [1.0; LANES]);
    }

    /// Every float in [-104, 0] (1.12 billion; seconds in release): the count in [`exp8`]'s doc.
    /// `cargo test --release -p bellows-worker --lib exp8_on_every_float -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn exp8_on_every_float_is_within_one_ulp_of_libm() {
        let (mut bits, mut differ, mut total) = (0x8000_0000u32, 0u64, 0u64);
        while f32::from_bits(bits + LANES as u32 - 1) >= -104.0 {
            let xs: [f32; LANES] = std::array::from_fn(|l| f32::from_bits(bits + l as u32));
            for (got, x) in exp8(xs).iter().zip(xs) {
                let ulps = (got.to_bits() as i64 - x.exp().to_bits() as i64).abs();
                assert!(ulps <= 1, "exp({x}) = {got}, libm {}", x.exp());
                differ += u64::from(ulps > 0);
                total += 1;
            }
            bits += LANES as u32;
        }
        eprintln!("exp8 differs from libm on {differ} of {total} floats in [-104, 0], by one ulp");
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
    fn dot_matches_naive_sum_closely() {
        let a: Vec<f32> = (0..67).map(|i| (i as f32).sin()).collect();
        let b: Vec<f32> = (0..67).map(|i| (i as f32).cos()).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-4);
    }
}
