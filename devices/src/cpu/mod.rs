//! The `cpu` device: the host's memory and threads with CUDA's stream semantics.
//!
//! How the contract maps onto the host:
//! - a **stream** is an executor thread with a FIFO queue; enqueueing sends a
//!   closure and returns, so work on two streams really runs concurrently;
//! - an **event** record is a marker in the queue that completes a flag with
//!   release ordering; a stream wait is a queued job that blocks the executor
//!   (acquire) until the flag is set, so the host returns at once;
//! - a **buffer** is a 64-byte-aligned host allocation shared by `Arc` with
//!   the queued jobs that use it, so dropping a buffer with work in flight is
//!   safe and the bytes are freed after the last job — to the device's
//!   caching allocator (`pool.rs`), which hands them out again as CUDA's does;
//! - memory statistics are exact counters in the stream-ordered allocator's
//!   terms: a buffer counts from allocation until its handle is dropped (see
//!   `device.rs`), so they are deterministic whatever the executors' lag;
//! - the **stream sanitizer** ([`sanitizer`]) checks every enqueued
//!   operation's declared reads and writes against the other streams' with
//!   vector clocks and refuses unordered ones with [`DeviceError::Race`](crate::DeviceError::Race).
//!
//! Other crates (the `sim` collectives backend) enqueue their own jobs with
//! [`CpuStream::enqueue`], declaring their accesses the same way.

mod compute;
mod device;
mod event;
mod foreign;
pub(crate) mod kernels;
mod memory;
mod pool;
pub mod sanitizer;
mod stream;

pub use device::{CpuBuffer, CpuConfig, CpuDevice, DEFAULT_CACHE_LIMIT};
pub use event::CpuEvent;
pub use memory::RawRange;
pub use pool::CacheStats;
pub use sanitizer::Access;
pub use stream::{CpuStream, JobInput};

crate::backend! {
    /// The cpu backend's types.
    Cpu = "cpu": CpuDevice, CpuStream, CpuEvent, CpuBuffer
}

/// The memory behind a view, kept alive while the handle lives (for jobs
/// enqueued with [`CpuStream::enqueue`]).
pub fn raw(view: crate::View<'_, Cpu>) -> RawRange {
    view.buffer().raw_range(view.byte_range())
}
