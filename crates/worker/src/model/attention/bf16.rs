//! Attention in bfloat16 arithmetic over a cache of bfloat16 keys and values
//! ([`super::KvDtype::Bf16`]). AVX-512 BF16's dot product (`vdpbf16ps`) multiplies two pairs of
//! bfloat16 into each f32 lane: twice the multiply-adds of an f32 fused multiply-add for the same
//! instruction (`bench --suite peak` on Zen 4: 235 against 121 GMAC/s). Queries, keys, values and the
//! softmax's weights are rounded to bfloat16; products are exact and every sum is f32, as
//! FlashAttention computes for bf16 models on GPUs.
//!
//! The invariant is the f32 path's: every sum runs in one fixed order whatever the chunk or the
//! batch, so a request's tokens do not depend on its neighbours. Each kernel gives the bits of the
//! plain loops here ([`dot`] for a score, [`weigh`] for an output), built on [`dp`], one lane of
//! the instruction (the tests check it against the CPU's); CPUs without AVX-512 BF16 run them.
//! A weight of zero adds nothing (`x + 0 == x`, and a sum from +0 is never -0), so the value
//! kernel takes every slot a tile's queries might see and lets the softmax's zeros mask the rest.
//!
//! Layouts put side by side what one lane multiplies: within a block, a KV head's keys lie as
//! `[d / 2][slot][2]` (two dimensions of a slot; sixteen slots to a register) and the values as
//! `[slot / 2][kv_head][head_dim][2]` (one element of two slots).

use std::{array::from_fn, ops::Range};

use half::{bf16, vec::HalfBitsVecExt};

use super::{Attention, BatchRow, Heads, Scratch, Step, Task, head_runs, run_slots};
use crate::kv_cache::BlockId;

/// Columns [`weigh_runs`]' AVX-512 kernel keeps in registers for each row: four of sixteen.
const COLS: usize = 64;

/// Two bfloat16 as one 32-bit lane: `lo` in the low half (the earlier element in memory).
#[inline(always)]
fn pair(lo: bf16, hi: bf16) -> u32 {
    u32::from(lo.to_bits()) | (u32::from(hi.to_bits()) << 16)
}

/// `x` rounded to bfloat16 (to nearest, ties to even).
#[inline(always)]
fn round(x: f32) -> bf16 {
    bf16::from_f32(x)
}

/// `xs` rounded to bfloat16 two to a lane, appended to `out`; an odd count's last lane pairs its
/// value with zero. (Subnormal values may round to zero on one path and not the other: [`dp`]
/// takes them as zero either way.)
fn push_pairs(xs: &[f32], out: &mut Vec<u32>) {
    #[cfg(target_arch = "x86_64")]
    if avx512bf16() {
        // SAFETY: AVX-512 F, BW, VL and BF16 are present (checked at run time).
        unsafe { push_pairs_avx512(xs, out) };
        return;
    }
    let (whole, last) = xs.as_chunks::<2>();
    out.extend(whole.iter().map(|&[a, b]| pair(round(a), round(b))));
    out.extend(last.iter().map(|&a| pair(round(a), bf16::ZERO)));
}

/// Which of the sixteen `f32` lanes from index `at` lie inside `inside`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn lanes_within(at: usize, inside: &Range<usize>) -> u16 {
    let lanes_to = |end: usize| (1u32 << end.saturating_sub(at).min(16)) - 1;
    (lanes_to(inside.end) & !lanes_to(inside.start)) as u16
}

/// [`push_pairs`] 32 values an instruction (`vcvtne2ps2bf16`: to nearest, ties to even).
///
/// SAFETY: the CPU has AVX-512 F, BW, VL and BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn push_pairs_avx512(xs: &[f32], out: &mut Vec<u32>) {
    use std::arch::x86_64::*;
    let lanes = xs.len().div_ceil(2);
    out.reserve(lanes);
    let all = 0..xs.len();
    // SAFETY: every load is masked to `xs`, every store to the `lanes` reserved above.
    unsafe {
        let (src, dst) = (xs.as_ptr(), out.as_mut_ptr().add(out.len()));
        for at in (0..xs.len()).step_by(32) {
            let a = _mm512_maskz_loadu_ps(lanes_within(at, &all), src.add(at));
            let b = _mm512_maskz_loadu_ps(lanes_within(at + 16, &all), src.add(at + 16));
            let packed: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(b, a));
            let stored = (u32::MAX >> (32 - (xs.len() - at).min(32).div_ceil(2))) as __mmask16;
            _mm512_mask_storeu_epi32(dst.add(at / 2).cast(), stored, packed);
        }
        out.set_len(out.len() + lanes);
    }
}

/// Lanes of [`exp_pairs`]' sum.
const SUM_LANES: usize = 16;

