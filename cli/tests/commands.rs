//! `info`, `bench` and `conformance` end to end: the limits they check
//! before anything runs (the real binary, bounded).

use crate::common;

use std::time::Duration;

use common::{chorus, run_bounded, text};

#[test]
fn info_lists_every_backend_that_backend_accepts() {
    let out = run_bounded(chorus().arg("info"), Duration::from_secs(30));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for name in ["cpu", "sim", "simnccl"] {
        assert!(stdout.lines().any(|l| l.split_whitespace().next() == Some(name)), "no row for {name}: {stdout}");
    }
}

#[test]
fn worlds_of_threads_too_large_exit_2() {
    for args in [
        vec!["bench", "--world-size", "100000", "--max-bytes", "1K"],
        vec!["bench", "--backend", "simnccl", "--world-size", "100000", "--max-bytes", "1K"],
        vec!["conformance", "--world-size", "100000"],
        vec!["conformance", "--backend", "simnccl", "--world-size", "100000"],
        // Issue 24: a list says what a run would do, and the run is refused.
        vec!["conformance", "--world-size", "513", "--list"],
    ] {
        let out = run_bounded(chorus().args(&args), Duration::from_secs(30));
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out.stderr));
        assert!(text(&out.stderr).contains("at most 512"), "{args:?}: {}", text(&out.stderr));
    }
}

#[test]
fn bench_sizes_below_one_element_exit_2() {
    let out = run_bounded(
        chorus().args(["bench", "--min-bytes", "3", "--max-bytes", "13", "--dtype", "f64"]),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("at least 8"), "{}", text(&out.stderr));
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
}

#[test]
fn bench_says_when_it_rounds_sizes() {
    let out = run_bounded(
        chorus().args([
            "bench",
            "--world-size",
            "2",
            "--min-bytes",
            "12",
            "--max-bytes",
            "24",
            "--dtype",
            "f64",
            "--iters",
            "1",
            "--warmup",
            "0",
        ]),
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("rounded down to whole f64 elements"), "{stdout}");
    // 12 and 24 bytes are measured as 8 and 24: one and three elements.
    let sizes: Vec<&str> =
        stdout.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split_whitespace().next()).collect();
    assert_eq!(sizes, ["8", "24"], "{stdout}");
}
