//! The chorus crate's integration tests, in one binary: each file of this
//! folder is a module of it, built and linked once. nextest runs each test
//! in a process of its own.

#[macro_use]
#[path = "../../ci/this_test.rs"]
mod this_test;

mod model;
mod world;
