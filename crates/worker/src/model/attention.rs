//! Rotary embedding and causal attention over a paged KV cache, on host memory.
//!
//! Every query's scores are summed in position order 0..=pos, whatever the batch or chunk it came
//! in: that fixed order is what makes a request's output independent of chunk size and of its
//! batch neighbours (bit-exact, not merely close). Work is split across threads by (token, head),
//! which changes who computes a value, never the order of its sums.

use rayon::prelude::*;

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
        let (c, s) = (
            &self.cos[pos * self.half..(pos + 1) * self.half],
            &self.sin[pos * self.half..(pos + 1) * self.half],
        );
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
}

impl LayerKv {
    pub fn new(num_blocks: usize, block_size: usize, heads: Heads) -> Self {
        let n = num_blocks * block_size * heads.n_kv_head * heads.head_dim;
        LayerKv { k: vec![0.0; n], v: vec![0.0; n] }
    }
}

/// Where a position of a row lives in the paged store (element offset of its K/V vector row).
#[inline]
fn slot_offset(blocks: &[crate::kv_cache::BlockId], block_size: usize, pos: usize, row: usize) -> usize {
    (blocks[pos / block_size].index() * block_size + pos % block_size) * row
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent lanes in a fixed order: vectorizes, and stays deterministic.
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s = (acc[0] + acc[4]) + (acc[1] + acc[5]) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
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
    block_size: usize,
    heads: Heads,
    rope: &Rope,
) -> Vec<f32> {
    let Heads { n_head, n_kv_head, head_dim: hd } = heads;
    let (q_row, kv_row) = (n_head * hd, n_kv_head * hd);

    // Token index -> (row, position): flat list so threads can take any token.
    let mut token_pos = Vec::with_capacity(q.len() / q_row);
    for (r, row) in rows.iter().enumerate() {
        for p in row.start_pos..row.end_pos() {
            token_pos.push((r, p));
        }
    }

    // Small steps (decode) run on this thread: waking the pool costs more than the work, and
    // spinning workers hurt badly when cores are shared.
    let work: usize = token_pos.iter().map(|&(_, p)| p + 1).sum::<usize>() * n_head * hd;
    let parallel = work >= PARALLEL_MIN_WORK;

    let rotate = |(qt, kt): (&mut [f32], &mut [f32]), pos: usize| {
        for h in qt.chunks_mut(hd) {
            rope.apply(h, pos);
        }
        for h in kt.chunks_mut(hd) {
            rope.apply(h, pos);
        }
    };
    if parallel {
        q.par_chunks_mut(q_row)
            .zip(k.par_chunks_mut(kv_row))
            .zip(&token_pos)
            .for_each(|(qk, &(_, pos))| rotate(qk, pos));
    } else {
        q.chunks_mut(q_row).zip(k.chunks_mut(kv_row)).zip(&token_pos).for_each(|(qk, &(_, pos))| rotate(qk, pos));
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
    let head = |scores: &mut Vec<f32>, (i, o): (usize, &mut [f32])| {
        let (t, h) = (i / n_head, i % n_head);
        let (r, pos) = token_pos[t];
        let blocks = rows[r].blocks;
        let qh = &q[t * q_row + h * hd..t * q_row + (h + 1) * hd];
        let kvh = h / group;
        scores.clear();
        let mut max = f32::NEG_INFINITY;
        for p in 0..=pos {
            let off = slot_offset(blocks, block_size, p, kv_row) + kvh * hd;
            let s = dot(qh, &kv.k[off..off + hd]) * scale;
            max = max.max(s);
            scores.push(s);
        }
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        for (p, s) in scores.iter().enumerate() {
            let off = slot_offset(blocks, block_size, p, kv_row) + kvh * hd;
            let w = s * inv;
            for (o, x) in o.iter_mut().zip(&kv.v[off..off + hd]) {
                *o += w * x;
            }
        }
    };
    if parallel {
        out.par_chunks_mut(hd).enumerate().for_each_init(Vec::new, head);
    } else {
        let mut scores = Vec::new();
        out.chunks_mut(hd).enumerate().for_each(|x| head(&mut scores, x));
    }
    out
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
