//! What the candle models' training loops ([`gpt_train`](crate::gpt_train),
//! [`llama_train`](crate::llama_train)) share and that does not depend on
//! the model: the FSDP step loop itself ([`train_sharded`]: micro-batches,
//! the global loss, clipping, the sharded optimizer, checkpoints and their
//! resume), the decoder stack's forward through its stages, the
//! data-parallel layout, the counters a report gives as differences, and the
//! plain candle reference's optimizer and clipping.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor, Var};
use candle_nn::Optimizer;
use chorus_collectives::{CommBackend, Communicator, Mesh};
use chorus_devices::{ComputeBackend, Device as _};
use chorus_fsdp::{CommCounts, DataParallel, Fsdp, FsdpConfig, HostOverhead, OptimizerKind, ShardedOptimizer};
use chorus_fsdp_candle::checkpoint::{self, LoadOptions, SaveOptions, TrainingState};
use chorus_fsdp_candle::{AdapterTimes, Error, FsdpModel, Recompute, Result, StageId};
use serde::Serialize;

use crate::gpt::loss;
use crate::gpt_train::{GptReport, NonFinite};
use crate::model_out::ModelOutput;

/// The token batches a training loop draws from.
pub(crate) trait Batches {
    /// Tokens per sequence.
    fn seq_len(&self) -> usize;
    /// What identifies the data in a checkpoint (a resumed run must train on the same).
    fn seed(&self) -> u64;
    /// Inputs and targets (each `n × seq_len` ids, row-major) of rows
    /// `first .. first + n` of the global batch at `step`.
    fn rows(&self, step: u64, first: usize, n: usize) -> (Vec<u32>, Vec<u32>);
}

impl Batches for crate::text::TextData {
    fn seq_len(&self) -> usize {
        self.seq_len()
    }
    fn seed(&self) -> u64 {
        self.seed()
    }
    fn rows(&self, step: u64, first: usize, n: usize) -> (Vec<u32>, Vec<u32>) {
        self.rows(step, first, n)
    }
}

impl Batches for crate::llama_train::LlamaData {
    fn seq_len(&self) -> usize {
        self.seq_len()
    }
    fn seed(&self) -> u64 {
        self.seed()
    }
    fn rows(&self, step: u64, first: usize, n: usize) -> (Vec<u32>, Vec<u32>) {
        self.rows(step, first, n)
    }
}

/// A decoder under FSDP, as the step loop drives it.
pub(crate) trait ShardedDecoder<C: CommBackend> {
    /// The adapter (and the [`Fsdp`] inside it).
    fn fsdp_model(&self) -> &FsdpModel<C>;
    /// Logits of `ids` (`[batch, seq]`, u32), carrying candle's graph.
    fn forward(&self, ids: &Tensor) -> Result<Tensor>;
}

impl<C: CommBackend + 'static> ShardedDecoder<C> for crate::gpt::ShardedGpt<C>
where
    C::B: ComputeBackend,
    Fsdp<C>: Send,
{
    fn fsdp_model(&self) -> &FsdpModel<C> {
        &self.model
    }
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.forward(ids)
    }
}

impl<C: CommBackend + 'static> ShardedDecoder<C> for crate::llama::ShardedLlama<C>
where
    C::B: ComputeBackend,
    Fsdp<C>: Send,
{
    fn fsdp_model(&self) -> &FsdpModel<C> {
        &self.model
    }
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.forward(ids)
    }
}

/// What [`train_sharded`] needs of a model's training spec.
pub(crate) struct LoopSpec<'a> {
    /// What the model is called in a refused resume's message ("transformer").
    pub(crate) what: &'static str,
    /// The model's configuration, recorded in every checkpoint and compared on resume.
    pub(crate) config: serde_json::Value,
    pub(crate) data: &'a dyn Batches,
    /// Sequences per rank per step.
    pub(crate) batch: usize,
    pub(crate) micro_batches: usize,
    /// The step to stop before.
    pub(crate) steps: u64,
    pub(crate) optimizer: OptimizerKind,
    pub(crate) fsdp: &'a FsdpConfig,
    pub(crate) replicate: Option<usize>,
    pub(crate) recompute: &'a Recompute,
    pub(crate) max_grad_norm: Option<f64>,
    pub(crate) checkpoint_dir: Option<&'a Path>,
    pub(crate) save_every: u64,
    pub(crate) keep_last: Option<usize>,
    pub(crate) resume: Option<&'a PathBuf>,
    pub(crate) allow_optimizer_change: bool,
    pub(crate) allow_nonfinite: bool,
    /// Where the trained model is written at the end (tensor by tensor).
    pub(crate) output: Option<&'a dyn ModelOutput>,
    /// Also gather the whole model into the report (tests, small models).
    pub(crate) collect_params: bool,
    /// A greedy continuation of this prompt by this many byte-level tokens,
    /// computed by the sharded model at the end (the transformer's sample).
    pub(crate) sample: Option<(&'a str, usize)>,
}

