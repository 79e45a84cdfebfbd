//! The range of every sampling parameter, defined once: the router refuses an out-of-range value
//! before any worker is used, and the worker refuses it from any other caller, with the same
//! bounds, so the two can never disagree on what is valid.

/// An interval of a parameter's values; the high end is always closed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Range {
    pub lo: f32,
    pub hi: f32,
    /// `(lo, hi]` rather than `[lo, hi]`.
    pub lo_open: bool,
}

impl Range {
    const fn closed(lo: f32, hi: f32) -> Range {
        Range { lo, hi, lo_open: false }
    }

    /// NaN is never in range.
    pub fn contains(&self, v: f32) -> bool {
        (if self.lo_open { v > self.lo } else { v >= self.lo }) && v <= self.hi
    }
}

impl std::fmt::Display for Range {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}, {}]", if self.lo_open { "(" } else { "[" }, self.lo, self.hi)
    }
}

pub const TEMPERATURE: Range = Range::closed(0.0, 2.0);
/// Anthropic's Messages API takes temperatures up to 1 (the worker's range holds it).
pub const ANTHROPIC_TEMPERATURE: Range = Range::closed(0.0, 1.0);
pub const TOP_P: Range = Range { lo: 0.0, hi: 1.0, lo_open: true };
pub const MIN_P: Range = Range::closed(0.0, 1.0);
/// Multiplicative (Hugging Face's), 1 = off.
pub const REPETITION_PENALTY: Range = Range { lo: 0.0, hi: 10.0, lo_open: true };
pub const PRESENCE_PENALTY: Range = Range::closed(-2.0, 2.0);
pub const FREQUENCY_PENALTY: Range = Range::closed(-2.0, 2.0);
pub const LOGIT_BIAS: Range = Range::closed(-100.0, 100.0);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_and_closed_ends_and_nan() {
        assert!(TEMPERATURE.contains(0.0) && TEMPERATURE.contains(2.0) && !TEMPERATURE.contains(2.01));
        assert!(!TOP_P.contains(0.0) && TOP_P.contains(1.0));
        assert!(!MIN_P.contains(f32::NAN));
        assert_eq!(TOP_P.to_string(), "(0, 1]");
        assert_eq!(PRESENCE_PENALTY.to_string(), "[-2, 2]");
    }
}
