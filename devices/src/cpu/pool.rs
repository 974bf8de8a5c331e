//! The cpu device's caching allocator: freed blocks go to free lists by size
//! class and are handed out again, as the CUDA caching allocator (and the
//! stream-ordered pool the cuda device uses) does on a GPU. FSDP allocates
//! its all-gather, unsharded, gradient and reduce-scatter buffers afresh
//! every step; without a cache each of those is a fresh `alloc_zeroed`
//! whose pages fault in on first touch, the largest part of FSDP's host time
//! on this device (`docs/benchmarks.md`).
//!
//! What the cache keeps is bounded twice: by the configured limit, and by
//! the most bytes ever in use at once. A request the cache cannot serve
//! first returns cached blocks to the system until the new block keeps the
//! reserved bytes within that peak, so a rank's memory never exceeds the
//! peak its own buffers reached (rounded to size classes) — the number a
//! user reads as its memory — however the sizes it asks for move. A cached
//! block up to a quarter larger than the request serves it, so buffers of
//! nearby sizes share blocks instead of evicting each other every step.
//!
//! A block returns here only when the last handle to its memory is gone —
//! the buffer and every queued job that used it — so a reused block is never
//! in use by earlier work. Every block was zeroed when it was first
//! allocated, so a reused one holds initialized (stale) bytes, never
//! uninitialized memory.

use std::alloc::{self, Layout};
use std::collections::BTreeMap;
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
    /// The most bytes reserved at once; never more than
    /// [`CacheStats::peak_in_use_bytes`].
    pub peak_reserved_bytes: usize,
    /// The most bytes of blocks handed out and not yet returned at once.
    pub peak_in_use_bytes: usize,
    /// Bytes of free blocks kept for reuse.
    pub cached_bytes: usize,
    /// Allocations served from the cache.
    pub hits: u64,
    /// Allocations that took a new block from the system.
    pub misses: u64,
    /// Cached blocks returned to the system to make room for a new block
    /// within the peak in use.
    pub evictions: u64,
}

impl CacheStats {
    fn in_use_bytes(&self) -> usize {
        self.reserved_bytes - self.cached_bytes
    }
}

#[derive(Debug, Default)]
struct State {
    /// Free blocks by size class.
    free: BTreeMap<usize, Vec<Block>>,
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

    /// A block for a request of size class `class` (from [`size_class`]):
    /// a cached one of that class or up to a quarter larger if there is one,
    /// else a new zeroed one of that class. Returns the address, the block's
    /// class (what [`Pool::put`] takes back) and whether the block was reused
    /// (its bytes are then stale, not zero).
    pub(crate) fn take(&self, class: usize, device: &str) -> Result<(NonNull<u8>, usize, bool), DeviceError> {
        let oom = || DeviceError::OutOfMemory { device: device.to_string(), bytes: class };
        let layout = Layout::from_size_align(class, ALIGN).ok().filter(|l| l.size() > 0).ok_or_else(oom)?;
        // The new block is counted as reserved before it exists, so that
        // concurrent misses each see the others' and the bound holds exactly.
        let evicted = match self.state.lock() {
            Ok(mut s) => {
                if let Some((ptr, found)) = s.reuse(class) {
                    return Ok((ptr, found, true));
                }
                let evicted = s.evict_for(class);
                s.stats.misses += 1;
                s.stats.reserved_bytes += class;
                s.note_peaks();
                evicted
            }
            Err(_) => Vec::new(),
        };
        release(evicted);
        // SAFETY: the layout has a non-zero size (checked above).
        let fresh = NonNull::new(unsafe { alloc::alloc_zeroed(layout) });
        let ptr = match fresh {
            Some(p) => p,
            None => {
                // What the cache holds may be what the system lacks: return it, then retry once.
                self.empty();
                // SAFETY: as above.
                match NonNull::new(unsafe { alloc::alloc_zeroed(layout) }) {
                    Some(p) => p,
                    None => {
                        if let Ok(mut s) = self.state.lock() {
                            s.stats.reserved_bytes -= class;
                        }
                        return Err(oom());
                    }
                }
            }
        };
        Ok((ptr, class, false))
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
        let blocks = match self.state.lock() {
            Ok(mut s) => {
                let freed = s.stats.cached_bytes;
                s.stats.cached_bytes = 0;
                s.stats.reserved_bytes -= freed;
                std::mem::take(&mut s.free)
                    .into_iter()
                    .flat_map(|(class, list)| list.into_iter().map(move |b| (b, class)))
                    .collect()
            }
            Err(_) => return,
        };
        release(blocks);
    }

    pub(crate) fn stats(&self) -> CacheStats {
        self.state.lock().map(|s| s.stats).unwrap_or_default()
    }
}

impl State {
    /// The smallest cached block of class `class` up to a quarter larger, taken off its list.
    fn reuse(&mut self, class: usize) -> Option<(NonNull<u8>, usize)> {
        let (&found, list) = self.free.range_mut(class..=class + class / 4).find(|(_, l)| !l.is_empty())?;
        let block = list.pop()?;
        self.stats.cached_bytes -= found;
        self.stats.hits += 1;
        self.note_peaks();
        Some((block.0, found))
    }

