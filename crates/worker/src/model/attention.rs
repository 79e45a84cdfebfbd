//! Rotary embedding and causal attention over a paged KV cache, on host memory.
//!
//! Every query's scores are summed in position order 0..=pos, whatever the batch or chunk it came
//! in: that fixed order is what makes a request's output independent of chunk size and of its
//! batch neighbours (bit-exact, not merely close). Work is split across threads by (token, KV
//! head), which changes who computes a value, never the order of its sums.

use super::BatchRow;

/// Below this many multiply-adds a step's attention runs on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 18;

/// How the model pairs dimensions for rotary embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (x[2i], x[2i+1]): GGUF llama (weights were permuted at conversion).
    Interleaved,
    /// Halves (x[i], x[i + d/2]): GGUF qwen2 (GPT-NeoX style).
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

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent lanes in a fixed order: one AVX register, and deterministic.
    let mut acc = [0f32; 8];
    let (ac, ar) = a.as_chunks::<8>();
    let (bc, br) = b.as_chunks::<8>();
    for (x, y) in ac.iter().zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = (acc[0] + acc[4]) + (acc[1] + acc[5]) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// Apply rotary embedding to q and k, store k and v in the paged cache, then compute causal
/// attention for every new token. `q` is `[tokens][n_head*head_dim]`, `k`/`v` are
/// `[tokens][n_kv_head*head_dim]`, rows concatenated in batch order. Returns `[tokens][n_head*head_dim]`.
pub fn paged_attention(
    rows: &[BatchRow<'_>],
    q: &mut [f32],
    k: &mut [f32],
    v: &[f32],
    kv: &mut LayerKv,
    heads: Heads,
    rope: &Rope,
) -> Vec<f32> {
    let Heads { n_head, n_kv_head, head_dim: hd } = heads;
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

    let scale = 1.0 / (hd as f32).sqrt();
    let group = n_head / n_kv_head;
    let mut out = vec![0f32; q.len()];
    let kv = &*kv;
    // One task per (token, KV head): the query heads sharing that KV head read each K/V row once.
    let task = |i: usize, o: &mut [f32], scores: &mut Vec<f32>| {
        let (t, g) = (i / n_kv_head, i % n_kv_head);
        let (r, pos) = token_pos[t];
        let n = pos + 1;
        let qs = &q[t * q_row + g * group * hd..t * q_row + (g + 1) * group * hd];
        scores.clear();
        scores.resize(group * n, 0.0);
        // Walk the sequence's blocks in position order; rows within a block are contiguous.
        let visit = |f: &mut dyn FnMut(usize, usize)| {
            let mut p = 0;
            for b in rows[r].blocks {
                if p >= n {
                    break;
                }
                let base = b.index() * block_size * kv_row + g * hd;
                for s in 0..block_size.min(n - p) {
                    f(p + s, base + s * kv_row);
                }
                p += block_size;
            }
        };
        visit(&mut |p, off| {
            let k = &kv.k[off..off + hd];
            for (qh, qv) in qs.chunks_exact(hd).enumerate() {
                scores[qh * n + p] = dot(qv, k) * scale;
            }
        });
        for row in scores.chunks_exact_mut(n) {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let mut sum = 0f32;
            for x in row.iter_mut() {
                *x = (*x - max).exp();
                sum += *x;
            }
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|x| *x *= inv);
        }
        visit(&mut |p, off| {
            let v = &kv.v[off..off + hd];
            for (qh, oh) in o.chunks_exact_mut(hd).enumerate() {
                let w = scores[qh * n + p];
                for (o, x) in oh.iter_mut().zip(v) {
                    *o += w * x;
                }
            }
        });
    };
    // Small steps (decode) run on this thread: waking the pool costs more than the work.
    let work: usize = token_pos.iter().map(|&(_, p)| p + 1).sum::<usize>() * n_head * hd;
    for_each_chunk(&mut out, group * hd, work >= PARALLEL_MIN_WORK, task);
    out
}

/// Run `f(i, chunk i, scratch)` over the `width`-wide chunks of `out`, in parallel on candle's
/// matmul thread pool: attention and matmuls then share one set of threads. (A second pool, such
/// as rayon's, spins beside candle's and oversubscribes the cores.)
fn for_each_chunk(out: &mut [f32], width: usize, parallel: bool, f: impl Fn(usize, &mut [f32], &mut Vec<f32>) + Sync) {
    if !parallel {
        let mut scratch = Vec::new();
        for (i, c) in out.chunks_mut(width).enumerate() {
            f(i, c, &mut scratch);
        }
        return;
    }
    let n = out.len() / width;
    let base = out.as_mut_ptr() as usize;
    candle_core::utils::barrier_pool().execute_chunked(n, |range| {
        let mut scratch = Vec::new();
        for i in range {
            // SAFETY: execute_chunked hands each index to exactly one thread, so chunk i has one
            // writer; `out` outlives the call, which returns only when every worker is done.
            let chunk = unsafe { std::slice::from_raw_parts_mut((base as *mut f32).add(i * width), width) };
            f(i, chunk, &mut scratch);
        }
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

    #[test]
    fn dot_matches_naive_sum_closely() {
        let a: Vec<f32> = (0..67).map(|i| (i as f32).sin()).collect();
        let b: Vec<f32> = (0..67).map(|i| (i as f32).cos()).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-4);
    }
}
