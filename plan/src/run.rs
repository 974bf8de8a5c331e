//! Every rank's FSDP run on the virtual device and communicator.
//!
//! Each rank run is a thread that builds [`Fsdp`] with the groups and settings
//! `chorus train` builds, then drives the hooks in the order the candle
//! adapter (`fsdp/candle/src/module.rs`) and the training loop
//! (`train/src/decoder/sharded.rs`) do: per micro-batch, the stages in
//! forward order (a group's pre-forward at its first stage, post-forward
//! after its last), then backward in reverse (pre-backward at each stage,
//! post-backward after the group's last), finalize; then the global mean of
//! the loss, clipping, the optimizer step and `zero_grad`. Between the hooks
//! each stage's [`StageWork`] runs on the compute stream, its activations
//! counted apart from FSDP's memory. The last step is measured.
//!
//! Which ranks run ([`Ranks`]): every one, a thread each, or — what
//! makes plans of thousands of ranks cheap — the first and the last, the
//! others mirroring them ([`VirtWorld::symmetric`]): every rank of a
//! data-parallel group runs the same FSDP program on shards of one padded
//! size, and a collective's time depends on where its ranks sit, not on
//! their data. A test holds the two to the same results on small worlds
//! (`plan/tests/symmetric.rs`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chorus_collectives::recorder::RecorderOptions;
use chorus_collectives::{CommError, Communicator, Mesh};
use chorus_devices::{Buffer as _, Device as _, DeviceError, Event as _, Stream as _, StreamExt as _};
use chorus_fsdp::{
    DataParallel, DeferredParam, Fsdp, FsdpConfig, FsdpError, OptimizerKind, ShardSource, ShardedOptimizer,
};

use crate::cost::{CostModel, Issuer};
use crate::virt::comm::{CollectiveRecord, Divergence, SplitQuery, SplitRule, VirtComm, VirtWorld};
use crate::virt::{TraceOp, VirtConfig, VirtDevice};
use crate::workload::StageWork;

/// The names of FSDP's streams in the order [`Fsdp::new`] creates them
/// (`fsdp/src/state.rs`): a traced operation's `stream` indexes this.
pub const FSDP_STREAMS: [&str; 5] = ["compute", "copy-in", "all-gather", "reduce-scatter", "all-reduce"];

/// The most ranks [`Ranks::Every`] runs, a thread each (with a stack of
/// 1 MiB, under an 8 GB address-space limit with room to spare).
pub const MAX_THREADED_RANKS: usize = 1024;

/// The largest shard of one parameter a plan registers, bytes: FSDP reads
/// a shard's rows into host memory before it uploads them, and the planner
/// gives it zeros of that size (a rank registers one parameter at a time).
pub const MAX_SHARD_BYTES: usize = 1 << 30;

/// Why a plan could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The inputs are inconsistent.
    #[error("invalid plan: {0}")]
    Invalid(String),
    /// FSDP refused something on a rank (a divergence arrives as its `Comm` error).
    #[error("rank {rank}: {source}")]
    Rank {
        /// The rank.
        rank: usize,
        /// FSDP's error.
        source: FsdpError,
    },
    /// A rank's thread could not be started or panicked.
    #[error("rank {rank}: {reason}")]
    Thread {
        /// The rank.
        rank: usize,
        /// What happened.
        reason: String,
    },
    /// [`Ranks::Symmetric`] does not hold: the ranks do not all run alike.
    #[error("the ranks are not alike, so one cannot stand for the others: {0}")]
    Asymmetric(String),
}

/// Which ranks a plan runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ranks {
    /// Every rank, a thread each (at most [`MAX_THREADED_RANKS`]).
    Every,
    /// The first and the last rank; every other mirrors them (the module's
    /// doc). Needs a model whose stages are the same on every rank
    /// ([`ModelSpec::same_on_every_rank`]) and a placement where every
    /// communicator of a kind (the mesh's rows, its columns, the
    /// post-forward groups) costs alike ([`CostModel::prices_alike`]):
    /// else [`PlanError::Asymmetric`].
    Symmetric,
}

