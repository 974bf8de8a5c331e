//! FSDP for candle models, over `chorus-fsdp`.
//!
//! candle has no module hooks and differentiates the whole graph at once, so
//! the adapter maps FSDP's per-group hooks onto candle custom ops
//! ([`FsdpModel`]): a model is split into *stages*, each using one param
//! group's parameters; a stage's forward all-gathers its group, computes,
//! and reshards; its backward all-gathers again, recomputes the stage
//! (activation checkpointing; or, per group, uses the graph kept from
//! forward: [`Recompute`]), runs candle's backward on it, and hands the
//! parameter gradients to FSDP's reduce-scatter. The design and its
//! trade-offs are in `docs/fsdp.md`.
//!
//! The adapter runs on any chorus backend whose device holds host memory
//! (the `cpu` device of the sim, simnccl and ucx backends): moving data
//! between a candle CPU tensor and a device buffer is a host copy through
//! the public [`Stream`](chorus_devices::Stream) API ([`convert`]). candle's
//! CPU kernels take their parallelism from `RAYON_NUM_THREADS` (its
//! element-wise pool is sized once per process); ranks that are threads of
//! one process should each get their share of the cores (`chorus train`
//! sets it to cores / ranks before candle computes anything), or they
//! oversubscribe them.
//!
//! With the `candle-cuda` feature, on the `cuda` device the stages compute
//! on candle's CUDA device on the same GPU ([`FsdpModel::device`]), on
//! FSDP's own buffers: parameters borrowed, gradients added by a kernel
//! into FSDP's, no host copies; candle's stream and FSDP's compute stream
//! ordered by events (the rule is in `docs/fsdp.md`); `cuda_device` is
//! candle's device for plain candle beside it.
//!
//! [`checkpoint`] saves and loads sharded safetensors checkpoints (PyTorch
//! distributed checkpoint's layout for safetensors) that reshard on load to
//! any world size and mesh, and consolidates them into plain safetensors
//! files that candle and Python load. [`safetensors_io`] writes safetensors
//! files tensor by tensor, header first, as the values arrive.
#![warn(missing_docs)]

pub mod checkpoint;
pub mod convert;
mod crc32;
#[cfg(feature = "candle-cuda")]
mod cuda;
mod device;
mod error;
mod module;
pub mod rng;
pub mod safetensors_io;
mod storage;

#[cfg(feature = "candle-cuda")]
pub use cuda::cuda_device;
pub use device::Transfers;
pub use error::{CheckpointError, Error, Result};
pub use module::{named_tensors, take_params, AdapterTimes, FsdpModel, GroupId, Recompute, StageFn, StageId};
