//! Devices, streams, events and buffers with CUDA's stream-ordered semantics.
//!
//! This crate is the bottom layer of chorus. It defines the [`Backend`] trait
//! family (see [`api`] for the ordering and error contract every backend
//! honours), the element types ([`DType`]), views into buffers ([`View`]),
//! host readbacks ([`Readback`]), and the always-available [`cpu`] device,
//! whose streams are executor threads and whose stream sanitizer reports
//! cross-stream races as typed errors.
#![warn(missing_docs)]

pub mod api;
mod bookkeeping;
mod call_count;
mod checks;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(any(feature = "cuda", feature = "rocm"))]
mod deferred;
mod dtype;
mod error;
mod failure;
mod foreign;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod gpu_batch;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod gpu_kernels;
#[cfg(feature = "rocm")]
pub mod hip;
#[cfg(any(feature = "cuda", feature = "rocm"))]
mod host_alloc;
pub mod host_fn;
pub mod host_step;
#[cfg(any(feature = "cuda", feature = "rocm"))]
mod host_update;
mod id;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod loader;
mod memory;
mod readback;
mod view;
pub mod wait;

pub use api::{
    AdamWOperands, AdamWParams, Backend, Buffer, BufferMeta, ComputeBackend, ComputeStream, Copy2d, Copy2dPiece,
    Device, Event, HostUpdate, MatmulSpec, MemorySpace, MemoryStats, Priority, Result, SgdOperands, SgdParams, Stream,
    StreamExt,
};
pub use dtype::{DType, Element, Float8E4M3, Scalar};
pub use error::{AccessKind, DeviceError, RaceAccess, RaceReport};
pub use failure::FailureHandle;
pub use foreign::ForeignBackend;
pub use half::{bf16, f16};
pub use memory::MemCounters;
pub use readback::{Readback, ReadbackFiller};
pub use view::View;
