//! The `cuda` device: NVIDIA GPUs through the CUDA driver API, NVRTC and
//! cuBLAS, all loaded at run time through cudarc (feature `cuda`).
//!
//! How the contract maps onto CUDA:
//! - a **device** is one GPU's primary context (`cuDevicePrimaryCtxRetain`);
//!   every call makes it current on the calling thread first, so any thread
//!   may use any device — setting it only when the thread's current context
//!   is another (`cuCtxGetCurrent`, a thread-local read, instead of
//!   `cuCtxSetCurrent` on every operation);
//! - a **stream** is a CUDA stream made by `cuStreamCreateWithPriority`
//!   (non-blocking; `Priority::High` is the context's greatest priority);
//! - an **event** is a CUDA event without timing; [`Stream::record`] is
//!   `cuEventRecord`, [`Stream::wait`] is `cuStreamWaitEvent` (device side,
//!   returns at once), [`Event::query`] is `cuEventQuery`;
//! - **host waits** poll `cuStreamQuery` / `cuEventQuery` against the
//!   device's deadline (with [`crate::wait::Backoff`]) rather than block in
//!   the driver, so a wait on a dead peer ends in `Timeout`;
//! - **asynchronous failures**: a device fault reported by the driver is
//!   sticky for every position of the stream (CUDA makes it sticky for the
//!   context); a failure only the host can see — a collective failed by its
//!   communicator's watchdog, through a [`FailureHandle`](crate::FailureHandle)
//!   — is sticky from the failed operation's position on and reaches the
//!   events recorded after it and the streams that waited for them; later
//!   operations on a failed stream are skipped. The bookkeeping is host
//!   state only (`crate::failure`), so host functions may read it;
//! - **host functions** (`cuLaunchHostFunc`: readback completion,
//!   [`Stream::launch_host_fn`](crate::Stream::launch_host_fn) and
//!   [`Stream::update_on_host`](crate::Stream::update_on_host)) run marked
//!   (`crate::host_fn`): every driver entry point binds the context first
//!   and refuses there with `InHostFunction`, and the driver work of a drop
//!   that happens there (a buffer's stream-ordered free, a stream's or an
//!   event's destruction) is postponed to the next bind on another thread.
//!   A host function is enqueued on a failed stream too (it is told the
//!   failure), so what it releases — a staging block a queued copy writes —
//!   is released only after that copy, whichever thread failed the stream;
//! - a **buffer** comes from the stream-ordered allocator (`cuMemAllocAsync`
//!   on the allocating stream; `Device::alloc` allocates and zeroes on an
//!   internal stream and waits). Dropping it makes the owning stream wait for
//!   every other stream that used it and enqueues `cuMemFreeAsync` there, so
//!   queued work never sees freed memory: a user the owner already waited
//!   for after its last use (or whose work a host wait saw finish) needs no
//!   new wait, and the others' waits go through the device's spare events
//!   (recorded, waited on, back in the pool at once), so a free makes and
//!   destroys no event; errors are parked on the device;
//! - **memory statistics** are our own exact counters, changed when a
//!   buffer is made and when its free is enqueued (the pool may keep the
//!   bytes reserved; the statistics count what chorus holds);
//! - **host memory** ([`crate::MemorySpace::Host`], `Device::alloc_host`)
//!   is pinned (`cuMemHostAlloc`) or pageable, counted apart; copies reach
//!   it (pinned: `cuMemcpyAsync`; pageable: staged through a pinned block
//!   by host functions, so stream order holds), kernels, fills and vendor
//!   work are refused, and a dropped host buffer is freed only after the
//!   work of every stream that used it (host functions hold it till then);
//! - **host→device** copies use `cuMemcpyHtoDAsync` from the caller's
//!   slice: for pageable memory the driver stages the bytes before it
//!   returns, so the slice may be reused at once. **Device→host** copies go
//!   into a pinned block with `cuMemcpyDtoHAsync`, followed by
//!   `cuLaunchHostFunc`: the host function (which may not call CUDA) copies
//!   the bytes out, completes the [`crate::Readback`] and returns the block
//!   to a pool. So a readback completes exactly when its copy has run;
//! - the **compute operations** are the kernels of the source shared with
//!   the hip device ([`crate::gpu_kernels`]), compiled by NVRTC once per
//!   compute capability per process and loaded once per device; `matmul` is `cublasGemmEx` with f32
//!   compute for f16/bf16/f32 (f64 for f64), one handle per stream;
//! - **batches** ([`Stream::copy_2d_batch`](crate::Stream::copy_2d_batch),
//!   [`Stream::fill_batch`](crate::Stream::fill_batch)) are planned by
//!   [`crate::gpu_batch`]: pieces that continue one another merge, the rest
//!   go 64 to a launch of the batch kernels, so a group's copy-out is one
//!   driver call rather than one per parameter;
//! - **counting**: [`Device::count_calls`](crate::Device::count_calls)
//!   counts the process's driver calls by entry point (every call made
//!   through `result.rs`), for the host-path bench and the device suite;
//! - **loading**: before cudarc is touched, [`driver_library`],
//!   [`nvrtc_library`] and [`cublas_library`] probe the libraries the way
//!   cudarc will load them; a missing library is
//!   [`DeviceError::LibraryUnavailable`](crate::DeviceError::LibraryUnavailable)
//!   naming the files tried and the variable to set, never a panic.
//!
//! [`Stream::record`]: crate::Stream::record
//! [`Stream::wait`]: crate::Stream::wait
//! [`Event::query`]: crate::Event::query

mod blas;
mod compute;
mod device;
mod event;
mod foreign;
mod host;
mod kernels;
mod loader;
mod memory;
mod result;
mod stream;

pub use device::{device_count, driver_version, CudaConfig, CudaDevice};
pub use event::CudaEvent;
pub use loader::{cublas_library, curand_library, driver_library, nvrtc_library, LibraryInfo};
pub use memory::CudaBuffer;
pub use stream::{device_ptr, CudaStream};

/// The raw driver types that vendor libraries built on this device take.
pub mod sys {
    pub use cudarc::driver::sys::{CUcontext, CUdevice, CUdeviceptr, CUevent, CUstream};
}

crate::backend! {
    /// The cuda backend's types.
    Cuda = "cuda": CudaDevice, CudaStream, CudaEvent, CudaBuffer
}