/// One FSDP param group: as `chorus train` registers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    /// The group's name (`root`, `blocks.3`, `model.layers.3`).
    pub name: String,
    /// Its parameters' full names and shapes, in registration order.
    pub params: Vec<(String, Vec<usize>)>,
    /// FSDP2's root: not resharded after forward.
    pub root: bool,
}

/// One stage of a rank's model: its group, its work, and the groups that
/// run inside it (routed experts, each between this stage's hooks).
#[derive(Clone, Debug, PartialEq)]
pub struct Stage {
    /// The group whose parameters the stage uses.
    pub group: usize,
    /// Its kernels and activation memory for one micro-batch.
    pub work: StageWork,
    /// Groups run (forward, then backward in reverse) inside this stage on this rank.
    pub inner: Vec<usize>,
}

/// Each rank's stages, in forward order.
pub type StagesOf = Arc<dyn Fn(usize) -> Vec<Stage> + Send + Sync>;

/// The model as FSDP sees it.
#[derive(Clone)]
pub struct ModelSpec {
    /// The param groups, in registration order.
    pub groups: Vec<GroupSpec>,
    /// Each rank's stages.
    pub stages_of: StagesOf,
    /// Routed groups per parent ([`Fsdp::set_routed_groups`]).
    pub routed: Vec<(usize, Vec<usize>)>,
    /// Whether `stages_of` gives every rank the same stages (a decoder:
    /// yes; ranks routed to different experts: no).
    pub same_on_every_rank: bool,
}

impl std::fmt::Debug for ModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelSpec").field("groups", &self.groups.len()).field("routed", &self.routed).finish()
    }
}

impl ModelSpec {
    /// A decoder as `chorus train` shards it: `groups` in registration
    /// order, the embedding's stage on group `embed`, layer `i`'s on group
    /// `i + 1`, the head's on group `head`; `work` the stages in forward
    /// order (`embed`, each layer, `head`).
    pub fn decoder(
        groups: Vec<GroupSpec>,
        embed: usize,
        head: usize,
        work: Vec<StageWork>,
    ) -> Result<ModelSpec, PlanError> {
        let layers = work.len().saturating_sub(2);
        if work.len() < 2 || layers + 1 > groups.len() || embed >= groups.len() || head >= groups.len() {
            return Err(PlanError::Invalid(format!(
                "{} stages of work for {} groups (embedding group {embed}, head group {head}): a decoder has its embedding, its layers (one group each) and its head",
                work.len(),
                groups.len()
            )));
        }
        let last = work.len() - 1;
        let stages: Vec<Stage> = work
            .into_iter()
            .enumerate()
            .map(|(i, work)| {
                let group = match i {
                    0 => embed,
                    i if i == last => head,
                    i => i,
                };
                Stage { group, work, inner: Vec::new() }
            })
            .collect();
        Ok(ModelSpec {
            groups,
            stages_of: Arc::new(move |_| stages.clone()),
            routed: Vec::new(),
            same_on_every_rank: true,
        })
    }
}

/// How to run: what `chorus train` is given beyond the model.
#[derive(Clone, Debug)]
pub struct RunSpec {
    /// Ranks.
    pub world: usize,
    /// Which of them run.
    pub ranks: Ranks,
    /// HSDP's replicate dimension (`None` or 1: plain FSDP).
    pub replicate: Option<usize>,
    /// FSDP's settings.
    pub fsdp: FsdpConfig,
    /// Each group's pre-forward also all-gathers the next group.
    pub forward_prefetch: bool,
    /// The optimizer.
    pub optimizer: OptimizerKind,
    /// Clip the global gradient norm.
    pub max_grad_norm: Option<f64>,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Steps (the last is measured; 2 measures one in the steady state).
    pub steps: usize,
    /// Model the cpu device (kernels reach host memory) rather than a GPU.
    pub kernels_reach_host: bool,
    /// The rank whose measured step is traced for the timeline.
    pub trace_rank: Option<usize>,
    /// How long (real time) a rank waits for the others at a collective.
    pub timeout: Duration,
}

