//! The whole conformance suite on the UCX backend with the ranks of this
//! process made to look like two hosts (fake host keys) and every size
//! taking the rings: the hierarchical schedules of all-reduce,
//! reduce-scatter and all-gather (inside a host, then across hosts) run
//! for every case whose world has two or more ranks per host.
#![cfg(feature = "ucx")]

use chorus_conformance::ucx::UcxHarness;

chorus_conformance::conformance_tests!(UcxHarness::fake_hosts(2), two_by_two = 4, two_by_three = 6);
