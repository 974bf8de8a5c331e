//! The lr of every step of `chorus train` (summary.json's `lrs`) against
//! PyTorch's `LambdaLR` with torchtitan's warmup-and-decay factor
//! (`ci/lr_schedule_torch.py`), over 100 steps, for cosine, linear and no
//! decay after a warmup.
//!
//! Needs the project's Python environment (`ci/python-env.sh`): the
//! interpreter comes from `CHORUS_PYTHON` (checked by `ci/torch_python.rs`).

use crate::common;
use crate::torch_python;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{chorus, run_bounded, scratch, text};

const STEPS: &str = "100";
const WARMUP: &str = "10";
const LR: &str = "0.002";
const MIN_LR: &str = "0.0002";

fn lrs_of(json: &serde_json::Value) -> Vec<f64> {
    json.as_array().expect("an array of lrs").iter().map(|x| x.as_f64().expect("a number")).collect()
}

#[test]
#[ignore = "needs PyTorch (ci/python-env.sh)"]
fn lrs_equal_pytorch_lambdalr_with_torchtitans_schedule() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ci/lr_schedule_torch.py");
    for decay in ["cosine", "linear", "none"] {
        let out = run_bounded(
            Command::new(torch_python::torch_python("torch")).arg(&script).args([STEPS, WARMUP, decay, LR, MIN_LR]),
            Duration::from_secs(300),
        );
        assert!(out.status.success(), "{decay}: {}", text(&out.stderr));
        let torch = lrs_of(&serde_json::from_str(&text(&out.stdout)).unwrap());
        let dir = scratch(&format!("lr-torch-{decay}"));
        // Without a decay there is no --min-lr to end at: chorus refuses the flag there.
        let min_lr: &[&str] = if decay == "none" { &[] } else { &["--min-lr", MIN_LR] };
        let run = run_bounded(
            chorus()
                .args(["train", "--model", "llama", "--world-size", "1", "--batch", "1", "--steps", STEPS])
                .args(["--layers", "1", "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--seq-len", "4"])
                .args(["--lr", LR, "--warmup-steps", WARMUP, "--lr-decay", decay])
                .args(min_lr)
                .arg("--out-dir")
                .arg(dir.join("out")),
            Duration::from_secs(600),
        );
        assert!(run.status.success(), "{decay}: {}", text(&run.stderr));
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("out/summary.json")).unwrap()).unwrap();
        let ours = lrs_of(&summary["lrs"]);
        assert_eq!(ours.len(), torch.len(), "{decay}");
        for (s, (a, b)) in ours.iter().zip(&torch).enumerate() {
            assert!((a - b).abs() <= 1e-12 * b.abs().max(1e-3), "{decay}: step {s}: chorus {a}, torch {b}");
        }
        // The schedule moved the lr: warmup from lr/11.
        assert!((torch[0] - 0.002 / 11.0).abs() < 1e-12, "{decay}: {}", torch[0]);
    }
}