    /// Takes cached blocks, largest first, off their lists until a new block
    /// of `class` keeps the reserved bytes within the peak in use (counting
    /// the new block as in use); the caller returns them to the system.
    fn evict_for(&mut self, class: usize) -> Vec<(Block, usize)> {
        let peak_after = self.stats.peak_in_use_bytes.max(self.stats.in_use_bytes() + class);
        let mut evicted = Vec::new();
        while self.stats.reserved_bytes + class > peak_after {
            let Some(mut entry) = self.free.last_entry() else { break };
            let found = *entry.key();
            match entry.get_mut().pop() {
                Some(b) => {
                    evicted.push((b, found));
                    self.stats.cached_bytes -= found;
                    self.stats.reserved_bytes -= found;
                    self.stats.evictions += 1;
                }
                None => {
                    entry.remove();
                }
            }
        }
        evicted
    }

    fn note_peaks(&mut self) {
        let s = &mut self.stats;
        s.peak_reserved_bytes = s.peak_reserved_bytes.max(s.reserved_bytes);
        s.peak_in_use_bytes = s.peak_in_use_bytes.max(s.in_use_bytes());
    }
}

/// Returns blocks taken off the free lists to the system.
fn release(blocks: Vec<(Block, usize)>) {
    for (b, class) in blocks {
        // SAFETY: a cached block, allocated in `take` with this class, used by nothing.
        unsafe { dealloc(b.0, class) };
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
        let (a, _, reused) = pool.take(512, "test").unwrap();
        assert!(!reused);
        // SAFETY: from take, not used after.
        unsafe { pool.put(a, 512) };
        let (b, _, reused) = pool.take(512, "test").unwrap();
        assert!(reused);
        assert_eq!(a, b);
        let (c, _, _) = pool.take(1024, "test").unwrap();
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

    #[test]
    fn a_block_up_to_a_quarter_larger_serves_a_request() {
        let pool = Pool::new(1 << 20);
        let (a, _, _) = pool.take(4096, "test").unwrap();
        // SAFETY: from take, not used after.
        unsafe { pool.put(a, 4096) };
        // 3584 · 5/4 = 4480 ≥ 4096: the cached block, which goes back as 4096.
        let (b, class, reused) = pool.take(3584, "test").unwrap();
        assert_eq!((b, class, reused), (a, 4096, true));
        // SAFETY: as above, with the class take returned.
        unsafe { pool.put(b, class) };
        // 3072 · 5/4 = 3840 < 4096: a new block, and the cached one is
        // returned to the system to keep the reserve within the peak in use.
        let (c, class, reused) = pool.take(3072, "test").unwrap();
        assert_eq!((class, reused), (3072, false));
        let s = pool.stats();
        assert_eq!((s.reserved_bytes, s.cached_bytes, s.evictions, s.peak_in_use_bytes), (3072, 0, 1, 4096));
        // SAFETY: as above.
        unsafe { pool.put(c, class) };
    }

    /// Random requests and returns, against the peak in use counted here
    /// from the classes handed out: the reserve never exceeds it, however
    /// the sizes move, while a repeated pattern is served from the cache.
    #[test]
    fn the_reserve_never_exceeds_the_peak_in_use() {
        let pool = Pool::new(usize::MAX);
        let mut held: Vec<(NonNull<u8>, usize)> = Vec::new();
        let (mut in_use, mut peak) = (0usize, 0usize);
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..4000 {
            if held.is_empty() || next() % 3 != 0 {
                let class = size_class(1 + (next() % (3 << 20)) as usize).unwrap();
                let (p, got, _) = pool.take(class, "test").unwrap();
                assert!(got >= class && got <= class + class / 4);
                held.push((p, got));
                in_use += got;
                peak = peak.max(in_use);
            } else {
                let (p, got) = held.swap_remove((next() % held.len() as u64) as usize);
                // SAFETY: from take with this class, not used after.
                unsafe { pool.put(p, got) };
                in_use -= got;
            }
            let s = pool.stats();
            assert_eq!((s.reserved_bytes - s.cached_bytes, s.peak_in_use_bytes), (in_use, peak));
            assert!(s.reserved_bytes <= peak && s.peak_reserved_bytes <= peak, "{s:?} against a peak of {peak}");
        }
        for (p, got) in held.drain(..) {
            // SAFETY: as above.
            unsafe { pool.put(p, got) };
        }
        // Steady state: one step's buffers, taken and returned twice, miss only the first time.
        pool.empty();
        let step = [3 << 20, 1 << 20, 5 << 20, 4096];
        for round in 0..2 {
            let blocks: Vec<_> = step.iter().map(|&b| pool.take(size_class(b).unwrap(), "test").unwrap()).collect();
            for (p, got, reused) in blocks {
                assert_eq!(reused, round == 1);
                // SAFETY: as above.
                unsafe { pool.put(p, got) };
            }
        }
    }
}
