//! API keys: `Authorization: Bearer <key>` → SHA-256 → the tenant that lists that hash.
//!
//! The lookup compares the presented key's hash with every stored hash in constant time and
//! never stops early, so how long it takes says nothing about which hashes exist or how close a
//! guess came. (Hashing first already makes a timing leak harmless: what could leak is the
//! prefix of a SHA-256 hash, and nobody can choose a key whose hash has a chosen prefix. The
//! constant-time scan is a second wall, cheap at any realistic number of keys: 32 bytes each.)
//!
//! Every failure (no header, another scheme, an empty or unknown key) is the same [`AuthError`]
//! with the same message, so a caller learns nothing about which keys exist.

use std::path::Path;

use anyhow::Context;
use subtle::{ConditionallySelectable, ConstantTimeEq};

use super::config::{TenantsConfig, parse_sha256_hex, sha256};

/// A missing, malformed or unknown API key (401). One message for all: it must not tell an
/// unknown key from a malformed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("invalid or missing API key")]
pub struct AuthError;

/// The key in an `Authorization` header value: the scheme is case-insensitive (RFC 9110), the
/// key is everything after it, surrounding whitespace removed.
pub fn bearer_key(authorization: Option<&str>) -> Option<&str> {
    let value = authorization?.trim();
    let (scheme, key) = value.split_once(char::is_whitespace)?;
    let key = key.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !key.is_empty()).then_some(key)
}

/// The index in `config.tenants` of the tenant that owns `key`.
pub(crate) fn find_tenant(config: &TenantsConfig, key: &str) -> Option<usize> {
    let digest = sha256(key.as_bytes());
    let mut found = subtle::Choice::from(0);
    let mut index = 0u64;
    for (hash, tenant) in &config.keys {
        let eq = hash.ct_eq(&digest);
        index = u64::conditional_select(&index, &(*tenant as u64), eq);
        found |= eq;
    }
    bool::from(found).then_some(index as usize)
}

/// The admin key, for the usage endpoint. Its file (`--admin-key-file`) holds the key's SHA-256
/// (64 lowercase hex digits, `printf %s "$KEY" | sha256sum`), like the tenants file: no file or
/// Secret of the gateway holds a usable key.
#[derive(Clone)]
pub struct AdminKey {
    hash: [u8; 32],
}

impl std::fmt::Debug for AdminKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminKey(..)")
    }
}

impl AdminKey {
    pub fn from_sha256_hex(text: &str) -> anyhow::Result<Self> {
        let hash = parse_sha256_hex(text.trim()).context(
            "the admin key file must hold the SHA-256 of the admin key (64 lowercase hex digits, as `printf %s \
             \"$KEY\" | sha256sum` prints), not the key itself",
        )?;
        Ok(AdminKey { hash })
    }

    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::from_sha256_hex(&text).with_context(|| format!("in {}", path.display()))
    }

    /// Whether an `Authorization` header value carries the admin key; constant time in the key.
    pub fn check(&self, authorization: Option<&str>) -> bool {
        bearer_key(authorization).is_some_and(|key| bool::from(sha256(key.as_bytes()).ct_eq(&self.hash)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenants::config::{parse, tests::key_hash};

    #[test]
    fn only_a_bearer_header_with_a_key_yields_a_key() {
        assert_eq!(bearer_key(Some("Bearer sk-1")), Some("sk-1"));
        assert_eq!(bearer_key(Some("bearer   sk-1  ")), Some("sk-1"));
        assert_eq!(bearer_key(Some("BEARER\tsk-1")), Some("sk-1"));
        for bad in [None, Some(""), Some("Bearer"), Some("Bearer   "), Some("Basic dXNlcjpw"), Some("sk-1")] {
            assert_eq!(bearer_key(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn each_key_finds_its_own_tenant_and_no_other() {
        let config = parse(&format!(
            "tenants:\n- name: a\n  key_sha256: [{}, {}]\n- name: b\n  key_sha256: [{}]\n",
            key_hash("a-1"),
            key_hash("a-2"),
            key_hash("b-1")
        ))
        .unwrap();
        assert_eq!(find_tenant(&config, "a-1"), Some(0));
        assert_eq!(find_tenant(&config, "a-2"), Some(0));
        assert_eq!(find_tenant(&config, "b-1"), Some(1));
        assert_eq!(find_tenant(&config, "b-2"), None);
        // The hash itself is not a key.
        assert_eq!(find_tenant(&config, &key_hash("a-1")), None);
    }

    #[test]
    fn the_admin_key_file_holds_a_hash_and_the_key_opens_it() {
        let admin = AdminKey::from_sha256_hex(&format!("{}\n", key_hash("root"))).unwrap();
        assert!(admin.check(Some("Bearer root")));
        assert!(!admin.check(Some("Bearer roo")));
        assert!(!admin.check(Some(&format!("Bearer {}", key_hash("root")))));
        assert!(!admin.check(None));
        let e = AdminKey::from_sha256_hex("root").unwrap_err().to_string();
        assert!(e.contains("SHA-256") && !e.contains("root"), "{e}");
        assert_eq!(format!("{admin:?}"), "AdminKey(..)");
    }

    #[test]
    fn one_error_for_every_failure() {
        let message = AuthError.to_string();
        assert!(!message.contains("unknown") && !message.contains("tenant"), "{message}");
    }
}
