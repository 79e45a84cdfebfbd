//! What the load generator sends.
//!
//! Prompts are token ids of the simulated vocabulary. Sent as text they are spelt `t17 t5 ...`,
//! which `bellows-router` (and [`crate::shim`]) tokenize back to exactly those ids, so a text
//! prompt and a token-id prompt reach a simulated worker as the same tokens, and the
//! prefix-sharing structure below is exact in tokens whichever form a router accepts.

use rand::{Rng, SeedableRng, rngs::StdRng};

/// One request's prompt.
pub struct Prompt {
    pub tokens: Vec<u32>,
    /// The tenant whose system prompt leads it (shared-prefix workload).
    pub tenant: Option<usize>,
}

pub fn to_text(tokens: &[u32]) -> String {
    let mut s = String::with_capacity(tokens.len() * 6);
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            s.push(' ');
        }
        s.push('t');
        s.push_str(&t.to_string());
    }
    s
}

pub enum Workload {
    /// Short random prompts that share nothing: the router's fixed cost per request.
    Overhead {
        prompt_tokens: usize,
        vocab: u32,
    },
    SharedPrefix(SharedPrefix),
}

impl Workload {
    pub fn next(&self, rng: &mut StdRng) -> Prompt {
        match self {
            Workload::Overhead { prompt_tokens, vocab } => {
                Prompt { tokens: random_tokens(rng, *prompt_tokens, *vocab), tenant: None }
            }
            Workload::SharedPrefix(w) => w.next(rng),
        }
    }
}

fn random_tokens(rng: &mut StdRng, n: usize, vocab: u32) -> Vec<u32> {
    // Never 0: the simulated end-of-sequence.
    (0..n).map(|_| rng.random_range(1..vocab)).collect()
}

/// Tenants that each put their own system prompt before a short user suffix; tenant 0 sends
/// `hot_share` of all requests and the others share the rest evenly.
pub struct SharedPrefix {
    systems: Vec<Vec<u32>>,
    hot_share: f64,
    suffix_tokens: usize,
    vocab: u32,
}

impl SharedPrefix {
    /// System prompts of about `system_bytes` bytes of text each, fixed by `seed`.
    pub fn new(
        tenants: usize,
        system_bytes: usize,
        hot_share: f64,
        suffix_tokens: usize,
        vocab: u32,
        seed: u64,
    ) -> Self {
        assert!(tenants > 0 && (0.0..=1.0).contains(&hot_share) && vocab > 1);
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_5eed);
        let systems = (0..tenants)
            .map(|_| {
                let mut tokens = Vec::new();
                let mut bytes = 0;
                while bytes < system_bytes {
                    let t = rng.random_range(1..vocab);
                    bytes += 2 + t.to_string().len(); // "t" + digits + " "
                    tokens.push(t);
                }
                tokens
            })
            .collect();
        SharedPrefix { systems, hot_share, suffix_tokens, vocab }
    }

    pub fn tenants(&self) -> usize {
        self.systems.len()
    }

    fn next(&self, rng: &mut StdRng) -> Prompt {
        let n = self.systems.len();
        let tenant = if n == 1 || rng.random_bool(self.hot_share) { 0 } else { rng.random_range(1..n) };
        let mut tokens = self.systems[tenant].clone();
        tokens.extend(random_tokens(rng, self.suffix_tokens, self.vocab));
        Prompt { tokens, tenant: Some(tenant) }
    }

    /// Tokens of a tenant's prompt that a worker can serve from its cache: the full KV blocks of
    /// the system prompt (a worker caches whole blocks only; the block that holds the end of the
    /// system prompt also holds suffix tokens, which no other request shares).
    pub fn shareable_tokens(&self, tenant: usize, block_size: usize) -> u64 {
        (self.systems[tenant].len() / block_size * block_size) as u64
    }

    /// The tenant's expected share of the requests.
    fn share(&self, tenant: usize) -> f64 {
        match (tenant, self.systems.len()) {
            (_, 1) => 1.0,
            (0, _) => self.hot_share,
            (_, n) => (1.0 - self.hot_share) / (n - 1) as f64,
        }
    }

    /// Workers that must hold a tenant's system prompt at saturation: a tenant sending a share
    /// `s` of the requests needs `ceil(s * workers)` workers' worth of capacity (the hot tenant
    /// at 50% needs 2 of 4 workers), every other tenant at least one.
    pub fn required_holders(&self, tenant: usize, workers: usize) -> u64 {
        ((self.share(tenant) * workers as f64 - 1e-9).ceil().max(1.0) as u64).min(workers as u64)
    }

    /// The most prompt tokens any placement could serve from cache for the requests sent
    /// (`sent[t]` of tenant `t`): every request's shareable tokens, except for the first
    /// request on each worker that must hold the tenant's prompt, which has to compute it.
    /// KV-capacity evictions are not subtracted: the benchmark sizes each worker's cache to hold
    /// its share of the system prompts under such a placement.
    pub fn achievable_cached_tokens(&self, sent: &[u64], workers: usize, block_size: usize) -> u64 {
        sent.iter()
            .enumerate()
            .map(|(t, &n)| n.saturating_sub(self.required_holders(t, workers)) * self.shareable_tokens(t, block_size))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_prompts_spell_their_token_ids() {
        assert_eq!(to_text(&[5, 17, 999]), "t5 t17 t999");
    }

    #[test]
    fn the_hot_tenant_sends_its_share_and_prompts_share_exactly_the_system_prompt() {
        let w = SharedPrefix::new(50, 2048, 0.5, 16, 1024, 7);
        let mut rng = StdRng::seed_from_u64(1);
        let mut per_tenant = [0u32; 50];
        for _ in 0..10_000 {
            let p = w.next(&mut rng);
            let t = p.tenant.unwrap();
            per_tenant[t] += 1;
            let system = &w.systems[t];
            assert_eq!(&p.tokens[..system.len()], &system[..]);
            assert_eq!(p.tokens.len(), system.len() + 16);
        }
        assert!((4800..5200).contains(&per_tenant[0]), "{}", per_tenant[0]);
        let len = to_text(&w.systems[3]).len();
        assert!((2040..2060).contains(&len), "a system prompt is about 2 KB of text: {len}");
    }

    #[test]
    fn the_achievable_maximum_charges_each_required_holder_one_cold_prompt() {
        let w = SharedPrefix::new(3, 400, 0.5, 4, 1024, 7);
        let block = 16;
        // 4 workers: the hot tenant (50%) needs 2 of them, the others (25% each) one.
        assert_eq!((w.required_holders(0, 4), w.required_holders(1, 4), w.required_holders(2, 4)), (2, 1, 1));
        let s: Vec<u64> = (0..3).map(|t| w.shareable_tokens(t, block)).collect();
        assert!(s.iter().all(|&x| x % 16 == 0 && x > 0));
        assert_eq!(w.achievable_cached_tokens(&[10, 5, 1], 4, block), 8 * s[0] + 4 * s[1]);
    }
}
