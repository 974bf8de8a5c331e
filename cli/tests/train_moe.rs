//! `chorus train --model moe` end to end: the mixture-of-experts transformer
//! trains on sim at 1, 2 and 3 ranks and on simnccl to the same losses (each
//! rank routing its own tokens), writes every expert, resumes from its
//! checkpoints exactly, and its flags are checked before anything is written.

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::{chorus, run_bounded, scratch, text};
use serde_json::Value;

const TINY: [&str; 12] =
    ["--layers", "2", "--d-model", "16", "--d-ff", "16", "--heads", "2", "--seq-len", "6", "--experts", "4"];

fn train(out: &Path, args: &[&str]) -> std::process::Output {
    let mut cmd = chorus();
    cmd.args(["train", "--model", "moe"]).args(TINY).args(args).arg("--out-dir").arg(out);
    run_bounded(&mut cmd, Duration::from_secs(300))
}

fn summary(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap()
}

fn losses(s: &Value) -> Vec<f64> {
    serde_json::from_value(s["losses"].clone()).unwrap()
}

/// One global batch of 6 sequences at 1, 2 and 3 ranks on sim, and at 2 on
/// simnccl: the same losses within f32 rounding (the ranks' routings differ,
/// their collectives do not), and the written model holds every expert.
#[test]
fn moe_trains_alike_at_1_2_3_ranks_and_on_simnccl() {
    let dir = scratch("moe-worlds");
    let mut runs = Vec::new();
    for (backend, world, batch) in [("sim", 1, "6"), ("sim", 2, "3"), ("sim", 3, "2"), ("simnccl", 2, "3")] {
        let out = dir.join(format!("{backend}-{world}"));
        let world_arg = world.to_string();
        let args = ["--backend", backend, "--world-size", &world_arg, "--batch", batch, "--steps", "4"];
        let r = train(&out, &args);
        assert!(r.status.success(), "{backend} {world}: {}", text(&r.stderr));
        let s = summary(&out);
        assert_eq!((s["model"].as_str(), s["status"].as_str()), (Some("moe"), Some("completed")));
        assert_eq!(s["config"]["transformer"]["experts"], 4);
        let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        let model = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        // The root's three, and per block its attention (5), mlp_norm, router and 4 experts × 2.
        assert_eq!(model.len(), 3 + 2 * (5 + 2 + 4 * 2), "{backend} {world}");
        assert_eq!(model.tensor("blocks.1.experts.3.up.weight").unwrap().shape(), &[16, 16]);
        assert_eq!(model.tensor("blocks.0.router.weight").unwrap().shape(), &[4, 16]);
        runs.push((format!("{backend} {world}"), losses(&s)));
    }
    let (_, first) = &runs[0];
    assert_eq!(first.len(), 4);
    assert!(first[3] < first[0], "nothing learned: {first:?}");
    for (what, l) in &runs[1..] {
        for (a, b) in l.iter().zip(first) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{what}: {l:?} vs 1 rank's {first:?}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Four steps, or two then two more resumed from the checkpoint: the same
/// losses bit for bit (the experts' shards and AdamW state are in the
/// checkpoint like any group's). A moe checkpoint is refused to
/// `--model gpt`, and to a moe of another expert count.
#[test]
fn moe_resumes_exactly_and_refuses_another_model() {
    let dir = scratch("moe-resume");
    let common = ["--world-size", "2", "--batch", "2"];
    let straight = dir.join("straight");
    let r = train(&straight, &[&common[..], &["--steps", "4"]].concat());
    assert!(r.status.success(), "{}", text(&r.stderr));
    let (first, ckpt) = (dir.join("first"), dir.join("ckpt"));
    let ckpt_arg = ckpt.display().to_string();
    let r = train(&first, &[&common[..], &["--steps", "2", "--checkpoint-dir", &ckpt_arg]].concat());
    assert!(r.status.success(), "{}", text(&r.stderr));
    let resumed = dir.join("resumed");
    let r = train(&resumed, &[&common[..], &["--steps", "4", "--resume", &ckpt_arg]].concat());
    assert!(r.status.success(), "{}", text(&r.stderr));
    let (a, b) = (losses(&summary(&straight)), losses(&summary(&resumed)));
    assert_eq!(summary(&resumed)["config"]["start_step"], 2);
    // The resumed run's summary holds the checkpoint's two losses, then its own.
    assert_eq!((a.len(), &a), (4, &b), "resumed losses differ from the uninterrupted run's");

    let refused = dir.join("refused");
    let gpt = ["train", "--model", "gpt", "--world-size", "2", "--steps", "4", "--resume", &ckpt_arg];
    let r = run_bounded(chorus().args(gpt).arg("--out-dir").arg(&refused), Duration::from_secs(60));
    assert_eq!(r.status.code(), Some(2), "{}", text(&r.stderr));
    assert!(text(&r.stderr).contains("a mixture-of-experts checkpoint: use --model moe"), "{}", text(&r.stderr));
    let mut cmd = chorus();
    cmd.args(["train", "--model", "moe"]).args(&TINY[..10]).args(["--experts", "3"]).args(common);
    cmd.args(["--steps", "4", "--resume", &ckpt_arg, "--out-dir"]).arg(&refused);
    let r = run_bounded(&mut cmd, Duration::from_secs(60));
    assert_eq!(r.status.code(), Some(2), "{}", text(&r.stderr));
    assert!(text(&r.stderr).contains("experts 4 -> 3"), "{}", text(&r.stderr));
    assert!(!refused.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn experts_are_checked_before_anything_is_written() {
    let dir = scratch("moe-usage");
    let out = dir.join("out");
    for (args, want) in [
        (vec!["--model", "moe", "--experts", "0"], "0 experts: between 1 and 256 per layer"),
        (vec!["--model", "moe", "--experts", "257"], "257 experts: between 1 and 256 per layer"),
        (vec!["--model", "gpt", "--experts", "2"], "--experts is for --model moe"),
        (vec!["--model", "moe", "--bench"], "--bench measures --model mlp, gpt and llama, not moe"),
        (vec!["--model", "moe", "--recompute", "blocks.0.experts.4"], "which is no group"),
    ] {
        let r = run_bounded(chorus().arg("train").args(&args).arg("--out-dir").arg(&out), Duration::from_secs(60));
        assert_eq!(r.status.code(), Some(2), "{args:?}: {}", text(&r.stderr));
        assert!(text(&r.stderr).contains(want), "{args:?}: {}", text(&r.stderr));
        assert!(!out.exists(), "{args:?} wrote {}", out.display());
    }
    // An expert's group may be named, and recomputes alone.
    let r = train(
        &out,
        &["--world-size", "2", "--batch", "2", "--steps", "2", "--recompute", "blocks.0,blocks.1.experts.2"],
    );
    assert!(r.status.success(), "{}", text(&r.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}
