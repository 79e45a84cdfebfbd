//! SwiGLU's gate in one pass: `silu(gate) * up`, read straight from the fused gate-and-up matmul's
//! output. Candle's ops would copy each half out, run SiLU into a new tensor and multiply into a
//! third: three passes and three allocations a layer. The arithmetic is candle's, `g / (1 +
//! exp(-g))` then `* u` in f32, so the bits are the same (a test holds it to candle's ops), and
//! each value depends on its own row alone.
//!
//! Candle's `exp` is the C library's `expf`, one call a value (a scalar call the compiler cannot
//! vectorize: as much time as the rest of the layer's element-wise work). On AVX-512, sixteen at a
//! time here replay the very operations of glibc's `expf` on CPUs with FMA (`__expf_fma`, the
//! variant glibc picks on every CPU this build runs on): the same table, constants, fused
//! multiply-adds and roundings, so the same bits; inputs outside its fast path (beyond ±88, not a
//! number) go to `expf` itself. A test holds the two to the same bits over every 61st float, and
//! an ignored one over all of them.

use anyhow::{Result, ensure};
use candle_core::{CpuStorage, Device, Storage, Tensor};

/// `silu(y[.., ..width]) * y[.., width..]` for `y` of shape `(rows, 2 * width)`: shape
/// `(rows, width)`. Host tensors of f32 take the one pass; any other (a device's) takes candle's ops.
pub fn silu_gate(y: &Tensor, width: usize) -> Result<Tensor> {
    let (rows, both) = y.dims2()?;
    ensure!(both == 2 * width, "a gate and an up of {width} each, not {both} columns");
    let out = {
        let (storage, layout) = y.storage_and_layout();
        match (&*storage, layout.contiguous_offsets()) {
            (Storage::Cpu(CpuStorage::F32(v)), Some((start, end))) => Some(gate(&v[start..end], width)),
            _ => None,
        }
    };
    match out {
        Some(out) => Ok(Tensor::from_vec(out, (rows, width), &Device::Cpu)?),
        None => {
            let (g, u) = (y.narrow(1, 0, width)?.contiguous()?, y.narrow(1, width, width)?.contiguous()?);
            Ok((candle_nn::ops::silu(&g)? * u)?)
        }
    }
}

/// The gated values of rows of `[gate | up]`, many rows split across candle's pool.
fn gate(y: &[f32], width: usize) -> Vec<f32> {
    super::rows::map_rows(y.len() / (2 * width), width, |range, dst| {
        let src = &y[range.start * 2 * width..range.end * 2 * width];
        for (o, row) in dst.chunks_exact_mut(width).zip(src.chunks_exact(2 * width)) {
            let (g, u) = row.split_at(width);
            gate_row(g, u, o);
        }
    })
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

/// glibc's `__expf_fma` table: 2^(i/32) as f64 bits, less `i << 47` (`__exp2f_data.tab`).
const EXPF_TABLE: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];
/// Its 32 / ln 2 and its rounding shift, 1.5 * 2^52.
const EXPF_INV_LN2_N: f64 = f64::from_bits(0x40471547652b82fe);
const EXPF_SHIFT: f64 = f64::from_bits(0x4338000000000000);
/// Its polynomial for 2^(r/32) - 1: the cube's, the square's and the linear coefficient.
const EXPF_POLY: [f64; 3] =
    [f64::from_bits(0x3ebc6af84b912394), f64::from_bits(0x3f2ebfce50fac4f3), f64::from_bits(0x3f962e42ff0c52d6)];
/// Inputs whose exponent bits (the top 12 less the sign) reach 88.0's leave its fast path.
const EXPF_FAST_BELOW: i32 = 0x42b;

/// [`gate_row`] sixteen values at a time; returns how many it did (whole sixteens).
///
/// SAFETY: the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gate_row_avx512(g: &[f32], u: &[f32], o: &mut [f32]) -> usize {
    use std::arch::x86_64::*;
    let n = g.len().min(u.len()).min(o.len()) / 16 * 16;
    // SAFETY: eight of the table's 32 entries from `i`, for `i` in 0, 8, 16, 24.
    let tab = |i: usize| unsafe { _mm512_loadu_si512(EXPF_TABLE[i..i + 8].as_ptr().cast()) };
    let (t0, t1, t2, t3) = (tab(0), tab(8), tab(16), tab(24));
    let (inv, shift, one) = (_mm512_set1_pd(EXPF_INV_LN2_N), _mm512_set1_pd(EXPF_SHIFT), _mm512_set1_pd(1.0));
    let [c0, c1, c2] = EXPF_POLY.map(|c| _mm512_set1_pd(c));
    // `__expf_fma`'s fast path on eight lanes, step for step.
    let exp8 = |x: __m256| {
        let xd = _mm512_cvtps_pd(x);
        let z = _mm512_fmadd_pd(inv, xd, shift);
        let ki = _mm512_castpd_si512(z);
        let r = _mm512_fmsub_pd(inv, xd, _mm512_sub_pd(z, shift));
        let idx = _mm512_and_si512(ki, _mm512_set1_epi64(31));
        let low = _mm512_permutex2var_epi64(t0, idx, t1);
        let high = _mm512_permutex2var_epi64(t2, idx, t3);
        let t = _mm512_mask_blend_epi64(_mm512_test_epi64_mask(idx, _mm512_set1_epi64(16)), low, high);
        let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
        let p = _mm512_fmadd_pd(c0, r, c1);
        let y = _mm512_fmadd_pd(c2, r, one);
        _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_fmadd_pd(p, _mm512_mul_pd(r, r), y), s))
    };
    for i in (0..n).step_by(16) {
        // SAFETY: sixteen values at `i` in each slice (`i + 16 <= n`).
        unsafe {
            let gv = _mm512_loadu_ps(g.as_ptr().add(i));
            let x = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), _mm512_set1_epi32(i32::MIN)));
            let lo = exp8(_mm512_castps512_ps256(x));
            let hi = exp8(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x))));
            let mut e = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                _mm512_castps_pd(_mm512_castps256_ps512(lo)),
                _mm256_castps_pd(hi),
            ));
            let top = _mm512_and_si512(_mm512_srli_epi32::<20>(_mm512_castps_si512(x)), _mm512_set1_epi32(0x7ff));
            let slow = _mm512_cmpge_epi32_mask(top, _mm512_set1_epi32(EXPF_FAST_BELOW));
            if slow != 0 {
                // Beyond ±88 or not a number: `expf` itself, lane by lane.
                let mut lanes = [0f32; 16];
                _mm512_storeu_ps(lanes.as_mut_ptr(), e);
                for (l, v) in lanes.iter_mut().enumerate().filter(|(l, _)| slow & (1 << l) != 0) {
                    *v = (-g[i + l]).exp();
                }
                e = _mm512_loadu_ps(lanes.as_ptr());
            }
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
        // The edges of expf's fast path and its special cases, side by side in one vector.
        let g = [
            0.0,
            -0.0,
            88.0,
            -88.0,
            87.99,
            -88.73,
            103.28,
            103.98,
            110.0,
            -110.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
        ];
        let mut o = [0f32; 16];
        gate_row(&g, &[1.0; 16], &mut o);
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
