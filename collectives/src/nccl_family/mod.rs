//! The NCCL family, written once: NCCL, RCCL and a simulated NCCL ABI share
//! one communicator ([`VendorComm`]), one symbol table ([`sys::Api`]), one
//! function per call ([`result`]), one watchdog and one ABI definition
//! ([`abi`]). What differs between the libraries is a [`VendorLib`]: where
//! the library is loaded from, which device backend it runs on, and its
//! version quirks. `nccl`, `rccl` and [`simlib`] are each one such impl.
//!
//! How the contract maps onto an NCCL-ABI library:
//! - **bootstrap**: rank 0 calls `ncclGetUniqueId` and publishes the 128
//!   bytes through a [`Store`](crate::bootstrap::Store); every rank calls
//!   `ncclCommInitRankConfig` with a **non-blocking** config and polls
//!   `ncclCommGetAsyncError` until it is ready or the deadline passes (then
//!   the communicator is aborted and the error is `Timeout`). A library
//!   without the config call gets the blocking `ncclCommInitRank`;
//! - **one call at a time**: every call on a communicator's handle is made
//!   under its lock (the library forbids concurrent use), polls of an
//!   in-progress call included; nothing is called on a handle after abort or
//!   destroy (a `released` flag under the same lock);
//! - **calls**: each batch from the [`Communicator`](crate::Communicator) is
//!   one `ncclGroupStart`/`ncclGroupEnd` on the caller's stream, enqueued
//!   through [`ForeignBackend::enqueue_foreign`]
//!   (which keeps the buffers alive in stream order). On a non-blocking
//!   communicator `ncclGroupEnd` may return `ncclInProgress` while the
//!   library's own thread enqueues the kernels; the launch waits for that
//!   (polling, abortable) so whatever the caller enqueues next runs after
//!   the collective. All-to-all is the library's own (`ncclAlltoAll`,
//!   `ncclAllToAll`) or grouped sends and receives; a barrier all-reduces
//!   one element of scratch allocated in the stream's order; `PreMulSum`
//!   creates a reduce operator with a host-immediate scalar and destroys it
//!   once the group is enqueued;
//! - **known library bugs**: NCCL before 2.29.7 (and RCCL, whose fix has no
//!   known release) leaves the last elements unscaled in one-rank `Avg` and
//!   `PreMulSum` reductions (NVIDIA/nccl#1950); on those versions a one-rank
//!   reduction is issued as a sum, then scaled on the stream;
//! - **failures and deadlines** (`watchdog.rs`): each launch is recorded
//!   between two events; a background watchdog starts the launch's deadline
//!   when its stream reaches it, polls `ncclCommGetAsyncError`, and on an
//!   error or an expired deadline aborts the communicator and fails the
//!   launch's stream with the [`CommError`](crate::CommError) inside
//!   `DeviceError::OpFailed`. Host waits and host functions never poll a
//!   communicator. The watchdog never blocks (one thread watches them all):
//!   it only tries a handle's lock, and the abort it decides releases the
//!   handle on a thread of its own; it polls every 100 ms (the trade-off is
//!   written at `watchdog::INTERVAL`);
//! - **abort** (`ncclCommAbort`) is local: peers see the failure through
//!   their own deadlines or the library's remote-error detection. It never
//!   waits behind a non-blocking call in progress;
//! - **split**: `ncclCommSplit` writes the child handle when the split
//!   completes — on a non-blocking parent after the call returned, which
//!   returns ncclSuccess all the same — so the handle goes to a heap slot
//!   that lives until the parent's async error says the split is done (and
//!   is leaked, never freed under the library, if it does not complete);
//! - **drop**: `ncclCommFinalize` (polled, with the deadline), then
//!   `ncclCommDestroy`; on failure `ncclCommAbort`. Errors are parked on
//!   the device. The teardown runs on a thread of its own, and the drop
//!   waits for it at most twice the deadline (destroy blocks until the whole
//!   device is idle, so device work that never ends would hang the dropping
//!   thread; past the deadline a `Timeout` is parked and the handle leaked).
//!   The watchdog's thread, which can hold the last reference while it
//!   polls, does not wait at all.

pub mod abi;
mod comm;
mod issue;
mod launches;
pub mod result;
mod shared;
#[cfg(feature = "sim")]
pub mod simlib;
pub mod sys;
mod translate;
mod watchdog;

pub use comm::VendorComm;
pub use shared::VendorConfig;

use chorus_devices::ForeignBackend;

use crate::Result;

/// One library of the NCCL family: where it comes from and its quirks.
pub trait VendorLib: Send + Sync + 'static {
    /// The backend's name (`nccl`, `rccl`, `simnccl`), also the library's in errors.
    const NAME: &'static str;
    /// The device backend the library runs on.
    type B: ForeignBackend;
    /// The loaded library, or why it cannot be loaded (loaded once per process).
    fn lib() -> Result<result::Lib>;
    /// Whether this version computes one-rank `Avg` and `PreMulSum`
    /// reductions wrongly (NVIDIA/nccl#1950); chorus then issues a sum and
    /// scales on the stream.
    fn one_rank_scaling_broken(version: abi::Version) -> bool;
}
