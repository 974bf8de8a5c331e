//! FSDP conformance: the reference MLP trained under FSDP on the world under
//! test must equal a host reference trained on the global batch; the state
//! machine, the collectives per step and the memory bound must be FSDP2's.
//!
//! Every case runs on a communicator split from the world (FSDP keeps its
//! communicators), so it leaves the world's own sequence in step.

pub mod counting;
pub mod float8;
pub mod moe;
pub mod moe_reference;
pub mod offload;
pub mod reference;
mod routed;

use std::sync::Arc;

use anyhow::{anyhow, ensure};
use chorus_collectives::backend::OpKind;
use chorus_collectives::{CommBackend, Communicator, Mesh};
use chorus_devices::{Buffer, ComputeBackend, DType, Device, Scalar, Stream, StreamExt};
use chorus_fsdp::{
    DataParallel, Fsdp, FsdpConfig, FsdpError, MixedPrecision, OptimizerKind, ParamInit, Reshard, ShardedOptimizer,
    ShardedState, TrainingState,
};
use chorus_train::mlp::{init_layers, Mlp, SplitMix};
use chorus_train::train::Dataset;

use crate::{Case, Failure, RankCtx, Requirements};
use counting::{Counting, Counts};
use reference::{Grads, RefMlp, RefOpt};

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
fn clip_threshold(s: &Setup, n: usize) -> Option<f64> {
    let fraction = s.clip_fraction?;
    let init: Vec<(String, Vec<f32>)> =
        init_layers(&s.dims, SEED).into_iter().flatten().map(|p| (p.name, p.values)).collect();
    let model = RefMlp::new(&s.dims, &init);
    let (x, y) = batch(&s.dims, n * s.batch * s.micro, 0);
    Some(fraction * norm(&model.grads(&x, &y, false)))
}

fn norm(g: &Grads) -> f64 {
    g.w.iter().flatten().chain(g.b.iter().flatten()).map(|v| v * v).sum::<f64>().sqrt()
}

const SEED: u64 = 7;

fn sgd(lr: f64, momentum: f64) -> RefOpt {
    RefOpt::Sgd { lr, momentum }
}

fn adamw() -> RefOpt {
    RefOpt::AdamW { lr: 1e-3, weight_decay: 0.01 }
}

/// The global batch of `step`: `rows` rows of inputs and targets.
fn batch(dims: &[usize], rows: usize, step: usize) -> (Vec<f32>, Vec<f32>) {
    let mut rng = SplitMix::new(1000 + step as u64);
    let x = (0..rows * dims[0]).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let y = (0..rows * dims[dims.len() - 1]).map(|_| rng.uniform(-1.0, 1.0)).collect();
    (x, y)
}

