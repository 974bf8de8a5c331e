//! Parity: the reference MLP trained under FSDP on the world under test
//! equals a host reference trained on the global batch (every optimizer,
//! layout and policy a [`Setup`] names), and its losses agree across ranks
//! and fall.

use std::sync::Arc;

use anyhow::ensure;
use chorus_collectives::{CommBackend, Communicator, Mesh};
use chorus_devices::{Buffer, ComputeBackend, DType, Stream, StreamExt};
use chorus_fsdp::{DataParallel, Fsdp, FsdpConfig, MixedPrecision, OptimizerKind, ShardedOptimizer};
use chorus_train::mlp::{init_layers, Mlp};
use chorus_train::rng::SplitMix;
use chorus_train::train::Dataset;

use super::reference::{Grads, RefMlp, RefOpt};
use super::world::own_world;
use crate::{Case, Failure, RankCtx};

/// How one parity case trains.
#[derive(Clone)]
pub struct Setup {
    /// HSDP: the replicate dimension's size.
    pub replicate: Option<usize>,
    /// DDP instead of FSDP.
    pub ddp: bool,
    /// Layer widths.
    pub dims: Vec<usize>,
    /// Rows per rank per micro-batch.
    pub batch: usize,
    /// Micro-batches per step (gradient sync only on the last).
    pub micro: usize,
    /// HSDP: reduce-scatter every micro-batch but all-reduce only on the last
    /// (instead of skipping gradient sync).
    pub defer_all_reduce: bool,
    /// Steps.
    pub steps: usize,
    /// The optimizer (FSDP's is the same kind with the same settings).
    pub opt: RefOpt,
    /// FSDP's settings.
    pub config: FsdpConfig,
    /// FSDP's gradients are this multiple of the reference's (custom divide
    /// factors); the reference's SGD learning rate is scaled to match.
    pub grad_scale: f64,
    /// Clip the global gradient norm to this fraction of the first step's
    /// norm (so clipping really happens) before each optimizer step.
    pub clip_fraction: Option<f64>,
}

impl Setup {
    /// Uneven dims (37, 64, 33, 5: trailing ranks hold fewer or no rows), 3 rows per rank, 4 steps.
    pub fn new(opt: RefOpt) -> Self {
        Setup {
            replicate: None,
            ddp: false,
            dims: vec![37, 64, 33, 5],
            batch: 3,
            micro: 1,
            defer_all_reduce: false,
            steps: 4,
            opt,
            config: FsdpConfig::default(),
            grad_scale: 1.0,
            clip_fraction: None,
        }
    }
}

/// The clip threshold both sides use: a fraction of the reference's first gradient norm.
pub(super) fn clip_threshold(s: &Setup, n: usize) -> Option<f64> {
    let fraction = s.clip_fraction?;
    let init: Vec<(String, Vec<f32>)> =
        init_layers(&s.dims, SEED).into_iter().flatten().map(|p| (p.name, p.values)).collect();
    let model = RefMlp::new(&s.dims, &init);
    let (x, y) = batch(&s.dims, n * s.batch * s.micro, 0);
    Some(fraction * norm(&model.grads(&x, &y, false)))
}

pub(super) fn norm(g: &Grads) -> f64 {
    g.w.iter().flatten().chain(g.b.iter().flatten()).map(|v| v * v).sum::<f64>().sqrt()
}

pub(super) const SEED: u64 = 7;

pub(super) fn sgd(lr: f64, momentum: f64) -> RefOpt {
    RefOpt::Sgd { lr, momentum }
}

pub(super) fn adamw() -> RefOpt {
    RefOpt::AdamW { lr: 1e-3, weight_decay: 0.01 }
}

/// The global batch of `step`: `rows` rows of inputs and targets.
pub(super) fn batch(dims: &[usize], rows: usize, step: usize) -> (Vec<f32>, Vec<f32>) {
    let mut rng = SplitMix::new(1000 + step as u64);
    let x = (0..rows * dims[0]).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let y = (0..rows * dims[dims.len() - 1]).map(|_| rng.uniform(-1.0, 1.0)).collect();
    (x, y)
}

