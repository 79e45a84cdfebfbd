//! Where stored responses live (`store: true`), so that a later request can continue one
//! (`previous_response_id`) and a client can read or delete it.
//!
//! A stored response belongs to its tenant: every lookup is by tenant and id together, so
//! another tenant's id is the same "not found" as an unknown one. Entries expire after a TTL
//! and the store holds a bounded number of bytes, dropping the oldest first: a store that only
//! grows is the leak other gateways have. A store that fails never fails a request that does
//! not read from it: writes that fail are logged, not raised (`responses::response`).

use std::{
    collections::{HashMap, VecDeque},
    sync::Mutex,
    time::{Duration, Instant},
};

use serde_json::Value;

/// One stored response: the object `GET /v1/responses/{id}` returns, the request's own input
/// items (`/input_items`), and the conversation a continuation starts from.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Stored {
    pub response: Value,
    pub input_items: Vec<Value>,
    /// Every item up to and including this response's output, `instructions` left out (they
    /// are not carried over to a continuation).
    pub context: Vec<Value>,
}

impl Stored {
    fn bytes(&self) -> usize {
        let size = |v: &Value| v.to_string().len();
        size(&self.response)
            + self.input_items.iter().map(size).sum::<usize>()
            + self.context.iter().map(size).sum::<usize>()
    }
}

/// Why the store could not answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The backend's own reason (the HTTP layer says that the store is unavailable).
    #[error("{0}")]
    Unavailable(String),
    #[error("a response of {bytes} bytes is larger than the whole store ({max} bytes)")]
    TooLarge { bytes: usize, max: usize },
}

/// A backend for stored responses.
#[async_trait::async_trait]
pub trait ResponseStore: Send + Sync {
    async fn put(&self, tenant: &str, id: &str, stored: Stored) -> Result<(), StoreError>;
    /// The response, if this tenant stored it and it has not expired.
    async fn get(&self, tenant: &str, id: &str) -> Result<Option<Stored>, StoreError>;
    /// Whether there was such a response to delete.
    async fn delete(&self, tenant: &str, id: &str) -> Result<bool, StoreError>;
}

/// The embedded store: this router's memory, for one router (a cluster of routers shares a
/// database instead, so that any replica reads what another stored: `super::postgres`).
pub struct MemoryStore {
    ttl: Duration,
    max_bytes: usize,
    inner: Mutex<Memory>,
}

#[derive(Default)]
struct Memory {
    entries: HashMap<(String, String), Entry>,
    /// Keys oldest first, for eviction (a deleted or replaced key may linger here: skipped).
    order: VecDeque<((String, String), u64)>,
    bytes: usize,
    next_serial: u64,
}

struct Entry {
    stored: Stored,
    bytes: usize,
    expires: Instant,
    serial: u64,
}

impl MemoryStore {
    pub fn new(ttl: Duration, max_bytes: usize) -> Self {
        MemoryStore { ttl, max_bytes, inner: Mutex::new(Memory::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Memory> {
        self.inner.lock().expect("response store lock")
    }
}

impl Memory {
    fn remove(&mut self, key: &(String, String)) -> Option<Entry> {
        let entry = self.entries.remove(key)?;
        self.bytes -= entry.bytes;
        Some(entry)
    }

    /// Drop the oldest entries until `room` more bytes fit under `max`.
    fn make_room(&mut self, room: usize, max: usize) {
        while self.bytes + room > max {
            let Some((key, serial)) = self.order.pop_front() else { return };
            if self.entries.get(&key).is_some_and(|e| e.serial == serial) {
                self.remove(&key);
            }
        }
    }
}

#[async_trait::async_trait]
impl ResponseStore for MemoryStore {
    async fn put(&self, tenant: &str, id: &str, stored: Stored) -> Result<(), StoreError> {
        let bytes = stored.bytes();
        let key = (tenant.to_string(), id.to_string());
        let mut m = self.lock();
        m.remove(&key);
        if bytes > self.max_bytes {
            return Err(StoreError::TooLarge { bytes, max: self.max_bytes });
        }
        m.make_room(bytes, self.max_bytes);
        m.next_serial += 1;
        let serial = m.next_serial;
        m.order.push_back((key.clone(), serial));
        m.bytes += bytes;
        m.entries.insert(key, Entry { stored, bytes, expires: Instant::now() + self.ttl, serial });
        Ok(())
    }

    async fn get(&self, tenant: &str, id: &str) -> Result<Option<Stored>, StoreError> {
        let key = (tenant.to_string(), id.to_string());
        let mut m = self.lock();
        match m.entries.get(&key) {
            Some(e) if e.expires > Instant::now() => Ok(Some(e.stored.clone())),
            Some(_) => {
                m.remove(&key);
                Ok(None)
            }
            None => Ok(None),
        }
    }

    async fn delete(&self, tenant: &str, id: &str) -> Result<bool, StoreError> {
        let key = (tenant.to_string(), id.to_string());
        Ok(self.lock().remove(&key).is_some_and(|e| e.expires > Instant::now()))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn stored(text: &str) -> Stored {
        Stored { response: json!({"text": text}), input_items: vec![], context: vec![json!(text)] }
    }

    #[tokio::test]
    async fn a_response_is_found_only_by_the_tenant_that_stored_it() {
        let s = MemoryStore::new(Duration::from_secs(60), 1 << 20);
        s.put("a", "resp_1", stored("x")).await.unwrap();
        assert_eq!(s.get("a", "resp_1").await.unwrap(), Some(stored("x")));
        assert_eq!(s.get("b", "resp_1").await.unwrap(), None, "another tenant's id is unknown");
        assert!(!s.delete("b", "resp_1").await.unwrap());
        assert!(s.delete("a", "resp_1").await.unwrap());
        assert_eq!(s.get("a", "resp_1").await.unwrap(), None);
    }

    #[tokio::test]
    async fn an_expired_response_is_gone() {
        let s = MemoryStore::new(Duration::ZERO, 1 << 20);
        s.put("a", "resp_1", stored("x")).await.unwrap();
        assert_eq!(s.get("a", "resp_1").await.unwrap(), None);
    }

    #[tokio::test]
    async fn the_oldest_responses_make_room_and_the_bytes_stay_bounded() {
        let one = stored("0123456789").bytes();
        let s = MemoryStore::new(Duration::from_secs(60), one * 3);
        for i in 0..5 {
            s.put("a", &format!("resp_{i}"), stored("0123456789")).await.unwrap();
            assert!(s.lock().bytes <= one * 3);
        }
        for (i, kept) in [false, false, true, true, true].into_iter().enumerate() {
            assert_eq!(s.get("a", &format!("resp_{i}")).await.unwrap().is_some(), kept, "resp_{i}");
        }
        let too_big = Stored { context: vec![json!("x".repeat(one * 3))], ..stored("y") };
        assert!(s.put("a", "big", too_big).await.is_err(), "larger than the whole store");
    }
}
