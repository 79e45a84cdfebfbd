//! Priority classes: what router and worker agree a request's urgency is.
//!
//! Three named classes, so tenants files and dashboards say what they mean. The derived order
//! is the admission order: `Interactive < Standard < Batch`, the smallest first. Callers may
//! name a class through OpenAI's `service_tier` or vLLM's integer `priority` (see
//! docs/priority.md); both map onto these.

use std::{fmt, str::FromStr};

/// A request's class. `Standard` is what a request without one gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// A person is waiting on the first token.
    Interactive,
    #[default]
    Standard,
    /// Throughput work: admitted last, first to be refused under overload.
    Batch,
}

impl Priority {
    /// Every class, most urgent first.
    pub const ALL: [Priority; 3] = [Priority::Interactive, Priority::Standard, Priority::Batch];

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Interactive => "interactive",
            Priority::Standard => "standard",
            Priority::Batch => "batch",
        }
    }

    /// The position in [`Priority::ALL`] (for per-class arrays).
    pub fn index(self) -> usize {
        self as usize
    }

    /// vLLM's convention: lower values are served earlier, 0 is the default.
    pub fn from_vllm(priority: i64) -> Self {
        match priority {
            ..0 => Priority::Interactive,
            0 => Priority::Standard,
            1.. => Priority::Batch,
        }
    }

    /// OpenAI's `service_tier`: `priority`, `default` and `flex` name a class (`default` is
    /// OpenAI's standard tier); `auto` leaves the choice to the tenant's default (`None`).
    /// Anything else is not a tier.
    pub fn from_service_tier(tier: &str) -> Result<Option<Self>, UnknownPriority> {
        match tier {
            "auto" => Ok(None),
            "priority" => Ok(Some(Priority::Interactive)),
            "default" => Ok(Some(Priority::Standard)),
            "flex" => Ok(Some(Priority::Batch)),
            other => Err(UnknownPriority(other.to_string())),
        }
    }

    /// The `service_tier` an OpenAI client reads back for this class.
    pub fn service_tier(self) -> &'static str {
        match self {
            Priority::Interactive => "priority",
            Priority::Standard => "default",
            Priority::Batch => "flex",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown priority class {0:?}: expected interactive, standard or batch")]
pub struct UnknownPriority(pub String);

impl FromStr for Priority {
    type Err = UnknownPriority;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Priority::ALL.into_iter().find(|p| p.as_str() == s).ok_or_else(|| UnknownPriority(s.to_string()))
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_order_is_interactive_then_standard_then_batch() {
        let mut classes = vec![Priority::Batch, Priority::Interactive, Priority::Standard];
        classes.sort();
        assert_eq!(classes, Priority::ALL);
        assert_eq!(Priority::ALL.map(Priority::index), [0, 1, 2]);
    }

    #[test]
    fn both_request_conventions_map_onto_the_classes() {
        assert_eq!(Priority::from_vllm(-5), Priority::Interactive);
        assert_eq!(Priority::from_vllm(0), Priority::Standard);
        assert_eq!(Priority::from_vllm(3), Priority::Batch);
        assert_eq!(Priority::from_service_tier("priority"), Ok(Some(Priority::Interactive)));
        assert_eq!(Priority::from_service_tier("flex"), Ok(Some(Priority::Batch)));
        assert_eq!(Priority::from_service_tier("default"), Ok(Some(Priority::Standard)));
        assert_eq!(Priority::from_service_tier("auto"), Ok(None));
        assert!(Priority::from_service_tier("scale").is_err());
        for p in Priority::ALL {
            assert_eq!(p.as_str().parse::<Priority>(), Ok(p));
            assert_eq!(Priority::from_service_tier(p.service_tier()), Ok(Some(p)), "the echoed tier names its class");
        }
    }
}
