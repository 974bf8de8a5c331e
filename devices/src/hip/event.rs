//! Events of the hip device, and the host-side polling every host wait uses.

use std::time::Duration;

use super::device::{defer_drop, next_id, HipDevice};
use super::sys::hipEvent_t;
use super::{result, Hip};
use crate::failure::LastRecord;
use crate::wait::Backoff;
use crate::{host_fn, DeviceError, Result};

/// Blocks the host until `event`'s recorded work has finished, polling
/// `hipEventQuery` with [`Backoff`], or returns `Timeout` after `timeout`.
///
/// # Safety
/// `event` is live.
pub(crate) unsafe fn poll_event(event: hipEvent_t, timeout: Duration, what: &str) -> Result<()> {
    let backoff = Backoff::new();
    loop {
        // SAFETY: per the caller's contract.
        if unsafe { result::event_query(event) }? {
            return Ok(());
        }
        if backoff.expired(timeout) {
            return Err(DeviceError::Timeout { what: what.to_string(), waited: timeout });
        }
        backoff.pause();
    }
}

/// An event of a hip device (`hipEvent_t`, timing disabled).
#[derive(Debug)]
pub struct HipEvent {
    raw: usize,
    id: u64,
    pub(crate) device: HipDevice,
    /// The stream of the most recent record, and its position there.
    pub(crate) recorded: LastRecord,
}

impl HipEvent {
    pub(crate) fn create(device: &HipDevice) -> Result<HipEvent> {
        device.bind()?;
        let raw = result::event_create()? as usize;
        Ok(HipEvent { raw, id: next_id(), device: device.clone(), recorded: LastRecord::default() })
    }

    /// The `hipEvent_t`.
    pub fn raw(&self) -> hipEvent_t {
        self.raw as hipEvent_t
    }

    /// A process-unique id of this event.
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl crate::Event for HipEvent {
    type B = Hip;

    fn synchronize(&self) -> Result<()> {
        host_fn::check("event synchronize")?;
        let Some((state, position)) = self.recorded.get() else {
            return Ok(());
        };
        self.device.bind()?;
        // SAFETY: the event is live while `self` is.
        unsafe { poll_event(self.raw(), self.device.config().timeout, &format!("hip event #{}", self.id)) }?;
        match state.failure_at(position) {
            Some(e) => Err(e),
            None => {
                state.mark_synced(position);
                Ok(())
            }
        }
    }

    fn query(&self) -> Result<bool> {
        host_fn::check("event query")?;
        let Some((state, position)) = self.recorded.get() else {
            return Ok(true);
        };
        if let Some(e) = state.failure_at(position) {
            return Err(e);
        }
        self.device.bind()?;
        // SAFETY: the event is live while `self` is.
        unsafe { result::event_query(self.raw()) }
    }
}

impl Drop for HipEvent {
    fn drop(&mut self) {
        let (inner, raw) = (&self.device.inner, self.raw);
        defer_drop(&inner.deferred, &inner.parked, inner.config.ordinal, "hipEventDestroy", move || {
            // SAFETY: destroyed once; HIP releases a pending event when its work completes.
            unsafe { result::event_destroy(raw as hipEvent_t) }
        });
    }
}
