//! Loading: every rank computes the box its shard covers at the current
//! world size and mesh and copies into it the parts of the saved boxes that
//! intersect it; consolidating: the same copy into whole tensors.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use chorus_collectives::CommBackend;
use chorus_devices::ComputeBackend;
use chorus_fsdp::{Fsdp, OptimizerKind, ShardedOptimizer};
use safetensors::tensor::Dtype;

use super::files::{
    consolidated_file, moment_names, shard_metadata, state_key, sync_dir, write_index, Opened, SavedBox, TensorEntry,
    INDEX, MANIFEST, TRAINING_STATE,
};
use super::geometry::{copy_box, padded_strides, strides, Region};
use super::{optimizer_json, TrainingState};
use crate::safetensors_io::{Planned, StreamWriter};
use crate::{CheckpointError, Error, Result};

/// Fills `dst` (box `want` of `name`, a tensor of `full_shape`, with
/// strides `dst_strides`) from the saved boxes of `name`, checking that they
/// fit the tensor and cover all of `want`.
fn read_into(
    ck: &mut Opened,
    boxes: &HashMap<String, Vec<SavedBox>>,
    name: &str,
    full_shape: &[usize],
    want: &Region,
    dst_strides: &[usize],
    dst: &mut [f32],
) -> Result<(), CheckpointError> {
    let saved = boxes
        .get(name)
        .ok_or_else(|| CheckpointError::MissingTensor { path: ck.dir.join(INDEX), tensor: name.to_string() })?;
    let mut covered = 0;
    for b in saved {
        let path = ck.dir.join(&b.file);
        if b.dtype != Dtype::F32 {
            return Err(CheckpointError::Mismatch {
                path,
                tensor: name.into(),
                message: format!("dtype {:?}, expected F32", b.dtype),
            });
        }
        let fits = b.region.offsets.len() == full_shape.len()
            && (0..full_shape.len()).all(|d| b.region.offsets[d] + b.region.shape[d] <= full_shape[d]);
        if !fits {
            return Err(CheckpointError::Mismatch {
                path,
                tensor: name.into(),
                message: format!(
                    "a box of shape {:?} at {:?} does not fit the model's shape {full_shape:?}",
                    b.region.shape, b.region.offsets
                ),
            });
        }
        let Some(part) = b.region.intersect(want) else { continue };
        let map = ck.map(&b.file)?;
        let bytes = map
            .get(b.data_start..b.data_end)
            .ok_or_else(|| CheckpointError::format(&path, format!("tensor `{name}`: data past the end")))?;
        let src: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        covered += copy_box(&part, &b.region, &src, want, dst_strides, dst);
    }
    if covered != want.numel() {
        return Err(CheckpointError::Coverage {
            path: ck.dir.clone(),
            tensor: name.into(),
            covered,
            needed: want.numel(),
        });
    }
    Ok(())
}

/// What a load accepts beyond an exact match.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// Continue with other optimizer settings (learning rate, momentum,
    /// betas, ε, weight decay) than the checkpoint was saved with; the kind
    /// (SGD, AdamW) and the state it keeps must stay the same.
    pub allow_optimizer_change: bool,
}

/// What a checkpoint holds, read without loading its tensors.
#[derive(Clone, Debug)]
pub struct Inspected {
    /// The `step-*` directory the path named.
    pub dir: PathBuf,
    /// Its training state.
    pub state: TrainingState,
    /// The optimizer it was saved with, as [`optimizer_json`] writes it.
    pub optimizer: serde_json::Value,
    /// Its tensors' names.
    pub tensors: Vec<String>,
}

/// The checkpoint `dir` names (a `step-*` directory or a root with
/// `latest`): its training state (checksum checked), optimizer and tensors.
pub fn inspect(dir: &Path) -> Result<Inspected, CheckpointError> {
    let mut ck = Opened::open(dir)?;
    let state = ck.training_state()?;
    Ok(Inspected {
        dir: ck.dir.clone(),
        state,
        optimizer: ck.manifest.optimizer.clone(),
        tensors: ck.manifest.tensors.iter().map(|t| t.name.clone()).collect(),
    })
}

