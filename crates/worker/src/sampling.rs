//! Per-request sampling: penalties, logit bias, temperature, top-k, top-p, min-p, seeded RNG.
//!
//! Each request owns its [`Sampler`] (and its RNG), keyed by request id in the scheduler, so its
//! tokens depend only on its own logits and seed: never on what else shares the batch or on the
//! order in which rows finish.
//!
//! A sampled token costs a few passes over the vocabulary and no sort of it: the sampler runs for
//! every row of every step, and a full sort of SmolLM2's 49,152 logits took 1.9 ms a token beside
//! the model's 3.5 ms step. Only the nucleus's candidates are sorted (`nucleus`), the k best are
//! kept in one pass (`best`), and the weights are computed in place in the row.

use std::collections::HashMap;

use rand::{Rng, SeedableRng};

use crate::{
    model::exp::exp_shifted,
    request::{TokenLogprobs, TopLogprob},
};
use rand_chacha::ChaCha8Rng;

/// Sampling parameters as a client gives them (OpenAI names and defaults).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 = off.
    pub top_k: u32,
    pub min_p: f32,
    /// Multiplicative penalty on tokens already in prompt or output (1 = off; HF semantics).
    pub repetition_penalty: f32,
    /// Subtracted once from tokens already generated (OpenAI semantics).
    pub presence_penalty: f32,
    /// Subtracted per occurrence in the output (OpenAI semantics).
    pub frequency_penalty: f32,
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Default::default() }
    }

    /// Check every parameter's range; the error names the parameter.
    pub fn validate(&self, vocab_size: usize) -> Result<(), (&'static str, String)> {
        use bellows_common::sampling_limits as limits;
        let checks = [
            ("temperature", self.temperature, limits::TEMPERATURE),
            ("top_p", self.top_p, limits::TOP_P),
            ("min_p", self.min_p, limits::MIN_P),
            ("repetition_penalty", self.repetition_penalty, limits::REPETITION_PENALTY),
            ("presence_penalty", self.presence_penalty, limits::PRESENCE_PENALTY),
            ("frequency_penalty", self.frequency_penalty, limits::FREQUENCY_PENALTY),
        ];
        if let Some((param, _, range)) = checks.iter().find(|(_, v, range)| !range.contains(*v)) {
            return Err((param, format!("must be in {range}")));
        }
        for &(t, b) in &self.logit_bias {
            if t as usize >= vocab_size {
                return Err(("logit_bias", format!("token id {t} is outside the vocabulary ({vocab_size})")));
            }
            if !limits::LOGIT_BIAS.contains(b) {
                return Err(("logit_bias", format!("bias values must be in {}", limits::LOGIT_BIAS)));
            }
        }
        Ok(())
    }
}

/// A request's sampler: its parameters, its RNG, and counts of what it has generated.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Tokens in prompt or output, for the repetition penalty.
    seen: HashMap<u32, ()>,
    /// Occurrences in the output, for presence and frequency penalties.
    generated: HashMap<u32, u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        let seen =
            if params.repetition_penalty != 1.0 { prompt.iter().map(|&t| (t, ())).collect() } else { HashMap::new() };
        Sampler { rng: ChaCha8Rng::seed_from_u64(seed), params, seen, generated: HashMap::new() }
    }

    /// Record a generated token (call for every token the request emits).
    pub fn observe(&mut self, token: u32) {
        *self.generated.entry(token).or_default() += 1;
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(token, ());
        }
    }

    /// Account for a token this request generated in an earlier attempt, as if this sampler had
    /// picked it: penalties count it, and a sampling (non-greedy) request's RNG advances by the
    /// one draw [`Sampler::sample`] makes per token, so a seeded request continues on the same
    /// random sequence.
    pub fn replay(&mut self, token: u32) {
        if self.params.temperature != 0.0 {
            let _: f32 = self.rng.random();
        }
        self.observe(token);
    }

    /// Pick the next token from raw logits (modified in place). Draws exactly one random number
    /// unless greedy: [`Sampler::replay`] relies on that.
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        self.adjust(logits);
        let p = &self.params;
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        let u: f32 = self.rng.random();
        if p.top_k > 0 && (p.top_k as usize) < logits.len() {
            let ids = best(logits, p.top_k as usize);
            let mut few: Vec<f32> = ids.iter().map(|&t| logits[t as usize]).collect();
            return ids[pick(&mut few, p, u)];
        }
        pick(logits, p, u) as u32
    }

    /// Logit bias, then the repetition, presence and frequency penalties.
    fn adjust(&self, logits: &mut [f32]) {
        let p = &self.params;
        for &(t, b) in &p.logit_bias {
            logits[t as usize] += b;
        }
        if p.repetition_penalty != 1.0 {
            for &t in self.seen.keys() {
                let l = &mut logits[t as usize];
                *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &n) in &self.generated {
                logits[t as usize] -= p.presence_penalty + p.frequency_penalty * n as f32;
            }
        }
    }
}

