//! The server's memory budget: the keys, values, queues and waiting
//! connections it holds, and what each costs against
//! [`ServerOptions::max_memory_bytes`](super::ServerOptions::max_memory_bytes).

use std::collections::{HashMap, VecDeque};

use super::options::ENTRY_OVERHEAD;

/// The capacity `v` gets to take `n` more bytes: its own when they fit,
/// else doubled (amortised growth, at most to `soft_max` unless the bytes
/// need more), so a buffer or value that grows by pieces is copied O(log n)
/// times, not once per piece.
pub(super) fn grown_capacity(v: &Vec<u8>, n: usize, soft_max: usize) -> usize {
    if v.capacity() - v.len() >= n {
        v.capacity()
    } else {
        (v.len() + n).max(v.capacity().saturating_mul(2).min(soft_max))
    }
}

/// Grows `v` to `target` capacity (from [`grown_capacity`]) and appends `bytes`.
pub(super) fn extend_to(v: &mut Vec<u8>, target: usize, bytes: &[u8]) {
    if v.capacity() < target {
        v.reserve_exact(target - v.len());
    }
    v.extend_from_slice(bytes);
}

/// What a stored key and value cost in the budget.
pub(super) fn entry_cost(key: &[u8], value: &Vec<u8>) -> usize {
    key.len() + value.capacity() + ENTRY_OVERHEAD
}

/// What waiting for `keys` costs: each key is held twice (by key, by connection).
pub(super) fn wait_cost(keys: &[Vec<u8>]) -> usize {
    keys.iter().map(|k| 2 * (k.len() + ENTRY_OVERHEAD)).sum()
}

/// The keys, values, queues and waiting connections, and what they cost.
#[derive(Default)]
pub(super) struct State {
    pub(super) data: HashMap<Vec<u8>, Vec<u8>>,
    /// Queues; a queue that empties is removed.
    pub(super) queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    /// Key -> connections waiting for it.
    pub(super) waiters: HashMap<Vec<u8>, Vec<u64>>,
    /// Connection -> (keys still awaited, the keys it is registered under).
    pub(super) awaiting: HashMap<u64, (usize, Vec<Vec<u8>>)>,
    /// The budget's share of all of the above.
    pub(super) bytes: usize,
}

