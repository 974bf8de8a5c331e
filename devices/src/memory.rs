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
/// enqueued work on it, with the position of that stream's last use where
/// it is known (so a free can skip a wait the home stream already made).
#[cfg(any(feature = "cuda", feature = "rocm"))]
#[derive(Debug)]
pub(crate) struct StreamUsers<S> {
    home: Arc<S>,
    /// The other streams and their last use's position ([`UNKNOWN_USE`] until known).
    others: Mutex<Vec<(Arc<S>, u64)>>,
}

/// A use whose position is not known (yet): the free always waits for it.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) const UNKNOWN_USE: u64 = u64::MAX;

#[cfg(any(feature = "cuda", feature = "rocm"))]
impl<S> StreamUsers<S> {
    /// A buffer allocated on `home`, used by no other stream yet.
    pub(crate) fn new(home: &Arc<S>) -> Self {
        StreamUsers { home: home.clone(), others: Default::default() }
    }

    /// Notes that `stream` enqueues work on the buffer, at a position not known yet.
    pub(crate) fn note(&self, stream: &Arc<S>) {
        self.note_at(stream, UNKNOWN_USE)
    }

    /// Notes that `stream` enqueued work on the buffer at `position`
    /// ([`UNKNOWN_USE`]: not known, as [`StreamUsers::note`]). A known
    /// position replaces an unknown one (the work noted as unknown was
    /// enqueued before it on the same stream) and a later one an earlier.
    pub(crate) fn note_at(&self, stream: &Arc<S>, position: u64) {
        if Arc::ptr_eq(stream, &self.home) {
            return;
        }
        if let Ok(mut others) = self.others.lock() {
            match others.iter_mut().find(|(u, _)| Arc::ptr_eq(u, stream)) {
                Some((_, last)) if position == UNKNOWN_USE || *last == UNKNOWN_USE => *last = position,
                Some((_, last)) => *last = (*last).max(position),
                None => others.push((stream.clone(), position)),
            }
        }
    }

    /// The home stream and the others, for the free (the buffer's drop).
    pub(crate) fn take(&self) -> (Arc<S>, Vec<Arc<S>>) {
        let (home, others) = self.take_with_positions();
        (home, others.into_iter().map(|(s, _)| s).collect())
    }

    /// The home stream and the others with their last uses' positions.
    pub(crate) fn take_with_positions(&self) -> (Arc<S>, Vec<(Arc<S>, u64)>) {
        let others = self.others.lock().map(|mut o| std::mem::take(&mut *o)).unwrap_or_default();
        (self.home.clone(), others)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(any(feature = "cuda", feature = "rocm"))]
    #[test]
    fn a_users_last_use_is_its_latest_known_position_and_unknown_wins_until_known() {
        let (home, a, b) = (Arc::new(0), Arc::new(1), Arc::new(2));
        let users = StreamUsers::new(&home);
        users.note(&home);
        users.note_at(&a, 5);
        users.note_at(&a, 3);
        users.note(&b);
        let (_, others) = users.take_with_positions();
        assert_eq!(others.iter().map(|(s, p)| (**s, *p)).collect::<Vec<_>>(), vec![(1, 5), (2, UNKNOWN_USE)]);
        users.note_at(&a, 7);
        users.note(&a);
        assert_eq!(users.take_with_positions().1[0].1, UNKNOWN_USE, "a use not yet placed keeps the free waiting");
        users.note(&a);
        users.note_at(&a, 9);
        assert_eq!(users.take_with_positions().1[0].1, 9);
    }

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
