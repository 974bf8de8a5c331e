//! Sharded safetensors checkpoints that reshard on load, and their
//! consolidation into plain safetensors files.
//!
//! # Layout (PyTorch distributed checkpoint's, for safetensors)
//! [`save`] writes, under a root directory, one directory per checkpoint:
//!
//! ```text
//! root/step-00000040/
//!     shard-00000-model-00001-of-00001.safetensors   this shard rank's parameter boxes
//!     shard-00000-optim-00001-of-00001.safetensors   its optimizer state (exp_avg, exp_avg_sq, step; momentum_buffer)
//!     shard-00001-model-00001-of-00001.safetensors   ...one pair per shard rank
//!     model.safetensors.index.json                   {"metadata": {"total_size"}, "weight_map": {name: file}}
//!     training_state.json                            step, data seed and position
//!     chorus_checkpoint.json                         manifest: tensors, world, optimizer, every file's size and CRC-32
//! root/latest                                        "step-00000040": the last complete checkpoint
//! ```
//!
//! Each shard file is a plain safetensors file holding, for every parameter
//! of which this rank holds real rows, the unpadded box of the full tensor
//! it holds; the file's `__metadata__` records where each box starts in the
//! full tensor as PyTorch's Hugging Face storage writer does
//! (`DCP_SHARDING_INFO`: `{name: {"saved_offsets": [...]}}`, with
//! `DCP_VERSION` and `format: pt`). Replicated parameters are written whole
//! by the first shard rank; with HSDP only the first replica writes.
//!
//! # Loading at any world size and mesh
//! [`load`] lets every rank compute the box its *new* shard covers (FSDP's
//! layout over the new shard world), memory-map the shard files, and copy
//! the intersection of each saved box with its own: a checkpoint saved at 4
//! ranks loads at 3, at 2 × 2 HSDP or at 1.
//!
//! # Nothing lost
//! A save writes into a temporary directory beside the destination, syncs
//! every file and the directory, renames it into place, and only then
//! replaces `latest` (written to a temporary name, synced, renamed). A crash
//! at any point leaves the previous checkpoint and `latest` intact. The
//! manifest records each file's size and CRC-32, checked before a file is
//! used; a missing, truncated, corrupt or mismatched (another model, shape or
//! dtype) file is a [`CheckpointError`] naming the file and the tensor.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use chorus_collectives::{CommBackend, ReduceOp};
use chorus_devices::{Buffer, ComputeBackend, StreamExt};
use chorus_fsdp::layout::ParamLayout;
use chorus_fsdp::{Fsdp, OptimizerKind, ShardedOptimizer};
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};

use crate::crc32::crc32;
use crate::{CheckpointError, Error, Result};

/// Version string of [`chorus_checkpoint.json`](self).
pub const FORMAT: &str = "chorus-fsdp-checkpoint/1";
const MANIFEST: &str = "chorus_checkpoint.json";
const INDEX: &str = "model.safetensors.index.json";
const TRAINING_STATE: &str = "training_state.json";
const LATEST: &str = "latest";
const SHARDING_INFO_KEY: &str = "DCP_SHARDING_INFO";
const SAVED_OFFSETS_KEY: &str = "saved_offsets";

/// What a training loop needs to continue where it stopped (`training_state.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainingState {
    /// Steps completed: the next step to run.
    pub step: u64,
    /// The seed the data's windows are drawn from (the data RNG).
    pub data_seed: u64,
    /// The losses of the steps so far, as the loop reported them.
    #[serde(default)]
    pub losses: Vec<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct TensorEntry {
    name: String,
    shape: Vec<usize>,
    dtype: String,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct FileEntry {
    bytes: u64,
    crc32: u32,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Manifest {
    format: String,
    step: u64,
    shard_world: usize,
    replicate_world: usize,
    optimizer: serde_json::Value,
    tensors: Vec<TensorEntry>,
    files: BTreeMap<String, FileEntry>,
}

fn optimizer_json(kind: OptimizerKind) -> serde_json::Value {
    match kind {
        OptimizerKind::Sgd { lr, momentum, dampening, weight_decay, nesterov } => serde_json::json!({
            "kind": "sgd", "lr": lr, "momentum": momentum, "dampening": dampening,
            "weight_decay": weight_decay, "nesterov": nesterov,
        }),
        OptimizerKind::AdamW { lr, beta1, beta2, eps, weight_decay } => serde_json::json!({
            "kind": "adamw", "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay,
        }),
    }
}

/// The names of a parameter's optimizer-state tensors, PyTorch's
/// `state_dict` keys: momentum `momentum_buffer`; AdamW `exp_avg`, `exp_avg_sq`.
fn moment_names(kind: OptimizerKind) -> &'static [&'static str] {
    match kind {
        OptimizerKind::Sgd { momentum, .. } if momentum != 0.0 => &["momentum_buffer"],
        OptimizerKind::Sgd { .. } => &[],
        OptimizerKind::AdamW { .. } => &["exp_avg", "exp_avg_sq"],
    }
}

fn shard_file(rank: usize, what: &str) -> String {
    format!("shard-{rank:05}-{what}-00001-of-00001.safetensors")
}

// ---------------------------------------------------------------- boxes

/// A box of a tensor: where it starts in the full tensor and its extent.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Region {
    offsets: Vec<usize>,
    shape: Vec<usize>,
}

