//! Barriers through a [`Store`], waited for on the store's side.
//!
//! A [`StoreBarrier`] of `parties` under `key`: every party adds 1 to
//! `{key}/arrived`; the party whose add makes it `parties` sets
//! `{key}/done`; every party waits for `{key}/done` with a deadline. So a
//! party makes one `add`, one `get` (a `WAIT` then a `GET` on a TCP store,
//! answered by the server when the key is set) and the last one a `set`,
//! however long it waits: no polling, whatever the store (a memory store
//! sleeps on its condition variable; a file store polls one file, as all its
//! waits do). A cancel sets `done` to a cancelled value, so every waiter
//! fails at once with the reason instead of at its deadline.
//!
//! A [`RoundBarrier`] is a reusable one: round `r` is the barrier under
//! `{prefix}/{r}`.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::store::Store;
use crate::{CommError, Result};

/// The value of `done` when every party arrived.
const RELEASED: &[u8] = b"released";
/// The start of the value of `done` when the barrier was cancelled (the reason follows).
const CANCELLED: &[u8] = b"cancelled: ";

/// A one-shot barrier of `parties` under `key`; see the module documentation.
/// Every party uses the same key and count; a key is used by one barrier only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreBarrier {
    key: String,
    parties: usize,
}

impl StoreBarrier {
    /// The barrier of `parties` (at least 1) under `key`.
    pub fn new(key: impl Into<String>, parties: usize) -> Result<StoreBarrier> {
        let key = key.into();
        if parties == 0 {
            return Err(CommError::invalid("store barrier", format!("{key}: a barrier of 0 parties")));
        }
        Ok(StoreBarrier { key, parties })
    }

    /// The key its counter and release live under.
    pub fn key(&self) -> &str {
        &self.key
    }

    fn arrived_key(&self) -> String {
        format!("{}/arrived", self.key)
    }

    fn done_key(&self) -> String {
        format!("{}/done", self.key)
    }

    /// Counts this party in, without waiting; the last party releases the
    /// others. Fails with `InvalidArgument` when more than `parties` have
    /// arrived (the key is used by another barrier or another job).
    pub fn arrive(&self, store: &dyn Store) -> Result<()> {
        let arrived = store.add(&self.arrived_key(), 1)?;
        let parties = self.parties as i64;
        if arrived == parties {
            store.set(&self.done_key(), RELEASED)?;
        } else if arrived > parties {
            return Err(CommError::invalid(
                "store barrier",
                format!(
                    "{}: {arrived} arrivals at a barrier of {parties} parties (the key is shared with another barrier or job)",
                    self.key
                ),
            ));
        }
        Ok(())
    }

    /// Waits until every party has arrived. Fails with `Timeout` after
    /// `timeout` (its op says how many had arrived) and with `Aborted` as
    /// soon as the barrier is cancelled.
    pub fn wait(&self, store: &dyn Store, timeout: Duration) -> Result<()> {
        match store.get(&self.done_key(), timeout) {
            Ok(v) if v == RELEASED => Ok(()),
            Ok(v) => match v.strip_prefix(CANCELLED) {
                Some(reason) => Err(CommError::Aborted {
                    reason: format!("store barrier {} cancelled: {}", self.key, String::from_utf8_lossy(reason)),
                }),
                None => Err(CommError::invalid(
                    "store barrier",
                    format!("{}: its release key holds {:?}", self.key, String::from_utf8_lossy(&v)),
                )),
            },
            Err(CommError::Timeout { waited, .. }) => Err(CommError::Timeout {
                op: format!("store barrier {}: {} of {} parties arrived", self.key, self.arrivals(store), self.parties),
                seq: 0,
                waited,
                missing: Vec::new(),
            }),
            Err(e) => Err(e),
        }
    }

    /// [`arrive`](Self::arrive), then [`wait`](Self::wait).
    pub fn arrive_and_wait(&self, store: &dyn Store, timeout: Duration) -> Result<()> {
        self.arrive(store)?;
        self.wait(store, timeout)
    }

    /// Fails every party's wait (present and future) with `reason`, unless
    /// the barrier was already released.
    pub fn cancel(&self, store: &dyn Store, reason: &str) -> Result<()> {
        let mut value = CANCELLED.to_vec();
        value.extend_from_slice(reason.as_bytes());
        store.compare_set(&self.done_key(), b"", &value).map(drop)
    }

    /// How many parties have arrived, for messages ("?" when the store cannot say).
    fn arrivals(&self, store: &dyn Store) -> String {
        let key = self.arrived_key();
        match store.check(&[&key]) {
            Ok(false) => "0".into(),
            Ok(true) => store
                .get(&key, Duration::from_millis(100))
                .map(|v| String::from_utf8_lossy(&v).into_owned())
                .unwrap_or_else(|_| "?".into()),
            Err(_) => "?".into(),
        }
    }
}

/// A reusable barrier: each [`wait`](RoundBarrier::wait) is the next round,
/// a [`StoreBarrier`] under `{prefix}/{round}`. Every party waits the same
/// number of rounds.
pub struct RoundBarrier {
    store: Arc<dyn Store>,
    prefix: String,
    parties: usize,
    /// Rounds this party has entered.
    round: Mutex<u64>,
}

impl std::fmt::Debug for RoundBarrier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoundBarrier").field("prefix", &self.prefix).field("parties", &self.parties).finish()
    }
}

impl RoundBarrier {
    /// Rounds of `parties` (at least 1) under `prefix` in `store`.
    pub fn new(store: Arc<dyn Store>, prefix: impl Into<String>, parties: usize) -> Result<RoundBarrier> {
        let prefix = prefix.into();
        StoreBarrier::new(prefix.clone(), parties)?;
        Ok(RoundBarrier { store, prefix, parties, round: Mutex::new(0) })
    }

    fn at(&self, round: u64) -> StoreBarrier {
        StoreBarrier { key: format!("{}/{round}", self.prefix), parties: self.parties }
    }

    /// The next round: arrives, and waits for every party (see [`StoreBarrier::wait`]).
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        let round = {
            let mut r = self.round.lock().unwrap_or_else(PoisonError::into_inner);
            *r += 1;
            *r
        };
        self.at(round).arrive_and_wait(&*self.store, timeout)
    }

    /// Fails the rounds the other parties can be waiting in with `reason`:
    /// this party's current round and the next (no party can be further
    /// ahead: a round is released only once this party has entered it).
    pub fn cancel(&self, reason: &str) -> Result<()> {
        let round = (*self.round.lock().unwrap_or_else(PoisonError::into_inner)).max(1);
        self.at(round).cancel(&*self.store, reason)?;
        self.at(round + 1).cancel(&*self.store, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::MemStore;

    #[test]
    fn zero_parties_and_a_reused_key_are_refused() {
        assert!(matches!(StoreBarrier::new("b", 0), Err(CommError::InvalidArgument { .. })));
        let store = MemStore::new();
        let b = StoreBarrier::new("b", 1).unwrap();
        b.arrive_and_wait(&store, Duration::from_secs(1)).unwrap();
        let e = b.arrive(&store).unwrap_err();
        assert!(e.to_string().contains("2 arrivals at a barrier of 1"), "{e}");
    }
}
