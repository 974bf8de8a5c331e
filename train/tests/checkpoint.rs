//! Sharded safetensors checkpoints of the transformer: save at 4 ranks,
//! resume at 4 (bitwise), 3, 2 × 2 HSDP and 1 (f32 tolerance) against an
//! uninterrupted run; consolidate and load into plain candle and Python
//! (the venv's, with `--ignored`);
//! every damaged checkpoint is a typed error naming the file and tensor.

use crate::common;
use crate::torch_python;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use chorus_fsdp::OptimizerKind;
use chorus_fsdp_candle::checkpoint::{consolidate, read_training_state};
use chorus_fsdp_candle::{CheckpointError, Error};
use chorus_train::decoder::{train_sharded, Data, TrainReport as GptReport, TrainSpec};
use chorus_train::models::gpt::{init_params, Gpt, GptConfig, GptModel};
use chorus_train::text::{encode, generate, vocab_size, TextData};
use common::on_sim_ranks;

fn config() -> GptConfig {
    GptConfig { vocab: vocab_size(), d_model: 16, layers: 2, heads: 2, d_ff: 24, seq_len: 10 }
}

type GptSpec = TrainSpec<GptModel>;

fn spec(batch: usize, steps: u64) -> GptSpec {
    let cfg = config();
    let data = Arc::new(Data::Text(TextData::new(encode(&generate(3000, 2)), cfg.seq_len, 5).unwrap()));
    GptSpec {
        max_grad_norm: Some(1.0),
        collect_params: true,
        ..GptSpec::new(
            GptModel { config: cfg, init: init_params(&cfg, 11).unwrap() },
            data,
            batch,
            steps,
            OptimizerKind::adamw(1e-2, 0.01),
        )
    }
}

fn run(ranks: usize, spec: GptSpec) -> Vec<Result<GptReport, Error>> {
    let spec = Arc::new(spec);
    on_sim_ranks(ranks, move |comm| train_sharded(comm, &spec, &mut |_, _| {}))
}

fn run_ok(ranks: usize, spec: GptSpec) -> GptReport {
    run(ranks, spec).into_iter().enumerate().map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r}: {e}"))).next().unwrap()
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("chorus-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn sorted(v: &[(String, Vec<f32>)]) -> Vec<(String, Vec<f32>)> {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn max_rel_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    let (a, b) = (sorted(a), sorted(b));
    assert_eq!(a.iter().map(|x| &x.0).collect::<Vec<_>>(), b.iter().map(|x| &x.0).collect::<Vec<_>>());
    a.iter()
        .zip(&b)
        .flat_map(|(x, y)| x.1.iter().zip(&y.1).map(|(u, v)| (u - v).abs() / (1.0 + v.abs())))
        .fold(0.0, f32::max)
}

