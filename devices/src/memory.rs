//! Memory accounting shared by every device: bytes in use, their peak and
//! live allocations, as [`Device::memory_stats`](crate::Device::memory_stats)
//! reports them; and, for the GPU devices, the streams a buffer's
//! stream-ordered free must follow.

use std::sync::atomic::{AtomicUsize, Ordering};
#[cfg(any(feature = "cuda", feature = "rocm"))]
use std::sync::{Arc, Mutex};

use crate::MemoryStats;

/// Memory counters: bytes in use, their peak and live allocations, read as
/// [`MemoryStats`]. The owner decides when a buffer counts: it calls
/// [`MemCounters::add`] when the buffer is made and [`MemCounters::sub`]
/// when it is released in its terms (each device backend's `mod.rs` says
/// when that is; a UCX communicator counts its scratch buffers).
#[derive(Debug, Default)]
pub struct MemCounters {
    in_use: AtomicUsize,
    peak: AtomicUsize,
    live: AtomicUsize,
}

impl MemCounters {
    /// The counters now.
    pub fn stats(&self) -> MemoryStats {
        MemoryStats {
            bytes_in_use: self.in_use.load(Ordering::Acquire),
            peak_bytes: self.peak.load(Ordering::Acquire),
            live_allocations: self.live.load(Ordering::Acquire),
        }
    }
    /// Resets the peak to the bytes in use now.
    pub fn reset_peak(&self) {
        self.peak.store(self.in_use.load(Ordering::Acquire), Ordering::Release);
    }
    /// Counts a new allocation of `bytes`.
    pub fn add(&self, bytes: usize) {
        let now = self.in_use.fetch_add(bytes, Ordering::AcqRel) + bytes;
        self.peak.fetch_max(now, Ordering::AcqRel);
        self.live.fetch_add(1, Ordering::AcqRel);
    }
    /// Stops counting an allocation of `bytes`.
    pub fn sub(&self, bytes: usize) {
        self.in_use.fetch_sub(bytes, Ordering::AcqRel);
        self.live.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The streams a GPU buffer's stream-ordered free must follow: its home
/// stream (which allocated it, and frees it) and every other stream that
/// enqueued work on it.
#[cfg(any(feature = "cuda", feature = "rocm"))]
#[derive(Debug)]
pub(crate) struct StreamUsers<S> {
    home: Arc<S>,
    others: Mutex<Vec<Arc<S>>>,
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
impl<S> StreamUsers<S> {
    /// A buffer allocated on `home`, used by no other stream yet.
    pub(crate) fn new(home: &Arc<S>) -> Self {
        StreamUsers { home: home.clone(), others: Default::default() }
    }

    /// Notes that `stream` enqueued work on the buffer, so the free waits for it.
    pub(crate) fn note(&self, stream: &Arc<S>) {
        if Arc::ptr_eq(stream, &self.home) {
            return;
        }
        if let Ok(mut others) = self.others.lock() {
            if !others.iter().any(|u| Arc::ptr_eq(u, stream)) {
                others.push(stream.clone());
            }
        }
    }

    /// The home stream and the others, for the free (the buffer's drop).
    pub(crate) fn take(&self) -> (Arc<S>, Vec<Arc<S>>) {
        let others = self.others.lock().map(|mut o| std::mem::take(&mut *o)).unwrap_or_default();
        (self.home.clone(), others)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_follows_the_most_in_use_until_reset() {
        let c = MemCounters::default();
        c.add(100);
        c.add(50);
        c.sub(100);
        assert_eq!(c.stats(), MemoryStats { bytes_in_use: 50, peak_bytes: 150, live_allocations: 1 });
        c.reset_peak();
        assert_eq!(c.stats().peak_bytes, 50);
        c.sub(50);
        assert_eq!(c.stats(), MemoryStats { bytes_in_use: 0, peak_bytes: 50, live_allocations: 0 });
    }
}