/// The [`LoopSpec`] of a model's spec (`GptSpec`, `LlamaSpec`: the same
/// field names), with its name and configuration.
macro_rules! loop_spec {
    ($spec:expr, $what:expr, $config:expr) => {
        $crate::fsdp_loop::LoopSpec {
            what: $what,
            config: $config,
            data: &*$spec.data,
            batch: $spec.batch,
            micro_batches: $spec.micro_batches,
            steps: $spec.steps,
            optimizer: $spec.optimizer,
            fsdp: &$spec.fsdp,
            replicate: $spec.replicate,
            recompute: &$spec.recompute,
            max_grad_norm: $spec.max_grad_norm,
            checkpoint_dir: $spec.checkpoint_dir.as_deref(),
            save_every: $spec.save_every,
            keep_last: $spec.keep_last,
            resume: $spec.resume.as_ref(),
            allow_optimizer_change: $spec.allow_optimizer_change,
            allow_nonfinite: $spec.allow_nonfinite,
            output: $spec.output.as_deref(),
            collect_params: $spec.collect_params,
            sample: None,
        }
    };
}
pub(crate) use loop_spec;

/// Trains on this rank of `world` the model `build` makes under FSDP (every
/// rank calls it with the same spec); `on_step(step, loss)` is called after
/// each step. A resumed run starts at its checkpoint's step, after checking
/// that the checkpoint holds the same model configuration and data.
pub(crate) fn train_sharded<C, M>(
    world: &Arc<Communicator<C>>,
    spec: LoopSpec<'_>,
    build: impl FnOnce(Fsdp<C>) -> Result<M>,
    on_step: &mut dyn FnMut(u64, f64),
) -> Result<GptReport>
where
    C: CommBackend + 'static,
    C::B: ComputeBackend,
    Fsdp<C>: Send,
    M: ShardedDecoder<C>,
{
    let micro = micro_batches(spec.batch, spec.micro_batches)?;
    let fsdp = Fsdp::new(data_parallel(world, spec.replicate)?, spec.fsdp.clone())?;
    let sharded = build(fsdp)?;
    let model = sharded.fsdp_model();
    model.apply_recompute(spec.recompute)?;
    let mut opt = ShardedOptimizer::new(spec.optimizer);
    let mut start = 0;
    let mut earlier_losses = Vec::new();
    if let Some(dir) = spec.resume {
        let options = LoadOptions { allow_optimizer_change: spec.allow_optimizer_change };
        let state = model.with_fsdp(|f| checkpoint::load(f, &mut opt, dir, &options))??;
        let changes = config_changes(&state.model, &spec.config);
        if !changes.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "{}: saved from another {} ({}); resume with the configuration it was saved with",
                dir.display(),
                spec.what,
                changes.join(", ")
            )));
        }
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
    model.with_fsdp(|f| -> Result<()> {
        f.synchronize()?;
        f.device().reset_peak_memory();
        f.device().reset_peak_host_memory();
        Ok(())
    })??;
    let before = Counters::of(model)?;
    let rank = world.rank();
    let seq = spec.data.seq_len();
    let rows = spec.batch / micro;
    let (mut losses, mut times, mut saved) = (Vec::new(), Vec::new(), Vec::new());
    let mut stopped = None;
    // The checkpoint resumed from is never pruned.
    let save_options = save_options(spec.keep_last, spec.resume);
    for step in start..spec.steps {
        let t0 = Instant::now();
        let mut local = 0.0f64;
        for m in 0..micro {
            model.with_fsdp(|f| f.set_requires_gradient_sync(m + 1 == micro))?;
            let (x, y) = spec.data.rows(step, rank * spec.batch + m * rows, rows);
            let logits = sharded.forward(&u32_tensor(x, rows, seq)?)?;
            // The targets go where the model computes (candle's CUDA device with `candle-cuda`).
            let l = loss(&logits, &u32_tensor(y, rows, seq)?.to_device(logits.device())?)?;
            let l = if micro > 1 { (l / micro as f64)? } else { l };
            local += l.to_scalar::<f32>()? as f64;
            model.backward(&l)?;
        }
        let mean = global_mean(model, local)?;
        if !mean.is_finite() && !spec.allow_nonfinite {
            // Every rank sees the same global loss, so all stop here together.
            losses.push(mean);
            times.push(t0.elapsed().as_secs_f64());
            stopped = Some(NonFinite { step, loss: mean });
            break;
        }
        if let Some(max) = spec.max_grad_norm {
            model.clip_grad_norm(max)?;
        }
        model.optimizer_step(&mut opt)?;
        model.with_fsdp(|f| f.synchronize())??;
        times.push(t0.elapsed().as_secs_f64());
        losses.push(mean);
        on_step(step, mean);
        let done = step + 1;
        let due = spec.save_every > 0 && done % spec.save_every == 0 || done == spec.steps;
        if let (Some(dir), true) = (spec.checkpoint_dir, due) {
            let losses = earlier_losses.iter().chain(&losses).copied().collect();
            let state = TrainingState { step: done, data_seed: spec.data.seed(), losses, model: spec.config.clone() };
            saved.push(model.with_fsdp(|f| checkpoint::save(f, &opt, dir, &state, &save_options))??);
        }
    }
    let counted = Counters::of(model)?.since(&before);
    // A stopped run writes no model; a completed one writes it tensor by tensor.
    if let (Some(output), None) = (spec.output, stopped) {
        model.with_fsdp(|f| crate::model_out::write_model(f, rank == 0, output))???;
    }
    let params = match spec.collect_params {
        true => model.with_fsdp(|f| f.full_parameters())??,
        false => Vec::new(),
    };
    let sample = match (spec.sample, stopped) {
        (Some((prompt, n)), None) => Some(sample_sharded(&sharded, seq, prompt, n)?),
        _ => None,
    };
    // The peak of the run's whole life after loading: the steps, the saves and the output.
    let (stats, host) = model.with_fsdp(|f| (f.device().memory_stats(), f.device().host_memory_stats()))?;
    Ok(GptReport {
        start_step: start,
        earlier_losses,
        losses,
        step_times_s: times,
        peak_memory_bytes: stats.peak_bytes,
        peak_host_memory_bytes: host.peak_bytes,
        overhead: counted.overhead,
        adapter: counted.adapter,
        groups: model.with_fsdp(|f| f.num_groups())?,
        comm_counts: counted.comm,
        params,
        sample,
        saved,
        stopped,
    })
}

