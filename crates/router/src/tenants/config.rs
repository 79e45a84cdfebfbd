//! The tenants file: who may call the gateway, with which keys, and within which limits.
//!
//! Its shape is the one the Helm chart writes (deploy/helm/bellows: `router.auth.tenants`,
//! checked by values.schema.json), and this parser accepts exactly what that schema accepts, so
//! a file that passes `helm lint` loads here and a file written by hand gets the same checks:
//!
//! ```yaml
//! tenants:
//!   - name: team-a                 # [A-Za-z0-9][-_.A-Za-z0-9]*, at most 63 characters
//!     key_sha256:                  # SHA-256 of each API key, 64 lowercase hex digits
//!       - 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
//!     models: [SmolLM2-135M-Instruct]   # absent or empty: every model
//!     requests_per_minute: 600     # every limit: absent = unlimited, 0 = nothing allowed
//!     tokens_per_minute: 200000
//!     max_concurrent: 32
//!     max_tokens: 4096
//!     weight: 1                    # fair share under load (> 0, default 1)
//!     isolate_prefix_cache: false
//!     priority: standard           # class of requests that name none (docs/priority.md)
//!     priorities: [standard, batch]  # classes it may ask for; absent: all
//! ```
//!
//! Keys exist here only as hashes (`printf %s "$KEY" | sha256sum`), so the file (and the Secret
//! that holds it) gives nobody a usable key. A file with an unknown field (a plain-text `key`, a
//! misspelt limit), a repeated name or key hash, or a malformed value is refused as a whole, with
//! a message that names the tenant and the field: a half-applied tenants file could silently open
//! or close the gateway to someone.

use std::{collections::HashMap, sync::Arc};

use bellows_common::priority::Priority;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::limits::LimitError;

/// The tenant that stands for every caller when auth is off (no tenants file).
pub const ANONYMOUS: &str = "anonymous";
/// Longest tenant name the chart admits (a DNS label's length).
const MAX_NAME_LEN: usize = 63;
/// Limits are clamped here: beyond, a limit is as good as none, and the fixed-point bucket
/// arithmetic (limits.rs) stays far from overflow.
pub(crate) const MAX_LIMIT: u64 = 1_000_000_000_000;

/// One tenant, as the file describes it. Immutable: a reload makes new ones.
#[derive(Debug, Clone, PartialEq)]
pub struct Tenant {
    pub name: String,
    /// Models this tenant may use; `None`: all.
    pub models: Option<Vec<String>>,
    pub requests_per_minute: Option<u64>,
    /// Prompt plus completion tokens.
    pub tokens_per_minute: Option<u64>,
    pub max_concurrent: Option<u64>,
    /// Largest `max_tokens` a request may ask for; also the default when it asks for none.
    pub max_tokens: Option<u64>,
    /// Share of the cluster under load, relative to the other tenants' weights.
    pub weight: f64,
    pub isolate_prefix_cache: bool,
    /// The class of its requests that name none (or `service_tier: auto`); always allowed.
    pub priority: Priority,
    /// Classes its requests may name; `None`: all.
    pub priorities: Option<Vec<Priority>>,
}

impl Tenant {
    /// Every caller when auth is off: no limits, no isolation.
    pub fn anonymous() -> Arc<Tenant> {
        Arc::new(Tenant {
            name: ANONYMOUS.to_string(),
            models: None,
            requests_per_minute: None,
            tokens_per_minute: None,
            max_concurrent: None,
            max_tokens: None,
            weight: 1.0,
            isolate_prefix_cache: false,
            priority: Priority::Standard,
            priorities: None,
        })
    }

    /// The most urgent class its requests may name.
    pub fn most_urgent(&self) -> Priority {
        self.priorities.as_ref().and_then(|p| p.iter().min().copied()).unwrap_or(Priority::Interactive)
    }

    /// The class a request runs in: the one it asked for, if allowed, or the tenant's default.
    pub fn class(&self, requested: Option<Priority>) -> Result<Priority, LimitError> {
        let class = requested.unwrap_or(self.priority);
        match &self.priorities {
            Some(allowed) if !allowed.contains(&class) => Err(LimitError::PriorityNotAllowed { class }),
            _ => Ok(class),
        }
    }

