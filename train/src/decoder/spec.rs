//! What a training run is given ([`TrainSpec`]) and what it reports
//! ([`TrainReport`], [`PlainReport`]), for every decoder model.

use std::path::PathBuf;
use std::sync::Arc;

use chorus_fsdp::{CommCounts, FsdpConfig, HostOverhead, OptimizerKind};
use chorus_fsdp_candle::{AdapterTimes, Error, Recompute, Transfers};
use chorus_kernels::timing::{OpKind, OpTime};

use super::data::Data;
use crate::codec::TextCodec;
use crate::model_out::ModelOutput;
use crate::schedule::Schedule;

/// What to train.
#[derive(Clone, Debug)]
pub struct TrainSpec<M> {
    /// The model: its configuration and initial parameters
    /// ([`GptModel`](crate::models::gpt::GptModel),
    /// [`LlamaModel`](crate::models::llama::LlamaModel)).
    pub model: M,
    /// The data.
    pub data: Arc<Data>,
    /// Sequences per rank per step.
    pub batch: usize,
    /// The step to stop before (a resumed run starts at its checkpoint's step).
    pub steps: u64,
    /// The optimizer, with the base lr.
    pub optimizer: OptimizerKind,
    /// The lr of each step: the base lr times the schedule's factor.
    pub schedule: Schedule,
    /// Held-out rows to evaluate the model on while it trains.
    pub validation: Option<Validation>,
    /// FSDP settings.
    pub fsdp: FsdpConfig,
    /// HSDP: the replicate dimension's size.
    pub replicate: Option<usize>,
    /// Clip the global gradient norm to this.
    pub max_grad_norm: Option<f64>,
    /// Each group's pre-forward also all-gathers the next group.
    pub forward_prefetch: bool,
    /// Which groups (`root`, `blocks.{i}`, `model.layers.{i}`) recompute
    /// their stages in backward (activation checkpointing) and which keep
    /// their forward graphs.
    pub recompute: Recompute,
    /// How parameters and gradients cross between FSDP's buffers and
    /// candle's CPU ([`Transfers::Staged`]: the readback and upload route of
    /// a device without host memory, on any device).
    pub transfers: Transfers,
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
    /// one tensor at a time (e.g. [`SafetensorsOutput`](crate::model_out::SafetensorsOutput),
    /// [`HfOutput`](crate::models::llama::hf::HfOutput)).
    pub output: Option<Arc<dyn ModelOutput>>,
    /// Also gather the whole trained model into [`TrainReport::params`] on
    /// every rank (tests and small models; a run's outputs do not need it).
    pub collect_params: bool,
    /// A greedy continuation of a prompt, computed by the sharded model at
    /// the end ([`TrainReport::sample`]).
    pub sample: Option<Sample>,
    /// Record each fused op kind's calls and device time per step
    /// ([`TrainReport::op_times`]): turns chorus-kernels' process-wide
    /// [`timing`](chorus_kernels::timing) on (and leaves it on: other ranks
    /// of this process may still be stepping).
    pub op_times: bool,
    /// Write checkpoints while the training goes on
    /// ([`save_async`](chorus_fsdp_candle::checkpoint::save_async)): the step
    /// waits only for the copy of the rank's state to host memory, one save
    /// is in flight at a time, and it is committed once every rank's writer
    /// is done (or before the next save, or at the end).
    pub async_save: bool,
}

impl<M> TrainSpec<M> {
    /// `steps` steps of `batch` sequences per rank of `model` on `data`, with
    /// the defaults of `chorus train`: FSDP's default settings, no HSDP, no
    /// clipping, a constant lr, forward prefetch, every group recomputed,
    /// one micro-batch, no checkpoints, and a stop
    /// on a loss that is not finite. Change the rest with struct update syntax.
    pub fn new(model: M, data: Arc<Data>, batch: usize, steps: u64, optimizer: OptimizerKind) -> TrainSpec<M> {
        TrainSpec {
            model,
            data,
            batch,
            steps,
            optimizer,
            schedule: Schedule::default(),
            validation: None,
            fsdp: FsdpConfig::default(),
            replicate: None,
            max_grad_norm: None,
            forward_prefetch: true,
            recompute: Recompute::All,
            transfers: Transfers::Direct,
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
            op_times: false,
            async_save: false,
        }
    }
}

