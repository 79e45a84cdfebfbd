//! Our int8 matrix multiply for Q8_0 and Q4_1 weights, on CPUs with AVX-512 VNNI or AVX2: with
//! VNNI, one `vpdpbusd` multiplies four inputs of sixteen output columns at once, and a pass keeps
//! up to eight rows' sums in registers, so each weight load serves every row of the pass; with
//! AVX2 only (module `avx2`), the same layout and float steps, eight columns to a register, so
//! the same bits on either CPU.
//!
//! Why not candle's repacked kernels, which use the same instruction: they take activations only
//! in 256-wide blocks, so every matrix whose input is not a multiple of 256 wide must be zero-padded
//! (SmolLM2's 576 becomes 768: a third more weight bytes for decode to stream), they take no Q4_1
//! (the default model's format, which the loader otherwise re-quantizes to Q8_0: 70% more bytes
//! and a second rounding), and their inner loop keeps at most four rows, their count known only at
//! run time. Here the input width need only be a multiple of 32, the weights keep their file's
//! size (Q4_1: 16 bytes of nibbles and two f16 per 32 values), and the row count of a pass is a
//! compile-time constant, so its sums stay in registers. (On AVX2 alone candle has only its
//! generic kernel, which sums each row against each column on its own, re-reading the weights for
//! every row; an earlier kernel of ours kept its bits and tiled it, and this one is 1.1-1.9x that
//! on the same Q8_0 matrices and 1.8-3.3x on Q4_1 ones, one row to 256: docs/BENCHMARKS.md.)
//!
//! Layout: the weights go in tiles of 16 output columns; per tile and input block, the quants of
//! the 16 columns lie as [4-input group][column][4 inputs] (`vpdpbusd`'s shape), beside the 16
//! scales (and, for Q4_1, the 16 minimums). Q8_0 quants are offset by +128 (`vpdpbusd` takes one
//! unsigned operand); Q4_1's are unsigned already, groups 0-3 in the low nibbles and 4-7 in the
//! high ones, as GGUF packs them. Activations are quantized per row to Q8_0 (an f32 scale per 32
//! values, rounded through f16 as GGUF stores it; quants rounded half to even), as llama.cpp
//! quantizes them for these formats; each block also keeps the sum of its quants, which takes
//! Q8_0's offset back out exactly and carries Q4_1's minimum. They lie block-major within each
//! pass of rows (see `QuantRows`), so the kernel reaches them through one pointer.
//!
//! The invariant, exactness: an output is a sum over blocks `b`, in order, of
//! `acc = fma(f32(dot_b) * w_scale_b, x_scale_b, acc)`, where `dot_b` is the exact integer dot
//! product of block `b` (Q4_1 then adds a second such sum, of `fma(w_min_b, x_scaled_sum_b, ·)`,
//! at the end: llama.cpp's formula for Q4_1 against Q8_1). No step depends on the other rows of
//! the pass or the batch, so a row's output is the same bits however many rows share the call, and
//! on either instruction set (tests below check every one the CPU runs against a scalar model of
//! that sequence, and against the same row alone). A fleet of mixed CPUs gives one answer.

use std::borrow::Cow;

use anyhow::{Result, bail, ensure};
use candle_core::{
    Device, Tensor,
    quantized::{GgmlDType, QTensor},
};
use half::f16;

use super::rows::{PARALLEL_MIN, RowFill, on_host};

/// Values per quantization block.
const BLOCK: usize = 32;
/// Bytes of a GGUF Q8_0 block: an f16 scale, then 32 signed quants.
const Q8_0_BYTES: usize = 2 + BLOCK;
/// Bytes of a GGUF Q4_1 block: an f16 scale and minimum, then 32 nibbles (byte `j`: value `j` low,
/// value `j + 16` high).
const Q4_1_BYTES: usize = 4 + BLOCK / 2;
/// Output columns per tile: the lanes of one 16-wide register.
const TILE: usize = 16;
/// Inputs one `vpdpbusd` lane sums.
const GROUP: usize = 4;
/// Most rows a pass keeps in registers (three each: for Q8_0 two integer chains for the block and
/// the row's running f32 sums; for Q4_1 one chain, the sums and the minimums' sums).
const MAX_ROWS: usize = 8;
/// The bits of the f32 `1.5 * 2^23`. Added to an integer below `2^22` in size, they give the bits of
/// `1.5 * 2^23 + that integer` exactly (the floats in `[2^23, 2^24)` are the integers): a dot
/// product's chain starts from them, so its sum is already a float, offset by [`MAGIC`], with no
/// conversion instruction.
const MAGIC_BITS: i32 = 0x4B40_0000;
/// `1.5 * 2^23`, the float [`MAGIC_BITS`] stand for.
const MAGIC: f32 = 12_582_912.0;
/// Passes one work item runs against its tile: the item's setup (the tile's slices, the dispatch)
/// is paid once for them all.
const ITEM_PASSES: usize = 4;

/// Whether this CPU runs the kernels (AVX-512 VNNI, or AVX2; checked at run time: the build
/// targets x86-64-v3).
pub fn available() -> bool {
    Isa::best().is_some()
}

/// Which kernels this CPU runs, by name, if any.
pub fn kernels() -> Option<&'static str> {
    Isa::best().map(|isa| match isa {
        Isa::Avx512Vnni => "AVX-512 VNNI",
        Isa::Avx2 => "AVX2",
    })
}

/// The instructions that run the kernels, chosen once as the weights are made. Both give the same
/// bits: only the integer dot products are computed differently, and integers are exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    /// AVX-512 F, BW and VNNI: `vpdpbusd`, sixteen columns to a register.
    Avx512Vnni,
    /// AVX2, FMA and F16C: `vpmaddubsw` and `vpmaddwd`, eight columns to a register.
    Avx2,
}

impl Isa {
    /// Every instruction set this CPU runs the kernels on, the fastest first.
    fn here() -> Vec<Isa> {
        let mut isas = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512bw") && has!("avx512vnni") {
                isas.push(Isa::Avx512Vnni);
            }
            if has!("avx2") && has!("fma") && has!("f16c") {
                isas.push(Isa::Avx2);
            }
        }
        isas
    }

    fn best() -> Option<Isa> {
        Isa::here().first().copied()
    }
}

/// Quantized weights of an `n × k` matrix (`n` outputs), tiled for the kernel (see the module docs).
pub struct Int8Weights {
    n: usize,
    k: usize,
    format: Format,
    isa: Isa,
}

