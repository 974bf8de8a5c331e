//! chorus-kernels's integration tests, in one binary: each file of this folder
//! is a module of it, so the code they share is built and linked once (a
//! binary per file built it again for each). nextest runs each test in a
//! process of its own.
//!
//! ops_cuda is a binary of its own, which ci/gpu-build.sh ships to a
//! GPU machine.

mod common;
mod host;
mod host_kernels;
mod ops;
mod ops_torch;
mod timing;
#[path = "../../ci/torch_python.rs"]
mod torch_python;
