//! [`MemStore`]: the in-process store for ranks that are threads of one
//! process (the sim backend's harnesses, thread-per-GPU NCCL).

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::store::{add_outcome, compare_set_outcome, deadline_after, timeout_error, wait_op, Store};
use crate::{CommError, Result, StoreFailure};

/// The map and the condition variable that waiting operations sleep on.
type Shared = (Mutex<HashMap<String, Vec<u8>>>, Condvar);

/// An in-memory store: clones share the same map. Waiting operations sleep
/// on a condition variable that every change notifies.
#[derive(Clone, Debug, Default)]
pub struct MemStore {
    shared: Arc<Shared>,
}

impl MemStore {
    /// An empty store.
    pub fn new() -> MemStore {
        MemStore::default()
    }

    fn lock(&self) -> Result<MutexGuard<'_, HashMap<String, Vec<u8>>>> {
        self.shared.0.lock().map_err(|_| poisoned())
    }

    /// Locks the map once every key is present, or fails after `timeout`.
    fn lock_when_present(
        &self,
        keys: &[&str],
        timeout: Duration,
        op: impl Fn() -> String,
    ) -> Result<MutexGuard<'_, HashMap<String, Vec<u8>>>> {
        let (_, cv) = &*self.shared;
        let deadline = deadline_after(timeout);
        let mut guard = self.lock()?;
        loop {
            if keys.iter().all(|k| guard.contains_key(*k)) {
                return Ok(guard);
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return Err(timeout_error(op(), timeout));
            }
            guard = cv.wait_timeout(guard, deadline - now).map_err(|_| poisoned())?.0;
        }
    }
}

fn poisoned() -> CommError {
    CommError::store("memory", StoreFailure::Io, "a thread panicked while holding the store")
}

impl Store for MemStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.lock()?.insert(key.to_string(), value.to_vec());
        self.shared.1.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let guard = self.lock_when_present(&[key], timeout, || format!("store get {key}"))?;
        Ok(guard.get(key).cloned().unwrap_or_default())
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut map = self.lock()?;
        let sum = add_outcome(map.get(key).map(Vec::as_slice), delta)
            .map_err(|reason| CommError::store("memory", StoreFailure::BadValue, format!("add {key}: {reason}")))?;
        map.insert(key.to_string(), sum.to_string().into_bytes());
        drop(map);
        self.shared.1.notify_all();
        Ok(sum)
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let mut map = self.lock()?;
        let (store, answer) = compare_set_outcome(map.get(key).map(Vec::as_slice), expected, desired);
        if let Some(v) = store {
            map.insert(key.to_string(), v);
            drop(map);
            self.shared.1.notify_all();
        }
        Ok(answer)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.lock_when_present(keys, timeout, || wait_op(keys)).map(drop)
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let map = self.lock()?;
        Ok(keys.iter().all(|k| map.contains_key(*k)))
    }

    fn delete(&self, key: &str) -> Result<bool> {
        Ok(self.lock()?.remove(key).is_some())
    }

    fn num_keys(&self) -> Result<u64> {
        Ok(self.lock()?.len() as u64)
    }

    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let guard = self.lock_when_present(keys, timeout, || format!("store multi_get [{}]", keys.join(", ")))?;
        Ok(keys.iter().map(|k| guard.get(*k).cloned().unwrap_or_default()).collect())
    }

    fn multi_set(&self, entries: &[(&str, &[u8])]) -> Result<()> {
        let mut map = self.lock()?;
        for (k, v) in entries {
            map.insert(k.to_string(), v.to_vec());
        }
        drop(map);
        self.shared.1.notify_all();
        Ok(())
    }
}
