//! The cpu device as a target of foreign work: what the simulated NCCL ABI
//! (and any library that enqueues its own jobs) uses, through
//! [`ForeignBackend`].

use std::ffi::c_void;
use std::sync::Arc;

use super::sanitizer::Access;
use super::{raw, Cpu, CpuDevice, CpuStream, JobInput};
use crate::{AccessKind, DeviceError, FailureHandle, ForeignBackend, Result, View};

impl ForeignBackend for Cpu {
    fn bind(_device: &CpuDevice) -> Result<()> {
        crate::host_fn::check("bind")
    }

    fn park(device: &CpuDevice, error: DeviceError) {
        device.park(error)
    }

    fn address(view: &View<'_, Cpu>) -> u64 {
        raw(*view).ptr() as u64
    }

    fn enqueue_foreign(
        stream: &CpuStream,
        op: &'static str,
        accesses: &[(View<'_, Cpu>, AccessKind)],
        issue: &mut dyn FnMut(*mut c_void) -> Result<()>,
    ) -> Result<Option<u64>> {
        crate::host_fn::check(op)?;
        for (v, _) in accesses {
            crate::checks::on_device(op, crate::Stream::device(stream), v)?;
        }
        if stream.failed() {
            return Ok(None);
        }
        // The accesses are declared by a marker job in the library's place:
        // the sanitizer checks them against other streams now, and the
        // library's own jobs follow it in stream order.
        let declared: Vec<Access> = accesses
            .iter()
            .map(|(v, kind)| match kind {
                AccessKind::Read => Access::read(*v),
                AccessKind::Write => Access::write(*v),
            })
            .collect();
        stream.enqueue(op, &declared, |_| Ok(()))?;
        let position = stream.submitted();
        issue(stream as *const CpuStream as *mut c_void)?;
        // Keep the memory alive until the library's jobs have run.
        let held: Vec<_> = accesses.iter().map(|(v, _)| raw(*v)).collect();
        stream.enqueue(op, &[], move |_: JobInput<'_>| {
            drop(held);
            Ok(())
        })?;
        Ok(Some(position))
    }

    fn failure_handle(stream: &CpuStream) -> FailureHandle {
        let shared = Arc::downgrade(&stream.shared);
        FailureHandle::new(
            stream.shared.name.clone(),
            Arc::new(move |_position, error| {
                if let Some(s) = shared.upgrade() {
                    s.fail(error);
                }
            }),
        )
    }
}