impl RunSpec {
    /// `world` ranks for `steps` steps, every one run: FSDP's default
    /// settings, forward prefetch, AdamW (lr 1e-3, weight decay 0.01), one
    /// micro-batch, no clipping, no HSDP, kernels that reach host memory
    /// (the cpu device), nothing traced, a 60 s deadline. Callers change
    /// what they need.
    pub fn new(world: usize, steps: usize) -> RunSpec {
        RunSpec {
            world,
            ranks: Ranks::Every,
            replicate: None,
            fsdp: FsdpConfig::default(),
            forward_prefetch: true,
            optimizer: OptimizerKind::adamw(1e-3, 0.01),
            max_grad_norm: None,
            micro_batches: 1,
            steps,
            kernels_reach_host: true,
            trace_rank: None,
            timeout: Duration::from_secs(60),
        }
    }
}

/// What one rank's run gave.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct RankPlan {
    /// The rank.
    pub rank: usize,
    /// FSDP's device peak from the first step on (`chorus train`'s `peak_memory_bytes`).
    pub fsdp_peak_bytes: usize,
    /// The host space's peak (offload).
    pub host_peak_bytes: usize,
    /// Device bytes of FSDP's sharded gradients after the measured step's
    /// backward (held until `zero_grad`, which frees exactly these).
    pub gradient_bytes: usize,
    /// The same in host memory (offload).
    pub host_gradient_bytes: usize,
    /// Seconds the host spent in the measured step's offloaded optimizer
    /// step (a GPU whose kernels cannot reach host memory; else 0).
    pub host_step_s: f64,
    /// The activations' peak.
    pub activation_peak_bytes: usize,
    /// Device memory of FSDP and the activations together, at its peak.
    pub peak_bytes: usize,
    /// Device bytes held before the first step: the sharded f32 masters.
    pub sharded_param_bytes: usize,
    /// Device bytes the optimizer step added and kept (its state).
    pub optimizer_state_bytes: usize,
    /// The measured step, seconds of virtual time.
    pub step_time_s: f64,
    /// Seconds the compute stream was busy in the measured step.
    pub compute_busy_s: f64,
    /// Seconds the host spent issuing operations in the measured step
    /// (`CostModel::host_cost`; its waits not counted). Above
    /// `compute_busy_s`, the step is host-bound.
    pub host_issue_s: f64,
    /// Every collective this rank issued, in order, on every communicator
    /// (as [`PlanRun::sequences`] holds it).
    pub collectives: Vec<CollectiveRecord>,
    /// The measured step's operations (the traced rank only).
    pub trace: Vec<TraceOp>,
}

/// Every rank's run.
#[derive(Clone, Debug)]
pub struct PlanRun {
    /// The ranks run, in rank order (every rank, or those of [`Ranks::Symmetric`]).
    pub run_ranks: Vec<usize>,
    /// Per rank run (as `run_ranks`): its plan, or why it failed.
    pub ranks: Vec<Result<RankPlan, String>>,
    /// Per rank run, every collective it issued (up to its failure, for a rank that failed).
    pub sequences: Vec<Vec<CollectiveRecord>>,
    /// The first divergence of the ranks' collectives, if they diverged.
    pub divergence: Option<Divergence>,
}

