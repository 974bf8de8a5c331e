//! The reference MLP's training loop (`chorus train --model mlp` and its
//! `--bench`): the MLP under FSDP on any backend, with data laid out as
//! PyTorch users export it.

use std::sync::Arc;
use std::time::Instant;

use chorus_collectives::{CommBackend, Communicator, Mesh};
use chorus_devices::{Buffer, ComputeBackend, Device};
use chorus_fsdp::{
    DataParallel, Fsdp, FsdpConfig, FsdpError, HostOverhead, OptimizerKind, ParamInit, Result, ShardedOptimizer,
};

use crate::mlp::Mlp;
use crate::npy::Array;
use crate::rng::SplitMix;

/// Inputs and targets: `batches` global batches of `rows` rows (the
/// data-parallel world × the per-rank batch).
#[derive(Clone, Debug)]
pub struct Dataset {
    x: Vec<f32>,
    y: Vec<f32>,
    batches: usize,
    rows: usize,
    d_in: usize,
    d_out: usize,
}

impl Dataset {
    /// From arrays of shape `[S, rows, d]` (one batch per step, cycling) or
    /// `[rows, d]` (the same batch every step).
    pub fn from_arrays(x: Array, y: Array) -> Result<Dataset> {
        let split = |a: &Array, what: &str| -> Result<(usize, usize, usize)> {
            match a.shape.as_slice() {
                [s, r, d] => Ok((*s, *r, *d)),
                [r, d] => Ok((1, *r, *d)),
                s => Err(FsdpError::InvalidArgument(format!(
                    "{what} has shape {s:?}; expected [S, rows, d] or [rows, d]"
                ))),
            }
        };
        let (sx, rx, d_in) = split(&x, "x")?;
        let (sy, ry, d_out) = split(&y, "y")?;
        if [sx, rx, d_in, sy, ry, d_out].contains(&0) {
            return Err(FsdpError::InvalidArgument(format!(
                "x {:?} and y {:?}: every dimension must be at least 1",
                x.shape, y.shape
            )));
        }
        if (sx, rx) != (sy, ry) {
            return Err(FsdpError::InvalidArgument(format!(
                "x {:?} and y {:?} disagree on batches/rows",
                x.shape, y.shape
            )));
        }
        Ok(Dataset { x: x.values, y: y.values, batches: sx, rows: rx, d_in, d_out })
    }

    /// Inputs uniform in [-1, 1) and targets from a random teacher,
    /// `y = tanh(x·T)`, so there is something to learn; all from `seed`.
    pub fn random(d_in: usize, d_out: usize, rows: usize, batches: usize, seed: u64) -> Dataset {
        let mut rng = SplitMix::new(seed ^ 0xDA7A);
        let bound = 2.0 / (d_in.max(1) as f32).sqrt();
        let teacher: Vec<f32> = (0..d_in * d_out).map(|_| rng.uniform(-bound, bound)).collect();
        let x: Vec<f32> = (0..batches * rows * d_in).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let y = x
            .chunks(d_in.max(1))
            .take(batches * rows)
            .flat_map(|row| {
                let teacher = &teacher;
                (0..d_out)
                    .map(move |o| row.iter().enumerate().map(|(k, v)| v * teacher[k * d_out + o]).sum::<f32>().tanh())
            })
            .collect();
        Dataset { x, y, batches, rows, d_in, d_out }
    }

    /// The arrays, as written to disk: `x` `[S, rows, d_in]` and `y` `[S, rows, d_out]`.
    pub fn arrays(&self) -> (Array, Array) {
        (
            Array { shape: vec![self.batches, self.rows, self.d_in], values: self.x.clone() },
            Array { shape: vec![self.batches, self.rows, self.d_out], values: self.y.clone() },
        )
    }

    /// Rows `[first, first + n)` of the batch used at `step`.
    pub fn rows(&self, step: usize, first: usize, n: usize) -> Result<(&[f32], &[f32])> {
        if first + n > self.rows {
            return Err(FsdpError::InvalidArgument(format!(
                "rows {first}..{} are past the {} rows of a batch",
                first + n,
                self.rows
            )));
        }
        let b = step % self.batches.max(1);
        let xs = (b * self.rows + first) * self.d_in;
        let ys = (b * self.rows + first) * self.d_out;
        Ok((&self.x[xs..xs + n * self.d_in], &self.y[ys..ys + n * self.d_out]))
    }
}

