//! Training the Llama: under FSDP on any backend whose device holds host
//! memory ([`train_llama`], behind `chorus train --model llama`), and as
//! plain single-process candle on the global batch ([`train_plain`], the
//! reference the FSDP runs are checked against). The loop is the
//! transformer's (`gpt_train`) with the Llama's model and data.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Var};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use chorus_collectives::{CommBackend, Communicator, Mesh};
use chorus_devices::{ComputeBackend, Device as _};
use chorus_fsdp::{CommCounts, DataParallel, DeferredParam, Fsdp, FsdpConfig, OptimizerKind, ShardedOptimizer};
use chorus_fsdp_candle::checkpoint::{self, TrainingState};
use chorus_fsdp_candle::{AdapterTimes, Error, Result};

use crate::gpt::loss;
use crate::gpt_train::{clip_grad_norm, u32_tensor, GptReport, PlainReport};
use crate::llama::{materialize, Llama, ShardedLlama};
use crate::llama_config::LlamaConfig;
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
        if let Some(i) = tokens.ids.iter().position(|t| *t as usize >= vocab_size) {
            return Err(format!(
                "token id {} at row {}, column {} is not below vocab_size {vocab_size}",
                tokens.ids[i],
                i / tokens.cols,
                i % tokens.cols
            ));
        }
        let hash = tokens
            .ids
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64 ^ tokens.cols as u64, |h, t| (h ^ *t as u64).wrapping_mul(0x100_0000_01b3));
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
                    let ids = &t.tokens.ids[row * cols..(row + 1) * cols];
                    x.extend_from_slice(&ids[..cols - 1]);
                    y.extend_from_slice(&ids[1..]);
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
    /// Resume from this checkpoint.
    pub resume: Option<PathBuf>,
    /// Keep going when the loss is not finite.
    pub allow_nonfinite: bool,
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
            resume: None,
            allow_nonfinite: false,
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
    let n = world.size();
    let micro = spec.micro_batches.max(1);
    if spec.batch == 0 || spec.batch % micro != 0 {
        return Err(Error::InvalidArgument(format!(
            "batch {} must be a positive multiple of {micro} micro-batches",
            spec.batch
        )));
    }
    let dp = match spec.replicate {
        Some(r) if r > 1 => {
            if n % r != 0 {
                return Err(Error::InvalidArgument(format!("--hsdp {r} does not divide {n} ranks")));
            }
            DataParallel::hsdp(
                &Mesh::new(&world, &[("replicate", r), ("shard", n / r)]).map_err(chorus_fsdp::FsdpError::from)?,
            )?
        }
        _ => DataParallel::fsdp(world.clone()),
    };
    let fsdp = Fsdp::new(dp, spec.fsdp.clone())?;
    let llama = ShardedLlama::new(fsdp, spec.config.clone(), spec.init.clone(), spec.forward_prefetch)?;
    let mut opt = ShardedOptimizer::new(spec.optimizer);
    let mut start = 0;
    let mut earlier_losses = Vec::new();
    if let Some(dir) = &spec.resume {
        let state = llama.model.with_fsdp(|f| checkpoint::load(f, &mut opt, dir, &checkpoint::LoadOptions::default()))??;
        if state.data_seed != spec.data.seed() {
            return Err(Error::InvalidArgument(format!(
                "{}: saved with data {:#x}, this run's is {:#x}",
                dir.display(),
                state.data_seed,
                spec.data.seed()
            )));
        }
        start = state.step;
        earlier_losses = state.losses;
    }
    llama.model.with_fsdp(|f| -> Result<()> {
        f.synchronize()?;
        f.device().reset_peak_memory();
        Ok(())
    })??;
    let overhead_before = llama.model.with_fsdp(|f| f.host_overhead())?;
    let counts_before = llama.model.with_fsdp(|f| f.comm_counts())?;
    let adapter_before = llama.model.times()?;
    let rank = world.rank();
    let seq = spec.data.seq_len();
    let rows = spec.batch / micro;
    let (mut losses, mut times, mut saved) = (Vec::new(), Vec::new(), Vec::new());
    for step in start..spec.steps {
        let t0 = Instant::now();
        let mut local = 0.0f64;
        for m in 0..micro {
            llama.model.with_fsdp(|f| f.set_requires_gradient_sync(m + 1 == micro))?;
            let (x, y) = spec.data.rows(step, rank * spec.batch + m * rows, rows);
            let logits = llama.forward(&u32_tensor(x, rows, seq)?)?;
            let l = loss(&logits, &u32_tensor(y, rows, seq)?)?;
            let l = if micro > 1 { (l / micro as f64)? } else { l };
            local += l.to_scalar::<f32>()? as f64;
            llama.model.backward(&l)?;
        }
        let mean = llama.model.with_fsdp(|f| -> Result<f64> {
            let s = f.compute_stream();
            let buf =
                chorus_devices::StreamExt::buffer_from(s, &[local as f32]).map_err(chorus_fsdp::FsdpError::from)?;
            Ok(f.mean_over_ranks(chorus_devices::Buffer::view(&buf))?)
        })??;
        if !mean.is_finite() && !spec.allow_nonfinite {
            return Err(Error::NonFinite { step, loss: mean });
        }
        if let Some(max) = spec.max_grad_norm {
            llama.model.clip_grad_norm(max)?;
        }
        llama.model.optimizer_step(&mut opt)?;
        llama.model.with_fsdp(|f| f.synchronize())??;
        times.push(t0.elapsed().as_secs_f64());
        losses.push(mean);
        on_step(step, mean);
        let done = step + 1;
        let due = spec.save_every > 0 && done % spec.save_every == 0 || done == spec.steps;
        if let (Some(dir), true) = (&spec.checkpoint_dir, due) {
            let losses = earlier_losses.iter().chain(&losses).copied().collect();
            let state = TrainingState { step: done, data_seed: spec.data.seed(), losses, model: serde_json::Value::Null };
            saved.push(llama.model.with_fsdp(|f| checkpoint::save(f, &opt, dir, &state, &checkpoint::SaveOptions::default()))??);
        }
    }
    let stats = llama.model.with_fsdp(|f| f.device().memory_stats())?;
    let after = llama.model.with_fsdp(|f| f.host_overhead())?;
    let adapter_after = llama.model.times()?;
    let groups = llama.model.with_fsdp(|f| f.num_groups())?;
    let counts = llama.model.with_fsdp(|f| f.comm_counts())?;
    let params = llama.model.with_fsdp(|f| f.full_parameters())??;
    Ok(GptReport {
        start_step: start,
        earlier_losses,
        losses,
        step_times_s: times,
        peak_memory_bytes: stats.peak_bytes,
        overhead: after.since(&overhead_before),
        adapter: AdapterTimes {
            transfer: adapter_after.transfer - adapter_before.transfer,
            compute: adapter_after.compute - adapter_before.compute,
            stage_calls: adapter_after.stage_calls - adapter_before.stage_calls,
            recomputed: adapter_after.recomputed - adapter_before.recomputed,
        },
        groups,
        comm_counts: CommCounts {
            all_gathers: counts.all_gathers - counts_before.all_gathers,
            reduce_scatters: counts.reduce_scatters - counts_before.reduce_scatters,
            all_reduces: counts.all_reduces - counts_before.all_reduces,
        },
        params,
        saved,
        stopped: None,
    })
}

