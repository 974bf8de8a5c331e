//! `this_test!(name)`: the name libtest gives the test `name` of the module
//! it is used in, in a test binary whose files are modules of one root
//! (`module::name`): what a test that runs itself again in a child process
//! passes to `--exact`. Shared by the crates' tests/integration.rs
//! (`#[macro_use] #[path = "../../ci/this_test.rs"] mod this_test;`).

/// `$name`, a test of the module this is used in, as libtest names it.
macro_rules! this_test {
    ($name:expr) => {
        format!("{}::{}", module_path!().split_once("::").map_or("", |(_, m)| m), $name)
    };
}