impl Region {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The box this rank holds of a parameter with `layout` (rank `rank`),
    /// or the whole tensor when it is replicated.
    fn of(shape: &[usize], layout: Option<&ParamLayout>, rank: usize) -> Region {
        match layout {
            None => Region { offsets: vec![0; shape.len()], shape: shape.to_vec() },
            Some(l) => {
                let mut offsets = vec![0; shape.len()];
                let mut ext = shape.to_vec();
                offsets[l.dim] = (rank * l.shard_rows).min(l.rows);
                ext[l.dim] = l.real_rows(rank);
                Region { offsets, shape: ext }
            }
        }
    }

    fn intersect(&self, other: &Region) -> Option<Region> {
        if self.offsets.len() != other.offsets.len() {
            return None;
        }
        let mut offsets = Vec::with_capacity(self.offsets.len());
        let mut shape = Vec::with_capacity(self.offsets.len());
        for d in 0..self.offsets.len() {
            let lo = self.offsets[d].max(other.offsets[d]);
            let hi = (self.offsets[d] + self.shape[d]).min(other.offsets[d] + other.shape[d]);
            if hi <= lo {
                return None;
            }
            offsets.push(lo);
            shape.push(hi - lo);
        }
        Some(Region { offsets, shape })
    }
}

/// Row-major strides of `shape`.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// Copies the elements of `part` (a box inside both) from `src` (the
/// elements of box `src_box`, row-major) into `dst` (the elements of box
/// `dst_box`, row-major with strides `dst_strides`), one run along the last
/// dimension at a time. Returns the elements copied.
fn copy_box(
    part: &Region,
    src_box: &Region,
    src: &[f32],
    dst_box: &Region,
    dst_strides: &[usize],
    dst: &mut [f32],
) -> usize {
    let nd = part.shape.len();
    if nd == 0 {
        if let (Some(s), Some(d)) = (src.first(), dst.first_mut()) {
            *d = *s;
            return 1;
        }
        return 0;
    }
    let src_strides = strides(&src_box.shape);
    let run = part.shape[nd - 1];
    let outer: usize = part.shape[..nd - 1].iter().product();
    let mut idx = vec![0usize; nd - 1];
    let mut copied = 0;
    for _ in 0..outer {
        let (mut s_off, mut d_off) = (0, 0);
        for d in 0..nd {
            let i = if d < nd - 1 { idx[d] } else { 0 } + part.offsets[d];
            s_off += (i - src_box.offsets[d]) * src_strides[d];
            d_off += (i - dst_box.offsets[d]) * dst_strides[d];
        }
        if let (Some(s), Some(t)) = (src.get(s_off..s_off + run), dst.get_mut(d_off..d_off + run)) {
            t.copy_from_slice(s);
            copied += run;
        }
        for d in (0..nd - 1).rev() {
            idx[d] += 1;
            if idx[d] < part.shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    copied
}

/// Cuts the unpadded box of `layout`'s rank `rank` out of its padded shard
/// (`[outer, shard_rows, inner]`).
fn unpad(shard: &[f32], layout: &ParamLayout, rank: usize) -> Vec<f32> {
    let len = layout.real_rows(rank) * layout.inner;
    let mut out = Vec::with_capacity(layout.outer * len);
    for o in 0..layout.outer {
        let start = o * layout.shard_rows * layout.inner;
        out.extend_from_slice(&shard[start..start + len]);
    }
    out
}

/// The padded-shard strides of a box (the padded shard is the box with
/// `shard_rows` instead of its real rows on the sharded dim).
fn padded_strides(region: &Region, layout: Option<&ParamLayout>) -> Vec<usize> {
    let mut shape = region.shape.clone();
    if let Some(l) = layout {
        shape[l.dim] = l.shard_rows;
    }
    strides(&shape)
}

// ---------------------------------------------------------------- files

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes `bytes` to `path`, syncs it.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = File::create(path).map_err(|e| CheckpointError::io(path, e))?;
    f.write_all(bytes).map_err(|e| CheckpointError::io(path, e))?;
    f.sync_all().map_err(|e| CheckpointError::io(path, e))
}

/// Syncs a directory (so renames and new entries in it are durable).
fn sync_dir(path: &Path) -> Result<(), CheckpointError> {
    File::open(path).and_then(|f| f.sync_all()).map_err(|e| CheckpointError::io(path, e))
}

/// Serializes named f32 tensors (name, shape, values) with sharding offsets.
fn safetensors_bytes(
    tensors: &[(String, Vec<usize>, Vec<u8>)],
    offsets: Option<&BTreeMap<String, Vec<usize>>>,
    path: &Path,
) -> Result<Vec<u8>, CheckpointError> {
    let views = tensors
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| CheckpointError::format(path, format!("tensor `{name}`: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    if let Some(offsets) = offsets {
        let info: BTreeMap<&String, serde_json::Value> =
            offsets.iter().map(|(n, o)| (n, serde_json::json!({ SAVED_OFFSETS_KEY: o }))).collect();
        meta.insert(SHARDING_INFO_KEY.to_string(), serde_json::to_string(&info).unwrap_or_default());
        meta.insert("DCP_VERSION".to_string(), "1.0".to_string());
    }
    safetensors::tensor::serialize(views, Some(meta)).map_err(|e| CheckpointError::format(path, e))
}

/// Every rank's success or failure, agreed on by all (a collective; blocks).
fn agree<C: CommBackend>(fsdp: &Fsdp<C>, ok: bool) -> Result<bool>
where
    C::B: ComputeBackend,
{
    let s = fsdp.compute_stream();
    let buf = s.buffer_from(&[if ok { 0.0f32 } else { 1.0 }]).map_err(chorus_fsdp::FsdpError::from)?;
    let dp = fsdp.data_parallel();
    dp.shard.all_reduce_in_place(buf.view(), ReduceOp::Sum, s).map_err(chorus_fsdp::FsdpError::from)?;
    if let Some(r) = &dp.replicate {
        r.all_reduce_in_place(buf.view(), ReduceOp::Sum, s).map_err(chorus_fsdp::FsdpError::from)?;
    }
    let v = s.read_vec::<f32>(buf.view()).map_err(chorus_fsdp::FsdpError::from)?;
    Ok(v.first().is_some_and(|x| *x == 0.0))
}

fn is_first_replica<C: CommBackend>(fsdp: &Fsdp<C>) -> bool {
    fsdp.data_parallel().replicate.as_ref().is_none_or(|r| r.rank() == 0)
}

fn is_global_first<C: CommBackend>(fsdp: &Fsdp<C>) -> bool {
    is_first_replica(fsdp) && fsdp.data_parallel().shard.rank() == 0
}

/// Writes this rank's shard files into `tmp` (nothing if it is not the first replica).
fn write_rank_files<C: CommBackend>(fsdp: &Fsdp<C>, opt: &ShardedOptimizer<C>, tmp: &Path) -> Result<()>
where
    C::B: ComputeBackend,
{
    if !is_first_replica(fsdp) {
        return Ok(());
    }
    let rank = fsdp.data_parallel().shard.rank();
    let first = rank == 0;
    let names = moment_names(opt.kind());
    let (mut model, mut model_offsets) = (Vec::new(), BTreeMap::new());
    let (mut optim, mut optim_offsets) = (Vec::new(), BTreeMap::new());
    for g in 0..fsdp.num_groups() {
        for (i, (name, shape)) in fsdp.group_params(g)?.into_iter().enumerate() {
            let layout = fsdp.param_layout(g, i)?;
            if layout.is_none() && !first {
                continue; // replicated: the first shard rank writes it whole
            }
            let region = Region::of(&shape, layout.as_ref(), rank);
            if region.numel() == 0 {
                continue; // trailing ranks may hold only padding
            }
            let cut = |v: Vec<f32>| match &layout {
                Some(l) => unpad(&v, l, rank),
                None => v,
            };
            model.push((name.clone(), region.shape.clone(), f32_bytes(&cut(fsdp.read_shard(g, i)?))));
            model_offsets.insert(name.clone(), region.offsets.clone());
            let moments = opt.read_state(fsdp, g, i)?;
            if moments.len() == names.len() && !moments.is_empty() {
                for (m, what) in moments.into_iter().zip(names) {
                    let key = format!("state.{name}.{what}");
                    optim.push((key.clone(), region.shape.clone(), f32_bytes(&cut(m))));
                    optim_offsets.insert(key, region.offsets.clone());
                }
                let key = format!("state.{name}.step");
                optim.push((key.clone(), vec![], f32_bytes(&[opt.steps() as f32])));
                optim_offsets.insert(key, vec![]);
            }
        }
    }
    for (what, tensors, offsets) in [("model", model, model_offsets), ("optim", optim, optim_offsets)] {
        let path = tmp.join(shard_file(rank, what));
        let bytes = safetensors_bytes(&tensors, Some(&offsets), &path)?;
        write_synced(&path, &bytes)?;
    }
    Ok(())
}

/// Saves this rank's shards and optimizer state, and (on the first rank)
/// the index, the training state and the manifest, as
/// `root/step-{state.step:08}`, then points `root/latest` at it. Every rank
/// must call it (it synchronizes the ranks); returns the checkpoint's
/// directory. See the module docs for the layout and the crash safety.
pub fn save<C: CommBackend>(
    fsdp: &Fsdp<C>,
    opt: &ShardedOptimizer<C>,
    root: &Path,
    state: &TrainingState,
) -> Result<PathBuf>
where
    C::B: ComputeBackend,
{
    let name = format!("step-{:08}", state.step);
    let dest = root.join(&name);
    let tmp = root.join(format!(".tmp-{name}"));
    let first = is_global_first(fsdp);
    // The first rank prepares the temporary directory; the others wait for it.
    let prepared = if first {
        (|| -> Result<(), CheckpointError> {
            std::fs::create_dir_all(root).map_err(|e| CheckpointError::io(root, e))?;
            if tmp.exists() {
                std::fs::remove_dir_all(&tmp).map_err(|e| CheckpointError::io(&tmp, e))?;
            }
            std::fs::create_dir(&tmp).map_err(|e| CheckpointError::io(&tmp, e))
        })()
    } else {
        Ok(())
    };
    let prepared_ok = prepared.is_ok();
    if !agree(fsdp, prepared_ok)? {
        return Err(match prepared {
            Err(e) => e.into(),
            Ok(()) => {
                Error::InvalidArgument(format!("{}: another rank could not prepare the checkpoint", tmp.display()))
            }
        });
    }
    let written = write_rank_files(fsdp, opt, &tmp);
    let written_ok = written.is_ok();
    if !agree(fsdp, written_ok)? {
        if first {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        return Err(match written {
            Err(e) => e,
            Ok(()) => Error::InvalidArgument(format!("{}: another rank failed to write its shards", tmp.display())),
        });
    }
    let finished = if first { finish_save(fsdp, opt, root, &tmp, &dest, &name, state) } else { Ok(()) };
    let finished_ok = finished.is_ok();
    if !agree(fsdp, finished_ok)? {
        if first {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        return Err(match finished {
            Err(e) => e,
            Ok(()) => {
                Error::InvalidArgument(format!("{}: the first rank failed to complete the checkpoint", dest.display()))
            }
        });
    }
    Ok(dest)
}

/// The first rank's part: index, training state, manifest with checksums,
/// then the renames.
fn finish_save<C: CommBackend>(
    fsdp: &Fsdp<C>,
    opt: &ShardedOptimizer<C>,
    root: &Path,
    tmp: &Path,
    dest: &Path,
    name: &str,
    state: &TrainingState,
) -> Result<()>
where
    C::B: ComputeBackend,
{
    let mut tensors = Vec::new();
    for g in 0..fsdp.num_groups() {
        for (n, shape) in fsdp.group_params(g)? {
            tensors.push(TensorEntry { name: n, shape, dtype: "F32".into() });
        }
    }
    // The index maps each tensor to the first shard file that holds part of it.
    let mut weight_map = BTreeMap::new();
    let mut entries: Vec<String> = std::fs::read_dir(tmp)
        .map_err(|e| CheckpointError::io(tmp, e))?
        .filter_map(|e| e.ok().and_then(|e| e.file_name().into_string().ok()))
        .collect();
    entries.sort();
    for file in entries.iter().filter(|f| f.contains("-model-")) {
        let path = tmp.join(file);
        let bytes = std::fs::read(&path).map_err(|e| CheckpointError::io(&path, e))?;
        let (_, meta) =
            safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| CheckpointError::format(&path, e))?;
        for t in meta.tensors().keys() {
            weight_map.entry(t.clone()).or_insert_with(|| file.clone());
        }
    }
    let total: usize = tensors.iter().map(|t| t.shape.iter().product::<usize>() * 4).sum();
    let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    write_synced(&tmp.join(INDEX), to_json(&index, &tmp.join(INDEX))?.as_bytes())?;
    write_synced(&tmp.join(TRAINING_STATE), to_json(state, &tmp.join(TRAINING_STATE))?.as_bytes())?;
    entries.push(INDEX.to_string());
    entries.push(TRAINING_STATE.to_string());
    let mut files = BTreeMap::new();
    for file in &entries {
        let path = tmp.join(file);
        let bytes = std::fs::read(&path).map_err(|e| CheckpointError::io(&path, e))?;
        files.insert(file.clone(), FileEntry { bytes: bytes.len() as u64, crc32: crc32(&bytes) });
    }
    let dp = fsdp.data_parallel();
    let manifest = Manifest {
        format: FORMAT.into(),
        step: state.step,
        shard_world: dp.shard.size(),
        replicate_world: dp.replicate.as_ref().map_or(1, |r| r.size()),
        optimizer: optimizer_json(opt.kind()),
        tensors,
        files,
    };
    write_synced(&tmp.join(MANIFEST), to_json(&manifest, &tmp.join(MANIFEST))?.as_bytes())?;
    sync_dir(tmp)?;
    // Replace an earlier checkpoint of the same step only once the new one is complete.
    if dest.exists() {
        let old = root.join(format!(".old-{name}"));
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(dest, &old).map_err(|e| CheckpointError::io(dest, e))?;
        std::fs::rename(tmp, dest).map_err(|e| CheckpointError::io(dest, e))?;
        let _ = std::fs::remove_dir_all(&old);
    } else {
        std::fs::rename(tmp, dest).map_err(|e| CheckpointError::io(dest, e))?;
    }
    sync_dir(root)?;
    let latest_tmp = root.join(".latest.tmp");
    write_synced(&latest_tmp, format!("{name}\n").as_bytes())?;
    std::fs::rename(&latest_tmp, root.join(LATEST)).map_err(|e| CheckpointError::io(root.join(LATEST), e))?;
    sync_dir(root)?;
    Ok(())
}

/// Pretty JSON of `v`, with errors naming the file it is for.
fn to_json<T: Serialize>(v: &T, path: &Path) -> Result<String, CheckpointError> {
    serde_json::to_string_pretty(v).map_err(|e| CheckpointError::format(path, e))
}

// ---------------------------------------------------------------- reading

/// The checkpoint directory `dir` names: `dir` itself if it holds a
/// manifest, else the one its `latest` file points to.
pub fn resolve(dir: &Path) -> Result<PathBuf, CheckpointError> {
    if dir.join(MANIFEST).exists() {
        return Ok(dir.to_path_buf());
    }
    let latest = dir.join(LATEST);
    let text = match std::fs::read_to_string(&latest) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(CheckpointError::MissingFile { path: dir.join(MANIFEST) });
        }
        Err(e) => return Err(CheckpointError::io(&latest, e)),
    };
    let name = text.trim();
    if name.is_empty() || name.contains('/') || name.contains("..") {
        return Err(CheckpointError::format(&latest, format!("`{name}` is not a checkpoint name")));
    }
    let target = dir.join(name);
    if !target.join(MANIFEST).exists() {
        return Err(CheckpointError::MissingFile { path: target.join(MANIFEST) });
    }
    Ok(target)
}

/// A checkpoint opened for reading: its manifest and, on demand, its files
/// memory-mapped and checked against their recorded size and checksum.
struct Opened {
    dir: PathBuf,
    manifest: Manifest,
    maps: HashMap<String, memmap2::Mmap>,
}

/// One saved box of a tensor.
struct SavedBox {
    file: String,
    region: Region,
    data_start: usize,
    data_end: usize,
    dtype: Dtype,
}

impl Opened {
    fn open(dir: &Path) -> Result<Opened, CheckpointError> {
        let dir = resolve(dir)?;
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path).map_err(|e| CheckpointError::io(&path, e))?;
        let manifest: Manifest = serde_json::from_str(&text).map_err(|e| CheckpointError::format(&path, e))?;
        if manifest.format != FORMAT {
            return Err(CheckpointError::format(&path, format!("format `{}`, expected `{FORMAT}`", manifest.format)));
        }
        Ok(Opened { dir, manifest, maps: HashMap::new() })
    }

    /// Maps `file` and checks its size and CRC-32 against the manifest.
    fn map(&mut self, file: &str) -> Result<&memmap2::Mmap, CheckpointError> {
        if !self.maps.contains_key(file) {
            let path = self.dir.join(file);
            let entry =
                *self.manifest.files.get(file).ok_or_else(|| {
                    CheckpointError::format(self.dir.join(MANIFEST), format!("lists no file `{file}`"))
                })?;
            let f = match File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(CheckpointError::MissingFile { path })
                }
                Err(e) => return Err(CheckpointError::io(&path, e)),
            };
            let len = f.metadata().map_err(|e| CheckpointError::io(&path, e))?.len();
            if len != entry.bytes {
                return Err(CheckpointError::Truncated { path, expected: entry.bytes, found: len });
            }
            // SAFETY: the map is read-only and checkpoint files are never
            // written in place (saves write new files and rename); a file
            // changed behind our back fails its checksum below.
            let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| CheckpointError::io(&path, e))?;
            let found = crc32(&map);
            if found != entry.crc32 {
                return Err(CheckpointError::Checksum { path, expected: entry.crc32, found });
            }
            self.maps.insert(file.to_string(), map);
        }
        self.maps.get(file).ok_or_else(|| CheckpointError::MissingFile { path: self.dir.join(file) })
    }

    fn files_with(&self, what: &str) -> Vec<String> {
        self.manifest.files.keys().filter(|f| f.contains(&format!("-{what}-"))).cloned().collect()
    }

    /// Every saved box of every tensor in the `what` ("model"/"optim") files.
    fn boxes(&mut self, what: &str) -> Result<HashMap<String, Vec<SavedBox>>, CheckpointError> {
        let mut out: HashMap<String, Vec<SavedBox>> = HashMap::new();
        for file in self.files_with(what) {
            let path = self.dir.join(&file);
            let map = self.map(&file)?;
            let (n, meta) =
                safetensors::SafeTensors::read_metadata(map).map_err(|e| CheckpointError::format(&path, e))?;
            let data_start = 8 + n;
            let info: HashMap<String, serde_json::Value> =
                match meta.metadata().as_ref().and_then(|m| m.get(SHARDING_INFO_KEY)) {
                    Some(text) => serde_json::from_str(text)
                        .map_err(|e| CheckpointError::format(&path, format!("{SHARDING_INFO_KEY}: {e}")))?,
                    None => HashMap::new(),
                };
            for (name, t) in meta.tensors() {
                let offsets: Vec<usize> = match info.get(&name).and_then(|v| v.get(SAVED_OFFSETS_KEY)) {
                    Some(v) => serde_json::from_value(v.clone())
                        .map_err(|e| CheckpointError::format(&path, format!("tensor `{name}`: saved_offsets: {e}")))?,
                    None => vec![0; t.shape.len()],
                };
                if offsets.len() != t.shape.len() {
                    return Err(CheckpointError::Mismatch {
                        path,
                        tensor: name,
                        message: format!("{} offsets for a {}-d box", offsets.len(), t.shape.len()),
                    });
                }
                out.entry(name).or_default().push(SavedBox {
                    file: file.clone(),
                    region: Region { offsets, shape: t.shape.clone() },
                    data_start: data_start + t.data_offsets.0,
                    data_end: data_start + t.data_offsets.1,
                    dtype: t.dtype,
                });
            }
        }
        Ok(out)
    }

    /// Fills `dst` (box `want` with strides `dst_strides`) from the saved boxes of `name`.
    fn read_into(
        &mut self,
        boxes: &HashMap<String, Vec<SavedBox>>,
        name: &str,
        full_shape: &[usize],
        want: &Region,
        dst_strides: &[usize],
        dst: &mut [f32],
    ) -> Result<(), CheckpointError> {
        let saved = boxes
            .get(name)
            .ok_or_else(|| CheckpointError::MissingTensor { path: self.dir.join(INDEX), tensor: name.to_string() })?;
        let mut covered = 0;
        for b in saved {
            let path = self.dir.join(&b.file);
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
            let map = self.map(&b.file)?;
            let bytes = map
                .get(b.data_start..b.data_end)
                .ok_or_else(|| CheckpointError::format(&path, format!("tensor `{name}`: data past the end")))?;
            let src: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            covered += copy_box(&part, &b.region, &src, want, dst_strides, dst);
        }
        if covered != want.numel() {
            return Err(CheckpointError::Coverage {
                path: self.dir.clone(),
                tensor: name.into(),
                covered,
                needed: want.numel(),
            });
        }
        Ok(())
    }
}