/// A token's place in best-first order as one integer, larger first: the logit (in
/// `f32::total_cmp`'s order) above, the lower id winning ties below.
fn rank(logit: f32, id: u32) -> u64 {
    let bits = logit.to_bits();
    // total_cmp's order as unsigned: negatives' magnitude bits flipped, the sign bit flipped.
    let ordered = if bits >> 31 == 1 { !bits } else { bits | 1 << 31 };
    (u64::from(ordered) << 32) | u64::from(u32::MAX - id)
}

/// The `k` best tokens, best first (ties to the lower id). One pass against the worst of the `k`
/// kept so far, which nearly every token loses: about a compare per token, where selecting over
/// the whole vocabulary moved it around several times.
fn best(logits: &[f32], k: usize) -> Vec<u32> {
    use std::{cmp::Reverse, collections::BinaryHeap};
    let mut kept: BinaryHeap<Reverse<u64>> = BinaryHeap::with_capacity(k + 1);
    for (id, &l) in logits.iter().enumerate() {
        let r = rank(l, id as u32);
        if kept.len() < k {
            kept.push(Reverse(r));
        } else if let Some(mut worst) = kept.peek_mut()
            && r > worst.0
        {
            *worst = Reverse(r);
        }
    }
    // Ascending `Reverse` is descending rank: best first.
    kept.into_sorted_vec().into_iter().map(|Reverse(r)| u32::MAX - r as u32).collect()
}

/// The position to emit among `row`'s tokens (their logits, best first or in id order), drawn at
/// `u` after temperature, min-p and top-p. `row` becomes the tokens' weights
/// `exp((logit - max) / temperature)`, the best weighing 1 (the draw scales `u` by their sum, so
/// they need no normalizing).
fn pick(row: &mut [f32], p: &SamplingParams, u: f32) -> usize {
    let inv = 1.0 / p.temperature;
    row.iter_mut().for_each(|l| *l *= inv);
    exp_shifted(row);
    if p.top_p >= 1.0 && p.min_p <= 0.0 {
        return draw(row, u);
    }
    let kept = nucleus(row, p);
    let weights: Vec<f32> = kept.iter().map(|&j| row[j]).collect();
    kept[draw(&weights, u)]
}

/// Weight thresholds the nucleus search tries, falling: tokens under a threshold are not sorted.
const NUCLEUS_THRESHOLDS: [f32; 4] = [1e-2, 1e-4, 1e-6, 0.0];

