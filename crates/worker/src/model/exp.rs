//! The exponential that attention's softmax, the sampler's weights and SwiGLU's gate take: the C
//! library's `expf`, bit for bit, many values at once.
//!
//! glibc's `expf` on CPUs with FMA (`__expf_fma`, the variant glibc picks on every CPU this build
//! runs on) evaluates in double precision: a 32-entry table of 2^(i/32), a cubic for the rest,
//! one rounding to f32. The vector paths here replay its fast path step for step (the same
//! table, constants, fused multiply-adds and roundings), sixteen values at a time on AVX-512 and
//! eight on AVX2, so the same bits; inputs outside that fast path (beyond ±88, not a number) go
//! to `expf` itself, except those below -104, whose `expf` is 0. A softmax or a sampler's weights
//! so never depend on the CPU feature that computed them, and stay what the scalar `expf` gave
//! (with which the engine's greedy output was first matched to llama.cpp's). An earlier
//! evaluation (an 11-term Taylor series in double precision) was within one ulp of `expf` and
//! took three times the multiply-adds: a fifth of a conversation turn's attention.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// glibc's `__expf_fma` table: 2^(i/32) as f64 bits, less `i << 47` (`__exp2f_data.tab`).
const TABLE: [u64; 32] = [
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
const INV_LN2_N: f64 = f64::from_bits(0x40471547652b82fe);
const SHIFT: f64 = f64::from_bits(0x4338000000000000);
/// Its polynomial for 2^(r/32) - 1: the cube's, the square's and the linear coefficient.
const POLY: [f64; 3] =
    [f64::from_bits(0x3ebc6af84b912394), f64::from_bits(0x3f2ebfce50fac4f3), f64::from_bits(0x3f962e42ff0c52d6)];
/// Inputs whose exponent bits (the top 12 less the sign) reach 88.0's leave its fast path.
const FAST_BELOW: i32 = 0x42b;
/// Below this, `expf` is 0 (exp(-104) is under half the least subnormal float).
const ZERO_BELOW: f32 = -104.0;

/// `expf` of sixteen values, its bits in every lane.
///
/// SAFETY: the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn expf16_avx512(x: __m512) -> __m512 {
    let lo = expf8_fast_avx512(_mm512_castps512_ps256(x));
    let hi = expf8_fast_avx512(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x))));
    let e =
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi)));
    let zero = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(ZERO_BELOW));
    let e = _mm512_mask_blend_ps(zero, e, _mm512_setzero_ps());
    let top = _mm512_and_si512(_mm512_srli_epi32::<20>(_mm512_castps_si512(x)), _mm512_set1_epi32(0x7ff));
    let slow = _mm512_cmpge_epi32_mask(top, _mm512_set1_epi32(FAST_BELOW)) & !zero;
    if slow == 0 {
        return e;
    }
    let (mut xs, mut es) = ([0f32; 16], [0f32; 16]);
    // SAFETY: sixteen floats each, unaligned.
    unsafe {
        _mm512_storeu_ps(xs.as_mut_ptr(), x);
        _mm512_storeu_ps(es.as_mut_ptr(), e);
    }
    for (l, e) in es.iter_mut().enumerate().filter(|(l, _)| slow & (1 << l) != 0) {
        *e = xs[l].exp();
    }
    // SAFETY: sixteen floats, unaligned.
    unsafe { _mm512_loadu_ps(es.as_ptr()) }
}

/// `__expf_fma`'s fast path on eight lanes in one double register, step for step (lanes outside
/// it are wrong: [`expf16_avx512`] replaces them).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn expf8_fast_avx512(x: __m256) -> __m256 {
    // SAFETY: eight of the table's 32 entries from `i`, for `i` in 0, 8, 16, 24.
    let tab = |i: usize| unsafe { _mm512_loadu_si512(TABLE[i..i + 8].as_ptr().cast()) };
    let xd = _mm512_cvtps_pd(x);
    let (inv, shift) = (_mm512_set1_pd(INV_LN2_N), _mm512_set1_pd(SHIFT));
    let z = _mm512_fmadd_pd(inv, xd, shift);
    let ki = _mm512_castpd_si512(z);
    let r = _mm512_fmsub_pd(inv, xd, _mm512_sub_pd(z, shift));
    let idx = _mm512_and_si512(ki, _mm512_set1_epi64(31));
    let low = _mm512_permutex2var_epi64(tab(0), idx, tab(8));
    let high = _mm512_permutex2var_epi64(tab(16), idx, tab(24));
    let t = _mm512_mask_blend_epi64(_mm512_test_epi64_mask(idx, _mm512_set1_epi64(16)), low, high);
    let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
    let [c0, c1, c2] = POLY.map(|c| _mm512_set1_pd(c));
    let p = _mm512_fmadd_pd(c0, r, c1);
    let y = _mm512_fmadd_pd(c2, r, _mm512_set1_pd(1.0));
    _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_fmadd_pd(p, _mm512_mul_pd(r, r), y), s))
}

