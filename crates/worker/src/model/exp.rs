//! The exponential that attention's softmax and the sampler's weights take: evaluated in double
//! precision and rounded once, so it is within one ulp of glibc's `expf` (a single-precision
//! polynomial moved a near-tie in the model's greedy output away from llama.cpp's), and the same
//! bits on every path (AVX2, AVX-512 chosen at run time, portable): a row's softmax never depends
//! on the CPU feature that ran it.

/// Values [`exp8`] takes at once.
const LANES: usize = 8;

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

/// [`exp8`] of `x - max` for every chunk, each in one 8-lane double-precision register: the same
/// operations, so the same bits.
///
/// SAFETY: the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_shifted_avx512(chunks: &mut [[f32; LANES]], max: f32) {
    use std::arch::x86_64::*;
    for c in chunks {
        // SAFETY: eight floats in and out, unaligned.
        unsafe {
            let x = _mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), _mm256_set1_ps(max));
            let xd = _mm512_cvtps_pd(_mm256_max_ps(x, _mm256_set1_ps(EXP_LOWEST)));
            let n = _mm512_roundscale_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_pd(
                xd,
                _mm512_set1_pd(EXP_LOG2E),
            ));
            let r = _mm512_fnmadd_pd(n, _mm512_set1_pd(EXP_LN2_HI), xd);
            let r = _mm512_fnmadd_pd(n, _mm512_set1_pd(EXP_LN2_LO), r);
            let mut p = _mm512_set1_pd(EXP_C[11]);
            for &c in EXP_C[..11].iter().rev() {
                p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(c));
            }
            let n = _mm512_cvtepi32_epi64(_mm512_cvtpd_epi32(n));
            let scale = _mm512_castsi512_pd(_mm512_slli_epi64::<52>(_mm512_add_epi64(n, _mm512_set1_epi64(1023))));
            _mm256_storeu_ps(c.as_mut_ptr(), _mm512_cvtpd_ps(_mm512_mul_pd(p, scale)));
        }
    }
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

/// `exp(x - max)` of every value through [`exp8`], `max` the row's largest, which it returns.
pub(crate) fn exp_shifted(row: &mut [f32]) -> f32 {
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
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present (checked at run time).
        unsafe { exp_shifted_avx512(chunks, max) };
    } else {
        for c in chunks.iter_mut() {
            *c = exp8(c.map(|x| x - max));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    for c in chunks.iter_mut() {
        *c = exp8(c.map(|x| x - max));
    }
    if !rest.is_empty() {
        let mut tail = [f32::NEG_INFINITY; LANES]; // exp gives 0 there; discarded anyway
        tail[..rest.len()].copy_from_slice(rest);
        let e = exp8(tail.map(|x| x - max));
        rest.copy_from_slice(&e[..rest.len()]);
    }
    max
}

#[cfg(test)]
mod tests {
    use std::array::from_fn;

    use super::*;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn exp8_agrees_with_libm_to_one_ulp_and_underflows_to_zero() {
        // Every 997th float in [-104, 0]; the full sweep is in exp8's doc.
        let (mut bits, mut differ, mut total) = (0x8000_0000u32, 0, 0);
        loop {
            let xs: [f32; LANES] = from_fn(|l| f32::from_bits(bits + l as u32 * 997));
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
        let xs: [f32; LANES] = from_fn(|l| -(l as f32) * 13.37 - 0.123);
        assert_eq!(exp8(xs).map(f32::to_bits), exp8_portable(xs).map(f32::to_bits), "the portable path's bits");
        assert_eq!(exp8([0.0; LANES]), [1.0; LANES]);
    }

    #[test]
    fn a_row_shifted_and_exponentiated_gets_exp8s_bits_on_every_path() {
        // Every 991st float in [-110, 0], a row led by its maximum (0) and ending mid-chunk.
        let mut row = vec![0f32];
        let mut at = 0x8000_0001u32;
        while f32::from_bits(at) >= -110.0 {
            row.push(f32::from_bits(at));
            at += 991;
        }
        while row.len() % LANES != 3 {
            row.push(-1.5); // a tail of three
        }
        let expected: Vec<f32> = row.iter().map(|&x| exp8([x; LANES])[0]).collect();
        let mut got = row.clone();
        exp_shifted(&mut got);
        assert!(bits(&got) == bits(&expected), "exp_shifted differs from exp8");
    }

    /// Every float in [-104, 0] (1.12 billion; seconds in release): the count in [`exp8`]'s doc.
    /// `cargo test --release -p bellows-worker --lib exp8_on_every_float -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn exp8_on_every_float_is_within_one_ulp_of_libm() {
        let (mut bits, mut differ, mut total) = (0x8000_0000u32, 0u64, 0u64);
        while f32::from_bits(bits + LANES as u32 - 1) >= -104.0 {
            let xs: [f32; LANES] = from_fn(|l| f32::from_bits(bits + l as u32));
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
}