/// Continues `prompt` by `n` byte-level tokens with the sharded model
/// (greedy decoding; every rank computes the same, each forward gathering
/// one group at a time), the last `seq_len` tokens as context.
fn sample_sharded<C, M>(sharded: &M, seq_len: usize, prompt: &str, n: usize) -> Result<String>
where
    C: CommBackend + 'static,
    C::B: ComputeBackend,
    Fsdp<C>: Send,
    M: ShardedDecoder<C>,
{
    let mut tokens = crate::text::encode(prompt);
    for _ in 0..if tokens.is_empty() { 0 } else { n } {
        let ctx = &tokens[tokens.len().saturating_sub(seq_len.max(1))..];
        let logits = sharded.forward(&u32_tensor(ctx.to_vec(), 1, ctx.len())?)?;
        sharded.fsdp_model().finish_without_backward()?;
        let last = logits.squeeze(0)?.get(ctx.len() - 1)?;
        tokens.push(last.argmax(0)?.to_scalar::<u32>()?);
    }
    Ok(crate::text::decode(&tokens))
}

/// How the model `config` differs from the one a checkpoint recorded
/// (`saved`, its training state's `model`): each differing field as
/// `"heads 4 -> 2"`; empty when they agree. A checkpoint that records no
/// configuration (or not an object) cannot be checked: that is a change.
pub fn config_changes<T: Serialize>(saved: &serde_json::Value, config: &T) -> Vec<String> {
    let now = serde_json::to_value(config).unwrap_or_default();
    let Some(saved) = saved.as_object() else {
        return vec![format!("no readable model configuration recorded ({saved})")];
    };
    let Some(now) = now.as_object() else { return Vec::new() };
    now.iter()
        .filter(|(k, v)| saved.get(*k) != Some(v))
        .map(|(k, v)| format!("{k} {} -> {v}", saved.get(k).map_or_else(|| "unset".into(), |s| s.to_string())))
        .collect()
}

