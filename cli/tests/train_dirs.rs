//! Issue 24, "nothing lost" and "wrong or unclear": `chorus train`'s
//! checkpoint directories (another run's checkpoints are never mixed with
//! or overwritten without being told; a failed resume creates none), the
//! checks of its resume and size flags, `chorus consolidate`'s exit codes
//! and paths, and the help that names the Llama (the real binary, bounded).

use crate::common;

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use common::{chorus, run_bounded, scratch, text};

const LIMIT: Duration = Duration::from_secs(300);

fn run(args: &[&str]) -> Output {
    let out = run_bounded(chorus().args(args), LIMIT);
    let err = text(&out.stderr);
    assert!(!err.contains("panicked") && out.status.code().is_some(), "{args:?}: {err}");
    out
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A small transformer on 2 ranks (seconds in a debug build), then `extra`.
fn gpt(extra: &[&str]) -> Output {
    let base = ["train", "--model", "gpt", "--d-model", "32", "--layers", "1", "--seq-len", "16", "--world-size", "2"];
    run(&[&base[..], &["--batch", "4"], extra].concat())
}

/// A small Llama on 1 rank, then `extra`.
fn llama(extra: &[&str]) -> Output {
    let base = ["train", "--model", "llama", "--hidden", "16", "--layers", "1", "--heads", "2", "--kv-heads", "2"];
    run(&[&base[..], &["--seq-len", "8", "--world-size", "1", "--batch", "2"], extra].concat())
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

fn latest(ckpt: &Path) -> String {
    std::fs::read_to_string(ckpt.join("latest")).unwrap().trim().to_string()
}

/// A fresh run into run A's checkpoint directory overwrote A's step 2,
/// moved `latest` back and left A's later steps beside it: now it is
/// refused (exit 2, before training), naming them, and everything stays;
/// `--overwrite-checkpoints` starts over.
#[test]
fn a_fresh_run_refuses_another_runs_checkpoints_unless_starting_over() {
    let root = scratch("dirs-fresh");
    let ckpt = root.join("ckpt");
    let o = gpt(&["--steps", "3", "--save-every", "1", "--checkpoint-dir", s(&ckpt), "--out-dir", s(&root.join("a"))]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let before = names(&ckpt);
    assert_eq!(before, ["latest", "progress.json", "step-00000001", "step-00000002", "step-00000003"]);
    let o = gpt(&["--steps", "2", "--checkpoint-dir", s(&ckpt), "--out-dir", s(&root.join("b"))]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(err.contains("step-00000001, step-00000002, step-00000003, latest"), "{err}");
    assert!(err.contains("--overwrite-checkpoints") && err.contains("--resume"), "{err}");
    assert_eq!(names(&ckpt), before, "nothing changed");
    assert_eq!(latest(&ckpt), "step-00000003");
    assert!(!root.join("b").exists());
    // Told to start over: only this run's checkpoints are there.
    let o = gpt(&[
        "--steps",
        "2",
        "--save-every",
        "1",
        "--checkpoint-dir",
        s(&ckpt),
        "--overwrite-checkpoints",
        "--out-dir",
        s(&root.join("b")),
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(names(&ckpt), ["latest", "progress.json", "step-00000001", "step-00000002"]);
    assert_eq!(latest(&ckpt), "step-00000002");
    // Continuing it from there is no mix.
    let o = gpt(&["--steps", "3", "--resume", s(&ckpt), "--checkpoint-dir", s(&ckpt), "--out-dir", s(&root.join("c"))]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(latest(&ckpt), "step-00000003");
    let o = run(&["train", "--model", "mlp", "--steps", "1", "--overwrite-checkpoints"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    std::fs::remove_dir_all(&root).ok();
}

/// A resume that fails once training starts (a corrupt shard) leaves no
/// new checkpoint directory behind (the default `<out-dir>-checkpoints`
/// was created and left empty).
#[test]
fn a_failed_resume_creates_no_checkpoint_directory() {
    let root = scratch("dirs-resume");
    let ckpt = root.join("ckpt");
    let o = gpt(&["--steps", "2", "--checkpoint-dir", s(&ckpt), "--out-dir", s(&root.join("a"))]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let shard = ckpt.join("step-00000002").join("shard-00000-model-00001-of-00001.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let at = bytes.len() - 5;
    bytes[at] ^= 0x40;
    std::fs::write(&shard, bytes).unwrap();
    let out = root.join("b");
    let o = gpt(&["--steps", "4", "--save-every", "1", "--resume", s(&ckpt), "--out-dir", s(&out)]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("shard-00000-model"), "{}", text(&o.stderr));
    assert!(!root.join("b-checkpoints").exists(), "{:?}", names(&root));
    assert!(!out.exists());
    std::fs::remove_dir_all(&root).ok();
}

/// The other model's size flags were ignored without a word (exit 0);
/// sizes are bounded before anything is listed from them; errors name the
/// flags, and say where a derived size comes from.
#[test]
fn size_flags_are_checked_and_named() {
    let root = scratch("dirs-flags");
    let cfg = root.join("huge");
    std::fs::create_dir_all(&cfg).unwrap();
    std::fs::write(
        cfg.join("config.json"),
        r#"{"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 100000000, "num_attention_heads": 4, "num_key_value_heads": 2}"#,
    )
    .unwrap();
    std::fs::write(cfg.join("model.safetensors"), b"").unwrap();
    let out = root.join("out");
    for (args, want) in [
        // One width, two names (the transformer's and Hugging Face's), as `chorus plan` takes them.
        (vec!["--model", "llama", "--d-model", "128", "--hidden", "128"], "cannot be used multiple times"),
        (vec!["--model", "mlp", "--hidden", "128"], "--d-model (--hidden) is for --model gpt and llama"),
        (vec!["--model", "mlp", "--intermediate", "7"], "--d-ff (--intermediate) is for --model gpt and llama"),
        (vec!["--model", "mlp", "--heads", "2"], "--heads is for --model gpt and llama"),
        (vec!["--model", "llama", "--layers", "3000000"], "--layers 3000000 is more than"),
        (vec!["--model", "gpt", "--layers", "3000000"], "--layers 3000000 is more than"),
        (vec!["--model", "llama", "--hidden", "30", "--heads", "4"], "(= --hidden 30 / --heads 4) must be even"),
        (vec!["--model", "llama", "--kv-heads", "3"], "--kv-heads 3 does not divide --heads 4"),
        (vec!["--model", "llama", "--init-from", s(&cfg), "--heads", "2"], "--heads: the sizes come from"),
        (vec!["--model", "llama", "--init-from", s(&cfg)], "`num_hidden_layers` 100000000 is more than"),
    ] {
        let o = run(&[&["train"][..], &args, &["--out-dir", s(&out)]].concat());
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o.stderr));
        let err = text(&o.stderr);
        assert!(err.contains(want), "{args:?}: expected `{want}` in {err}");
        assert!(
            !err.contains("config.json: `") || args.contains(&"--init-from"),
            "{args:?}: flags are not config.json: {err}"
        );
    }
    assert!(!out.exists());
    std::fs::remove_dir_all(&root).ok();
}

/// IEEE CRC-32, as checkpoint manifests record it.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for b in bytes {
        crc ^= u32::from(*b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

/// Rewrites a checkpoint's training state with `edit`, its manifest's
/// size and checksum kept true.
fn edit_state(step: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = step.join("training_state.json");
    let mut state: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut state);
    let bytes = serde_json::to_vec(&state).unwrap();
    std::fs::write(&path, &bytes).unwrap();
    let mpath = step.join("chorus_checkpoint.json");
    let mut manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    manifest["files"]["training_state.json"] = serde_json::json!({"bytes": bytes.len(), "crc32": crc32(&bytes)});
    std::fs::write(&mpath, serde_json::to_vec(&manifest).unwrap()).unwrap();
}

/// A Llama checkpoint resumed as the transformer (and back) says which
/// model it is; one recording no model configuration, or an unreadable
/// one, is refused (it was accepted unchecked); `chorus consolidate`'s
/// "no checkpoint" errors exit 2 as `train --resume`'s do, and a dangling
/// link as its output is refused, leaving nothing beside it.
#[test]
fn resumes_name_the_model_and_consolidate_checks_its_paths() {
    let root = scratch("dirs-model");
    let (lck, gck) = (root.join("llama-ckpt"), root.join("gpt-ckpt"));
    let o = llama(&["--steps", "1", "--checkpoint-dir", s(&lck), "--out-dir", s(&root.join("l"))]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = gpt(&["--steps", "1", "--checkpoint-dir", s(&gck), "--out-dir", s(&root.join("g"))]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = s(&root.join("r")).to_string();
    let o = gpt(&["--steps", "3", "--resume", s(&lck), "--out-dir", &out]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("a Llama checkpoint: use --model llama"), "{}", text(&o.stderr));
    let o = llama(&["--steps", "3", "--resume", s(&gck), "--out-dir", &out]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("a transformer checkpoint: use --model gpt"), "{}", text(&o.stderr));
    let step = gck.join("step-00000001");
    for (edit, want) in [
        (
            Box::new(|v: &mut serde_json::Value| drop(v.as_object_mut().unwrap().remove("model")))
                as Box<dyn FnOnce(&mut serde_json::Value)>,
            "is missing",
        ),
        (Box::new(|v: &mut serde_json::Value| v["model"] = "gpt".into()), "is \"gpt\""),
    ] {
        edit_state(&step, edit);
        let o = gpt(&["--steps", "3", "--resume", s(&gck), "--out-dir", &out]);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
        let err = text(&o.stderr);
        assert!(err.contains("records no model configuration") && err.contains(want), "{err}");
    }
    assert!(!root.join("r").exists());
    // consolidate: no checkpoint there exits 2; a link to nothing is refused and nothing is left beside it.
    let o = run(&["consolidate", s(&root.join("missing")), s(&root.join("c"))]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    let dangling = root.join("dangling");
    std::os::unix::fs::symlink(root.join("nowhere"), &dangling).unwrap();
    let before = names(&root);
    let o = run(&["consolidate", s(&gck), s(&dangling)]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("symbolic link to nothing"), "{}", text(&o.stderr));
    assert_eq!(names(&root), before, "nothing written beside it");
    std::fs::remove_dir_all(&root).ok();
}

/// The help names the Llama wherever it applies.
#[test]
fn the_help_names_the_llama() {
    let top = text(&run(&["--help"]).stdout);
    assert!(top.contains("Llama"), "{top}");
    let consolidate = text(&run(&["consolidate", "--help"]).stdout);
    assert!(consolidate.contains("--model llama"), "{consolidate}");
    let train = text(&run(&["train", "--help"]).stdout);
    // Each flag's block: its line and the indented description below it.
    let block = |flag: &str| -> String {
        let start = train.find(&format!("--{flag} <")).unwrap_or_else(|| panic!("no --{flag}: {train}"));
        let rest = &train[start..];
        let end = rest[1..].find("\n      --").or_else(|| rest[1..].find("\n  -")).map_or(rest.len(), |e| e + 1);
        rest[..end].to_string()
    };
    for flag in ["layers", "heads", "text", "seq-len"] {
        assert!(block(flag).contains("llama"), "--{flag}: {}", block(flag));
    }
    assert!(train.contains("--overwrite-checkpoints"), "{train}");
}