/// A softmax row's weights before their division by the sum, as pairs: `exp(x - max(seen))` of
/// the positions in `seen` (those its query sees), rounded to bfloat16 into `out` (the row's
/// pairs, every lane written: zero where nothing is seen); returns their sum. The weighted sums divide by it at the
/// end, as FlashAttention does. The weights are rounded to 8 bits of significand, so the
/// exponential is a polynomial ([`exp`]) rather than the f32 path's `expf`. The sum runs in
/// sixteen lanes, position `i` in lane `(i - base) % 16` from `base`, `seen.start` rounded down
/// to even: set by the query alone, not by the tile it came in.
fn exp_pairs(row: &[f32], seen: Range<usize>, out: &mut [u32]) -> f32 {
    assert!(seen.end <= row.len() && out.len() >= row.len().div_ceil(2), "the row's pairs");
    let max = crate::model::exp::max(&row[seen.clone()]);
    // The pairs the pass below does not reach.
    out[..seen.start / 2].fill(0);
    out[seen.end.div_ceil(2)..].fill(0);
    #[cfg(target_arch = "x86_64")]
    if avx512bf16() {
        // SAFETY: AVX-512 F, BW, VL and BF16 are present (checked at run time); the bounds
        // asserted above.
        return unsafe { exp_pairs_avx512(row, seen, max, out) };
    }
    exp_pairs_portable(row, seen, max, out)
}

/// [`exp_pairs`] on any CPU, value by value.
fn exp_pairs_portable(row: &[f32], seen: Range<usize>, max: f32, out: &mut [u32]) -> f32 {
    let base = seen.start & !1;
    let mut lanes = [0f32; SUM_LANES];
    let e = |i: usize| if seen.contains(&i) { exp(row[i] - max) } else { 0.0 };
    for i in (base..seen.end).step_by(2) {
        let (a, b) = (e(i), e(i + 1));
        lanes[(i - base) % SUM_LANES] += a;
        lanes[(i + 1 - base) % SUM_LANES] += b;
        out[i / 2] = pair(round(a), round(b));
    }
    fold_halves(lanes)
}

/// Below this, [`exp`] takes the exponential of this instead (about 1.6e-38: a weight of nothing
/// beside the largest, 1, and no subnormal on the way).
const EXP_FLOOR: f32 = -87.0;
/// ln 2 in two parts, the first with trailing zeros so `n * LN2_HI` is exact for `n` to 2^8.
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// Taylor's coefficients of e^r to r^6 (r within ±ln 2 / 2: the next term is under 1.2e-7).
const EXP_POLY: [f32; 7] = [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];

/// e^y for y at most 0: `y = n ln 2 + r`, `e^r` by [`EXP_POLY`], times 2^n.
fn exp(y: f32) -> f32 {
    let y = y.max(EXP_FLOOR);
    let n = (y * std::f32::consts::LOG2_E).round_ties_even();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, y));
    let p = EXP_POLY[1..].iter().fold(EXP_POLY[0], |p, &c| p.mul_add(r, c));
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Lane `l` plus lane `l + 8`, then `+ 4`, `+ 2`, `+ 1`: [`exp_pairs`]' fold.
fn fold_halves(mut lanes: [f32; SUM_LANES]) -> f32 {
    let mut width = SUM_LANES / 2;
    while width > 0 {
        for l in 0..width {
            lanes[l] += lanes[l + width];
        }
        width /= 2;
    }
    lanes[0]
}

/// [`exp_pairs`] 32 positions at a time: [`exp`] sixteen to a register, two registers to a
/// register of pairs.
///
/// SAFETY: the CPU has AVX-512 F, BW, VL and BF16; `seen.end <= row.len()`, and `out` holds
/// `row.len().div_ceil(2)` lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn exp_pairs_avx512(row: &[f32], seen: Range<usize>, max: f32, out: &mut [u32]) -> f32 {
    use std::arch::x86_64::*;
    let (max, floor, log2e) =
        (_mm512_set1_ps(max), _mm512_set1_ps(EXP_FLOOR), _mm512_set1_ps(std::f32::consts::LOG2_E));
    let (hi, lo) = (_mm512_set1_ps(-LN2_HI), _mm512_set1_ps(-LN2_LO));
    let exp16 = |x: __m512, mask: __mmask16| {
        let y = _mm512_max_ps(_mm512_sub_ps(x, max), floor);
        let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(y, log2e));
        let r = _mm512_fmadd_ps(k, lo, _mm512_fmadd_ps(k, hi, y));
        let e =
            EXP_POLY[1..].iter().fold(_mm512_set1_ps(EXP_POLY[0]), |e, &c| _mm512_fmadd_ps(e, r, _mm512_set1_ps(c)));
        let two_k = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)));
        _mm512_maskz_mul_ps(mask, e, _mm512_castsi512_ps(two_k))
    };
    let base = seen.start & !1;
    let mut sum = _mm512_setzero_ps();
    // SAFETY: loads are masked to `seen`, inside `row`; stores to the pairs of positions below
    // `seen.end` rounded up to even, inside `out` (the caller's contract).
    unsafe {
        for at in (base..seen.end).step_by(32) {
            let (ma, mb) = (lanes_within(at, &seen), lanes_within(at + 16, &seen));
            let a = exp16(_mm512_maskz_loadu_ps(ma, row.as_ptr().add(at)), ma);
            let b = exp16(_mm512_maskz_loadu_ps(mb, row.as_ptr().add(at + 16)), mb);
            sum = _mm512_add_ps(_mm512_add_ps(sum, a), b);
            let packed: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(b, a));
            let stored = (u32::MAX >> (32 - (seen.end - at).min(32).div_ceil(2))) as __mmask16;
            _mm512_mask_storeu_epi32(out.as_mut_ptr().add(at / 2).cast(), stored, packed);
        }
        let mut lanes = [0f32; SUM_LANES];
        _mm512_storeu_ps(lanes.as_mut_ptr(), sum);
        fold_halves(lanes)
    }
}

