//! Training the transformer: under FSDP on any backend whose device holds
//! host memory ([`train_gpt`], behind `chorus train --model gpt`), and as
//! plain single-process candle on the global batch ([`train_plain`], the
//! reference the FSDP runs are checked against).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use chorus_collectives::{CommBackend, Communicator};
use chorus_devices::ComputeBackend;
use chorus_fsdp::{CommCounts, Fsdp, FsdpConfig, HostOverhead, OptimizerKind};
use chorus_fsdp_candle::{AdapterTimes, Error, Recompute, Result};

use crate::fsdp_loop::{clip_grad_norm, loop_spec, train_sharded, u32_tensor, LoopSpec, PlainOptimizer};
use crate::gpt::{loss, Gpt, GptConfig, ShardedGpt};
use crate::model_out::ModelOutput;
use crate::text::TextData;

/// What to train.
#[derive(Clone, Debug)]
pub struct GptSpec {
    /// The model's sizes.
    pub config: GptConfig,
    /// Initial parameters (names, values), e.g. from [`init_params`](crate::gpt::init_params).
    pub init: Vec<(String, Tensor)>,
    /// The data.
    pub data: Arc<TextData>,
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
    /// Which groups (`root`, `blocks.{i}`) recompute their stages in backward
    /// (activation checkpointing) and which keep their forward graphs.
    pub recompute: Recompute,
    /// Micro-batches per step (gradient accumulation without sync on all but the last).
    pub micro_batches: usize,
    /// Save a checkpoint under this directory every `save_every` steps (and at the end).
    pub checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints (0: only at the end, when a directory is given).
    pub save_every: u64,
    /// Keep only this many checkpoints under `checkpoint_dir` (the newest;
    /// never the one `latest` names nor the one resumed from); `None` keeps all.
    pub keep_last: Option<usize>,
    /// Resume from this checkpoint (a `step-*` directory, or a directory with a `latest` pointer).
    pub resume: Option<PathBuf>,
    /// Resume with other optimizer settings than the checkpoint's (same kind).
    pub allow_optimizer_change: bool,
    /// Keep going when the loss is not finite (default: stop with an error).
    pub allow_nonfinite: bool,
    /// Where the trained model is written at the end of a completed run,
    /// one tensor at a time (e.g. [`SafetensorsOutput`](crate::model_out::SafetensorsOutput)).
    pub output: Option<Arc<dyn ModelOutput>>,
    /// Also gather the whole trained model into [`GptReport::params`] on
    /// every rank (tests and small models; a run's outputs do not need it).
    pub collect_params: bool,
    /// A greedy continuation of this prompt by this many characters,
    /// computed by the sharded model at the end ([`GptReport::sample`]).
    pub sample: Option<(String, usize)>,
}

impl GptSpec {
    /// `steps` steps of `batch` sequences per rank from `init` on `data`, with
    /// the defaults of `chorus train`: FSDP's default settings, no HSDP, no
    /// clipping, forward prefetch, every group recomputed, one micro-batch, no checkpoints, and a stop
    /// on a loss that is not finite. Change the rest with struct update syntax.
    pub fn new(
        config: GptConfig,
        init: Vec<(String, Tensor)>,
        data: Arc<TextData>,
        batch: usize,
        steps: u64,
        optimizer: OptimizerKind,
    ) -> GptSpec {
        GptSpec {
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
            recompute: Recompute::All,
            micro_batches: 1,
            checkpoint_dir: None,
            save_every: 0,
            keep_last: None,
            resume: None,
            allow_optimizer_change: false,
            allow_nonfinite: false,
            output: None,
            collect_params: false,
            sample: None,
        }
    }
}

/// What one rank measured.
#[derive(Clone, Debug)]
pub struct GptReport {
    /// The step this run started at (0, or the resumed checkpoint's).
    pub start_step: u64,
    /// The losses of the steps before `start_step`, as the checkpoint recorded them.
    pub earlier_losses: Vec<f64>,
    /// The global mean loss of each step this run took, before its update.
    pub losses: Vec<f64>,
    /// Wall time of each step, host-synchronized.
    pub step_times_s: Vec<f64>,
    /// The most device bytes in use from the first step to the end: the
    /// steps, the checkpoints and the written model.
    pub peak_memory_bytes: usize,
    /// The same for the host space (CPU offload's state).
    pub peak_host_memory_bytes: usize,
    /// Host time in FSDP's hooks over the steps.
    pub overhead: HostOverhead,
    /// Host time of the adapter (copies between candle and the device; candle compute).
    pub adapter: AdapterTimes,
    /// Number of param groups.
    pub groups: usize,
    /// Collectives FSDP issued over the steps.
    pub comm_counts: CommCounts,
    /// The final parameters, unsharded, where the spec asked to collect
    /// them (`collect_params`); empty otherwise.
    pub params: Vec<(String, Vec<f32>)>,
    /// The sample the spec asked for, where the run completed.
    pub sample: Option<String>,
    /// Checkpoints written.
    pub saved: Vec<PathBuf>,
    /// Where the run stopped early because the loss stopped being finite
    /// (without `allow_nonfinite`): that step's loss is the last of `losses`,
    /// and its update was not applied.
    pub stopped: Option<NonFinite>,
}

