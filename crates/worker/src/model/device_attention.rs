//! Paged attention over a KV pool held as tensors on the model's device, in candle's
//! device-generic ops: the path a GPU worker runs, and the very same code on the CPU, where the
//! tests hold it to the host kernel (`attention.rs`).
//!
//! Why: the host kernel needs q, k and v in host memory; on a GPU that is a device-to-host copy
//! in every layer of every step, slower than the CPU build. Here the pool is one K and one V
//! tensor per layer on the device, `[slots, kv_heads * head_dim]`, where slot
//! `block * block_size + i` holds position `i` of that block. The block ids the scheduler's
//! `BlockPool` hands out address it directly, so refcounts, prefix hashes, eviction and KV events
//! do not care where the storage lives. Only the sampled rows' logits leave the device.
//!
//! A step: rotary embedding of q and k (the table gathered at each token's position), one scatter
//! per layer writing the step's keys and values to their slots, then attention by groups: every
//! decoding row (one new token) together, its keys gathered and padded to the longest context
//! and masked; each prefill chunk alone, under a causal mask. Slots, positions and masks depend
//! only on the rows, so they are built once per step ([`StepPlan`]) and uploaded once for all
//! layers.
//!
//! Exactness: the host kernel sums every query's scores in position order, so its results do not
//! depend on batch or chunk. Here sums run in the order the device's matmul picks (cuBLAS
//! chooses by shape), so a row's output can move in the last bits with the batch around it. The
//! tests hold this path to the host kernel within a stated tolerance, and greedy decoding on the
//! real model to the same tokens.

use candle_core::{DType, Device, Result, Tensor};

use super::{
    BatchRow,
    attention::{Attention, Heads, Rope, RopeStyle},
};

/// One layer's K and V pool on the device: `[num_blocks * block_size, n_kv_head * head_dim]`.
pub struct DeviceKv {
    k: Tensor,
    v: Tensor,
}

impl DeviceKv {
    pub fn new(num_blocks: usize, block_size: usize, heads: Heads, device: &Device) -> Result<Self> {
        let shape = (num_blocks * block_size, heads.n_kv_head * heads.head_dim);
        Ok(DeviceKv { k: Tensor::zeros(shape, DType::F32, device)?, v: Tensor::zeros(shape, DType::F32, device)? })
    }
}

/// A rope table on the device: cos and sin `[positions, head_dim / 2]`, the host table's values.
pub struct DeviceRope {
    style: RopeStyle,
    cos: Tensor,
    sin: Tensor,
}

impl DeviceRope {
    pub fn new(rope: &Rope, device: &Device) -> Result<Self> {
        let (style, half, cos, sin) = rope.tables();
        let positions = cos.len() / half;
        Ok(DeviceRope {
            style,
            cos: Tensor::from_slice(cos, (positions, half), device)?,
            sin: Tensor::from_slice(sin, (positions, half), device)?,
        })
    }

    /// The table's rows at a step's token positions (`[tokens]`).
    fn at(&self, positions: &Tensor) -> Result<StepRope> {
        let (tokens, half) = (positions.dim(0)?, self.cos.dim(1)?);
        // Each token its own batch entry: candle's rope takes a cos/sin table per batch entry.
        Ok(StepRope {
            style: self.style,
            cos: self.cos.index_select(positions, 0)?.reshape((tokens, 1, half))?,
            sin: self.sin.index_select(positions, 0)?.reshape((tokens, 1, half))?,
        })
    }
}

/// One rope table's cos and sin at each token of a step (`[tokens, 1, head_dim / 2]`): gathered
/// once a step, used by every layer that takes the table.
pub struct StepRope {
    style: RopeStyle,
    cos: Tensor,
    sin: Tensor,
}

impl StepRope {
    /// Rotate every head of `x` (`[tokens, heads * head_dim]`) at its token's position.
    fn apply(&self, x: &Tensor, head_dim: usize) -> Result<Tensor> {
        let (tokens, width) = x.dims2()?;
        let heads = x.contiguous()?.reshape((tokens, width / head_dim, 1, head_dim))?;
        let rotated = match self.style {
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&heads, &self.cos, &self.sin)?,
            RopeStyle::Halves => candle_nn::rotary_emb::rope(&heads, &self.cos, &self.sin)?,
        };
        rotated.reshape((tokens, width))
    }
}

/// Which of the step's tokens a group attends for.
enum Queries {
    /// A prefill chunk: `len` consecutive tokens from `start`.
    Run { start: usize, len: usize },
    /// Decoding rows: one token each, picked by index.
    Picked(Tensor),
}

