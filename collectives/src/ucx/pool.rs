//! A communicator's scratch buffers (partial results, received slots,
//! hellos): reused from call to call, bounded, and counted.
//!
//! Every buffer the pool makes is counted from its allocation to its drop,
//! whether a call uses it, a transfer still holds it (a cancelled request
//! keeps its memory until UCX ends it), or it waits in the pool; that is
//! what [`UcxComm::scratch_memory`](super::UcxComm::scratch_memory) reports.
//! The pool keeps at most [`UcxConfig::scratch_pool_buffers`](super::UcxConfig)
//! buffers and [`UcxConfig::scratch_pool_bytes`](super::UcxConfig) bytes (the
//! largest that fit), and [`ScratchPool::release`] empties it.
//!
//! A new buffer is rounded up to its size class ([`class_of`]): eight
//! classes per doubling, so it is at most 1/8 larger than asked (at least
//! [`MIN_BYTES`]), and calls of nearly the same size share buffers.

use std::sync::{Arc, Mutex};

use chorus_devices::{MemCounters, MemoryStats};

use super::region::Scratch;

/// The free scratch buffers of one communicator, and the count of all it made.
pub(crate) struct ScratchPool {
    free: Mutex<Vec<Arc<Scratch>>>,
    max_buffers: usize,
    max_bytes: usize,
    counters: Arc<MemCounters>,
}

/// The smallest buffer made (so that small calls of different sizes share one).
const MIN_BYTES: usize = 4096;

/// Size classes per doubling: a buffer is at most `1/CLASSES_PER_DOUBLING`
/// larger than asked.
const CLASSES_PER_DOUBLING: usize = 8;

/// The size of the buffer made for `bytes`: [`MIN_BYTES`] for small ones,
/// else `bytes` rounded up to a multiple of `2^k / CLASSES_PER_DOUBLING`,
/// where `2^k <= bytes < 2^(k+1)` (less than `bytes / 8` more).
pub(crate) fn class_of(bytes: usize) -> usize {
    if bytes <= MIN_BYTES {
        return MIN_BYTES;
    }
    let power = 1usize << (usize::BITS - 1 - bytes.leading_zeros());
    let step = power / CLASSES_PER_DOUBLING;
    bytes.div_ceil(step).checked_mul(step).unwrap_or(bytes)
}

impl ScratchPool {
    pub(crate) fn new(max_buffers: usize, max_bytes: usize) -> ScratchPool {
        ScratchPool { free: Mutex::new(Vec::new()), max_buffers, max_bytes, counters: Arc::default() }
    }