/// A step whose global loss was NaN or infinite.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NonFinite {
    /// The step.
    pub step: u64,
    /// Its loss.
    pub loss: f64,
}

impl NonFinite {
    /// The error a run stopped here reports.
    pub fn error(self) -> Error {
        Error::NonFinite { step: self.step, loss: self.loss }
    }
}

/// How the transformer `config` differs from the one a checkpoint recorded
/// (the model-independent [`fsdp_loop::config_changes`](crate::fsdp_loop::config_changes)).
pub use crate::fsdp_loop::config_changes;

/// Trains on this rank of `world`; every rank calls it with the same spec.
/// `on_step(step, loss)` is called after each step.
pub fn train_gpt<C: CommBackend + 'static>(
    world: Arc<Communicator<C>>,
    spec: &GptSpec,
    on_step: &mut dyn FnMut(u64, f64),
) -> Result<GptReport>
where
    C::B: ComputeBackend,
    Fsdp<C>: Send,
{
    let spec_config = serde_json::to_value(spec.config).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let sample = spec.sample.as_ref().map(|(p, n)| (p.as_str(), *n));
    let loop_spec = LoopSpec { sample, ..loop_spec!(spec, "transformer", spec_config) };
    let build = |fsdp| ShardedGpt::new(fsdp, spec.config, spec.init.clone(), spec.forward_prefetch);
    train_sharded(&world, loop_spec, build, on_step)
}

/// What the plain candle run measured.
#[derive(Clone, Debug)]
pub struct PlainReport {
    /// The mean loss of each step over the global batch.
    pub losses: Vec<f64>,
    /// Wall time of each step.
    pub step_times_s: Vec<f64>,
    /// The final parameters.
    pub params: Vec<(String, Vec<f32>)>,
}

/// The same training as plain single-process candle on the global batch of
/// `ranks × batch` sequences, with candle-nn's own optimizers (`SGD` without
/// momentum, `AdamW`) — an implementation independent of chorus's. With
/// `spec.max_grad_norm`, the gradients are clipped here as
/// `torch.nn.utils.clip_grad_norm_` does (scaled by `max / (norm + 1e-6)`
/// when that is below one). The FSDP settings, micro-batches and prefetch do
/// not apply: they must not change the result.
pub fn train_plain(spec: &GptSpec, ranks: usize) -> Result<PlainReport> {
    train_plain_on(spec, ranks, &Device::Cpu)
}

/// [`train_plain`] with the model on `device` (candle's CUDA device for the
/// comparison on a GPU).
pub fn train_plain_on(spec: &GptSpec, ranks: usize, device: &Device) -> Result<PlainReport> {
    let varmap = VarMap::new();
    {
        let mut data = varmap.data().lock().map_err(|_| Error::InvalidArgument("VarMap lock poisoned".into()))?;
        for (name, t) in &spec.init {
            data.insert(name.clone(), Var::from_tensor(&t.to_device(device)?)?);
        }
    }
    let vb = VarBuilder::from_varmap(&varmap, candle_core::DType::F32, device);
    let gpt = Gpt::new(spec.config, vb)?;
    let mut opt = PlainOptimizer::new(spec.optimizer, varmap.all_vars())?;
    let rows = ranks * spec.batch;
    let seq = spec.data.seq_len();
    let (mut losses, mut times) = (Vec::new(), Vec::new());
    for step in 0..spec.steps {
        let t0 = Instant::now();
        let (x, y) = spec.data.rows(step, 0, rows);
        let (x, y) = (u32_tensor(x, rows, seq)?.to_device(device)?, u32_tensor(y, rows, seq)?.to_device(device)?);
        let l = loss(&gpt.forward(&x)?, &y)?;
        losses.push(l.to_scalar::<f32>()? as f64);
        let mut grads = l.backward()?;
        if let Some(max) = spec.max_grad_norm {
            clip_grad_norm(&mut grads, &varmap.all_vars(), max)?;
        }
        opt.step(&grads)?;
        times.push(t0.elapsed().as_secs_f64());
    }
    let params = spec
        .init
        .iter()
        .map(|(name, _)| {
            let data = varmap.data().lock().map_err(|_| Error::InvalidArgument("VarMap lock poisoned".into()))?;
            let v = data.get(name).ok_or_else(|| Error::InvalidArgument(format!("no variable {name}")))?;
            Ok((name.clone(), v.as_tensor().flatten_all()?.to_vec1::<f32>()?))
        })
        .collect::<Result<_>>()?;
    Ok(PlainReport { losses, step_times_s: times, params })
}
