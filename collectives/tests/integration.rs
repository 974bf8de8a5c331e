//! chorus-collectives's integration tests, in one binary: each file of this folder
//! is a module of it, so the code they share is built and linked once (a
//! binary per file built it again for each). nextest runs each test in a
//! process of its own.
//!
//! The NCCL and RCCL loading tests are binaries of their own, which
//! ci/gpu-build.sh ships to a GPU machine.

#[macro_use]
#[path = "../../ci/this_test.rs"]
mod this_test;

mod bootstrap_env;
mod common;
mod sim_determinism;
mod sim_smoke;
mod simnccl_teardown;
mod simnccl_watchdog;
mod store_semantics;
mod tcpstore_fuzz;
mod tcpstore_server;
mod tcpstore_torch;
mod tcpstore_transcript;
#[path = "../../ci/torch_python.rs"]
mod torch_python;