    /// A buffer of at least `bytes`: the smallest free one that fits, or a new one.
    pub(crate) fn take(&self, bytes: usize) -> Arc<Scratch> {
        if let Ok(mut free) = self.free.lock() {
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, s)| s.bytes() >= bytes && Arc::strong_count(s) == 1)
                .min_by_key(|(_, s)| s.bytes())
                .map(|(i, _)| i);
            if let Some(i) = best {
                return free.swap_remove(i);
            }
        }
        Scratch::counted(class_of(bytes), self.counters.clone())
    }

    /// Keeps `s` for a later call when no transfer holds it and it fits the
    /// bounds (the largest buffers are kept); otherwise it is freed (when
    /// its last holder lets it go).
    pub(crate) fn give_back(&self, s: Arc<Scratch>) {
        if Arc::strong_count(&s) != 1 {
            return;
        }
        let Ok(mut free) = self.free.lock() else { return };
        free.push(s);
        free.sort_by_key(|s| std::cmp::Reverse(s.bytes()));
        let (mut kept, mut bytes) = (0, 0);
        free.retain(|s| {
            let keep = kept < self.max_buffers && bytes + s.bytes() <= self.max_bytes;
            if keep {
                kept += 1;
                bytes += s.bytes();
            }
            keep
        });
    }

    /// Frees every buffer in the pool; the bytes freed.
    pub(crate) fn release(&self) -> usize {
        let Ok(mut free) = self.free.lock() else { return 0 };
        free.drain(..).map(|s| s.bytes()).sum()
    }

    /// Every scratch buffer this pool made and that is still alive (in a
    /// call, held by a transfer, or free in the pool).
    pub(crate) fn stats(&self) -> MemoryStats {
        self.counters.stats()
    }

    /// Bytes free in the pool.
    #[cfg(test)]
    pub(crate) fn pooled_bytes(&self) -> usize {
        self.free.lock().map(|f| f.iter().map(|s| s.bytes()).sum()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: usize = 1024;

    #[test]
    fn the_pool_is_bounded_in_buffers_and_bytes_and_keeps_the_largest() {
        let pool = ScratchPool::new(3, 100 * KIB);
        let sizes = [4 * KIB, 8 * KIB, 16 * KIB, 32 * KIB, 64 * KIB, 128 * KIB];
        let taken: Vec<_> = sizes.iter().map(|b| pool.take(*b)).collect();
        let made: usize = sizes.iter().sum();
        assert_eq!(pool.stats().bytes_in_use, made);
        assert_eq!(pool.stats().live_allocations, 6);
        // Largest first: each give-back sees the ones kept so far.
        for s in taken.into_iter().rev() {
            pool.give_back(s);
        }
        // 128 KiB exceeds the byte bound alone; then 64 + 32 (96 KiB) and,
        // within 100 KiB, the 4 KiB one: 3 buffers, 100 KiB.
        assert_eq!(pool.pooled_bytes(), 100 * KIB);
        assert_eq!(pool.stats().bytes_in_use, 100 * KIB, "the dropped buffers are no longer counted");
        assert_eq!(pool.stats().live_allocations, 3);
        assert_eq!(pool.stats().peak_bytes, made);
    }

    /// The rounding wastes less than an eighth of a large buffer (a power
    /// of two wasted up to all of it: 64 MiB + 1 byte took 128 MiB).
    #[test]
    fn a_new_buffer_is_at_most_an_eighth_larger_than_asked() {
        const MIB: usize = 1024 * KIB;
        assert_eq!(class_of(1), MIN_BYTES);
        assert_eq!(class_of(MIN_BYTES), MIN_BYTES);
        assert_eq!(class_of(64 * MIB), 64 * MIB);
        assert_eq!(class_of(64 * MIB + 1), 72 * MIB);
        assert_eq!(class_of(usize::MAX), usize::MAX);
        let mut sizes: Vec<usize> = (0..usize::BITS - 1).flat_map(|k| [(1 << k) - 1, 1 << k, (1 << k) + 1]).collect();
        sizes.extend((1..2000).map(|i| i * 7919 + i * i * 31));
        for b in sizes {
            let c = class_of(b);
            assert!(c >= b, "{b} -> {c}");
            assert!(c <= MIN_BYTES.max(b + b / CLASSES_PER_DOUBLING), "{b} -> {c}: over 1/8 more");
            assert_eq!(class_of(c), c, "a class is its own class");
        }
        // What the pool allocates, and counts, is the class.
        let pool = ScratchPool::new(6, usize::MAX);
        let asked = [5 * KIB + 1, 100 * KIB, 300 * KIB + 3, 1025 * KIB];
        let made: Vec<_> = asked.iter().map(|b| pool.take(*b)).collect();
        let total: usize = made.iter().map(|s| s.bytes()).sum();
        assert_eq!(total, asked.iter().map(|b| class_of(*b)).sum::<usize>());
        assert_eq!(pool.stats().bytes_in_use, total);
        assert!(total * 8 <= asked.iter().sum::<usize>() * 9, "{total} bytes for {asked:?}");
    }

    #[test]
    fn a_buffer_is_reused_best_fit_and_one_a_transfer_holds_is_not_pooled() {
        let pool = ScratchPool::new(6, usize::MAX);
        let (small, large) = (pool.take(4 * KIB), pool.take(64 * KIB));
        let (small_ptr, large_ptr) = (small.ptr(), large.ptr());
        pool.give_back(large);
        pool.give_back(small);
        let again = pool.take(100);
        assert_eq!(again.ptr(), small_ptr, "a small request takes the small buffer, not the large one");
        let big = pool.take(40 * KIB);
        assert_eq!(big.ptr(), large_ptr);
        // A transfer still holds it: not pooled, counted until the holder drops it.
        let transfer = big.clone();
        pool.give_back(big);
        assert_eq!(pool.pooled_bytes(), 0);
        assert_eq!(pool.stats().bytes_in_use, 68 * KIB);
        drop(transfer);
        assert_eq!(pool.stats().bytes_in_use, 4 * KIB);
        pool.give_back(again);
        assert_eq!(pool.release(), 4 * KIB);
        assert_eq!(pool.stats().bytes_in_use, 0);
        assert_eq!(pool.stats().live_allocations, 0);
    }
}