/// A communicator of the whole world that FSDP can own: split from the one under test.
fn own_world<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<Arc<Communicator<C>>, Failure>
where
    C::B: ComputeBackend,
{
    let c = ctx.comm.split(Some(0), ctx.rank() as i64)?.ok_or_else(|| anyhow!("split returned no communicator"))?;
    Ok(Arc::new(c))
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

fn parity_case<C: CommBackend>(name: &str, setup: Setup, tol: f64) -> Case<C>
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

fn bf16_case<C: CommBackend>(reduce: DType) -> Case<C>
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

/// The FSDP cases for a world of `world_size` ranks.
pub fn cases<C: CommBackend>(world_size: usize) -> Vec<Case<C>>
where
    C::B: ComputeBackend,
{
    let even = Requirements { even_world: true, ..Requirements::default() };
    let half = (world_size / 2).max(1);
    let mut out = vec![
        parity_case("sgd", Setup::new(sgd(0.05, 0.0)), 1e-6),
        parity_case("sgd-momentum", Setup::new(sgd(0.05, 0.9)), 1e-6),
        parity_case("adamw", Setup::new(adamw()), 1e-5),
        parity_case(
            "reshard-after-forward-false",
            Setup {
                config: FsdpConfig { reshard_after_forward: Reshard::No, ..FsdpConfig::default() },
                ..Setup::new(sgd(0.05, 0.0))
            },
            1e-6,
        ),
        parity_case(
            &format!("reshard-after-forward-{half}"),
            Setup {
                config: FsdpConfig { reshard_after_forward: Reshard::To(half), ..FsdpConfig::default() },
                ..Setup::new(sgd(0.05, 0.0))
            },
            1e-6,
        )
        .needs(even),
        parity_case(
            "shard-dim-1",
            Setup {
                config: FsdpConfig {
                    shard_placement: Some(Arc::new(|_: &str, shape: &[usize]| if shape.len() == 2 { -1 } else { 0 })),
                    ..FsdpConfig::default()
                },
                ..Setup::new(sgd(0.05, 0.0))
            },
            1e-6,
        ),
        // Biases (≤ 64 elements) and the last weight (165) stay replicated.
        parity_case(
            "replicate-below-threshold",
            Setup { config: FsdpConfig { replicate_below: 200, ..FsdpConfig::default() }, ..Setup::new(adamw()) },
            1e-5,
        ),
        // Four accumulated micro-batch means are four times the big batch's mean.
        parity_case("accumulate-4-micro-batches", Setup { micro: 4, ..Setup::new(sgd(0.05 / 4.0, 0.0)) }, 1e-6),
        parity_case(
            "forced-sum",
            Setup { config: FsdpConfig { force_sum: true, ..FsdpConfig::default() }, ..Setup::new(sgd(0.05, 0.0)) },
            1e-6,
        ),
        parity_case("ddp", Setup { ddp: true, ..Setup::new(sgd(0.05, 0.0)) }, 1e-6),
        // Clipping to half the first norm (padding and replicated parameters counted once).
        parity_case("clip-grad-norm", Setup { clip_fraction: Some(0.5), ..Setup::new(sgd(0.05, 0.9)) }, 1e-6),
        parity_case(
            "clip-grad-norm-replicated-params",
            Setup {
                clip_fraction: Some(0.5),
                config: FsdpConfig { replicate_below: 200, ..FsdpConfig::default() },
                ..Setup::new(sgd(0.05, 0.0))
            },
            1e-6,
        ),
        bf16_case(DType::F32),
        bf16_case(DType::BF16),
        state_machine_case(),
        prefetch_case(),
        counts_case(),
        memory_case(),
        losses_case(),
    ];
    // A divide factor of n/2 doubles the averaged gradient (with and without forced sums).
    for force_sum in [false, true] {
        let config = FsdpConfig { divide_factor: Some(world_size as f64 / 2.0), force_sum, ..FsdpConfig::default() };
        let name = if force_sum { "divide-factor-forced-sum" } else { "divide-factor" };
        out.push(parity_case(name, Setup { config, grad_scale: 2.0, ..Setup::new(sgd(0.05, 0.0)) }, 1e-6));
    }
    if world_size >= 4 && world_size % 2 == 0 {
        let r = Some(2);
        out.push(parity_case(&format!("hsdp-2x{half}"), Setup { replicate: r, ..Setup::new(sgd(0.05, 0.0)) }, 1e-6));
        out.push(parity_case(
            &format!("hsdp-2x{half}-replicate-below-threshold"),
            Setup {
                replicate: r,
                config: FsdpConfig { replicate_below: 200, ..FsdpConfig::default() },
                ..Setup::new(adamw())
            },
            1e-5,
        ));
        // Partial reduce-scatter results accumulate until the all-reduce.
        out.push(parity_case(
            &format!("hsdp-2x{half}-deferred-all-reduce"),
            Setup { replicate: r, micro: 2, defer_all_reduce: true, ..Setup::new(sgd(0.05 / 2.0, 0.0)) },
            1e-6,
        ));
        out.push(hsdp_counts_case());
    }
    out.extend(routed::cases(world_size));
    out.extend(offload::cases(world_size));
    out.extend(float8::cases());
    out
}

/// The world, split and wrapped so its calls are counted.
type CountedWorld<C> = Arc<Communicator<Counting<C>>>;

fn counted<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(CountedWorld<C>, Counts), Failure>
where
    C::B: ComputeBackend,
{
    let counts = Counts::default();
    let comm = ctx.comm.split(Some(0), ctx.rank() as i64)?.ok_or_else(|| anyhow!("split returned no communicator"))?;
    Ok((Arc::new(Communicator::new(Counting::new(comm.into_backend(), counts.clone()))), counts))
}

const DIMS: [usize; 4] = [16, 32, 32, 8];

fn one_step<C: CommBackend>(fsdp: &mut Fsdp<C>, mlp: &Mlp, rank: usize) -> Result<(), Failure>
where
    C::B: ComputeBackend,
{
    let x: Vec<f32> = (0..4 * DIMS[0]).map(|i| ((i + rank) % 7) as f32 * 0.1).collect();
    let y: Vec<f32> = (0..4 * DIMS[3]).map(|i| (i % 5) as f32 * 0.1).collect();
    mlp.forward_backward(fsdp, &x, &y)?;
    fsdp.finalize_backward()?;
    fsdp.synchronize()?;
    Ok(())
}

fn counts_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/collectives-per-step", |ctx: &RankCtx<'_, C>| {
        let n = ctx.size();
        let half = (n / 2).max(1);
        let mut modes = vec![(Reshard::Yes, 3, 3), (Reshard::No, 3, 0)];
        if n % 2 == 0 && half < n {
            modes.push((Reshard::To(half), 3, 3));
        }
        for (reshard, forward_ag, backward_ag) in modes {
            let (world, counts) = counted(ctx)?;
            let config = FsdpConfig { reshard_after_forward: reshard, ..FsdpConfig::default() };
            let mut fsdp = Fsdp::new(DataParallel::fsdp(world.clone()), config)?;
            let mlp = Mlp::register(&mut fsdp, init_layers(&DIMS, 1))?;
            counts.clear();
            one_step(&mut fsdp, &mlp, world.rank())?;
            let get = |k| counts.get(k, n);
            match reshard {
                Reshard::To(k) => {
                    ensure!(
                        get(OpKind::AllGather) == forward_ag,
                        "{reshard}: forward all-gathers {}",
                        get(OpKind::AllGather)
                    );
                    ensure!(
                        counts.get(OpKind::AllGather, k) == backward_ag,
                        "{reshard}: backward all-gathers on {k} ranks"
                    );
                }
                _ => ensure!(
                    get(OpKind::AllGather) == forward_ag + backward_ag,
                    "reshard {reshard}: {} all-gathers, expected {}",
                    get(OpKind::AllGather),
                    forward_ag + backward_ag
                ),
            }
            ensure!(get(OpKind::ReduceScatter) == 3, "{reshard}: {} reduce-scatters", get(OpKind::ReduceScatter));
            ensure!(get(OpKind::AllReduce) == 0, "{reshard}: {} all-reduces", get(OpKind::AllReduce));
            let own = fsdp.comm_counts();
            ensure!((own.all_gathers, own.reduce_scatters) == (forward_ag + backward_ag, 3), "FSDP counted {own:?}");
        }
        Ok(())
    })
}