/// The tiles' quants, per tile, per block (index `tile * blocks + block`); scales and minimums
/// are zero past `n`.
enum Format {
    /// `[group][column][4]`, each quant + 128.
    Q8_0 { quants: Vec<[u8; BLOCK * TILE]>, scales: Vec<[f16; TILE]> },
    /// `[group 0-3][column][4]`, group `g + 4` in the high nibble of group `g`'s byte.
    Q4_1 { quants: Vec<[u8; BLOCK * TILE / 2]>, scales: Vec<[f16; TILE]>, mins: Vec<[f16; TILE]> },
}

/// Activations quantized per row, block by block, laid out pass by pass as the kernel reads them:
/// the rows of a pass (eight consecutive rows from a multiple of eight, fewer in the last) lie
/// block-major, `[block][row of the pass]`, so one pointer that steps a block at a time reaches
/// every row of the pass at a displacement known at compile time (row-major rows cost the kernel
/// an address register or a bounds check per row and block, which ran on the vector ports).
struct QuantRows {
    /// Blocks a row.
    blocks: usize,
    rows: usize,
    quants: Vec<[i8; BLOCK]>,
    scales: Vec<f32>,
    /// `-128` times the sum of each block's quants, plus [`MAGIC_BITS`]: starts a Q8_0 dot product
    /// so that it takes the weights' offset back out and ends as a float.
    offsets: Vec<i32>,
    /// The block's (unrounded) scale times the sum of its quants, rounded through f16: llama.cpp's
    /// Q8_1 `s`, which carries Q4_1's minimum.
    scaled_sums: Vec<f32>,
}

impl Int8Weights {
    /// Whether `from_qtensor` takes weights of this type.
    pub fn takes(dtype: GgmlDType) -> bool {
        matches!(dtype, GgmlDType::Q8_0 | GgmlDType::Q4_1)
    }

    /// From a Q8_0 or Q4_1 tensor of shape `(n, k)`; `k` must be a whole number of blocks.
    pub fn from_qtensor(t: &QTensor) -> Result<Self> {
        let Some(isa) = Isa::best() else {
            bail!("this CPU lacks both AVX-512 VNNI and AVX2, which these kernels need")
        };
        Self::for_isa(t, isa)
    }

    /// [`Int8Weights::from_qtensor`] for the kernels of `isa`, which must be among [`Isa::here`]:
    /// the kernels' safety rests on it (no weights, no calls).
    fn for_isa(t: &QTensor, isa: Isa) -> Result<Self> {
        ensure!(Isa::here().contains(&isa), "this CPU cannot run the {isa:?} kernels");
        let (n, k) = t.shape().dims2()?;
        ensure!(k % BLOCK == 0, "a row of {k} values is not a whole number of blocks");
        let data: Cow<[u8]> = t.data()?;
        let (nb, tiles) = (k / BLOCK, n.div_ceil(TILE));
        let bytes = match t.dtype() {
            GgmlDType::Q8_0 => Q8_0_BYTES,
            GgmlDType::Q4_1 => Q4_1_BYTES,
            other => bail!("our matmul takes Q8_0 or Q4_1 weights, not {other:?}"),
        };
        ensure!(data.len() == n * nb * bytes, "{:?} data of {} bytes for {n}x{k}", t.dtype(), data.len());
        // (tile * blocks + block, lane, the GGUF block) for every column's every block.
        let blocks = (0..n).flat_map(|col| {
            let data = &data;
            (0..nb).map(move |b| {
                let at = (col * nb + b) * bytes;
                ((col / TILE) * nb + b, col % TILE, &data[at..at + bytes])
            })
        });
        let half = |block: &[u8], at: usize| f16::from_le_bytes([block[at], block[at + 1]]);
        // Within a tile's block, input `i` of column `lane` (of a group of four) sits here.
        let slot = |i: usize, lane: usize| (i / GROUP) * TILE * GROUP + lane * GROUP + i % GROUP;
        let format = if t.dtype() == GgmlDType::Q8_0 {
            // Columns past `n`: quants 0 (128 once offset), scale 0; never written out.
            let (mut quants, mut scales) =
                (vec![[128u8; BLOCK * TILE]; tiles * nb], vec![[f16::ZERO; TILE]; tiles * nb]);
            for (at, lane, block) in blocks {
                scales[at][lane] = half(block, 0);
                for (i, &q) in block[2..].iter().enumerate() {
                    quants[at][slot(i, lane)] = (q as i8 as i16 + 128) as u8;
                }
            }
            Format::Q8_0 { quants, scales }
        } else {
            let mut quants = vec![[0u8; BLOCK * TILE / 2]; tiles * nb];
            let (mut scales, mut mins) = (vec![[f16::ZERO; TILE]; tiles * nb], vec![[f16::ZERO; TILE]; tiles * nb]);
            for (at, lane, block) in blocks {
                (scales[at][lane], mins[at][lane]) = (half(block, 0), half(block, 2));
                // GGUF's byte `j` holds values `j` and `j + 16`: groups `g` and `g + 4`, as here.
                for (j, &q) in block[4..].iter().enumerate() {
                    quants[at][slot(j, lane)] = q;
                }
            }
            Format::Q4_1 { quants, scales, mins }
        };
        Ok(Int8Weights { n, k, format, isa })
    }

