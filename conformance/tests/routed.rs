//! The routed-group cases (`fsdp/routed/`: a mixture-of-experts model whose
//! ranks use different experts each step) at 2, 3 and 4 ranks on sim, on the
//! NCCL family under the checked wrapper, and (feature `ucx`) on UCX, where
//! the whole suite's tests run only 2 and 4. Every wait in them has the
//! harness's deadline, so a hang would be a failed case.

use chorus_conformance::harness::{run, Harness};
use chorus_conformance::Status;

const FILTER: &str = "fsdp/routed/";

/// Runs the routed cases on `harness` at `ranks`: none may fail, and every
/// parity case must have run (only the mismatch case may be skipped, on a
/// backend that cannot see a peer's call).
fn routed<H: Harness>(harness: &H, ranks: usize) {
    let (mut failed, mut parity) = (Vec::new(), 0);
    let summary = run(harness, ranks, Some(FILTER), &mut |o| match &o.status {
        Status::Failed(_) => {
            println!("{o}");
            failed.push(o.name.clone());
        }
        Status::Skipped(_) => println!("{o}"),
        Status::Passed => parity += usize::from(o.name.contains("moe-parity")),
    });
    println!("{}, {ranks} ranks: {}", harness.name(), summary.line());
    assert!(failed.is_empty(), "failed: {failed:#?}");
    assert!(parity >= 4, "only {parity} MoE parity cases passed");
}

#[test]
fn sim_two_three_and_four_ranks() {
    for n in [2, 3, 4] {
        routed(&chorus_conformance::sim::SimHarness, n);
    }
}

#[test]
fn checked_simnccl_two_and_three_ranks() {
    use chorus_collectives::nccl_family::simlib::SimNccl228;
    use chorus_conformance::checked::CheckedHarness;
    use chorus_conformance::vendor::VendorHarness;
    for n in [2, 3] {
        routed(&CheckedHarness::new(VendorHarness::<SimNccl228>::default()), n);
    }
}

#[cfg(feature = "ucx")]
#[test]
fn ucx_two_three_and_four_ranks() {
    for n in [2, 3, 4] {
        routed(&chorus_conformance::ucx::UcxHarness::default(), n);
    }
}
