//! Our int8 matrix multiply for Q8_0 weights, on x86 with AVX2 and FMA: each row of activations is
//! quantized to Q8_0 (32 values per block, one scale), and every output is the sum over blocks of
//! `scale_w * scale_x * (w · x)`.
//!
//! Why not candle's: its AVX2 kernel computes each (row, column) dot product on one dependent chain
//! of fused multiply-adds, so it runs at the latency of that chain rather than the throughput of
//! the cores (about 18 GMAC/s on two cores here, whatever the number of rows). Here a micro-kernel
//! computes a tile of rows × columns at once: eight independent chains in flight, each weight
//! block's absolute value formed once for all the rows of the tile, and a tile of rows kept in L1
//! while every column quad of the weights streams past it once per tile.
//!
//! The invariant, exactness: every output element is computed by the same instruction sequence as
//! candle's `vec_dot_q8_0_q8_0` (the same quantization of the activations, the same products,
//! the same accumulation order and horizontal sum), whatever tile it falls in and however many
//! rows the batch has. So a row's output does not depend on the rows beside it, and every output is
//! bit-identical to candle's `vec_dot_q8_0_q8_0` (tests below).

use std::borrow::Cow;

use anyhow::{Result, bail, ensure};
use candle_core::{
    Device, Tensor,
    quantized::{GgmlDType, QTensor},
};
use half::f16;

/// Values per quantization block.
const BLOCK: usize = 32;
/// Bytes of a GGUF Q8_0 block: an f16 scale, then 32 signed quants.
const Q8_0_BYTES: usize = 2 + BLOCK;
/// Output columns a micro-kernel computes per pass (one "quad").
const QUAD: usize = 4;
/// Rows that share one pass over a quad's weights (kept in L1 together).
const ROW_TILE: usize = 16;

/// Whether this CPU runs the kernels (checked at run time: the build machine says nothing).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Q8_0 weights of an `n × k` matrix (`n` outputs), laid out for the kernel: per quad of four
/// output columns, per block, the four columns' quants side by side, and their scales as f32.
pub struct Q8Weights {
    n: usize,
    k: usize,
    quants: Vec<[i8; BLOCK]>,
    scales: Vec<f32>,
}

/// Activations quantized per row, as candle quantizes them.
struct Q8Rows {
    quants: Vec<[i8; BLOCK]>,
    scales: Vec<f32>,
}

impl Q8Weights {
    /// From a Q8_0 tensor of shape `(n, k)`; `k` must be a whole number of blocks.
    pub fn from_qtensor(t: &QTensor) -> Result<Self> {
        // The kernels' safety rests on this: no weights, no calls.
        ensure!(available(), "this CPU lacks AVX2 and FMA, which these kernels need");
        ensure!(t.dtype() == GgmlDType::Q8_0, "our matmul takes Q8_0 weights, not {:?}", t.dtype());
        let (n, k) = t.shape().dims2()?;
        ensure!(k % BLOCK == 0, "a row of {k} values is not a whole number of Q8_0 blocks");
        let data: Cow<[u8]> = t.data()?;
        let nb = k / BLOCK;
        ensure!(data.len() == n * nb * Q8_0_BYTES, "Q8_0 data of {} bytes for {n}x{k}", data.len());
        let quads = n.div_ceil(QUAD);
        // Columns past `n` in the last quad are zeros: they add nothing and are never written.
        let mut quants = vec![[0i8; BLOCK]; quads * nb * QUAD];
        let mut scales = vec![0f32; quads * nb * QUAD];
        for col in 0..n {
            for b in 0..nb {
                let at = (col * nb + b) * Q8_0_BYTES;
                let block = &data[at..at + Q8_0_BYTES];
                let slot = ((col / QUAD) * nb + b) * QUAD + col % QUAD;
                scales[slot] = f16::from_le_bytes([block[0], block[1]]).to_f32();
                for (q, &byte) in quants[slot].iter_mut().zip(&block[2..]) {
                    *q = byte as i8;
                }
            }
        }
        Ok(Q8Weights { n, k, quants, scales })
    }