    /// `x · selfᵀ` for `x` of shape `(…, k)`: shape `(…, n)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims();
        let Some((&k, outer)) = dims.split_last() else { bail!("a matmul input needs a last dimension") };
        ensure!(k == self.k, "input of width {k} for weights of width {}", self.k);
        let m = outer.iter().product::<usize>();
        let rows = match on_host(x, |v| QuantRows::quantize(Source::Rows(v), m, k, self.isa)) {
            Some(rows) => rows,
            None => QuantRows::quantize(Source::Rows(&x.flatten_all()?.to_vec1::<f32>()?), m, k, self.isa),
        };
        let mut shape = outer.to_vec();
        shape.push(self.n);
        Ok(Tensor::from_vec(self.product(&rows), shape, &Device::Cpu)?)
    }

    /// `x · selfᵀ` for the `m` rows of width `k` that `fill` writes (a norm's or a gate's): shape
    /// `(m, n)`. Each row is quantized as it is made, a few at a time in a buffer the cache holds,
    /// so the rows are never written out whole and read back (the same bits as `forward` of them).
    pub fn forward_rows(&self, m: usize, k: usize, fill: &RowFill<'_>) -> Result<Tensor> {
        ensure!(k == self.k, "rows of width {k} for weights of width {}", self.k);
        let rows = QuantRows::quantize(Source::Made(fill), m, k, self.isa);
        Ok(Tensor::from_vec(self.product(&rows), (m, self.n), &Device::Cpu)?)
    }

    /// The `rows.rows × n` outputs.
    fn product(&self, rows: &QuantRows) -> Vec<f32> {
        let m = rows.rows;
        // No zero fill: the matmul writes every output (a memset of the whole result was 1-2% of
        // a step, on the calling thread while the others waited).
        let mut out = Vec::with_capacity(m * self.n);
        self.matmul(rows, m, out.as_mut_ptr());
        // SAFETY: every (row, column) below (m, n) was written by exactly one work item.
        unsafe { out.set_len(m * self.n) };
        out
    }

    /// Work items: (column tile, up to [`ITEM_PASSES`] passes of up to eight rows), tile-major, so
    /// one thread's consecutive items reuse a tile's weights from L1; split across candle's pool.
    /// `out` has room for `m × n` floats; the items together write every one of them.
    fn matmul(&self, rows: &QuantRows, m: usize, out: *mut f32) {
        let tiles = self.n.div_ceil(TILE);
        let spans = m.div_ceil(MAX_ROWS * ITEM_PASSES);
        let out_at = out as usize;
        let work = |items: std::ops::Range<usize>| {
            for item in items {
                let (tile, span) = (item / spans, item % spans);
                let first = span * MAX_ROWS * ITEM_PASSES;
                let count = (MAX_ROWS * ITEM_PASSES).min(m - first);
                // SAFETY: each (row, column) of `out` belongs to exactly one item; the kernel
                // writes only the columns below `n` of its rows. `for_isa` checked that the CPU
                // runs `self.isa`'s kernels before any `Int8Weights` was made.
                unsafe { self.passes(rows, first..first + count, tile, out_at as *mut f32) };
            }
        };
        candle_core::utils::barrier_pool().execute_chunked(tiles * spans, work);
    }

    /// Rows `rows` against one tile, eight at a time.
    ///
    /// # Safety
    /// The CPU runs `self.isa`'s kernels; `out` points to an `m × n` buffer no other thread writes
    /// these elements of.
    unsafe fn passes(&self, x: &QuantRows, rows: std::ops::Range<usize>, tile: usize, out: *mut f32) {
        let nb = self.k / BLOCK;
        let span = tile * nb..(tile + 1) * nb;
        let cols = TILE.min(self.n - tile * TILE);
        let w = match &self.format {
            Format::Q8_0 { quants, scales } => {
                TileRef { quants: quants[span.clone()].as_flattened(), scales: &scales[span], mins: &[] }
            }
            Format::Q4_1 { quants, scales, mins } => TileRef {
                quants: quants[span.clone()].as_flattened(),
                scales: &scales[span.clone()],
                mins: &mins[span],
            },
        };
        let nibbles = matches!(self.format, Format::Q4_1 { .. });
        for first in rows.clone().step_by(MAX_ROWS) {
            let count = MAX_ROWS.min(rows.end - first);
            let x = x.pass(first, count);
            // SAFETY: the caller's promise; row `first + r`'s columns of this tile start here.
            let dst = unsafe { out.add(first * self.n + tile * TILE) };
            if self.isa == Isa::Avx2 {
                // SAFETY: as above; AVX2, FMA and F16C are present (the weights were made for them).
                unsafe { avx2::pass(w, x, count, nibbles, dst, self.n, cols) };
                continue;
            }
            /// The kernel for `count` rows and the format, compile-time constants in each arm.
            macro_rules! by_rows {
                ($($rows:literal)*) => {
                    match (count, nibbles) {
                        // SAFETY: as above, for each arm.
                        $(($rows, false) => unsafe { kernel::<$rows, false>(w, x, dst, self.n, cols) },
                        ($rows, true) => unsafe { kernel::<$rows, true>(w, x, dst, self.n, cols) },)*
                        _ => unreachable!("a pass has 1 to {MAX_ROWS} rows"),
                    }
                };
            }
            by_rows!(1 2 3 4 5 6 7 8)
        }
    }
}

/// One tile's blocks, in input order: `quants` per block as its format lays them out (512 bytes
/// for Q8_0, 256 of nibbles for Q4_1), `mins` empty for Q8_0.
#[derive(Clone, Copy)]
struct TileRef<'a> {
    quants: &'a [u8],
    scales: &'a [[f16; TILE]],
    mins: &'a [[f16; TILE]],
}

/// One pass's quantized blocks, `[block][row]` (see [`QuantRows`]): `blocks × rows` of each.
#[derive(Clone, Copy)]
struct PassRef<'a> {
    blocks: usize,
    quants: &'a [[i8; BLOCK]],
    scales: &'a [f32],
    offsets: &'a [i32],
    scaled_sums: &'a [f32],
}

/// Where the rows to quantize come from.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// Memory holding them all, row after row.
    Rows(&'a [f32]),
    /// A function that makes any of them (see `forward_rows`).
    Made(&'a RowFill<'a>),
}

/// The addresses of a [`QuantRows`]' four buffers (capacity for every block, not yet written),
/// for the threads that fill them.
#[derive(Clone, Copy)]
struct Slots {
    quants: usize,
    scales: usize,
    offsets: usize,
    scaled_sums: usize,
    blocks: usize,
    rows: usize,
    isa: Isa,
}

impl Slots {
    /// Rows `first..` (as many as `src` holds, whole rows) quantized into their slots.
    ///
    /// # Safety
    /// No other thread fills these rows; the buffers have room for `blocks × rows` blocks; the
    /// CPU runs `self.isa`'s kernels (checked before any `Int8Weights` was made).
    unsafe fn fill(&self, first: usize, src: &[f32]) {
        let (quants, scales, offsets, scaled) = (
            self.quants as *mut [i8; BLOCK],
            self.scales as *mut f32,
            self.offsets as *mut i32,
            self.scaled_sums as *mut f32,
        );
        for (i, x) in src.as_chunks::<BLOCK>().0.iter().enumerate() {
            let (row, block) = (first + i / self.blocks, i % self.blocks);
            let j = QuantRows::slot(self.blocks, self.rows, row, block);
            // SAFETY: `slot` maps distinct blocks to distinct places below the capacity, and
            // these rows are this call's alone (the caller's promise).
            unsafe {
                let (scale, sum, scaled_sum) = match self.isa {
                    Isa::Avx512Vnni => quantize_block(x, quants.add(j)),
                    Isa::Avx2 => avx2::quantize_block(x, quants.add(j)),
                };
                (*scales.add(j), *offsets.add(j), *scaled.add(j)) = (scale, MAGIC_BITS - 128 * sum, scaled_sum);
            }
        }
    }
}