/// The same training as plain single-process candle on the global batch of
/// `ranks × batch` sequences with candle-nn's own optimizers (`SGD` without
/// momentum, `AdamW`) and `clip_grad_norm_`'s clipping: an implementation
/// independent of chorus's FSDP.
pub fn train_plain(spec: &LlamaSpec, ranks: usize) -> Result<PlainReport> {
    let varmap = VarMap::new();
    let init = materialize(&spec.init)?;
    {
        let mut data = varmap.data().lock().map_err(|_| Error::InvalidArgument("VarMap lock poisoned".into()))?;
        for (name, t) in &init {
            data.insert(name.clone(), Var::from_tensor(t)?);
        }
    }
    let vb = VarBuilder::from_varmap(&varmap, candle_core::DType::F32, &Device::Cpu);
    let llama = Llama::new(spec.config.clone(), vb)?;
    let vars = varmap.all_vars();
    enum Opt {
        Sgd(candle_nn::SGD),
        AdamW(candle_nn::AdamW),
    }
    let mut opt = match spec.optimizer {
        OptimizerKind::Sgd { lr, momentum, weight_decay, .. } if momentum == 0.0 && weight_decay == 0.0 => {
            Opt::Sgd(candle_nn::SGD::new(vars, lr)?)
        }
        OptimizerKind::AdamW { lr, beta1, beta2, eps, weight_decay } => {
            Opt::AdamW(candle_nn::AdamW::new(vars, candle_nn::ParamsAdamW { lr, beta1, beta2, eps, weight_decay })?)
        }
        k => return Err(Error::InvalidArgument(format!("candle-nn has no optimizer matching {k:?}"))),
    };
    let rows = ranks * spec.batch;
    let seq = spec.data.seq_len();
    let (mut losses, mut times) = (Vec::new(), Vec::new());
    for step in 0..spec.steps {
        let t0 = Instant::now();
        let (x, y) = spec.data.rows(step, 0, rows);
        let l = loss(&llama.forward(&u32_tensor(x, rows, seq)?)?, &u32_tensor(y, rows, seq)?)?;
        losses.push(l.to_scalar::<f32>()? as f64);
        let mut grads = l.backward()?;
        if let Some(max) = spec.max_grad_norm {
            clip_grad_norm(&mut grads, &varmap.all_vars(), max)?;
        }
        match &mut opt {
            Opt::Sgd(o) => o.step(&grads)?,
            Opt::AdamW(o) => o.step(&grads)?,
        }
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
