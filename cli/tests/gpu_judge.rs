//! The judges of `ci/gpu-check.sh` (`ci/gpu_judge.py`) shown to pass on
//! what correct runs write and to fail on perturbed copies of it: two real
//! runs of a small Llama on 2 sim ranks (with and without `--offload`, with
//! a `--peak-tflops` so that each reports an MFU) handed to
//! `ci/test_gpu_judge.py` (standard library only: `$CHORUS_PYTHON`, else
//! `python3`; a missing Python fails the test).

use crate::common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{chorus, run_bounded, scratch, text};

fn train(out: &Path, offload: bool) {
    let mut cmd = chorus();
    cmd.args(["train", "--model", "llama", "--world-size", "2", "--batch", "2", "--seq-len", "16", "--steps", "4"])
        .args(["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--intermediate", "48"])
        .args(["--vocab", "96", "--peak-tflops", "0.001", "--out-dir"])
        .arg(out);
    if offload {
        cmd.arg("--offload");
    }
    let r = run_bounded(&mut cmd, Duration::from_secs(300));
    assert!(r.status.success(), "offload {offload}: {}", text(&r.stderr));
}

#[test]
fn every_judge_fails_on_a_perturbed_summary() {
    let dir = scratch("gpu-judge");
    train(&dir.join("plain"), false);
    train(&dir.join("offload"), true);
    let python = std::env::var("CHORUS_PYTHON").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| "python3".into());
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let r = run_bounded(
        Command::new(&python)
            .arg(root.join("ci/test_gpu_judge.py"))
            .arg("-v")
            .env("CHORUS_JUDGE_RUNS", &dir)
            .current_dir(&root),
        Duration::from_secs(300),
    );
    let said = format!("{}{}", text(&r.stdout), text(&r.stderr));
    assert!(r.status.success(), "{python} ci/test_gpu_judge.py: {said}");
    // Every test ran (none skipped).
    assert!(said.contains("Ran 14 tests") && !said.contains("skipped"), "{said}");
    std::fs::remove_dir_all(&dir).ok();
}