/// How the optimizer `now` differs from `saved` (a manifest's `optimizer`):
/// `Err` when it cannot continue from that state at all (another kind, or
/// momentum turned on or off, which adds or drops the momentum buffers);
/// else each changed setting as `"lr 0.003 -> 0.01"` (empty when the same).
pub fn optimizer_changes(saved: &serde_json::Value, now: OptimizerKind) -> Result<Vec<String>, String> {
    let now_json = optimizer_json(now);
    let (saved_kind, this_kind) = (saved["kind"].as_str().unwrap_or("?"), now_json["kind"].as_str().unwrap_or("?"));
    if saved_kind != this_kind {
        return Err(format!(
            "saved with the {saved_kind} optimizer; this run uses {this_kind} (its state cannot continue)"
        ));
    }
    let moments = |momentum: f64| if momentum != 0.0 { "with" } else { "without" };
    if let (Some(a), OptimizerKind::Sgd { momentum: b, .. }) = (saved["momentum"].as_f64(), now) {
        if (a != 0.0) != (b != 0.0) {
            return Err(format!(
                "saved with SGD momentum {a}, this run uses {b}: the checkpoint has {} momentum buffers, the run needs them {}",
                moments(a),
                moments(b)
            ));
        }
    }
    let mut changes = Vec::new();
    if let Some(fields) = now_json.as_object() {
        for (key, value) in fields.iter().filter(|(k, _)| k.as_str() != "kind") {
            if saved.get(key) != Some(value) {
                let before = saved.get(key).map_or_else(|| "unset".to_string(), |v| v.to_string());
                changes.push(format!("{key} {before} -> {value}"));
            }
        }
    }
    Ok(changes)
}

/// Loads a checkpoint (`dir`: a `step-*` directory or a root with `latest`)
/// into this rank's shards and optimizer state, at whatever world size and
/// mesh `fsdp` has: each rank reads the parts of the saved boxes that
/// intersect its own shards, from memory-mapped files. Every saved tensor
/// must be a tensor of the model; the optimizer must be the one saved
/// (its settings too, unless `options` allow a change) and its state
/// complete. Call it between steps (every group idle and sharded); it does
/// not communicate. Returns the training state to continue from.
pub fn load<C: CommBackend>(
    fsdp: &mut Fsdp<C>,
    opt: &mut ShardedOptimizer<C>,
    dir: &Path,
    options: &LoadOptions,
) -> Result<TrainingState>
where
    C::B: ComputeBackend,
{
    let mut ck = Opened::open(dir)?;
    let manifest_path = ck.dir.join(MANIFEST);
    // The index is not read for the data, but it is of the checkpoint: checked like the rest.
    ck.map(INDEX)?;
    let saved_shapes: HashMap<&str, &TensorEntry> = ck.manifest.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let rank = fsdp.data_parallel().shard.rank();
    // Check the model against the manifest before reading any data.
    let mut params = Vec::new();
    for g in 0..fsdp.num_groups() {
        for (i, (name, shape)) in fsdp.group_params(g)?.into_iter().enumerate() {
            let entry = saved_shapes
                .get(name.as_str())
                .ok_or_else(|| CheckpointError::MissingTensor { path: manifest_path.clone(), tensor: name.clone() })?;
            if entry.shape != shape || entry.dtype != "F32" {
                return Err(CheckpointError::Mismatch {
                    path: manifest_path.clone(),
                    tensor: name,
                    message: format!("saved as {} {:?}, the model has F32 {shape:?}", entry.dtype, entry.shape),
                }
                .into());
            }
            params.push((g, i, name, shape, fsdp.param_layout(g, i)?));
        }
    }
    // Every saved tensor is used: one the model lacks means another model.
    let unused: Vec<&str> =
        ck.manifest.tensors.iter().map(|t| t.name.as_str()).filter(|n| !params.iter().any(|p| p.2 == *n)).collect();
    if !unused.is_empty() {
        let mut names = unused.iter().take(4).copied().collect::<Vec<_>>().join(", ");
        if unused.len() > 4 {
            names.push_str(", ...");
        }
        return Err(CheckpointError::UnusedTensors { path: manifest_path, count: unused.len(), names }.into());
    }
    let names = moment_names(opt.kind());
    match optimizer_changes(&ck.manifest.optimizer, opt.kind()) {
        Err(message) => return Err(CheckpointError::Optimizer { path: manifest_path, message }.into()),
        Ok(changes) if !changes.is_empty() && !options.allow_optimizer_change => {
            return Err(CheckpointError::Optimizer {
                path: manifest_path,
                message: format!(
                    "saved with other optimizer settings ({}); continuing with them needs an explicit allowance (chorus train --allow-optimizer-change)",
                    changes.join(", ")
                ),
            }
            .into())
        }
        Ok(_) => {}
    }
    let model_boxes = ck.boxes("model")?;
    let optim_boxes = if names.is_empty() { HashMap::new() } else { ck.boxes("optim")? };
    // After a step every parameter has its full state: a missing moment
    // (or AdamW's step) is an error, never a silent restart from zero.
    let has_state = ck.manifest.step > 0 && !names.is_empty();
    let with_step = matches!(opt.kind(), OptimizerKind::AdamW { .. });
    let mut shards = Vec::new();
    let mut states = Vec::new();
    for (g, i, name, shape, layout) in &params {
        let want = Region::of(shape, layout.as_ref(), rank);
        let len = layout.as_ref().map_or(shape.iter().product(), |l| l.shard_numel);
        let strides = padded_strides(&want, layout.as_ref());
        let mut values = vec![0.0f32; len];
        if want.numel() > 0 {
            read_into(&mut ck, &model_boxes, name, shape, &want, &strides, &mut values)?;
        }
        shards.push((*g, *i, values));
        if has_state {
            if with_step && !optim_boxes.contains_key(&state_key(name, "step")) {
                return Err(
                    CheckpointError::MissingTensor { path: ck.dir.clone(), tensor: state_key(name, "step") }.into()
                );
            }
            let mut moments = Vec::new();
            for what in names {
                let mut m = vec![0.0f32; len];
                if want.numel() > 0 {
                    read_into(&mut ck, &optim_boxes, &state_key(name, what), shape, &want, &strides, &mut m)?;
                }
                moments.push(m);
            }
            states.push((*g, *i, moments));
        }
    }
    // Every rank needs every moment, even where it holds only padding.
    if has_state {
        for (_, _, name, _, _) in &params {
            for what in names {
                let key = state_key(name, what);
                if !optim_boxes.contains_key(&key) {
                    return Err(CheckpointError::MissingTensor { path: ck.dir.clone(), tensor: key }.into());
                }
            }
        }
    }
    for (g, i, values) in shards {
        fsdp.write_shard(g, i, &values)?;
    }
    opt.load_state(fsdp, ck.manifest.step, states)?;
    let state = ck.training_state()?;
    if state.step != ck.manifest.step {
        return Err(CheckpointError::format(
            ck.dir.join(TRAINING_STATE),
            format!("step {} but the manifest says {}", state.step, ck.manifest.step),
        )
        .into());
    }
    Ok(state)
}

