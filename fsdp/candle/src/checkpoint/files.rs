//! The files of a checkpoint: their names, the manifest and the index,
//! safetensors with PyTorch's sharding metadata, writing durably (synced
//! files, synced directories) and reading through memory maps checked
//! against the manifest's sizes and checksums.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use chorus_fsdp::OptimizerKind;
use safetensors::tensor::Dtype;
use serde::{Deserialize, Serialize};

use super::geometry::Region;
use super::{TrainingState, FORMAT};
use crate::crc32::crc32;
use crate::CheckpointError;

pub(super) use super::place::replace_dir;

pub(super) const MANIFEST: &str = "chorus_checkpoint.json";
pub(super) const INDEX: &str = "model.safetensors.index.json";
pub(super) const TRAINING_STATE: &str = "training_state.json";
pub(super) const LATEST: &str = "latest";
const SHARDING_INFO_KEY: &str = "DCP_SHARDING_INFO";
/// The key of a save's identity: in every safetensors file's `__metadata__`,
/// the index's `metadata`, the training state and the manifest.
pub(super) const SAVE_ID_KEY: &str = "chorus_save_id";
const SAVED_OFFSETS_KEY: &str = "saved_offsets";

/// A tensor of the model, as the manifest lists it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct TensorEntry {
    pub(super) name: String,
    pub(super) shape: Vec<usize>,
    pub(super) dtype: String,
}

/// A file's size and checksum, as the manifest records them.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub(super) struct FileEntry {
    pub(super) bytes: u64,
    pub(super) crc32: u32,
}

/// `chorus_checkpoint.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Manifest {
    pub(super) format: String,
    pub(super) step: u64,
    pub(super) shard_world: usize,
    pub(super) replicate_world: usize,
    pub(super) optimizer: serde_json::Value,
    pub(super) tensors: Vec<TensorEntry>,
    pub(super) files: BTreeMap<String, FileEntry>,
    /// The save that wrote every file (absent in checkpoints written before
    /// save identities were recorded: their files are not cross-checked).
    #[serde(default, rename = "chorus_save_id", skip_serializing_if = "Option::is_none")]
    pub(super) save_id: Option<String>,
}

/// `training_state.json`: the training state and the save that wrote it.
#[derive(Serialize, Deserialize)]
pub(super) struct StoredState {
    #[serde(flatten)]
    pub(super) state: TrainingState,
    #[serde(default, rename = "chorus_save_id", skip_serializing_if = "Option::is_none")]
    pub(super) save_id: Option<String>,
}

/// A fresh identity for one save: 64 bits from the standard library's
/// randomly keyed hasher, the time and the process id (the first rank draws
/// it; every rank writes it into its files).
pub(super) fn new_save_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.finish()
}

/// A save identity as the files record it.
pub(super) fn save_id_text(id: u64) -> String {
    format!("{id:016x}")
}

/// The names of a parameter's optimizer-state tensors, PyTorch's
/// `state_dict` keys: momentum `momentum_buffer`; AdamW `exp_avg`, `exp_avg_sq`.
pub(super) fn moment_names(kind: OptimizerKind) -> &'static [&'static str] {
    match kind {
        OptimizerKind::Sgd { momentum, .. } if momentum != 0.0 => &["momentum_buffer"],
        OptimizerKind::Sgd { .. } => &[],
        OptimizerKind::AdamW { .. } => &["exp_avg", "exp_avg_sq"],
    }
}

/// The key of optimizer state `what` of parameter `param` in the optim files.
pub(super) fn state_key(param: &str, what: &str) -> String {
    format!("state.{param}.{what}")
}

/// The file of shard rank `rank`'s `what` ("model"/"optim") tensors.
pub(super) fn shard_file(rank: usize, what: &str) -> String {
    format!("shard-{rank:05}-{what}-00001-of-00001.safetensors")
}

/// File `k` (from 0) of `n` of a consolidated model.
pub(super) fn consolidated_file(k: usize, n: usize) -> String {
    format!("model-{:05}-of-{n:05}.safetensors", k + 1)
}

// ---------------------------------------------------------------- writing

/// Writes `bytes` to `path`, syncs it.
pub(super) fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = File::create(path).map_err(|e| CheckpointError::io(path, e))?;
    f.write_all(bytes).map_err(|e| CheckpointError::io(path, e))?;
    f.sync_all().map_err(|e| CheckpointError::io(path, e))
}

