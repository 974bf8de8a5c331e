//! What a vendor communication library needs from a device backend.
//!
//! NCCL and RCCL enqueue their own kernels on our streams and read our
//! buffers through raw device addresses. [`ForeignBackend`] is the small
//! surface they use, implemented by the cuda and hip devices and by the cpu
//! device (for the simulated NCCL ABI that runs the same communicator code in
//! CI): bind the device to the calling thread, enqueue foreign work on a
//! stream with the buffers it touches declared, fail a stream from a
//! watchdog, and park errors that arise in drops.

use std::ffi::c_void;

use crate::api::Backend;
use crate::{AccessKind, DeviceError, FailureHandle, Result, View};

/// A device backend that vendor libraries can enqueue work on.
pub trait ForeignBackend: Backend {
    /// Makes `device` current on the calling thread (`cuCtxSetCurrent`,
    /// `hipSetDevice`; nothing on the cpu). Refused inside a host function.
    fn bind(device: &Self::Device) -> Result<()>;

    /// Keeps an error that arose where no caller can take it (a drop); the
    /// device's next `synchronize` reports it.
    fn park(device: &Self::Device, error: DeviceError);

    /// The address of `view`'s first element as the library takes it.
    fn address(view: &View<'_, Self>) -> u64;

    /// Enqueues work that a library issues itself on `stream`.
    ///
    /// Checks that every view is of the stream's device (else
    /// `InvalidArgument`) and that the call is not made inside a host
    /// function; declares the accesses (so the cpu device's sanitizer checks
    /// them and every device keeps the buffers alive until the work has run);
    /// binds the device; then calls `issue` with the raw stream handle the
    /// library takes (`cudaStream_t`, `hipStream_t`, or for the cpu device a
    /// pointer to the [`CpuStream`](crate::cpu::CpuStream), valid during the
    /// call). Whatever `issue` enqueues on that handle runs in stream order.
    ///
    /// Returns `Ok(Some(position))` — the operation's position, for
    /// [`FailureHandle::fail`] — or `Ok(None)` without calling `issue` when
    /// the stream has already failed (the work is skipped, as every
    /// operation on a failed stream is). An error from `issue` is returned
    /// and fails nothing.
    fn enqueue_foreign(
        stream: &Self::Stream,
        op: &'static str,
        accesses: &[(View<'_, Self>, AccessKind)],
        issue: &mut dyn FnMut(*mut c_void) -> Result<()>,
    ) -> Result<Option<u64>>;

    /// A handle that fails `stream` from a given position on, from any thread.
    fn failure_handle(stream: &Self::Stream) -> FailureHandle;
}
