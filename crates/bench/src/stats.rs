//! Latency summaries: percentiles of a set of samples, in milliseconds.

use serde::Serialize;

#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Summary {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
    pub max: f64,
}

/// `None` for no samples. Nearest-rank percentiles.
pub fn summarize(samples_ms: &mut [f64]) -> Option<Summary> {
    if samples_ms.is_empty() {
        return None;
    }
    samples_ms.sort_by(f64::total_cmp);
    let n = samples_ms.len();
    let at = |q: f64| samples_ms[((q * n as f64).ceil() as usize).clamp(1, n) - 1];
    let round = |x: f64| (x * 1000.0).round() / 1000.0;
    Some(Summary {
        p50: round(at(0.50)),
        p90: round(at(0.90)),
        p99: round(at(0.99)),
        mean: round(samples_ms.iter().sum::<f64>() / n as f64),
        max: round(samples_ms[n - 1]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut xs: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let s = summarize(&mut xs).unwrap();
        assert_eq!((s.p50, s.p90, s.p99, s.max, s.mean), (50.0, 90.0, 99.0, 100.0, 50.5));
        assert_eq!(summarize(&mut [7.0]).unwrap().p99, 7.0);
        assert!(summarize(&mut []).is_none());
    }
}