/// Trains the reference MLP under FSDP on `world` and returns the final full parameters.
pub fn train_fsdp<C: CommBackend>(world: Arc<Communicator<C>>, s: &Setup) -> Result<Vec<(String, Vec<f32>)>, Failure>
where
    C::B: ComputeBackend,
{
    let (rank, n) = (world.rank(), world.size());
    let dp = if s.ddp {
        DataParallel::ddp(world.clone())?
    } else if let Some(r) = s.replicate {
        let mesh = Mesh::new(&world, &[("replicate", r), ("shard", n / r)])?;
        DataParallel::hsdp(&mesh)?
    } else {
        DataParallel::fsdp(world.clone())
    };
    let mut fsdp = Fsdp::new(dp, s.config.clone())?;
    let mlp = Mlp::register(&mut fsdp, init_layers(&s.dims, SEED))?;
    let kind = match s.opt {
        RefOpt::Sgd { lr, momentum } => OptimizerKind::sgd(lr, momentum),
        RefOpt::AdamW { lr, weight_decay } => OptimizerKind::adamw(lr, weight_decay),
    };
    let mut opt = ShardedOptimizer::new(kind);
    let (d0, dl) = (s.dims[0], s.dims[s.dims.len() - 1]);
    let clip = clip_threshold(s, n);
    for step in 0..s.steps {
        let (x, y) = batch(&s.dims, n * s.batch * s.micro, step);
        for m in 0..s.micro {
            let last = m + 1 == s.micro;
            if s.defer_all_reduce {
                fsdp.set_requires_all_reduce(last);
            } else {
                fsdp.set_requires_gradient_sync(last);
            }
            let row = (m * n + rank) * s.batch;
            mlp.forward_backward(&mut fsdp, &x[row * d0..(row + s.batch) * d0], &y[row * dl..(row + s.batch) * dl])?;
            fsdp.finalize_backward()?;
        }
        if let Some(max) = clip {
            fsdp.clip_grad_norm(max)?;
        }
        opt.step(&mut fsdp)?;
        fsdp.zero_grad();
    }
    let params = fsdp.full_parameters()?;
    fsdp.synchronize()?;
    Ok(params)
}

/// Trains the host reference on the global batch of a world of `n` ranks.
/// With `bf16_compute` it emulates each rank's bf16 gradients, then their average.
pub fn train_reference(s: &Setup, n: usize, bf16_compute: bool) -> Vec<(String, Vec<f64>)> {
    let init: Vec<(String, Vec<f32>)> =
        init_layers(&s.dims, SEED).into_iter().flatten().map(|p| (p.name, p.values)).collect();
    let mut model = RefMlp::new(&s.dims, &init);
    let opt = match s.opt {
        RefOpt::Sgd { lr, momentum } => RefOpt::Sgd { lr: lr * s.grad_scale, momentum },
        o => o,
    };
    let (d0, dl) = (s.dims[0], s.dims[s.dims.len() - 1]);
    let clip = clip_threshold(s, n);
    for step in 0..s.steps {
        let (x, y) = batch(&s.dims, n * s.batch * s.micro, step);
        let mut g = if bf16_compute {
            let parts: Vec<Grads> = (0..n)
                .map(|r| {
                    let row = r * s.batch;
                    model.grads(&x[row * d0..(row + s.batch) * d0], &y[row * dl..(row + s.batch) * dl], true)
                })
                .collect();
            let avg = |pick: &dyn Fn(&Grads) -> &Vec<Vec<f64>>| -> Vec<Vec<f64>> {
                (0..pick(&parts[0]).len())
                    .map(|l| {
                        (0..pick(&parts[0])[l].len())
                            .map(|i| parts.iter().map(|p| pick(p)[l][i]).sum::<f64>() / n as f64)
                            .collect()
                    })
                    .collect()
            };
            Grads { w: avg(&|p| &p.w), b: avg(&|p| &p.b), loss: 0.0 }
        } else {
            // The global batch at once; accumulated micro-batch means sum to `micro` times its mean.
            let mut g = model.grads(&x, &y, false);
            let scale = s.micro as f64;
            g.w.iter_mut().flatten().chain(g.b.iter_mut().flatten()).for_each(|v| *v *= scale);
            g
        };
        if let Some(max) = clip {
            // torch.nn.utils.clip_grad_norm_
            let coef = max / (norm(&g) + 1e-6);
            if coef < 1.0 {
                g.w.iter_mut().flatten().chain(g.b.iter_mut().flatten()).for_each(|v| *v *= coef);
            }
        }
        model.apply(&g, opt);
    }
    model.named()
}

