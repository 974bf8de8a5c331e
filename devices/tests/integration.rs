//! chorus-devices's integration tests, in one binary: each file of this folder
//! is a module of it, so the code they share is built and linked once (a
//! binary per file built it again for each). nextest runs each test in a
//! process of its own.
//!
//! The GPU devices' tests are binaries of their own, which
//! ci/gpu-build.sh ships to a GPU machine.

mod common;
mod cpu_cache;
mod cpu_ordering;
mod cpu_sanitizer;
mod device_cpu;
mod float8_numpy;
mod memory_spaces;
mod suite;
#[path = "../../ci/torch_python.rs"]
mod torch_python;