/// The training state of a checkpoint, without loading it.
pub fn read_training_state(dir: &Path) -> Result<TrainingState, CheckpointError> {
    Opened::open(dir)?.training_state()
}

/// A checkpoint's parameters read whole, one at a time, from its
/// memory-mapped shard files (consolidation): one full tensor in memory at
/// a time, never the model.
pub struct FullTensors {
    ck: Opened,
    boxes: HashMap<String, Vec<SavedBox>>,
}

impl FullTensors {
    /// Opens the checkpoint `dir` (a `step-*` directory or a root with `latest`).
    pub fn open(dir: &Path) -> Result<FullTensors, CheckpointError> {
        let mut ck = Opened::open(dir)?;
        let boxes = ck.boxes("model")?;
        Ok(FullTensors { ck, boxes })
    }

    /// Every parameter's name and shape, in the manifest's order.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        self.ck.manifest.tensors.iter().map(|t| (t.name.clone(), t.shape.clone())).collect()
    }

    /// The whole of the parameter `name` (row-major f32), checked to be
    /// covered by its saved boxes.
    pub fn read(&mut self, name: &str) -> Result<Vec<f32>, CheckpointError> {
        let shape =
            self.ck.manifest.tensors.iter().find(|t| t.name == name).map(|t| t.shape.clone()).ok_or_else(|| {
                CheckpointError::MissingTensor { path: self.ck.dir.join(MANIFEST), tensor: name.into() }
            })?;
        // The boxes' sizes are their files' (checked against the files'
        // lengths): a manifest shape they cannot fill is refused before
        // anything that size is allocated.
        let saved: usize = self.boxes.get(name).map_or(0, |b| b.iter().map(|b| b.region.numel()).sum());
        let needed = shape.iter().try_fold(1usize, |a, d| a.checked_mul(*d)).unwrap_or(usize::MAX);
        if needed > saved {
            return Err(CheckpointError::Coverage {
                path: self.ck.dir.clone(),
                tensor: name.into(),
                covered: saved,
                needed,
            });
        }
        let full = Region::whole(&shape);
        let mut values = vec![0.0f32; full.numel()];
        read_into(&mut self.ck, &self.boxes, name, &shape, &full, &strides(&shape), &mut values)?;
        Ok(values)
    }
}

