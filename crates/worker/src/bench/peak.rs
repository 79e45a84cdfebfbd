//! What these cores can compute and read at most (`bench --suite peak`): the ceilings the engine's
//! kernels are judged against. A kernel's GMAC/s means little alone; beside the machine's own
//! peak it says how much is left to win, and whether a target is within reach at all.
//!
//! Each compute loop runs enough independent chains to hide its instruction's latency, on
//! registers only, on every thread of the matmul pool at once (the engine's threads); the memory
//! loop sums a buffer far larger than the caches, each thread its own half. Figures are for both
//! threads together.

use std::{sync::Barrier, time::Instant};

use serde_json::{Value, json};

/// Iterations of each compute loop per thread: long enough to dwarf start-up, short enough
/// (well under a second) for a suite.
const ITERS: usize = 20_000_000;
/// Bytes the memory loop reads: far above any cache.
const BUFFER: usize = 512 << 20;

/// Multiply-adds per second of the CPU's vector instructions, and memory read bandwidth; the
/// best of three runs each. Instructions this CPU lacks are left out.
pub fn run() -> Value {
    let threads = candle_core::utils::get_num_threads();
    let mut out = json!({ "threads": threads });
    #[cfg(target_arch = "x86_64")]
    for (name, kernel) in compute_kernels() {
        let gmacs = best_of_three(|| on_threads(threads, kernel) / 1e9);
        out[name] = json!({ "gmac_s": gmacs });
    }
    let buffer = vec![1u8; BUFFER];
    let gbs = best_of_three(|| read_bandwidth(&buffer, threads) / 1e9);
    out["memory_read"] = json!({ "gb_s": gbs });
    out
}

fn best_of_three(f: impl Fn() -> f64) -> f64 {
    (0..3).map(|_| f()).fold(0.0, f64::max)
}

/// A compute loop: runs `iters` iterations, returns multiply-adds done and a value to keep the
/// work from being optimized away.
#[cfg(target_arch = "x86_64")]
type Kernel = fn(usize) -> (u64, f32);

/// The loops this CPU can run, named for the instruction and its register width.
#[cfg(target_arch = "x86_64")]
fn compute_kernels() -> Vec<(&'static str, Kernel)> {
    use std::arch::is_x86_feature_detected as has;
    let mut k: Vec<(&'static str, Kernel)> = Vec::new();
    // SAFETY (each call below): the features its kernel needs were detected just before.
    if has!("avx2") && has!("fma") {
        k.push(("f32_fma_256", |n| unsafe { x86::fma_256(n) }));
    }
    if has!("avx512f") {
        k.push(("f32_fma_512", |n| unsafe { x86::fma_512(n) }));
    }
    if has!("avx2") {
        k.push(("int8_vpmaddubsw_256", |n| unsafe { x86::maddubs_256(n) }));
    }
    if has!("avx512f") && has!("avx512vnni") {
        k.push(("int8_vpdpbusd_512", |n| unsafe { x86::dpbusd_512(n) }));
    }
    if has!("avx512f") && has!("avx512bf16") {
        k.push(("bf16_vdpbf16ps_512", |n| unsafe { x86::dpbf16_512(n) }));
    }
    k
}

/// Multiply-adds per second with `kernel` running on `threads` threads at once, timed from a
/// common start to the last thread's end.
#[cfg(target_arch = "x86_64")]
fn on_threads(threads: usize, kernel: Kernel) -> f64 {
    let start = Barrier::new(threads + 1);
    let (macs, t) = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    start.wait();
                    let (macs, keep) = kernel(std::hint::black_box(ITERS));
                    std::hint::black_box(keep);
                    macs
                })
            })
            .collect();
        start.wait();
        let t = Instant::now();
        let macs: u64 = workers.into_iter().map(|w| w.join().expect("a compute thread")).sum();
        (macs, t.elapsed())
    });
    macs as f64 / t.as_secs_f64()
}

/// Bytes per second read from `buffer` by `threads` threads, each summing its own part.
fn read_bandwidth(buffer: &[u8], threads: usize) -> f64 {
    let part = buffer.len().div_ceil(threads);
    let start = Barrier::new(threads + 1);
    let t = std::thread::scope(|s| {
        let workers: Vec<_> = buffer
            .chunks(part)
            .map(|chunk| {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    let (words, _) = chunk.as_chunks::<8>();
                    let sum = words.iter().fold(0u64, |a, w| a.wrapping_add(u64::from_le_bytes(*w)));
                    std::hint::black_box(sum);
                })
            })
            .collect();
        start.wait();
        let t = Instant::now();
        workers.into_iter().for_each(|w| w.join().expect("a memory thread"));
        t.elapsed()
    });
    buffer.len() as f64 / t.as_secs_f64()
}

