//! chorus-conformance's integration tests, in one binary: each file of this
//! folder is a module of it, so the generic suite they instantiate is built
//! and linked once (a binary per file built it again for each). nextest
//! runs each test in a process of its own.

mod checked;
mod float8;
mod offload_kernels_off_host;
mod rank_deadline;
mod routed;
mod sim;
mod simnccl;
mod ucx;
mod ucx_hosts;