/// Runs `model` on the ranks of `spec` ([`RunSpec::ranks`]) with `cost`'s times.
pub fn run(model: &ModelSpec, spec: &RunSpec, cost: Arc<dyn CostModel>) -> Result<PlanRun, PlanError> {
    if spec.world == 0 || spec.steps == 0 || spec.micro_batches == 0 {
        return Err(PlanError::Invalid("ranks, steps and micro-batches must be positive".into()));
    }
    if let Some(r) = spec.replicate.filter(|r| *r > 1) {
        if spec.world % r != 0 {
            return Err(PlanError::Invalid(format!("--hsdp {r} does not divide {} ranks", spec.world)));
        }
    }
    let (world, running) = match spec.ranks {
        Ranks::Every => {
            if spec.world > MAX_THREADED_RANKS {
                return Err(PlanError::Invalid(format!(
                    "{} ranks: a plan that runs every rank runs a thread each, at most {MAX_THREADED_RANKS} (a symmetric plan runs two)",
                    spec.world
                )));
            }
            (VirtWorld::new(spec.world, cost.clone(), spec.timeout), (0..spec.world).collect::<Vec<_>>())
        }
        Ranks::Symmetric => {
            if !model.same_on_every_rank {
                return Err(PlanError::Asymmetric("the model's stages differ between ranks (routed experts)".into()));
            }
            check_placement(spec, cost.as_ref())?;
            let running: Vec<usize> = if spec.world == 1 { vec![0] } else { vec![0, spec.world - 1] };
            (VirtWorld::symmetric(spec.world, &running, split_rule(spec), cost.clone(), spec.timeout), running)
        }
    };
    let logs: Vec<Log> = running.iter().map(|_| Log::default()).collect();
    let mut no_thread = None;
    let results: Vec<Result<RankPlan, String>> = std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(running.len());
        for (&rank, log) in running.iter().zip(&logs) {
            let (rank_world, cost, log) = (world.clone(), cost.clone(), log.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("plan-rank{rank}"))
                .stack_size(1 << 20)
                .spawn_scoped(scope, move || {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        run_rank(model, spec, &rank_world, cost, rank, log)
                    }));
                    rank_world.rank_ended(rank);
                    match r {
                        Ok(r) => r.map_err(|e| e.to_string()),
                        Err(_) => Err(format!("rank {rank} panicked")),
                    }
                });
            match spawned {
                Ok(h) => handles.push((rank, h)),
                Err(e) => {
                    // The ranks started wait for this one: they fail at once, nothing hangs.
                    let reason = format!("no thread for it: {e}");
                    world.abort(&format!("rank {rank}: {reason}"));
                    no_thread = Some(PlanError::Thread { rank, reason });
                    break;
                }
            }
        }
        handles.into_iter().map(|(rank, h)| h.join().unwrap_or_else(|_| Err(format!("rank {rank} panicked")))).collect()
    });
    if let Some(e) = no_thread {
        return Err(e);
    }
    let sequences = logs.iter().map(|l| l.lock().map(|l| l.clone()).unwrap_or_default()).collect();
    Ok(PlanRun { run_ranks: running, ranks: results, sequences, divergence: world.divergence() })
}

/// How the ranks a symmetric plan does not run split their communicators,
/// as FSDP and the mesh split them (`Mesh::new` in
/// `collectives/src/mesh.rs`: row-major coordinates, one split per
/// dimension; `Fsdp`'s post-forward world in `fsdp/src/state.rs`: blocks
/// of `k` consecutive shard ranks). The ranks that run check it: a split
/// of theirs that differs from this rule fails the plan, naming both.
fn split_rule(spec: &RunSpec) -> SplitRule {
    let hsdp = spec.replicate.filter(|r| *r > 1).map(|r| spec.world / r);
    let post_forward = match spec.fsdp.reshard_after_forward {
        chorus_fsdp::Reshard::To(k) if k > 0 => Some(k),
        _ => None,
    };
    Arc::new(move |q: &SplitQuery<'_>| {
        let shard_comm = match hsdp {
            None => q.communicator == "root",
            Some(_) => q.communicator.strip_prefix("root/split1:color").is_some_and(|c| !c.contains('/')),
        };
        match (hsdp, q.communicator, q.split) {
            // The mesh [replicate r, shard s]: coordinates (i / s, i % s).
            (Some(s), "root", 0) => Some((Some(u32::try_from(q.index % s).ok()?), (q.index / s) as i64)),
            (Some(s), "root", 1) => Some((Some(u32::try_from(q.index / s).ok()?), (q.index % s) as i64)),
            (_, _, 0) if shard_comm => {
                let k = post_forward?;
                Some((Some(u32::try_from(q.index / k).ok()?), (q.index % k) as i64))
            }
            _ => None,
        }
    })
}