    pub fn allows_model(&self, model: &str) -> bool {
        self.models.as_ref().is_none_or(|m| m.iter().any(|allowed| allowed == model))
    }

    /// The salt to mix into this tenant's prefix-cache block hashes, when its cache is isolated.
    ///
    /// Derived from the name alone, so every router, and the same router after a reload or a
    /// restart, salts the same way and the tenant keeps hitting its own cached blocks. It is not
    /// a secret and needs not be: the router applies it, a client cannot choose it, so no other
    /// tenant's requests ever hash into this chain (and this tenant's never into the shared one).
    pub fn cache_salt(&self) -> Option<String> {
        self.isolate_prefix_cache.then(|| {
            let digest =
                Sha256::new().chain_update(b"bellows/prefix-cache-salt/v1\0").chain_update(&self.name).finalize();
            hex(&digest[..16])
        })
    }

    /// The salt of a request's prefix-cache chain: this tenant's, joined with the request's own
    /// `cache_salt` when it sends one (vLLM's field: only requests that know the salt share the
    /// blocks, so a neighbour cannot probe for a prompt by timing its cache hits).
    ///
    /// A joined salt always holds a NUL, which neither a tenant's (hex) salt nor the shared chain
    /// (none) does, and starts with the tenant's fixed-length salt, or with the NUL when the
    /// tenant shares: so a request salt never reaches another tenant's isolated chain, the shared
    /// one, or a request salt of another isolated tenant.
    pub fn prefix_salt(&self, request_salt: Option<&str>) -> Option<String> {
        let tenant = self.cache_salt();
        match request_salt {
            None => tenant,
            Some(salt) => Some(format!("{}\0{salt}", tenant.unwrap_or_default())),
        }
    }
}

/// A parsed, valid tenants file.
#[derive(Debug, Clone, Default)]
pub struct TenantsConfig {
    pub tenants: Vec<Arc<Tenant>>,
    /// Every key hash with the index of its tenant in `tenants`.
    pub(crate) keys: Vec<([u8; 32], usize)>,
}

impl TenantsConfig {
    pub fn tenant(&self, name: &str) -> Option<&Arc<Tenant>> {
        self.tenants.iter().find(|t| t.name == name)
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// Not YAML, or not a mapping with a `tenants` list and nothing else.
    #[error("tenants file: {0}")]
    Syntax(String),
    /// One tenant's field is missing, unknown, of the wrong type or out of range.
    #[error("tenants file: tenant {tenant}: {field}: {message}")]
    Field { tenant: String, field: String, message: String },
    #[error("tenants file: the tenant name {0:?} appears twice")]
    DuplicateName(String),
    /// The same key would open two tenants (or one twice): ambiguous, so refused.
    #[error("tenants file: tenants {first:?} and {second:?} list the same key_sha256")]
    DuplicateKey { first: String, second: String },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    tenants: Vec<serde_norway::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTenant {
    name: String,
    key_sha256: Vec<String>,
    #[serde(default)]
    models: Option<Vec<String>>,
    #[serde(default)]
    requests_per_minute: Option<u64>,
    #[serde(default)]
    tokens_per_minute: Option<u64>,
    #[serde(default)]
    max_concurrent: Option<u64>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    weight: Option<f64>,
    #[serde(default)]
    isolate_prefix_cache: Option<bool>,
    #[serde(default)]
    priority: Option<Priority>,
    #[serde(default)]
    priorities: Option<Vec<Priority>>,
}

/// Parse and check a whole tenants file.
/// What a `key_sha256` entry that is not a hash is told.
const NOT_A_HASH: &str = "is not a SHA-256 hash (64 lowercase hex digits, as `printf %s \"$KEY\" | sha256sum` \
                          prints); the file holds hashes of keys, never keys";

/// One entry of the list as a tenant's fields; an error names the field at fault.
fn raw_tenant(value: serde_norway::Value, label: &str) -> Result<RawTenant, ConfigError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let message = e.into_inner().to_string();
        // serde names a missing or unknown field in its message; the path is then just ".".
        let field = if path == "." { field_in_message(&message) } else { path };
        ConfigError::Field { tenant: label.to_string(), field, message }
    })
}

