//! Plan before you rent: predict per-rank memory, step time and every rank's
//! collective sequence at N GPUs by running chorus's own FSDP state machine
//! on a device and a communicator that keep virtual time instead of data.
//!
//! [`cost`] is the boundary between the two halves: the modelled device and
//! communicator ask a [`cost::CostModel`] how long a kernel, a copy or a
//! collective takes; the GPU tables, NCCL's ring and tree algorithms and the
//! decoder workloads (FLOPs, bytes, activation memory) implement it.
//!
//! - [`virt`]: the virtual device and communicator.
//! - [`run`]: the ranks' FSDP runs on them, with the hooks `chorus train` drives
//!   (every rank a thread, or two ranks standing for all: [`run::Ranks`]).
//! - [`schedule`]: the comparison of every rank's collective sequence.
//! - [`constant`]: a cost model of constant rates (the tests').
//! - [`kernel_rates`] and [`rated_gpu`]: chorus's own trainer on a GPU,
//!   priced from a file of measured rates per kernel and per host operation.
#![warn(missing_docs)]

pub mod constant;
pub mod cost;
pub mod cpu_model;
pub mod decoder_cost;
pub mod gpu;
pub mod kernel_rates;
pub mod nccl;
pub mod rated_gpu;
pub mod run;
pub mod schedule;
pub mod virt;
pub mod workload;