/// Writes `v` to `path` as pretty JSON, synced.
pub(super) fn write_json<T: Serialize>(path: &Path, v: &T) -> Result<(), CheckpointError> {
    let text = serde_json::to_string_pretty(v).map_err(|e| CheckpointError::format(path, e))?;
    write_synced(path, text.as_bytes())
}

/// Writes `dir/model.safetensors.index.json`, Hugging Face's map from each
/// tensor to the file that holds it (with the save's identity, if any, in
/// its `metadata`).
pub(super) fn write_index(
    dir: &Path,
    total_size: usize,
    weight_map: &BTreeMap<String, String>,
    save_id: Option<&str>,
) -> Result<(), CheckpointError> {
    let mut metadata = serde_json::json!({ "total_size": total_size });
    if let Some(id) = save_id {
        metadata[SAVE_ID_KEY] = id.into();
    }
    let index = serde_json::json!({ "metadata": metadata, "weight_map": weight_map });
    write_json(&dir.join(INDEX), &index)
}

/// Syncs a directory (so renames and new entries in it are durable).
pub(super) fn sync_dir(path: &Path) -> Result<(), CheckpointError> {
    File::open(path).and_then(|f| f.sync_all()).map_err(|e| CheckpointError::io(path, e))
}

/// Makes `dir`, the temporary directory a checkpoint is written into before
/// it is renamed into place, empty: its parents are created, and a leftover
/// of an interrupted write of the same name is removed.
pub(super) fn fresh_dir(dir: &Path) -> Result<(), CheckpointError> {
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(|e| CheckpointError::io(parent, e))?;
    }
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(|e| CheckpointError::io(dir, e))?;
    }
    std::fs::create_dir(dir).map_err(|e| CheckpointError::io(dir, e))
}

/// The `__metadata__` of a checkpoint's safetensors file: `format: pt`,
/// the boxes' offsets in the full tensors (PyTorch's sharding info), and
/// the save's identity.
pub(super) fn shard_metadata(
    offsets: Option<&BTreeMap<String, Vec<usize>>>,
    save_id: Option<&str>,
) -> BTreeMap<String, String> {
    let mut meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    if let Some(offsets) = offsets {
        let info: BTreeMap<&String, serde_json::Value> =
            offsets.iter().map(|(n, o)| (n, serde_json::json!({ SAVED_OFFSETS_KEY: o }))).collect();
        meta.insert(SHARDING_INFO_KEY.to_string(), serde_json::to_string(&info).unwrap_or_default());
        meta.insert("DCP_VERSION".to_string(), "1.0".to_string());
    }
    if let Some(id) = save_id {
        meta.insert(SAVE_ID_KEY.to_string(), id.to_string());
    }
    meta
}

// ---------------------------------------------------------------- reading

/// The checkpoint directory `dir` names: `dir` itself if it holds a
/// manifest, else the one its `latest` file points to. A directory that is
/// not there, one that is not a checkpoint, and a `latest` that names
/// nothing are three different errors.
pub fn resolve(dir: &Path) -> Result<PathBuf, CheckpointError> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(CheckpointError::NotACheckpoint { path: dir.to_path_buf() }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(CheckpointError::NotFound { path: dir.to_path_buf() })
        }
        Err(e) => return Err(CheckpointError::io(dir, e)),
    }
    if dir.join(MANIFEST).exists() {
        return Ok(dir.to_path_buf());
    }
    let latest = dir.join(LATEST);
    // A `latest` that is a link to a step directory (another tool's convention) names it as the file would; a
    // directory is never read as the file (that gave "Is a directory").
    if std::fs::metadata(&latest).is_ok_and(|m| m.is_dir()) {
        let target = std::fs::read_link(&latest)
            .map_or_else(|_| "itself: a directory, not the file naming a step".into(), |t| t.display().to_string());
        return match std::fs::canonicalize(&latest) {
            Ok(step) if step.join(MANIFEST).exists() => Ok(step),
            _ => Err(CheckpointError::DanglingLatest { latest, target }),
        };
    }
    let text = match std::fs::read_to_string(&latest) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(CheckpointError::NotACheckpoint { path: dir.to_path_buf() });
        }
        Err(e) => return Err(CheckpointError::io(&latest, e)),
    };
    let name = text.trim();
    if name.is_empty() || name.contains('/') || name.contains("..") {
        return Err(CheckpointError::format(&latest, format!("`{name}` is not a checkpoint name")));
    }
    let target = dir.join(name);
    if !target.join(MANIFEST).exists() {
        return Err(CheckpointError::DanglingLatest { latest, target: name.to_string() });
    }
    Ok(target)
}