impl QuantRows {
    /// `m` rows of `k` values (a whole number of blocks) to Q8_0, block by block; many rows are
    /// split across candle's pool.
    fn quantize(source: Source<'_>, m: usize, k: usize, isa: Isa) -> QuantRows {
        let count = m * k / BLOCK;
        // Not zeroed: the blocks below fill every element (zeroing them first was 0.4% of a cold
        // prefill's samples, on the calling thread while the others waited).
        let mut rows = QuantRows {
            blocks: k / BLOCK,
            rows: m,
            quants: Vec::with_capacity(count),
            scales: Vec::with_capacity(count),
            offsets: Vec::with_capacity(count),
            scaled_sums: Vec::with_capacity(count),
        };
        let slots = Slots {
            quants: rows.quants.as_mut_ptr() as usize,
            scales: rows.scales.as_mut_ptr() as usize,
            offsets: rows.offsets.as_mut_ptr() as usize,
            scaled_sums: rows.scaled_sums.as_mut_ptr() as usize,
            blocks: k / BLOCK,
            rows: m,
            isa,
        };
        let work = |range: std::ops::Range<usize>| match source {
            // SAFETY (both arms): rows `range` belong to this call alone (see `Slots::fill`).
            Source::Rows(xs) => unsafe { slots.fill(range.start, &xs[range.start * k..range.end * k]) },
            Source::Made(fill) => {
                let mut made = vec![0f32; MAX_ROWS.min(range.len()) * k];
                for first in range.clone().step_by(MAX_ROWS) {
                    let these = first..range.end.min(first + MAX_ROWS);
                    let made = &mut made[..these.len() * k];
                    fill(these, made);
                    unsafe { slots.fill(first, made) };
                }
            }
        };
        // A decode step's few rows stay on this thread: waking the pool would cost more than the
        // work.
        if m * k < PARALLEL_MIN {
            work(0..m)
        } else {
            candle_core::utils::barrier_pool().execute_chunked(m, work)
        }
        // SAFETY: `slot` maps the `count` blocks one to one onto `0..count`, and each block's
        // quants, scale, offset and scaled sum were written above.
        unsafe {
            rows.quants.set_len(count);
            rows.scales.set_len(count);
            rows.offsets.set_len(count);
            rows.scaled_sums.set_len(count);
        }
        rows
    }

    /// Where block `block` of row `row` lies, of `rows` rows of `blocks` blocks: in its pass's span,
    /// block-major.
    fn slot(blocks: usize, rows: usize, row: usize, block: usize) -> usize {
        let first = row - row % MAX_ROWS;
        first * blocks + block * MAX_ROWS.min(rows - first) + row % MAX_ROWS
    }

    /// The pass of rows `first..first + count`: `first` a multiple of [`MAX_ROWS`], `count` up to
    /// it, and short only where the rows end.
    fn pass(&self, first: usize, count: usize) -> PassRef<'_> {
        assert!(
            first.is_multiple_of(MAX_ROWS) && count == MAX_ROWS.min(self.rows - first),
            "rows {first}..{} are not one pass",
            first + count
        );
        let span = first * self.blocks..(first + count) * self.blocks;
        PassRef {
            blocks: self.blocks,
            quants: &self.quants[span.clone()],
            scales: &self.scales[span.clone()],
            offsets: &self.offsets[span.clone()],
            scaled_sums: &self.scaled_sums[span],
        }
    }
}