/// The communicators of `spec`'s ranks by kind, each kind's groups as
/// global ranks: the mesh's rows (shard) and columns (replicate) under
/// HSDP, and the post-forward groups of `k` consecutive shard ranks.
fn communicator_kinds(spec: &RunSpec) -> Vec<(&'static str, Vec<Vec<usize>>)> {
    let n = spec.world;
    let (r, s) = match spec.replicate.filter(|r| *r > 1) {
        Some(r) => (r, n / r),
        None => (1, n),
    };
    let rows: Vec<Vec<usize>> = (0..r).map(|row| (row * s..(row + 1) * s).collect()).collect();
    let mut kinds = Vec::new();
    if r > 1 {
        kinds.push(("the mesh's replicate groups", (0..s).map(|c| (0..r).map(|row| row * s + c).collect()).collect()));
        kinds.push(("the mesh's shard groups", rows.clone()));
    }
    if let chorus_fsdp::Reshard::To(k) = spec.fsdp.reshard_after_forward {
        if k > 0 && k < s && s % k == 0 {
            let blocks = rows.iter().flat_map(|row| row.chunks(k).map(|b| b.to_vec())).collect();
            kinds.push(("the post-forward groups", blocks));
        }
    }
    kinds
}

/// [`Ranks::Symmetric`]'s condition on the placement: within each kind of
/// communicator, every group costs what the first does.
fn check_placement(spec: &RunSpec, cost: &dyn CostModel) -> Result<(), PlanError> {
    let head = |g: &[usize]| match g {
        [a, .., b] => format!("ranks {a}..={b}"),
        [a] => format!("rank {a}"),
        [] => "no ranks".into(),
    };
    for (kind, groups) in communicator_kinds(spec) {
        if let Some(g) = groups.iter().find(|g| !cost.prices_alike(&groups[0], g)) {
            return Err(PlanError::Asymmetric(format!(
                "{kind} sit differently on the nodes ({} of {} and {} of {} ranks): their collectives take different times",
                head(&groups[0]),
                groups[0].len(),
                head(g),
                g.len()
            )));
        }
    }
    Ok(())
}

/// A parameter's values in a plan: zeros, never materialised beyond one shard.
struct Zeros {
    shape: Vec<usize>,
}

impl ShardSource for Zeros {
    fn read_rows(&self, dim: usize, rows: std::ops::Range<usize>) -> Result<Vec<f32>, String> {
        if self.shape.is_empty() {
            return Ok(vec![0.0]);
        }
        let outer: usize = self.shape[..dim.min(self.shape.len())].iter().product();
        let inner: usize = self.shape.get(dim + 1..).map_or(1, |s| s.iter().product());
        let n = outer
            .checked_mul(rows.len())
            .and_then(|n| n.checked_mul(inner))
            .filter(|n| n.saturating_mul(4) <= MAX_SHARD_BYTES)
            .ok_or_else(|| {
                format!("rows {rows:?} of {:?}: a shard above the planner's {MAX_SHARD_BYTES} bytes", self.shape)
            })?;
        // Zeroed pages: nothing is written, and the virtual device reads none of it.
        Ok(vec![0.0; n])
    }
}

fn fsdp_err(rank: usize) -> impl Fn(FsdpError) -> PlanError {
    move |source| PlanError::Rank { rank, source }
}

fn comm_err(rank: usize) -> impl Fn(CommError) -> PlanError {
    move |e| PlanError::Rank { rank, source: FsdpError::Comm(e) }
}

fn dev_err(rank: usize) -> impl Fn(DeviceError) -> PlanError {
    move |e| PlanError::Rank { rank, source: FsdpError::from(e) }
}

/// FSDP over `world`, or HSDP with a replicate dimension of `replicate`
/// (as `chorus train`'s loop builds it).
fn data_parallel(
    world: Arc<Communicator<VirtComm>>,
    replicate: Option<usize>,
) -> Result<DataParallel<VirtComm>, FsdpError> {
    let n = world.size();
    Ok(match replicate {
        Some(r) if r > 1 => DataParallel::hsdp(&Mesh::new(&world, &[("replicate", r), ("shard", n / r)])?)?,
        _ => DataParallel::fsdp(world),
    })
}

type Log = Arc<Mutex<Vec<CollectiveRecord>>>;

