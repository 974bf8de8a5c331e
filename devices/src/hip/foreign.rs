//! The hip device as a target of vendor work (RCCL), through [`ForeignBackend`].

use std::ffi::c_void;

use super::{Hip, HipDevice, HipStream};
use crate::{AccessKind, DeviceError, FailureHandle, ForeignBackend, Result, View};

impl ForeignBackend for Hip {
    fn bind(device: &HipDevice) -> Result<()> {
        device.bind()
    }

    fn park(device: &HipDevice, error: DeviceError) {
        device.park_error(error)
    }

    fn address(view: &View<'_, Hip>) -> u64 {
        view.buffer().device_ptr() + (view.offset() * view.dtype().size()) as u64
    }

    fn enqueue_foreign(
        stream: &HipStream,
        op: &'static str,
        accesses: &[(View<'_, Hip>, AccessKind)],
        issue: &mut dyn FnMut(*mut c_void) -> Result<()>,
    ) -> Result<Option<u64>> {
        // Checks the device and notes the use, so the buffers' frees wait for this work.
        for (v, _) in accesses {
            stream.device_ptr(op, *v)?;
        }
        stream.enqueue_at(issue)
    }

    fn failure_handle(stream: &HipStream) -> FailureHandle {
        stream.failure_handle()
    }
}
