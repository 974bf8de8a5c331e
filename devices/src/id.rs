//! Ids of buffers, streams and events: one process-wide counter for every
//! backend, so an id names one object even where backends meet (a
//! communicator's reports, the sanitizer's records).

use std::sync::atomic::{AtomicU64, Ordering};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A process-unique id.
pub(crate) fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}