    /// `x · selfᵀ` for `x` of shape `(…, k)`: shape `(…, n)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims();
        let Some((&k, outer)) = dims.split_last() else { bail!("a matmul input needs a last dimension") };
        ensure!(k == self.k, "input of width {k} for weights of width {}", self.k);
        let m = outer.iter().product::<usize>();
        let mut out = vec![0f32; m * self.n];
        let rows = match super::rows::on_host(x, Q8Rows::quantize) {
            Some(rows) => rows,
            None => Q8Rows::quantize(&x.flatten_all()?.to_vec1::<f32>()?),
        };
        self.matmul(&rows, m, &mut out);
        let mut shape = outer.to_vec();
        shape.push(self.n);
        Ok(Tensor::from_vec(out, shape, &Device::Cpu)?)
    }

    /// Work items: (tile of rows, quad of columns), tile-major, split across candle's pool. One
    /// row (decode) goes two quads at a time instead, for as many chains in flight as two rows.
    fn matmul(&self, rows: &Q8Rows, m: usize, out: &mut [f32]) {
        let quads = self.n.div_ceil(QUAD);
        let out_at = out.as_mut_ptr() as usize;
        let pool = candle_core::utils::barrier_pool();
        if m == 1 {
            let work = |items: std::ops::Range<usize>| {
                for pair in items {
                    // SAFETY: each column of the row belongs to exactly one pair of quads.
                    unsafe { self.one_row(rows.row(0, self.k / BLOCK), pair * 2, quads, out_at as *mut f32) };
                }
            };
            return pool.execute_chunked(quads.div_ceil(2), work);
        }
        let tiles = m.div_ceil(ROW_TILE);
        let work = |items: std::ops::Range<usize>| {
            for item in items {
                let (tile, quad) = (item / quads, item % quads);
                let rows_in = tile * ROW_TILE..m.min((tile + 1) * ROW_TILE);
                // SAFETY: each (row, column) of `out` belongs to exactly one item, and `kernels`
                // writes only the columns below `n` of the rows it is given.
                unsafe { self.tile(rows, rows_in, quad, out_at as *mut f32) };
            }
        };
        pool.execute_chunked(tiles * quads, work);
    }

    fn quad(&self, quad: usize) -> WeightQuad<'_> {
        let per_quad = (self.k / BLOCK) * QUAD;
        WeightQuad {
            quants: &self.quants[quad * per_quad..(quad + 1) * per_quad],
            scales: &self.scales[quad * per_quad..(quad + 1) * per_quad],
        }
    }

    /// The single row against quads `first` and `first + 1` (if there is one).
    ///
    /// # Safety
    /// `out` points to a `1 × n` buffer no other thread writes these elements of.
    unsafe fn one_row(&self, row: RowBlocks, first: usize, quads: usize, out: *mut f32) {
        let mut sums = [[0f32; QUAD]; 2];
        let done = if first + 1 < quads {
            // SAFETY: `available` was checked before any `Q8Weights` was made.
            unsafe { kernel::<1, 2>([&self.quad(first), &self.quad(first + 1)], [row], &mut sums) };
            2
        } else {
            // SAFETY: as above.
            unsafe { kernel::<1, 1>([&self.quad(first)], [row], &mut sums[..1]) };
            1
        };
        let flat = sums[0].iter().chain(&sums[1]).take(done * QUAD);
        for (c, &v) in flat.enumerate().take(self.n - first * QUAD) {
            // SAFETY: column below `n`, this item's alone.
            unsafe { *out.add(first * QUAD + c) = v };
        }
    }

    /// One item: its rows two at a time (the last alone), against one quad.
    ///
    /// # Safety
    /// `out` points to an `m × n` buffer no other thread writes these elements of.
    unsafe fn tile(&self, rows: &Q8Rows, range: std::ops::Range<usize>, quad: usize, out: *mut f32) {
        let nb = self.k / BLOCK;
        let w = self.quad(quad);
        let cols = QUAD.min(self.n - quad * QUAD);
        let mut r = range.start;
        while r < range.end {
            let take = if range.end - r >= 2 { 2 } else { 1 };
            let mut sums = [[0f32; QUAD]; 2];
            // SAFETY: the kernels need AVX2 and FMA, which `available` checked before any
            // `Q8Weights` was made.
            unsafe {
                match take {
                    2 => kernel::<2, 1>([&w], [rows.row(r, nb), rows.row(r + 1, nb)], &mut sums),
                    _ => kernel::<1, 1>([&w], [rows.row(r, nb)], &mut sums[..1]),
                }
            }
            for (i, row_sums) in sums.iter().take(take).enumerate() {
                for (c, &v) in row_sums.iter().take(cols).enumerate() {
                    // SAFETY: in bounds (row < m, column < n), and this item's alone.
                    unsafe { *out.add((r + i) * self.n + quad * QUAD + c) = v };
                }
            }
            r += take;
        }
    }
}