/// The sample a run ends with: `tokens` greedy tokens after `prompt`,
/// encoded and decoded by `codec`.
#[derive(Clone, Debug)]
pub struct Sample {
    /// The text continued.
    pub prompt: String,
    /// How many tokens are added.
    pub tokens: usize,
    /// Text to ids and back (the model's vocabulary).
    pub codec: Arc<dyn TextCodec>,
}

/// The validation of a run: the mean loss over a fixed set of held-out
/// rows, evaluated (forward only) after every `every` steps and after the
/// last step.
#[derive(Clone, Debug)]
pub struct Validation {
    /// The rows: global batch `b` is `data.rows(b, ..)`, with the run's
    /// global batch size (each rank evaluates its share).
    pub data: Arc<Data>,
    /// Global batches evaluated, `0 .. batches`.
    pub batches: usize,
    /// Steps between evaluations (0: only after the last step).
    pub every: u64,
}

impl Validation {
    /// Whether the model is evaluated after `done` steps of a run of `steps`.
    pub fn due(&self, done: u64, steps: u64) -> bool {
        done == steps || self.every > 0 && done % self.every == 0
    }
}

/// What one rank measured.
#[derive(Clone, Debug)]
pub struct TrainReport {
    /// The step this run started at (0, or the resumed checkpoint's).
    pub start_step: u64,
    /// The losses of the steps before `start_step`, as the checkpoint recorded them.
    pub earlier_losses: Vec<f64>,
    /// The global mean loss of each step this run took, before its update.
    pub losses: Vec<f64>,
    /// The lr of each step this run took.
    pub lrs: Vec<f64>,
    /// `(steps done, mean validation loss)` at each evaluation of this run.
    pub val_losses: Vec<(u64, f64)>,
    /// Wall time of each step: from its start (or from when the step before
    /// it reached the host, if later) to when its loss reached the host. The
    /// host enqueues a step while the device runs the one before, so in a
    /// run's steady state this is the device's time per step.
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
    /// (without `allow_nonfinite`): that step's loss is the last of `losses`
    /// (read once the next step is enqueued, so the shards may hold that
    /// step's update too; a stopped run writes nothing from them).
    pub stopped: Option<NonFinite>,
    /// Where the spec asked for them ([`TrainSpec::op_times`]), each step's
    /// calls and device time of every fused op kind on this rank, one entry
    /// per step of `step_times_s` (what ran between steps, validation and
    /// the sample, left out); empty otherwise.
    pub op_times: Vec<Vec<(OpKind, OpTime)>>,
    /// How long each checkpoint save of this run held the step.
    pub saves: Vec<SaveTime>,
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

/// What the plain candle run measured.
#[derive(Clone, Debug)]
pub struct PlainReport {
    /// The mean loss of each step over the global batch.
    pub losses: Vec<f64>,
    /// The lr of each step.
    pub lrs: Vec<f64>,
    /// `(steps done, mean validation loss)` at each evaluation.
    pub val_losses: Vec<(u64, f64)>,
    /// Wall time of each step.
    pub step_times_s: Vec<f64>,
    /// The final parameters.
    pub params: Vec<(String, Vec<f32>)>,
}

/// How long one checkpoint save held the step.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SaveTime {
    /// The step the checkpoint is of.
    pub step: u64,
    /// Seconds the training waited for it: the whole save when blocking;
    /// asynchronous, the copy to host memory and the commit (the wait for
    /// the writers still running at the commit, the ranks' agreement and
    /// the first rank's index, manifest and renames).
    pub blocked_s: f64,
    /// Of `blocked_s`, an asynchronous save's commit (0 when blocking).
    pub commit_s: f64,
    /// Bytes of this rank's state copied to host memory (0 when blocking).
    pub staged_bytes: u64,
    /// Whether the shards were written while the training went on.
    pub asynchronous: bool,
}