/// One lane of `vdpbf16ps`: `acc + a.hi × b.hi`, then plus `a.lo × b.lo`, each product exact (eight
/// bits of significand by eight fit f32's) and each sum rounded to nearest; subnormal inputs and
/// results count as zero (the instruction's DAZ and FTZ).
#[inline(always)]
fn dp(acc: f32, a: u32, b: u32) -> f32 {
    let flush = |x: f32| if x.is_subnormal() { 0f32.copysign(x) } else { x };
    let half = |x: u32, shift: u32| flush(f32::from_bits(((x >> shift) & 0xffff) << 16));
    let acc = flush(half(a, 16).mul_add(half(b, 16), acc));
    flush(half(a, 0).mul_add(half(b, 0), acc))
}

/// Lane sums of a score: pair `j` of dimensions goes to lane `j % SCORE_LANES` (two: with six
/// rows of queries, twelve independent sums, enough to hide the dot product's latency).
const SCORE_LANES: usize = 2;

/// A score (unscaled): query pairs `q` against the key whose pair `j` is `key(j)`, stepped with
/// [`dp`] in [`SCORE_LANES`] lanes in order, then added.
fn dot(q: &[u32], key: impl Fn(usize) -> u32) -> f32 {
    let mut acc = [0f32; SCORE_LANES];
    for (j, &q) in q.iter().enumerate() {
        acc[j % SCORE_LANES] = dp(acc[j % SCORE_LANES], key(j), q);
    }
    acc[0] + acc[1]
}

/// Whether this CPU runs AVX-512 BF16 (with the F, BW and VL the kernels also use).
#[cfg(target_arch = "x86_64")]
#[inline]
fn avx512bf16() -> bool {
    use std::arch::is_x86_feature_detected as has;
    super::avx512() && has!("avx512bf16")
}

/// One layer's keys and values as bfloat16, laid out as the module says.
pub(super) struct Plane {
    k: Vec<bf16>,
    v: Vec<bf16>,
}

impl Plane {
    /// Zeroed allocations: the pages are mapped when first written, not here.
    pub(super) fn new(elements: usize) -> Self {
        Plane { k: vec![0u16; elements].reinterpret_into(), v: vec![0u16; elements].reinterpret_into() }
    }

    /// Store a position's keys and values (`[kv_head][head_dim]` each, head sizes even) in `slot`
    /// of `block` (of `bs` slots, even).
    pub(super) fn write(&mut self, bs: usize, block: BlockId, slot: usize, k: &[f32], v: &[f32]) {
        let at = block.index() * bs * v.len()..(block.index() + 1) * bs * v.len();
        Self::write_slot(&mut self.k[at.clone()], &mut self.v[at], bs, slot, k, v);
    }

    /// One position's keys and values into `slot` of one block's keys and values (`bs` slots).
    pub(super) fn write_slot(keys: &mut [bf16], values: &mut [bf16], bs: usize, slot: usize, k: &[f32], v: &[f32]) {
        let row = v.len();
        let values = &mut values[slot / 2 * 2 * row..][..2 * row];
        for (e, &x) in v.iter().enumerate() {
            values[2 * e + slot % 2] = round(x);
        }
        // Dimension d of every head: the heads' matrices one after another, pair d / 2.
        for (d, &x) in k.iter().enumerate() {
            keys[(d & !1) * bs + 2 * slot + d % 2] = round(x);
        }
    }

    /// The keys and the values, each `[block][bs × row]`.
    pub(super) fn planes_mut(&mut self) -> (&mut [bf16], &mut [bf16]) {
        (&mut self.k, &mut self.v)
    }
}

