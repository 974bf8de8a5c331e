//! The [`Store`] trait: the key-value store ranks rendezvous through, with
//! PyTorch's `c10d::Store` semantics, and [`PrefixStore`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{CommError, Result};

/// A key-value store shared by the ranks of a job (PyTorch's `c10d::Store`).
///
/// Keys are strings, values are bytes. Every operation is atomic with
/// respect to the others on the same store (linearizable): a `set` seen by
/// one rank is seen by every later operation of every rank. Operations that
/// can wait for another rank take a `timeout` and fail with
/// [`CommError::Timeout`] when it passes; the others return as soon as the
/// store answered (a TCP store bounds them with its I/O timeout). Other
/// failures are [`CommError::Store`] (unreachable, protocol, limit, bad
/// value, I/O).
///
/// Every implementation (`MemStore`, `FileStore`, `TcpStore`, `PrefixStore`)
/// passes one shared test suite of these semantics.
pub trait Store: Send + Sync {
    /// Publishes `value` under `key`, replacing an earlier value, and wakes
    /// every rank waiting for the key.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// The value under `key`, blocking until some rank has set it. Fails
    /// with [`CommError::Timeout`] (op `store get <key>`) after `timeout`.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;

    /// Adds `delta` to the integer under `key` (0 when absent) and returns
    /// the new value. The value is stored as its decimal text (`"42"`), as
    /// PyTorch does, so `get` reads it back as bytes. Fails with
    /// [`StoreFailure::BadValue`](crate::StoreFailure::BadValue) when the
    /// stored value is not a decimal integer or the sum overflows.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// Compare-and-set with PyTorch's semantics, returning what the caller
    /// should take as the current value:
    /// - `key` absent and `expected` empty: stores `desired`, returns `desired`;
    /// - `key` absent and `expected` not empty: stores nothing, returns `expected`;
    /// - `key` present and equal to `expected`: stores `desired`, returns `desired`;
    /// - `key` present and different: stores nothing, returns the stored value.
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>>;

    /// Blocks until every key in `keys` is set (at once for an empty list);
    /// fails with [`CommError::Timeout`] after `timeout`.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;

    /// Whether every key in `keys` is set now (true for an empty list).
    fn check(&self, keys: &[&str]) -> Result<bool>;

    /// Removes `key`; returns whether it was there. Ranks waiting for the
    /// key keep waiting.
    fn delete(&self, key: &str) -> Result<bool>;

    /// How many keys the store holds. A shared store counts every key in it,
    /// including those of other users (PyTorch's `num_keys` does the same).
    fn num_keys(&self) -> Result<u64>;

    /// The values under `keys`, in order, blocking until all of them are set;
    /// fails with [`CommError::Timeout`] after `timeout`.
    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>>;

    /// Sets every `(key, value)` pair, in order (a later pair for the same
    /// key wins).
    fn multi_set(&self, entries: &[(&str, &[u8])]) -> Result<()>;
}

/// The trait's methods, forwarded to `**self` (for smart pointers).
macro_rules! forward_store {
    () => {
        fn set(&self, key: &str, value: &[u8]) -> Result<()> {
            (**self).set(key, value)
        }
        fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
            (**self).get(key, timeout)
        }
        fn add(&self, key: &str, delta: i64) -> Result<i64> {
            (**self).add(key, delta)
        }
        fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
            (**self).compare_set(key, expected, desired)
        }
        fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
            (**self).wait(keys, timeout)
        }
        fn check(&self, keys: &[&str]) -> Result<bool> {
            (**self).check(keys)
        }
        fn delete(&self, key: &str) -> Result<bool> {
            (**self).delete(key)
        }
        fn num_keys(&self) -> Result<u64> {
            (**self).num_keys()
        }
        fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
            (**self).multi_get(keys, timeout)
        }
        fn multi_set(&self, entries: &[(&str, &[u8])]) -> Result<()> {
            (**self).multi_set(entries)
        }
    };
}

/// A shared store is a store (`Arc<dyn Store>` is what launchers hand out).
impl<S: Store + ?Sized> Store for Arc<S> {
    forward_store!();
}

/// A boxed store is a store.
impl<S: Store + ?Sized> Store for Box<S> {
    forward_store!();
}

/// A view of a store where every key is `"{prefix}/{key}"`, as PyTorch's
/// `PrefixStore` writes them, so that users of one store (a process group,
/// a restart attempt) do not see each other's keys. Nesting prefix stores
/// nests the prefixes. `num_keys` counts every key of the underlying store,
/// as PyTorch's does.
#[derive(Clone, Debug)]
pub struct PrefixStore<S> {
    prefix: String,
    inner: S,
}

impl<S: Store> PrefixStore<S> {
    /// Keys of `inner` under `prefix` (without the trailing `/`, which is added).
    pub fn new(prefix: impl Into<String>, inner: S) -> PrefixStore<S> {
        PrefixStore { prefix: prefix.into(), inner }
    }

    /// The prefix (without the joining `/`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The underlying store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }

    fn keys(&self, keys: &[&str]) -> Vec<String> {
        keys.iter().map(|k| self.key(k)).collect()
    }
}

fn as_strs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

