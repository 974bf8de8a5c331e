//! Training the Llama: under FSDP on any backend whose device holds host
//! memory ([`train_llama`], behind `chorus train --model llama`), and as
//! plain single-process candle on the global batch ([`train_plain`], the
//! reference the FSDP runs are checked against). The step loop is the
//! transformer's (`fsdp_loop::train_sharded`) with the Llama's model and data.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Var};
use candle_nn::{VarBuilder, VarMap};
use chorus_collectives::{CommBackend, Communicator};
use chorus_devices::ComputeBackend;
use chorus_fsdp::{DeferredParam, Fsdp, FsdpConfig, OptimizerKind};
use chorus_fsdp_candle::{Error, Recompute, Result};

use crate::fsdp_loop::{clip_grad_norm, loop_spec, train_sharded, u32_tensor, PlainOptimizer};
use crate::gpt::loss;
use crate::gpt_train::{GptReport, PlainReport};
use crate::llama::{materialize, Llama, ShardedLlama};
use crate::llama_config::LlamaConfig;
use crate::model_out::ModelOutput;
use crate::npy::Tokens;
use crate::text::TextData;

/// Token-id rows from a `.npy` file `[N, seq_len + 1]`: row `k` gives inputs
/// `row[..seq_len]` and targets `row[1..]`; at step `s` the global batch is
/// rows `(s·G + k) mod N` for `k < G` (G = ranks × sequences per rank), the
/// same batches at every world size and mesh.
#[derive(Clone, Debug)]
pub struct TokenRows {
    tokens: Tokens,
    global_batch: usize,
    hash: u64,
}

impl TokenRows {
    /// Checks `tokens` against the model and the batch: at least two
    /// columns, at least `global_batch` rows, every id below `vocab_size`.
    pub fn new(tokens: Tokens, vocab_size: usize, global_batch: usize) -> std::result::Result<TokenRows, String> {
        if tokens.cols < 2 {
            return Err(format!("rows of {} token(s): each row needs seq_len + 1 ≥ 2 tokens", tokens.cols));
        }
        if global_batch == 0 || tokens.rows < global_batch {
            return Err(format!("{} rows are fewer than one global batch of {global_batch}", tokens.rows));
        }
        if let Some(i) = u32::try_from(vocab_size).ok().and_then(|v| tokens.first_at_least(v)) {
            return Err(format!(
                "token id {} at row {}, column {} is not below vocab_size {vocab_size}",
                tokens.id(i),
                i / tokens.cols,
                i % tokens.cols
            ));
        }
        let hash = tokens.content_hash();
        Ok(TokenRows { tokens, global_batch, hash })
    }
}

/// What the Llama trains on.
#[derive(Clone, Debug)]
pub enum LlamaData {
    /// Rows of token ids (`--data`).
    Tokens(TokenRows),
    /// Byte-level windows of a text (`--text`, or generated text).
    Text(TextData),
}

impl LlamaData {
    /// Tokens per sequence.
    pub fn seq_len(&self) -> usize {
        match self {
            LlamaData::Tokens(t) => t.tokens.cols - 1,
            LlamaData::Text(t) => t.seq_len(),
        }
    }

    /// What identifies the data in a checkpoint (a resumed run must train on the same).
    pub fn seed(&self) -> u64 {
        match self {
            LlamaData::Tokens(t) => t.hash,
            LlamaData::Text(t) => t.seed(),
        }
    }

    /// Inputs and targets (each `n × seq_len` ids, row-major) of rows
    /// `first .. first + n` of the global batch at `step`.
    pub fn rows(&self, step: u64, first: usize, n: usize) -> (Vec<u32>, Vec<u32>) {
        match self {
            LlamaData::Text(t) => t.rows(step, first, n),
            LlamaData::Tokens(t) => {
                let (cols, total) = (t.tokens.cols, t.tokens.rows as u64);
                let (mut x, mut y) = (Vec::with_capacity(n * (cols - 1)), Vec::with_capacity(n * (cols - 1)));
                for k in first..first + n {
                    let row = ((step as u128 * t.global_batch as u128 + k as u128) % total as u128) as usize;
                    let before = x.len();
                    t.tokens.extend_row(row, 0, &mut x);
                    x.truncate(before + cols - 1);
                    t.tokens.extend_row(row, 1, &mut y);
                }
                (x, y)
            }
        }
    }
}

/// What to train.
#[derive(Clone, Debug)]
pub struct LlamaSpec {
    /// The model's config.
    pub config: Arc<LlamaConfig>,
    /// Initial parameters as sources of their shards ([`init_params`](crate::llama::init_params) or HF weights).
    pub init: Vec<DeferredParam>,
    /// The data.
    pub data: Arc<LlamaData>,
    /// Sequences per rank per step.
    pub batch: usize,
    /// The step to stop before (a resumed run starts at its checkpoint's step).
    pub steps: u64,
    /// The optimizer.
    pub optimizer: OptimizerKind,
    /// FSDP settings.
    pub fsdp: FsdpConfig,
    /// HSDP: the replicate dimension's size.
    pub replicate: Option<usize>,
    /// Clip the global gradient norm to this.
    pub max_grad_norm: Option<f64>,
    /// Each group's pre-forward also all-gathers the next group.
    pub forward_prefetch: bool,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Save a checkpoint under this directory every `save_every` steps (and at the end).
    pub checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints (0: only at the end, when a directory is given).
    pub save_every: u64,
    /// Keep only this many checkpoints under `checkpoint_dir` (as
    /// [`GptSpec::keep_last`](crate::gpt_train::GptSpec::keep_last)); `None` keeps all.
    pub keep_last: Option<usize>,
    /// Resume from this checkpoint.
    pub resume: Option<PathBuf>,
    /// Resume with other optimizer settings than the checkpoint's (same kind).
    pub allow_optimizer_change: bool,
    /// Keep going when the loss is not finite (default: stop, see [`GptReport::stopped`]).
    pub allow_nonfinite: bool,
    /// Which groups (`root`, `model.layers.{i}`) recompute their stages in
    /// backward (activation checkpointing); the others keep their graphs.
    pub recompute: Recompute,
    /// Where the trained model is written at the end of a completed run,
    /// one tensor at a time (e.g. [`HfOutput`](crate::llama_hf::HfOutput)).
    pub output: Option<Arc<dyn ModelOutput>>,
    /// Also gather the whole trained model into the report's `params` on
    /// every rank (tests and small models; a run's outputs do not need it).
    pub collect_params: bool,
}

