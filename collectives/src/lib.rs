//! One collective-communication API with NCCL's semantics over several backends.
//!
//! - [`Communicator`] is what users call: validation, sequence numbers and
//!   fingerprints, groups, splits; it hands validated [`backend::Call`]s to a
//!   [`CommBackend`].
//! - [`Mesh`] builds named dimensions (HSDP's replicate × shard) from splits.
//! - [`bootstrap`]: how ranks find each other — the rendezvous [`bootstrap::Store`]
//!   (in memory, on a shared filesystem, over TCP in PyTorch's TCPStore
//!   protocol) and the launcher environments (torchrun, Slurm, Open MPI, PMI).
//! - Backends: [`sim`] (feature `sim`, default) runs ranks as threads of one
//!   process on cpu devices; the NCCL family ([`vendor`]: `nccl` on cuda
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
#[cfg(feature = "rccl")]
pub mod rccl;
mod reduce;
#[cfg(feature = "sim")]
pub mod sim;
#[cfg(feature = "ucx")]
pub mod ucx;
pub mod vendor;

pub use backend::{Capabilities, CommBackend, OpKind};
pub use comm::{Communicator, Group};
pub use error::{CommError, Result, StoreFailure};
pub use mesh::Mesh;
pub use reduce::ReduceOp;
pub use vendor::abi as nccl_abi;

/// What this crate's exported macros name, reachable through `$crate`
/// whatever the caller calls the devices crate.
#[doc(hidden)]
pub mod __private {
    pub use chorus_devices::{bf16, f16, Backend, DType};
}

/// Evaluates `$body` with `$t` bound to the host type of the
/// [`DType`](chorus_devices::DType) `$dtype` (`f32` for `F32`, `half`'s
/// `f16` for `F16`, ...), so code generic over the element type is written
/// once for every dtype: `with_dtype!(dtype, T => run::<T>(...))`.
#[macro_export]
macro_rules! with_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        $crate::with_dtype!(@each $dtype, $t => $body; F32 f32, F64 f64, F16 $crate::__private::f16,
            BF16 $crate::__private::bf16, I32 i32, I64 i64, I8 i8, U8 u8)
    };
    (@each $dtype:expr, $t:ident => $body:expr; $($variant:ident $host:ty),*) => {
        match $dtype {
            $($crate::__private::DType::$variant => {
                type $t = $host;
                $body
            })*
        }
    };
}

/// `Ok` outside host functions; inside one, the device's `InHostFunction`
/// for `op` (a communicator call there would call the driver).
pub(crate) fn host_fn_check(op: &str) -> Result<()> {
    chorus_devices::host_fn::check(op).map_err(CommError::Device)
}