impl<S: Store> Store for PrefixStore<S> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get(&self.key(key), timeout)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.inner.compare_set(&self.key(key), expected, desired)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.inner.wait(&as_strs(&self.keys(keys)), timeout)
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        self.inner.check(&as_strs(&self.keys(keys)))
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(&self.key(key))
    }

    fn num_keys(&self) -> Result<u64> {
        self.inner.num_keys()
    }

    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.inner.multi_get(&as_strs(&self.keys(keys)), timeout)
    }

    fn multi_set(&self, entries: &[(&str, &[u8])]) -> Result<()> {
        let keys: Vec<String> = entries.iter().map(|(k, _)| self.key(k)).collect();
        let prefixed: Vec<(&str, &[u8])> = keys.iter().zip(entries).map(|(k, (_, v))| (k.as_str(), *v)).collect();
        self.inner.multi_set(&prefixed)
    }
}

// ---------------------------------------------------------------------------
// Semantics shared by the implementations (and the TCP server), written once.

/// `now + timeout`, saturating far in the future instead of overflowing
/// (`Duration::MAX` means "no deadline" to callers).
pub(crate) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout).unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// The timeout error of a store operation.
pub(crate) fn timeout_error(op: String, waited: Duration) -> CommError {
    CommError::Timeout { op, seq: 0, waited, missing: Vec::new() }
}

/// `store wait [a, b]`, for timeout errors.
pub(crate) fn wait_op(keys: &[&str]) -> String {
    format!("store wait [{}]", keys.join(", "))
}

/// What compare-and-set stores (if anything) and returns, given the current
/// value: PyTorch's rules, see [`Store::compare_set`].
pub(crate) fn compare_set_outcome(
    current: Option<&[u8]>,
    expected: &[u8],
    desired: &[u8],
) -> (Option<Vec<u8>>, Vec<u8>) {
    match current {
        None if expected.is_empty() => (Some(desired.to_vec()), desired.to_vec()),
        None => (None, expected.to_vec()),
        Some(cur) if cur == expected => (Some(desired.to_vec()), desired.to_vec()),
        Some(cur) => (None, cur.to_vec()),
    }
}

/// Parses a stored counter like C's `strtoll` as PyTorch's `std::stoll`
/// does: leading whitespace, an optional sign, at least one digit, and
/// whatever follows the digits is ignored. `None` when there is no number
/// or it does not fit an `i64`.
pub(crate) fn parse_counter(value: &[u8]) -> Option<i64> {
    let mut i = value.iter().take_while(|b| b.is_ascii_whitespace()).count();
    let negative = match value.get(i) {
        Some(b'-') => {
            i += 1;
            true
        }
        Some(b'+') => {
            i += 1;
            false
        }
        _ => false,
    };
    let digits = value[i.min(value.len())..].iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return None;
    }
    let mut n: i64 = 0;
    for &d in &value[i..i + digits] {
        let d = i64::from(d - b'0');
        n = n.checked_mul(10)?;
        n = if negative { n.checked_sub(d)? } else { n.checked_add(d)? };
    }
    Some(n)
}

/// The new counter after adding `delta` to `current` (absent = 0), or why not.
pub(crate) fn add_outcome(current: Option<&[u8]>, delta: i64) -> std::result::Result<i64, String> {
    let base = match current {
        None => 0,
        Some(v) => parse_counter(v)
            .ok_or_else(|| format!("the stored value {:?} is not a decimal integer", String::from_utf8_lossy(v)))?,
    };
    base.checked_add(delta).ok_or_else(|| format!("{base} + {delta} overflows an i64"))
}

/// Polls with a growing sleep (1 ms doubling to 20 ms) until `ready` says
/// yes or `deadline` passes; `Ok(false)` on the deadline. For stores that
/// cannot be notified (files).
pub(crate) fn poll_until(deadline: Instant, mut ready: impl FnMut() -> Result<bool>) -> Result<bool> {
    let mut sleep = Duration::from_millis(1);
    loop {
        if ready()? {
            return Ok(true);
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(false);
        }
        std::thread::sleep(sleep.min(deadline - now));
        sleep = (sleep * 2).min(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_parse_like_stoll() {
        assert_eq!(parse_counter(b"42"), Some(42));
        assert_eq!(parse_counter(b"  -7"), Some(-7));
        assert_eq!(parse_counter(b"+3abc"), Some(3));
        assert_eq!(parse_counter(b"9223372036854775807"), Some(i64::MAX));
        assert_eq!(parse_counter(b"-9223372036854775808"), Some(i64::MIN));
        assert_eq!(parse_counter(b"9223372036854775808"), None);
        assert_eq!(parse_counter(b""), None);
        assert_eq!(parse_counter(b"-"), None);
        assert_eq!(parse_counter(b"x1"), None);
        assert_eq!(add_outcome(None, 5), Ok(5));
        assert_eq!(add_outcome(Some(b"5"), -7), Ok(-2));
        assert!(add_outcome(Some(b"abc"), 1).is_err());
        assert!(add_outcome(Some(b"9223372036854775807"), 1).is_err());
    }

    #[test]
    fn compare_set_follows_pytorch() {
        assert_eq!(compare_set_outcome(None, b"", b"d"), (Some(b"d".to_vec()), b"d".to_vec()));
        assert_eq!(compare_set_outcome(None, b"e", b"d"), (None, b"e".to_vec()));
        assert_eq!(compare_set_outcome(Some(b"e"), b"e", b"d"), (Some(b"d".to_vec()), b"d".to_vec()));
        assert_eq!(compare_set_outcome(Some(b"x"), b"e", b"d"), (None, b"x".to_vec()));
    }

    #[test]
    fn huge_timeouts_do_not_overflow() {
        assert!(deadline_after(Duration::MAX) > Instant::now());
    }
}
