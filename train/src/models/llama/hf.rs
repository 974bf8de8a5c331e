//! Hugging Face model directories, in and out.
//!
//! In: [`open`] reads `config.json` and the weights as `save_pretrained`
//! writes them (`model.safetensors`, or `model-0000i-of-0000N.safetensors`
//! with `model.safetensors.index.json`; the single file where both are
//! there, as transformers does; float32, bfloat16 or float16; regular
//! files only),
//! memory-mapped: each parameter becomes a [`ShardSource`] that converts
//! only the rows a rank asks for, so loading under FSDP never holds the
//! whole model on any rank.
//!
//! Out: [`HfWriter`] writes `config.json` and the parameters as safetensors
//! files split by size ([`HfLayout`]), with the index when there is more
//! than one file, in float32 or bfloat16, tensor by tensor as the values
//! arrive (each file written once, header first): a directory
//! `LlamaForCausalLM.from_pretrained` loads unchanged. A run's end writes
//! it through [`HfOutput`], gathering one parameter at a time.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use chorus_fsdp::{DeferredParam, ShardSource};
use chorus_fsdp_candle::safetensors_io::{header_problem, Planned, StreamWriter, WriteError};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::config::{ConfigError, LlamaConfig};
use crate::model_out::{ModelOutput, TensorSink};

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

/// The largest `config.json` read (a Llama's is a few KiB).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Reads `dir/config.json`: a regular file of at most [`MAX_CONFIG_BYTES`].
pub fn read_config(dir: &Path) -> Result<LlamaConfig, HfError> {
    use std::io::Read as _;
    let path = dir.join("config.json");
    crate::files::regular_file(&path).map_err(io_err(&path))?;
    // At most one byte past the bound, so a file that grows after the check is refused too.
    let mut text = String::new();
    std::fs::File::open(&path)
        .and_then(|f| f.take(MAX_CONFIG_BYTES + 1).read_to_string(&mut text))
        .map_err(io_err(&path))?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        let why = format!("more than {MAX_CONFIG_BYTES} bytes, larger than any config.json");
        return Err(HfError::Io { path, source: std::io::Error::new(std::io::ErrorKind::InvalidData, why) });
    }
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
    // Tensor name → file, from the single file or the index: where both
    // are there, the single file, as transformers' `from_pretrained` chooses.
    let files: Vec<PathBuf> = if single.exists() {
        vec![single]
    } else if index.exists() {
        crate::files::regular_file(&index).map_err(io_err(&index))?;
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
    } else {
        return Err(weights_err(dir, format!("neither model.safetensors nor {INDEX}")));
    };
    let mut found: HashMap<String, MappedTensor> = HashMap::new();
    for path in &files {
        // A FIFO would block the open (and a directory cannot be mapped).
        crate::files::regular_file(path).map_err(io_err(path))?;
        let file = std::fs::File::open(path).map_err(io_err(path))?;
        // SAFETY: the file is mapped read-only; like every safetensors
        // loader, chorus requires it not to be modified while training reads it.
        let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(io_err(path))?);
        let (header, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
            // safetensors blames an inconsistent offset on the tensor after
            // the wrong one; the diagnosis names the wrong one.
            let n = map.get(..8).map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
            let header = usize::try_from(n).ok().and_then(|n| map.get(8..8usize.saturating_add(n)));
            match header.and_then(|h| header_problem(h, map.len() as u64)) {
                Some(why) => weights_err(path, why),
                None => weights_err(path, e),
            }
        })?;
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
        let t = found.remove(&name).ok_or_else(|| {
            let names: Vec<String> =
                files.iter().filter_map(|f| f.file_name().map(|n| n.to_string_lossy().into_owned())).collect();
            weights_err(dir, format!("no tensor {name} in {}", names.join(", ")))
        })?;
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

/// How a Llama's parameters lie in a Hugging Face directory: in the
/// config's order, a new file whenever one would pass the size limit (one
/// tensor larger than that gets a file of its own). Pure: every rank
/// computes the same, so all gather the parameters in this order.
#[derive(Clone, Debug)]
pub struct HfLayout {
    dtype: SaveDtype,
    /// Each file's tensors (name, shape).
    files: Vec<Vec<(String, Vec<usize>)>>,
}

