//! [`Stream::update_on_host`](crate::Stream::update_on_host) on the GPU
//! devices, written once: the host ranges a host function hands to the
//! update, each holding its allocation alive until the function has run.

use std::sync::Arc;

use crate::{HostUpdate, Result};

/// One view's host bytes: its allocation (held; `None` for an empty view),
/// the address of its first byte and its length.
pub(crate) struct HeldRange<M> {
    _memory: Option<Arc<M>>,
    at: usize,
    bytes: usize,
}

impl<M> HeldRange<M> {
    /// The range of `bytes` at `at` in `memory` (which must hold it), or an empty range.
    pub(crate) fn new(memory: Option<&Arc<M>>, at: usize, bytes: usize) -> Self {
        match memory {
            Some(m) if bytes > 0 => HeldRange { _memory: Some(m.clone()), at, bytes },
            _ => HeldRange { _memory: None, at: 0, bytes: 0 },
        }
    }
}

/// Calls `f` with the bytes of `reads` and of `writes`.
///
/// # Safety
/// Every range lies in its allocation, every write to it enqueued before has
/// finished and none enqueued after has started (stream order), and no
/// written range overlaps another range.
pub(crate) unsafe fn run<M>(reads: &[HeldRange<M>], writes: &[HeldRange<M>], f: HostUpdate) -> Result<()> {
    let read: Vec<&[u8]> = reads
        .iter()
        .map(|r| match r.bytes {
            0 => &[][..],
            // SAFETY: the caller's contract.
            n => unsafe { std::slice::from_raw_parts(r.at as *const u8, n) },
        })
        .collect();
    let mut written: Vec<&mut [u8]> = writes
        .iter()
        .map(|w| match w.bytes {
            0 => &mut [][..],
            // SAFETY: the caller's contract; no other slice covers these bytes.
            n => unsafe { std::slice::from_raw_parts_mut(w.at as *mut u8, n) },
        })
        .collect();
    f(&read, &mut written)
}