/// One block to Q8_0: the scale `amax / 127` (rounded through f16), each quant `x / scale` rounded
/// half to even, as llama.cpp's AVX code quantizes activations. Returns (scale, sum of the quants,
/// unrounded scale times that sum rounded through f16).
///
/// # Safety
/// The CPU has AVX-512F; `q` is 32 writable bytes (not necessarily initialized).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn quantize_block(x: &[f32; BLOCK], q: *mut [i8; BLOCK]) -> (f32, i32, f32) {
    use std::arch::x86_64::*;
    // SAFETY: 32 floats, loaded unaligned as two halves.
    let (a, b) = unsafe { (_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(x.as_ptr().add(16))) };
    let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    let d = amax / 127.0;
    let id = _mm512_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
    // Conversion rounds as MXCSR says: to nearest, ties to even.
    let (qa, qb) = (_mm512_cvtps_epi32(_mm512_mul_ps(a, id)), _mm512_cvtps_epi32(_mm512_mul_ps(b, id)));
    let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    // SAFETY: 16 bytes each, the two halves of the block's quants.
    unsafe {
        _mm_storeu_si128(q.cast(), _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128(q.cast::<i8>().add(16).cast(), _mm512_cvtepi32_epi8(qb));
    }
    (f16::from_f32(d).to_f32(), sum, f16::from_f32(d * sum as f32).to_f32())
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn quantize_block(_: &[f32; BLOCK], _: *mut [i8; BLOCK]) -> (f32, i32, f32) {
    unreachable!("Int8Weights are only made where `available` is true")
}

/// A pass of `R` rows against one tile, of Q4_1 if `NIBBLES` else of Q8_0: row `r`'s `cols`
/// outputs go to `out + r * stride`, each summed in the order the module docs give. Raw pointers
/// step through the blocks: every address is a pointer plus a constant, with no bounds check.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `x` holds `R` rows and `w` its blocks (checked below);
/// `out + r * stride .. + cols` is writable for each row `r`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn kernel<const R: usize, const NIBBLES: bool>(
    w: TileRef,
    x: PassRef,
    out: *mut f32,
    stride: usize,
    cols: usize,
) {
    use std::arch::x86_64::*;
    let nb = x.blocks;
    let block_bytes = if NIBBLES { BLOCK * TILE / 2 } else { BLOCK * TILE };
    let per_pass = [x.quants.len(), x.scales.len(), x.offsets.len(), x.scaled_sums.len()];
    assert!(per_pass.iter().all(|&len| len == nb * R), "a pass of {R} rows has {per_pass:?} blocks, not {nb} each");
    assert!(w.quants.len() == nb * block_bytes && w.scales.len() == nb && (!NIBBLES || w.mins.len() == nb));
    let (mut wq, mut ws) = (w.quants.as_ptr(), w.scales.as_ptr());
    let (mut xq, mut xs, mut xo) = (x.quants.as_ptr().cast::<u8>(), x.scales.as_ptr(), x.offsets.as_ptr());
    let nibble = _mm512_set1_epi8(0x0F);
    let (mut wm, mut xm) = (w.mins.as_ptr(), x.scaled_sums.as_ptr());
    let (mut acc, mut mins) = ([_mm512_setzero_ps(); R], [_mm512_setzero_ps(); R]);
    for _ in 0..nb {
        // SAFETY (the whole loop body): the pointers stand at this block, inside the slices
        // checked above: `block_bytes` of quants and 16 f16 scales (and minimums) of the tile,
        // `R` rows' 32 quants, scales, offsets (and scaled sums) of the pass. Loads are unaligned.
        unsafe {
            let w_scale = _mm512_cvtph_ps(_mm256_loadu_si256(ws.cast()));
            // `-MAGIC * w_scale` is exact (an f16 scale has 11 significant bits, `MAGIC` two), so
            // `fma(MAGIC + dot, w_scale, -MAGIC * w_scale)` rounds `dot * w_scale` once: the same
            // bits as `f32(dot) * w_scale`, without the conversion per row.
            let w_unmagic = _mm512_mul_ps(w_scale, _mm512_set1_ps(-MAGIC));
            // Q8_0 runs two chains a row (groups 0-3 and 4-7), added at the end: integer sums are
            // exact in any order, and half-length chains keep more multiplies in flight; the
            // first starts at the block's offset, taking the weights' +128 back out. Q4_1 runs
            // one, leaving registers for its minimums' sums. Each ends as the bits of
            // `MAGIC + dot` (dot products here stay below 2^20 in size).
            let high = if NIBBLES { 0 } else { 1 };
            let mut dots: [[__m512i; R]; 2] = [
                std::array::from_fn(|r| _mm512_set1_epi32(if NIBBLES { MAGIC_BITS } else { *xo.add(r) })),
                [_mm512_setzero_si512(); R],
            ];
            for g in 0..BLOCK / GROUP / 2 {
                // Groups `g` and `g + 4`: 64 bytes each (Q8_0), or packed in one 64 (Q4_1).
                let (w_lo, w_hi) = if NIBBLES {
                    let packed = _mm512_loadu_si512(wq.add(g * TILE * GROUP).cast());
                    (_mm512_and_si512(packed, nibble), _mm512_and_si512(_mm512_srli_epi16::<4>(packed), nibble))
                } else {
                    (
                        _mm512_loadu_si512(wq.add(g * TILE * GROUP).cast()),
                        _mm512_loadu_si512(wq.add((g + 4) * TILE * GROUP).cast()),
                    )
                };
                #[allow(clippy::needless_range_loop)] // `r` indexes the chains and the quants alike
                for r in 0..R {
                    // Row `r`'s four quants of each group, broadcast as `vpdpbusd`'s signed operand.
                    let a = xq.add(r * BLOCK + g * GROUP).cast::<i32>().read_unaligned();
                    let c = xq.add(r * BLOCK + (g + 4) * GROUP).cast::<i32>().read_unaligned();
                    dots[0][r] = _mm512_dpbusd_epi32(dots[0][r], w_lo, _mm512_set1_epi32(a));
                    dots[high][r] = _mm512_dpbusd_epi32(dots[high][r], w_hi, _mm512_set1_epi32(c));
                }
            }
            for r in 0..R {
                let dot = if NIBBLES { dots[0][r] } else { _mm512_add_epi32(dots[0][r], dots[1][r]) };
                let scaled = _mm512_fmadd_ps(_mm512_castsi512_ps(dot), w_scale, w_unmagic);
                acc[r] = _mm512_fmadd_ps(scaled, _mm512_set1_ps(*xs.add(r)), acc[r]);
            }
            if NIBBLES {
                // Q4_1's minimums' terms, on their own sums until the end (as llama.cpp adds them).
                let w_min = _mm512_cvtph_ps(_mm256_loadu_si256(wm.cast()));
                for (r, mins) in mins.iter_mut().enumerate() {
                    *mins = _mm512_fmadd_ps(w_min, _mm512_set1_ps(*xm.add(r)), *mins);
                }
                (wm, xm) = (wm.add(1), xm.add(R));
            }
            wq = wq.add(block_bytes);
            ws = ws.add(1);
            (xq, xs, xo) = (xq.add(R * BLOCK), xs.add(R), xo.add(R));
        }
    }
    if NIBBLES {
        acc = std::array::from_fn(|r| _mm512_add_ps(acc[r], mins[r]));
    }
    // SAFETY: the caller's promise.
    unsafe { store(&acc, out, stride, cols) };
}

/// Row `r`'s first `cols` sums to `out + r * stride`.
///
/// # Safety
/// The CPU has AVX-512F; those outputs are writable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn store<const R: usize>(acc: &[std::arch::x86_64::__m512; R], out: *mut f32, stride: usize, cols: usize) {
    use std::arch::x86_64::*;
    let mask: __mmask16 = if cols == TILE { !0 } else { (1u16 << cols) - 1 };
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: the caller's promise for row `r`'s `cols` outputs; masked lanes are not touched.
        unsafe { _mm512_mask_storeu_ps(out.add(r * stride), mask, *acc) };
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel<const R: usize, const NIBBLES: bool>(_: TileRef, _: PassRef, _: *mut f32, _: usize, _: usize) {
    unreachable!("Int8Weights are only made where `available` is true")
}