impl HfLayout {
    /// The layout of `cfg`'s parameters in `dtype`, files of at most `max_file_bytes`.
    pub fn new(cfg: &LlamaConfig, dtype: SaveDtype, max_file_bytes: usize) -> HfLayout {
        let mut files: Vec<Vec<(String, Vec<usize>)>> = vec![Vec::new()];
        let mut size = 0usize;
        for (name, shape) in cfg.param_shapes() {
            let bytes = shape.iter().product::<usize>().saturating_mul(dtype.bytes());
            if size > 0 && size.saturating_add(bytes) > max_file_bytes {
                files.push(Vec::new());
                size = 0;
            }
            size = size.saturating_add(bytes);
            if let Some(f) = files.last_mut() {
                f.push((name, shape));
            }
        }
        HfLayout { dtype, files }
    }

    /// The parameters in the order they are written.
    pub fn order(&self) -> Vec<String> {
        self.files.iter().flatten().map(|(n, _)| n.clone()).collect()
    }
}

/// A Hugging Face directory being written tensor by tensor: each weights
/// file is created with its header when its first value arrives, and synced
/// when its last has; the index and `config.json` when all are written.
pub struct HfWriter {
    dir: PathBuf,
    config_json: serde_json::Value,
    layout: HfLayout,
    /// The file being written (index into the layout), its writer and the values it still needs.
    current: Option<(usize, StreamWriter, usize)>,
    next: usize,
    written: Vec<PathBuf>,
}

fn write_error(e: WriteError) -> HfError {
    HfError::Io { path: e.path, source: e.source }
}

impl HfWriter {
    /// Starts writing `cfg`'s model laid out as `layout` into the existing,
    /// empty directory `dir`.
    pub fn create(dir: &Path, cfg: &LlamaConfig, layout: HfLayout) -> Result<HfWriter, HfError> {
        let config_json = cfg.to_hf_json(layout.dtype.torch_name());
        Ok(HfWriter { dir: dir.to_path_buf(), config_json, layout, current: None, next: 0, written: Vec::new() })
    }

    /// Opens the next file with values to come, finishing the complete one.
    fn advance(&mut self) -> Result<(), HfError> {
        loop {
            match self.current.take() {
                Some((k, w, left)) if left > 0 => {
                    self.current = Some((k, w, left));
                    return Ok(());
                }
                Some((k, w, _)) => {
                    w.finish().map_err(write_error)?;
                    self.written.push(self.dir.join(file_name(k, self.layout.files.len())));
                }
                None => {
                    let Some(tensors) = self.layout.files.get(self.next) else { return Ok(()) };
                    let k = self.next;
                    self.next += 1;
                    let st = match self.layout.dtype {
                        SaveDtype::F32 => Dtype::F32,
                        SaveDtype::BF16 => Dtype::BF16,
                    };
                    let plan: Vec<Planned> =
                        tensors.iter().map(|(n, s)| Planned { name: n.clone(), dtype: st, shape: s.clone() }).collect();
                    let numel = tensors.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
                    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
                    let path = self.dir.join(file_name(k, self.layout.files.len()));
                    self.current = Some((k, StreamWriter::create(&path, &plan, &meta).map_err(write_error)?, numel));
                }
            }
        }
    }

    /// The next values, in [`HfLayout::order`] (pieces may cross tensors and files).
    pub fn write(&mut self, mut values: &[f32]) -> Result<(), HfError> {
        while !values.is_empty() {
            self.advance()?;
            let Some((_, w, left)) = &mut self.current else {
                return Err(weights_err(&self.dir, "more values than the model's parameters hold"));
            };
            let take = (*left).min(values.len());
            w.write_f32(&values[..take]).map_err(write_error)?;
            *left -= take;
            values = &values[take..];
        }
        Ok(())
    }

