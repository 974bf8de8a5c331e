//! The cpu device's caching allocator: freed blocks go to free lists by size
//! class and are handed out again, as the CUDA caching allocator (and the
//! stream-ordered pool the cuda device uses) does on a GPU. FSDP allocates
//! its all-gather, unsharded, gradient and reduce-scatter buffers afresh
//! every step; without a cache each of those is a fresh `alloc_zeroed`
//! whose pages fault in on first touch, the largest part of FSDP's host time
//! on this device (`docs/benchmarks.md`).
//!
//! A block returns here only when the last handle to its memory is gone —
//! the buffer and every queued job that used it — so a reused block is never
//! in use by earlier work. Every block was zeroed when it was first
//! allocated, so a reused one holds initialized (stale) bytes, never
//! uninitialized memory.

use std::alloc::{self, Layout};
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::Mutex;

use crate::DeviceError;

/// Alignment of every allocation: a cache line, enough for any dtype and SIMD loads.
pub(crate) const ALIGN: usize = 64;

/// Size classes up to this are multiples of [`SMALL_STEP`]; larger ones are
/// 32 steps per power of two (less than 1/16 of a request rounded on).
const SMALL_LIMIT: usize = 1 << 20;
const SMALL_STEP: usize = 512;

/// The size class (the bytes actually allocated) of a request of `bytes` > 0.
pub(crate) fn size_class(bytes: usize) -> Option<usize> {
    let step = if bytes <= SMALL_LIMIT { SMALL_STEP } else { bytes.checked_next_power_of_two()? / 32 };
    bytes.checked_next_multiple_of(step)
}

/// What the cache holds and has handed out, in bytes of whole blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Bytes taken from the system and not returned: live blocks and cached
    /// ones (PyTorch's `memory_reserved`).
    pub reserved_bytes: usize,
    /// The most bytes reserved at once.
    pub peak_reserved_bytes: usize,
    /// Bytes of free blocks kept for reuse.
    pub cached_bytes: usize,
    /// Allocations served from the cache.
    pub hits: u64,
    /// Allocations that took a new block from the system.
    pub misses: u64,
}

#[derive(Debug, Default)]
struct State {
    free: HashMap<usize, Vec<Block>>,
    stats: CacheStats,
}

/// A free block's address; its size is its free list's class.
#[derive(Debug)]
struct Block(NonNull<u8>);

// SAFETY: a free block is plain memory that nothing else references.
unsafe impl Send for Block {}

/// One memory space's cache.
#[derive(Debug)]
pub(crate) struct Pool {
    state: Mutex<State>,
    /// Cached bytes kept at most; a block freed beyond it goes back to the system.
    limit: usize,
}

impl Pool {
    pub(crate) fn new(limit: usize) -> Pool {
        Pool { state: Mutex::new(State::default()), limit }
    }

    /// A block of size class `class` (from [`size_class`]): a cached one if
    /// there is one, else a new zeroed one. Returns the address and whether
    /// the block was reused (its bytes are then stale, not zero).
    pub(crate) fn take(&self, class: usize, device: &str) -> Result<(NonNull<u8>, bool), DeviceError> {
        let oom = || DeviceError::OutOfMemory { device: device.to_string(), bytes: class };
        if let Ok(mut s) = self.state.lock() {
            if let Some(b) = s.free.get_mut(&class).and_then(Vec::pop) {
                s.stats.cached_bytes -= class;
                s.stats.hits += 1;
                return Ok((b.0, true));
            }
        }
        let layout = Layout::from_size_align(class, ALIGN).ok().filter(|l| l.size() > 0).ok_or_else(oom)?;
        // SAFETY: the layout has a non-zero size (checked above).
        let fresh = NonNull::new(unsafe { alloc::alloc_zeroed(layout) });
        let ptr = match fresh {
            Some(p) => p,
            None => {
                // What the cache holds may be what the system lacks: return it, then retry once.
                self.empty();
                // SAFETY: as above.
                NonNull::new(unsafe { alloc::alloc_zeroed(layout) }).ok_or_else(oom)?
            }
        };
        if let Ok(mut s) = self.state.lock() {
            s.stats.misses += 1;
            s.stats.reserved_bytes += class;
            s.stats.peak_reserved_bytes = s.stats.peak_reserved_bytes.max(s.stats.reserved_bytes);
        }
        Ok((ptr, false))
    }