pub fn parse(text: &str) -> Result<TenantsConfig, ConfigError> {
    let file: RawFile = serde_norway::from_str(text).map_err(|e| ConfigError::Syntax(e.to_string()))?;
    let mut config = TenantsConfig::default();
    let mut names: HashMap<String, usize> = HashMap::new();
    let mut owners: HashMap<[u8; 32], usize> = HashMap::new();
    for (index, value) in file.tenants.into_iter().enumerate() {
        // Name the tenant in every message, even before its entry is known to be well formed.
        let label = match value.get("name").and_then(|n| n.as_str()) {
            Some(name) => format!("{name:?}"),
            None => format!("#{} (the {} in the list)", index + 1, ordinal(index + 1)),
        };
        let raw = raw_tenant(value, &label)?;
        let field_error =
            |field: &str, message: String| ConfigError::Field { tenant: label.clone(), field: field.into(), message };

        check_name(&raw.name).map_err(|m| field_error("name", m))?;
        if raw.key_sha256.is_empty() {
            return Err(field_error("key_sha256", "needs at least one key hash".into()));
        }
        for (k, hex_hash) in raw.key_sha256.iter().enumerate() {
            let hash = parse_sha256_hex(hex_hash)
                .ok_or_else(|| field_error(&format!("key_sha256[{k}]"), NOT_A_HASH.into()))?;
            if let Some(&other) = owners.get(&hash) {
                let first: &str = if other == index { &raw.name } else { &config.tenants[other].name };
                return Err(ConfigError::DuplicateKey { first: first.to_string(), second: raw.name.clone() });
            }
            owners.insert(hash, index);
            config.keys.push((hash, index));
        }
        if let Some(models) = &raw.models
            && let Some(k) = models.iter().position(|m| m.is_empty())
        {
            return Err(field_error(&format!("models[{k}]"), "is empty".into()));
        }
        let weight = raw.weight.unwrap_or(1.0);
        if !(weight.is_finite() && weight > 0.0) {
            return Err(field_error("weight", format!("must be a number greater than 0, not {weight}")));
        }
        let priority =
            default_class(raw.priority, raw.priorities.as_deref()).map_err(|m| field_error("priority", m))?;
        if names.insert(raw.name.clone(), index).is_some() {
            return Err(ConfigError::DuplicateName(raw.name));
        }
        let clamp = |v: Option<u64>| v.map(|v| v.min(MAX_LIMIT));
        config.tenants.push(Arc::new(Tenant {
            name: raw.name,
            models: raw.models.filter(|m| !m.is_empty()),
            requests_per_minute: clamp(raw.requests_per_minute),
            tokens_per_minute: clamp(raw.tokens_per_minute),
            max_concurrent: clamp(raw.max_concurrent),
            max_tokens: raw.max_tokens,
            weight,
            isolate_prefix_cache: raw.isolate_prefix_cache.unwrap_or(false),
            priority,
            priorities: raw.priorities,
        }));
    }
    Ok(config)
}

/// A tenant's default class: as given (it must be allowed), else `standard` if allowed, else
/// its most urgent allowed class.
fn default_class(given: Option<Priority>, allowed: Option<&[Priority]>) -> Result<Priority, String> {
    let Some(allowed) = allowed else { return Ok(given.unwrap_or_default()) };
    if allowed.is_empty() {
        return Err("'priorities' must name at least one class".into());
    }
    match given {
        Some(p) if !allowed.contains(&p) => Err(format!("{p} is not among the tenant's 'priorities'")),
        Some(p) => Ok(p),
        None if allowed.contains(&Priority::Standard) => Ok(Priority::Standard),
        None => Ok(*allowed.iter().min().expect("not empty")),
    }
}

