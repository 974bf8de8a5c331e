//! The cuda device as a target of vendor work (NCCL), through [`ForeignBackend`].

use std::ffi::c_void;

use super::stream::device_ptr;
use super::{Cuda, CudaDevice, CudaStream};
use crate::{AccessKind, DeviceError, FailureHandle, ForeignBackend, Result, View};

impl ForeignBackend for Cuda {
    fn bind(device: &CudaDevice) -> Result<()> {
        device.bind()
    }

    fn park(device: &CudaDevice, error: DeviceError) {
        device.park(error)
    }

    fn address(view: &View<'_, Cuda>) -> u64 {
        device_ptr(view)
    }

    fn enqueue_foreign(
        stream: &CudaStream,
        op: &'static str,
        accesses: &[(View<'_, Cuda>, AccessKind)],
        issue: &mut dyn FnMut(*mut c_void) -> Result<()>,
    ) -> Result<Option<u64>> {
        let views: Vec<View<'_, Cuda>> = accesses.iter().map(|(v, _)| *v).collect();
        stream.enqueue_op(op, &views, |raw| issue(raw as *mut c_void))
    }

    fn failure_handle(stream: &CudaStream) -> FailureHandle {
        stream.shared.state.failure_handle()
    }
}
