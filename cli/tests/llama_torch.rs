//! `chorus train --model llama` against PyTorch and transformers
//! themselves: `ci/llama_torch.py make` builds a small `LlamaForCausalLM`
//! (grouped-query attention; untied, then tied head; random weights,
//! `save_pretrained`) and token data, `ci/llama_torch.py train` trains it on
//! the global batch with `torch.optim.AdamW` and `clip_grad_norm_`, chorus
//! trains the same directory on 4 simulated ranks, and every step's loss
//! (≤ 1e-4 absolute) and the final weights (`ci/llama_torch.py compare`,
//! which loads chorus's output with `from_pretrained`) must agree.
//!
//! Needs the project's Python environment (`ci/python-env.sh`): the
//! interpreter comes from `CHORUS_PYTHON` (checked by `ci/torch_python.rs`), the script from
//! `CHORUS_LLAMA_TORCH` (default `ci/llama_torch.py` in this workspace).

use crate::common;
use crate::torch_python;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{chorus, run_bounded, scratch, text};

const STEPS: usize = 6;
const GLOBAL_BATCH: usize = 8;

fn script() -> PathBuf {
    std::env::var_os("CHORUS_LLAMA_TORCH")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../ci/llama_torch.py"))
}

/// Runs `llama_torch.py` with `args` and returns its stdout; fails with its output otherwise.
fn torch<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(args: &[S]) -> String {
    let out = run_bounded(
        Command::new(torch_python::torch_python("torch, transformers")).arg(script()).args(args),
        Duration::from_secs(600),
    );
    assert!(
        out.status.success(),
        "llama_torch.py {args:?} failed: {}\nstdout: {}\nstderr: {}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

fn losses(path: &Path) -> Vec<f64> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["losses"]
        .as_array()
        .unwrap_or_else(|| panic!("{}: no losses", path.display()))
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn equal_to_pytorch(tied: bool) {
    let dir = scratch(if tied { "llama-torch-tied" } else { "llama-torch" });
    let d = |p: &str| dir.join(p).display().to_string();
    let mut make = vec!["make".to_string(), d("made"), "--seed".into(), "3".into(), "--rows".into(), "40".into()];
    make.extend(["--seq-len".to_string(), "16".into()]);
    if tied {
        make.push("--tied".into());
    }
    torch(&make);
    let (model, data) = (d("made/model"), d("made/data.npy"));
    let (steps, global) = (STEPS.to_string(), GLOBAL_BATCH.to_string());
    let hyper = ["--lr", "1e-3", "--weight-decay", "0.01", "--max-grad-norm", "1.0"];
    let mut train = vec!["train".to_string(), model.clone(), data.clone(), d("torch"), "--steps".into(), steps.clone()];
    train.extend(["--global-batch".to_string(), global]);
    train.extend(hyper.iter().map(|s| s.to_string()));
    torch(&train);
    let out = run_bounded(
        chorus()
            .args(["train", "--model", "llama", "--init-from", &model, "--data", &data, "--world-size", "4"])
            .args(["--batch", &(GLOBAL_BATCH / 4).to_string(), "--steps", &steps, "--optimizer", "adamw"])
            .args(hyper)
            .args(["--out-dir", &d("chorus")]),
        Duration::from_secs(600),
    );
    assert!(out.status.success(), "chorus train: {}\n{}", text(&out.stdout), text(&out.stderr));
    let (ours, theirs) = (losses(&dir.join("chorus/summary.json")), losses(&dir.join("torch/losses.json")));
    assert_eq!(ours.len(), STEPS, "{ours:?}");
    assert_eq!(theirs.len(), STEPS, "{theirs:?}");
    for (s, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert!((a - b).abs() <= 1e-4, "step {s}: chorus {a} vs PyTorch {b}\nchorus {ours:?}\nPyTorch {theirs:?}");
    }
    assert!(ours[STEPS - 1] < ours[0], "the loss goes down: {ours:?}");
    // from_pretrained loads chorus's directory with no key problems, and every tensor matches PyTorch's.
    let report = torch(&["compare", &d("chorus/model"), &d("torch/model"), "--atol", "1e-4"]);
    assert!(report.contains("max_abs_diff"), "{report}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "needs PyTorch and transformers (ci/python-env.sh)"]
fn llama_trains_as_pytorch_does_untied() {
    equal_to_pytorch(false);
}

#[test]
#[ignore = "needs PyTorch and transformers (ci/python-env.sh)"]
fn llama_trains_as_pytorch_does_tied() {
    equal_to_pytorch(true);
}