/// [`super::attend`] in bfloat16: the same tasks, tiles and walk over the key blocks; queries
/// rounded to pairs once a step, each task's weights once after its scores
/// ([`Weights::of_scores`]). A task weighs every block its tile's queries may see in one span,
/// two tokens' heads sharing each value load (zero weights mask what a query does not see),
/// then divides each output by its softmax's sum.
pub(super) fn attend(
    rows: &[BatchRow<'_>],
    q: &[f32],
    token_pos: &[(usize, usize)],
    kv: &Plane,
    block_size: usize,
    shape: Attention,
) -> Vec<f32> {
    let Heads { n_head, head_dim: hd, .. } = shape.heads;
    let (q_row, group, scale) = (n_head * hd, shape.heads.group(), shape.scale);
    let mut pairs = Vec::with_capacity(q.len() / 2);
    push_pairs(q, &mut pairs);
    let mut out = Vec::<f32>::with_capacity(token_pos.len() * q_row);
    let step = Step::new(rows, token_pos, shape, block_size, &mut out);
    step.run(|i, Scratch { scores, span, pairs: weights, sums }| {
        let task = step.task(i);
        let (m, n_max) = (task.m, task.n_max);
        let tile = Tile { q: &pairs, first: task.first / 2, q_row: q_row / 2, pairs: hd / 2, group, n_max };
        task.clear_scores(scores);
        task.score_blocks(
            &kv.k,
            None::<&[bf16]>,
            scores,
            |blocks, p, len, scores| {
                for (b, keys) in blocks.iter().enumerate() {
                    let slots = run_slots(len, block_size, b);
                    tile.scores(0..m, keys, block_size, p + b * block_size, slots, scale, scores);
                }
            },
            |j, keys, p, slots, scores| tile.scores(j..j + 1, keys, block_size, p, slots, scale, scores),
        );
        let weights = Weights::of_scores(&task, scores, weights, sums);
        weights.weigh(&step, &task, &kv.v, span);
    });
    // SAFETY: as in `super::attend`: every (token, head) zeroed, then added into, by its task.
    unsafe { out.set_len(token_pos.len() * q_row) };
    out
}

/// A task's softmax weights before their division, as pairs of positions from `from` (the first
/// block any of its queries sees), `row_pairs` lanes a score row; and each row's sum.
struct Weights<'a> {
    pairs: &'a [u32],
    sums: &'a [f32],
    from: usize,
    row_pairs: usize,
}

impl<'a> Weights<'a> {
    /// The weights of the task's score rows ([`exp_pairs`] for each), in `pairs` and `sums`.
    fn of_scores(task: &Task<'_>, scores: &[f32], pairs: &'a mut Vec<u32>, sums: &'a mut Vec<f32>) -> Self {
        let (shape, n_max) = (task.step.shape, task.n_max);
        let (lo, _) = shape.visible(task.p0);
        let from = lo - lo % task.step.block_size;
        let row_pairs = (n_max - from).div_ceil(2);
        let group = shape.heads.group();
        // Every lane is written below (no zeroing of the whole buffer first).
        pairs.resize(task.m * group * row_pairs, 0);
        sums.clear();
        for (r, (row, pairs)) in scores.chunks(n_max).zip(pairs.chunks_mut(row_pairs)).enumerate() {
            let (lo, hi) = shape.visible(task.p0 + r / group);
            sums.push(exp_pairs(&row[from..], lo - from..hi - from, pairs));
        }
        Weights { pairs, sums, from, row_pairs }
    }

    /// Every output of the task: its weights of the value pairs from `from` ([`weigh_runs`] for
    /// two tokens' heads at a time over one span of blocks, `span` its runs), then the division.
    fn weigh(&self, step: &Step<'_>, task: &Task<'_>, values: &[bf16], span: &mut Vec<(usize, usize)>) {
        let Heads { n_head, n_kv_head, head_dim: hd } = step.shape.heads;
        let (q_row, group, pair_stride) = (n_head * hd, step.shape.heads.group(), 2 * n_kv_head * hd);
        // A block's pair s of this KV head at the block's offset + s * pair_stride + 2 * g * hd.
        span.clear();
        span.extend(
            task.value_rows()
                .runs(task.n_max)
                .skip_while(|&(p, _, len)| p + len <= self.from)
                .map(|(_, off, len)| (off - task.g * hd + 2 * task.g * hd, len)),
        );
        // SAFETY (for each use): the task's own heads, zeroed at its start, of distinct (token,
        // head), no other slice of them alive.
        let out = |j: usize, h: usize| unsafe { step.out.slice(task.first + j * q_row + h * hd, hd) };
        let w = |j: usize, h: usize| &self.pairs[(j * group + h) * self.row_pairs..][..self.row_pairs];
        for j0 in (0..task.m).step_by(2) {
            let tokens = 2.min(task.m - j0);
            for (h, n) in head_runs(group) {
                // Row i: token j0 + i / n, head h + i % n.
                let at = |i: usize| (j0 + i / n, h + i % n);
                let (w, o) = (|i: usize| w(at(i).0, at(i).1), |i: usize| out(at(i).0, at(i).1));
                with_rows!(tokens * n, [6 4 3 2] 1, |R| weigh_runs::<R>(from_fn(w), values, span, pair_stride, from_fn(o)))
            }
        }
        for (r, &sum) in self.sums.iter().enumerate() {
            let inv = 1.0 / sum;
            out(r / group, r % group).iter_mut().for_each(|x| *x *= inv);
        }
    }
}

