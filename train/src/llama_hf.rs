//! Hugging Face model directories, in and out.
//!
//! In: [`open`] reads `config.json` and the weights as `save_pretrained`
//! writes them (`model.safetensors`, or `model-0000i-of-0000N.safetensors`
//! with `model.safetensors.index.json`; float32, bfloat16 or float16),
//! memory-mapped: each parameter becomes a [`ShardSource`] that converts
//! only the rows a rank asks for, so loading under FSDP never holds the
//! whole model on any rank.
//!
//! Out: [`write`] writes `config.json` and the parameters as safetensors
//! files split by size, with the index when there is more than one file,
//! in float32 or bfloat16: a directory `LlamaForCausalLM.from_pretrained`
//! loads unchanged.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use chorus_fsdp::{DeferredParam, ShardSource};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::llama_config::{ConfigError, LlamaConfig};

/// What is wrong with a model directory, or with writing one.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// `config.json` is not a Llama this model implements.
    #[error("{path}: {source}")]
    Config {
        /// The file.
        path: PathBuf,
        /// The error.
        source: ConfigError,
    },
    /// A weights file or the index is malformed, or does not match the config.
    #[error("{path}: {why}")]
    Weights {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
}

fn weights_err(path: &Path, why: impl std::fmt::Display) -> HfError {
    HfError::Weights { path: path.to_path_buf(), why: why.to_string() }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> HfError + '_ {
    move |source| HfError::Io { path: path.to_path_buf(), source }
}

/// The index file of a sharded model directory.
pub const INDEX: &str = "model.safetensors.index.json";

/// A model directory opened for loading: its config and one source per
/// parameter, in the model's order.
pub struct HfModel {
    /// The config.
    pub config: LlamaConfig,
    /// The parameters, each reading its rows from the mapped files.
    pub params: Vec<DeferredParam>,
    /// The weights files mapped.
    pub files: Vec<PathBuf>,
    /// The dtype on disk of each parameter, by name.
    pub dtypes: BTreeMap<String, String>,
}

/// Reads `dir/config.json`.
pub fn read_config(dir: &Path) -> Result<LlamaConfig, HfError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    LlamaConfig::from_json(&text).map_err(|source| HfError::Config { path, source })
}

/// One tensor's bytes in a mapped file.
struct MappedTensor {
    map: Arc<Mmap>,
    path: PathBuf,
    /// Byte offset of the tensor's first element in the file.
    start: usize,
    dtype: Dtype,
    shape: Vec<usize>,
}

impl ShardSource for MappedTensor {
    fn read_rows(&self, dim: usize, rows: Range<usize>) -> Result<Vec<f32>, String> {
        let n = *self.shape.get(dim).ok_or(format!("dim {dim} is out of range for {:?}", self.shape))?;
        if rows.start > rows.end || rows.end > n {
            return Err(format!("rows {rows:?} are out of range for {:?}", self.shape));
        }
        let outer: usize = self.shape[..dim].iter().product();
        let inner: usize = self.shape[dim + 1..].iter().product();
        let es = self.dtype.bitsize() / 8;
        let mut out = Vec::with_capacity(outer * rows.len() * inner);
        for o in 0..outer {
            let from = self.start + (o * n + rows.start) * inner * es;
            let bytes = self
                .map
                .get(from..from + rows.len() * inner * es)
                .ok_or_else(|| format!("{}: the tensor runs past the end of the file", self.path.display()))?;
            match self.dtype {
                Dtype::F32 => out.extend(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
                Dtype::BF16 => {
                    out.extend(bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()))
                }
                Dtype::F16 => {
                    out.extend(bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()))
                }
                d => return Err(format!("dtype {d:?} is not f32, bf16 or f16")),
            }
        }
        Ok(out)
    }
}

/// Opens the model directory `dir`: reads `config.json`, maps the weights
/// files, and checks that every parameter the config implies is there with
/// its shape and a float dtype, and that nothing else is (buffers that
/// older transformers saved, `rotary_emb.inv_freq`, are skipped; a tied
/// model's `lm_head.weight`, which transformers ignores, too).
pub fn open(dir: &Path) -> Result<HfModel, HfError> {
    let config = read_config(dir)?;
    let index = dir.join(INDEX);
    let single = dir.join("model.safetensors");
    // Tensor name → file, from the index or the single file.
    let files: Vec<PathBuf> = if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(io_err(&index))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| weights_err(&index, e))?;
        let map =
            v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| weights_err(&index, "no weight_map"))?;
        let mut names: Vec<String> = Vec::new();
        for (tensor, file) in map {
            let file =
                file.as_str().ok_or_else(|| weights_err(&index, format!("{tensor}: the file is not a string")))?;
            if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                return Err(weights_err(&index, format!("{tensor}: file name {file:?} leaves the directory")));
            }
            if !names.iter().any(|n| n == file) {
                names.push(file.to_string());
            }
        }
        names.sort();
        names.into_iter().map(|n| dir.join(n)).collect()
    } else if single.exists() {
        vec![single]
    } else {
        return Err(weights_err(dir, format!("neither model.safetensors nor {INDEX}")));
    };
    let mut found: HashMap<String, MappedTensor> = HashMap::new();
    for path in &files {
        let file = std::fs::File::open(path).map_err(io_err(path))?;
        // SAFETY: the file is mapped read-only; like every safetensors
        // loader, chorus requires it not to be modified while training reads it.
        let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(io_err(path))?);
        let (header, meta) = SafeTensors::read_metadata(&map).map_err(|e| weights_err(path, e))?;
        for (name, info) in meta.tensors() {
            if found.contains_key(&name) {
                return Err(weights_err(path, format!("{name} is in more than one file")));
            }
            let start = 8 + header + info.data_offsets.0;
            let t = MappedTensor {
                map: map.clone(),
                path: path.clone(),
                start,
                dtype: info.dtype,
                shape: info.shape.clone(),
            };
            found.insert(name, t);
        }
    }
    let mut params = Vec::new();
    let mut dtypes = BTreeMap::new();
    for (name, shape) in config.param_shapes() {
        let t = found.remove(&name).ok_or_else(|| weights_err(dir, format!("no tensor {name}")))?;
        if t.shape != shape {
            return Err(weights_err(&t.path, format!("{name} has shape {:?}; config.json implies {shape:?}", t.shape)));
        }
        if !matches!(t.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            return Err(weights_err(&t.path, format!("{name} is {:?}; chorus loads f32, bf16 or f16", t.dtype)));
        }
        dtypes.insert(name.clone(), format!("{:?}", t.dtype));
        params.push(DeferredParam { name, shape, source: Arc::new(t) });
    }
    found.retain(|name, _| {
        !(name.ends_with("rotary_emb.inv_freq") || (config.tie_word_embeddings && name == "lm_head.weight"))
    });
    if let Some(name) = found.keys().min() {
        return Err(weights_err(dir, format!("tensor {name} is not a parameter of this Llama config")));
    }
    Ok(HfModel { config, params, files, dtypes })
}

