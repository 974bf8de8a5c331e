//! Events: CUDA events (timing disabled), plus the host-side failure state
//! of the stream they were recorded on (a collective failed by its watchdog
//! is a failure CUDA cannot see).

use cudarc::driver::result as drv;
use cudarc::driver::sys::{CUevent, CUevent_flags};

use super::device::{defer, next_id, CudaDevice};
use super::result::DriverResult;
use super::Cuda;
use crate::failure::LastRecord;
use crate::{host_fn, wait, Result};

/// An event of a cuda device.
#[derive(Debug)]
pub struct CudaEvent {
    pub(crate) raw: CUevent,
    pub(crate) id: u64,
    pub(crate) device: CudaDevice,
    /// The stream of the most recent record and its position there.
    pub(crate) recorded: LastRecord,
}

// SAFETY: a driver handle usable from any thread once the context is bound.
unsafe impl Send for CudaEvent {}
unsafe impl Sync for CudaEvent {}

impl CudaEvent {
    pub(crate) fn create(device: &CudaDevice) -> Result<CudaEvent> {
        device.bind()?;
        let raw = drv::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING).drv("cuEventCreate", device.label())?;
        Ok(CudaEvent { raw, id: next_id(), device: device.clone(), recorded: LastRecord::default() })
    }

    /// A process-unique id of this event.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The driver handle (for vendor libraries).
    pub fn raw(&self) -> CUevent {
        self.raw
    }
}

impl crate::Event for CudaEvent {
    type B = Cuda;

    fn synchronize(&self) -> Result<()> {
        host_fn::check("event synchronize")?;
        let what = format!("event #{} on {}", self.id, self.device.label());
        wait::poll_until(self.device.config().timeout, &what, || crate::Event::query(self))
    }

    fn query(&self) -> Result<bool> {
        host_fn::check("event query")?;
        self.device.bind()?;
        let record = self.recorded.get();
        if let Some((state, pos)) = &record {
            if let Some(e) = state.failure_at(*pos) {
                return Err(e);
            }
        }
        // SAFETY: a live event.
        match unsafe { drv::event::query(self.raw) } {
            Ok(()) => {
                if let Some((state, pos)) = record {
                    // A watchdog may have failed the work just before it completed.
                    if let Some(e) = state.failure_at(pos) {
                        return Err(e);
                    }
                    state.mark_synced(pos);
                }
                Ok(true)
            }
            Err(e) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(super::result::driver("cuEventQuery", e, self.device.label(), 0)),
        }
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        let raw = self.raw as usize;
        defer(&self.device.inner, "cuEventDestroy", move |inner| {
            super::device::bind_ctx(inner)?;
            // SAFETY: destroyed once; CUDA releases a pending event after it completes.
            unsafe { drv::event::destroy(raw as CUevent) }.drv("cuEventDestroy", &inner.label)
        });
    }
}
