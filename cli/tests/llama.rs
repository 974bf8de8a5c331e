//! `chorus train --model llama` end to end without Python: bad data and
//! unsupported configs are usage errors before anything is written; a run's
//! Hugging Face directory, its checkpoint consolidated, and a run started
//! from that directory agree.

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::{chorus, npy, run_bounded, scratch, text};

fn ids_i64(rows: usize, cols: usize, vocab: usize) -> Vec<u8> {
    (0..rows * cols).flat_map(|i| (((i * 31 + i / 5) % vocab) as i64).to_le_bytes()).collect()
}

fn train(args: &[&str]) -> std::process::Output {
    run_bounded(chorus().args(["train", "--model", "llama"]).args(args), Duration::from_secs(300))
}

#[test]
fn bad_data_and_configs_are_usage_errors_before_anything_is_written() {
    let dir = scratch("llama-bad");
    let out = dir.join("out");
    let p = |n: &str| dir.join(n).display().to_string();
    npy(&dir.join("big-id.npy"), "<i8", &[16, 9], &ids_i64(16, 9, 50));
    npy(&dir.join("f32.npy"), "<f4", &[16, 9], &[0u8; 16 * 9 * 4]);
    npy(&dir.join("flat.npy"), "<i4", &[144], &[0u8; 144 * 4]);
    npy(&dir.join("few.npy"), "<u2", &[6, 9], &[0u8; 6 * 9 * 2]);
    let o = out.display().to_string();
    for (file, extra, want) in [
        ("big-id.npy", vec!["--vocab", "40"], "is not below vocab_size 40"),
        ("f32.npy", vec![], "must be uint16, uint32, int32 or int64"),
        ("flat.npy", vec![], "must be a 2-d array"),
        ("few.npy", vec![], "6 rows are fewer than one global batch of 8"),
    ] {
        let path = p(file);
        let mut args = vec!["--data", &path, "--batch", "2", "--steps", "1", "--out-dir", &o];
        args.extend(extra);
        let r = train(&args);
        assert_eq!(r.status.code(), Some(2), "{file}: {}", text(&r.stderr));
        assert!(text(&r.stderr).contains(want), "{file}: {}", text(&r.stderr));
        assert!(!out.exists(), "{file}: wrote {}", out.display());
    }
    // A config asking for what the model does not compute.
    let model = dir.join("model");
    std::fs::create_dir(&model).unwrap();
    let cfg = r#"{"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}"#;
    std::fs::write(model.join("config.json"), cfg).unwrap();
    let m = model.display().to_string();
    let r = train(&["--init-from", &m, "--data", &p("big-id.npy"), "--batch", "2", "--steps", "1", "--out-dir", &o]);
    assert_eq!(r.status.code(), Some(2), "{}", text(&r.stderr));
    assert!(text(&r.stderr).contains("`rope_scaling`"), "{}", text(&r.stderr));
    assert!(!out.exists());
    // Flags that belong to another model, or that --init-from's config.json decides.
    for (args, want) in [
        (vec!["train", "--model", "gpt", "--data", "x.npy"], "--data is for --model llama"),
        (vec!["train", "--model", "mlp", "--save-dtype", "bf16"], "--save-dtype is for --model llama"),
        (vec!["train", "--model", "llama", "--init-from", &m, "--layers", "3"], "the sizes come from --init-from"),
        (vec!["train", "--model", "llama", "--kv-heads", "3"], "--kv-heads 3 does not divide --heads 4"),
        (vec!["train", "--model", "llama", "--vocab", "20"], "smaller than the byte-level text"),
        (
            vec!["train", "--model", "llama", "--recompute", "root,blocks.0"],
            "`blocks.0`, which is no group (root, model.layers.0",
        ),
    ] {
        let r = run_bounded(chorus().args(&args).args(["--out-dir", &o]), Duration::from_secs(60));
        assert_eq!(r.status.code(), Some(2), "{args:?}: {}", text(&r.stderr));
        assert!(text(&r.stderr).contains(want), "{args:?}: {}", text(&r.stderr));
        assert!(!out.exists());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn tensors(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (name, view) in st.tensors() {
                out.push((name, view.data().to_vec()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn a_run_its_consolidated_checkpoint_and_a_run_from_its_output_agree() {
    let dir = scratch("llama-roundtrip");
    let p = |n: &str| dir.join(n).display().to_string();
    npy(&dir.join("data.npy"), "<i8", &[24, 9], &ids_i64(24, 9, 50));
    let data = p("data.npy");
    let common = ["--data", &data, "--batch", "2", "--vocab", "64"];
    let r = train(
        &[&common[..], &["--steps", "3", "--save-every", "2", "--max-file-bytes", "40K", "--out-dir", &p("a")]]
            .concat(),
    );
    assert!(r.status.success(), "{}", text(&r.stderr));
    let model = dir.join("a/model");
    assert!(model.join("model.safetensors.index.json").exists(), "split by --max-file-bytes");
    let r = run_bounded(chorus().args(["consolidate", &p("a-checkpoints"), &p("c")]), Duration::from_secs(120));
    assert!(r.status.success(), "{}", text(&r.stderr));
    let (run, consolidated) = (tensors(&model), tensors(&dir.join("c")));
    assert_eq!(run.len(), 2 + 9 * 2 + 1, "every parameter of 2 layers and an untied head");
    assert_eq!(run, consolidated, "the final checkpoint is the run's model");
    // bf16 output: half the bytes of each tensor.
    let r = run_bounded(
        chorus().args(["consolidate", &p("a-checkpoints"), &p("c16"), "--save-dtype", "bf16"]),
        Duration::from_secs(120),
    );
    assert!(r.status.success(), "{}", text(&r.stderr));
    let half = tensors(&dir.join("c16"));
    assert!(half.iter().zip(&run).all(|(h, f)| h.0 == f.0 && 2 * h.1.len() == f.1.len()));
    // The output is a model directory chorus starts from (the sizes come from its config.json).
    let r = train(&[
        "--init-from",
        &model.display().to_string(),
        "--data",
        &p("data.npy"),
        "--batch",
        "2",
        "--steps",
        "1",
        "--out-dir",
        &p("b"),
    ]);
    assert!(r.status.success(), "{}", text(&r.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Inputs, checkpoints and resumes inside the out-dir are refused before
/// anything runs (the out-dir is replaced whole when the run ends), as is a
/// `--seq-len` that disagrees with `--data`'s rows.
#[test]
fn paths_inside_the_out_dir_and_a_seq_len_against_the_data_are_refused() {
    let dir = scratch("llama-inside");
    let out = dir.join("out");
    let o = out.display().to_string();
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join(".chorus-out"), b"").unwrap();
    npy(&out.join("data.npy"), "<i8", &[16, 9], &ids_i64(16, 9, 50));
    // A real model directory inside the out-dir: a run's output, copied.
    npy(&dir.join("data.npy"), "<i8", &[16, 9], &ids_i64(16, 9, 50));
    let data = dir.join("data.npy").display().to_string();
    let src = dir.join("src").display().to_string();
    let r = train(&["--data", &data, "--vocab", "64", "--batch", "2", "--steps", "1", "--out-dir", &src]);
    assert!(r.status.success(), "{}", text(&r.stderr));
    std::fs::create_dir(out.join("model")).unwrap();
    for e in std::fs::read_dir(dir.join("src/model")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), out.join("model").join(e.file_name())).unwrap();
    }
    let inner = out.join("data.npy").display().to_string();
    let model = out.join("model").display().to_string();
    let ckpt = out.join("ckpt").display().to_string();
    for (args, flag) in [
        (vec!["--data", &inner], "--data"),
        (vec!["--init-from", &model], "--init-from"),
        (vec!["--checkpoint-dir", &ckpt], "--checkpoint-dir"),
    ] {
        let before: Vec<_> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name()).collect();
        let mut args = args.clone();
        if flag != "--data" {
            args.extend(["--data", &data]);
        }
        if flag != "--init-from" {
            args.extend(["--vocab", "64"]);
        }
        let r = train(&[&args[..], &["--batch", "2", "--steps", "1", "--out-dir", &o]].concat());
        assert_eq!(r.status.code(), Some(2), "{flag}: {}", text(&r.stderr));
        let err = text(&r.stderr);
        assert!(err.contains(&format!("{flag} ")) && err.contains("inside --out-dir"), "{err}");
        let after: Vec<_> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(before, after, "{flag}: the out-dir changed");
    }
    let r = train(&["--data", &data, "--seq-len", "16", "--batch", "2", "--steps", "1", "--out-dir", &o]);
    assert_eq!(r.status.code(), Some(2), "{}", text(&r.stderr));
    assert!(text(&r.stderr).contains("--seq-len 16: --data") && text(&r.stderr).contains("sequences of 8"));
    // The length the rows give is accepted (into another out-dir: this one
    // holds files its marker does not list, which a run never replaces).
    let ok = dir.join("ok").display().to_string();
    let r =
        train(&["--data", &data, "--vocab", "64", "--seq-len", "8", "--batch", "2", "--steps", "1", "--out-dir", &ok]);
    assert!(r.status.success(), "{}", text(&r.stderr));
    let r = train(&["--data", &data, "--vocab", "64", "--batch", "2", "--steps", "1", "--out-dir", &o]);
    assert_eq!(r.status.code(), Some(2), "{}", text(&r.stderr));
    assert!(text(&r.stderr).contains("data.npy") && out.join("data.npy").is_file(), "{}", text(&r.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap()
}

fn steps_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    v.sort();
    v
}

/// `--keep-last` prunes the Llama's checkpoints (never the one resumed
/// from; `llama-config.json` stays), and a resume refuses another
/// configuration (4 heads → 2: no tensor changes shape), other optimizer
/// settings without `--allow-optimizer-change`, and other data.
#[test]
fn keep_last_prunes_and_resume_refuses_another_configuration() {
    let dir = scratch("llama-resume");
    let p = |n: &str| dir.join(n).display().to_string();
    npy(&dir.join("data.npy"), "<i8", &[16, 9], &ids_i64(16, 9, 50));
    npy(&dir.join("other.npy"), "<i8", &[16, 9], &ids_i64(16, 9, 49));
    let (data, ckpt) = (p("data.npy"), p("ckpt"));
    let model = ["--vocab", "64", "--heads", "4", "--kv-heads", "4", "--batch", "2", "--lr", "0.01"];
    let r = train(
        &[&model[..], &["--data", &data, "--steps", "3", "--save-every", "1", "--keep-last", "2"]]
            .concat()
            .iter()
            .copied()
            .chain(["--checkpoint-dir", &ckpt, "--out-dir", &p("a")])
            .collect::<Vec<_>>(),
    );
    assert!(r.status.success(), "{}", text(&r.stderr));
    assert_eq!(steps_in(&dir.join("ckpt")), ["step-00000002", "step-00000003"]);
    assert!(dir.join("ckpt/llama-config.json").is_file());
    assert!(text(&r.stdout).contains("mean of steps") || text(&r.stdout).contains("mean of step"));
    let refused = |extra: &[&str], want: &str| {
        let out = p("refused");
        let mut args: Vec<&str> = extra.to_vec();
        args.extend(["--resume", &ckpt, "--steps", "5", "--out-dir", &out]);
        let r = train(&args);
        assert_eq!(r.status.code(), Some(2), "{extra:?}: {}", text(&r.stderr));
        assert!(text(&r.stderr).contains(want), "{extra:?}: {}", text(&r.stderr));
        assert!(!dir.join("refused").exists());
    };
    let two_heads = ["--vocab", "64", "--heads", "2", "--kv-heads", "2", "--batch", "2", "--lr", "0.01"];
    refused(&[&two_heads[..], &["--data", &data]].concat(), "num_attention_heads 4 -> 2");
    let other_lr = ["--vocab", "64", "--heads", "4", "--kv-heads", "4", "--batch", "2", "--lr", "0.02"];
    refused(&[&other_lr[..], &["--data", &data]].concat(), "--allow-optimizer-change");
    refused(&[&model[..], &["--data", &p("other.npy")]].concat(), "saved with other token rows (--data");
    // The same run resumes, saves into the same directory (its
    // llama-config.json is this run's), and keeps the checkpoint it resumed from.
    let r = train(
        &[&model[..], &["--data", &data, "--steps", "5", "--save-every", "1", "--keep-last", "1"]]
            .concat()
            .iter()
            .copied()
            .chain(["--resume", &ckpt, "--checkpoint-dir", &ckpt, "--out-dir", &p("b")])
            .collect::<Vec<_>>(),
    );
    assert!(r.status.success(), "{}", text(&r.stderr));
    assert_eq!(steps_in(&dir.join("ckpt")), ["step-00000003", "step-00000005"]);
    let s = summary(&dir.join("b"));
    assert_eq!(s["status"], "completed");
    assert_eq!(s["losses"].as_array().unwrap().len(), 5);
    assert_eq!(s["config"]["start_step"], 3);
    // Another configuration into the same checkpoint directory (no resume) is refused.
    let r = train(
        &[&two_heads[..], &["--data", &data, "--steps", "1", "--checkpoint-dir", &ckpt, "--out-dir", &p("c")]].concat(),
    );
    assert_eq!(r.status.code(), Some(2), "{}", text(&r.stderr));
    assert!(text(&r.stderr).contains("holds another run's checkpoints"), "{}", text(&r.stderr));
    assert_eq!(steps_in(&dir.join("ckpt")), ["step-00000003", "step-00000005"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A Llama whose loss becomes NaN (a NaN weight) stops with an error and
/// writes its summary marked failed and the loss curve, no model.
#[test]
fn a_nan_loss_stops_the_run_with_a_failed_summary() {
    let dir = scratch("llama-nan");
    let p = |n: &str| dir.join(n).display().to_string();
    npy(&dir.join("data.npy"), "<i8", &[16, 9], &ids_i64(16, 9, 50));
    let data = p("data.npy");
    let r = train(&["--data", &data, "--vocab", "64", "--batch", "2", "--steps", "1", "--out-dir", &p("a")]);
    assert!(r.status.success(), "{}", text(&r.stderr));
    // The trained model with a NaN in the final norm's weight.
    let file = dir.join("a/model/model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> =
        st.tensors().into_iter().map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec())).collect();
    let norm = tensors.iter_mut().find(|t| t.0 == "model.norm.weight").expect("model.norm.weight");
    norm.2[..4].copy_from_slice(&f32::NAN.to_le_bytes());
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, s, b)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap())
        })
        .collect();
    std::fs::write(&file, safetensors::tensor::serialize(views, None).unwrap()).unwrap();
    let model = dir.join("a/model").display().to_string();
    let r = train(&["--init-from", &model, "--data", &data, "--batch", "2", "--steps", "3", "--out-dir", &p("b")]);
    assert_eq!(r.status.code(), Some(1), "{}", text(&r.stderr));
    assert!(text(&r.stderr).contains("the loss became NaN"), "{}", text(&r.stderr));
    let s = summary(&dir.join("b"));
    assert_eq!(s["status"], "failed", "{s}");
    assert_eq!(s["stopped_at_step"], 0);
    assert!(dir.join("b/loss.svg").is_file());
    assert!(!dir.join("b/model").exists(), "no model from a failed run");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--text` reads any file as the transformer does (Latin-1 where it is not
/// UTF-8), and the Hugging Face output is complete; a FIFO given as
/// `--data` or `--text` is a usage error at once, not a run blocked on it.
#[test]
fn latin1_text_trains_and_fifos_are_refused() {
    let dir = scratch("llama-text");
    let out = dir.join("out");
    let o = out.display().to_string();
    let latin1: Vec<u8> = b"caf\xe9 cr\xe8me br\xfbl\xe9e, ".iter().cycle().take(2000).copied().collect();
    assert!(String::from_utf8(latin1.clone()).is_err());
    std::fs::write(dir.join("latin1.txt"), &latin1).unwrap();
    let t = dir.join("latin1.txt").display().to_string();
    let sizes = ["--hidden", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--seq-len", "8"];
    let r = train(&[&["--text", &t, "--batch", "1", "--steps", "2", "--out-dir", &o][..], &sizes[..]].concat());
    assert!(r.status.success(), "{}", text(&r.stderr));
    for f in ["config.json", "model.safetensors"] {
        assert!(out.join("model").join(f).is_file(), "{f}");
    }
    let fifo = dir.join("fifo");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let f = fifo.display().to_string();
    let o2 = dir.join("out2").display().to_string();
    for flag in ["--data", "--text"] {
        let r = run_bounded(
            chorus().args(["train", "--model", "llama", flag, &f, "--steps", "1", "--out-dir", &o2]).args(sizes),
            Duration::from_secs(60),
        );
        assert_eq!(r.status.code(), Some(2), "{flag}: {}", text(&r.stderr));
        assert!(text(&r.stderr).contains("not a regular file"), "{flag}: {}", text(&r.stderr));
        assert!(!dir.join("out2").exists());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Token rows made from `--text` by a `--tokenizer` depend on `--seq-len`:
/// a resume with another one is refused naming `--seq-len` (and the flags
/// that make the rows), not only "other data".
#[test]
fn a_resume_with_another_seq_len_names_it() {
    let dir = scratch("llama-resume-seq-len");
    let p = |n: &str| dir.join(n).display().to_string();
    let corpus: String = (0..200).map(|i| format!("the cat sat on mat {i}. it was a good mat.\n\n")).collect();
    std::fs::write(dir.join("corpus.txt"), corpus).unwrap();
    let r =
        run_bounded(
            chorus()
                .args(["tokenize", "--train-tokenizer", "--vocab-size", "300", "--tokenizer", &p("tok.json")])
                .args(["--input", &p("corpus.txt"), "--out", &p("rows.npy"), "--seq-len", "16"]),
            Duration::from_secs(300),
        );
    assert!(r.status.success(), "{}", text(&r.stderr));
    let (tok, corpus, ckpt) = (p("tok.json"), p("corpus.txt"), p("ckpt"));
    let model = ["--tokenizer", &tok, "--text", &corpus, "--layers", "1", "--hidden", "32", "--heads", "2"];
    let run = ["--world-size", "2", "--batch", "2", "--checkpoint-dir", &ckpt];
    let r = train(&[&model[..], &run, &["--seq-len", "16", "--steps", "1", "--out-dir", &p("a")]].concat());
    assert!(r.status.success(), "{}", text(&r.stderr));
    let r = train(
        &[&model[..], &run, &["--seq-len", "8", "--steps", "2", "--resume", &ckpt, "--out-dir", &p("b")]].concat(),
    );
    assert_eq!(r.status.code(), Some(2), "{}", text(&r.stderr));
    let err = text(&r.stderr);
    assert!(err.contains("--seq-len 8") && err.contains("--tokenizer"), "{err}");
    assert!(!dir.join("b").exists());
    std::fs::remove_dir_all(&dir).ok();
}