impl State {
    pub(super) fn present(&self, key: &[u8]) -> bool {
        self.data.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    /// The budget `put(key, value)` adds (0 when it shrinks the entry).
    pub(super) fn put_cost(&self, key: &[u8], value: &Vec<u8>) -> usize {
        let old = self.data.get(key).map_or(0, |v| entry_cost(key, v));
        entry_cost(key, value).saturating_sub(old)
    }

    /// Stores `value` under `key` (its cost checked by the caller).
    pub(super) fn put(&mut self, key: &[u8], value: Vec<u8>) {
        self.bytes += entry_cost(key, &value);
        if let Some(old) = self.data.insert(key.to_vec(), value) {
            self.bytes -= entry_cost(key, &old);
        }
    }

    /// The budget appending `n` bytes to `key` adds.
    pub(super) fn append_cost(&self, key: &[u8], n: usize) -> usize {
        match self.data.get(key) {
            Some(v) => grown_capacity(v, n, usize::MAX) - v.capacity(),
            None => key.len() + n + ENTRY_OVERHEAD,
        }
    }

    /// Appends in place, growing the value by doubling: linear in the bytes
    /// appended overall, where copying the value each time was quadratic.
    pub(super) fn append(&mut self, key: &[u8], bytes: &[u8]) {
        match self.data.get_mut(key) {
            Some(v) => {
                let before = v.capacity();
                extend_to(v, grown_capacity(v, bytes.len(), usize::MAX), bytes);
                self.bytes += v.capacity() - before;
            }
            None => self.put(key, bytes.to_vec()),
        }
    }

    pub(super) fn remove(&mut self, key: &[u8]) -> bool {
        match self.data.remove(key) {
            Some(v) => {
                self.bytes -= entry_cost(key, &v);
                true
            }
            None => false,
        }
    }

    /// The budget pushing `value` to queue `key` adds.
    pub(super) fn push_cost(&self, key: &[u8], value: &Vec<u8>) -> usize {
        let new_queue = if self.queues.contains_key(key) { 0 } else { key.len() + ENTRY_OVERHEAD };
        new_queue + value.capacity() + ENTRY_OVERHEAD
    }

    pub(super) fn push(&mut self, key: &[u8], value: Vec<u8>) {
        self.bytes += self.push_cost(key, &value);
        self.queues.entry(key.to_vec()).or_default().push_back(value);
    }

    /// The queue's length before the pop and the element popped; a queue
    /// left empty is removed (a pop of an absent queue creates nothing).
    pub(super) fn pop(&mut self, key: &[u8]) -> (usize, Option<Vec<u8>>) {
        let Some(queue) = self.queues.get_mut(key) else { return (0, None) };
        let len = queue.len();
        let value = queue.pop_front();
        if let Some(v) = &value {
            self.bytes -= v.capacity() + ENTRY_OVERHEAD;
        }
        if queue.is_empty() {
            self.queues.remove(key);
            self.bytes -= key.len() + ENTRY_OVERHEAD;
        }
        (len, value)
    }

    pub(super) fn register_wait(&mut self, conn: u64, keys: Vec<Vec<u8>>) {
        self.clear_wait(conn);
        for k in &keys {
            self.waiters.entry(k.clone()).or_default().push(conn);
        }
        self.bytes += wait_cost(&keys);
        self.awaiting.insert(conn, (keys.len(), keys));
    }

    /// Forgets `conn`'s wait, refunding what its registration cost.
    pub(super) fn forget_wait(&mut self, conn: u64) -> Option<Vec<Vec<u8>>> {
        let (_, keys) = self.awaiting.remove(&conn)?;
        self.bytes -= wait_cost(&keys);
        Some(keys)
    }

    pub(super) fn clear_wait(&mut self, conn: u64) {
        if let Some(keys) = self.forget_wait(conn) {
            for k in keys {
                if let Some(list) = self.waiters.get_mut(&k) {
                    list.retain(|&c| c != conn);
                    if list.is_empty() {
                        self.waiters.remove(&k);
                    }
                }
            }
        }
    }

    /// Counts `key` as arrived for one waiting connection; true when that
    /// was its last awaited key.
    pub(super) fn arrived(&mut self, conn: u64) -> bool {
        match self.awaiting.get_mut(&conn) {
            Some((remaining, _)) => {
                *remaining = remaining.saturating_sub(1);
                if *remaining == 0 {
                    self.forget_wait(conn);
                    true
                } else {
                    false
                }
            }
            None => false,
        }
    }

    /// `key` is set: every connection waiting for it has one key fewer to wait for.
    pub(super) fn wake_all(&mut self, key: &[u8], woken: &mut Vec<u64>) {
        if let Some(conns) = self.waiters.remove(key) {
            for conn in conns {
                if self.arrived(conn) {
                    woken.push(conn);
                }
            }
        }
    }

    /// An element was pushed to queue `key`: one waiting connection may take it.
    pub(super) fn wake_one(&mut self, key: &[u8], woken: &mut Vec<u64>) {
        let Some(list) = self.waiters.get_mut(key) else { return };
        if list.is_empty() {
            return;
        }
        let conn = list.remove(0);
        if list.is_empty() {
            self.waiters.remove(key);
        }
        if self.arrived(conn) {
            woken.push(conn);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_grows_in_place_by_doubling() {
        let mut st = State::default();
        let mut moves = 0;
        let mut last = std::ptr::null();
        for i in 0..10_000u32 {
            st.append(b"k", &i.to_le_bytes());
            let v = &st.data[&b"k"[..]];
            if v.as_ptr() != last {
                moves += 1;
                last = v.as_ptr();
            }
        }
        let v = &st.data[&b"k"[..]];
        assert_eq!(v.len(), 40_000);
        assert_eq!(&v[4 * 9_999..], &9_999u32.to_le_bytes());
        // Copying the value on every append moved it 10 000 times.
        assert!(moves <= 20, "the value moved {moves} times");
        assert_eq!(st.bytes, 1 + v.capacity() + ENTRY_OVERHEAD);
        assert!(v.capacity() < 2 * v.len());
    }

    #[test]
    fn a_pop_leaves_no_empty_queue_and_the_budget_returns_to_zero() {
        let mut st = State::default();
        assert_eq!(st.pop(b"q"), (0, None));
        assert!(st.queues.is_empty(), "a pop of an absent queue created it");
        st.push(b"q", b"ab".to_vec());
        st.push(b"q", b"c".to_vec());
        assert_eq!(st.pop(b"q"), (2, Some(b"ab".to_vec())));
        assert_eq!(st.pop(b"q"), (1, Some(b"c".to_vec())));
        assert!(st.queues.is_empty());
        st.register_wait(7, vec![b"x".to_vec(), b"y".to_vec()]);
        st.put(b"x", b"1".to_vec());
        let mut woken = Vec::new();
        st.wake_all(b"x", &mut woken);
        st.wake_all(b"y", &mut woken);
        assert_eq!(woken, vec![7]);
        assert!(st.remove(b"x"));
        assert_eq!(st.bytes, 0);
    }
}