/// Rows attended together: `rows` rows of `queries` new tokens each, over `keys` positions
/// (padded to the longest row; the mask hides the padding).
struct Group {
    queries_of: Queries,
    rows: usize,
    queries: usize,
    keys: usize,
    /// The slot of each row's positions `0..keys`, `[rows * keys]` (padding points at a slot of
    /// the row's own, masked out).
    gather: Tensor,
    /// For each window a layer may have: 0 where a query sees a position, -inf elsewhere,
    /// `[rows, queries, keys]`.
    masks: Vec<(Option<usize>, Tensor)>,
}

impl Group {
    /// Build a group from rows, each given as (row, index of its first token in the step).
    fn new(
        members: &[(&BatchRow<'_>, usize)],
        block_size: usize,
        windows: &[Option<usize>],
        device: &Device,
    ) -> Result<Self> {
        let queries = members[0].0.tokens.len();
        debug_assert!(members.iter().all(|(r, _)| r.tokens.len() == queries), "a group's rows are alike");
        let keys = members.iter().map(|(r, _)| r.end_pos()).max().unwrap_or(0);
        let mut gather = Vec::with_capacity(members.len() * keys);
        for (row, _) in members {
            gather.extend((0..keys).map(|p| slot(row, block_size, p.min(row.end_pos() - 1))));
        }
        let masks = windows
            .iter()
            .map(|&window| {
                let mut mask = Vec::with_capacity(members.len() * queries * keys);
                for (row, _) in members {
                    for pos in row.start_pos..row.end_pos() {
                        let (lo, hi) = Attention::visible_with(window, pos);
                        mask.extend((0..keys).map(|p| if (lo..hi).contains(&p) { 0.0 } else { f32::NEG_INFINITY }));
                    }
                }
                Ok((window, Tensor::from_vec(mask, (members.len(), queries, keys), device)?))
            })
            .collect::<Result<_>>()?;
        let queries_of = match members {
            [(row, start)] => Queries::Run { start: *start, len: row.tokens.len() },
            _ => {
                let picked: Vec<u32> = members.iter().map(|(_, t)| *t as u32).collect();
                Queries::Picked(Tensor::from_vec(picked, members.len(), device)?)
            }
        };
        let n = members.len();
        Ok(Group { queries_of, rows: n, queries, keys, gather: Tensor::from_vec(gather, n * keys, device)?, masks })
    }

    fn mask(&self, window: Option<usize>) -> Result<&Tensor> {
        match self.masks.iter().find(|(w, _)| *w == window) {
            Some((_, m)) => Ok(m),
            None => candle_core::bail!("no mask was planned for window {window:?}"),
        }
    }

    /// Attention of this group's queries: `[rows * queries, n_head * head_dim]`.
    fn attend(&self, q: &Tensor, kv: &DeviceKv, shape: Attention) -> Result<Tensor> {
        let Heads { n_head, n_kv_head, head_dim } = shape.heads;
        let group = n_head / n_kv_head;
        let (r, n, l) = (self.rows, self.queries, self.keys);
        let q = match &self.queries_of {
            Queries::Run { start, len } => q.narrow(0, *start, *len)?,
            Queries::Picked(ix) => q.index_select(ix, 0)?,
        };
        // [rows, kv_head, group * queries, head_dim]: a KV head's queries side by side.
        let q = q.reshape((r, n, n_kv_head, group, head_dim))?.permute((0, 2, 3, 1, 4))?.contiguous()?.reshape((
            r,
            n_kv_head,
            group * n,
            head_dim,
        ))?;
        let gathered = |pool: &Tensor| -> Result<Tensor> {
            pool.index_select(&self.gather, 0)?.reshape((r, l, n_kv_head, head_dim))?.transpose(1, 2)?.contiguous()
        };
        let (k, v) = (gathered(&kv.k)?, gathered(&kv.v)?);
        let scores = (q.matmul(&k.t()?)? * f64::from(shape.scale))?;
        let mask = self.mask(shape.window)?.reshape((r, 1, 1, n, l))?;
        let scores = scores.reshape((r, n_kv_head, group, n, l))?.broadcast_add(&mask)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.reshape((r, n_kv_head, group * n, l))?;
        let out = probs.matmul(&v)?.reshape((r, n_kv_head, group, n, head_dim))?;
        out.permute((0, 3, 1, 2, 4))?.contiguous()?.reshape((r * n, n_head * head_dim))
    }
}

/// The slot holding position `pos` of `row`.
fn slot(row: &BatchRow<'_>, block_size: usize, pos: usize) -> u32 {
    (row.blocks[pos / block_size].index() * block_size + pos % block_size) as u32
}

/// Everything about a step that every layer shares: built once, on the device.
pub struct StepPlan {
    /// Each rope table of the model at the step's token positions, in the model's order.
    ropes: Vec<StepRope>,
    /// Each new token's slot, repeated across its KV row (`[tokens, kv width]`: a scatter takes
    /// an index of its source's shape).
    write: Tensor,
    groups: Vec<Group>,
    /// Where each token's output lies in the groups' concatenated outputs; None when in order.
    order: Option<Tensor>,
}

impl StepPlan {
    /// The plan for `rows`, with masks for each window a layer of the model has and the rows of
    /// each of its rope tables.
    pub fn new(
        rows: &[BatchRow<'_>],
        block_size: usize,
        heads: Heads,
        windows: &[Option<usize>],
        ropes: &[DeviceRope],
        device: &Device,
    ) -> Result<Self> {
        let kv_width = heads.n_kv_head * heads.head_dim;
        let (mut positions, mut write) = (Vec::new(), Vec::new());
        let (mut decoding, mut chunks) = (Vec::new(), Vec::new());
        for row in rows {
            let first = positions.len();
            for pos in row.start_pos..row.end_pos() {
                positions.push(pos as u32);
                write.extend(std::iter::repeat_n(slot(row, block_size, pos), kv_width));
            }
            match row.tokens.len() {
                0 => {}
                1 => decoding.push((row, first)),
                _ => chunks.push((row, first)),
            }
        }
        let n_tok = positions.len();
        let mut groups = Vec::with_capacity(chunks.len() + 1);
        if !decoding.is_empty() {
            groups.push(Group::new(&decoding, block_size, windows, device)?);
        }
        for chunk in &chunks {
            groups.push(Group::new(std::slice::from_ref(chunk), block_size, windows, device)?);
        }
        // The groups' outputs come decoding rows first, then the chunks: token t's output is at
        // `order[t]` of their concatenation.
        let mut order = vec![0u32; n_tok];
        let concatenated = decoding
            .iter()
            .map(|(_, t)| *t)
            .chain(chunks.iter().flat_map(|(row, first)| *first..*first + row.tokens.len()));
        for (at, t) in concatenated.enumerate() {
            order[t] = at as u32;
        }
        let in_order = order.iter().enumerate().all(|(t, &at)| at as usize == t);
        let positions = Tensor::from_vec(positions, n_tok, device)?;
        Ok(StepPlan {
            ropes: ropes.iter().map(|r| r.at(&positions)).collect::<Result<_>>()?,
            write: Tensor::from_vec(write, (n_tok, kv_width), device)?,
            groups,
            order: if in_order { None } else { Some(Tensor::from_vec(order, n_tok, device)?) },
        })
    }

    /// Rope table `i` of the model (as given to [`StepPlan::new`]) at this step's positions.
    pub fn rope(&self, i: usize) -> &StepRope {
        &self.ropes[i]
    }
}

/// Apply rotary embedding to q and k, store k and v in their slots of the pool, then attend for
/// every new token (over its window, on a sliding-window layer). `q` is `[tokens, n_head *
/// head_dim]`, `k` and `v` `[tokens, n_kv_head * head_dim]`, rows in batch order; the result is
/// `[tokens, n_head * head_dim]`, on the device.
pub fn paged_attention_on_device(
    plan: &StepPlan,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    kv: &DeviceKv,
    shape: Attention,
    rope: &StepRope,
) -> Result<Tensor> {
    let hd = shape.heads.head_dim;
    let q = rope.apply(q, hd)?;
    let k = rope.apply(k, hd)?;
    kv.k.scatter_set(&plan.write, &k, 0)?;
    kv.v.scatter_set(&plan.write, &v.contiguous()?, 0)?;
    let outs = plan.groups.iter().map(|g| g.attend(&q, kv, shape)).collect::<Result<Vec<_>>>()?;
    let out = Tensor::cat(&outs, 0)?;
    match &plan.order {
        Some(order) => out.index_select(order, 0),
        None => Ok(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        kv_cache::BlockId,
        model::attention::{LayerKv, paged_attention},
    };

    fn wave(n: usize, f: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32) * f).sin() * 3.0).collect()
    }

    /// The largest difference between two outputs, relative to the largest value.
    fn relative_gap(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    /// Steps of a ragged batch through both paths, each step's rows as (sequence, new tokens):
    /// the device path (on the GPU where the build has one) must give the host kernel's outputs
    /// within 1e-5 of their largest value.
    fn both_paths(heads: Heads, style: RopeStyle, window: Option<usize>, steps: &[Vec<(usize, usize)>]) {
        let device = crate::model::test_device();
        let block_size = 4;
        let shape = Attention { window, ..Attention::causal(heads) };
        let rope = Rope::new(style, heads.head_dim, 10000.0, 256);
        let device_rope = [DeviceRope::new(&rope, &device).unwrap()];
        let (mut host, pool) =
            (LayerKv::new(40, block_size, heads), DeviceKv::new(40, block_size, heads, &device).unwrap());
        // Three sequences on scattered, interleaved blocks.
        let tables: Vec<Vec<BlockId>> =
            (0..3).map(|s| (0..12).map(|b| BlockId::new(((b * 3 + s) * 7 % 36) as u32)).collect()).collect();
        let mut done = [0usize; 3];
        let ids = vec![0u32; 64];
        let (q_w, kv_w) = (heads.n_head * heads.head_dim, heads.n_kv_head * heads.head_dim);
        for (i, step) in steps.iter().enumerate() {
            let rows: Vec<BatchRow<'_>> = step
                .iter()
                .map(|&(s, n)| BatchRow {
                    tokens: &ids[..n],
                    start_pos: done[s],
                    blocks: &tables[s],
                    want_logits: true,
                })
                .collect();
            let n_tok: usize = step.iter().map(|(_, n)| n).sum();
            let f = 0.011 * (i + 1) as f32;
            let (q, k, v) = (wave(n_tok * q_w, f), wave(n_tok * kv_w, f * 1.7), wave(n_tok * kv_w, f * 2.3));
            let (mut hq, mut hk) = (q.clone(), k.clone());
            let expected = paged_attention(&rows, &mut hq, &mut hk, &v, &mut host, shape, &rope);
            let plan = StepPlan::new(&rows, block_size, heads, &[None, window], &device_rope, &device).unwrap();
            let t = |x: Vec<f32>, w: usize| Tensor::from_vec(x, (n_tok, w), &device).unwrap();
            let got =
                paged_attention_on_device(&plan, &t(q, q_w), &t(k, kv_w), &t(v, kv_w), &pool, shape, plan.rope(0))
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
            let gap = relative_gap(&expected, &got);
            assert!(gap < 1e-5, "step {i} ({step:?}): the device path is {gap} off the host kernel");
            for &(s, n) in step {
                done[s] += n;
            }
        }
    }

    /// Prefill chunks, then decoding mixed with a chunk, rows out of order.
    fn ragged_steps() -> Vec<Vec<(usize, usize)>> {
        vec![
            vec![(0, 9), (1, 3)],
            vec![(1, 1), (0, 1), (2, 14)],
            vec![(2, 1), (1, 6), (0, 1)],
            vec![(0, 1), (1, 1), (2, 1)],
            vec![(2, 12), (0, 1)],
        ]
    }

    #[test]
    fn the_device_path_attends_as_the_host_kernel_does_over_scattered_blocks() {
        let heads = Heads { n_head: 6, n_kv_head: 2, head_dim: 64 };
        for style in [RopeStyle::Interleaved, RopeStyle::Halves] {
            both_paths(heads, style, None, &ragged_steps());
        }
        // The default model's heads (SmolLM2: 9 over 3 KV heads of 64).
        both_paths(Heads { n_head: 9, n_kv_head: 3, head_dim: 64 }, RopeStyle::Interleaved, None, &ragged_steps());
        // No grouping (one query head per KV head), a head size no multiple of 8.
        both_paths(Heads { n_head: 2, n_kv_head: 2, head_dim: 38 }, RopeStyle::Halves, None, &ragged_steps());
    }

    #[test]
    fn the_device_path_hides_what_lies_before_a_sliding_window() {
        let heads = Heads { n_head: 4, n_kv_head: 1, head_dim: 32 };
        both_paths(heads, RopeStyle::Halves, Some(5), &ragged_steps());
    }

    #[test]
    fn a_decoding_row_is_not_changed_by_the_padding_of_a_longer_neighbour() {
        // Row 0 decodes at 3 positions beside row 1 at 30: its keys are padded to 30, masked.
        let heads = Heads { n_head: 2, n_kv_head: 1, head_dim: 16 };
        both_paths(heads, RopeStyle::Interleaved, None, &[vec![(0, 2), (1, 29)], vec![(1, 1), (0, 1)]]);
    }
}