fn run_rank(
    model: &ModelSpec,
    spec: &RunSpec,
    world: &Arc<VirtWorld>,
    cost: Arc<dyn CostModel>,
    rank: usize,
    log: Log,
) -> Result<RankPlan, PlanError> {
    let (fe, ce, de) = (fsdp_err(rank), comm_err(rank), dev_err(rank));
    let device = VirtDevice::new(VirtConfig { ordinal: rank, kernels_reach_host: spec.kernels_reach_host }, cost);
    let comm = world.communicator(rank, device.clone(), log.clone()).map_err(&ce)?;
    let comm = Arc::new(Communicator::with_recorder(comm, &RecorderOptions::off()));
    let mut fsdp = Fsdp::new(data_parallel(comm, spec.replicate).map_err(&fe)?, spec.fsdp.clone()).map_err(&fe)?;
    for g in &model.groups {
        let params = g
            .params
            .iter()
            .map(|(name, shape)| DeferredParam {
                name: name.clone(),
                shape: shape.clone(),
                source: Arc::new(Zeros { shape: shape.clone() }),
            })
            .collect();
        fsdp.add_group_deferred(&g.name, params, g.root).map_err(&fe)?;
    }
    if spec.forward_prefetch {
        for g in 1..model.groups.len() {
            fsdp.set_forward_prefetch(g - 1, vec![g]).map_err(&fe)?;
        }
    }
    for (parent, routed) in &model.routed {
        fsdp.set_routed_groups(*parent, routed).map_err(&fe)?;
    }
    let stages = (model.stages_of)(rank);
    let mut stage_count = vec![0usize; model.groups.len()];
    for s in &stages {
        *stage_count.get_mut(s.group).ok_or_else(|| PlanError::Invalid(format!("stage of no group {}", s.group)))? += 1;
    }
    fsdp.synchronize().map_err(&fe)?;
    device.reset_all_peaks();
    let sharded_param_bytes = device.memory_stats().bytes_in_use;
    let mut opt = ShardedOptimizer::new(spec.optimizer);
    let (mut step_time_s, mut compute_busy_s, mut optimizer_state_bytes) = (0.0, 0.0, 0);
    let mut host_issue_s = 0.0;
    let (mut gradient_bytes, mut host_gradient_bytes, mut host_step_s) = (0, 0, 0.0);
    // As the decoder loop (`train/src/decoder/sharded.rs`), nothing in a step
    // waits for the device but the read of its loss. The loop reads it during
    // the next step; a plan reads it at the step's end, so each step starts
    // on an idle device and the measured step is the synchronous one: longer
    // than the loop's steady state by the host's time to its first kernel.
    device.set_deferred_readbacks(true);
    for step in 0..spec.steps {
        let measured = step + 1 == spec.steps;
        let t0 = device.host_clock();
        let busy0 = fsdp.compute_stream().busy();
        let issued0 = device.host_issue_seconds();
        device.set_tracing(measured && spec.trace_rank == Some(rank));
        for m in 0..spec.micro_batches {
            fsdp.set_requires_gradient_sync(m + 1 == spec.micro_batches);
            micro_batch(&mut fsdp, &device, &stages, &stage_count, spec.kernels_reach_host).map_err(&fe)?;
        }
        if let Some(max) = spec.max_grad_norm {
            // As the trainers clip: enqueued, the norm not read.
            let _ = fsdp.clip_grad_norm_async(max).map_err(&fe)?;
        }
        let host0 = device.host_step_seconds();
        // A GPU steps offloaded parameters on the host (see `VirtDevice::set_host_steps`).
        device.set_host_steps(spec.fsdp.offload.is_some() && !spec.kernels_reach_host);
        let stepped = opt.step(&mut fsdp);
        device.set_host_steps(false);
        stepped.map_err(&fe)?;
        let held = (device.memory_stats().bytes_in_use, device.host_memory_stats().bytes_in_use);
        fsdp.zero_grad();
        let grads = gradients_freed(&device, held);
        if measured {
            (gradient_bytes, host_gradient_bytes) = grads;
            host_step_s = device.host_step_seconds() - host0;
        }
        if step == 0 {
            // zero_grad dropped the gradients: what stays beyond the masters is the optimizer's state.
            optimizer_state_bytes = device.memory_stats().bytes_in_use.saturating_sub(sharded_param_bytes);
        }
        // The loop's global mean of the loss, behind the optimizer step.
        let buf = fsdp.compute_stream().buffer_from(&[0f32]).map_err(&de)?;
        let _ = fsdp.mean_over_ranks_async(buf.view()).map_err(&fe)?;
        let loss_read = device.create_event().map_err(&de)?;
        fsdp.compute_stream().record(&loss_read).map_err(&de)?;
        loss_read.synchronize().map_err(&de)?;
        if measured {
            step_time_s = device.host_clock() - t0;
            compute_busy_s = fsdp.compute_stream().busy() - busy0;
            host_issue_s = device.host_issue_seconds() - issued0;
        }
    }
    device.set_tracing(false);
    device.set_deferred_readbacks(false);
    fsdp.synchronize().map_err(&fe)?;
    let total = device.total_stats();
    let collectives = log.lock().map(|l| l.clone()).unwrap_or_default();
    Ok(RankPlan {
        rank,
        fsdp_peak_bytes: device.memory_stats().peak_bytes,
        host_peak_bytes: device.host_memory_stats().peak_bytes,
        gradient_bytes,
        host_gradient_bytes,
        host_step_s,
        activation_peak_bytes: device.activation_stats().peak_bytes,
        peak_bytes: total.peak_bytes,
        sharded_param_bytes,
        optimizer_state_bytes,
        step_time_s,
        compute_busy_s,
        host_issue_s,
        collectives,
        trace: device.take_trace(),
    })
}