/// The positions min-p and top-p keep, heaviest first (ties to the earlier position): the tokens
/// weighing at least `min_p` (the best weighs 1), cut after the first whose running weight
/// reaches `top_p` of the whole row's. Only the tokens above a weight threshold are sorted, the
/// threshold falling until they carry the `top_p` share: they are the heaviest tokens, so the
/// nucleus lies among them, and a peaked distribution sorts a few hundred.
fn nucleus(weights: &[f32], p: &SamplingParams) -> Vec<usize> {
    let target = p.top_p * lane_sum(weights);
    let mut kept: Vec<usize> = Vec::new();
    for threshold in NUCLEUS_THRESHOLDS {
        let floor = if p.top_p >= 1.0 { p.min_p } else { threshold.max(p.min_p) };
        kept = (0..weights.len()).filter(|&j| weights[j] >= floor).collect();
        if floor <= p.min_p || kept.iter().map(|&j| weights[j]).sum::<f32>() >= target {
            break;
        }
    }
    kept.sort_unstable_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(a.cmp(&b)));
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let reached = kept.iter().position(|&j| {
            acc += weights[j];
            acc >= target
        });
        kept.truncate(reached.map_or(kept.len(), |at| at + 1));
    }
    if kept.is_empty() {
        // Only when no weight compares (NaN logits): the first token.
        kept.push(0);
    }
    kept
}

/// Lanes summed apart, then together: a fixed order (so fixed bits) the compiler vectorizes.
fn lane_sum(v: &[f32]) -> f32 {
    const LANES: usize = 16;
    let (chunks, rest) = v.as_chunks::<LANES>();
    let mut lanes = [0f32; LANES];
    for c in chunks {
        for (s, &x) in lanes.iter_mut().zip(c) {
            *s += x;
        }
    }
    lanes.iter().chain(rest).sum()
}

/// The position at `u` (uniform in [0, 1)) of the way through the total of `weights`, walking
/// them in order; a chunk at a time while the point lies beyond it. Zero weights are never drawn.
fn draw(weights: &[f32], u: f32) -> usize {
    const CHUNK: usize = 16;
    let mut r = u * lane_sum(weights);
    let mut from = 0;
    for c in weights.chunks(CHUNK) {
        let mass = lane_sum(c);
        if r - mass >= 0.0 && from + c.len() < weights.len() {
            r -= mass;
            from += c.len();
            continue;
        }
        for (j, &w) in c.iter().enumerate() {
            r -= w;
            if r < 0.0 {
                return from + j;
            }
        }
        from += c.len();
    }
    // Rounding left the point past the end: the last that weighs anything.
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0)
}

/// `chosen`'s log-probability under the distribution of `raw` logits (log-softmax: the
/// exponentials as attention's softmax takes them, summed in f64 in eight lanes, a fixed order, so
/// the same logits give the same bits), and the `top` most likely tokens. `raw` becomes the
/// exponentials (the caller's copy: a second one of the vocabulary would cost every row).
pub fn logprobs(mut raw: Vec<f32>, chosen: u32, top: usize) -> TokenLogprobs {
    let chosen_logit = raw[chosen as usize];
    let top: Vec<(u32, f32)> = best(&raw, top.min(raw.len())).into_iter().map(|t| (t, raw[t as usize])).collect();
    let max = f64::from(exp_shifted(&mut raw));
    let (chunks, rest) = raw.as_chunks::<8>();
    let mut lanes = [0f64; 8];
    for c in chunks {
        for (s, &x) in lanes.iter_mut().zip(c) {
            *s += f64::from(x);
        }
    }
    let tail: f64 = rest.iter().map(|&x| f64::from(x)).sum();
    let lse = max + (lanes.iter().sum::<f64>() + tail).ln();
    let lp = |l: f32| (f64::from(l) - lse) as f32;
    TokenLogprobs {
        logprob: lp(chosen_logit),
        top: top.into_iter().map(|(token, l)| TopLogprob { token, logprob: lp(l) }).collect(),
    }
}