fn check_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphanumeric());
    let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !(first_ok && rest_ok) || name.len() > MAX_NAME_LEN {
        return Err(format!(
            "{name:?} is not a valid name (letters, digits, '-', '_', '.', starting with a letter or digit, at most \
             {MAX_NAME_LEN} characters)"
        ));
    }
    Ok(())
}

/// The field a serde message names in backquotes (`missing field `name``), if any.
fn field_in_message(message: &str) -> String {
    message.split('`').nth(1).map_or_else(|| "(entry)".to_string(), str::to_string)
}

fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// 64 lowercase hex digits, the way sha256sum prints them (and the chart's schema demands).
pub(crate) fn parse_sha256_hex(s: &str) -> Option<[u8; 32]> {
    let bytes = s.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; 32];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn sha256(data: &[u8]) -> [u8; 32] {
    Sha256::digest(data).into()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The hash of a test key, as it would appear in a file.
    pub(crate) fn key_hash(key: &str) -> String {
        hex(&sha256(key.as_bytes()))
    }

    fn err(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    fn one(fields: &str) -> Result<TenantsConfig, ConfigError> {
        parse(&format!("tenants:\n- name: a\n  key_sha256: [{}]\n{fields}", key_hash("k")))
    }

    #[test]
    fn a_tenant_gets_a_default_class_within_the_classes_it_may_use() {
        let class = |fields: &str| one(fields).map(|c| (c.tenants[0].priority, c.tenants[0].priorities.clone()));
        assert_eq!(class("").unwrap(), (Priority::Standard, None));
        assert_eq!(class("  priority: batch\n").unwrap().0, Priority::Batch);
        assert_eq!(class("  priorities: [batch]\n").unwrap().0, Priority::Batch, "the only one allowed");
        assert_eq!(class("  priorities: [interactive, standard]\n").unwrap().0, Priority::Standard);
        for bad in ["  priority: urgent\n", "  priority: interactive\n  priorities: [batch]\n", "  priorities: []\n"] {
            let e = one(bad).unwrap_err().to_string();
            assert!(e.contains("priorit"), "{bad:?}: {e}");
        }
        let t = &one("  priorities: [standard, batch]\n").unwrap().tenants[0];
        assert_eq!(t.class(None), Ok(Priority::Standard));
        assert_eq!(t.class(Some(Priority::Batch)), Ok(Priority::Batch));
        assert_eq!(
            t.class(Some(Priority::Interactive)),
            Err(LimitError::PriorityNotAllowed { class: Priority::Interactive })
        );
        assert_eq!(t.most_urgent(), Priority::Standard);
    }

    #[test]
    fn the_charts_example_tenant_parses_with_every_field() {
        // The commented example in deploy/helm/bellows/values.yaml, as the chart's toYaml writes it.
        let text = "# Generated by the bellows Helm chart from router.auth.tenants. Keys are SHA-256 hashes.\n\
            tenants:\n\
            - isolate_prefix_cache: false\n  \
              key_sha256:\n  - 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\n  \
              max_concurrent: 32\n  max_tokens: 4096\n  models:\n  - SmolLM2-135M-Instruct\n  \
              name: team-a\n  requests_per_minute: 600\n  tokens_per_minute: 200000\n  weight: 1\n";
        let config = parse(text).unwrap();
        assert_eq!(config.tenants.len(), 1);
        let t = &config.tenants[0];
        assert_eq!(
            **t,
            Tenant {
                name: "team-a".into(),
                models: Some(vec!["SmolLM2-135M-Instruct".into()]),
                requests_per_minute: Some(600),
                tokens_per_minute: Some(200000),
                max_concurrent: Some(32),
                max_tokens: Some(4096),
                weight: 1.0,
                isolate_prefix_cache: false,
                priority: Priority::Standard,
                priorities: None,
            }
        );
        // 9f86d0... is sha256("test").
        assert_eq!(config.keys, vec![(sha256(b"test"), 0)]);
    }

    #[test]
    fn absent_limits_are_unlimited_and_weight_defaults_to_one() {
        let config = parse(&format!("tenants:\n- name: t\n  key_sha256: [{}]\n  models: []\n", key_hash("k"))).unwrap();
        let t = &config.tenants[0];
        assert_eq!(
            (t.requests_per_minute, t.tokens_per_minute, t.max_concurrent, t.max_tokens),
            (None, None, None, None)
        );
        assert_eq!(t.weight, 1.0);
        assert!(t.models.is_none() && t.allows_model("anything"));
        assert!(!t.isolate_prefix_cache && t.cache_salt().is_none());
    }

    #[test]
    fn an_unknown_field_is_refused_naming_the_tenant_and_the_field() {
        let e = err("tenants:\n- name: team-a\n  key: sk-plaintext\n  key_sha256: [x]\n");
        assert!(e.contains("\"team-a\"") && e.contains("`key`"), "{e}");
        let e = err(&format!("tenants:\n- name: b\n  key_sha256: [{}]\n  request_per_minute: 5\n", key_hash("k")));
        assert!(e.contains("\"b\"") && e.contains("request_per_minute"), "{e}");
        let e = err("tenant:\n- name: a\n");
        assert!(e.contains("tenant"), "{e}");
    }

    #[test]
    fn a_wrong_type_is_refused_naming_the_field() {
        let e = err(&format!("tenants:\n- name: t\n  key_sha256: [{}]\n  tokens_per_minute: lots\n", key_hash("k")));
        assert!(e.contains("\"t\"") && e.contains("tokens_per_minute"), "{e}");
        let e = err(&format!("tenants:\n- name: t\n  key_sha256: [{}]\n  requests_per_minute: -1\n", key_hash("k")));
        assert!(e.contains("requests_per_minute"), "{e}");
    }

    #[test]
    fn a_missing_name_or_key_list_is_refused_naming_the_entry() {
        let e = err(&format!("tenants:\n- key_sha256: [{}]\n", key_hash("k")));
        assert!(e.contains("#1") && e.contains("name"), "{e}");
        let e = err("tenants:\n- name: t\n");
        assert!(e.contains("\"t\"") && e.contains("key_sha256"), "{e}");
        let e = err("tenants:\n- name: t\n  key_sha256: []\n");
        assert!(e.contains("\"t\"") && e.contains("key_sha256"), "{e}");
    }

    #[test]
    fn duplicate_names_are_refused() {
        let text = format!(
            "tenants:\n- name: a\n  key_sha256: [{}]\n- name: a\n  key_sha256: [{}]\n",
            key_hash("1"),
            key_hash("2")
        );
        assert_eq!(parse(&text).unwrap_err(), ConfigError::DuplicateName("a".into()));
    }

    #[test]
    fn a_key_hash_shared_by_two_tenants_or_listed_twice_is_refused() {
        let text = format!(
            "tenants:\n- name: a\n  key_sha256: [{}]\n- name: b\n  key_sha256: [{}, {}]\n",
            key_hash("1"),
            key_hash("2"),
            key_hash("1")
        );
        assert_eq!(parse(&text).unwrap_err(), ConfigError::DuplicateKey { first: "a".into(), second: "b".into() });
        let text = format!("tenants:\n- name: a\n  key_sha256: [{}, {}]\n", key_hash("1"), key_hash("1"));
        assert_eq!(parse(&text).unwrap_err(), ConfigError::DuplicateKey { first: "a".into(), second: "a".into() });
    }

    #[test]
    fn malformed_hashes_are_refused_and_never_echoed() {
        for bad in [
            "sk-live-plaintext-key".to_string(),
            key_hash("k")[..63].to_string(),
            format!("{}0", key_hash("k")),
            key_hash("k").to_uppercase(),
            format!("g{}", &key_hash("k")[1..]),
        ] {
            let e = err(&format!("tenants:\n- name: t\n  key_sha256: [{bad}]\n"));
            assert!(e.contains("\"t\"") && e.contains("key_sha256[0]"), "{e}");
            assert!(!e.contains(&bad), "the message must not repeat what may be a plain-text key: {e}");
        }
    }

    #[test]
    fn weight_must_be_positive_and_finite() {
        for w in ["0", "-1", ".inf", ".nan"] {
            let e = err(&format!("tenants:\n- name: t\n  key_sha256: [{}]\n  weight: {w}\n", key_hash("k")));
            assert!(e.contains("\"t\"") && e.contains("weight"), "{w}: {e}");
        }
        let ok = parse(&format!("tenants:\n- name: t\n  key_sha256: [{}]\n  weight: 0.5\n", key_hash("k"))).unwrap();
        assert_eq!(ok.tenants[0].weight, 0.5);
    }

    #[test]
    fn names_follow_the_charts_pattern() {
        for bad in ["-a", "a b", "ä", "", &"a".repeat(64)] {
            let e = err(&format!("tenants:\n- name: \"{bad}\"\n  key_sha256: [{}]\n", key_hash("k")));
            assert!(e.contains("name"), "{bad:?}: {e}");
        }
        parse(&format!("tenants:\n- name: A.b_c-9\n  key_sha256: [{}]\n", key_hash("k"))).unwrap();
    }

    #[test]
    fn an_empty_model_name_is_refused() {
        let e = err(&format!("tenants:\n- name: t\n  key_sha256: [{}]\n  models: [a, \"\"]\n", key_hash("k")));
        assert!(e.contains("models[1]"), "{e}");
    }

    #[test]
    fn an_empty_list_admits_nobody_but_a_missing_list_is_an_error() {
        assert!(parse("tenants: []\n").unwrap().tenants.is_empty());
        assert!(matches!(parse(""), Err(ConfigError::Syntax(_))));
        assert!(matches!(parse("tenants: 3\n"), Err(ConfigError::Syntax(_))));
    }

    /// A tenant of this name with an isolated cache and this rate limit.
    fn t(name: &str, limit: Option<u64>) -> Tenant {
        Tenant {
            name: name.into(),
            isolate_prefix_cache: true,
            requests_per_minute: limit,
            ..(*Tenant::anonymous()).clone()
        }
    }

    #[test]
    fn the_cache_salt_depends_on_the_name_only_and_differs_between_tenants() {
        let a = t("a", None).cache_salt().unwrap();
        assert_eq!(a, t("a", Some(5)).cache_salt().unwrap(), "stable across a reload that changes limits");
        assert_ne!(a, t("b", None).cache_salt().unwrap());
        assert_eq!(a.len(), 32);
        assert!(Tenant::anonymous().cache_salt().is_none());
    }

    #[test]
    fn a_request_salt_separates_chains_and_never_reaches_a_tenants_own() {
        let (isolated, shared) = (t("a", None), Tenant::anonymous());
        assert_eq!(isolated.prefix_salt(None), isolated.cache_salt(), "no request salt: the tenant's chain");
        assert_eq!(shared.prefix_salt(None), None, "no request salt: the shared chain");
        let salted = [
            isolated.prefix_salt(Some("s")).unwrap(),
            isolated.prefix_salt(Some("t")).unwrap(),
            shared.prefix_salt(Some("s")).unwrap(),
            t("b", None).prefix_salt(Some("s")).unwrap(),
        ];
        for (i, a) in salted.iter().enumerate() {
            assert!(a.contains('\0'), "a joined salt is never a tenant's hex salt");
            assert_ne!(Some(a.clone()), isolated.cache_salt());
            for b in &salted[i + 1..] {
                assert_ne!(a, b, "each (tenant, request salt) has its own chain");
            }
        }
        assert_eq!(isolated.prefix_salt(Some("s")), t("a", Some(5)).prefix_salt(Some("s")), "stable");
        // A shared tenant's salted requests meet those of another shared tenant with the salt.
        assert_eq!(shared.prefix_salt(Some("s")), Tenant::anonymous().prefix_salt(Some("s")));
    }

    #[test]
    fn huge_limits_are_clamped_not_refused() {
        let text = format!(
            "tenants:\n- name: t\n  key_sha256: [{}]\n  tokens_per_minute: 18446744073709551615\n",
            key_hash("k")
        );
        assert_eq!(parse(&text).unwrap().tenants[0].tokens_per_minute, Some(MAX_LIMIT));
    }
}
