//! The `hip` device: AMD GPUs through the HIP runtime, with kernels compiled
//! at run time by hipRTC (feature `rocm`).
//!
//! Our own bindings, in three layers like cudarc's: [`sys`] (the symbols of
//! `libamdhip64` and hipRTC, loaded at run time with `libloading` from
//! `CHORUS_HIP_LIB` / `CHORUS_HIPRTC_LIB` or the usual file names — nothing
//! links against ROCm, so the feature builds anywhere), [`result`] (one
//! function per call, `hipError_t` → [`DeviceError`]) and the safe types
//! here. A missing library is [`DeviceError::LibraryUnavailable`] naming the
//! files tried and the variable; a runtime that sees no GPU is
//! [`DeviceError::NoDevice`].
//!
//! How the contract maps onto HIP:
//! - a **stream** is a `hipStream_t` created with
//!   `hipStreamCreateWithPriority(hipStreamNonBlocking)`; [`Priority::High`]
//!   is the device's greatest priority. Every operation is one or two
//!   asynchronous HIP calls, so enqueueing returns at once;
//! - an **event** is a `hipEvent_t` (timing disabled); [`Stream::wait`] is
//!   `hipStreamWaitEvent` (device-side), and every host wait — event, stream,
//!   device synchronize — *polls* `hipEventQuery` against the device's
//!   deadline rather than blocking in HIP, so a hung GPU or collective is a
//!   [`DeviceError::Timeout`], not a hang;
//! - a **buffer** is `hipMallocAsync` memory freed with `hipFreeAsync` on
//!   its home stream (the stream that allocated it; an internal stream for
//!   [`Device::alloc`]). Every stream that touches a buffer is remembered;
//!   dropping the buffer makes the home stream wait for an event on each of
//!   them before the free, so dropping with work in flight is safe. `Drop`
//!   never panics: HIP errors while releasing are parked and returned by the
//!   next [`Device::synchronize`];
//! - **memory statistics** are our own counters, updated on every allocation
//!   and drop (HIP's pool may hold more than that from the driver);
//! - **host memory** ([`crate::MemorySpace::Host`], `Device::alloc_host`)
//!   is pinned (`hipHostMalloc`) or pageable, counted apart; copies reach
//!   it (pinned: `hipMemcpyAsync`; pageable: staged through a pinned block
//!   by host work, so stream order holds), kernels, fills and vendor work
//!   are refused, and a dropped host buffer is freed only after the work of
//!   every stream that used it (`host.rs`). Built, never run on an AMD GPU;
//! - **host↔device copies** stage through page-locked blocks (`hipHostMalloc`,
//!   pooled per device) so they are truly asynchronous; a host function
//!   enqueued after the copy (`hipLaunchHostFunc`, or `hipStreamAddCallback`
//!   on runtimes that lack it, such as ROCm 5.2) completes the
//!   [`Readback`](crate::Readback) or returns the staged upload's block to
//!   the pool, in stream order. Host functions never call HIP: they run
//!   marked (`crate::host_fn`), every HIP call refuses there with
//!   `InHostFunction`, and a drop there postpones its HIP work to the next
//!   bind from another thread. `launch_host_fn` is enqueued on a failed
//!   stream too, so it runs after the work before it, as on every device;
//!   `update_on_host` is host work on the host buffers' bytes
//!   (`crate::host_update`, shared with the cuda device);
//! - **batches** (`copy_2d_batch`, `fill_batch`) are still one call per
//!   piece here (the trait's default): the batch kernels of the shared source
//!   compile for HIP, and the cuda device's launch path
//!   (`crate::gpu_batch`) is not yet ported;
//! - **compute** (cast, scale, accumulate, axpy, the MLP and loss ops, SGD,
//!   AdamW, matmul) are the kernels of the source shared with the cuda
//!   device ([`crate::gpu_kernels`]), compiled whole with hipRTC when a
//!   stream of the device first needs one and kept per device; see
//!   [`kernels`] (matmul is the source's tiled kernel with f32 accumulation,
//!   not hipBLAS);
//! - **asynchronous failures**: a HIP error seen by a host wait, or a failure
//!   another layer reports through a [`FailureHandle`](crate::FailureHandle)
//!   (a collective's watchdog), is sticky on the stream from the failed
//!   operation on (`crate::failure`, shared with the cuda device): later
//!   operations on it are skipped, and the next synchronize — or of an event
//!   recorded after it, or of a stream that waited for such an event —
//!   returns it.
//!
//! The stream sanitizer of the cpu device has no counterpart here: the same
//! program runs on `cpu` in CI, where races are caught.

mod compute;
mod device;
mod event;
mod foreign;
mod host;
pub mod kernels;
pub mod result;
mod stream;
pub mod sys;

pub use device::{HipBuffer, HipConfig, HipDevice};
pub use event::HipEvent;
pub use stream::HipStream;

#[cfg(doc)]
use crate::{Device, Priority, Stream};
use crate::{DeviceError, Result};

crate::backend! {
    /// The hip backend's types.
    Hip = "hip": HipDevice, HipStream, HipEvent, HipBuffer
}

/// What the process sees of ROCm: for `chorus info` and logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HipInfo {
    /// Where `libamdhip64` was loaded from.
    pub library: String,
    /// `hipRuntimeGetVersion`, decoded (`5.2.21153`).
    pub runtime_version: String,
    /// Where hipRTC was loaded from, or why it could not be.
    pub hiprtc: std::result::Result<String, String>,
    /// Devices visible (0 without a GPU or driver).
    pub devices: usize,
    /// Why no device is usable, when `devices` is 0.
    pub no_device_reason: Option<String>,
}

/// Loads HIP (not hipRTC's compiler) and reports the library, its version
/// and the visible devices. Fails only if the runtime cannot be loaded.
pub fn info() -> Result<HipInfo> {
    let lib = sys::hip()?;
    let v = result::runtime_version()?;
    let runtime_version = format!("{}.{}.{}", v / 10_000_000, (v / 100_000) % 100, v % 100_000);
    let (devices, no_device_reason) = match result::init().and_then(|_| result::device_count()) {
        Ok(0) => (0, Some("hipGetDeviceCount reports no device".to_string())),
        Ok(n) => (n, None),
        Err(e) => (0, Some(e.to_string())),
    };
    let hiprtc = sys::hiprtc().map(|r| r.path.clone()).map_err(|e| e.to_string());
    Ok(HipInfo { library: lib.path.clone(), runtime_version, hiprtc, devices, no_device_reason })
}

/// Number of HIP devices visible (0 when the runtime loads but sees none).
pub fn device_count() -> Result<usize> {
    match result::init() {
        Ok(()) => result::device_count(),
        Err(DeviceError::NoDevice { .. }) => Ok(0),
        Err(e) => Err(e),
    }
}