/// Index of the largest logit; the lowest index wins ties, so greedy output is reproducible.
pub fn argmax(logits: &[f32]) -> u32 {
    /// Lanes of the first pass: each keeps the largest of every sixteenth logit, a compare and a
    /// select the compiler turns into vector instructions (one running best was a chain of
    /// dependent compares, 1-2% of a batched decode step on the engine's thread).
    const LANES: usize = 16;
    // The answer is the first index of the largest value, NaNs never counted as larger; a NaN in
    // front is larger than nothing and smaller than nothing, so the scan never leaves it.
    match logits.first() {
        None => return 0,
        Some(first) if first.is_nan() => return 0,
        Some(_) => {}
    }
    let (chunks, rest) = logits.as_chunks::<LANES>();
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for c in chunks {
        for (best, &l) in lanes.iter_mut().zip(c) {
            *best = if l > *best { l } else { *best };
        }
    }
    let max = lanes.iter().chain(rest).fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
    // The first chunk that holds it (a whole chunk compared at once), then its place there. -0
    // and +0 are equal here as in the scan: the first of either wins.
    let chunk = chunks.iter().position(|c| c.iter().fold(false, |any, &l| any | (l == max))).unwrap_or(chunks.len());
    let from = chunk * LANES;
    (from + logits[from..].iter().position(|&l| l == max).unwrap_or(0)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.0, 0.5, 2.9]
    }

    #[test]
    fn greedy_picks_the_largest_logit_and_the_lowest_index_on_ties() {
        let mut s = Sampler::new(SamplingParams::greedy(), &[]);
        assert_eq!(s.sample(&mut logits()), 1);
        assert_eq!(argmax(&[1.0, 5.0, 5.0]), 1);
    }

    /// The plain scan `argmax` must agree with: the first index of a strictly larger value.
    fn scan(logits: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &l) in logits.iter().enumerate() {
            if l > logits[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_is_the_first_largest_with_ties_signed_zeros_nans_and_infinities() {
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 1.0, 1.0];
        let mut state = 0x9E37_79B9u32;
        for case in 0..2_000 {
            let len = [1, 5, 15, 16, 17, 33, 100, 49_152][case % 8];
            let v: Vec<f32> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 17;
                    state ^= state << 5;
                    // Mostly a few small values (many ties), sometimes a special.
                    if state.is_multiple_of(11) {
                        specials[(state >> 8) as usize % specials.len()]
                    } else {
                        (state % 7) as f32 - 3.0
                    }
                })
                .collect();
            assert_eq!(argmax(&v), scan(&v), "case {case}: {:?}", &v[..len.min(40)]);
        }
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NAN, 9.0]), scan(&[f32::NAN, 9.0]));
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY]), 0);
    }

    #[test]
    fn the_same_seed_gives_the_same_tokens() {
        let p = SamplingParams { seed: Some(7), ..Default::default() };
        let run = || {
            let mut s = Sampler::new(p.clone(), &[]);
            (0..32).map(|_| s.sample(&mut logits())).collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
        let other = {
            let mut s = Sampler::new(SamplingParams { seed: Some(8), ..p.clone() }, &[]);
            (0..32).map(|_| s.sample(&mut logits())).collect::<Vec<_>>()
        };
        assert_ne!(run(), other, "different seeds should differ over 32 draws");
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = Sampler::new(SamplingParams { top_k: 1, seed: Some(1), ..Default::default() }, &[]);
        for _ in 0..20 {
            assert_eq!(s.sample(&mut logits()), 1);
        }
    }

    #[test]
    fn top_p_and_min_p_never_pick_outside_the_nucleus() {
        let mut s = Sampler::new(SamplingParams { top_p: 0.5, seed: Some(3), ..Default::default() }, &[]);
        for _ in 0..50 {
            assert!([1, 4].contains(&s.sample(&mut logits())));
        }
        let mut s = Sampler::new(SamplingParams { min_p: 0.5, seed: Some(3), ..Default::default() }, &[]);
        for _ in 0..50 {
            assert!([1, 2, 4].contains(&s.sample(&mut logits())));
        }
    }

    /// The nucleus by the plain rule: sort every position heaviest first, keep those weighing at
    /// least `min_p`, cut after the running weight reaches `top_p` of the whole row's.
    fn full_sort_nucleus(weights: &[f32], p: &SamplingParams) -> Vec<usize> {
        let target = p.top_p * lane_sum(weights);
        let mut order: Vec<usize> = (0..weights.len()).collect();
        order.sort_unstable_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(a.cmp(&b)));
        order.retain(|&j| weights[j] >= p.min_p);
        let mut acc = 0.0;
        let cut = order.iter().position(|&j| {
            acc += weights[j];
            acc >= target
        });
        order.truncate(cut.map_or(order.len(), |c| c + 1));
        order
    }

    /// `logits` as [`pick`] weighs them.
    fn weights(logits: &[f32], temperature: f32) -> Vec<f32> {
        let mut w: Vec<f32> = logits.iter().map(|&l| l * (1.0 / temperature)).collect();
        exp_shifted(&mut w);
        w
    }

    /// Xorshift: test data without a dependency.
    fn xorshift(mut state: u32) -> impl FnMut() -> u32 {
        move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        }
    }

    #[test]
    fn the_nucleus_is_the_prefix_a_sort_of_the_whole_vocabulary_gives() {
        let mut next = xorshift(0x2545_F491);
        for case in 0..400 {
            let n = [7, 16, 100, 2_000, 49_152][case % 5];
            // Peaked (a few tokens hold the mass), flat, or a few values only (ties across the
            // cut), sometimes a masked-out -inf.
            let shape = (case / 5) % 3;
            let logits: Vec<f32> = (0..n)
                .map(|_| {
                    let r = next();
                    match (r % 97, shape) {
                        (0, _) => f32::NEG_INFINITY,
                        (_, 0) => (r % 1000) as f32 / 40.0 - 20.0,
                        (_, 1) => (r % 1000) as f32 / 4000.0,
                        _ => (r % 4) as f32,
                    }
                })
                .collect();
            let p = SamplingParams {
                temperature: [0.3, 1.0, 2.0][case % 3],
                top_p: [0.1, 0.5, 0.9, 0.95, 1.0][(case / 3) % 5],
                min_p: [0.0, 0.05, 0.3][(case / 7) % 3],
                ..Default::default()
            };
            let w = weights(&logits, p.temperature);
            if p.top_p < 1.0 || p.min_p > 0.0 {
                assert_eq!(nucleus(&w, &p), full_sort_nucleus(&w, &p), "case {case}: {p:?}");
            }
        }
    }

    #[test]
    fn a_long_tail_of_light_tokens_still_makes_the_nucleus_it_should() {
        // One best token and a tail each weighing under a search threshold, together enough of
        // the mass that the nucleus must reach into it: the threshold has to keep falling.
        for tail in [4e-3f32, 5e-5, 5e-7] {
            for top_p in [0.5, 0.9, 0.999] {
                let w: Vec<f32> =
                    (0..49_152).map(|i| if i == 1_000 { 1.0 } else { tail * (1.0 + (i % 7) as f32 / 10.0) }).collect();
                let p = SamplingParams { top_p, ..Default::default() };
                let kept = nucleus(&w, &p);
                assert_eq!(kept, full_sort_nucleus(&w, &p), "tail {tail}, top_p {top_p}");
                let needed = 1.0 / lane_sum(&w) < top_p;
                assert_eq!(kept.len() > 1, needed, "tail {tail}, top_p {top_p}: the tail is needed");
            }
        }
    }

    #[test]
    fn the_best_k_are_the_first_k_of_a_full_sort_ties_to_the_lower_id() {
        let mut next = xorshift(0x1234_5678);
        for case in 0..300 {
            let n = [1, 5, 40, 1_000, 49_152][case % 5];
            let logits: Vec<f32> = (0..n)
                .map(|_| match next() % 50 {
                    0 => f32::NEG_INFINITY,
                    1 => -0.0,
                    2 => 0.0,
                    r => (r % 9) as f32 - 4.0 + if case % 2 == 0 { (next() % 1000) as f32 / 1e4 } else { 0.0 },
                })
                .collect();
            let mut sorted: Vec<u32> = (0..n as u32).collect();
            sorted.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
            for k in [0, 1, 5, 20, 40, n] {
                let k = k.min(n);
                assert_eq!(best(&logits, k), sorted[..k], "case {case}, k {k}");
            }
        }
    }

    #[test]
    fn draws_follow_the_weights_across_chunks_and_never_pick_a_zero_weight() {
        // Mass on tokens 3, 37 and 80 (three different chunks), 1 : 2 : 1; the rest weigh 0.
        let mut logits = vec![f32::NEG_INFINITY; 100];
        (logits[3], logits[37], logits[80]) = (0.0, 2f32.ln(), 0.0);
        let mut s = Sampler::new(SamplingParams { seed: Some(11), ..Default::default() }, &[]);
        let mut counts = HashMap::<u32, u32>::new();
        const DRAWS: u32 = 40_000;
        for _ in 0..DRAWS {
            *counts.entry(s.sample(&mut logits.clone())).or_default() += 1;
        }
        assert_eq!(counts.len(), 3, "only tokens with weight are drawn: {counts:?}");
        for (t, share) in [(3, 0.25), (37, 0.5), (80, 0.25)] {
            let got = counts[&t] as f64 / DRAWS as f64;
            assert!((got - share).abs() < 0.015, "token {t}: drawn {got:.3} of the time, weight {share}");
        }
        assert_eq!(draw(&[0.0, 1.0, 0.0], 0.0), 1, "u = 0 lands on the first weight, not before it");
        assert_eq!(draw(&[0.5, 1.0, 0.0], 0.999_999_9), 1, "a point near the end: the last with weight");
    }

    #[test]
    fn logit_bias_and_penalties_move_the_choice() {
        let p = SamplingParams { logit_bias: vec![(3, 100.0)], ..SamplingParams::greedy() };
        assert_eq!(Sampler::new(p, &[]).sample(&mut logits()), 3);

        let p = SamplingParams { presence_penalty: 2.0, ..SamplingParams::greedy() };
        let mut s = Sampler::new(p, &[]);
        s.observe(1);
        assert_eq!(s.sample(&mut logits()), 4, "token 1 (3.0) penalized to 1.0; token 4 (2.9) wins");

        let p = SamplingParams { repetition_penalty: 2.0, ..SamplingParams::greedy() };
        assert_eq!(Sampler::new(p, &[1]).sample(&mut logits()), 4, "prompt token 1 halved to 1.5");
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_most_likely_first() {
        let l = logits();
        let lp = logprobs(l.clone(), 4, 3);
        let total: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
        assert!((lp.logprob as f64 - (2.9f64 - total.ln())).abs() < 1e-6);
        let top: Vec<u32> = lp.top.iter().map(|t| t.token).collect();
        assert_eq!(top, [1, 4, 2]);
        assert!(lp.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        assert_eq!(logprobs(vec![1.0, 1.0, 0.0], 0, 2).top.iter().map(|t| t.token).collect::<Vec<_>>(), [0, 1]);
        assert!(logprobs(l.clone(), 1, 0).top.is_empty());
    }

    #[test]
    fn out_of_range_parameters_are_named() {
        let v = |p: SamplingParams| p.validate(5).map_err(|e| e.0);
        assert_eq!(v(SamplingParams { temperature: 3.0, ..Default::default() }), Err("temperature"));
        assert_eq!(v(SamplingParams { top_p: 0.0, ..Default::default() }), Err("top_p"));
        assert_eq!(v(SamplingParams { logit_bias: vec![(9, 1.0)], ..Default::default() }), Err("logit_bias"));
        assert_eq!(v(SamplingParams::default()), Ok(()));
    }
}
