//! One job for `chorus train` and `chorus plan` (`cli/src/job`): a plan made
//! from the `config.toml` a run wrote predicts that run's FSDP peak to the
//! byte, and a combination one command refuses, the other refuses with the
//! same words.

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::{chorus, run_bounded, scratch, text};
use serde_json::Value;

const LIMIT: Duration = Duration::from_secs(300);

fn run(args: &[&str]) -> std::process::Output {
    let out = run_bounded(chorus().args(args), LIMIT);
    assert!(!text(&out.stderr).contains("panicked"), "{args:?}: {}", text(&out.stderr));
    out
}

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// The run and the plan of one job, for each decoder `chorus plan` plans:
/// the plan reads the run's `config.toml` (the world size, the sizes, the
/// batch, the policy; the run's own settings passed over) and its FSDP peak
/// per rank is the largest rank's `peak_memory_bytes` the run measured.
#[test]
fn a_plan_of_a_runs_config_toml_predicts_its_fsdp_peak() {
    let dir = scratch("job-peak");
    for (model, sizes) in [
        ("gpt", vec!["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16"]),
        ("llama", vec!["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--seq-len", "16"]),
    ] {
        let out = dir.join(format!("train-{model}"));
        let o = out.display().to_string();
        let common = ["--world-size", "2", "--batch", "4", "--micro-batches", "2", "--steps", "2", "--out-dir", &o];
        let r = run(&[&["train", "--model", model][..], &sizes, &common].concat());
        assert!(r.status.success(), "train {model}: {}", text(&r.stderr));
        let measured = json(&out.join("summary.json"))["peak_memory_bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .max()
            .unwrap();
        let plan_dir = dir.join(format!("plan-{model}"));
        let config = out.join("config.toml").display().to_string();
        let p = plan_dir.display().to_string();
        let r = run(&["plan", "--config", &config, "--gpu", "cpu", "--out-dir", &p]);
        assert!(r.status.success(), "plan {model}: {}", text(&r.stderr));
        let plan = json(&plan_dir.join("plan.json"));
        assert_eq!(plan["gpus"], 2, "{model}: the run's world size");
        assert_eq!(plan["model"], model);
        assert_eq!(plan["fsdp_peak_memory_bytes"].as_u64(), Some(measured), "{model}: plan {plan}");
        // The run's out-dir is the run's: the plan's went where --out-dir said.
        assert!(!out.join("plan.json").exists());
        // --gpus plans the same job at another size.
        let r = run(&["plan", "--config", &config, "--gpu", "cpu", "--gpus", "4"]);
        assert!(r.status.success(), "plan {model} at 4: {}", text(&r.stderr));
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Combinations the one validation refuses: `chorus train` and `chorus
/// plan` both exit 2 with the same message.
#[test]
fn train_and_plan_refuse_the_same_jobs() {
    let dir = scratch("job-refused");
    let o = dir.join("out").display().to_string();
    for (job, want) in [
        (vec!["--optimizer", "adamw", "--momentum", "0.9"], "--momentum is for --optimizer sgd"),
        (vec!["--model", "gpt", "--kv-heads", "2"], "--kv-heads is for --model llama"),
        (vec!["--model", "gpt", "--vocab", "256"], "--vocab is for --model llama"),
        (vec!["--model", "llama", "--layers", "2", "--recompute", "root,model.layers.2"], "model.layers.2"),
        (vec!["--world-size", "4", "--hsdp", "3"], "--hsdp 3 must divide"),
        (vec!["--all-gather-dtype", "f16"], "must be float8 or the param dtype (f32)"),
        (vec!["--model", "llama", "--dims", "4,4"], "--dims is for --model mlp"),
        (vec!["--world-size", "2", "--global-batch", "3"], "--global-batch 3 must be a positive multiple"),
    ] {
        for command in [&["train", "--steps", "1", "--out-dir", &o][..], &["plan", "--gpu", "cpu"]] {
            let r = run(&[command, &job[..]].concat());
            assert_eq!(r.status.code(), Some(2), "{command:?} {job:?}: {}", text(&r.stderr));
            assert!(text(&r.stderr).contains(want), "{command:?} {job:?}: {}", text(&r.stderr));
        }
        assert!(!Path::new(&o).exists(), "{job:?} wrote {o}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `--global-batch` gives the per-rank batch: a micro-batch count that does
/// not divide it names the global batch the user gave, not a `--batch` the
/// user never set.
#[test]
fn micro_batches_against_a_global_batch_name_the_global_batch() {
    let dir = scratch("job-global-batch");
    let o = dir.join("out").display().to_string();
    let job = ["--world-size", "2", "--global-batch", "4", "--micro-batches", "4"];
    for command in [&["train", "--steps", "1", "--out-dir", &o][..], &["plan", "--gpu", "cpu"]] {
        let r = run(&[command, &job[..]].concat());
        assert_eq!(r.status.code(), Some(2), "{command:?}: {}", text(&r.stderr));
        let err = text(&r.stderr);
        assert!(err.contains("--global-batch 4 over 2 ranks") && !err.contains("--batch 2"), "{command:?}: {err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `--min-lr` is where `--lr-decay` ends: without a decay it would do
/// nothing, so it is refused.
#[test]
fn min_lr_without_a_decay_is_refused() {
    let dir = scratch("job-min-lr");
    let o = dir.join("out").display().to_string();
    let r = run(&["train", "--model", "gpt", "--steps", "2", "--min-lr", "1e-4", "--out-dir", &o]);
    assert_eq!(r.status.code(), Some(2), "{}", text(&r.stderr));
    assert!(text(&r.stderr).contains("--min-lr 0.0001 is where --lr-decay ends"), "{}", text(&r.stderr));
    assert!(!Path::new(&o).exists());
    std::fs::remove_dir_all(&dir).ok();
}