/// Global batch 12 sequences: 4 ranks × 3, 3 × 4, 2 × 2 HSDP × 3, 1 × 12.
#[test]
fn a_run_saved_at_4_ranks_resumes_at_4_3_hsdp_and_1() {
    let dir = tmpdir("resume");
    let whole = run_ok(4, spec(3, 6));
    let mut first_half = spec(3, 3);
    first_half.checkpoint_dir = Some(dir.clone());
    first_half.save_every = 3;
    let saved = run_ok(4, first_half);
    assert_eq!(saved.saved, vec![dir.join("step-00000003")]);
    assert_eq!(saved.losses, whole.losses[..3], "the first half is the same run");
    assert_eq!(std::fs::read_to_string(dir.join("latest")).unwrap().trim(), "step-00000003");
    assert_eq!(read_training_state(&dir).unwrap().step, 3);

    for (ranks, batch, replicate) in [(4, 3, None), (3, 4, None), (4, 3, Some(2)), (1, 12, None)] {
        let mut rest = spec(batch, 6);
        rest.resume = Some(dir.clone());
        rest.replicate = replicate;
        let resumed = run_ok(ranks, rest);
        assert_eq!(resumed.start_step, 3);
        assert_eq!(resumed.losses.len(), 3);
        if ranks == 4 && replicate.is_none() {
            assert_eq!(resumed.losses, whole.losses[3..], "same world size: bitwise");
            assert_eq!(sorted(&resumed.params), sorted(&whole.params), "same world size: bitwise");
        } else {
            for (a, b) in resumed.losses.iter().zip(&whole.losses[3..]) {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "{ranks} ranks: {:?} vs {:?}",
                    resumed.losses,
                    &whole.losses[3..]
                );
            }
            let d = max_rel_diff(&resumed.params, &whole.params);
            assert!(d <= 1e-5, "{ranks} ranks (hsdp {replicate:?}): parameters differ by {d}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

fn saved_checkpoint(name: &str) -> (PathBuf, GptReport) {
    let dir = tmpdir(name);
    let mut s = spec(2, 2);
    s.checkpoint_dir = Some(dir.clone());
    let report = run_ok(3, s);
    (dir, report)
}

#[test]
fn consolidated_checkpoints_load_in_plain_candle() {
    let (dir, report) = saved_checkpoint("consolidate");
    let out = dir.join("consolidated");
    // Issue 43: a directory of the user's named as consolidate's staging once was (`.tmp-NAME`) is never removed.
    std::fs::create_dir_all(dir.join(".tmp-consolidated")).unwrap();
    std::fs::write(dir.join(".tmp-consolidated/mine.txt"), "kept").unwrap();
    // A small file limit to get several files.
    let files = consolidate(&dir.join("step-00000002"), &out, 8 * 1024).unwrap();
    assert_eq!(std::fs::read_to_string(dir.join(".tmp-consolidated/mine.txt")).unwrap(), "kept");
    assert!(files.len() > 1, "{files:?}");
    assert!(out.join("model.safetensors.index.json").exists());
    assert!(consolidate(&dir, &out, 1 << 30).is_err(), "never overwrites");
    // candle's own loader, tensor by tensor.
    let mut loaded = Vec::new();
    for f in &files {
        for (name, t) in candle_core::safetensors::load(f, &Device::Cpu).unwrap() {
            loaded.push((name, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()));
        }
    }
    assert_eq!(sorted(&loaded), sorted(&report.params), "consolidated = the trained parameters");
    // An unsharded candle model built from the files computes what the
    // trained parameters compute.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, &Device::Cpu) }.unwrap();
    let from_files = Gpt::new(config(), vb).unwrap();
    let tensors = report
        .params
        .iter()
        .map(|(n, v)| {
            let shape = config().param_shapes().into_iter().find(|(m, _)| m == n).unwrap().1;
            (n.clone(), Tensor::from_vec(v.clone(), shape, &Device::Cpu).unwrap())
        })
        .collect();
    let from_report = Gpt::new(config(), VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu)).unwrap();
    let ids = Tensor::from_vec(encode("the cat sees the moon."), (2, 11), &Device::Cpu).unwrap();
    let (a, b) = (from_files.forward(&ids).unwrap(), from_report.forward(&ids).unwrap());
    assert_eq!(a.flatten_all().unwrap().to_vec1::<f32>().unwrap(), b.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
#[ignore = "needs the venv's safetensors (ci/python-env.sh)"]
fn consolidated_checkpoints_load_in_python() {
    let python = torch_python::torch_python("safetensors, numpy");
    let (dir, report) = saved_checkpoint("consolidate-python");
    let out = dir.join("consolidated");
    consolidate(&dir.join("step-00000002"), &out, 8 * 1024).unwrap();
    python_reads(&python, &out, &report);
    std::fs::remove_dir_all(&dir).ok();
}

/// Python's `safetensors` (the venv's `python`) reads the consolidated files.
fn python_reads(python: &str, out: &Path, report: &GptReport) {
    let script = r#"
import json, sys, os
from safetensors.numpy import load_file
d = sys.argv[1]
index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
sums = {}
for f in sorted(set(index["weight_map"].values())):
    for name, a in load_file(os.path.join(d, f)).items():
        assert index["weight_map"][name] == f
        sums[name] = [list(a.shape), float(a.astype("float64").sum())]
print(json.dumps(sums))
"#;
    let o = std::process::Command::new(python).args(["-c", script, out.to_str().unwrap()]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let sums: std::collections::HashMap<String, (Vec<usize>, f64)> = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(sums.len(), report.params.len());
    for (name, values) in &report.params {
        let (shape, sum) = &sums[name];
        assert_eq!(shape.iter().product::<usize>(), values.len(), "{name}");
        let ours: f64 = values.iter().map(|v| *v as f64).sum();
        assert!((sum - ours).abs() <= 1e-9 * (1.0 + ours.abs()), "{name}: python {sum} vs {ours}");
    }
}

fn resume_error(dir: &Path, spec_for: impl FnOnce(&mut GptSpec)) -> Error {
    let mut s = spec(2, 3);
    s.resume = Some(dir.to_path_buf());
    spec_for(&mut s);
    run(2, s).into_iter().next().unwrap().expect_err("a damaged checkpoint must not load")
}

fn shard0(dir: &Path) -> PathBuf {
    dir.join("step-00000002").join("shard-00000-model-00001-of-00001.safetensors")
}

#[test]
fn damaged_checkpoints_are_typed_errors_naming_file_and_tensor() {
    // Truncated.
    let (dir, _) = saved_checkpoint("truncated");
    let f = shard0(&dir);
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() - 7]).unwrap();
    match resume_error(&dir, |_| {}) {
        Error::Checkpoint(CheckpointError::Truncated { path, expected, found }) => {
            assert_eq!(path, f);
            assert_eq!((expected - found) as usize, 7);
        }
        e => panic!("expected Truncated, got {e}"),
    }
    // Corrupt: one flipped bit in the data.
    std::fs::write(&f, &bytes).unwrap();
    let mut flipped = bytes.clone();
    let last = flipped.len() - 3;
    flipped[last] ^= 0x10;
    std::fs::write(&f, &flipped).unwrap();
    match resume_error(&dir, |_| {}) {
        Error::Checkpoint(CheckpointError::Checksum { path, .. }) => assert_eq!(path, f),
        e => panic!("expected Checksum, got {e}"),
    }
    // Missing.
    std::fs::remove_file(&f).unwrap();
    match resume_error(&dir, |_| {}) {
        Error::Checkpoint(CheckpointError::MissingFile { path }) => assert_eq!(path, f),
        e => panic!("expected MissingFile, got {e}"),
    }
    std::fs::write(&f, &bytes).unwrap();
    // Another model: wider layers.
    let err = resume_error(&dir, |s| {
        s.model.config.d_ff = 32;
        s.model.init = init_params(&s.model.config, 1).unwrap();
    });
    match err {
        Error::Checkpoint(CheckpointError::Mismatch { tensor, message, .. }) => {
            assert_eq!(tensor, "blocks.0.mlp.up.weight");
            assert!(message.contains("[24, 16]") && message.contains("[32, 16]"), "{message}");
        }
        e => panic!("expected Mismatch, got {e}"),
    }
    // Another optimizer.
    match resume_error(&dir, |s| s.optimizer = OptimizerKind::sgd(0.1, 0.9)) {
        Error::Checkpoint(CheckpointError::Optimizer { message, .. }) => {
            assert!(message.contains("adamw optimizer") && message.contains("sgd"), "{message}");
        }
        e => panic!("expected an Optimizer error, got {e}"),
    }
    // Another dtype: the shard file rewritten with bf16 data, its checksum
    // updated in the manifest so that only the dtype is wrong.
    let (n, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut halves = Vec::new();
    for (name, view) in st.tensors() {
        let data: Vec<u8> = view.data().chunks_exact(4).flat_map(|c| [c[2], c[3]]).collect();
        halves.push((name, view.shape().to_vec(), data));
    }
    let views: Vec<_> = halves
        .iter()
        .map(|(name, shape, data)| {
            (name.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape.clone(), data).unwrap())
        })
        .collect();
    let _ = n;
    let rewritten = safetensors::tensor::serialize(views, meta.metadata().clone()).unwrap();
    std::fs::write(&f, &rewritten).unwrap();
    let manifest_path = dir.join("step-00000002").join("chorus_checkpoint.json");
    let mut manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest_path).unwrap()).unwrap();
    let entry = &mut manifest["files"]["shard-00000-model-00001-of-00001.safetensors"];
    entry["bytes"] = rewritten.len().into();
    entry["crc32"] = crc32(&rewritten).into();
    std::fs::write(&manifest_path, serde_json::to_string(&manifest).unwrap()).unwrap();
    match resume_error(&dir, |_| {}) {
        Error::Checkpoint(CheckpointError::Mismatch { path, tensor, message }) => {
            assert_eq!(path, f);
            assert!(
                tensor.starts_with("embed")
                    || tensor.starts_with("head")
                    || tensor.starts_with("norm")
                    || tensor.starts_with("blocks")
            );
            assert!(message.contains("BF16"), "{message}");
        }
        e => panic!("expected a dtype Mismatch, got {e}"),
    }
    // A manifest that is not JSON.
    std::fs::write(&manifest_path, b"{ not json").unwrap();
    match resume_error(&dir, |_| {}) {
        Error::Checkpoint(CheckpointError::Format { path, .. }) => assert_eq!(path, manifest_path),
        e => panic!("expected Format, got {e}"),
    }
    // No checkpoint at all: three different problems, three errors.
    let empty = tmpdir("empty");
    assert!(matches!(resume_error(&empty, |_| {}), Error::Checkpoint(CheckpointError::NotACheckpoint { .. })));
    let missing = empty.join("missing");
    assert!(matches!(resume_error(&missing, |_| {}), Error::Checkpoint(CheckpointError::NotFound { .. })));
    std::fs::write(empty.join("latest"), "step-00000007\n").unwrap();
    match resume_error(&empty, |_| {}) {
        Error::Checkpoint(CheckpointError::DanglingLatest { target, .. }) => assert_eq!(target, "step-00000007"),
        e => panic!("expected DanglingLatest, got {e}"),
    }
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_dir_all(&empty).ok();
}

/// Rewrites safetensors file `file` of checkpoint `step_dir` with only the
/// tensors `keep` accepts (its metadata as it was), and records its new
/// size and checksum in the manifest: a damaged checkpoint whose checksums
/// all pass.
fn rewrite(step_dir: &Path, file: &str, keep: impl Fn(&str) -> bool) {
    let path = step_dir.join(file);
    let bytes = std::fs::read(&path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<_> = st.tensors().into_iter().filter(|(n, _)| keep(n)).collect();
    let rewritten = safetensors::tensor::serialize(views, meta.metadata().clone()).unwrap();
    std::fs::write(&path, &rewritten).unwrap();
    record(step_dir, file, &rewritten);
}

/// Records `bytes` as the contents of `file` in the manifest of `step_dir`.
fn record(step_dir: &Path, file: &str, bytes: &[u8]) {
    let manifest_path = step_dir.join("chorus_checkpoint.json");
    let mut manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest_path).unwrap()).unwrap();
    manifest["files"][file]["bytes"] = bytes.len().into();
    manifest["files"][file]["crc32"] = crc32(bytes).into();
    std::fs::write(&manifest_path, serde_json::to_string(&manifest).unwrap()).unwrap();
}