/// `expf` of eight values, its bits in every lane: [`expf16_avx512`]'s steps in two 4-lane
/// double registers.
#[cfg(all(target_arch = "x86_64", target_feature = "fma", target_feature = "avx2"))]
#[inline]
fn expf8_avx2(x: [f32; 8]) -> [f32; 8] {
    // SAFETY: AVX2 and FMA are enabled at compile time (the cfg above); the gathers read entries
    // 0..32 of the table (indices masked to 5 bits); loads and stores are of whole arrays.
    unsafe {
        let xs = _mm256_loadu_ps(x.as_ptr());
        let (inv, shift) = (_mm256_set1_pd(INV_LN2_N), _mm256_set1_pd(SHIFT));
        let [c0, c1, c2] = POLY.map(|c| _mm256_set1_pd(c));
        let mut out = [0f32; 8];
        for (half, h) in [_mm256_castps256_ps128(xs), _mm256_extractf128_ps::<1>(xs)].into_iter().enumerate() {
            let xd = _mm256_cvtps_pd(h);
            let z = _mm256_fmadd_pd(inv, xd, shift);
            let ki = _mm256_castpd_si256(z);
            let r = _mm256_fmsub_pd(inv, xd, _mm256_sub_pd(z, shift));
            let idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
            let t = _mm256_i64gather_epi64::<8>(TABLE.as_ptr().cast(), idx);
            let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
            let p = _mm256_fmadd_pd(c0, r, c1);
            let y = _mm256_fmadd_pd(c2, r, _mm256_set1_pd(1.0));
            let e = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_fmadd_pd(p, _mm256_mul_pd(r, r), y), s));
            _mm_storeu_ps(out.as_mut_ptr().add(half * 4), e);
        }
        for (o, &x) in out.iter_mut().zip(&x) {
            if x < ZERO_BELOW {
                *o = 0.0;
            } else if ((x.to_bits() >> 20) & 0x7ff) as i32 >= FAST_BELOW {
                *o = x.exp();
            }
        }
        out
    }
}

/// The largest of `row` (negative infinity if empty), not-a-number values passed over: exact in
/// any order (but for the sign of a zero maximum, which no caller's result depends on), so on
/// AVX-512 through [`max_avx512`], else in sixteen lanes, then across them.
pub(crate) fn max(row: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present (checked at run time).
        return unsafe { max_avx512(row) };
    }
    max_in_lanes(row)
}

/// [`max`] in sixteen lanes, then across them one at a time.
fn max_in_lanes(row: &[f32]) -> f32 {
    let (chunks, rest) = row.as_chunks::<16>();
    let mut lanes = [f32::NEG_INFINITY; 16];
    for c in chunks {
        for l in 0..16 {
            lanes[l] = if c[l] > lanes[l] { c[l] } else { lanes[l] };
        }
    }
    lanes.iter().chain(rest).fold(f32::NEG_INFINITY, |m, &x| m.max(x))
}

