//! Runs the whole conformance suite on the sim backend, one test per world size.
//!
//! Each failure and skip is printed with its reason (run with `--nocapture`
//! to see them when everything passes), then the summary line; the test
//! fails if any case failed.

use std::sync::Mutex;
use std::time::Instant;

use chorus_conformance::{sim, Status};

/// The world sizes run one at a time: the error cases use sub-second
/// deadlines, which a machine busy with another world's megabyte cases could miss.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn suite(world_size: usize) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let start = Instant::now();
    let mut failures = Vec::new();
    let summary = sim::run(world_size, None, &mut |o| match &o.status {
        Status::Failed(_) => {
            println!("{o}");
            failures.push(o.name.clone());
        }
        Status::Skipped(_) => println!("{o}"),
        Status::Passed => {}
    });
    println!("sim, {world_size} ranks: {} in {:.1?}", summary.line(), start.elapsed());
    assert!(summary.passed > 0, "no case ran");
    assert_eq!(summary.failed, 0, "failed cases: {failures:#?}");
}

#[test]
fn one_rank() {
    suite(1);
}

#[test]
fn two_ranks() {
    suite(2);
}

#[test]
fn three_ranks() {
    suite(3);
}

#[test]
fn four_ranks() {
    suite(4);
}

#[test]
fn eight_ranks() {
    suite(8);
}

#[test]
fn case_names_are_unique_for_every_world_size() {
    for n in 0..=9 {
        let names = sim::case_names(n);
        let unique: std::collections::HashSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "duplicate case names for {n} ranks");
    }
}

#[test]
fn a_filter_selects_cases_by_substring() {
    let mut ran = Vec::new();
    let summary = sim::run(2, Some("all_reduce/f32/sum/"), &mut |o| ran.push(o.name.clone()));
    assert_eq!(ran.len(), 5, "{ran:?}");
    assert!(ran.iter().all(|n| n.starts_with("all_reduce/f32/sum/count=")), "{ran:?}");
    assert_eq!(summary.line(), "5 passed, 0 failed, 0 skipped");
}

#[test]
fn a_world_of_no_ranks_is_a_failure_not_a_panic() {
    let summary = sim::run(0, None, &mut |_| {});
    assert_eq!((summary.passed, summary.failed), (0, 1));
}