/// A task's queries as bfloat16 pairs and where their scores go: token `j`'s head `h` is the
/// `pairs` lanes at `first + j * q_row + h * pairs` of `q`, its scores row `j * group + h` of
/// `n_max` (positions).
struct Tile<'a> {
    q: &'a [u32],
    first: usize,
    q_row: usize,
    pairs: usize,
    group: usize,
    n_max: usize,
}

impl Tile<'_> {
    /// The scores of tokens `tokens` (every head) against the slots `slots` of a block's keys of
    /// one KV head, the block's first slot at position `p`: `dot(query, key) * scale`. On AVX-512
    /// BF16, two tokens' heads share each key load.
    #[allow(clippy::too_many_arguments)]
    fn scores(
        &self,
        tokens: Range<usize>,
        keys: &[bf16],
        block_size: usize,
        p: usize,
        slots: Range<usize>,
        scale: f32,
        scores: &mut [f32],
    ) {
        let (pairs, group, n_max) = (self.pairs, self.group, self.n_max);
        assert!(
            !tokens.is_empty() && slots.end <= block_size && keys.len() >= 2 * pairs * block_size,
            "slots inside the keys"
        );
        assert!(p + slots.end <= n_max && tokens.end * group * n_max <= scores.len(), "scores inside the rows");
        assert!(self.first + (tokens.end - 1) * self.q_row + group * pairs <= self.q.len(), "queries inside q");
        let query = |j: usize, h: usize| self.first + j * self.q_row + h * pairs;
        let row = |j: usize, h: usize| (j * group + h) * n_max + p + slots.start;
        #[cfg(target_arch = "x86_64")]
        if avx512bf16() && pairs.is_multiple_of(SCORE_LANES) {
            let (q, s) = (self.q.as_ptr(), scores.as_mut_ptr());
            for j0 in tokens.clone().step_by(2) {
                let two = 2.min(tokens.end - j0);
                for (h, n) in head_runs(group) {
                    // Row i of the call: token j0 + i / n, head h + i % n.
                    let at = |i: usize| (j0 + i / n, h + i % n);
                    // SAFETY: AVX-512 F, BW, VL and BF16 are present (checked at run time); the
                    // queries, keys and score rows lie inside their buffers (asserted above), the
                    // score rows (of distinct tokens and heads) apart.
                    unsafe {
                        let q = |i: usize| q.add(query(at(i).0, at(i).1));
                        let o = |i: usize| s.add(row(at(i).0, at(i).1));
                        let (k, slots) = (keys.as_ptr(), slots.clone());
                        with_rows!(two * n, [6 4 3 2] 1, |R| qk_block_avx512::<R>(
                            from_fn(q),
                            k,
                            block_size,
                            pairs,
                            slots,
                            scale,
                            from_fn(o)
                        ))
                    }
                }
            }
            return;
        }
        self.scores_portable(tokens, keys, block_size, p, slots, scale, scores);
    }

    /// [`Tile::scores`] on any CPU: [`dot`] for each query and slot.
    #[allow(clippy::too_many_arguments)]
    fn scores_portable(
        &self,
        tokens: Range<usize>,
        keys: &[bf16],
        block_size: usize,
        p: usize,
        slots: Range<usize>,
        scale: f32,
        scores: &mut [f32],
    ) {
        for j in tokens {
            for h in 0..self.group {
                let q = &self.q[self.first + j * self.q_row + h * self.pairs..][..self.pairs];
                let row = &mut scores[(j * self.group + h) * self.n_max + p..];
                for slot in slots.clone() {
                    let key = |d: usize| pair(keys[2 * (d * block_size + slot)], keys[2 * (d * block_size + slot) + 1]);
                    row[slot] = dot(q, key) * scale;
                }
            }
        }
    }
}

/// [`Tile::scores`] for `R` queries, sixteen slots to a register: [`dot`]'s lane sums, each a register, and its fold.
///
/// SAFETY: the CPU has AVX-512 F, BW, VL and BF16; `pairs` (a multiple of [`SCORE_LANES`]) lanes are
/// readable at each `q[r]`, and `2 * pairs * block_size` elements at `keys`; `slots.len()` floats
/// are writable at each `out[r]`, overlapping nothing else; `slots.end <= block_size`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn qk_block_avx512<const R: usize>(
    q: [*const u32; R],
    keys: *const bf16,
    block_size: usize,
    pairs: usize,
    slots: Range<usize>,
    scale: f32,
    out: [*mut f32; R],
) {
    use std::arch::x86_64::*;
    const SLOTS: usize = 16;
    // SAFETY: lanes past `slots.end` are masked off in every load and store; the rest lie inside
    // what the caller promises.
    unsafe {
        for c in slots.clone().step_by(SLOTS) {
            let n = (slots.end - c).min(SLOTS);
            let (slot_mask, pair_mask) = ((u32::MAX >> (32 - n)) as __mmask16, u64::MAX >> (64 - 2 * n));
            let k = keys.add(2 * c);
            let mut acc = [[_mm512_setzero_ps(); SCORE_LANES]; R];
            for j0 in (0..pairs).step_by(SCORE_LANES) {
                for (l, j) in (j0..j0 + SCORE_LANES).enumerate() {
                    let key: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(
                        pair_mask as __mmask32,
                        k.add(2 * j * block_size).cast(),
                    ));
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let q: __m512bh = std::mem::transmute(_mm512_set1_epi32(*q[r].add(j) as i32));
                        acc[l] = _mm512_dpbf16_ps(acc[l], key, q);
                    }
                }
            }
            for r in 0..R {
                let a = &acc[r];
                let score = _mm512_add_ps(a[0], a[1]);
                _mm512_mask_storeu_ps(
                    out[r].add(c - slots.start),
                    slot_mask,
                    _mm512_mul_ps(score, _mm512_set1_ps(scale)),
                );
            }
        }
    }
}