/// The dtype of the weights chorus writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveDtype {
    /// float32.
    F32,
    /// bfloat16 (rounded to nearest even, as `torch.Tensor.to(torch.bfloat16)`).
    BF16,
}

impl SaveDtype {
    /// transformers' name of the dtype (`config.json`'s `torch_dtype`).
    pub fn torch_name(self) -> &'static str {
        match self {
            SaveDtype::F32 => "float32",
            SaveDtype::BF16 => "bfloat16",
        }
    }
    fn bytes(self) -> usize {
        match self {
            SaveDtype::F32 => 4,
            SaveDtype::BF16 => 2,
        }
    }
}

/// The file names of `n` weights files: `model.safetensors` alone, or
/// `model-0000i-of-0000N.safetensors`.
fn file_name(k: usize, n: usize) -> String {
    if n == 1 {
        "model.safetensors".into()
    } else {
        format!("model-{:05}-of-{:05}.safetensors", k + 1, n)
    }
}

/// Writes the model `params` (full values, named as transformers names
/// them) with `cfg` into the existing, empty directory `dir`: `config.json`,
/// the weights in `dtype` starting a new file whenever one would pass
/// `max_file_bytes` (one tensor larger than that gets a file of its own),
/// and `model.safetensors.index.json` when there is more than one file.
/// Every parameter of `cfg` must be given, with its shape's element count.
/// Returns the files written.
pub fn write(
    dir: &Path,
    cfg: &LlamaConfig,
    params: &[(String, Vec<f32>)],
    dtype: SaveDtype,
    max_file_bytes: usize,
) -> Result<Vec<PathBuf>, HfError> {
    let by_name: HashMap<&str, &Vec<f32>> = params.iter().map(|(n, v)| (n.as_str(), v)).collect();
    let mut tensors = Vec::new();
    for (name, shape) in cfg.param_shapes() {
        let v = by_name.get(name.as_str()).ok_or_else(|| weights_err(dir, format!("no values for {name}")))?;
        if v.len() != shape.iter().product::<usize>() {
            return Err(weights_err(dir, format!("{name}: {} values for shape {shape:?}", v.len())));
        }
        tensors.push((name, shape, *v));
    }
    let mut files: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0;
    for (i, (_, _, v)) in tensors.iter().enumerate() {
        let bytes = v.len() * dtype.bytes();
        if size > 0 && size + bytes > max_file_bytes {
            files.push(Vec::new());
            size = 0;
        }
        size += bytes;
        if let Some(f) = files.last_mut() {
            f.push(i);
        }
    }
    let n = files.len();
    let mut written = Vec::new();
    let mut weight_map = BTreeMap::new();
    let mut total = 0usize;
    for (k, members) in files.iter().enumerate() {
        let name = file_name(k, n);
        let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = members
            .iter()
            .map(|&i| {
                let (tname, shape, v) = &tensors[i];
                let bytes: Vec<u8> = match dtype {
                    SaveDtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    SaveDtype::BF16 => v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
                };
                (tname.clone(), shape.clone(), bytes)
            })
            .collect();
        let st_dtype = match dtype {
            SaveDtype::F32 => Dtype::F32,
            SaveDtype::BF16 => Dtype::BF16,
        };
        let views = encoded
            .iter()
            .map(|(n, s, b)| {
                total += b.len();
                weight_map.insert(n.clone(), name.clone());
                Ok((n.clone(), safetensors::tensor::TensorView::new(st_dtype, s.clone(), b)?))
            })
            .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
            .map_err(|e| weights_err(dir, e))?;
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        let bytes = safetensors::tensor::serialize(views, Some(meta)).map_err(|e| weights_err(dir, e))?;
        let path = dir.join(&name);
        write_synced(&path, &bytes)?;
        written.push(path);
    }
    if n > 1 {
        let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let path = dir.join(INDEX);
        write_synced(&path, serde_json::to_string_pretty(&index).map_err(|e| weights_err(&path, e))?.as_bytes())?;
        written.push(path);
    }
    let path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&cfg.to_hf_json(dtype.torch_name())).map_err(|e| weights_err(&path, e))?;
    write_synced(&path, text.as_bytes())?;
    written.push(path);
    Ok(written)
}

/// Writes `bytes` to a new file at `path` and syncs it.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), HfError> {
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(path).map_err(io_err(path))?;
    f.write_all(bytes).and_then(|_| f.sync_all()).map_err(io_err(path))
}
