//! The whole conformance suite on the UCX backend with every rank in this
//! process (each its own UCP worker); `ucx_processes.rs` runs it with one
//! rank per process.

use chorus_conformance::ucx::UcxHarness;

chorus_conformance::conformance_tests!(UcxHarness::default(), two_ranks = 2, four_ranks = 4);
