//! Distributed training in Rust: one collective-communication API with
//! NCCL's semantics over several backends, and FSDP (PyTorch FSDP2's design)
//! for candle models, written once against it.
//!
//! ```
//! use chorus::prelude::*;
//!
//! // Four ranks: threads of this process on the simulated backend (the
//! // default feature), or this process's rank under torchrun / `chorus
//! // launch` / srun with the `ucx` or `nccl` feature. The same code builds
//! // for every backend.
//! let results = chorus::run(4, |rank| -> chorus::Result<(Vec<f32>, Vec<f32>)> {
//!     let sum = rank.all_reduce(&[rank.rank() as f32, 1.0], ReduceOp::Sum)?;
//!     let all = rank.all_gather(&[rank.rank() as f32 * 10.0])?;
//!     Ok((sum, all))
//! })?;
//! for (sum, all) in results {
//!     assert_eq!(sum, [6.0, 4.0]);
//!     assert_eq!(all, [0.0, 10.0, 20.0, 30.0]);
//! }
//! # Ok::<(), chorus::Error>(())
//! ```
//!
//! # Backends: one feature each
//!
//! | feature | ranks | device |
//! | --- | --- | --- |
//! | `sim` (default) | threads of one process: a simulated cluster, bitwise deterministic, strictest checks | CPU |
//! | `ucx` | processes or hosts under a launcher (threads without one) | CPU |
//! | `nccl` | one per NVIDIA GPU: processes under a launcher, else threads | CUDA |
//! | `rccl` | one per AMD GPU, as `nccl` | HIP |
//!
//! [`SelectedBackend`] is the most specific one built; [`run`] and [`World`]
//! start its ranks. `candle` adds FSDP for your own candle model
//! ([`model`]), `candle-cuda` candle computing on the GPU with NCCL.
//! `docs/library.md` says what runs where and how to go from the simulator
//! to a GPU cluster.
//!
//! # What is here
//!
//! - [`run`], [`World`]: start a world of ranks; each gets a [`Rank`], its
//!   communicator and a stream, with collectives on host slices.
//! - [`testing`]: your distributed function on N simulated ranks inside
//!   `cargo test`, with a deadline and each failing rank's message.
//! - [`model`] (feature `candle`): FSDP for a model written with candle_nn.
//! - The layers below, re-exported whole: [`collectives`] (communicators,
//!   meshes, bootstrap), [`devices`] (devices, streams, buffers), [`fsdp`]
//!   (the param-group state machine, sharded optimizers), and with
//!   `candle`, [`fsdp_candle`] (the adapter, sharded checkpoints), candle
//!   itself as [`candle_core`] and [`candle_nn`] (so your versions match).
#![warn(missing_docs)]

mod backend;
mod error;
#[cfg(feature = "candle")]
pub mod model;
mod rank;
#[cfg(feature = "sim")]
pub mod testing;
mod threads;
mod world;

pub use chorus_collectives as collectives;
pub use chorus_devices as devices;
pub use chorus_fsdp as fsdp;
#[cfg(feature = "candle")]
pub use chorus_fsdp_candle as fsdp_candle;
#[cfg(feature = "candle")]
pub use {candle_core, candle_nn};

pub use backend::{SelectedBackend, SELECTED_BACKEND};
pub use chorus_collectives::bootstrap::{Job, JobError};
pub use chorus_collectives::{CommBackend, Communicator, ReduceOp};
pub use error::{BoxError, Error, Result};
pub use rank::Rank;
pub use world::{run, World};

/// What a training program needs in scope: `use chorus::prelude::*;`.
pub mod prelude {
    pub use crate::{run, Rank, World};
    pub use chorus_collectives::{CommBackend, Communicator, Mesh, ReduceOp};
    pub use chorus_devices::{Buffer, DType, Device, Stream, StreamExt};
    pub use chorus_fsdp::{FsdpConfig, MixedPrecision, OptimizerKind, ShardedOptimizer};

    #[cfg(feature = "candle")]
    pub use crate::model::{batch_slice, Layer, SeededVars, ShardBuilder, ShardedModel};
}
