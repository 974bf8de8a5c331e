//! Counting a device's calls by name, for benchmarks and tests of the host
//! path ([`Device::count_calls`](crate::Device::count_calls)): how many
//! operations FSDP enqueues per group and step, how many driver calls a
//! batched copy makes.
//!
//! Off by default; while off a call costs one relaxed atomic load. While on,
//! each call takes a short lock, so counts are exact across threads.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Calls by name, in the order each name was first seen.
#[derive(Debug, Default)]
pub(crate) struct CallCounter {
    on: AtomicBool,
    counts: Mutex<Vec<(&'static str, u64)>>,
}

impl CallCounter {
    /// A counter that is off (usable in a `static`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) const fn new() -> CallCounter {
        CallCounter { on: AtomicBool::new(false), counts: Mutex::new(Vec::new()) }
    }

    /// Starts counting from zero (`true`) or stops (`false`, the counts stay readable).
    pub(crate) fn set(&self, on: bool) {
        if on {
            if let Ok(mut c) = self.counts.lock() {
                c.clear();
            }
        }
        self.on.store(on, Ordering::Release);
    }

    /// Counts one call of `name` if counting is on.
    pub(crate) fn note(&self, name: &'static str) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        if let Ok(mut c) = self.counts.lock() {
            match c.iter_mut().find(|(n, _)| *n == name) {
                Some((_, k)) => *k += 1,
                None => c.push((name, 1)),
            }
        }
    }

    /// The counts so far.
    pub(crate) fn snapshot(&self) -> Vec<(&'static str, u64)> {
        self.counts.lock().map(|c| c.clone()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_only_while_on_and_restarts_from_zero() {
        let c = CallCounter::default();
        c.note("a");
        assert!(c.snapshot().is_empty(), "counted while off");
        c.set(true);
        c.note("a");
        c.note("b");
        c.note("a");
        assert_eq!(c.snapshot(), vec![("a", 2), ("b", 1)]);
        c.set(false);
        c.note("a");
        assert_eq!(c.snapshot(), vec![("a", 2), ("b", 1)], "counted after stopping");
        c.set(true);
        assert!(c.snapshot().is_empty(), "a restart keeps old counts");
    }
}