/// [`max`] in four registers of sixteen lanes, the last few values through a masked load, and
/// across the lanes in registers. Attention's rows are a few hundred values: the portable
/// version's one-at-a-time fold of its lanes and its tail took longer than its vector loop, and
/// was 3.4% of a cold prefill's samples on one thread (0.7% now).
///
/// SAFETY: the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn max_avx512(row: &[f32]) -> f32 {
    // `_mm512_max_ps(x, m)` gives `m` where `x` is not a number, so those never enter a lane.
    let low = _mm512_set1_ps(f32::NEG_INFINITY);
    let (quads, rest) = row.as_chunks::<64>();
    let mut m = [low; 4];
    for q in quads {
        for (i, m) in m.iter_mut().enumerate() {
            // SAFETY: sixteen floats of the 64, unaligned.
            *m = _mm512_max_ps(unsafe { _mm512_loadu_ps(q.as_ptr().add(16 * i)) }, *m);
        }
    }
    let (sixteens, tail) = rest.as_chunks::<16>();
    for (i, c) in sixteens.iter().enumerate() {
        // SAFETY: sixteen floats, unaligned.
        m[i] = _mm512_max_ps(unsafe { _mm512_loadu_ps(c.as_ptr()) }, m[i]);
    }
    let mask = (1u32 << tail.len()) as u16 - 1;
    // SAFETY: the mask's lanes are the tail's floats; the others are not read (they take `low`).
    m[3] = _mm512_max_ps(unsafe { _mm512_mask_loadu_ps(low, mask, tail.as_ptr()) }, m[3]);
    _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])))
}

/// `exp(x - max)` of every value, `max` the row's largest, which it returns: `expf`'s bits,
/// sixteen or eight at a time where the CPU has the registers.
pub(crate) fn exp_shifted(row: &mut [f32]) -> f32 {
    let max = max(row);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present (checked at run time).
        done = unsafe { exp_shifted_avx512(row, max) };
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "fma", target_feature = "avx2"))]
    {
        let (chunks, _) = row[done..].as_chunks_mut::<8>();
        for c in chunks.iter_mut() {
            *c = expf8_avx2(c.map(|x| x - max));
        }
        done += chunks.len() * 8;
    }
    for x in &mut row[done..] {
        *x = (*x - max).exp();
    }
    max
}

/// [`exp_shifted`] sixteen values at a time, the last few through masked loads and stores (a
/// row's tail had gone to `expf` one value at a time); returns how many values it did: all.
///
/// SAFETY: the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_shifted_avx512(row: &mut [f32], max: f32) -> usize {
    let (chunks, tail) = row.as_chunks_mut::<16>();
    for c in chunks.iter_mut() {
        // SAFETY: sixteen floats in and out, unaligned.
        unsafe {
            let x = _mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), _mm512_set1_ps(max));
            _mm512_storeu_ps(c.as_mut_ptr(), expf16_avx512(x));
        }
    }
    if !tail.is_empty() {
        let mask = (1u16 << tail.len()) - 1;
        // SAFETY: the mask's lanes are the tail's floats; the others are neither read nor written
        // (their lanes hold zeros, whose exponential is computed and dropped).
        unsafe {
            let x = _mm512_sub_ps(_mm512_maskz_loadu_ps(mask, tail.as_ptr()), _mm512_set1_ps(max));
            _mm512_mask_storeu_ps(tail.as_mut_ptr(), mask, expf16_avx512(x));
        }
    }
    row.len()
}

