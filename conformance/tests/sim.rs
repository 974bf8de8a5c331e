//! Runs the whole conformance suite on the sim backend, one test per world size.

use chorus_collectives::sim::SimComm;
use chorus_conformance::harness::case_names;
use chorus_conformance::sim::SimHarness;

chorus_conformance::conformance_tests!(
    SimHarness,
    one_rank = 1,
    two_ranks = 2,
    three_ranks = 3,
    four_ranks = 4,
    eight_ranks = 8,
);

#[test]
fn case_names_are_unique_for_every_world_size() {
    for n in 0..=9 {
        let names = case_names::<SimComm>(n);
        let unique: std::collections::HashSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "duplicate case names for {n} ranks");
    }
}

#[test]
fn a_filter_selects_cases_by_substring() {
    let mut ran = Vec::new();
    let summary = chorus_conformance::harness::run(&SimHarness, 2, Some("all_reduce/f32/sum/"), &mut |o| {
        ran.push(o.name.clone())
    });
    assert_eq!(ran.len(), 5, "{ran:?}");
    assert!(ran.iter().all(|n| n.starts_with("all_reduce/f32/sum/count=")), "{ran:?}");
    assert_eq!(summary.line(), "5 passed, 0 failed, 0 skipped");
}

#[test]
fn a_world_of_no_ranks_is_a_failure_not_a_panic() {
    let summary = chorus_conformance::harness::run(&SimHarness, 0, None, &mut |_| {});
    assert_eq!((summary.passed, summary.failed), (0, 1));
}
