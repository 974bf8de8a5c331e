//! `chorus train`'s loop flags end to end: `--global-batch` is the
//! `--batch` it implies, validation (`--val-fraction`, `--val-data`,
//! `--eval-every`) lands in summary.json, `--sample-prompt` samples the
//! Llama, and bad combinations are usage errors before anything is written.

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::{chorus, npy, run_bounded, scratch, text};

/// A C-order int32 `.npy` file of `rows × cols` ids below `vocab`.
fn ids(path: &Path, rows: usize, cols: usize, vocab: usize) {
    let data: Vec<u8> = (0..rows * cols).flat_map(|i| (((i * 31 + i / 5) % vocab) as i32).to_le_bytes()).collect();
    npy(path, "<i4", &[rows, cols], &data);
}

const TINY: [&str; 10] = ["--layers", "1", "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--vocab", "40"];

fn train(args: &[&str]) -> std::process::Output {
    run_bounded(chorus().args(["train", "--model", "llama"]).args(TINY).args(args), Duration::from_secs(300))
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn global_batch_is_the_batch_it_implies() {
    let dir = scratch("loop-global-batch");
    let data = dir.join("d.npy");
    ids(&data, 32, 9, 40);
    let data = data.display().to_string();
    let (a, b) = (dir.join("a"), dir.join("b"));
    let common = ["--data", &data, "--world-size", "4", "--steps", "3"];
    let r = train(&[&common[..], &["--batch", "2", "--out-dir", &a.display().to_string()]].concat());
    assert!(r.status.success(), "{}", text(&r.stderr));
    let r = train(&[&common[..], &["--global-batch", "8", "--out-dir", &b.display().to_string()]].concat());
    assert!(r.status.success(), "{}", text(&r.stderr));
    let (sa, sb) = (summary(&a), summary(&b));
    assert_eq!(sa["losses"], sb["losses"]);
    assert_eq!(sb["config"]["batch"], 2);
    let out = dir.join("bad").display().to_string();
    for (extra, want) in [
        (vec!["--global-batch", "6"], "--global-batch 6 must be a positive multiple of the world size 4"),
        (vec!["--global-batch", "8", "--batch", "2"], "cannot be used with"),
    ] {
        let r = train(&[&common[..], &extra[..], &["--out-dir", &out]].concat());
        assert_eq!(r.status.code(), Some(2), "{extra:?}: {}", text(&r.stderr));
        assert!(text(&r.stderr).contains(want), "{extra:?}: {}", text(&r.stderr));
        assert!(!Path::new(&out).exists());
    }
}

#[test]
fn validation_losses_and_lrs_are_in_the_summary() {
    let dir = scratch("loop-val");
    let (data, val) = (dir.join("d.npy"), dir.join("v.npy"));
    ids(&data, 40, 9, 40);
    ids(&val, 8, 9, 40);
    let (data, val) = (data.display().to_string(), val.display().to_string());
    let base = ["--data", &data, "--world-size", "2", "--batch", "2", "--steps", "4", "--eval-every", "2"];
    let out = dir.join("frac");
    let r = train(&[&base[..], &["--val-fraction", "0.2", "--out-dir", &out.display().to_string()]].concat());
    assert!(r.status.success(), "{}", text(&r.stderr));
    assert!(text(&r.stdout).contains("validation loss after step 4"), "{}", text(&r.stdout));
    let s = summary(&out);
    let steps: Vec<u64> = s["val_losses"].as_array().unwrap().iter().map(|p| p[0].as_u64().unwrap()).collect();
    assert_eq!(steps, vec![2, 4]);
    assert!(s["val_losses"][1][1].as_f64().unwrap().is_finite());
    // 8 held-out rows, global batch 4: two validation batches by default.
    assert_eq!(s["config"]["val_batches"], 2);
    assert_eq!(s["lrs"].as_array().unwrap().len(), 4);
    let out = dir.join("file");
    let r = train(&[&base[..], &["--val-data", &val, "--out-dir", &out.display().to_string()]].concat());
    assert!(r.status.success(), "{}", text(&r.stderr));
    assert_eq!(summary(&out)["val_losses"].as_array().unwrap().len(), 2);

    let bad = dir.join("bad").display().to_string();
    for (extra, want) in [
        (vec!["--val-batches", "3", "--val-data", &val], "--val-batches 3 needs 12 validation rows"),
        (vec!["--val-fraction", "0.95"], "leaves 2 to train on"),
        (vec!["--val-fraction", "1.5"], "between 0 and 1"),
    ] {
        let r = train(&[&base[..], &extra[..], &["--out-dir", &bad]].concat());
        assert_eq!(r.status.code(), Some(2), "{extra:?}: {}", text(&r.stderr));
        assert!(text(&r.stderr).contains(want), "{extra:?}: {}", text(&r.stderr));
        assert!(!Path::new(&bad).exists());
    }
    let r = train(&["--steps", "2", "--eval-every", "1", "--out-dir", &bad]);
    assert_eq!(r.status.code(), Some(2));
    assert!(text(&r.stderr).contains("go with --val-data or --val-fraction"), "{}", text(&r.stderr));
    let r = run_bounded(
        chorus().args(["train", "--model", "gpt", "--steps", "2", "--val-fraction", "0.1", "--out-dir", &bad]),
        Duration::from_secs(60),
    );
    assert_eq!(r.status.code(), Some(2));
    assert!(text(&r.stderr).contains("is for --model llama"), "{}", text(&r.stderr));
}

#[test]
fn the_llama_samples_its_prompt_and_a_bad_schedule_is_refused() {
    let dir = scratch("loop-sample");
    let out = dir.join("out").display().to_string();
    let tiny_text = ["--vocab", "29", "--seq-len", "8", "--world-size", "2", "--batch", "2", "--steps", "3"];
    let r = run_bounded(
        chorus()
            .args(["train", "--model", "llama", "--layers", "1", "--hidden", "16", "--heads", "2", "--kv-heads", "1"])
            .args(tiny_text)
            .args(["--sample-prompt", "the cat", "--out-dir", &out]),
        Duration::from_secs(300),
    );
    assert!(r.status.success(), "{}", text(&r.stderr));
    let sample = summary(Path::new(&out))["sample"].as_str().unwrap().to_string();
    assert!(sample.starts_with("the cat") && sample.len() == "the cat".len() + 60, "{sample:?}");
    assert!(text(&r.stdout).contains("sample: "), "{}", text(&r.stdout));
    let bad = dir.join("bad").display().to_string();
    for (extra, want) in [
        (vec!["--warmup-steps", "5"], "--warmup-steps 5 exceeds --steps 3"),
        (vec!["--lr-decay", "cosine", "--min-lr", "1"], "--min-lr 1 must be between 0 and the lr"),
        (vec!["--lr-decay", "step"], "unknown lr decay"),
    ] {
        let r = train(&[&["--steps", "3", "--out-dir", &bad][..], &extra[..]].concat());
        assert_eq!(r.status.code(), Some(2), "{extra:?}: {}", text(&r.stderr));
        assert!(text(&r.stderr).contains(want), "{extra:?}: {}", text(&r.stderr));
        assert!(!Path::new(&bad).exists());
    }
}