fn hsdp_counts_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/hsdp-collectives-per-step", |ctx: &RankCtx<'_, C>| {
        let (world, counts) = counted(ctx)?;
        let shard = world.size() / 2;
        let mesh = Mesh::new(&world, &[("replicate", 2), ("shard", shard)])?;
        let mut fsdp = Fsdp::new(DataParallel::hsdp(&mesh)?, FsdpConfig::default())?;
        let mlp = Mlp::register(&mut fsdp, init_layers(&DIMS, 1))?;
        counts.clear();
        one_step(&mut fsdp, &mlp, world.rank())?;
        ensure!(
            counts.get(OpKind::AllGather, shard) == 6,
            "all-gathers over shard: {}",
            counts.get(OpKind::AllGather, shard)
        );
        ensure!(counts.get(OpKind::ReduceScatter, shard) == 3, "reduce-scatters over shard");
        ensure!(
            counts.get(OpKind::AllReduce, 2) == 3,
            "all-reduces over replicate: {}",
            counts.get(OpKind::AllReduce, 2)
        );
        // Deferred all-reduce: reduce-scatters only.
        fsdp.set_requires_all_reduce(false);
        counts.clear();
        one_step(&mut fsdp, &mlp, world.rank())?;
        ensure!(
            counts.get(OpKind::ReduceScatter, shard) == 3 && counts.get(OpKind::AllReduce, 2) == 0,
            "deferred step"
        );
        Ok(())
    })
}

