//! Rendezvous stores: how ranks find each other before a communicator exists.
//!
//! Rank 0 publishes a value (NCCL's 128-byte unique id) under a key; the
//! other ranks read it, waiting until it is there. The trait is what a
//! launcher-provided store (TCP, file, Slurm) implements; [`MemStore`] is
//! the in-process one that tests and thread-per-GPU harnesses use.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::{CommError, Result};

/// A key-value store shared by the ranks of a job.
pub trait Store: Send + Sync {
    /// Publishes `value` under `key`, replacing an earlier value, and wakes
    /// every rank waiting for the key.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// The value under `key`, blocking until some rank has set it. Fails
    /// with [`CommError::Timeout`] (op `store get <key>`) after `timeout`.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
}

/// The map and the condition variable that `get` waits on.
type Shared = (Mutex<HashMap<String, Vec<u8>>>, Condvar);

/// An in-memory store: clones share the same map.
#[derive(Clone, Debug, Default)]
pub struct MemStore {
    shared: Arc<Shared>,
}

impl MemStore {
    /// An empty store.
    pub fn new() -> MemStore {
        MemStore::default()
    }
}

fn poisoned() -> CommError {
    CommError::invalid("MemStore", "a thread panicked while holding the store")
}

impl Store for MemStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let (map, cv) = &*self.shared;
        map.lock().map_err(|_| poisoned())?.insert(key.to_string(), value.to_vec());
        cv.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let (map, cv) = &*self.shared;
        let deadline = Instant::now() + timeout;
        let mut guard = map.lock().map_err(|_| poisoned())?;
        loop {
            if let Some(v) = guard.get(key) {
                return Ok(v.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    op: format!("store get {key}"),
                    seq: 0,
                    waited: timeout,
                    missing: Vec::new(),
                });
            }
            guard = cv.wait_timeout(guard, deadline - now).map_err(|_| poisoned())?.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_waits_for_set_and_times_out_otherwise() {
        let store = MemStore::new();
        let reader = store.clone();
        let t = std::thread::spawn(move || reader.get("id", Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        store.set("id", b"hello").unwrap();
        assert_eq!(t.join().unwrap().unwrap(), b"hello");
        let e = store.get("absent", Duration::from_millis(10)).unwrap_err();
        assert!(matches!(e, CommError::Timeout { ref op, .. } if op == "store get absent"), "{e}");
    }
}
