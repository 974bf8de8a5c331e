//! The FSDP step loop ([`train_sharded`]) for every decoder model:
//! micro-batches, the global loss, clipping, the sharded optimizer,
//! checkpoints and their resume, the written model and the sample; with the
//! data-parallel layout and the counters a report gives as differences.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use chorus_collectives::{CommBackend, Communicator, Mesh};
use chorus_devices::{ComputeBackend, Device as _};
use chorus_fsdp::{CommCounts, DataParallel, Fsdp, HostOverhead, PendingValue, ShardedOptimizer};
use chorus_fsdp_candle::checkpoint::{self, LoadOptions, PendingSave, SaveOptions, TrainingState};
use chorus_fsdp_candle::{AdapterTimes, Error, FsdpModel, Result};
use chorus_kernels::timing;
use serde::Serialize;

use super::progress::{self, Recorder};
use super::spec::{NonFinite, Sample, SaveTime, TrainReport, TrainSpec, Validation};
use super::{loss, u32_tensor};
use crate::models::{DecoderModel, ShardedDecoder};

/// Trains `spec.model` under FSDP on this rank of `world` (every rank calls
/// it with the same spec); `on_step(step, loss)` is called after each step.
/// A resumed run starts at its checkpoint's step, after checking that the
/// checkpoint holds the same model configuration and data.
pub fn train_sharded<C, M>(
    world: Arc<Communicator<C>>,
    spec: &TrainSpec<M>,
    on_step: &mut dyn FnMut(u64, f64),
) -> Result<TrainReport>
where
    C: CommBackend + 'static,
    C::B: ComputeBackend,
    M: DecoderModel,
{
    let micro = micro_batches(spec.batch, spec.micro_batches)?;
    let base_lr = spec.optimizer.lr();
    spec.schedule.validate(spec.steps, base_lr).map_err(Error::InvalidArgument)?;
    let config = spec.model.config_json()?;
    let fsdp = Fsdp::new(data_parallel(&world, spec.replicate)?, spec.fsdp.clone())?;
    let sharded = spec.model.shard(fsdp, spec.forward_prefetch)?;
    let model = &sharded.model;
    model.apply_recompute(&spec.recompute)?;
    model.set_transfers(spec.transfers)?;
    let mut opt = ShardedOptimizer::new(spec.optimizer);
    let mut start = 0;
    let mut earlier_losses = Vec::new();
    if let Some(dir) = &spec.resume {
        let options = LoadOptions { allow_optimizer_change: spec.allow_optimizer_change };
        let state = model.with_fsdp(|f| checkpoint::load(f, &mut opt, dir, &options))??;
        let changes = config_changes(&state.model, &config);
        if !changes.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "{}: saved from another {} ({}); resume with the configuration it was saved with",
                dir.display(),
                spec.model.name(),
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
    let (mut lrs, mut saved) = (Vec::new(), Vec::new());
    let mut step_log = StepLog::default();
    // The step whose loss is on its way to the host (read during the next).
    let mut in_flight: Option<InFlight> = None;
    let mut val_losses = Vec::new();
    let mut stopped = None;
    let mut op_times = Vec::new();
    if spec.op_times {
        timing::set_enabled(true);
    }
    // The checkpoint resumed from is never pruned.
    let save_options = save_options(spec.keep_last, spec.resume.as_ref());
    // Rank 0 says how far the run got, for a run that continues it after a fault.
    let mut progress = match &spec.checkpoint_dir {
        Some(dir) if rank == 0 => Some(Recorder::start(dir, start, spec.data.seed(), config.clone())?),
        _ => None,
    };
    // The asynchronous save in flight (at most one), and when its step ended.
    let mut pending: Option<(PendingSave, u64)> = None;
    let mut saves: Vec<SaveTime> = Vec::new();
    for step in start..spec.steps {
        if spec.op_times {
            // What ran since the last step (validation, another run's tail) is not this step's.
            timing::take()?;
        }
        let t0 = Instant::now();
        let lr = spec.schedule.lr(step, spec.steps, base_lr);
        opt.set_lr(lr);
        lrs.push(lr);
        let mut local = LossSum::default();
        for m in 0..micro {
            model.with_fsdp(|f| f.set_requires_gradient_sync(m + 1 == micro))?;
            let (x, y) = spec.data.rows(step, rank * spec.batch + m * rows, rows);
            let logits = sharded.forward(&u32_tensor(x, rows, seq)?)?;
            // The targets go where the model computes (candle's CUDA device with `candle-cuda`).
            let l = loss(&logits, &u32_tensor(y, rows, seq)?.to_device(logits.device())?)?;
            let l = if micro > 1 { (l / micro as f64)? } else { l };
            local.add(&l)?;
            model.backward(&l)?;
        }
        if let Some(max) = spec.max_grad_norm {
            // Enqueued with its coefficient on the device; the norm is not read.
            let _ = model.clip_grad_norm_async(max)?;
        }
        model.optimizer_step(&mut opt)?;
        // The step's loss is enqueued (its mean over the ranks and its copy to
        // the host) behind the optimizer step, and read once the next step is
        // enqueued: the host stays one step ahead of the device and never
        // synchronizes it. Where this step's loss is needed at once (a save or
        // a validation after it, the last step, per-op times) it is read now.
        let this = InFlight { step, loss: model.mean_over_ranks_async(&local.total()?)?, started: t0 };
        let done = step + 1;
        let save_due = spec.save_every > 0 && done % spec.save_every == 0 || done == spec.steps;
        let read_now = spec.op_times
            || done == spec.steps
            || (spec.checkpoint_dir.is_some() && save_due)
            || spec.validation.as_ref().is_some_and(|v| v.due(done, spec.steps));
        let mut to_read: Vec<InFlight> = in_flight.take().into_iter().collect();
        match read_now {
            true => to_read.push(this),
            false => in_flight = Some(this),
        }
        for step_loss in to_read {
            let (at, mean) = (step_loss.step, step_log.read(step_loss)?);
            if spec.op_times {
                // Per-op times are read from events that have all completed.
                model.with_fsdp(|f| f.synchronize())??;
                op_times.push(timing::take()?);
            }
            if !mean.is_finite() && !spec.allow_nonfinite {
                // Every rank sees the same global loss, so all stop here together.
                stopped = Some(NonFinite { step: at, loss: mean });
                break;
            }
            on_step(at, mean);
        }
        if stopped.is_some() {
            // The step after the stopped one may be enqueued already: it is not reported.
            lrs.truncate(step_log.losses.len());
            break;
        }
        if let Some(v) = spec.validation.as_ref().filter(|v| v.due(done, spec.steps)) {
            val_losses.push((done, validate(&sharded, v, rank, spec.batch, micro)?));
        }
        let due = save_due;
        // The step is recorded before its save: a fault during the save has lost it.
        let step_ended_us = progress::now_us();
        if let Some(p) = progress.as_mut() {
            p.step_done(done)?;
        }
        // A save whose shards every rank has written is committed at once (every
        // rank asks at every step while one is in flight, so all agree when).
        let written = match &pending {
            Some((p, _)) => model.with_fsdp(|f| p.written_everywhere(f))??,
            None => false,
        };
        // One save in flight, so one staged copy: a save due while the last is in
        // flight commits it first (joining its writer, which frees its copy).
        if written || (due && pending.is_some()) {
            if let Some(p) = pending.take() {
                saved.push(commit_pending(model, p, &opt, &save_options, &mut saves, progress.as_mut())?);
            }
        }
        if let (Some(dir), true) = (&spec.checkpoint_dir, due) {
            let losses = earlier_losses.iter().chain(&step_log.losses).copied().collect();
            let state = TrainingState { step: done, data_seed: spec.data.seed(), losses, model: config.clone() };
            let t = Instant::now();
            let staged_bytes = if spec.async_save {
                let p = model.with_fsdp(|f| checkpoint::save_async(f, &opt, dir, &state))??;
                let bytes = p.staged_bytes();
                pending = Some((p, step_ended_us));
                bytes
            } else {
                saved.push(model.with_fsdp(|f| checkpoint::save(f, &opt, dir, &state, &save_options))??);
                if let Some(r) = progress.as_mut() {
                    r.saved(done, step_ended_us)?;
                }
                0
            };
            let blocked_s = t.elapsed().as_secs_f64();
            saves.push(SaveTime { step: done, blocked_s, commit_s: 0.0, staged_bytes, asynchronous: spec.async_save });
        }
    }
    // The last save in flight is complete before the run says it is done.
    if let Some(p) = pending.take() {
        saved.push(commit_pending(model, p, &opt, &save_options, &mut saves, progress.as_mut())?);
    }
    let counted = Counters::of(model)?.since(&before);
    // A stopped run writes no model; a completed one writes it tensor by tensor.
    if let (Some(output), None) = (&spec.output, stopped) {
        model.with_fsdp(|f| crate::model_out::write_model(f, rank == 0, &**output))???;
    }
    let params = match spec.collect_params {
        true => model.with_fsdp(|f| f.full_parameters())??,
        false => Vec::new(),
    };
    let sample = match (&spec.sample, stopped) {
        (Some(s), None) => Some(sample_sharded(&sharded, seq, spec.model.vocab_size(), s)?),
        _ => None,
    };
    // The peak of the run's whole life after loading: the steps, the saves and the output.
    let (stats, host) = model.with_fsdp(|f| (f.device().memory_stats(), f.device().host_memory_stats()))?;
    Ok(TrainReport {
        start_step: start,
        earlier_losses,
        losses: step_log.losses,
        lrs,
        val_losses,
        step_times_s: step_log.times,
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
        op_times,
        saves,
    })
}

/// The mean loss over `v`'s rows, each rank evaluating its `batch` rows of
/// every global batch in `micro` pieces (forward only), the global mean
/// taken as the training loss's is (every piece has as many tokens).
fn validate<C>(sharded: &ShardedDecoder<C>, v: &Validation, rank: usize, batch: usize, micro: usize) -> Result<f64>
where
    C: CommBackend + 'static,
    C::B: ComputeBackend,
{
    let (seq, rows) = (v.data.seq_len(), batch / micro);
    let mut local = LossSum::default();
    for b in 0..v.batches {
        for m in 0..micro {
            let (x, y) = v.data.rows(b as u64, rank * batch + m * rows, rows);
            let logits = sharded.forward(&u32_tensor(x, rows, seq)?)?;
            local.add(&loss(&logits, &u32_tensor(y, rows, seq)?.to_device(logits.device())?)?)?;
            sharded.model.finish_without_backward()?;
        }
    }
    // The mean of the pieces in f64 (a division, as the host's was), then over the ranks.
    let sum = local.total()?;
    let pieces = Tensor::new((v.batches * micro).max(1) as f64, sum.device())?;
    Ok(sharded.model.mean_over_ranks_async(&sum.broadcast_div(&pieces)?)?.read()?)
}

/// Continues the sample's prompt by its number of tokens with the sharded
/// model (greedy decoding; every rank computes the same, each forward
/// gathering one group at a time), the last `seq_len` tokens as context.
/// A prompt with ids outside the model's `vocab` is an error.
fn sample_sharded<C>(sharded: &ShardedDecoder<C>, seq_len: usize, vocab: usize, s: &Sample) -> Result<String>
where
    C: CommBackend + 'static,
    C::B: ComputeBackend,
{
    let codec_err = |e: crate::codec::CodecError| Error::InvalidArgument(format!("sample: {e}"));
    let mut tokens = s.codec.encode(&s.prompt).map_err(codec_err)?;
    if let Some(id) = tokens.iter().find(|t| **t as usize >= vocab) {
        return Err(Error::InvalidArgument(format!(
            "sample: the prompt's token {id} is outside the model's vocabulary of {vocab}"
        )));
    }
    for _ in 0..if tokens.is_empty() { 0 } else { s.tokens } {
        let ctx = &tokens[tokens.len().saturating_sub(seq_len.max(1))..];
        let logits = sharded.forward(&u32_tensor(ctx.to_vec(), 1, ctx.len())?)?;
        sharded.model.finish_without_backward()?;
        let last = logits.squeeze(0)?.get(ctx.len() - 1)?;
        tokens.push(last.argmax(0)?.to_scalar::<u32>()?);
    }
    s.codec.decode(&tokens).map_err(codec_err)
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

/// The micro-batch count (at least one) that divides `batch` sequences per rank.
fn micro_batches(batch: usize, micro_batches: usize) -> Result<usize> {
    let micro = micro_batches.max(1);
    if batch == 0 || batch % micro != 0 {
        return Err(Error::InvalidArgument(format!(
            "batch {batch} must be a positive multiple of {micro} micro-batches"
        )));
    }
    Ok(micro)
}

/// FSDP over `world`, or HSDP with a replicate dimension of `replicate`.
fn data_parallel<C: CommBackend>(world: &Arc<Communicator<C>>, replicate: Option<usize>) -> Result<DataParallel<C>>
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

/// A sum of losses kept where they are computed (candle's CUDA device with
/// `candle-cuda`), in f64 (the exact sum of the f32 losses, as a host sum
/// would be), whose mean over the ranks a step enqueues once
/// ([`FsdpModel::mean_over_ranks_async`]) instead of waiting for the device
/// after every micro-batch's forward.
#[derive(Default)]
struct LossSum(Option<Tensor>);

impl LossSum {
    /// Adds `l` (a one-element loss; its graph is not followed).
    fn add(&mut self, l: &Tensor) -> Result<()> {
        let l = l.detach().to_dtype(candle_core::DType::F64)?.reshape(())?;
        self.0 = Some(match self.0.take() {
            Some(sum) => (sum + l)?,
            None => l,
        });
        Ok(())
    }

    /// The sum, where it was computed (zero, on the host, when nothing was added).
    fn total(&self) -> Result<Tensor> {
        Ok(match &self.0 {
            Some(sum) => sum.clone(),
            None => Tensor::new(0f64, &candle_core::Device::Cpu)?,
        })
    }
}

/// A step whose global loss is on its way to the host.
struct InFlight {
    step: u64,
    loss: PendingValue,
    /// When the step's enqueueing began.
    started: Instant,
}

/// The losses and times of the steps read so far.
#[derive(Default)]
struct StepLog {
    losses: Vec<f64>,
    times: Vec<f64>,
    /// When the last step's loss reached the host.
    last_read: Option<Instant>,
}

impl StepLog {
    /// Reads `step`'s loss (waiting for the device up to it) and records it
    /// with the step's time: from its start, or from when the step before it
    /// was read if that was later (the host enqueues a step while the device
    /// runs the one before, so in a run's steady state this is the device's
    /// time per step).
    fn read(&mut self, step: InFlight) -> Result<f64> {
        let mean = step.loss.read()?;
        let now = Instant::now();
        let from = self.last_read.map_or(step.started, |r| r.max(step.started));
        self.times.push((now - from).as_secs_f64());
        self.losses.push(mean);
        self.last_read = Some(now);
        Ok(mean)
    }
}

/// Completes the asynchronous save in flight (a collective: every rank
/// waits for its writer, then the commit), counts the time it blocked on its
/// step's [`SaveTime`], and has rank 0 record the save in its progress
/// (`at_us`: when the saved step ended). Returns the checkpoint's directory.
fn commit_pending<C: CommBackend + 'static>(
    model: &FsdpModel<C>,
    (pending, at_us): (PendingSave, u64),
    opt: &ShardedOptimizer<C>,
    options: &SaveOptions,
    saves: &mut [SaveTime],
    progress: Option<&mut Recorder>,
) -> Result<PathBuf>
where
    C::B: ComputeBackend,
{
    let step = pending.step();
    let t = Instant::now();
    let dir = model.with_fsdp(|f| pending.commit(f, opt, options))??;
    if let Some(s) = saves.iter_mut().rev().find(|s| s.step == step) {
        s.blocked_s += t.elapsed().as_secs_f64();
        s.commit_s += t.elapsed().as_secs_f64();
    }
    if let Some(r) = progress {
        r.saved(step, at_us)?;
    }
    Ok(dir)
}

/// How a run's saves prune: `keep_last`, never the checkpoint resumed from.
fn save_options(keep_last: Option<usize>, resume: Option<&PathBuf>) -> SaveOptions {
    SaveOptions { keep_last, keep: resume.iter().filter_map(|d| checkpoint::resolve(d).ok()).collect() }
}

/// FSDP's and the adapter's running counters at one moment; a report gives
/// the difference between two ([`Counters::since`]).
struct Counters {
    overhead: HostOverhead,
    comm: CommCounts,
    adapter: AdapterTimes,
}

impl Counters {
    /// The counters of `model` now.
    fn of<C: CommBackend + 'static>(model: &FsdpModel<C>) -> Result<Counters>
    where
        C::B: ComputeBackend,
    {
        Ok(Counters {
            overhead: model.with_fsdp(|f| f.host_overhead())?,
            comm: model.with_fsdp(|f| f.comm_counts())?,
            adapter: model.times()?,
        })
    }

    /// What was counted from `earlier` to `self`.
    fn since(&self, earlier: &Counters) -> Counters {
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
                staged_transfers: self.adapter.staged_transfers - earlier.adapter.staged_transfers,
            },
        }
    }
}
