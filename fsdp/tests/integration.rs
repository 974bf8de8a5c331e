//! chorus-fsdp's integration tests, in one binary: each file of this folder
//! is a module of it, so the code they share is built and linked once.
//! nextest runs each test in a process of its own.

mod clip;
mod deferred_grads;
mod host_path;