/// The staging directory [`consolidate`] writes `out` in before renaming it
/// into place: beside `out`, named by this process (`.NAME.consolidate-PID`),
/// so it is never another run's or a file of the user's. A program that
/// can be interrupted removes it then.
pub fn consolidate_stage(out: &Path) -> PathBuf {
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = out.file_name().map_or_else(|| "consolidated".into(), |n| n.to_string_lossy().into_owned());
    parent.join(format!(".{name}.consolidate-{}", std::process::id()))
}

/// Writes the checkpoint's parameters as plain full tensors:
/// `out/model-0000i-of-0000N.safetensors` (a new file whenever one would pass
/// `max_file_bytes`) and `out/model.safetensors.index.json`, the layout
/// Hugging Face models ship in, which candle (`VarBuilder::from_mmaped_safetensors`)
/// and Python's `safetensors` load. Each file is written once, tensor by
/// tensor (one full tensor in memory at a time), into a staging directory
/// ([`consolidate_stage`]) renamed to `out`; `out` must not exist. Returns
/// the files written.
pub fn consolidate(dir: &Path, out: &Path, max_file_bytes: usize) -> Result<Vec<PathBuf>> {
    if out.exists() {
        return Err(Error::InvalidArgument(format!("{} exists; consolidate writes a new directory", out.display())));
    }
    let mut full = FullTensors::open(dir)?;
    let tensors = full.tensors();
    // Group tensors into files of at most max_file_bytes (one tensor may exceed it alone).
    let mut files: Vec<Vec<&(String, Vec<usize>)>> = vec![Vec::new()];
    let mut size = 0usize;
    for t in &tensors {
        let bytes = t.1.iter().product::<usize>().saturating_mul(4);
        if size > 0 && size.saturating_add(bytes) > max_file_bytes {
            files.push(Vec::new());
            size = 0;
        }
        size = size.saturating_add(bytes);
        if let Some(last) = files.last_mut() {
            last.push(t);
        }
    }
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let tmp = consolidate_stage(out);
    // Created new: an existing one is not this call's to replace (a fixed name here once removed whatever was there).
    std::fs::create_dir_all(parent).map_err(|e| CheckpointError::io(parent, e))?;
    std::fs::create_dir(&tmp).map_err(|e| CheckpointError::io(&tmp, e))?;
    let written = (|| -> Result<Vec<String>> {
        let n = files.len();
        let mut weight_map = BTreeMap::new();
        let mut names = Vec::new();
        let mut total = 0;
        for (k, group) in files.iter().enumerate() {
            let file = consolidated_file(k, n);
            let path = tmp.join(&file);
            let plan: Vec<Planned> =
                group.iter().map(|(n, s)| Planned { name: n.clone(), dtype: Dtype::F32, shape: s.clone() }).collect();
            let io = |e: crate::safetensors_io::WriteError| CheckpointError::io(&e.path, e.source);
            let mut w = StreamWriter::create(&path, &plan, &shard_metadata(None, None)).map_err(io)?;
            for (name, _) in group {
                let values = full.read(name)?;
                total += values.len() * 4;
                w.write_f32(&values).map_err(io)?;
                weight_map.insert(name.clone(), file.clone());
            }
            w.finish().map_err(io)?;
            names.push(file);
        }
        write_index(&tmp, total, &weight_map, None)?;
        sync_dir(&tmp)?;
        Ok(names)
    })();
    let names = match written {
        Ok(names) => names,
        Err(e) => {
            // Only what this call wrote goes.
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    std::fs::rename(&tmp, out).map_err(|e| CheckpointError::io(out, e))?;
    sync_dir(parent)?;
    Ok(names.into_iter().map(|f| out.join(f)).collect())
}