/// One quad's weights: per block, four columns' quants and scales.
struct WeightQuad<'a> {
    quants: &'a [[i8; BLOCK]],
    scales: &'a [f32],
}

/// One row's quantized blocks.
#[derive(Clone, Copy)]
struct RowBlocks<'a> {
    quants: &'a [[i8; BLOCK]],
    scales: &'a [f32],
}

impl Q8Rows {
    /// Rows of values (each a whole number of blocks) to Q8_0, block by block, exactly as
    /// candle's `BlockQ8_0::from_float` does (the scale rounded through f16, each quant
    /// `round(x / scale)`).
    fn quantize(xs: &[f32]) -> Q8Rows {
        let blocks = xs.len() / BLOCK;
        let mut quants = vec![[0i8; BLOCK]; blocks];
        let mut scales = vec![0f32; blocks];
        for ((chunk, q), s) in xs.chunks_exact(BLOCK).zip(&mut quants).zip(&mut scales) {
            let amax = chunk.iter().fold(0f32, |a, &x| a.max(x.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            *s = f16::from_f32(d).to_f32();
            for (q, &x) in q.iter_mut().zip(chunk) {
                *q = (x * id).round() as i8;
            }
        }
        Q8Rows { quants, scales }
    }

    fn row(&self, r: usize, nb: usize) -> RowBlocks<'_> {
        RowBlocks { quants: &self.quants[r * nb..(r + 1) * nb], scales: &self.scales[r * nb..(r + 1) * nb] }
    }
}

/// `R` rows against `Q` quads: `sums[r][q * 4 + c]`, flattened as `sums[r * Q + q][c]`, is the
/// dot product of row `r` and column `c` of quad `q`, each on its own accumulator, in candle's
/// order (see the module docs). `R * Q` is at most 2: eight accumulators in registers.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel<const R: usize, const Q: usize>(
    quads: [&WeightQuad; Q],
    rows: [RowBlocks; R],
    sums: &mut [[f32; QUAD]],
) {
    use std::arch::x86_64::*;
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[[_mm256_setzero_ps(); QUAD]; Q]; R];
    for b in 0..rows[0].quants.len() {
        for (q, w) in quads.iter().enumerate() {
            for c in 0..QUAD {
                let at = b * QUAD + c;
                // SAFETY: a block is 32 bytes, loaded unaligned.
                let wq = unsafe { _mm256_loadu_si256(w.quants[at].as_ptr().cast()) };
                let w_abs = _mm256_sign_epi8(wq, wq);
                let w_scale = w.scales[at];
                for (row, acc) in rows.iter().zip(acc.iter_mut()) {
                    // SAFETY: as above.
                    let xq = unsafe { _mm256_loadu_si256(row.quants[b].as_ptr().cast()) };
                    let signed = _mm256_sign_epi8(xq, wq);
                    let pairs = _mm256_maddubs_epi16(w_abs, signed);
                    let products = _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, pairs));
                    let d = _mm256_set1_ps(w_scale * row.scales[b]);
                    acc[q][c] = _mm256_fmadd_ps(d, products, acc[q][c]);
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (q, acc) in acc.iter().enumerate() {
            for (a, o) in acc.iter().zip(sums[r * Q + q].iter_mut()) {
                *o = hsum(*a);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel<const R: usize, const Q: usize>(_: [&WeightQuad; Q], _: [RowBlocks; R], _: &mut [[f32; QUAD]]) {
    unreachable!("Q8Weights are only made where `available` is true")
}

/// The sum of eight lanes, in candle's `hsum_float_8` order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn hsum(x: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let res = _mm256_extractf128_ps(x, 1);
    let res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    let res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    let res = _mm_add_ss(res, _mm_movehdup_ps(res));
    _mm_cvtss_f32(res)
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::k_quants::{BlockQ8_0, GgmlType};

    use super::*;

    /// `x · wᵀ` by candle's own `vec_dot_q8_0_q8_0`, one output at a time: the instruction
    /// sequence the kernels promise to follow. (candle's `QMatMul` is not that reference on
    /// every CPU: with AVX-512 VNNI it repacks Q8_0 weights for kernels that sum in another
    /// order.)
    fn candles_vec_dot(w: &[f32], x: &[f32], n: usize, k: usize) -> Vec<f32> {
        let blocks = |v: &[f32]| {
            let mut b = vec![BlockQ8_0::zeros(); v.len() / BLOCK];
            BlockQ8_0::from_float(v, &mut b);
            b
        };
        let (w, x) = (blocks(w), blocks(x));
        let nb = k / BLOCK;
        let m = x.len() / nb;
        let mut out = Vec::with_capacity(m * n);
        for r in 0..m {
            for c in 0..n {
                out.push(BlockQ8_0::vec_dot(k, &w[c * nb..(c + 1) * nb], &x[r * nb..(r + 1) * nb]));
            }
        }
        out
    }

    fn weights(n: usize, k: usize) -> QTensor {
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
        QTensor::quantize(&w, GgmlDType::Q8_0).unwrap()
    }

    #[test]
    fn every_output_is_bit_identical_to_candles_whatever_the_number_of_rows() {
        if !available() {
            eprintln!("skipped: no AVX2+FMA on this CPU");
            return;
        }
        // Widths of the default model's matmuls, and a column count that leaves a partial quad.
        for (n, k) in [(960, 576), (3072, 576), (576, 1536), (18, 64)] {
            let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
            let w: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
            let ours = Q8Weights::from_qtensor(&q).unwrap();
            for m in [1, 2, 3, 17, 33] {
                let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
                let b = candles_vec_dot(&w, &x.flatten_all().unwrap().to_vec1().unwrap(), n, k);
                let a: Vec<f32> = ours.forward(&x).unwrap().flatten_all().unwrap().to_vec1().unwrap();
                let differ = a.iter().zip(&b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
                assert_eq!(differ, 0, "{n}x{k}, {m} rows: {differ} of {} outputs differ", a.len());
            }
        }
    }

    #[test]
    fn a_rows_output_does_not_depend_on_the_rows_beside_it() {
        if !available() {
            eprintln!("skipped: no AVX2+FMA on this CPU");
            return;
        }
        let ours = Q8Weights::from_qtensor(&weights(100, 576)).unwrap();
        let x = Tensor::randn(0f32, 1.0, (37, 576), &Device::Cpu).unwrap();
        let all: Vec<Vec<f32>> = ours.forward(&x).unwrap().to_vec2().unwrap();
        for r in [0, 1, 15, 16, 36] {
            let alone: Vec<Vec<f32>> = ours.forward(&x.narrow(0, r, 1).unwrap()).unwrap().to_vec2().unwrap();
            assert_eq!(alone[0], all[r], "row {r} alone differs from row {r} in a batch of 37");
        }
    }
}