/// The largest absolute difference between FSDP's and the reference's parameters.
pub fn max_diff(fsdp: &[(String, Vec<f32>)], reference: &[(String, Vec<f64>)]) -> Result<f64, Failure> {
    ensure!(fsdp.len() == reference.len(), "{} parameters, the reference has {}", fsdp.len(), reference.len());
    let mut worst = 0.0f64;
    for ((n1, a), (n2, b)) in fsdp.iter().zip(reference) {
        ensure!(n1 == n2 && a.len() == b.len(), "parameter {n1} ({}) vs {n2} ({})", a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            worst = worst.max((*x as f64 - y).abs());
        }
    }
    Ok(worst)
}

pub(super) fn parity_case<C: CommBackend>(name: &str, setup: Setup, tol: f64) -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new(format!("fsdp/parity/{name}"), move |ctx: &RankCtx<'_, C>| {
        let got = train_fsdp(own_world(ctx)?, &setup)?;
        let d = max_diff(&got, &train_reference(&setup, ctx.size(), false))?;
        ensure!(d <= tol, "max |fsdp - reference| = {d:e} > {tol:e}");
        Ok(())
    })
}

pub(super) fn bf16_case<C: CommBackend>(reduce: DType) -> Case<C>
where
    C::B: ComputeBackend,
{
    let mp = MixedPrecision {
        param_dtype: Some(DType::BF16),
        reduce_dtype: Some(reduce),
        output_dtype: None,
        all_gather_dtype: None,
    };
    let setup =
        Setup { config: FsdpConfig { mixed_precision: mp, ..FsdpConfig::default() }, ..Setup::new(sgd(0.05, 0.0)) };
    Case::new(format!("fsdp/parity/bf16-params/{}-reduce", reduce.name()), move |ctx: &RankCtx<'_, C>| {
        let got = train_fsdp(own_world(ctx)?, &setup)?;
        let d = max_diff(&got, &train_reference(&setup, ctx.size(), true))?;
        // bf16 keeps 8 significant bits: a flipped rounding moves a gradient
        // by ~0.4 %, so parameters agree to a few bf16 ulps of lr·grad.
        ensure!(d <= 2e-3, "max |fsdp - emulated bf16 reference| = {d:e}");
        let f32_run = max_diff(&got, &train_reference(&setup, ctx.size(), false))?;
        ensure!(f32_run > 1e-6, "bf16 training matched the f32 reference to {f32_run:e}: was bf16 used at all?");
        Ok(())
    })
}

pub(super) fn losses_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/losses-agree-across-ranks-and-fall", |ctx: &RankCtx<'_, C>| {
        let world = own_world(ctx)?;
        let (rank, n) = (world.rank(), world.size());
        let mut fsdp = Fsdp::new(DataParallel::fsdp(world), FsdpConfig::default())?;
        let dims = [8, 16, 4];
        let mlp = Mlp::register(&mut fsdp, init_layers(&dims, 3))?;
        let mut opt = ShardedOptimizer::new(OptimizerKind::sgd(0.1, 0.0));
        // Targets from a teacher network, so there is something to fit.
        let data = Dataset::random(dims[0], dims[2], 8 * n, 1, 3);
        let (x, y) = data.rows(0, rank * 8, 8)?;
        let mut losses = Vec::new();
        for _ in 0..30 {
            let loss = mlp.forward_backward(&mut fsdp, x, y)?;
            fsdp.finalize_backward()?;
            losses.push(fsdp.mean_over_ranks(loss.view())?);
            opt.step(&mut fsdp)?;
            fsdp.zero_grad();
        }
        ensure!(losses.windows(2).all(|w| w[1] < w[0]), "the loss did not fall at every step: {losses:?}");
        ensure!(losses[29] < losses[0] * 0.8, "the loss fell too little: {losses:?}");
        // Every rank computed the same mean: compare through the communicator.
        let s = fsdp.compute_stream();
        let mine = s.buffer_from(&[losses[29] as f32])?;
        let max = s.alloc(DType::F32, 1)?;
        ctx.comm.all_reduce(mine.view(), max.view(), chorus_collectives::ReduceOp::Max, s)?;
        ensure!(s.read_vec::<f32>(max.view())?[0] == losses[29] as f32, "ranks disagree on the loss");
        Ok(())
    })
}