/// Loads a checkpoint (`dir`: a `step-*` directory or a root with `latest`)
/// into this rank's shards and optimizer state, at whatever world size and
/// mesh `fsdp` has: each rank reads the parts of the saved boxes that
/// intersect its own shards, from memory-mapped files. Call it between steps
/// (every group idle and sharded); it does not communicate. Returns the
/// training state to continue from.
pub fn load<C: CommBackend>(fsdp: &mut Fsdp<C>, opt: &mut ShardedOptimizer<C>, dir: &Path) -> Result<TrainingState>
where
    C::B: ComputeBackend,
{
    let mut ck = Opened::open(dir)?;
    let manifest_path = ck.dir.join(MANIFEST);
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
    let names = moment_names(opt.kind());
    let saved_kind = ck.manifest.optimizer.get("kind").and_then(|k| k.as_str()).unwrap_or("").to_string();
    let this_kind = optimizer_json(opt.kind()).get("kind").and_then(|k| k.as_str()).unwrap_or("").to_string();
    if saved_kind != this_kind {
        return Err(CheckpointError::Mismatch {
            path: manifest_path,
            tensor: "optimizer".into(),
            message: format!("saved with {saved_kind}, this run uses {this_kind}"),
        }
        .into());
    }
    let model_boxes = ck.boxes("model")?;
    let optim_boxes = if names.is_empty() { HashMap::new() } else { ck.boxes("optim")? };
    let has_state = ck.manifest.step > 0 && !names.is_empty();
    let mut shards = Vec::new();
    let mut states = Vec::new();
    for (g, i, name, shape, layout) in &params {
        let want = Region::of(shape, layout.as_ref(), rank);
        let len = layout.as_ref().map_or(shape.iter().product(), |l| l.shard_numel);
        let strides = padded_strides(&want, layout.as_ref());
        let mut values = vec![0.0f32; len];
        if want.numel() > 0 {
            ck.read_into(&model_boxes, name, shape, &want, &strides, &mut values)?;
        }
        shards.push((*g, *i, values));
        if has_state && optim_boxes.keys().any(|k| k.starts_with(&format!("state.{name}."))) {
            let mut moments = Vec::new();
            for what in names {
                let mut m = vec![0.0f32; len];
                if want.numel() > 0 {
                    ck.read_into(&optim_boxes, &format!("state.{name}.{what}"), shape, &want, &strides, &mut m)?;
                }
                moments.push(m);
            }
            states.push((*g, *i, moments));
        }
    }
    for (g, i, values) in shards {
        fsdp.write_shard(g, i, &values)?;
    }
    opt.load_state(fsdp, ck.manifest.step, states)?;
    let path = ck.dir.join(TRAINING_STATE);
    let bytes = ck.map(TRAINING_STATE)?.to_vec();
    let state: TrainingState = serde_json::from_slice(&bytes).map_err(|e| CheckpointError::format(&path, e))?;
    if state.step != ck.manifest.step {
        return Err(CheckpointError::format(
            &path,
            format!("step {} but the manifest says {}", state.step, ck.manifest.step),
        )
        .into());
    }
    Ok(state)
}

