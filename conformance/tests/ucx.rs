//! The whole conformance suite on the UCX backend with every rank in this
//! process (each its own UCP worker); `cli/tests/ucx.rs` runs it with one
//! rank per process under `chorus launch`.
#![cfg(feature = "ucx")]

use chorus_conformance::ucx::UcxHarness;

chorus_conformance::conformance_tests!(UcxHarness::default(), two_ranks = 2, four_ranks = 4);