/// The kernels on AVX2 ([`Isa::Avx2`]): the same weight layout, activation blocks and float steps
/// as the AVX-512 ones, each tile's sixteen columns in two halves of eight lanes, so the same
/// bits. Only the integer dot products are made differently: `vpmaddubsw` multiplies unsigned by
/// signed bytes and adds pairs into 16 bits, `vpmaddwd` adds those pairs into 32; both exact here
/// (see the bounds at each use), so each block's dot product is the integer `vpdpbusd` gives.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::{arch::x86_64::*, array::from_fn};

    use super::{BLOCK, GROUP, MAGIC, MAGIC_BITS, PassRef, TILE, TileRef, f16};

    /// Rows one kernel call keeps in registers: three each (dot product, sums, minimums' sums)
    /// of AVX2's sixteen, beside the weights.
    const ROWS: usize = 4;
    /// Columns one register holds: half a tile.
    const HALF: usize = TILE / 2;

    /// A pass of `count` rows against one tile, as [`super::kernel`] computes it: its rows four at
    /// a time, each against the tile's two halves in turn.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `x` is a pass of `count` rows and `w` a tile of as many
    /// blocks (checked in the kernel); `out + r * stride .. + cols` is writable for each row `r`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn pass(
        w: TileRef,
        x: PassRef,
        count: usize,
        nibbles: bool,
        out: *mut f32,
        stride: usize,
        cols: usize,
    ) {
        for r0 in (0..count).step_by(ROWS) {
            for half in 0..TILE / HALF {
                let cols = cols.saturating_sub(half * HALF).min(HALF);
                if cols == 0 {
                    continue;
                }
                // SAFETY: the caller's promise, for rows `r0..` and the half's columns.
                let (dst, at) = (unsafe { out.add(r0 * stride + half * HALF) }, Rows { pass: count, first: r0 });
                /// The kernel for the call's rows and the format, compile-time constants in each arm.
                macro_rules! by_rows {
                    ($($rows:literal)*) => {
                        match (ROWS.min(count - r0), nibbles) {
                            // SAFETY: as above, for each arm.
                            $(($rows, false) => unsafe { kernel::<$rows, false>(w, x, at, half, dst, stride, cols) },
                            ($rows, true) => unsafe { kernel::<$rows, true>(w, x, at, half, dst, stride, cols) },)*
                            _ => unreachable!("a call has 1 to {ROWS} rows"),
                        }
                    };
                }
                by_rows!(1 2 3 4)
            }
        }
    }

    /// Which rows of a pass a kernel call takes: from `first`, of the pass's `pass`.
    #[derive(Clone, Copy)]
    struct Rows {
        pass: usize,
        first: usize,
    }

    /// `R` rows of a pass against half `half` of one tile, of Q4_1 if `NIBBLES` else of Q8_0: the
    /// float steps of [`super::kernel`] in its order, eight columns to a register.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `x` is a pass of `at.pass` rows and `w` a tile of as many
    /// blocks (checked below); `out + r * stride .. + cols` is writable for each row `r < R`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn kernel<const R: usize, const NIBBLES: bool>(
        w: TileRef,
        x: PassRef,
        at: Rows,
        half: usize,
        out: *mut f32,
        stride: usize,
        cols: usize,
    ) {
        let (nb, pass) = (x.blocks, at.pass);
        let block_bytes = if NIBBLES { BLOCK * TILE / 2 } else { BLOCK * TILE };
        let per_pass = [x.quants.len(), x.scales.len(), x.offsets.len(), x.scaled_sums.len()];
        assert!(per_pass.iter().all(|&len| len == nb * pass), "a pass of {pass} rows has {per_pass:?} blocks");
        assert!(
            at.first + R <= pass && half < TILE / HALF && cols <= HALF,
            "rows and columns inside the pass and tile"
        );
        assert!(w.quants.len() == nb * block_bytes && w.scales.len() == nb && (!NIBBLES || w.mins.len() == nb));
        let (mut wq, mut ws, mut wm) = (w.quants.as_ptr(), w.scales.as_ptr(), w.mins.as_ptr());
        // SAFETY: the row offsets are inside each block's `pass` rows (asserted above).
        let (mut xq, mut xs, mut xm) = unsafe {
            (
                x.quants.as_ptr().add(at.first).cast::<u8>(),
                x.scales.as_ptr().add(at.first),
                x.scaled_sums.as_ptr().add(at.first),
            )
        };
        let (nibble, flip, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(i8::MIN), _mm256_set1_epi16(1));
        let magic = _mm256_set1_epi32(MAGIC_BITS);
        // This half's eight entries of a tile's sixteen (scales, minimums).
        let eight = |p: *const [f16; TILE]| p.cast::<f16>().wrapping_add(half * HALF).cast::<__m128i>();
        let (mut acc, mut mins) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
        for _ in 0..nb {
            // SAFETY (the whole loop body): the pointers stand at this block, inside the slices
            // checked above (the half's 32 bytes of a group's 64, its eight of sixteen scales and
            // minimums; rows `at.first..+R` of the pass's). Loads are unaligned.
            unsafe {
                let w_scale = _mm256_cvtph_ps(_mm_loadu_si128(eight(ws)));
                let w_unmagic = _mm256_mul_ps(w_scale, _mm256_set1_ps(-MAGIC));
                let group = |g: usize| _mm256_loadu_si256(wq.add(g * TILE * GROUP + half * HALF * GROUP).cast());
                // Row `r`'s four quants of group `g`, in every lane.
                let quants = |r: usize, g: usize| {
                    _mm256_set1_epi32(xq.add(r * BLOCK + g * GROUP).cast::<i32>().read_unaligned())
                };
                // Each row's block dot product as the bits of `MAGIC + dot`, as `vpdpbusd`'s chain ends.
                let dots: [__m256i; R] = if NIBBLES {
                    // Nibbles (0 to 15) times quants: a pair's sum is at most 2 x 15 x 128 in size,
                    // so all eight groups' add up in 16 bits before one widening.
                    let mut pairs = [_mm256_setzero_si256(); R];
                    for g in 0..BLOCK / GROUP / 2 {
                        let packed = group(g);
                        let (lo, hi) = (
                            _mm256_and_si256(packed, nibble),
                            _mm256_and_si256(_mm256_srli_epi16::<4>(packed), nibble),
                        );
                        for (r, pairs) in pairs.iter_mut().enumerate() {
                            *pairs = _mm256_add_epi16(*pairs, _mm256_maddubs_epi16(lo, quants(r, g)));
                            *pairs = _mm256_add_epi16(*pairs, _mm256_maddubs_epi16(hi, quants(r, g + 4)));
                        }
                    }
                    from_fn(|r| _mm256_add_epi32(_mm256_madd_epi16(pairs[r], ones), magic))
                } else {
                    // Quants back to signed (the layout's +128 off), then |w| times the row's
                    // quant with w's sign: a pair's sum is at most 2 x 128 x 127, below 2^15
                    // (activation quants are at most 127 in size).
                    let mut dots = [magic; R];
                    for g in 0..BLOCK / GROUP {
                        let signed = _mm256_xor_si256(group(g), flip);
                        let size = _mm256_abs_epi8(signed);
                        for (r, dot) in dots.iter_mut().enumerate() {
                            let pairs = _mm256_maddubs_epi16(size, _mm256_sign_epi8(quants(r, g), signed));
                            *dot = _mm256_add_epi32(*dot, _mm256_madd_epi16(pairs, ones));
                        }
                    }
                    dots
                };
                for r in 0..R {
                    let scaled = _mm256_fmadd_ps(_mm256_castsi256_ps(dots[r]), w_scale, w_unmagic);
                    acc[r] = _mm256_fmadd_ps(scaled, _mm256_set1_ps(*xs.add(r)), acc[r]);
                }
                if NIBBLES {
                    let w_min = _mm256_cvtph_ps(_mm_loadu_si128(eight(wm)));
                    for (r, mins) in mins.iter_mut().enumerate() {
                        *mins = _mm256_fmadd_ps(w_min, _mm256_set1_ps(*xm.add(r)), *mins);
                    }
                    (wm, xm) = (wm.add(1), xm.add(pass));
                }
                wq = wq.add(block_bytes);
                ws = ws.add(1);
                (xq, xs) = (xq.add(pass * BLOCK), xs.add(pass));
            }
        }
        if NIBBLES {
            acc = from_fn(|r| _mm256_add_ps(acc[r], mins[r]));
        }
        for (r, acc) in acc.iter().enumerate() {
            let mut sums = [0f32; HALF];
            // SAFETY: eight floats of our own; the caller's promise for row `r`'s `cols` outputs.
            unsafe {
                _mm256_storeu_ps(sums.as_mut_ptr(), *acc);
                std::ptr::copy_nonoverlapping(sums.as_ptr(), out.add(r * stride), cols);
            }
        }
    }

    /// [`super::quantize_block`] on AVX2, the same bits: the scale from the largest size, each
    /// quant rounded half to even (the conversion's rounding), packed in order.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `q` is 32 writable bytes (not necessarily initialized).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_block(x: &[f32; BLOCK], q: *mut [i8; BLOCK]) -> (f32, i32, f32) {
        // SAFETY: 32 floats, loaded unaligned as four eights.
        let v: [__m256; 4] = from_fn(|i| unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * i)) });
        let size = |v: __m256| _mm256_andnot_ps(_mm256_set1_ps(-0.0), v);
        let m = _mm256_max_ps(_mm256_max_ps(size(v[0]), size(v[1])), _mm256_max_ps(size(v[2]), size(v[3])));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        // Conversion rounds as MXCSR says: to nearest, ties to even.
        let qi: [__m256i; 4] = from_fn(|i| _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id)));
        let total = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
        let total = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256::<1>(total));
        let total = _mm_add_epi32(total, _mm_shuffle_epi32::<0b01_00_11_10>(total));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(total, _mm_shuffle_epi32::<0b10_11_00_01>(total)));
        // The packs work within 128-bit lanes, leaving the eight fours of bytes in the order
        // 0, 2, 4, 6, 1, 3, 5, 7: the permute puts them back.
        let bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: 32 bytes, the caller's.
        unsafe { _mm256_storeu_si256(q.cast(), bytes) };
        (f16::from_f32(d).to_f32(), sum, f16::from_f32(d * sum as f32).to_f32())
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod avx2 {
    use super::{BLOCK, PassRef, TileRef};

    pub(super) unsafe fn pass(_: TileRef, _: PassRef, _: usize, _: bool, _: *mut f32, _: usize, _: usize) {
        unreachable!("Int8Weights are only made where `available` is true")
    }

    pub(super) unsafe fn quantize_block(_: &[f32; BLOCK], _: *mut [i8; BLOCK]) -> (f32, i32, f32) {
        unreachable!("Int8Weights are only made where `available` is true")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The module docs' quantization in scalar code: (quants, scales, scaled sums) per block.
    fn scalar_quantize(x: &[f32]) -> (Vec<[i8; BLOCK]>, Vec<f32>, Vec<f32>) {
        let (mut quants, mut scales, mut scaled_sums) = (Vec::new(), Vec::new(), Vec::new());
        for block in x.chunks_exact(BLOCK) {
            let amax = block.iter().fold(0f32, |a, &v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let q: [i8; BLOCK] = std::array::from_fn(|i| (block[i] * id).round_ties_even() as i8);
            let sum: i32 = q.iter().map(|&v| v as i32).sum();
            quants.push(q);
            scales.push(f16::from_f32(d).to_f32());
            scaled_sums.push(f16::from_f32(d * sum as f32).to_f32());
        }
        (quants, scales, scaled_sums)
    }

    /// The module docs' sequence, one output at a time, in scalar code, from the GGUF blocks.
    fn scalar_model(w: &QTensor, x: &[f32], n: usize, k: usize) -> Vec<f32> {
        let data = w.data().unwrap();
        let nb = k / BLOCK;
        let (quants, scales, scaled_sums) = scalar_quantize(x);
        let half = |block: &[u8], at: usize| f16::from_le_bytes([block[at], block[at + 1]]).to_f32();
        let mut out = Vec::new();
        for r in 0..x.len() / k {
            for c in 0..n {
                let (mut acc, mut mins) = (0f32, 0f32);
                for b in 0..nb {
                    let (xq, x_scale) = (&quants[r * nb + b], scales[r * nb + b]);
                    match w.dtype() {
                        GgmlDType::Q8_0 => {
                            let block = &data[(c * nb + b) * Q8_0_BYTES..][..Q8_0_BYTES];
                            let dot: i32 = block[2..].iter().zip(xq).map(|(&w, &x)| w as i8 as i32 * x as i32).sum();
                            acc = (dot as f32 * half(block, 0)).mul_add(x_scale, acc);
                        }
                        _ => {
                            let block = &data[(c * nb + b) * Q4_1_BYTES..][..Q4_1_BYTES];
                            let value =
                                |i: usize| (if i < 16 { block[4 + i] & 15 } else { block[4 + i - 16] >> 4 }) as i32;
                            let dot: i32 = (0..BLOCK).map(|i| value(i) * xq[i] as i32).sum();
                            acc = (dot as f32 * half(block, 0)).mul_add(x_scale, acc);
                            mins = half(block, 2).mul_add(scaled_sums[r * nb + b], mins);
                        }
                    }
                }
                out.push(if w.dtype() == GgmlDType::Q8_0 { acc } else { acc + mins });
            }
        }
        out
    }

    fn weights(n: usize, k: usize, dtype: GgmlDType) -> QTensor {
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
        QTensor::quantize(&w, dtype).unwrap()
    }

    fn flat(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    const FORMATS: [GgmlDType; 2] = [GgmlDType::Q8_0, GgmlDType::Q4_1];

    /// The kernels this CPU runs, every one of which a test checks; the test reports the ones it
    /// skips.
    fn isas() -> Vec<Isa> {
        let isas = Isa::here();
        for (isa, name) in [(Isa::Avx512Vnni, "AVX-512 VNNI"), (Isa::Avx2, "AVX2/FMA/F16C")] {
            crate::model::kernel_check::report(isas.contains(&isa), name);
        }
        isas
    }

    /// Every format on every kernel this CPU runs.
    fn cases() -> Vec<(GgmlDType, Isa)> {
        FORMATS.into_iter().flat_map(|d| isas().into_iter().map(move |i| (d, i))).collect()
    }

    /// How many outputs differ from the wanted ones in any bit.
    fn differing_bits(got: &[f32], want: &[f32]) -> usize {
        got.iter().zip(want).filter(|(a, b)| a.to_bits() != b.to_bits()).count()
    }

    #[test]
    fn every_output_is_the_scalar_sequence_bit_for_bit_whatever_the_number_of_rows_and_the_kernels() {
        // The default model's widths, an input that is no multiple of 256, and partial tiles
        // (18: two columns past a tile, 40: eight, 5: under half a tile).
        for (dtype, (n, k)) in
            FORMATS.into_iter().flat_map(|d| [(960, 576), (576, 1536), (18, 64), (40, 96), (5, 32)].map(|s| (d, s)))
        {
            let q = weights(n, k, dtype);
            for isa in isas() {
                let ours = Int8Weights::for_isa(&q, isa).unwrap();
                for m in [1, 2, 3, 5, 7, 8, 9, 17, 33, 130] {
                    let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
                    let want = scalar_model(&q, &flat(&x), n, k);
                    let got = flat(&ours.forward(&x).unwrap());
                    let differ = differing_bits(&got, &want);
                    assert_eq!(
                        differ,
                        0,
                        "{isa:?} {dtype:?} {n}x{k}, {m} rows: {differ} of {} outputs differ",
                        got.len()
                    );
                }
            }
        }
    }

    #[test]
    fn the_largest_dot_products_a_block_can_hold_stay_exact() {
        // Every activation quant at 127 and every weight quant at the end of its range (Q8_0:
        // -127 or 127; Q4_1: 0 and 15 in turn), so each block's dot product is as large as it
        // gets (32 x 127 x 127 for Q8_0): the chains' float trick must hold there too.
        let (n, k, m) = (32, 128, 9);
        let x = Tensor::ones((m, k), candle_core::DType::F32, &Device::Cpu).unwrap();
        for dtype in FORMATS {
            for sign in [1f32, -1.0] {
                let value = |i: usize| if dtype == GgmlDType::Q4_1 && i.is_multiple_of(2) { 0.0 } else { sign };
                let w = Tensor::from_vec((0..n * k).map(value).collect(), (n, k), &Device::Cpu).unwrap();
                let q = QTensor::quantize(&w, dtype).unwrap();
                let want = scalar_model(&q, &flat(&x), n, k);
                for isa in isas() {
                    let got = flat(&Int8Weights::for_isa(&q, isa).unwrap().forward(&x).unwrap());
                    let differ = differing_bits(&got, &want);
                    assert_eq!(differ, 0, "{isa:?} {dtype:?}, sign {sign}: {differ} outputs differ");
                }
            }
        }
    }

    #[test]
    fn rows_quantized_as_they_are_made_give_the_bits_of_the_same_rows_in_memory() {
        // Row counts off a pass of eight, on this thread and (300 x 576 values) across the pool.
        for m in [1, 13, 300] {
            let x: Vec<f32> =
                Tensor::randn(0f32, 1.0, (m, 576), &Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let made = |range: std::ops::Range<usize>, out: &mut [f32]| {
                assert_eq!(out.len(), range.len() * 576, "a buffer as long as the rows asked for");
                out.copy_from_slice(&x[range.start * 576..range.end * 576]);
            };
            for (dtype, isa) in cases() {
                let ours = Int8Weights::for_isa(&weights(40, 576, dtype), isa).unwrap();
                let whole = ours.forward(&Tensor::from_slice(&x, (m, 576), &Device::Cpu).unwrap()).unwrap();
                let as_made = ours.forward_rows(m, 576, &made).unwrap();
                let bits = |t: &Tensor| flat(t).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&as_made), bits(&whole), "{isa:?} {dtype:?}, {m} rows");
            }
        }
    }

    #[test]
    fn a_rows_output_does_not_depend_on_the_rows_beside_it() {
        let x = Tensor::randn(0f32, 1.0, (37, 576), &Device::Cpu).unwrap();
        for (dtype, isa) in cases() {
            let ours = Int8Weights::for_isa(&weights(100, 576, dtype), isa).unwrap();
            let all: Vec<Vec<f32>> = ours.forward(&x).unwrap().to_vec2().unwrap();
            for r in [0, 1, 7, 8, 15, 36] {
                let alone: Vec<Vec<f32>> = ours.forward(&x.narrow(0, r, 1).unwrap()).unwrap().to_vec2().unwrap();
                assert_eq!(alone[0], all[r], "{isa:?} {dtype:?}: row {r} alone differs from row {r} in a batch of 37");
            }
        }
    }

    #[test]
    fn the_result_is_the_product_with_the_dequantized_weights_within_activation_rounding() {
        let (n, k, m) = (48, 256, 5);
        let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
        for (dtype, isa) in cases() {
            let q = weights(n, k, dtype);
            let exact = flat(&x.matmul(&q.dequantize(&Device::Cpu).unwrap().t().unwrap()).unwrap());
            let got = flat(&Int8Weights::for_isa(&q, isa).unwrap().forward(&x).unwrap());
            // Activations rounded to a 254th of each block's range: about 0.1 over 256 terms of
            // unit variance.
            for (a, b) in got.iter().zip(&exact) {
                assert!((a - b).abs() < 0.5, "{dtype:?}: {a} against {b}");
            }
        }
    }
}
