//! The `nccl` backend: NVIDIA's NCCL on `cuda` devices (feature `nccl`).
//!
//! Three layers, as every vendor library in chorus:
//! - [`sys`]: the symbols, loaded at run time from `$CHORUS_NCCL_LIB`,
//!   `libnccl.so.2` (pip's `nvidia-nccl-cu12`), `libnccl.so` or cudarc's
//!   names; declarations follow cudarc's `nccl::sys` (see there why the
//!   loading is ours);
//! - [`result`]: one function per NCCL call, status → [`CommError`] with the
//!   code, its name and NCCL's last error;
//! - the safe [`NcclComm`] (this module's [`CommBackend`]): owns the
//!   handle, is `Send + Sync`, exposes pre-multiplied sums and splits.
//!
//! How the contract maps onto NCCL:
//! - **bootstrap**: rank 0 calls `ncclGetUniqueId` and publishes the 128
//!   bytes in a [`Store`](crate::bootstrap::Store); the others read them; every
//!   rank calls `ncclCommInitRankConfig` with a **non-blocking** config and
//!   polls `ncclCommGetAsyncError` until it is ready or the deadline passes
//!   (then the communicator is aborted and the error is `Timeout`);
//! - **calls**: each batch from the [`Communicator`](crate::Communicator) is
//!   one `ncclGroupStart`/`ncclGroupEnd` on the caller's stream; all-to-all
//!   is grouped `ncclSend`/`ncclRecv`; barrier is an all-reduce of one
//!   element; `PreMulSum` creates a reduce op with a host-immediate scalar in
//!   the buffer's dtype and destroys it once the group is enqueued;
//! - **failures**: after each batch an event is recorded and a
//!   [`StreamMonitor`](chorus_devices::cuda::StreamMonitor) watches it. While
//!   the host waits on that stream (or on a later event), the monitor polls
//!   `ncclCommGetAsyncError` and the deadline; an error or an expired
//!   deadline (a dead peer) aborts the communicator — which makes NCCL's
//!   kernels return — and fails the stream with the `CommError` inside
//!   `DeviceError::OpFailed`, so `CommError::from` recovers `Timeout`,
//!   `Aborted` or the backend error;
//! - **abort** is `ncclCommAbort` and affects this rank only (peers time out);
//! - **drop** finalizes (`ncclCommFinalize`, polled to completion) then
//!   destroys; a failure there aborts instead and is parked on the device.

mod comm;
pub mod result;
pub mod sys;

pub use comm::{NcclComm, NcclConfig};