/// The save identity `file` (its bytes `bytes`, at `path`) records: a
/// safetensors file's `__metadata__`, the index's `metadata`, the training
/// state's field.
pub(super) fn recorded_save_id(file: &str, bytes: &[u8], path: &Path) -> Result<Option<String>, CheckpointError> {
    if file.ends_with(".safetensors") {
        let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| CheckpointError::format(path, e))?;
        return Ok(meta.metadata().as_ref().and_then(|m| m.get(SAVE_ID_KEY)).cloned());
    }
    let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| CheckpointError::format(path, e))?;
    let id = if file == INDEX { &v["metadata"][SAVE_ID_KEY] } else { &v[SAVE_ID_KEY] };
    Ok(id.as_str().map(str::to_string))
}

/// A checkpoint opened for reading: its manifest and, on demand, its files
/// memory-mapped and checked against their recorded size and checksum.
pub(super) struct Opened {
    pub(super) dir: PathBuf,
    pub(super) manifest: Manifest,
    maps: HashMap<String, memmap2::Mmap>,
}

/// One saved box of a tensor: where it lies in the full tensor, and where
/// its data lies in its file.
pub(super) struct SavedBox {
    pub(super) file: String,
    pub(super) region: Region,
    pub(super) data_start: usize,
    pub(super) data_end: usize,
    pub(super) dtype: Dtype,
}

impl Opened {
    pub(super) fn open(dir: &Path) -> Result<Opened, CheckpointError> {
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
    pub(super) fn map(&mut self, file: &str) -> Result<&memmap2::Mmap, CheckpointError> {
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
            if let Some(expected) = &self.manifest.save_id {
                let recorded = recorded_save_id(file, &map, &path)?;
                if recorded.as_deref() != Some(expected.as_str()) {
                    return Err(CheckpointError::Mixed {
                        path,
                        found: recorded.unwrap_or_else(|| "none".into()),
                        expected: expected.clone(),
                    });
                }
            }
            self.maps.insert(file.to_string(), map);
        }
        self.maps.get(file).ok_or_else(|| CheckpointError::MissingFile { path: self.dir.join(file) })
    }

    /// The training state, `training_state.json`.
    pub(super) fn training_state(&mut self) -> Result<TrainingState, CheckpointError> {
        let path = self.dir.join(TRAINING_STATE);
        let bytes = self.map(TRAINING_STATE)?;
        serde_json::from_slice::<StoredState>(bytes).map(|s| s.state).map_err(|e| CheckpointError::format(&path, e))
    }

    fn files_with(&self, what: &str) -> Vec<String> {
        self.manifest.files.keys().filter(|f| f.contains(&format!("-{what}-"))).cloned().collect()
    }

    /// Every saved box of every tensor in the `what` ("model"/"optim") files.
    pub(super) fn boxes(&mut self, what: &str) -> Result<HashMap<String, Vec<SavedBox>>, CheckpointError> {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 43: a `latest` that is a directory gave "Is a directory (os
    /// error 21)": a link to a complete step names it; a link to anything
    /// else, or a directory, is a `latest` that names no checkpoint.
    #[test]
    fn a_latest_that_is_a_directory_is_read_as_what_it_names() {
        let root = std::env::temp_dir().join(format!("chorus-latest-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("step-00000002")).unwrap();
        std::fs::write(root.join("step-00000002").join(MANIFEST), "{}").unwrap();
        std::os::unix::fs::symlink("step-00000002", root.join(LATEST)).unwrap();
        let step = std::fs::canonicalize(root.join("step-00000002")).unwrap();
        assert_eq!(resolve(&root).unwrap(), step);
        std::fs::create_dir_all(root.join("empty")).unwrap();
        std::fs::remove_file(root.join(LATEST)).unwrap();
        std::os::unix::fs::symlink("empty", root.join(LATEST)).unwrap();
        match resolve(&root) {
            Err(CheckpointError::DanglingLatest { target, .. }) => assert_eq!(target, "empty"),
            other => panic!("expected DanglingLatest, got {other:?}"),
        }
        std::fs::remove_file(root.join(LATEST)).unwrap();
        std::fs::create_dir_all(root.join(LATEST)).unwrap();
        match resolve(&root) {
            Err(CheckpointError::DanglingLatest { target, .. }) => assert!(target.contains("a directory"), "{target}"),
            other => panic!("expected DanglingLatest, got {other:?}"),
        }
        std::fs::remove_dir_all(&root).ok();
    }
}
