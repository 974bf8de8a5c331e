//! Fully sharded data parallel, written once against chorus's traits.
//!
//! This is PyTorch FSDP2's design on the [`Communicator`](chorus_collectives::Communicator)
//! and [`Stream`](chorus_devices::Stream) traits, with no backend code:
//! per-parameter sharding on any dimension with padding ([`layout`]); param
//! groups that all-gather all their parameters at once and reduce-scatter
//! all their gradients at once; the training and sharded state machines;
//! the four communication streams with events between them (reused, not
//! made per synchronisation); implicit and
//! explicit prefetch; reshard-after-forward as a bool or a smaller world;
//! HSDP and DDP layouts; mixed precision; gradient-accumulation switches;
//! gradient divide factors; sharded optimizers and gradient clipping
//! ([`optim`]).
//!
//! Rust has no module hooks, so a model calls the hooks explicitly — one
//! line per layer with [`Fsdp::forward`] and [`Fsdp::backward`]. The
//! `chorus-train` crate holds a reference model and training loop written
//! against this public API.
//!
//! The modules follow FSDP2's files: `state` is the root ([`Fsdp`]) and the
//! order of the hooks, `param_group` a group's state machine, `collectives`
//! the copy-in / all-gather / copy-out and gradient reduction, `param` one
//! parameter, `storage` a group's flat buffers (masters, gradients,
//! unsharded parameters: one buffer per kind and group, each parameter a
//! range), `events` the events the streams order themselves with,
//! `comm_context` what the groups share, `training_state` a group's states.
#![warn(missing_docs)]

mod collectives;
mod comm_context;
mod config;
mod error;
mod events;
pub mod layout;
mod offload;
pub mod optim;
mod overhead;
mod param;
mod param_group;
mod pending;
mod routed;
mod state;
mod storage;
mod training_state;

use chorus_collectives::CommBackend;
use chorus_devices::Backend;

pub use comm_context::CommCounts;
pub use config::{gathers_as_float8, DataParallel, FsdpConfig, MixedPrecision, OffloadPolicy, Reshard, ShardPlacement};
pub use error::{FsdpError, Result};
pub use optim::{OptimizerKind, ShardedOptimizer};
pub use overhead::{Hook, HookTime, HostOverhead};
pub use param::{rows_of, DeferredParam, ParamInit, ShardSource};
pub use pending::PendingValue;
pub use state::{Fsdp, UnshardHandle};
pub use training_state::{ShardedState, TrainingState};

// Shorthands for the backend types behind a communicator.
pub(crate) type B<C> = <C as CommBackend>::B;
pub(crate) type Buf<C> = <B<C> as Backend>::Buffer;
pub(crate) type Strm<C> = <B<C> as Backend>::Stream;
pub(crate) type Ev<C> = <B<C> as Backend>::Event;
