//! Events of the hip device, and the host-side polling every host wait uses.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::device::{next_id, park, HipDevice};
use super::stream::StreamState;
use super::sys::hipEvent_t;
use super::{result, Hip};
use crate::{DeviceError, Result};

/// Blocks the host until `event`'s recorded work has finished, polling
/// `hipEventQuery` (spinning briefly, then sleeping up to 1 ms between
/// queries), or returns `Timeout` after `timeout`.
///
/// # Safety
/// `event` is live.
pub(crate) unsafe fn poll_event(event: hipEvent_t, timeout: Duration, what: &str) -> Result<()> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(20);
    loop {
        // SAFETY: per the caller's contract.
        if unsafe { result::event_query(event) }? {
            return Ok(());
        }
        let waited = start.elapsed();
        if waited >= timeout {
            return Err(DeviceError::Timeout { what: what.to_string(), waited: timeout });
        }
        if waited < Duration::from_micros(100) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(pause.min(timeout - waited));
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

/// The error a wait on work recorded after a failure reports.
pub(crate) fn poisoned(e: &DeviceError) -> DeviceError {
    match e {
        DeviceError::Poisoned { .. } => e.clone(),
        other => DeviceError::Poisoned { cause: Box::new(other.clone()) },
    }
}

/// The most recent record: which stream's state, and how many operations it had enqueued.
#[derive(Debug, Clone)]
pub(crate) struct Recorded {
    pub(crate) state: Arc<StreamState>,
    pub(crate) position: u64,
}

impl Recorded {
    /// The stream's failure, if it happened at or before the record.
    pub(crate) fn failure(&self) -> Option<DeviceError> {
        self.state.failed_by(self.position)
    }
}

/// An event of a hip device (`hipEvent_t`, timing disabled).
#[derive(Debug)]
pub struct HipEvent {
    raw: usize,
    id: u64,
    pub(crate) device: HipDevice,
    recorded: Mutex<Option<Recorded>>,
}

impl HipEvent {
    pub(crate) fn create(device: &HipDevice) -> Result<HipEvent> {
        device.bind()?;
        let raw = result::event_create()? as usize;
        Ok(HipEvent { raw, id: next_id(), device: device.clone(), recorded: Mutex::new(None) })
    }

    /// The `hipEvent_t`.
    pub fn raw(&self) -> hipEvent_t {
        self.raw as hipEvent_t
    }

    /// A process-unique id of this event.
    pub fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn set_recorded(&self, r: Recorded) {
        if let Ok(mut cur) = self.recorded.lock() {
            *cur = Some(r);
        }
    }

    pub(crate) fn recorded(&self) -> Option<Recorded> {
        self.recorded.lock().ok().and_then(|r| r.clone())
    }
}

impl crate::Event for HipEvent {
    type B = Hip;

    fn synchronize(&self) -> Result<()> {
        let Some(rec) = self.recorded() else {
            return Ok(());
        };
        self.device.bind()?;
        // SAFETY: the event is live while `self` is.
        unsafe { poll_event(self.raw(), self.device.config().timeout, &format!("hip event #{}", self.id)) }?;
        match rec.failure() {
            Some(e) => Err(poisoned(&e)),
            None => Ok(()),
        }
    }

    fn query(&self) -> Result<bool> {
        let Some(rec) = self.recorded() else {
            return Ok(true);
        };
        if let Some(e) = rec.failure() {
            return Err(poisoned(&e));
        }
        self.device.bind()?;
        // SAFETY: the event is live while `self` is.
        unsafe { result::event_query(self.raw()) }
    }
}

impl Drop for HipEvent {
    fn drop(&mut self) {
        // SAFETY: destroyed once; HIP releases a pending event when its work completes.
        let r = self.device.bind().and_then(|_| unsafe { result::event_destroy(self.raw()) });
        if let Err(e) = r {
            park(&self.device.inner.parked, e);
        }
    }
}