/// What `zero_grad` freed, (device, host) bytes, given what was in use
/// just before it: the sharded gradients, which nothing else holds then.
fn gradients_freed(device: &VirtDevice, held: (usize, usize)) -> (usize, usize) {
    let now = (device.memory_stats().bytes_in_use, device.host_memory_stats().bytes_in_use);
    (held.0.saturating_sub(now.0), held.1.saturating_sub(now.1))
}

/// The host's own work for one of FSDP's hooks on one group ([`Issuer::Hook`]),
/// besides the operations the hook issues.
fn hook(device: &VirtDevice, hooks: usize) {
    for _ in 0..hooks {
        device.host_work(device.cost().host_cost(Issuer::Hook).issue_s);
    }
}

/// One micro-batch: forward through the stages, backward in reverse, finalize.
/// On the host (`host`: the cpu device, candle computing on its copies of the
/// parameters) a group's backward is the candle adapter's there: its
/// unsharded parameters freed once candle has its copies, its gradients made
/// when candle's are added (`fsdp/candle/src/module.rs`, `backward_stage`).
fn micro_batch(
    fsdp: &mut Fsdp<VirtComm>,
    device: &VirtDevice,
    stages: &[Stage],
    stage_count: &[usize],
    host: bool,
) -> Result<(), FsdpError> {
    let mut runs = vec![0usize; stage_count.len()];
    let mut saved = Vec::with_capacity(stages.len());
    for s in stages {
        if runs[s.group] == 0 {
            hook(device, 1);
            fsdp.pre_forward(s.group)?;
        }
        {
            let _transient = device.alloc_activation(s.work.transient_bytes)?;
            for k in &s.work.forward {
                fsdp.compute_stream().run_kernel(k);
            }
            for g in &s.inner {
                hook(device, 2);
                fsdp.forward(*g, |_| Ok(()))?;
            }
            saved.push(device.alloc_activation(s.work.saved_bytes)?);
        }
        runs[s.group] += 1;
        if runs[s.group] == stage_count[s.group] {
            runs[s.group] = 0;
            hook(device, 1);
            fsdp.post_forward(s.group)?;
        }
    }
    let mut pending = stage_count.to_vec();
    for s in stages.iter().rev() {
        hook(device, 1);
        match host {
            true => {
                fsdp.pre_backward_without_grads(s.group)?;
                fsdp.release_params_in_backward(s.group)?;
            }
            false => fsdp.pre_backward(s.group)?,
        }
        {
            let _transient = device.alloc_activation(s.work.transient_bytes)?;
            for g in s.inner.iter().rev() {
                hook(device, 2);
                fsdp.backward(*g, |_| Ok(()))?;
            }
            for k in &s.work.backward {
                fsdp.compute_stream().run_kernel(k);
            }
            if host {
                fsdp.ensure_grads(s.group)?;
            }
            saved.pop();
        }
        pending[s.group] -= 1;
        if pending[s.group] == 0 {
            hook(device, 1);
            fsdp.post_backward(s.group)?;
        }
    }
    hook(device, 1);
    fsdp.finalize_backward()
}
