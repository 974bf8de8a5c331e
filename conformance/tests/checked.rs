//! The suite on the NCCL family (over the simulated NCCL ABI) wrapped in the
//! checked wrapper: the mismatch and missing-rank cases, which the library
//! alone cannot see, now run and pass.

use chorus_collectives::nccl_family::simlib::SimNccl228;
use chorus_conformance::checked::CheckedHarness;
use chorus_conformance::vendor::VendorHarness;

chorus_conformance::conformance_tests!(
    CheckedHarness::new(VendorHarness::<SimNccl228>::default()),
    two_ranks = 2,
    three_ranks = 3,
);