/// The edges of `expf`'s fast path, of its zero and subnormal results, and its special cases: what
/// the tests of every vector exp put side by side.
#[cfg(test)]
pub(crate) const EDGES: [f32; 20] = [
    0.0,
    -0.0,
    88.0,
    -88.0,
    87.99,
    -88.73,
    -103.28,
    -103.97,
    -103.98,
    -104.0,
    -104.01,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Every `step`-th float of all 2^32 (as bits), and [`EDGES`].
    fn floats(step: u32) -> Vec<f32> {
        let mut xs: Vec<f32> = (0..=u32::MAX / step).map(|i| f32::from_bits(i * step)).collect();
        xs.extend(EDGES);
        xs
    }

    fn assert_libm(xs: &[f32], got: &[f32], path: &str) {
        for (&x, &e) in xs.iter().zip(got) {
            let libm = x.exp();
            assert!(
                e.to_bits() == libm.to_bits() || (e.is_nan() && libm.is_nan()),
                "{path}: exp({x}) = {e}, not {libm}"
            );
        }
    }

    #[test]
    fn the_largest_value_is_found_at_every_length_and_not_a_number_is_passed_over() {
        let value = |i: usize| match i % 23 {
            5 => f32::NAN,
            11 => f32::NEG_INFINITY,
            _ => ((i * 7919) % 1013) as f32 - 700.0,
        };
        #[cfg(target_arch = "x86_64")]
        let avx512 = std::arch::is_x86_feature_detected!("avx512f");
        for len in 0..300usize {
            for peak in [0, len / 2, len.saturating_sub(1)] {
                let mut row: Vec<f32> = (0..len).map(value).collect();
                if peak < len {
                    row[peak] = 5_000.0 + len as f32;
                }
                let expected = row.iter().copied().filter(|x| !x.is_nan()).fold(f32::NEG_INFINITY, f32::max);
                assert_eq!(max_in_lanes(&row), expected, "{len} values, the largest at {peak}");
                #[cfg(target_arch = "x86_64")]
                if avx512 {
                    // SAFETY: AVX-512F is present (checked at the start).
                    assert_eq!(unsafe { max_avx512(&row) }, expected, "{len} values, the largest at {peak}");
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        crate::model::kernel_check::report(avx512, "AVX-512F");
        assert_eq!(max(&[f32::NAN; 20]), f32::NEG_INFINITY);
    }

    #[test]
    fn every_path_gives_libms_bits_across_the_floats() {
        // Every 61st float: both signs, tiny to huge, subnormal results, infinities, NaNs.
        let xs = floats(61);
        #[cfg(target_arch = "x86_64")]
        crate::model::kernel_check::on_cpu_with(std::arch::is_x86_feature_detected!("avx512f"), "AVX-512F", || {
            let (chunks, _) = xs.as_chunks::<16>();
            let got: Vec<f32> = chunks
                .iter()
                .flat_map(|c| {
                    let mut e = [0f32; 16];
                    // SAFETY: AVX-512F is present (checked above); sixteen floats in and out.
                    unsafe { _mm512_storeu_ps(e.as_mut_ptr(), expf16_avx512(_mm512_loadu_ps(c.as_ptr()))) };
                    e
                })
                .collect();
            assert_libm(&xs, &got, "AVX-512");
        });
        #[cfg(all(target_arch = "x86_64", target_feature = "fma", target_feature = "avx2"))]
        {
            let (chunks, _) = xs.as_chunks::<8>();
            let got: Vec<f32> = chunks.iter().flat_map(|c| expf8_avx2(*c)).collect();
            assert_libm(&xs, &got, "AVX2");
        }
    }

    #[test]
    fn a_row_shifted_and_exponentiated_gets_libms_bits() {
        // Every 991st float in [-110, 0] and a -inf, shifted by a maximum of 2.5, a row whose
        // length leaves a tail after its sixteens and its eights.
        let mut row = vec![2.5f32, f32::NEG_INFINITY];
        let mut at = 0x8000_0001u32;
        while f32::from_bits(at) >= -110.0 {
            row.push(f32::from_bits(at));
            at += 991;
        }
        while row.len() % 16 != 11 {
            row.push(-1.5);
        }
        let expected: Vec<f32> = row.iter().map(|&x| (x - 2.5).exp()).collect();
        let mut got = row.clone();
        assert_eq!(exp_shifted(&mut got), 2.5);
        assert!(bits(&got) == bits(&expected), "exp_shifted differs from libm");
    }

    /// All 2^32 floats through the AVX-512 path (about a minute in release):
    /// `cargo test --release -p bellows-worker --lib exp_on_every_float -- --ignored`
    #[test]
    #[ignore]
    fn the_vector_exp_on_every_float_gives_libms_bits() {
        #[cfg(target_arch = "x86_64")]
        crate::model::kernel_check::on_cpu_with(std::arch::is_x86_feature_detected!("avx512f"), "AVX-512F", || {
            let mut xs = [0f32; 16];
            for hi in 0..=(u32::MAX >> 4) {
                for (l, x) in xs.iter_mut().enumerate() {
                    *x = f32::from_bits(hi << 4 | l as u32);
                }
                let mut e = [0f32; 16];
                // SAFETY: AVX-512F is present (checked above); sixteen floats in and out.
                unsafe { _mm512_storeu_ps(e.as_mut_ptr(), expf16_avx512(_mm512_loadu_ps(xs.as_ptr()))) };
                assert_libm(&xs, &e, "AVX-512");
            }
        });
    }
}