/// Token ids as a `rows × seq` tensor.
pub(crate) fn u32_tensor(v: Vec<u32>, rows: usize, seq: usize) -> Result<Tensor> {
    Ok(Tensor::from_vec(v, (rows, seq), &Device::Cpu)?)
}

/// The micro-batch count (at least one) that divides `batch` sequences per rank.
pub(crate) fn micro_batches(batch: usize, micro_batches: usize) -> Result<usize> {
    let micro = micro_batches.max(1);
    if batch == 0 || batch % micro != 0 {
        return Err(Error::InvalidArgument(format!(
            "batch {batch} must be a positive multiple of {micro} micro-batches"
        )));
    }
    Ok(micro)
}

/// FSDP over `world`, or HSDP with a replicate dimension of `replicate`.
pub(crate) fn data_parallel<C: CommBackend>(
    world: &Arc<Communicator<C>>,
    replicate: Option<usize>,
) -> Result<DataParallel<C>>
where
    C::B: ComputeBackend,
{
    let n = world.size();
    Ok(match replicate {
        Some(r) if r > 1 => {
            if n % r != 0 {
                return Err(Error::InvalidArgument(format!("--hsdp {r} does not divide {n} ranks")));
            }
            DataParallel::hsdp(
                &Mesh::new(world, &[("replicate", r), ("shard", n / r)]).map_err(chorus_fsdp::FsdpError::from)?,
            )?
        }
        _ => DataParallel::fsdp(world.clone()),
    })
}

/// The mean over every rank of this rank's `local` loss (a collective; blocks).
pub(crate) fn global_mean<C: CommBackend + 'static>(model: &FsdpModel<C>, local: f64) -> Result<f64>
where
    C::B: ComputeBackend,
    Fsdp<C>: Send,
{
    model.with_fsdp(|f| -> Result<f64> {
        let s = f.compute_stream();
        let buf = chorus_devices::StreamExt::buffer_from(s, &[local as f32]).map_err(chorus_fsdp::FsdpError::from)?;
        Ok(f.mean_over_ranks(chorus_devices::Buffer::view(&buf))?)
    })?
}

/// Each group's pre-forward also all-gathers the next one (`groups` in
/// forward order), as FSDP2's explicit forward prefetch.
pub(crate) fn chain_forward_prefetch<C: CommBackend + 'static>(model: &FsdpModel<C>, groups: &[usize]) -> Result<()>
where
    C::B: ComputeBackend,
    Fsdp<C>: Send,
{
    model.with_fsdp(|f| -> chorus_fsdp::Result<()> {
        for w in groups.windows(2) {
            f.set_forward_prefetch(w[0], vec![w[1]])?;
        }
        Ok(())
    })??;
    Ok(())
}

/// Logits of `ids` (`[batch, seq]`, u32) through a decoder stack's stages
/// (embedding, each layer, head), carrying candle's graph through every
/// stage: in the param dtype, or cast (differentiably) to the
/// mixed-precision policy's output dtype when it names one, as FSDP2's root
/// casts the model's outputs.
pub(crate) fn forward_stages<C: CommBackend + 'static>(
    model: &FsdpModel<C>,
    embed: StageId,
    layers: &[StageId],
    head: StageId,
    ids: &Tensor,
) -> Result<Tensor>
where
    C::B: ComputeBackend,
    Fsdp<C>: Send,
{
    let mut x = model.run(embed, ids)?;
    for l in layers {
        x = model.run(*l, &x)?;
    }
    let logits = model.run(head, &x)?;
    match model.with_fsdp(|f| f.mixed_precision().output_dtype)? {
        Some(d) => Ok(logits.to_dtype(chorus_fsdp_candle::convert::candle_dtype(d)?)?),
        None => Ok(logits),
    }
}

