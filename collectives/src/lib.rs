//! One collective-communication API with NCCL's semantics over several backends.
//!
//! - [`Communicator`] is what users call: validation, sequence numbers and
//!   fingerprints, groups, splits; it hands validated [`backend::Call`]s to a
//!   [`CommBackend`].
//! - [`recorder`]: the flight recorder every communicator keeps (its last
//!   launches and their states), dumped on a failure or a signal and read by
//!   `chorus trace`.
//! - [`Mesh`] builds named dimensions (HSDP's replicate × shard) from splits.
//! - [`bootstrap`]: how ranks find each other — the rendezvous [`bootstrap::Store`]
//!   (in memory, on a shared filesystem, over TCP in PyTorch's TCPStore
//!   protocol) and the launcher environments (torchrun, Slurm, Open MPI, PMI).
//! - Backends: [`sim`] (feature `sim`, default) runs ranks as threads of one
//!   process on cpu devices; the NCCL family ([`nccl_family`]: `nccl` on cuda
//!   devices, `rccl` on hip devices, and a simulated NCCL ABI on cpu
//!   devices that checks the library's usage rules in CI); [`ucx`] (feature
//!   `ucx`) runs one rank per process (or host) over UCX's tagged messages on
//!   cpu devices.
#![warn(missing_docs)]

#[cfg(any(feature = "sim", feature = "ucx"))]
mod arith;
pub mod backend;
pub mod bootstrap;
pub mod checked;
mod comm;
mod error;
#[cfg(any(feature = "sim", feature = "ucx"))]
mod host_call;
mod mesh;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod nccl_family;
#[cfg(feature = "rccl")]
pub mod rccl;
pub mod recorder;
mod reduce;
#[cfg(feature = "sim")]
pub mod sim;
#[cfg(feature = "ucx")]
pub mod ucx;

pub use backend::{Capabilities, CommBackend, OpKind};
pub use comm::{Communicator, Group};
pub use error::{CommError, Result, StoreFailure};
pub use mesh::Mesh;
pub use nccl_family::abi as nccl_abi;
pub use reduce::ReduceOp;

/// What this crate's exported macros name, reachable through `$crate`
/// whatever the caller calls the devices crate.
#[doc(hidden)]
pub mod __private {
    pub use chorus_devices::Backend;
}

/// `Ok` outside host functions; inside one, the device's `InHostFunction`
/// for `op` (a communicator call there would call the driver).
pub(crate) fn host_fn_check(op: &str) -> Result<()> {
    chorus_devices::host_fn::check(op).map_err(CommError::Device)
}
