//! What an interrupted or cut-off command leaves (issue 43): `chorus plan`
//! and `chorus train` answer the signals chorus documents (SIGUSR1: a
//! flight-recorder dump, and the run goes on; SIGINT, SIGTERM, SIGHUP: the
//! run ends as the signal would, its lock and staged out-dir removed), and
//! a closed stdout loses the report's lines, never the outputs.
//!
//! The children are started by `common::chorus()`, which sets the signals
//! these tests send to their default action in the child whatever this
//! process inherited (a suite started in the background has SIGINT ignored).

use crate::common;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{chorus, scratch, text, wait_bounded};

const LIMIT: Duration = Duration::from_secs(300);

/// A plan that takes seconds after it has locked its out-dir.
fn slow_plan(out: &Path) -> Child {
    chorus()
        .args(["plan", "--model", "llama", "--layers", "4096", "--batch", "7", "--micro-batches", "7", "--gpus", "8"])
        .arg("--out-dir")
        .arg(out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The names beside `out` (in its parent) that start with `.NAME.`: its lock and staging directories.
fn leftovers(out: &Path) -> Vec<String> {
    let prefix = format!(".{}.", out.file_name().unwrap().to_string_lossy());
    let mut found: Vec<String> = std::fs::read_dir(out.parent().unwrap())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    found.sort();
    found
}

/// Waits until `path` exists (the child still running), at most [`LIMIT`].
fn wait_for(path: &Path, child: &mut Child) {
    let start = Instant::now();
    while !path.exists() {
        assert!(child.try_wait().unwrap().is_none(), "{} never appeared: the child ended", path.display());
        assert!(start.elapsed() < LIMIT, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn signal(child: &Child, signal: libc::c_int) {
    // SAFETY: kill(2) on the pid of a child this test started and has not waited for.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, signal) }, 0);
}

/// Issue 43: SIGUSR1 killed `chorus plan --out-dir` and left its lock and
/// staging directory; SIGINT and SIGTERM left them until a later run into
/// the same out-dir (a plan into a new directory never removed them).
#[test]
fn an_interrupted_plan_leaves_nothing_and_sigusr1_does_not_end_it() {
    let dir = scratch("interrupt-plan");
    let out = dir.join("plan");
    let lock = dir.join(".plan.lock");
    let mut child = slow_plan(&out);
    wait_for(&lock, &mut child);
    signal(&child, libc::SIGUSR1);
    let r = wait_bounded(child, LIMIT);
    assert!(r.status.success(), "{:?}: {}", r.status, text(&r.stderr));
    assert!(text(&r.stderr).contains("SIGUSR1"), "answered: {}", text(&r.stderr));
    assert!(out.join("plan.json").is_file() && leftovers(&out).is_empty(), "{:?}", leftovers(&out));
    for (sig, name) in [(libc::SIGINT, "new"), (libc::SIGTERM, "new2"), (libc::SIGHUP, "plan")] {
        let target = dir.join(name);
        let mut child = slow_plan(&target);
        wait_for(&dir.join(format!(".{name}.lock")), &mut child);
        signal(&child, sig);
        let status = wait_bounded(child, LIMIT).status;
        assert_eq!(status.signal(), Some(sig), "ended by the signal: {status:?}");
        assert_eq!(leftovers(&target), Vec::<String>::new(), "signal {sig}");
    }
    assert!(!dir.join("new").exists(), "an interrupted plan writes no out-dir");
    assert!(out.join("plan.json").is_file(), "the earlier plan is kept");
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 43: `chorus plan --out-dir D | true` panicked (exit 101) and did
/// not write the plan; the plan is written, and the run succeeds.
#[test]
fn a_plan_with_a_closed_stdout_is_written() {
    let dir = scratch("interrupt-plan-stdout");
    let out = dir.join("plan");
    let mut child = chorus()
        .args(["plan", "--gpus", "8", "--out-dir"])
        .arg(&out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let r = wait_bounded(child, LIMIT);
    assert_eq!(r.status.code(), Some(0), "{}", text(&r.stderr));
    assert!(out.join("plan.json").is_file() && out.join("timeline.svg").is_file());
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 43: an interrupted `chorus train` left `.OUT.lock` and
/// `.OUT.partial-PID-*` beside its out-dir until a later run into it; the
/// signal's end removes them (and the checkpoint directory's lock).
#[test]
fn an_interrupted_train_leaves_no_lock_or_staging() {
    let dir = scratch("interrupt-train");
    let (out, ckpt) = (dir.join("out"), dir.join("ckpt"));
    for sig in [libc::SIGINT, libc::SIGTERM] {
        let mut child = chorus()
            .args(["train", "--model", "gpt", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "8"])
            .args(["--world-size", "2", "--batch", "2", "--steps", "100000"])
            .arg("--out-dir")
            .arg(&out)
            .arg("--checkpoint-dir")
            .arg(&ckpt)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_for(&dir.join(".out.lock"), &mut child);
        // Well into the steps: the staging directory made, the ranks running.
        std::thread::sleep(Duration::from_millis(500));
        let staging: Vec<PathBuf> = leftovers(&out).iter().map(|n| dir.join(n)).collect();
        assert!(staging.iter().any(|p| p.to_string_lossy().contains(".out.partial-")), "{staging:?}");
        signal(&child, sig);
        let r = wait_bounded(child, LIMIT);
        assert_eq!(r.status.signal(), Some(sig), "ended by the signal: {:?} {}", r.status, text(&r.stderr));
        assert_eq!(leftovers(&out), Vec::<String>::new(), "signal {sig}");
        assert!(!ckpt.join(".lock").exists(), "the checkpoint directory's lock");
        assert!(!out.exists());
    }
    std::fs::remove_dir_all(&dir).ok();
}
