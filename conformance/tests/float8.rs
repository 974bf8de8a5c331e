//! The float8 all-gather cases alone (they also run in each backend's whole
//! suite): on sim at 1–4 and 8 ranks, and on UCX with every rank in this
//! process at 2 and 4 (with the `ucx` feature).

use chorus_conformance::harness::run;

fn run_float8<H: chorus_conformance::harness::Harness>(harness: &H, ranks: &[usize]) {
    for &n in ranks {
        let mut names = Vec::new();
        let summary = run(harness, n, Some("fsdp/float8/"), &mut |o| names.push(o.name.clone()));
        assert_eq!(summary.failed, 0, "{n} ranks: {}", summary.line());
        assert_eq!((summary.passed, summary.skipped), (5, 0), "{n} ranks: {names:?}");
    }
}

#[test]
fn float8_cases_pass_on_sim() {
    run_float8(&chorus_conformance::sim::SimHarness, &[1, 2, 3, 4, 8]);
}

#[cfg(feature = "ucx")]
#[test]
fn float8_cases_pass_on_ucx() {
    run_float8(&chorus_conformance::ucx::UcxHarness::default(), &[2, 4]);
}
