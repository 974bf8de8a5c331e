//! Events: CUDA events (timing disabled), plus what the host needs to report
//! a failure that CUDA cannot see (a collective aborted by its watchdog).

use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::result as drv;
use cudarc::driver::sys::{CUevent, CUevent_flags};

use super::device::{next_id, CudaDevice};
use super::result::DriverResult;
use super::stream::{StreamShared, Target};
use super::Cuda;
use crate::Result;

/// An event of a cuda device.
#[derive(Debug)]
pub struct CudaEvent {
    pub(crate) raw: CUevent,
    pub(crate) id: u64,
    pub(crate) device: CudaDevice,
    /// The stream of the most recent record and its position there.
    pub(crate) recorded: Mutex<Option<(Weak<StreamShared>, u64)>>,
}

// SAFETY: a driver handle usable from any thread once the context is bound.
unsafe impl Send for CudaEvent {}
unsafe impl Sync for CudaEvent {}

impl CudaEvent {
    pub(crate) fn create(device: &CudaDevice) -> Result<CudaEvent> {
        device.bind()?;
        let raw = drv::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING).drv("cuEventCreate", &device.label())?;
        Ok(CudaEvent { raw, id: next_id(), device: device.clone(), recorded: Mutex::new(None) })
    }

    /// A process-unique id of this event.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The driver handle (for vendor libraries).
    pub fn raw(&self) -> CUevent {
        self.raw
    }

    pub(crate) fn last_record(&self) -> Option<(Arc<StreamShared>, u64)> {
        let r = self.recorded.lock().ok()?;
        let (w, pos) = r.as_ref()?;
        Some((w.upgrade()?, *pos))
    }
}

impl crate::Event for CudaEvent {
    type B = Cuda;

    fn synchronize(&self) -> Result<()> {
        match self.last_record() {
            Some((stream, pos)) => stream.host_wait(&self.device, Some(Target::Event(self.raw, pos))),
            // Never recorded, or its stream is gone: CUDA answers for the event alone.
            None => {
                self.device.bind()?;
                let what = format!("event #{}", self.id);
                super::stream::poll_until(self.device.config().timeout, &what, || crate::Event::query(self))
            }
        }
    }

    fn query(&self) -> Result<bool> {
        self.device.bind()?;
        if let Some((stream, pos)) = self.last_record() {
            stream.poll_monitors();
            if let Some(e) = stream.failure_at(pos) {
                return Err(e);
            }
        }
        // SAFETY: a live event.
        match unsafe { drv::event::query(self.raw) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(super::result::driver("cuEventQuery", e, &self.device.label(), 0)),
        }
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        let destroyed = self
            .device
            .bind()
            // SAFETY: destroyed once; CUDA releases a pending event after it completes.
            .and_then(|_| unsafe { drv::event::destroy(self.raw) }.drv("cuEventDestroy", &self.device.label()));
        if let Err(e) = destroyed {
            self.device.park(e);
        }
    }
}