/// The plain loop every output element of [`weigh_runs`] is: `out[d]` stepped with [`dp`] over
/// the value pairs of `runs` in order, `weights` one lane a pair. A run is `(element offset of
/// its first pair, slots)`; pairs lie `pair_stride` elements apart; a run of odd slots ends on a
/// pair whose second slot counts as zero (it is not read).
fn weigh(weights: &[u32], values: &[bf16], runs: &[(usize, usize)], pair_stride: usize, out: &mut [f32]) {
    let mut w = weights.iter();
    for &(off, slots) in runs {
        for s in 0..slots.div_ceil(2) {
            let w = *w.next().expect("a weight for every pair");
            let row = &values[off + s * pair_stride..];
            let odd = 2 * s + 1 < slots;
            for (d, o) in out.iter_mut().enumerate() {
                let hi = if odd { row[2 * d + 1] } else { bf16::ZERO };
                *o = dp(*o, pair(row[2 * d], hi), w);
            }
        }
    }
}

/// `R` rows of weights (pairs of slots, the runs' pairs one after another) applied to the value
/// pairs of `runs` (as [`weigh`] reads them) and added into `out[r]`, [`weigh`]'s bits for each.
/// On AVX-512 BF16, each value load serves every row and the sums stay in registers across the
/// runs.
fn weigh_runs<const R: usize>(
    weights: [&[u32]; R],
    values: &[bf16],
    runs: &[(usize, usize)],
    pair_stride: usize,
    out: [&mut [f32]; R],
) {
    let pairs: usize = runs.iter().map(|&(_, slots)| slots.div_ceil(2)).sum();
    let cols = out[0].len();
    assert!(weights.iter().all(|w| w.len() >= pairs), "a weight for every pair");
    assert!(out.iter().all(|o| o.len() == cols), "as many columns for each row");
    assert!(
        runs.iter()
            .all(|&(off, slots)| slots == 0 || off + (slots.div_ceil(2) - 1) * pair_stride + 2 * cols <= values.len()),
        "value pairs inside the store"
    );
    #[cfg(target_arch = "x86_64")]
    if avx512bf16() && cols.is_multiple_of(COLS) {
        let out = out.map(<[f32]>::as_mut_ptr);
        for t in (0..cols).step_by(COLS) {
            // SAFETY: AVX-512 F, BW, VL and BF16 are present (checked at run time); the pairs and
            // weights read lie inside their slices (asserted above); the rows are distinct
            // outputs of `cols` floats.
            unsafe {
                weigh_tile_avx512(
                    weights.map(<[u32]>::as_ptr),
                    values.as_ptr().add(2 * t),
                    runs,
                    pair_stride,
                    out.map(|o| o.add(t)),
                )
            };
        }
        return;
    }
    for (w, o) in weights.iter().zip(out) {
        weigh(w, values, runs, pair_stride, o);
    }
}