fn param(name: &str, shape: &[usize]) -> ParamInit {
    let n: usize = shape.iter().product();
    ParamInit { name: name.into(), shape: shape.to_vec(), values: (0..n).map(|i| i as f32 - 3.0).collect() }
}

fn state_error<T>(r: Result<T, FsdpError>, event: &str) -> Result<(), Failure> {
    match r {
        Err(FsdpError::State { event: e, .. }) if e == event => Ok(()),
        Err(e) => Err(anyhow!("{event}: expected a state error, got {e}")),
        Ok(_) => Err(anyhow!("{event}: expected a state error, got success")),
    }
}

fn state_machine_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/state-machine", |ctx: &RankCtx<'_, C>| {
        let n = ctx.size();
        for reshard in [Reshard::Yes, Reshard::No, Reshard::To(1)] {
            let world = own_world(ctx)?;
            let config = FsdpConfig { reshard_after_forward: reshard, ..FsdpConfig::default() };
            let mut f = Fsdp::new(DataParallel::fsdp(world), config)?;
            let w = param("w", &[5, 3]);
            let expected = w.values.clone();
            let g = f.add_group("g", vec![w], false)?;
            let state = |f: &Fsdp<C>| -> Result<_, Failure> { Ok((f.training_state(g)?, f.sharded_state(g)?)) };
            ensure!(state(&f)? == (TrainingState::Idle, ShardedState::Sharded), "initial state");
            state_error(f.param(g, 0), "parameter access")?;
            state_error(f.post_forward(g), "post_forward")?;
            state_error(f.post_backward(g), "post_backward")?;

            f.pre_forward(g)?;
            ensure!(state(&f)? == (TrainingState::Forward, ShardedState::Unsharded), "after pre_forward");
            ensure!(f.compute_stream().read_vec::<f32>(f.param(g, 0)?)? == expected, "unsharded values");
            state_error(f.pre_forward(g), "pre_forward")?;
            state_error(f.pre_backward(g), "pre_backward")?;
            state_error(f.post_backward(g), "post_backward")?;
            state_error(f.grad(g, 0), "gradient access")?;

            f.post_forward(g)?;
            let after_forward = match reshard {
                Reshard::No => ShardedState::Unsharded,
                Reshard::To(k) if k < n => ShardedState::ShardedPostForward,
                _ => ShardedState::Sharded,
            };
            ensure!(
                state(&f)? == (TrainingState::Idle, after_forward),
                "{reshard}: after post_forward {:?}",
                state(&f)?
            );

            f.pre_backward(g)?;
            ensure!(state(&f)? == (TrainingState::PreBackward, ShardedState::Unsharded), "after pre_backward");
            ensure!(f.compute_stream().read_vec::<f32>(f.param(g, 0)?)? == expected, "{reshard}: values in backward");
            f.compute_stream().fill(f.grad(g, 0)?, Scalar::Float(1.0))?;
            f.pre_backward(g)?; // a second pre-backward is a no-op, as in FSDP2
            f.post_backward(g)?;
            ensure!(state(&f)? == (TrainingState::PostBackward, ShardedState::Sharded), "after post_backward");
            state_error(f.post_backward(g), "post_backward")?;
            state_error(f.pre_forward(g), "pre_forward")?;
            f.finalize_backward()?;
            ensure!(state(&f)? == (TrainingState::Idle, ShardedState::Sharded), "after finalize");

            // Without reshard-after-backward the next forward needs no all-gather.
            f.set_reshard_after_backward(false);
            f.pre_forward(g)?;
            f.post_forward(g)?;
            f.pre_backward(g)?;
            f.post_backward(g)?;
            ensure!(f.sharded_state(g)? == ShardedState::Unsharded, "kept after backward");
            f.finalize_backward()?;
            let before = f.comm_counts().all_gathers;
            f.pre_forward(g)?;
            ensure!(f.comm_counts().all_gathers == before, "an all-gather for kept parameters");
            f.post_forward(g)?;
            f.synchronize()?;
        }
        Ok(())
    })
}