/// The loops: `CHAINS` accumulators, each one dependent chain, so that the units never wait
/// (12 for AVX2's 16 registers: with the two operands, 16 chains spilled and halved the rate).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    const CHAINS: usize = 16;
    const CHAINS_256: usize = 12;

    /// `chains` accumulators from `init`, each stepped `iters` times; inlined into each kernel, so
    /// `step` runs with that kernel's target features.
    #[inline(always)]
    fn chains<T: Copy, const C: usize>(iters: usize, init: T, step: impl Fn(T) -> T) -> [T; C] {
        let mut acc = [init; C];
        for _ in 0..iters {
            for x in &mut acc {
                *x = step(*x);
            }
        }
        acc
    }

    /// SAFETY: the CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_256(iters: usize) -> (u64, f32) {
        let (a, b) = (_mm256_set1_ps(0.999_9), _mm256_set1_ps(1e-6));
        let acc: [_; CHAINS_256] = chains(iters, _mm256_set1_ps(1.0), |x| _mm256_fmadd_ps(x, a, b));
        let sum = acc.iter().fold(_mm256_setzero_ps(), |s, x| _mm256_add_ps(s, *x));
        ((iters * CHAINS_256 * 8) as u64, _mm256_cvtss_f32(sum))
    }

    /// SAFETY: the CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_512(iters: usize) -> (u64, f32) {
        let (a, b) = (_mm512_set1_ps(0.999_9), _mm512_set1_ps(1e-6));
        let acc: [_; CHAINS] = chains(iters, _mm512_set1_ps(1.0), |x| _mm512_fmadd_ps(x, a, b));
        let sum = acc.iter().fold(_mm512_setzero_ps(), |s, x| _mm512_add_ps(s, *x));
        ((iters * CHAINS * 16) as u64, _mm512_reduce_add_ps(sum))
    }

    /// Unsigned by signed bytes, pairs into 16-bit sums: 32 multiply-adds an instruction (the int8
    /// kernels' multiply on CPUs without VNNI; each chain feeds its sums back as its next bytes).
    /// SAFETY: the CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn maddubs_256(iters: usize) -> (u64, f32) {
        let b = _mm256_set1_epi8(-2);
        let acc: [_; CHAINS_256] = chains(iters, _mm256_set1_epi8(3), |x| _mm256_maddubs_epi16(x, b));
        let sum = acc.iter().fold(_mm256_setzero_si256(), |s, x| _mm256_add_epi16(s, *x));
        ((iters * CHAINS_256 * 32) as u64, _mm256_extract_epi16::<0>(sum) as f32)
    }

    /// Unsigned by signed bytes, four to each 32-bit sum: 64 multiply-adds an instruction.
    /// SAFETY: the CPU has AVX-512F and AVX-512 VNNI.
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub unsafe fn dpbusd_512(iters: usize) -> (u64, f32) {
        let (a, b) = (_mm512_set1_epi8(3), _mm512_set1_epi8(-2));
        let acc: [_; CHAINS] = chains(iters, _mm512_setzero_si512(), |x| _mm512_dpbusd_epi32(x, a, b));
        let sum = acc.iter().fold(_mm512_setzero_si512(), |s, x| _mm512_add_epi32(s, *x));
        ((iters * CHAINS * 64) as u64, _mm512_reduce_add_epi32(sum) as f32)
    }

    /// Pairs of bfloat16 into each f32 sum: 32 multiply-adds an instruction (the bf16 KV cache's
    /// attention).
    /// SAFETY: the CPU has AVX-512F and AVX-512 BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn dpbf16_512(iters: usize) -> (u64, f32) {
        // 0.5 and a tiny step as bfloat16 pairs (0x3f00, 0x3380): the sums stay finite.
        // SAFETY: 512 bits either way.
        let pairs = |bits: i16| unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi16(bits)) };
        let (a, b) = (pairs(0x3f00), pairs(0x3380));
        let acc: [_; CHAINS] = chains(iters, _mm512_setzero_ps(), |x| _mm512_dpbf16_ps(x, a, b));
        let sum = acc.iter().fold(_mm512_setzero_ps(), |s, x| _mm512_add_ps(s, *x));
        ((iters * CHAINS * 32) as u64, _mm512_reduce_add_ps(sum))
    }
}