    /// Checks every value was written, then writes the index (when there is
    /// more than one file) and `config.json`; returns the files written.
    pub fn finish(mut self) -> Result<Vec<PathBuf>, HfError> {
        self.advance()?;
        if self.current.is_some() || self.next < self.layout.files.len() {
            return Err(weights_err(&self.dir, "fewer values than the model's parameters hold"));
        }
        let n = self.layout.files.len();
        if n > 1 {
            let mut weight_map = BTreeMap::new();
            for (k, tensors) in self.layout.files.iter().enumerate() {
                for (name, _) in tensors {
                    weight_map.insert(name.clone(), file_name(k, n));
                }
            }
            let total: usize = self
                .layout
                .files
                .iter()
                .flatten()
                .map(|(_, s)| s.iter().product::<usize>() * self.layout.dtype.bytes())
                .sum();
            let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
            let path = self.dir.join(INDEX);
            write_synced(&path, serde_json::to_string_pretty(&index).map_err(|e| weights_err(&path, e))?.as_bytes())?;
            self.written.push(path);
        }
        let path = self.dir.join("config.json");
        let text = serde_json::to_string_pretty(&self.config_json).map_err(|e| weights_err(&path, e))?;
        write_synced(&path, text.as_bytes())?;
        self.written.push(path);
        Ok(self.written)
    }
}

/// Writes the model `params` (full values, named as transformers names
/// them) with `cfg` into the existing, empty directory `dir`, laid out as
/// [`HfLayout::new`] says, through an [`HfWriter`]. Every parameter of
/// `cfg` must be given, with its shape's element count. Returns the files
/// written.
pub fn write(
    dir: &Path,
    cfg: &LlamaConfig,
    params: &[(String, Vec<f32>)],
    dtype: SaveDtype,
    max_file_bytes: usize,
) -> Result<Vec<PathBuf>, HfError> {
    let by_name: HashMap<&str, &Vec<f32>> = params.iter().map(|(n, v)| (n.as_str(), v)).collect();
    let layout = HfLayout::new(cfg, dtype, max_file_bytes);
    let shapes: HashMap<String, Vec<usize>> = cfg.param_shapes().into_iter().collect();
    let mut w = HfWriter::create(dir, cfg, layout.clone())?;
    for name in layout.order() {
        let v = by_name.get(name.as_str()).ok_or_else(|| weights_err(dir, format!("no values for {name}")))?;
        let numel = shapes.get(&name).map_or(0, |s| s.iter().product::<usize>());
        if v.len() != numel {
            return Err(weights_err(dir, format!("{name}: {} values for {numel} elements", v.len())));
        }
        w.write(v)?;
    }
    w.finish()
}

/// The Llama's Hugging Face directory as a run's output ([`write_model`](crate::model_out::write_model)):
/// `dir` is created (it must not exist) by the writing rank.
#[derive(Clone, Debug)]
pub struct HfOutput {
    /// The directory to create; `None` where this process writes nothing.
    pub dir: Option<PathBuf>,
    /// The model's config.
    pub config: Arc<LlamaConfig>,
    /// The layout (dtype and files).
    pub layout: HfLayout,
}

impl ModelOutput for HfOutput {
    fn order(&self) -> Vec<String> {
        self.layout.order()
    }
    fn open(&self) -> Result<Option<Box<dyn TensorSink>>, WriteError> {
        let Some(dir) = &self.dir else { return Ok(None) };
        std::fs::create_dir(dir).map_err(|source| WriteError { path: dir.clone(), source })?;
        let w = HfWriter::create(dir, &self.config, self.layout.clone()).map_err(hf_to_write)?;
        Ok(Some(Box::new(w)))
    }
}

/// An [`HfError`] as the [`TensorSink`] interface reports it (path and cause).
fn hf_to_write(e: HfError) -> WriteError {
    let invalid = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    match e {
        HfError::Io { path, source } => WriteError { path, source },
        HfError::Weights { path, why } => WriteError { path, source: invalid(why) },
        HfError::Config { path, source } => WriteError { path, source: invalid(source.to_string()) },
    }
}

impl TensorSink for HfWriter {
    fn write(&mut self, values: &[f32]) -> Result<(), WriteError> {
        HfWriter::write(self, values).map_err(hf_to_write)
    }
    fn finish(self: Box<Self>) -> Result<(), WriteError> {
        HfWriter::finish(*self).map(|_| ()).map_err(hf_to_write)
    }
}

/// Writes `bytes` to a new file at `path` and syncs it.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), HfError> {
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(path).map_err(io_err(path))?;
    f.write_all(bytes).and_then(|_| f.sync_all()).map_err(io_err(path))
}
