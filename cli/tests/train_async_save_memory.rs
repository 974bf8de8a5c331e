//! `chorus train --async-save` and memory: the save's staged copy (one more
//! host copy of every rank's share of the parameters and optimizer state)
//! is counted in the check made before anything is allocated, and named
//! when a run does not fit; and a run holds at most one save in flight,
//! so at most one staged copy. (Where a run fits without `--async-save`
//! but not with it depends on this machine's memory: the unit tests of
//! `cli/src/train/memory.rs` check that boundary against a given memory.)

use crate::common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::{chorus, run_bounded, scratch, text, wait_bounded};

/// A transformer far larger than any machine's memory, saving at every step.
const TOO_LARGE: &str = "train --model gpt --d-model 65536 --layers 256 --world-size 2 --steps 2 --save-every 1";

#[test]
fn a_run_that_does_not_fit_names_the_staged_copy() {
    let dir = scratch("async-save-too-large");
    let run = |extra: &[&str]| {
        let o = run_bounded(
            chorus().args(TOO_LARGE.split(' ')).args(extra).arg("--out-dir").arg(dir.join("out")),
            Duration::from_secs(60),
        );
        (o.status.code(), text(&o.stderr))
    };
    let (code, stderr) = run(&["--async-save"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("this run (with about"), "{stderr}");
    assert!(stderr.contains("--async-save's staged copy"), "{stderr}");
    assert!(stderr.contains("or save without --async-save"), "{stderr}");
    // Without it the same run is refused for itself, and no copy is named.
    let (code, stderr) = run(&[]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("this run needs") && !stderr.contains("staged"), "{stderr}");
    assert!(!dir.join("out").exists(), "a refused run wrote its out-dir");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The save directories in flight in `ck` now (each save writes into its
/// own temporary directory until its commit renames it into place).
fn saves_in_flight(ck: &Path) -> usize {
    std::fs::read_dir(ck).map_or(0, |entries| {
        entries.filter_map(Result::ok).filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-step-")).count()
    })
}

/// A save at every step, each asynchronous: each must wait for the one
/// before it to be committed (its writer done, its staged copy freed)
/// before it stages its own, so the checkpoint directory never holds two
/// saves in flight; every save is complete at the end.
#[test]
fn an_asynchronous_save_at_every_step_keeps_one_save_in_flight() {
    let dir = scratch("async-save-one-in-flight");
    let (out, ck) = (dir.join("out"), dir.join("ck"));
    let steps = 24;
    let mut run = chorus();
    run.args(["train", "--model", "gpt", "--d-model", "64", "--layers", "2", "--seq-len", "32"])
        .args(["--world-size", "2", "--batch", "4", "--steps", &steps.to_string(), "--save-every", "1"])
        .args(["--async-save", "--out-dir"])
        .arg(&out)
        .arg("--checkpoint-dir")
        .arg(&ck)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = run.spawn().unwrap();
    let (mut most, mut seen) = (0, 0u64);
    let start = std::time::Instant::now();
    while !out.join("summary.json").exists() && start.elapsed() < Duration::from_secs(120) {
        let now = saves_in_flight(&ck);
        most = most.max(now);
        seen += u64::from(now > 0);
        std::thread::sleep(Duration::from_micros(200));
    }
    let o = wait_bounded(child, Duration::from_secs(60));
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(most <= 1, "{most} saves in flight at once");
    let summary: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let saves = summary["saves"].as_array().unwrap();
    assert_eq!(saves.len(), steps, "{summary}");
    let staged: Vec<u64> = saves.iter().map(|s| s["staged_bytes"].as_u64().unwrap()).collect();
    assert!(staged.iter().all(|&b| b > 0 && b == staged[0]), "{staged:?}");
    for step in 1..=steps {
        assert!(ck.join(format!("step-{step:08}")).join("chorus_checkpoint.json").is_file(), "step {step}");
    }
    assert_eq!(saves_in_flight(&ck), 0);
    eprintln!("{steps} asynchronous saves of {} bytes per rank; a save in flight in {seen} of the polls", staged[0]);
    let _ = std::fs::remove_dir_all(&dir);
}