/// The training state of a checkpoint, without loading it.
pub fn read_training_state(dir: &Path) -> Result<TrainingState, CheckpointError> {
    let mut ck = Opened::open(dir)?;
    let path = ck.dir.join(TRAINING_STATE);
    let bytes = ck.map(TRAINING_STATE)?.to_vec();
    serde_json::from_slice(&bytes).map_err(|e| CheckpointError::format(&path, e))
}

/// Writes the checkpoint's parameters as plain full tensors:
/// `out/model-0000i-of-0000N.safetensors` (a new file whenever one would pass
/// `max_file_bytes`) and `out/model.safetensors.index.json`, the layout
/// Hugging Face models ship in, which candle (`VarBuilder::from_mmaped_safetensors`)
/// and Python's `safetensors` load. Written to a temporary directory and
/// renamed; `out` must not exist. Returns the files written.
pub fn consolidate(dir: &Path, out: &Path, max_file_bytes: usize) -> Result<Vec<PathBuf>> {
    if out.exists() {
        return Err(Error::InvalidArgument(format!("{} exists; consolidate writes a new directory", out.display())));
    }
    let mut ck = Opened::open(dir)?;
    let boxes = ck.boxes("model")?;
    let tensors = ck.manifest.tensors.clone();
    // Group tensors into files of at most max_file_bytes (one tensor may exceed it alone).
    let mut files: Vec<Vec<&TensorEntry>> = vec![Vec::new()];
    let mut size = 0;
    for t in &tensors {
        let bytes = t.shape.iter().product::<usize>() * 4;
        if size > 0 && size + bytes > max_file_bytes {
            files.push(Vec::new());
            size = 0;
        }
        size += bytes;
        if let Some(last) = files.last_mut() {
            last.push(t);
        }
    }
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| CheckpointError::io(parent, e))?;
    let tmp = parent.join(format!(".tmp-{}", out.file_name().and_then(|n| n.to_str()).unwrap_or("consolidated")));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| CheckpointError::io(&tmp, e))?;
    }
    std::fs::create_dir(&tmp).map_err(|e| CheckpointError::io(&tmp, e))?;
    let n = files.len();
    let mut weight_map = BTreeMap::new();
    let mut names = Vec::new();
    let mut total = 0;
    for (k, group) in files.iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
        let mut data = Vec::new();
        for t in group {
            let full = Region { offsets: vec![0; t.shape.len()], shape: t.shape.clone() };
            let mut values = vec![0.0f32; full.numel()];
            ck.read_into(&boxes, &t.name, &t.shape, &full, &strides(&t.shape), &mut values)?;
            total += values.len() * 4;
            data.push((t.name.clone(), t.shape.clone(), f32_bytes(&values)));
            weight_map.insert(t.name.clone(), file.clone());
        }
        let path = tmp.join(&file);
        write_synced(&path, &safetensors_bytes(&data, None, &path)?)?;
        names.push(file);
    }
    let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    let index_path = tmp.join(INDEX);
    write_synced(&index_path, to_json(&index, &index_path)?.as_bytes())?;
    sync_dir(&tmp)?;
    std::fs::rename(&tmp, out).map_err(|e| CheckpointError::io(out, e))?;
    sync_dir(parent)?;
    Ok(names.into_iter().map(|f| out.join(f)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host reference: element (idx) of the full tensor.
    fn full(shape: &[usize]) -> Vec<f32> {
        (0..shape.iter().product::<usize>()).map(|i| i as f32).collect()
    }

    #[test]
    fn boxes_of_any_world_reassemble_the_tensor() {
        for (shape, dim) in [(vec![7usize, 3], 0usize), (vec![4, 5, 3], 1), (vec![5], 0), (vec![3, 10], 1)] {
            let values = full(&shape);
            for saved_world in 1..=4 {
                let saved = ParamLayout::new(&shape, dim, saved_world, 0).unwrap();
                let boxes: Vec<(Region, Vec<f32>)> = (0..saved_world)
                    .map(|r| (Region::of(&shape, Some(&saved), r), unpad(&saved.shard_of(&values, r), &saved, r)))
                    .filter(|(b, _)| b.numel() > 0)
                    .collect();
                for new_world in 1..=4 {
                    let new = ParamLayout::new(&shape, dim, new_world, 0).unwrap();
                    for r in 0..new_world {
                        let want = Region::of(&shape, Some(&new), r);
                        let strides = padded_strides(&want, Some(&new));
                        let mut out = vec![0.0; new.shard_numel];
                        let mut covered = 0;
                        for (b, data) in &boxes {
                            if let Some(part) = b.intersect(&want) {
                                covered += copy_box(&part, b, data, &want, &strides, &mut out);
                            }
                        }
                        assert_eq!(covered, want.numel());
                        // The independent path: FSDP's own shard_of on the full tensor.
                        assert_eq!(
                            out,
                            new.shard_of(&values, r),
                            "{shape:?} dim {dim}: {saved_world} -> {new_world} rank {r}"
                        );
                    }
                }
            }
        }
    }
}
