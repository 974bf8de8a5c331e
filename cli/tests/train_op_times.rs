//! `chorus train --op-times`: each fused op kind's calls and time per step
//! of rank 0 in summary.json (`op_times`) and a line after the closing one;
//! nothing of it without the flag; refused where no fused op runs, before
//! anything is written.

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::{chorus, run_bounded, scratch, text};

const TINY: [&str; 10] = ["--layers", "1", "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--vocab", "40"];

/// The kinds `chorus_kernels::timing` reports, by their summary names.
const KINDS: [&str; 10] = [
    "rms_norm",
    "rms_norm_backward",
    "rope",
    "rope_backward",
    "swiglu",
    "swiglu_backward",
    "attention",
    "attention_backward",
    "cross_entropy",
    "cross_entropy_backward",
];

const STEPS: u64 = 3;

/// A tiny Llama trained for [`STEPS`] steps on 2 ranks into `out`, then `extra`; its stdout.
fn train(out: &Path, extra: &[&str]) -> String {
    let o = run_bounded(
        chorus()
            .args(["train", "--model", "llama", "--world-size", "2", "--batch", "2", "--steps", &STEPS.to_string()])
            .args(TINY)
            .args(["--out-dir", &out.display().to_string()])
            .args(extra),
        Duration::from_secs(300),
    );
    assert!(o.status.success(), "chorus train: {}\n{}", text(&o.stdout), text(&o.stderr));
    text(&o.stdout)
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

/// The summary's `op_times`, checked for its form: every kind, the sums
/// consistent with the per-step figures.
fn op_times(summary: &serde_json::Value) -> &serde_json::Map<String, serde_json::Value> {
    let ops = &summary["op_times"];
    assert_eq!(ops["steps"].as_u64(), Some(STEPS), "{ops}");
    let kinds = ops["kinds"].as_object().unwrap_or_else(|| panic!("no kinds: {ops}"));
    let names: Vec<&str> = kinds.keys().map(String::as_str).collect();
    let mut want = KINDS.to_vec();
    want.sort();
    assert_eq!(names, want, "{ops}");
    for (name, k) in kinds {
        let (calls, time) = (k["calls"].as_u64().unwrap(), k["time_s"].as_f64().unwrap());
        let (per_step, median) = (k["calls_per_step"].as_f64().unwrap(), k["median_step_s"].as_f64().unwrap());
        assert_eq!(per_step, calls as f64 / STEPS as f64, "{name}: {k}");
        assert!(time >= 0.0 && median >= 0.0 && median <= time, "{name}: {k}");
        assert!(calls > 0 || time == 0.0, "{name} took time in no call: {k}");
    }
    kinds
}

#[test]
fn op_times_are_in_the_summary_and_the_output_only_when_asked() {
    let dir = scratch("op-times");
    let on = train(&dir.join("on"), &["--op-times"]);
    let s = summary(&dir.join("on"));
    let kinds = op_times(&s);
    assert!(kinds.values().any(|k| k["calls"].as_u64() > Some(0)), "the Llama ran no fused op: {kinds:?}");
    let line = on.lines().find(|l| l.starts_with("fused ops")).unwrap_or_else(|| panic!("no fused-ops line: {on}"));
    assert!(line.starts_with(&format!("fused ops per step (rank 0, median of {} steps)", STEPS - 1)), "{line}");

    let off = train(&dir.join("off"), &[]);
    assert!(summary(&dir.join("off"))["op_times"].is_null(), "op_times without --op-times");
    assert!(!off.contains("fused ops"), "{off}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every fused op kind the Llama calls (all of them, its loss being the
/// fused cross-entropy) has calls and time in every report.
#[test]
fn the_llama_times_every_kind_it_calls() {
    let dir = scratch("op-times-llama");
    train(&dir.join("out"), &["--op-times"]);
    let s = summary(&dir.join("out"));
    for (name, k) in op_times(&s) {
        assert!(k["calls"].as_u64() > Some(0) && k["time_s"].as_f64() > Some(0.0), "{name} never ran: {k}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn op_times_is_refused_where_no_fused_op_runs() {
    let dir = scratch("op-times-refused");
    let out = dir.join("out").display().to_string();
    for args in [
        vec!["train", "--model", "mlp", "--op-times", "--out-dir", &out],
        vec!["train", "--model", "gpt", "--bench", "--op-times"],
    ] {
        let o = run_bounded(chorus().args(&args), Duration::from_secs(60));
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o.stderr));
        assert!(
            text(&o.stderr).contains("--op-times is for training --model gpt, moe and llama"),
            "{}",
            text(&o.stderr)
        );
        assert!(!dir.join("out").exists(), "{args:?} wrote its out-dir");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