impl LlamaSpec {
    /// `steps` steps of `batch` sequences per rank, with the defaults of
    /// `chorus train` (as [`GptSpec::new`](crate::gpt_train::GptSpec::new)).
    pub fn new(
        config: Arc<LlamaConfig>,
        init: Vec<DeferredParam>,
        data: Arc<LlamaData>,
        batch: usize,
        steps: u64,
        optimizer: OptimizerKind,
    ) -> LlamaSpec {
        LlamaSpec {
            config,
            init,
            data,
            batch,
            steps,
            optimizer,
            fsdp: FsdpConfig::default(),
            replicate: None,
            max_grad_norm: None,
            forward_prefetch: true,
            micro_batches: 1,
            checkpoint_dir: None,
            save_every: 0,
            keep_last: None,
            resume: None,
            allow_optimizer_change: false,
            allow_nonfinite: false,
            recompute: Recompute::All,
            output: None,
            collect_params: false,
        }
    }
}

/// Trains on this rank of `world`; every rank calls it with the same spec.
/// `on_step(step, loss)` is called after each step. The report is the
/// transformer's ([`GptReport`]).
pub fn train_llama<C: CommBackend + 'static>(
    world: Arc<Communicator<C>>,
    spec: &LlamaSpec,
    on_step: &mut dyn FnMut(u64, f64),
) -> Result<GptReport>
where
    C::B: ComputeBackend,
    Fsdp<C>: Send,
{
    let spec_config = serde_json::to_value(&*spec.config).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let loop_spec = loop_spec!(spec, "Llama configuration", spec_config);
    let build = |fsdp| ShardedLlama::new(fsdp, spec.config.clone(), spec.init.clone(), spec.forward_prefetch);
    train_sharded(&world, loop_spec, build, on_step)
}

/// The same training as plain single-process candle on the global batch of
/// `ranks × batch` sequences with candle-nn's own optimizers (`SGD` without
/// momentum, `AdamW`) and `clip_grad_norm_`'s clipping: an implementation
/// independent of chorus's FSDP.
pub fn train_plain(spec: &LlamaSpec, ranks: usize) -> Result<PlainReport> {
    train_plain_on(spec, ranks, &Device::Cpu)
}

/// [`train_plain`] with the model on `device` (candle's CUDA device for the
/// comparison on a GPU).
pub fn train_plain_on(spec: &LlamaSpec, ranks: usize, device: &Device) -> Result<PlainReport> {
    let varmap = VarMap::new();
    let init = materialize(&spec.init)?;
    {
        let mut data = varmap.data().lock().map_err(|_| Error::InvalidArgument("VarMap lock poisoned".into()))?;
        for (name, t) in &init {
            data.insert(name.clone(), Var::from_tensor(&t.to_device(device)?)?);
        }
    }
    let vb = VarBuilder::from_varmap(&varmap, candle_core::DType::F32, device);
    let llama = Llama::new(spec.config.clone(), vb)?;
    let mut opt = PlainOptimizer::new(spec.optimizer, varmap.all_vars())?;
    let rows = ranks * spec.batch;
    let seq = spec.data.seq_len();
    let (mut losses, mut times) = (Vec::new(), Vec::new());
    for step in 0..spec.steps {
        let t0 = Instant::now();
        let (x, y) = spec.data.rows(step, 0, rows);
        let (x, y) = (u32_tensor(x, rows, seq)?.to_device(device)?, u32_tensor(y, rows, seq)?.to_device(device)?);
        let l = loss(&llama.forward(&x)?, &y)?;
        losses.push(l.to_scalar::<f32>()? as f64);
        let mut grads = l.backward()?;
        if let Some(max) = spec.max_grad_norm {
            clip_grad_norm(&mut grads, &varmap.all_vars(), max)?;
        }
        opt.step(&grads)?;
        times.push(t0.elapsed().as_secs_f64());
    }
    let data = varmap.data().lock().map_err(|_| Error::InvalidArgument("VarMap lock poisoned".into()))?;
    let params = init
        .iter()
        .map(|(name, _)| {
            let v = data.get(name).ok_or_else(|| Error::InvalidArgument(format!("no variable {name}")))?;
            Ok((name.clone(), v.as_tensor().flatten_all()?.to_vec1::<f32>()?))
        })
        .collect::<Result<_>>()?;
    Ok(PlainReport { losses, step_times_s: times, params })
}