/// [`weigh_runs`]' [`COLS`] columns, four registers of sixteen for each row.
///
/// SAFETY: the CPU has AVX-512 F, BW, VL and BF16; for every run and pair `s` below its slots'
/// half (rounded up), `2 * COLS` elements are readable at `values + off + s * pair_stride`; each
/// `weights[r]` holds a lane for every pair of the runs; each `out[r]` is `COLS` writable floats,
/// overlapping no other.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn weigh_tile_avx512<const R: usize>(
    mut weights: [*const u32; R],
    values: *const bf16,
    runs: &[(usize, usize)],
    pair_stride: usize,
    out: [*mut f32; R],
) {
    use std::arch::x86_64::*;
    const W: usize = 16;
    // The even slots' halves of a pair: what is left of the last pair of a run of odd slots.
    const EVEN: __mmask32 = 0x5555_5555;
    // SAFETY: by the caller's contract.
    unsafe {
        let mut acc: [[__m512; COLS / W]; R] = from_fn(|r| from_fn(|c| _mm512_loadu_ps(out[r].add(c * W))));
        for &(off, slots) in runs {
            for s in 0..slots.div_ceil(2) {
                let mask = if 2 * s + 1 < slots { u32::MAX } else { EVEN };
                let v = values.add(off + s * pair_stride);
                let vs: [__m512bh; COLS / W] =
                    from_fn(|c| std::mem::transmute(_mm512_maskz_loadu_epi16(mask, v.add(2 * c * W).cast())));
                for r in 0..R {
                    let w: __m512bh = std::mem::transmute(_mm512_set1_epi32(*weights[r].add(s) as i32));
                    for c in 0..COLS / W {
                        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vs[c], w);
                    }
                }
            }
            weights = weights.map(|w| w.add(slots.div_ceil(2)));
        }
        for (o, acc) in out.iter().zip(&acc) {
            for (c, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(o.add(c * W), *a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values of both signs over many magnitudes, none subnormal.
    fn wave(n: usize, f: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32) * f).sin() * (1.0 + (i % 7) as f32).powi(3)).collect()
    }

    fn to_pairs(xs: &[f32]) -> Vec<u32> {
        let mut out = Vec::new();
        push_pairs(xs, &mut out);
        out
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn a_dot_product_step_is_the_cpus_vdpbf16ps_lane() {
        #[cfg(target_arch = "x86_64")]
        crate::model::kernel_check::on_cpu_with(avx512bf16(), "AVX-512 BF16", || {
            use std::arch::x86_64::*;
            // Sums that cancel, that round, and that grow far past their terms.
            let (a, b, acc) = (to_pairs(&wave(32, 0.37)), to_pairs(&wave(32, 0.53)), wave(16, 0.71));
            for scale in [1.0, 1e-3, 1e6] {
                let acc: Vec<f32> = acc.iter().map(|x| x * scale).collect();
                let mut got = [0f32; 16];
                // SAFETY: AVX-512 BF16 is present (checked above); 16 lanes in each buffer.
                unsafe {
                    let load =
                        |p: &[u32]| std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_epi32(p.as_ptr().cast()));
                    let r = _mm512_dpbf16_ps(_mm512_loadu_ps(acc.as_ptr()), load(&a), load(&b));
                    _mm512_storeu_ps(got.as_mut_ptr(), r);
                }
                let plain: Vec<f32> = (0..16).map(|i| dp(acc[i], a[i], b[i])).collect();
                assert_eq!(bits(&got), bits(&plain), "scale {scale}");
            }
        });
    }

    #[test]
    fn the_kernels_give_the_bits_of_the_plain_loops_for_any_slots_and_rows() {
        // Blocks of 4 (part of a register) and 20 (a register and part of another); heads of 64
        // and 128 (one and two value tiles); every run of slots inside the block.
        for (hd, block_size) in [(64, 4), (128, 20), (64, 16)] {
            let keys: Vec<bf16> = wave(hd * block_size, 0.013).into_iter().map(round).collect();
            let keys_ref = &keys;
            let key = |slot: usize| {
                move |j: usize| {
                    let at = 2 * (j * block_size + slot);
                    pair(keys_ref[at], keys_ref[at + 1])
                }
            };
            // Three tokens (a pair and one alone) of groups of three and two heads; the block at
            // position 5 of rows of 25 positions.
            for group in [3, 2] {
                let (m, n_max, p) = (3, 25, 5);
                let q = to_pairs(&wave(m * group * hd, 0.29));
                let tile = Tile { q: &q, first: 0, q_row: group * hd / 2, pairs: hd / 2, group, n_max };
                for slots in [0..block_size, 1..block_size - 1, 2..3] {
                    let zeros = || vec![0f32; m * group * n_max];
                    let (mut all, mut each, mut portable) = (zeros(), zeros(), zeros());
                    tile.scores(0..m, &keys, block_size, p, slots.clone(), 0.5, &mut all);
                    (0..m).for_each(|j| tile.scores(j..j + 1, &keys, block_size, p, slots.clone(), 0.5, &mut each));
                    tile.scores_portable(0..m, &keys, block_size, p, slots.clone(), 0.5, &mut portable);
                    let mut plain = zeros();
                    for (r, row) in plain.chunks_mut(n_max).enumerate() {
                        let q = &q[r * hd / 2..][..hd / 2];
                        slots.clone().for_each(|s| row[p + s] = dot(q, key(s)) * 0.5);
                    }
                    let case = format!("hd {hd}, block {block_size}, group {group}, slots {slots:?}");
                    assert_eq!(bits(&all), bits(&plain), "{case}");
                    assert_eq!(bits(&each), bits(&plain), "{case}: token by token");
                    assert_eq!(bits(&portable), bits(&plain), "{case}: the portable path");
                }
            }
            // Values: three runs, the last of odd slots, pairs 2 * hd * 3 apart (three KV heads).
            let pair_stride = 2 * hd * 3;
            let values: Vec<bf16> = wave(4 * block_size / 2 * pair_stride, 0.017).into_iter().map(round).collect();
            let block = block_size / 2 * pair_stride;
            let runs = [(3 * block + 2 * hd, block_size), (block + 2 * hd, block_size), (2 * hd, 3)];
            let pairs: usize = runs.iter().map(|&(_, s)| s.div_ceil(2)).sum();
            let weights: [Vec<u32>; 6] = from_fn(|r| to_pairs(&wave(2 * pairs, 0.1 + r as f32 * 0.07)));
            let mut plain: [Vec<f32>; 6] = from_fn(|r| wave(hd, 0.2 + r as f32));
            let mut six = plain.clone();
            let mut one = plain.clone();
            for (w, o) in weights.iter().zip(&mut plain) {
                weigh(w, &values, &runs, pair_stride, o);
            }
            weigh_runs(
                weights.each_ref().map(|w| w.as_slice()),
                &values,
                &runs,
                pair_stride,
                six.each_mut().map(|o| o.as_mut_slice()),
            );
            for (w, o) in weights.iter().zip(&mut one) {
                weigh_runs([w.as_slice()], &values, &runs, pair_stride, [o.as_mut_slice()]);
            }
            assert_eq!(plain.each_ref().map(|o| bits(o)), six.each_ref().map(|o| bits(o)), "six rows, hd {hd}");
            assert_eq!(plain.each_ref().map(|o| bits(o)), one.each_ref().map(|o| bits(o)), "one row, hd {hd}");
        }
    }

    #[test]
    fn values_round_to_pairs_alike_on_every_path_and_an_odd_count_ends_on_zero() {
        for n in [0, 1, 2, 31, 32, 33, 64, 77] {
            let xs = wave(n, 0.37);
            let got = to_pairs(&xs);
            let plain: Vec<u32> = (0..n.div_ceil(2))
                .map(|i| pair(round(xs[2 * i]), xs.get(2 * i + 1).map_or(bf16::ZERO, |&x| round(x))))
                .collect();
            assert_eq!(got, plain, "{n} values");
        }
    }

    #[test]
    fn the_softmax_exponential_is_within_a_few_ulps_of_libm() {
        // Every 97th step of 1e-4 from -87 to 0, then below the floor.
        for y in (0..=870_000).step_by(97).map(|i| -(i as f32) / 10_000.0) {
            let (got, want) = (exp(y), y.exp());
            assert!((got - want).abs() <= want * 4e-7, "exp({y}) = {got}, libm {want}");
        }
        for y in [-87.5f32, -200.0, f32::NEG_INFINITY] {
            assert!(exp(y) > 0.0 && exp(y) < 2e-38, "exp({y}) = {}", exp(y));
        }
    }

    #[test]
    fn softmax_pairs_sum_to_one_are_zero_outside_and_alike_on_every_path_and_offset() {
        let unpack = |p: &[u32]| p.iter().flat_map(|&l| [l as u16, (l >> 16) as u16]).collect::<Vec<u16>>();
        let weight = |w: u16| bf16::from_bits(w).to_f32();
        let scores = wave(77, 0.41);
        // Seen from an even and from an odd position, in rows that start at different places.
        for (lead, tail) in [(0, 0), (3, 2), (4, 1)] {
            let row = [vec![0.0; lead], scores.clone(), vec![0.0; tail]].concat();
            let seen = lead..lead + scores.len();
            let lanes = row.len().div_ceil(2);
            let (mut vector, mut portable) = (vec![7; lanes], vec![7; lanes]);
            let max = crate::model::exp::max(&scores);
            let sum = exp_pairs(&row, seen.clone(), &mut vector);
            let plain = exp_pairs_portable(&row, seen.clone(), max, &mut portable);
            let (v, p) = (unpack(&vector), unpack(&portable));
            // Lanes outside the pass's reach are zeroed before it.
            let reached = (seen.start & !1)..seen.end.next_multiple_of(2);
            assert_eq!(sum.to_bits(), plain.to_bits(), "lead {lead}: the vector path's sum");
            assert_eq!(v[reached.clone()], p[reached.clone()], "lead {lead}: the vector path's pairs");
            assert!(v[reached.clone()].iter().enumerate().all(|(i, &w)| seen.contains(&(i + reached.start)) || w == 0));
            assert_eq!(
                v[seen.clone()],
                unpack(&{
                    let mut at_start = vec![0; scores.len().div_ceil(2)];
                    exp_pairs(&scores, 0..scores.len(), &mut at_start);
                    at_start
                })[..scores.len()],
                "lead {lead}: the weights wherever the row starts"
            );
            let total: f32 = v[seen.clone()].iter().map(|&w| weight(w)).sum::<f32>() / sum;
            assert!((total - 1.0).abs() < 0.02, "weights sum to {total}");
            let top = scores.iter().enumerate().fold(0, |m, (i, &x)| if x > scores[m] { i } else { m });
            assert_eq!(weight(v[lead + top]), 1.0, "the largest score's weight before the division");
        }
    }
}