fn optim_files(step_dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(step_dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("-optim-"))
        .collect();
    v.sort();
    v
}

/// Issue 19: a parameter whose optimizer state is missing altogether (its
/// moments and step) is an error, not a restart of its moments from zero.
#[test]
fn a_missing_optimizer_state_is_an_error() {
    let (dir, _) = saved_checkpoint("missing-state");
    let step = dir.join("step-00000002");
    for file in optim_files(&step) {
        rewrite(&step, &file, |n| !n.starts_with("state.head.weight."));
    }
    match resume_error(&dir, |_| {}) {
        Error::Checkpoint(CheckpointError::MissingTensor { tensor, .. }) => {
            assert!(tensor.starts_with("state.head.weight."), "{tensor}")
        }
        e => panic!("expected MissingTensor, got {e}"),
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 19 (DCP): each parameter's AdamW `step`, a replicated scalar, is
/// written once (by the first shard rank), as PyTorch's saver writes it,
/// so a DCP reader sees one chunk of it; the moments stay sharded.
#[test]
fn replicated_step_scalars_are_written_once() {
    let (dir, report) = saved_checkpoint("dcp-step");
    let step = dir.join("step-00000002");
    let mut count = std::collections::HashMap::<String, usize>::new();
    for file in optim_files(&step) {
        let bytes = std::fs::read(step.join(&file)).unwrap();
        for (name, _) in safetensors::SafeTensors::deserialize(&bytes).unwrap().tensors() {
            *count.entry(name).or_default() += 1;
        }
    }
    for (name, _) in &report.params {
        assert_eq!(count.get(&format!("state.{name}.step")), Some(&1), "{name}: {count:?}");
    }
    assert!(count.get("state.head.weight.exp_avg").is_some_and(|n| *n > 1), "the moments are sharded: {count:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 19: files of two saves with valid checksums (two runs sharing a
/// directory) are refused on load, naming the file.
#[test]
fn a_checkpoint_mixed_from_two_saves_is_refused() {
    let (a, _) = saved_checkpoint("mixed-a");
    let (b, _) = saved_checkpoint("mixed-b");
    let file = "shard-00001-optim-00001-of-00001.safetensors";
    let (step_a, step_b) = (a.join("step-00000002"), b.join("step-00000002"));
    let foreign = std::fs::read(step_b.join(file)).unwrap();
    std::fs::write(step_a.join(file), &foreign).unwrap();
    record(&step_a, file, &foreign);
    match resume_error(&a, |_| {}) {
        Error::Checkpoint(CheckpointError::Mixed { path, found, expected }) => {
            assert_eq!(path, step_a.join(file));
            assert_ne!(found, expected);
        }
        e => panic!("expected Mixed, got {e}"),
    }
    std::fs::remove_dir_all(&a).ok();
    std::fs::remove_dir_all(&b).ok();
}

/// Issue 19: a resume uses every saved tensor (a 2-block checkpoint does
/// not load into 1 block) and the configuration that changes no shape
/// (the heads) must match too; the optimizer's settings must match unless
/// a change is allowed.
#[test]
fn a_resume_is_refused_for_another_configuration_or_optimizer() {
    let (dir, _) = saved_checkpoint("config");
    match resume_error(&dir, |s| {
        s.model.config.layers = 1;
        s.model.init = init_params(&s.model.config, 11).unwrap();
    }) {
        Error::Checkpoint(CheckpointError::UnusedTensors { count, names, .. }) => {
            assert_eq!(count, 8, "one block's tensors");
            assert!(names.contains("blocks.1."), "{names}");
        }
        e => panic!("expected UnusedTensors, got {e}"),
    }
    match resume_error(&dir, |s| s.model.config.heads = 1) {
        Error::InvalidArgument(message) => assert!(message.contains("heads 2 -> 1"), "{message}"),
        e => panic!("expected a configuration error, got {e}"),
    }
    match resume_error(&dir, |s| s.optimizer = OptimizerKind::adamw(2e-2, 0.01)) {
        Error::Checkpoint(CheckpointError::Optimizer { message, .. }) => {
            assert!(message.contains("lr 0.01 -> 0.02"), "{message}")
        }
        e => panic!("expected an Optimizer error, got {e}"),
    }
    let mut s = spec(2, 3);
    s.resume = Some(dir.clone());
    s.optimizer = OptimizerKind::adamw(2e-2, 0.01);
    s.allow_optimizer_change = true;
    let resumed = run_ok(2, s);
    assert_eq!(resumed.start_step, 2);
    std::fs::remove_dir_all(&dir).ok();
}

/// CRC-32 (IEEE), written again here so the test does not trust the crate's.
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for b in bytes {
        c ^= *b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
        }
    }
    !c
}

/// PyTorch's own distributed-checkpoint reader (`HuggingFaceStorageReader`
/// and `dcp.load`) loads a checkpoint's shard files into full tensors: the
/// parameters are the trained ones, and each replicated `step` is one chunk.
#[test]
#[ignore = "needs PyTorch (ci/python-env.sh)"]
fn torch_dcp_loads_the_shard_files() {
    let (dir, report) = saved_checkpoint("torch-dcp");
    let script = r#"
import json, sys, warnings
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
warnings.simplefilter("ignore")
path = sys.argv[1]
md = HuggingFaceStorageReader(path).read_metadata()
sd = {k: torch.zeros(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
dcp.load(sd, storage_reader=HuggingFaceStorageReader(path), no_dist=True)
print(json.dumps({k: [list(v.shape), len(md.state_dict_metadata[k].chunks), float(v.double().sum())]
                  for k, v in sd.items()}))
"#;
    let step = dir.join("step-00000002");
    let o = std::process::Command::new(torch_python::torch_python("torch"))
        .args(["-c", script, step.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let loaded: std::collections::HashMap<String, (Vec<usize>, usize, f64)> =
        serde_json::from_slice(&o.stdout).unwrap();
    for (name, values) in &report.params {
        let (shape, _, sum) = &loaded[name];
        assert_eq!(shape.iter().product::<usize>(), values.len(), "{name}");
        let ours: f64 = values.iter().map(|v| *v as f64).sum();
        assert!((sum - ours).abs() <= 1e-6 * (1.0 + ours.abs()), "{name}: torch {sum} vs {ours}");
        let (step_shape, chunks, value) = &loaded[&format!("state.{name}.step")];
        assert!(step_shape.is_empty() && *chunks == 1 && *value == 2.0, "{name}: step {step_shape:?} {chunks} {value}");
        let (moment_shape, _, _) = &loaded[&format!("state.{name}.exp_avg")];
        assert_eq!(moment_shape, shape, "{name}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
