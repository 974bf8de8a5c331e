//! chorus-plan's integration tests, in one binary: each file of this folder
//! is a module of it, so the code they share is built and linked once (a
//! binary per file built it again for each). nextest runs each test in a
//! process of its own.
//!
//! exact_hsdp is a binary of its own: the flight recorder's records of
//! dropped communicators, which it reads, are the whole process's.

mod common;
mod cost_collectives;
mod cost_cpu;
mod cost_decoder;
mod exact_counts;
mod host_cost;
mod kernel_rates;
mod overlap;
mod plan_judge;
mod saved_torch;
mod scale;
mod schedule;
mod symmetric;
#[path = "../../ci/torch_python.rs"]
mod torch_python;
#[path = "common/train.rs"]
mod train;