/// How a run's saves prune: `keep_last`, never the checkpoint resumed from.
pub(crate) fn save_options(keep_last: Option<usize>, resume: Option<&PathBuf>) -> SaveOptions {
    SaveOptions { keep_last, keep: resume.iter().filter_map(|d| checkpoint::resolve(d).ok()).collect() }
}

/// FSDP's and the adapter's running counters at one moment; a report gives
/// the difference between two ([`Counters::since`]).
pub(crate) struct Counters {
    pub(crate) overhead: HostOverhead,
    pub(crate) comm: CommCounts,
    pub(crate) adapter: AdapterTimes,
}

impl Counters {
    /// The counters of `model` now.
    pub(crate) fn of<C: CommBackend + 'static>(model: &FsdpModel<C>) -> Result<Counters>
    where
        C::B: ComputeBackend,
        Fsdp<C>: Send,
    {
        Ok(Counters {
            overhead: model.with_fsdp(|f| f.host_overhead())?,
            comm: model.with_fsdp(|f| f.comm_counts())?,
            adapter: model.times()?,
        })
    }

    /// What was counted from `earlier` to `self`.
    pub(crate) fn since(&self, earlier: &Counters) -> Counters {
        Counters {
            overhead: self.overhead.since(&earlier.overhead),
            comm: CommCounts {
                all_gathers: self.comm.all_gathers - earlier.comm.all_gathers,
                reduce_scatters: self.comm.reduce_scatters - earlier.comm.reduce_scatters,
                all_reduces: self.comm.all_reduces - earlier.comm.all_reduces,
            },
            adapter: AdapterTimes {
                transfer: self.adapter.transfer - earlier.adapter.transfer,
                compute: self.adapter.compute - earlier.adapter.compute,
                stage_calls: self.adapter.stage_calls - earlier.adapter.stage_calls,
                recomputed: self.adapter.recomputed - earlier.adapter.recomputed,
            },
        }
    }
}

/// candle-nn's own optimizer matching `kind` (the plain reference's):
/// `SGD` without momentum or weight decay, `AdamW`.
pub(crate) enum PlainOptimizer {
    Sgd(candle_nn::SGD),
    AdamW(candle_nn::AdamW),
}

impl PlainOptimizer {
    pub(crate) fn new(kind: OptimizerKind, vars: Vec<Var>) -> Result<PlainOptimizer> {
        Ok(match kind {
            OptimizerKind::Sgd { lr, momentum, weight_decay, .. } if momentum == 0.0 && weight_decay == 0.0 => {
                PlainOptimizer::Sgd(candle_nn::SGD::new(vars, lr)?)
            }
            OptimizerKind::AdamW { lr, beta1, beta2, eps, weight_decay } => PlainOptimizer::AdamW(
                candle_nn::AdamW::new(vars, candle_nn::ParamsAdamW { lr, beta1, beta2, eps, weight_decay })?,
            ),
            k => return Err(Error::InvalidArgument(format!("candle-nn has no optimizer matching {k:?}"))),
        })
    }

    pub(crate) fn step(&mut self, grads: &candle_core::backprop::GradStore) -> Result<()> {
        match self {
            PlainOptimizer::Sgd(o) => o.step(grads)?,
            PlainOptimizer::AdamW(o) => o.step(grads)?,
        }
        Ok(())
    }
}

/// Scales the gradients of `vars` in `grads` as `clip_grad_norm_` does: the
/// global L2 norm (summed in f64), then `max / (norm + 1e-6)` if below one.
pub(crate) fn clip_grad_norm(grads: &mut candle_core::backprop::GradStore, vars: &[Var], max: f64) -> Result<()> {
    let mut total = 0.0f64;
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            total += g.flatten_all()?.to_vec1::<f32>()?.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>();
        }
    }
    let coef = max / (total.sqrt() + 1e-6);
    if coef < 1.0 {
        for v in vars {
            if let Some(g) = grads.get(v.as_tensor()) {
                let scaled = (g * coef)?;
                grads.insert(v.as_tensor(), scaled);
            }
        }
    }
    Ok(())
}