fn prefetch_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/async-unshard-and-explicit-prefetch", |ctx: &RankCtx<'_, C>| {
        let (world, counts) = counted(ctx)?;
        let n = world.size();
        let mut f = Fsdp::new(DataParallel::fsdp(world), FsdpConfig::default())?;
        let a = f.add_group("a", vec![param("a", &[4, 2])], false)?;
        let b = f.add_group("b", vec![param("b", &[3, 3])], false)?;
        let handle = f.unshard(a, true)?;
        ensure!(f.sharded_state(a)? == ShardedState::Sharded, "sharded until waited on");
        f.wait_unshard(handle)?;
        ensure!(f.sharded_state(a)? == ShardedState::Unsharded, "unsharded after wait");
        ensure!(f.compute_stream().read_vec::<f32>(f.param(a, 0)?)? == param("a", &[4, 2]).values, "values of a");
        f.set_forward_prefetch(a, vec![b])?;
        ensure!(f.set_forward_prefetch(a, vec![7]).is_err(), "prefetching a missing group");
        counts.clear();
        f.pre_forward(a)?;
        f.post_forward(a)?;
        ensure!(counts.get(OpKind::AllGather, n) == 1, "a's pre-forward all-gathers b once");
        f.pre_forward(b)?;
        ensure!(counts.get(OpKind::AllGather, n) == 1, "b's pre-forward uses the prefetch");
        ensure!(f.compute_stream().read_vec::<f32>(f.param(b, 0)?)? == param("b", &[3, 3]).values, "values of b");
        f.post_forward(b)?;
        f.synchronize()?;
        Ok(())
    })
}

/// The memory bound of docs/fsdp.md for groups without model compute (f32, SGD with momentum).
struct Bound {
    after_step: usize,
    after_zero_grad: usize,
    peak: usize,
    floor: usize,
}

/// Bytes of one rank's f32 shard of a parameter of `shape` sharded on dim 0
/// over `world` ranks, padding included: by docs/fsdp.md's rule every rank
/// holds `ceil(rows / world)` rows. Computed here from the rule, not by
/// FSDP's own layout code, so a layout bug cannot move the oracle with it.
fn padded_shard_bytes(shape: &[usize], world: usize) -> usize {
    let rows = shape[0];
    let row_len: usize = shape[1..].iter().product();
    rows.div_ceil(world) * row_len * 4
}

/// The bound for groups of one f32 parameter each, of these shapes, over `world` ranks.
fn bound(shapes: &[&[usize]], world: usize) -> Bound {
    let s: Vec<usize> = shapes.iter().map(|shape| padded_shard_bytes(shape, world)).collect();
    let n: Vec<usize> = shapes.iter().map(|shape| shape.iter().product::<usize>() * 4).collect();
    let ag: Vec<usize> = s.iter().map(|s| s * world).collect();
    let l = s.len();
    let base: usize = s.iter().map(|s| 2 * s).sum();
    let mut peak = 0;
    for i in 0..l {
        let prev = if i > 0 { ag[i - 1] } else { 0 };
        peak = peak.max(base + (prev + ag[i]).max(ag[i] + n[i]));
    }
    for i in (0..l).rev() {
        let done: usize = (i + 1..l).map(|j| 2 * s[j]).sum();
        let rs_later = if i + 1 < l { ag[i + 1] } else { 0 };
        let prefetch = if i > 0 { ag[i - 1] } else { 0 };
        let pre = (rs_later + ag[i] + n[i]).max(rs_later + 2 * n[i] + prefetch);
        let post = n[i] + ag[i] + 2 * s[i] + prefetch;
        peak = peak.max(base + done + pre.max(post));
    }
    Bound {
        after_step: base + s.iter().sum::<usize>(),
        after_zero_grad: base,
        peak,
        floor: base + n.iter().map(|n| 2 * n).max().unwrap_or(0),
    }
}

/// CPU offload with pinned host memory (FSDP2's default policy).
const OFFLOAD: Option<chorus_fsdp::OffloadPolicy> = Some(chorus_fsdp::OffloadPolicy { pin_memory: true });

