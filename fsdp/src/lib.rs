//! Fully sharded data parallel, written once against chorus's traits.
//!
//! This is PyTorch FSDP2's design on the [`Communicator`](chorus_collectives::Communicator)
//! and [`Stream`](chorus_devices::Stream) traits, with no backend code:
//! per-parameter sharding on any dimension with padding ([`layout`]); param
//! groups that all-gather all their parameters at once and reduce-scatter
//! all their gradients at once; the training and sharded state machines;
//! the four communication streams with events between them; implicit and
//! explicit prefetch; reshard-after-forward as a bool or a smaller world;
//! HSDP and DDP layouts; mixed precision; gradient-accumulation switches;
//! gradient divide factors; sharded optimizers and gradient clipping
//! ([`optim`]); and a reference model ([`mlp`]).
//!
//! Rust has no module hooks, so a model calls the hooks explicitly — one
//! line per layer with [`Fsdp::forward`] and [`Fsdp::backward`].
#![warn(missing_docs)]

mod config;
mod error;
pub mod layout;
pub mod mlp;
pub mod npy;
pub mod optim;
mod state;
pub mod train;

pub use config::{DataParallel, FsdpConfig, MixedPrecision, Reshard, ShardPlacement};
pub use error::{FsdpError, Result};
pub use optim::{OptimizerKind, ShardedOptimizer};
pub use state::{CommCounts, Fsdp, HostOverhead, ParamInit, ShardedState, TrainingState, UnshardHandle};
