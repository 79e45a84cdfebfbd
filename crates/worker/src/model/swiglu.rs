//! SwiGLU's gate in one pass: `silu(gate) * up`, read straight from the fused gate-and-up matmul's
//! output. Candle's ops would copy each half out, run SiLU into a new tensor and multiply into a
//! third: three passes and three allocations a layer. The arithmetic is candle's, `g / (1 +
//! exp(-g))` then `* u` in f32, so the bits are the same (a test holds it to candle's ops), and
//! each value depends on its own row alone.
//!
//! Candle's `exp` is the C library's `expf`, one call a value (a scalar call the compiler cannot
//! vectorize: as much time as the rest of the layer's element-wise work). On AVX-512, sixteen at a
//! time here take `model::exp`'s vector `expf`, the same bits. A test holds the gate to the
//! scalar formula's bits over every 61st float, and an ignored one over all of them.

use anyhow::{Result, ensure};
use candle_core::{Device, Tensor};

use super::rows::{RowFill, map_rows};

/// `silu(y[.., ..width]) * y[.., width..]` for `y` of shape `(rows, 2 * width)`: shape
/// `(rows, width)`. Host tensors of f32 take the one pass; any other (a device's) takes candle's ops.
pub fn silu_gate(y: &Tensor, width: usize) -> Result<Tensor> {
    let gated = with_rows(y, width, |rows, fill| {
        Ok(Tensor::from_vec(map_rows(rows, width, fill), (rows, width), &Device::Cpu)?)
    })?;
    match gated {
        Some(out) => Ok(out),
        None => {
            let (g, u) = (y.narrow(1, 0, width)?.contiguous()?, y.narrow(1, width, width)?.contiguous()?);
            Ok((candle_nn::ops::silu(&g)? * u)?)
        }
    }
}

/// `consume(rows, fill)`, where `fill` writes any of the gated rows of `y` (`(rows, 2 * width)`),
/// for whoever takes them next (a buffer, or a matmul's quantization as they are made): a host
/// f32 tensor only, else `None` (the caller takes candle's ops).
pub fn with_rows<T>(
    y: &Tensor,
    width: usize,
    consume: impl FnOnce(usize, &RowFill<'_>) -> Result<T>,
) -> Result<Option<T>> {
    let (rows, both) = y.dims2()?;
    ensure!(both == 2 * width, "a gate and an up of {width} each, not {both} columns");
    super::rows::on_host(y, |y| {
        consume(rows, &|range: std::ops::Range<usize>, dst: &mut [f32]| {
            let src = &y[range.start * 2 * width..range.end * 2 * width];
            for (o, row) in dst.chunks_exact_mut(width).zip(src.chunks_exact(2 * width)) {
                let (g, u) = row.split_at(width);
                gate_row(g, u, o);
            }
        })
    })
    .transpose()
}

/// `o = g / (1 + exp(-g)) * u`, element by element.
fn gate_row(g: &[f32], u: &[f32], o: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present (checked at run time).
        done = unsafe { gate_row_avx512(g, u, o) };
    }
    for ((o, &g), &u) in o.iter_mut().zip(g).zip(u).skip(done) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

/// [`gate_row`] sixteen values at a time; returns how many it did (whole sixteens).
///
/// SAFETY: the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gate_row_avx512(g: &[f32], u: &[f32], o: &mut [f32]) -> usize {
    use std::arch::x86_64::*;

    use super::exp::expf16_avx512;
    let n = g.len().min(u.len()).min(o.len()) / 16 * 16;
    for i in (0..n).step_by(16) {
        // SAFETY: sixteen values at `i` in each slice (`i + 16 <= n`); AVX-512F (the caller's).
        unsafe {
            let gv = _mm512_loadu_ps(g.as_ptr().add(i));
            let x = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), _mm512_set1_epi32(i32::MIN)));
            let e = expf16_avx512(x);
            let up = _mm512_loadu_ps(u.as_ptr().add(i));
            let gated = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0), e)), up);
            _mm512_storeu_ps(o.as_mut_ptr().add(i), gated);
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candle_gate(y: &Tensor, width: usize) -> Vec<f32> {
        let (g, u) = (y.narrow(1, 0, width).unwrap().contiguous().unwrap(), y.narrow(1, width, width).unwrap());
        let out = (candle_nn::ops::silu(&g).unwrap() * u.contiguous().unwrap()).unwrap();
        out.flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn the_one_pass_gate_gives_candles_bits_for_a_few_rows_and_for_many() {
        // 3 rows of 37: on this thread; 64 rows of 1,536: across the pool (and past
        // saturation: values up to 40 in size, where exp overflows or vanishes).
        for (rows, width, spread) in [(3, 37, 4.0), (64, 1536, 40.0)] {
            let y = (Tensor::randn(0f32, 1.0, (rows, 2 * width), &Device::Cpu).unwrap() * spread).unwrap();
            let ours = silu_gate(&y, width).unwrap();
            assert_eq!(ours.dims(), [rows, width]);
            let ours: Vec<u32> =
                ours.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
            let theirs: Vec<u32> = candle_gate(&y, width).iter().map(|x| x.to_bits()).collect();
            assert!(ours == theirs, "{rows}x{width}: the gate differs from candle's silu then multiply");
        }
    }

    /// SiLU of floats `0, step, 2 * step, ...` (as bits, sixteen at a time) through [`gate_row`]
    /// with `u = 1`, against the scalar formula on libm's `expf`; returns how many it checked.
    fn gate_matches_libm(step: u64) -> u64 {
        let (mut bits, mut checked) = (0u64, 0);
        let (ones, mut g, mut o) = ([1f32; 16], [0f32; 16], [0f32; 16]);
        while bits + 15 * step <= u32::MAX as u64 {
            for (l, g) in g.iter_mut().enumerate() {
                *g = f32::from_bits((bits + l as u64 * step) as u32);
            }
            gate_row(&g, &ones, &mut o);
            assert_same_silu(&g, &o);
            bits += 16 * step;
            checked += 16;
        }
        checked
    }

    fn assert_same_silu(g: &[f32], o: &[f32]) {
        for (&g, &o) in g.iter().zip(o) {
            let expected = g / (1.0 + (-g).exp());
            assert!(
                o.to_bits() == expected.to_bits() || (o.is_nan() && expected.is_nan()),
                "silu({g}) = {o}, not {expected}"
            );
        }
    }

    #[test]
    fn the_vector_exp_gives_libms_bits_across_the_floats() {
        // Every 61st float of all 2^32: both signs, tiny to huge, infinities' neighbours, NaNs.
        assert!(gate_matches_libm(61) > 70_000_000);
        // The edges of expf's fast path and its special cases, either sign (the gate takes
        // exp(-g)), side by side in whole vectors.
        let mut g: Vec<f32> = crate::model::exp::EDGES.iter().flat_map(|&x| [x, -x]).collect();
        g.resize(g.len().next_multiple_of(16), 0.0);
        let mut o = vec![0f32; g.len()];
        gate_row(&g, &vec![1.0; g.len()], &mut o);
        assert_same_silu(&g, &o);
    }

    /// All 2^32 floats (about a minute in release):
    /// `cargo test --release -p bellows-worker --lib every_float -- --ignored`
    #[test]
    #[ignore]
    fn the_vector_exp_gives_libms_bits_on_every_float() {
        assert_eq!(gate_matches_libm(1), 1 << 32);
    }

    #[test]
    fn a_gate_and_up_of_other_widths_is_refused() {
        let y = Tensor::zeros((2, 10), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(silu_gate(&y, 4).is_err());
    }
}
