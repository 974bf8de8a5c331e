//! Runs the whole conformance suite on the NCCL family's communicator over
//! the simulated NCCL ABI (as NCCL 2.28.3, whose one-rank scaling bug must be
//! worked around), checking the library's usage rules after every case.

use chorus_collectives::nccl_family::simlib::SimNccl228;
use chorus_conformance::vendor::VendorHarness;

chorus_conformance::conformance_tests!(
    VendorHarness::<SimNccl228>::default(),
    one_rank = 1,
    two_ranks = 2,
    four_ranks = 4,
);