/// What to train.
#[derive(Clone, Debug)]
pub struct TrainSpec {
    /// Initial parameters, one list (weight, bias) per layer.
    pub layers: Vec<Vec<ParamInit>>,
    /// The data.
    pub data: Arc<Dataset>,
    /// Rows per rank per step.
    pub batch: usize,
    /// Steps.
    pub steps: usize,
    /// The optimizer.
    pub optimizer: OptimizerKind,
    /// FSDP settings.
    pub fsdp: FsdpConfig,
    /// HSDP: the replicate dimension's size (the rest is the shard dimension).
    pub replicate: Option<usize>,
    /// Clip the global gradient norm to this.
    pub max_grad_norm: Option<f64>,
    /// Stop when the global loss is NaN or infinite (the report says where:
    /// [`RankReport::stopped`]).
    pub stop_on_nonfinite: bool,
    /// Where the trained parameters are written at the end of a completed
    /// run, one gathered parameter at a time (e.g. [`NpyOutput`](crate::model_out::NpyOutput)).
    pub output: Option<Arc<dyn crate::model_out::ModelOutput>>,
    /// Also gather every parameter into [`RankReport::params`] on every
    /// rank (tests and small models; the outputs do not need it).
    pub collect_params: bool,
}

/// The stages of a training step whose host time [`RankReport`] reports:
/// the ones that only enqueue work, and the two that wait for the device
/// (the loss read back, the end-of-step synchronize).
pub const STAGES: [&str; 7] = [
    "batch",
    "forward+backward (enqueue)",
    "finalize_backward (enqueue)",
    "loss (waits for the device)",
    "clip_grad_norm (enqueue)",
    "optimizer step (enqueue)",
    "synchronize (waits for the device)",
];

/// The median of each column of `rows`.
fn column_medians(rows: &[[f64; STAGES.len()]]) -> Vec<(&'static str, f64)> {
    STAGES
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut v: Vec<f64> = rows.iter().map(|r| r[i]).collect();
            v.sort_by(|a, b| a.total_cmp(b));
            let m = match v.len() {
                0 => 0.0,
                n if n % 2 == 1 => v[n / 2],
                n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
            };
            (*name, m)
        })
        .collect()
}

