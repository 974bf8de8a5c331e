//! `chorus train --model llama` end to end without Python: bad data and
//! unsupported configs are usage errors before anything is written; a run's
//! Hugging Face directory, its checkpoint consolidated, and a run started
//! from that directory agree.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{chorus, run_bounded, scratch, text};

/// A C-order `.npy` file with dtype `descr`, `shape` and raw little-endian `data`.
fn npy(path: &Path, descr: &str, shape: &[usize], data: &[u8]) {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend((header.len() as u16).to_le_bytes());
    bytes.extend(header.as_bytes());
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

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
        ("f32.npy", vec![], "must be int32, int64 or uint16"),
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
        (vec!["train", "--model", "llama", "--kv-heads", "3"], "num_key_value_heads"),
        (vec!["train", "--model", "llama", "--vocab", "20"], "smaller than the byte-level text"),
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