    /// Takes back a block from [`Pool::take`] that nothing uses any more:
    /// cached, or returned to the system when the cache is full.
    ///
    /// # Safety
    /// `ptr` came from `take(class, ..)` of this pool and is not used after this call.
    pub(crate) unsafe fn put(&self, ptr: NonNull<u8>, class: usize) {
        if let Ok(mut s) = self.state.lock() {
            if s.stats.cached_bytes + class <= self.limit {
                s.stats.cached_bytes += class;
                s.free.entry(class).or_default().push(Block(ptr));
                return;
            }
            s.stats.reserved_bytes -= class;
        }
        // SAFETY: allocated in `take` with this layout; the caller gave up the block.
        unsafe { dealloc(ptr, class) };
    }

    /// Returns every cached block to the system (PyTorch's `empty_cache`).
    pub(crate) fn empty(&self) {
        let blocks: Vec<(usize, Vec<Block>)> = match self.state.lock() {
            Ok(mut s) => {
                let freed = s.stats.cached_bytes;
                s.stats.cached_bytes = 0;
                s.stats.reserved_bytes -= freed;
                s.free.drain().collect()
            }
            Err(_) => return,
        };
        for (class, list) in blocks {
            for b in list {
                // SAFETY: a cached block, allocated in `take` with this class, used by nothing.
                unsafe { dealloc(b.0, class) };
            }
        }
    }

    pub(crate) fn stats(&self) -> CacheStats {
        self.state.lock().map(|s| s.stats).unwrap_or_default()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.empty();
    }
}

/// # Safety
/// `ptr` was allocated with size `class` and [`ALIGN`] and is not used after this.
unsafe fn dealloc(ptr: NonNull<u8>, class: usize) {
    if let Ok(layout) = Layout::from_size_align(class, ALIGN) {
        // SAFETY: per the caller's contract.
        unsafe { alloc::dealloc(ptr.as_ptr(), layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_round_up_by_at_most_a_sixteenth_above_a_mebibyte() {
        assert_eq!(size_class(1), Some(512));
        assert_eq!(size_class(512), Some(512));
        assert_eq!(size_class(513), Some(1024));
        assert_eq!(size_class(1 << 20), Some(1 << 20));
        // Just above 1 MiB: steps of 2 MiB / 32 = 64 KiB.
        assert_eq!(size_class((1 << 20) + 1), Some((1 << 20) + (64 << 10)));
        for bytes in [(1usize << 20) + 7, 3 << 20, (5 << 20) + 12345, 1 << 30] {
            let c = size_class(bytes).unwrap();
            assert!(c >= bytes && (c - bytes) * 16 < bytes, "{bytes} -> {c}");
        }
        assert_eq!(size_class(usize::MAX), None);
    }

    #[test]
    fn a_freed_block_is_reused_and_the_limit_bounds_the_cache() {
        let pool = Pool::new(1024);
        let (a, reused) = pool.take(512, "test").unwrap();
        assert!(!reused);
        // SAFETY: from take, not used after.
        unsafe { pool.put(a, 512) };
        let (b, reused) = pool.take(512, "test").unwrap();
        assert!(reused);
        assert_eq!(a, b);
        let (c, _) = pool.take(1024, "test").unwrap();
        let s = pool.stats();
        assert_eq!((s.reserved_bytes, s.cached_bytes, s.hits, s.misses), (1536, 0, 1, 2));
        // SAFETY: as above.
        unsafe {
            pool.put(b, 512);
            pool.put(c, 1024); // over the 1024-byte limit with b cached: freed
        }
        let s = pool.stats();
        assert_eq!((s.reserved_bytes, s.cached_bytes, s.peak_reserved_bytes), (512, 512, 1536));
        pool.empty();
        assert_eq!((pool.stats().reserved_bytes, pool.stats().cached_bytes), (0, 0));
    }
}
