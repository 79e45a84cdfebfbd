//! RMS norm of each row of the residual stream (and of each head, for Qwen3's and Gemma 3's q/k
//! norms), with candle's bits: `x / sqrt(sum(x²) / n + eps) * weight`, the sum of squares added
//! in element order from the first, in f32, exactly as candle's op computes it.
//!
//! Why our own: candle's op sums each row as one chain of dependent adds (its latency, not the
//! arithmetic, sets the pace), runs at most 32 rows on the calling thread while the other cores
//! wait, and splits more on rayon's pool, whose threads then spin beside the pool the matmuls
//! run on. Here eight rows' chains run side by side (each still in element order: the same
//! bits), and many rows split across candle's pool (see `rows`). A device's tensors keep
//! candle's op.

use std::array::from_fn;

use anyhow::{Result, ensure};
use candle_core::{Device, Tensor};

use super::rows::{RowFill, map_rows, on_host};

/// Rows whose sums of squares run side by side.
const SIDE_BY_SIDE: usize = 8;

/// RMS norm over the last dimension of `x`, scaled by `weight` (as wide as that dimension).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    let n = weight.dims1()?;
    let normed = with_rows(x, weight, eps, |rows, fill| {
        Ok(Tensor::from_vec(map_rows(rows, n, fill), x.shape(), &Device::Cpu)?)
    })?;
    match normed {
        Some(out) => Ok(out),
        None => Ok(candle_nn::ops::rms_norm(x, weight, eps)?),
    }
}

/// `consume(rows, fill)`, where `fill` writes any of `x`'s rows normed, for whoever takes them
/// next (a buffer, or a matmul's quantization as they are made): host f32 tensors only, else
/// `None` (the caller takes candle's op).
pub fn with_rows<T>(
    x: &Tensor,
    weight: &Tensor,
    eps: f32,
    consume: impl FnOnce(usize, &RowFill<'_>) -> Result<T>,
) -> Result<Option<T>> {
    let n = weight.dims1()?;
    ensure!(x.dim(candle_core::D::Minus1)? == n, "rows of {} for a norm of {n}", x.dim(candle_core::D::Minus1)?);
    let done = on_host(weight, |w| {
        on_host(x, |x| {
            consume(x.len() / n, &|range: std::ops::Range<usize>, dst: &mut [f32]| {
                norm_rows(&x[range.start * n..range.end * n], w, eps, dst)
            })
        })
    });
    done.flatten().transpose()
}

/// Every row of `x` (rows as wide as `weight`: a hidden state's, or a head's), normed.
pub fn rows(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let n = weight.len();
    map_rows(x.len() / n, n, |range, dst| norm_rows(&x[range.start * n..range.end * n], weight, eps, dst))
}

/// The rows of `src` normed into `dst`, eight rows' sums side by side.
fn norm_rows(src: &[f32], weight: &[f32], eps: f32, dst: &mut [f32]) {
    let n = weight.len();
    let group = SIDE_BY_SIDE * n;
    let whole = src.len() / group * group;
    for (s, d) in src[..whole].chunks_exact(group).zip(dst.chunks_exact_mut(group)) {
        scale_rows(s, weight, sums_of_squares::<SIDE_BY_SIDE>(s, n), eps, d);
    }
    for (s, d) in src[whole..].chunks_exact(n).zip(dst[whole..].chunks_exact_mut(n)) {
        scale_rows(s, weight, sums_of_squares::<1>(s, n), eps, d);
    }
}

/// Each of `R` rows' sum of squares, element by element from the first (candle's order), the
/// rows' chains side by side.
#[inline(always)]
fn sums_of_squares<const R: usize>(rows: &[f32], n: usize) -> [f32; R] {
    let rows: [&[f32]; R] = from_fn(|r| &rows[r * n..(r + 1) * n]);
    let mut sums = [0f32; R];
    #[allow(clippy::needless_range_loop)] // element-major: element `i` of every row, then `i + 1`
    for i in 0..n {
        for r in 0..R {
            let v = rows[r][i];
            sums[r] += v * v;
        }
    }
    sums
}

/// `dst = src / sqrt(sum / n + eps) * weight` for each row, with its sum of squares.
fn scale_rows<const R: usize>(src: &[f32], weight: &[f32], sums: [f32; R], eps: f32, dst: &mut [f32]) {
    let n = weight.len();
    for ((s, d), sum) in src.chunks_exact(n).zip(dst.chunks_exact_mut(n)).zip(sums) {
        let m = (sum / n as f32 + eps).sqrt();
        for ((d, &s), &w) in d.iter_mut().zip(s).zip(weight) {
            *d = s / m * w;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
    }

    /// Values over many magnitudes and both signs, so sums round differently in another order.
    fn values(count: usize, seed: u32) -> Vec<f32> {
        (0..count as u32)
            .map(|i| {
                let h = (i ^ seed).wrapping_mul(2_654_435_761).rotate_left(13).wrapping_mul(40_503);
                let mantissa = (h % 10_000) as f32 / 997.0 - 5.0;
                mantissa * 10f32.powi((h >> 20) as i32 % 7 - 3)
            })
            .collect()
    }

    #[test]
    fn every_row_gets_candles_bits_whatever_the_rows_beside_it() {
        // Row counts around a group of eight, on this thread and across the pool (200 x 576 is
        // past the pool's threshold); widths of a hidden state, a head, and an odd one.
        for (rows, n) in [(1, 576), (7, 576), (8, 64), (9, 37), (21, 64), (200, 576)] {
            let x = Tensor::from_vec(values(rows * n, rows as u32), (rows, n), &Device::Cpu).unwrap();
            let w = Tensor::from_vec(values(n, 7), n, &Device::Cpu).unwrap();
            let ours = rms_norm(&x, &w, 1e-5).unwrap();
            let candles = candle_nn::ops::rms_norm(&x, &w, 1e-5).unwrap();
            assert_eq!(bits(&ours), bits(&candles), "{rows} rows of {n}");
            // Row r alone gets the bits it got among the others.
            let r = rows / 2;
            let alone = rms_norm(&x.narrow(0, r, 1).unwrap(), &w, 1e-5).unwrap();
            assert_eq!(bits(&alone), bits(&ours.narrow(0, r, 1).unwrap()), "row {r} of {rows} alone");
        }
    }

    #[test]
    fn a_row_of_zeros_is_zero_and_a_three_dimensional_input_keeps_its_shape() {
        let x = Tensor::zeros((2, 3, 64), candle_core::DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::ones(64, candle_core::DType::F32, &Device::Cpu).unwrap();
        let y = rms_norm(&x, &w, 1e-6).unwrap();
        assert_eq!(y.dims(), &[2, 3, 64]);
        assert!(y.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().all(|&v| v == 0.0));
    }

    #[test]
    fn a_weight_of_the_wrong_width_is_an_error() {
        let x = Tensor::zeros((2, 64), candle_core::DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::ones(63, candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(rms_norm(&x, &w, 1e-6).is_err());
    }
}