/// What one rank measured.
#[derive(Clone, Debug)]
pub struct RankReport {
    /// The global mean loss of each step, before its update.
    pub losses: Vec<f64>,
    /// Wall time of each step, host-synchronized.
    pub step_times_s: Vec<f64>,
    /// The most device bytes in use during the steps.
    pub peak_memory_bytes: usize,
    /// The most host-space bytes (CPU offload's state) in use during the steps.
    pub peak_host_memory_bytes: usize,
    /// Device bytes in use after the last step.
    pub final_memory_bytes: usize,
    /// Host time in FSDP's hooks over the steps.
    pub overhead: HostOverhead,
    /// Host time of each stage of a step, the median over the steps, in
    /// step order (see [`STAGES`]): where a slow step's time goes.
    pub stage_times_s: Vec<(&'static str, f64)>,
    /// Number of param groups.
    pub groups: usize,
    /// The final unsharded parameters, where the spec asked to collect
    /// them (`collect_params`); empty otherwise.
    pub params: Vec<(String, Vec<f32>)>,
    /// The step (and its loss) at which the run stopped because the loss was
    /// not finite, with `stop_on_nonfinite`: the last of `losses`, its update
    /// not applied.
    pub stopped: Option<(usize, f64)>,
}

/// Trains on this rank of `world`; every rank calls it with the same spec.
/// `on_step(step, loss)` is called after each step.
pub fn train<C: CommBackend>(
    world: Arc<Communicator<C>>,
    spec: &TrainSpec,
    on_step: &mut dyn FnMut(usize, f64),
) -> Result<RankReport>
where
    C::B: ComputeBackend,
{
    let n = world.size();
    if spec.batch * n > spec.data.rows {
        return Err(FsdpError::InvalidArgument(format!(
            "{n} ranks × batch {} needs {} rows per step; the data has {}",
            spec.batch,
            spec.batch * n,
            spec.data.rows
        )));
    }
    let dp = match spec.replicate {
        Some(r) if r > 1 => {
            if n % r != 0 {
                return Err(FsdpError::InvalidArgument(format!("--hsdp {r} does not divide {n} ranks")));
            }
            DataParallel::hsdp(&Mesh::new(&world, &[("replicate", r), ("shard", n / r)])?)?
        }
        _ => DataParallel::fsdp(world.clone()),
    };
    let mut fsdp = Fsdp::new(dp, spec.fsdp.clone())?;
    let mlp = Mlp::register(&mut fsdp, spec.layers.clone())?;
    if mlp.dims()[0] != spec.data.d_in || mlp.dims().last() != Some(&spec.data.d_out) {
        return Err(FsdpError::InvalidArgument(format!(
            "the model maps {} → {:?} but the data has {} → {}",
            mlp.dims()[0],
            mlp.dims().last(),
            spec.data.d_in,
            spec.data.d_out
        )));
    }
    let mut opt = ShardedOptimizer::new(spec.optimizer);
    fsdp.synchronize()?;
    fsdp.device().reset_peak_memory();
    fsdp.device().reset_peak_host_memory();
    let overhead_before = fsdp.host_overhead();
    let rank = world.rank();
    let mut losses = Vec::new();
    let mut times = Vec::new();
    let mut stages = Vec::with_capacity(spec.steps.min(1 << 16));
    let mut stopped = None;
    for step in 0..spec.steps {
        let t0 = Instant::now();
        let mut marks = [0.0; STAGES.len()];
        let mut last = t0;
        let mut mark = |i: usize| {
            let now = Instant::now();
            marks[i] = (now - last).as_secs_f64();
            last = now;
        };
        let (x, y) = spec.data.rows(step, rank * spec.batch, spec.batch)?;
        mark(0);
        let loss = mlp.forward_backward(&mut fsdp, x, y)?;
        mark(1);
        fsdp.finalize_backward()?;
        mark(2);
        let mean = fsdp.mean_over_ranks(loss.view())?;
        mark(3);
        if spec.stop_on_nonfinite && !mean.is_finite() {
            // Every rank sees the same global loss, so all stop here together.
            fsdp.zero_grad();
            fsdp.synchronize()?;
            times.push(t0.elapsed().as_secs_f64());
            losses.push(mean);
            stopped = Some((step, mean));
            break;
        }
        if let Some(max) = spec.max_grad_norm {
            // Enqueued; the norm is not needed, so the host does not wait for it.
            let _ = fsdp.clip_grad_norm_async(max)?;
        }
        mark(4);
        opt.step(&mut fsdp)?;
        fsdp.zero_grad();
        mark(5);
        fsdp.synchronize()?;
        mark(6);
        stages.push(marks);
        times.push(t0.elapsed().as_secs_f64());
        losses.push(mean);
        on_step(step, mean);
    }
    let stats = fsdp.device().memory_stats();
    let after = fsdp.host_overhead();
    // A stopped run writes no model; a completed one writes it tensor by tensor.
    if let (Some(output), None) = (&spec.output, stopped) {
        crate::model_out::write_model(&fsdp, rank == 0, output.as_ref())?
            .map_err(|e| FsdpError::InvalidArgument(format!("writing the trained model: {e}")))?;
    }
    let params = if spec.collect_params { fsdp.full_parameters()? } else { Vec::new() };
    Ok(RankReport {
        losses,
        step_times_s: times,
        peak_memory_bytes: stats.peak_bytes,
        peak_host_memory_bytes: fsdp.device().host_memory_stats().peak_bytes,
        final_memory_bytes: stats.bytes_in_use,
        overhead: after.since(&overhead_before),
        stage_times_s: column_medians(&stages),
        groups: fsdp.num_groups(),
        params,
        stopped,
    })
}
