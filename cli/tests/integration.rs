//! chorus-cli's integration tests, in one binary: each file of this folder
//! is a module of it (train/ one with its own files), so the code they
//! share is built and linked once (a binary per file built it again for
//! each). nextest runs each test in a process of its own.

#[macro_use]
#[path = "../../ci/this_test.rs"]
mod this_test;

mod commands;
mod common;
mod flight_recorder;
mod generate;
mod gpu_judge;
mod interrupts;
mod job;
mod launch;
mod launch_restarts;
mod llama;
mod llama_torch;
mod lr_torch;
mod plan_limits;
mod tokenize;
#[path = "../../ci/torch_python.rs"]
mod torch_python;
mod train;
mod train_async_save_memory;
mod train_dirs;
mod train_job;
mod train_loop;
mod train_moe;
mod train_offload;
mod train_op_times;
mod train_resident;
mod ucx;