/// The groups of the memory cases: one f32 parameter each, of these shapes.
const MEMORY_SHAPES: [&[usize]; 4] = [&[64, 48], &[96, 64], &[33, 96], &[50, 33]];

/// What one rank's device and host spaces held in one fake training step,
/// less what they held before FSDP was made (the harness's buffers).
#[derive(Debug)]
struct StepMemory {
    device_peak: usize,
    device_after_step: usize,
    device_after_zero_grad: usize,
    host_after_step: usize,
    host_after_zero_grad: usize,
}

/// Two training steps of groups without model compute (the forward only
/// gathers, every gradient is 0.5; SGD with momentum) over groups of
/// `shapes`, the first `offloaded` of them offloaded (per group, through
/// `set_offload`), measuring each step: what the memory cases share.
fn fake_steps<C: CommBackend>(
    ctx: &RankCtx<'_, C>,
    shapes: &[&[usize]],
    offloaded: usize,
) -> Result<[StepMemory; 2], Failure>
where
    C::B: ComputeBackend,
{
    let world = own_world(ctx)?;
    ctx.device().synchronize()?;
    let dev = ctx.device().clone();
    let (others, host_others) = (dev.memory_stats().bytes_in_use, dev.host_memory_stats().bytes_in_use);
    let mut f = Fsdp::new(DataParallel::fsdp(world), FsdpConfig::default())?;
    for (i, shape) in shapes.iter().enumerate() {
        f.set_offload(if i < offloaded { OFFLOAD } else { None });
        f.add_group(&format!("g{i}"), vec![param(&format!("p{i}"), shape)], false)?;
        ensure!(f.is_offloaded(i)? == (i < offloaded), "group {i}'s offload");
    }
    let mut opt = ShardedOptimizer::new(OptimizerKind::sgd(0.1, 0.9));
    let l = shapes.len();
    let mut step = || -> Result<StepMemory, Failure> {
        f.synchronize()?;
        dev.reset_peak_memory();
        for g in 0..l {
            f.pre_forward(g)?;
            f.post_forward(g)?;
        }
        for g in (0..l).rev() {
            f.pre_backward(g)?;
            f.compute_stream().fill(f.grad(g, 0)?, Scalar::Float(0.5))?;
            f.post_backward(g)?;
        }
        f.finalize_backward()?;
        opt.step(&mut f)?;
        f.synchronize()?;
        let device_peak = dev.memory_stats().peak_bytes.saturating_sub(others);
        let device_after_step = dev.memory_stats().bytes_in_use.saturating_sub(others);
        let host_after_step = dev.host_memory_stats().bytes_in_use.saturating_sub(host_others);
        f.zero_grad();
        Ok(StepMemory {
            device_peak,
            device_after_step,
            host_after_step,
            device_after_zero_grad: dev.memory_stats().bytes_in_use.saturating_sub(others),
            host_after_zero_grad: dev.host_memory_stats().bytes_in_use.saturating_sub(host_others),
        })
    };
    Ok([step()?, step()?])
}

fn memory_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/memory-within-zero3-bound", |ctx: &RankCtx<'_, C>| {
        let b = bound(&MEMORY_SHAPES, ctx.size());
        for (step, m) in fake_steps(ctx, &MEMORY_SHAPES, 0)?.iter().enumerate() {
            if step == 1 {
                let peak = m.device_peak;
                ensure!(peak as f64 <= b.peak as f64 * 1.05, "peak {peak} B above the bound {} B", b.peak);
                ensure!(
                    peak >= b.floor,
                    "peak {peak} B below the floor {} B: the bound is not being exercised",
                    b.floor
                );
            }
            let now = m.device_after_step;
            ensure!(now == b.after_step, "after step {step}: {now} B, expected {}", b.after_step);
            let now = m.device_after_zero_grad;
            ensure!(now == b.after_zero_grad, "after zero_grad: {now} B, expected {}", b.after_zero_grad);
        }
        Ok(())
    })
}

fn losses_case<C: CommBackend>() -> Case<C>
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
