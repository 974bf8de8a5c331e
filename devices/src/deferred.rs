//! Driver work of drops that ran inside host functions, done later on a
//! thread that may call the driver; written once for the GPU devices.
//!
//! A handle dropped inside a host function (a buffer captured by a host job,
//! say) cannot call the driver there (see [`crate::host_fn`]). Its driver
//! work is queued on its device instead and done at the device's next entry
//! point from an ordinary thread (every one binds the device first), or when
//! the device itself is dropped. Errors go to the device's parked errors.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::{host_fn, DeviceError, Result};

/// The driver work of one drop.
type Work<C> = Box<dyn FnOnce(&C) -> Result<()> + Send>;

struct Item<C> {
    what: &'static str,
    work: Work<C>,
}

/// Postponed driver work of one device; `C` is what the work needs (the device).
pub(crate) struct Deferred<C> {
    items: Mutex<Vec<Item<C>>>,
    pending: AtomicBool,
}

impl<C> Default for Deferred<C> {
    fn default() -> Self {
        Deferred { items: Mutex::new(Vec::new()), pending: AtomicBool::new(false) }
    }
}

impl<C> fmt::Debug for Deferred<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Deferred(pending: {})", self.pending.load(Ordering::Relaxed))
    }
}

impl<C> Deferred<C> {
    /// Does `work` now, or — inside a host function — queues it. Its error,
    /// now or later, goes to `park`.
    pub(crate) fn run_or_defer(
        &self,
        ctx: &C,
        what: &'static str,
        work: impl FnOnce(&C) -> Result<()> + Send + 'static,
        park: impl Fn(DeviceError),
    ) {
        if host_fn::in_host_fn() {
            if let Ok(mut items) = self.items.lock() {
                items.push(Item { what, work: Box::new(work) });
                self.pending.store(true, Ordering::Release);
            }
            return;
        }
        if let Err(e) = work(ctx) {
            park(e);
        }
    }

    /// Does the queued work (cheap when there is none). Call outside host
    /// functions, with the device bound.
    pub(crate) fn drain(&self, ctx: &C, park: impl Fn(DeviceError)) {
        if !self.pending.load(Ordering::Acquire) {
            return;
        }
        let items = match self.items.lock() {
            Ok(mut items) => {
                self.pending.store(false, Ordering::Release);
                std::mem::take(&mut *items)
            }
            Err(_) => return,
        };
        for Item { what, work } in items {
            if let Err(e) = work(ctx) {
                park(DeviceError::Backend {
                    library: "deferred",
                    code: 0,
                    message: format!("{what}, postponed out of a host function: {e}"),
                });
            }
        }
    }
}
