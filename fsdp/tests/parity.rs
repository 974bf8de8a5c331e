//! FSDP on N simulated ranks against a single-rank host reference trained on the global batch.

mod reference;

use std::sync::Arc;

use chorus_collectives::sim::{SimConfig, SimWorld};
use chorus_collectives::Mesh;
use chorus_devices::{Buffer, DType};
use chorus_fsdp::mlp::{init_layers, Mlp, SplitMix};
use chorus_fsdp::{DataParallel, Fsdp, FsdpConfig, MixedPrecision, OptimizerKind, Reshard, ShardedOptimizer};
use reference::{RefMlp, RefOpt};

#[derive(Clone)]
struct Setup {
    world: usize,
    replicate: Option<usize>,
    ddp: bool,
    dims: Vec<usize>,
    batch: usize,
    micro: usize,
    steps: usize,
    opt: RefOpt,
    config: FsdpConfig,
    /// Gradients are multiplied by this in FSDP relative to the reference
    /// (custom divide factors); the reference lr is scaled to match.
    grad_scale: f64,
}

impl Setup {
    fn new(world: usize, opt: RefOpt) -> Self {
        Setup {
            world,
            replicate: None,
            ddp: false,
            dims: vec![37, 64, 33, 5],
            batch: 3,
            micro: 1,
            steps: 4,
            opt,
            config: FsdpConfig::default(),
            grad_scale: 1.0,
        }
    }
}

fn sgd(lr: f64, momentum: f64) -> RefOpt {
    RefOpt::Sgd { lr, momentum }
}

/// Global batch of step `s`: `rows` rows of x and y.
fn batch(dims: &[usize], rows: usize, step: usize) -> (Vec<f32>, Vec<f32>) {
    let mut rng = SplitMix::new(1000 + step as u64);
    let x = (0..rows * dims[0]).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let y = (0..rows * dims[dims.len() - 1]).map(|_| rng.uniform(-1.0, 1.0)).collect();
    (x, y)
}

const SEED: u64 = 7;

fn run_fsdp(setup: &Setup) -> anyhow::Result<Vec<(String, Vec<f32>)>> {
    let s = setup.clone();
    let results = SimWorld::run(setup.world, SimConfig::default(), move |comm| -> anyhow::Result<_> {
        let rank = comm.rank();
        let comm = Arc::new(comm);
        let dp = if s.ddp {
            DataParallel::ddp(comm.clone())?
        } else if let Some(r) = s.replicate {
            let mesh = Mesh::new(&comm, &[("replicate", r), ("shard", s.world / r)])?;
            DataParallel::hsdp(&mesh)?
        } else {
            DataParallel::fsdp(comm.clone())
        };
        let mut fsdp = Fsdp::new(dp, s.config.clone())?;
        let mlp = Mlp::register(&mut fsdp, init_layers(&s.dims, SEED))?;
        let kind = match s.opt {
            RefOpt::Sgd { lr, momentum } => OptimizerKind::sgd(lr, momentum),
            RefOpt::AdamW { lr, weight_decay } => OptimizerKind::adamw(lr, weight_decay),
        };
        let mut opt = ShardedOptimizer::new(kind);
        let (d0, dl) = (s.dims[0], s.dims[s.dims.len() - 1]);
        for step in 0..s.steps {
            let (x, y) = batch(&s.dims, s.world * s.batch * s.micro, step);
            for m in 0..s.micro {
                fsdp.set_requires_gradient_sync(m + 1 == s.micro);
                let row = (m * s.world + rank) * s.batch;
                let xs = &x[row * d0..(row + s.batch) * d0];
                let ys = &y[row * dl..(row + s.batch) * dl];
                mlp.forward_backward(&mut fsdp, xs, ys)?;
                fsdp.finalize_backward()?;
            }
            opt.step(&mut fsdp)?;
            fsdp.zero_grad();
        }
        let params = fsdp.full_parameters()?;
        fsdp.synchronize()?;
        Ok(params)
    })?;
    let mut first = None;
    for r in results {
        let p = r??;
        // Every rank must hold the same full parameters.
        match &first {
            None => first = Some(p),
            Some(f) => assert_eq!(f, &p, "ranks disagree on the parameters"),
        }
    }
    Ok(first.unwrap_or_default())
}

fn run_reference(setup: &Setup, bf16_compute: bool) -> Vec<(String, Vec<f64>)> {
    let init: Vec<(String, Vec<f32>)> =
        init_layers(&setup.dims, SEED).into_iter().flatten().map(|p| (p.name, p.values)).collect();
    let mut model = RefMlp::new(&setup.dims, &init);
    let opt = match setup.opt {
        RefOpt::Sgd { lr, momentum } => RefOpt::Sgd { lr: lr * setup.grad_scale, momentum },
        o => o,
    };
    let (d0, dl) = (setup.dims[0], setup.dims[setup.dims.len() - 1]);
    for step in 0..setup.steps {
        let rows = setup.world * setup.batch * setup.micro;
        let (x, y) = batch(&setup.dims, rows, step);
        let g = if bf16_compute {
            // Emulate each rank's bf16 gradients, then their average.
            let parts: Vec<_> = (0..setup.world)
                .map(|r| {
                    let row = r * setup.batch;
                    model.grads(&x[row * d0..(row + setup.batch) * d0], &y[row * dl..(row + setup.batch) * dl], true)
                })
                .collect();
            let avg = |f: &dyn Fn(&reference::Grads) -> &Vec<Vec<f64>>| -> Vec<Vec<f64>> {
                (0..f(&parts[0]).len())
                    .map(|l| {
                        (0..f(&parts[0])[l].len())
                            .map(|i| parts.iter().map(|p| f(p)[l][i]).sum::<f64>() / setup.world as f64)
                            .collect()
                    })
                    .collect()
            };
            reference::Grads { w: avg(&|p| &p.w), b: avg(&|p| &p.b), loss: 0.0 }
        } else {
            // The global batch at once: rows of every rank and micro-batch.
            let mut g = model.grads(&x, &y, false);
            let scale = setup.micro as f64;
            g.w.iter_mut().flatten().chain(g.b.iter_mut().flatten()).for_each(|v| *v *= scale);
            g
        };
        model.apply(&g, opt);
    }
    model.named()
}

fn max_diff(fsdp: &[(String, Vec<f32>)], reference: &[(String, Vec<f64>)]) -> f64 {
    assert_eq!(fsdp.len(), reference.len());
    let mut worst = 0.0f64;
    for ((n1, a), (n2, b)) in fsdp.iter().zip(reference) {
        assert_eq!(n1, n2);
        assert_eq!(a.len(), b.len(), "{n1}");
        for (x, y) in a.iter().zip(b) {
            worst = worst.max((*x as f64 - y).abs());
        }
    }
    worst
}

fn check(setup: Setup, tol: f64) -> anyhow::Result<()> {
    let got = run_fsdp(&setup)?;
    let want = run_reference(&setup, false);
    let d = max_diff(&got, &want);
    assert!(d <= tol, "max |fsdp - reference| = {d:e} > {tol:e}");
    Ok(())
}

#[test]
fn sgd_matches_reference_on_every_world_size() -> anyhow::Result<()> {
    for world in [1, 2, 3, 4, 8] {
        check(Setup::new(world, sgd(0.05, 0.0)), 1e-6)?;
    }
    Ok(())
}

#[test]
fn sgd_momentum_matches_reference() -> anyhow::Result<()> {
    for world in [1, 3, 8] {
        check(Setup::new(world, sgd(0.05, 0.9)), 1e-6)?;
    }
    Ok(())
}

#[test]
fn adamw_matches_reference() -> anyhow::Result<()> {
    for world in [1, 2, 4, 8] {
        check(Setup::new(world, RefOpt::AdamW { lr: 1e-3, weight_decay: 0.01 }), 1e-5)?;
    }
    Ok(())
}

#[test]
fn hsdp_2x2_and_2x4_match_reference() -> anyhow::Result<()> {
    for world in [4, 8] {
        check(Setup { replicate: Some(2), ..Setup::new(world, sgd(0.05, 0.0)) }, 1e-6)?;
    }
    Ok(())
}

#[test]
fn ddp_matches_reference() -> anyhow::Result<()> {
    check(Setup { ddp: true, ..Setup::new(4, sgd(0.05, 0.0)) }, 1e-6)
}

#[test]
fn reshard_after_forward_true_false_and_two_match_reference() -> anyhow::Result<()> {
    for r in [Reshard::Yes, Reshard::No, Reshard::To(2)] {
        let config = FsdpConfig { reshard_after_forward: r, ..FsdpConfig::default() };
        check(Setup { config, ..Setup::new(4, sgd(0.05, 0.0)) }, 1e-6)?;
    }
    Ok(())
}

#[test]
fn sharding_weights_on_dim_one_matches_reference() -> anyhow::Result<()> {
    let config = FsdpConfig {
        shard_placement: Some(Arc::new(|_name: &str, shape: &[usize]| if shape.len() == 2 { -1 } else { 0 })),
        ..FsdpConfig::default()
    };
    check(Setup { config, ..Setup::new(3, sgd(0.05, 0.0)) }, 1e-6)
}

#[test]
fn replicating_small_parameters_matches_reference() -> anyhow::Result<()> {
    // Biases (≤ 64 elements) and the last weight (165) stay replicated.
    let config = FsdpConfig { replicate_below: 200, ..FsdpConfig::default() };
    check(Setup { config, ..Setup::new(4, sgd(0.05, 0.0)) }, 1e-6)?;
    let config = FsdpConfig { replicate_below: 200, ..FsdpConfig::default() };
    check(Setup { config, replicate: Some(2), ..Setup::new(4, RefOpt::AdamW { lr: 1e-3, weight_decay: 0.01 }) }, 1e-5)
}

#[test]
fn accumulating_four_micro_batches_equals_one_big_batch() -> anyhow::Result<()> {
    for world in [1, 4] {
        // Four accumulated means are four times the big batch's mean gradient.
        let setup = Setup { micro: 4, ..Setup::new(world, sgd(0.05 / 4.0, 0.0)) };
        let got = run_fsdp(&setup)?;
        let want = run_reference(&Setup { micro: 4, grad_scale: 1.0, ..setup.clone() }, false);
        let d = max_diff(&got, &want);
        assert!(d <= 1e-6, "world {world}: {d:e}");
    }
    Ok(())
}

#[test]
fn forced_sum_and_custom_divide_factor_scale_gradients() -> anyhow::Result<()> {
    let world = 4;
    // Forced sum with the default factor is still the average.
    let config = FsdpConfig { force_sum: true, ..FsdpConfig::default() };
    check(Setup { config, ..Setup::new(world, sgd(0.05, 0.0)) }, 1e-6)?;
    // A factor of 2 on 4 ranks doubles the averaged gradient.
    for force_sum in [false, true] {
        let config = FsdpConfig { divide_factor: Some(2.0), force_sum, ..FsdpConfig::default() };
        check(Setup { config, grad_scale: 2.0, ..Setup::new(world, sgd(0.05, 0.0)) }, 1e-6)?;
    }
    Ok(())
}

#[test]
fn bf16_mixed_precision_matches_an_emulating_reference() -> anyhow::Result<()> {
    for reduce in [DType::F32, DType::BF16] {
        let mp = MixedPrecision { param_dtype: Some(DType::BF16), reduce_dtype: Some(reduce), output_dtype: None };
        let setup = Setup {
            config: FsdpConfig { mixed_precision: mp, ..FsdpConfig::default() },
            ..Setup::new(4, sgd(0.05, 0.0))
        };
        let got = run_fsdp(&setup)?;
        let want = run_reference(&setup, true);
        let d = max_diff(&got, &want);
        // bf16 has 8 significant bits: one rounding flip moves a gradient by
        // ~0.4 %, so the parameters agree to a few bf16 ulps of lr·grad.
        assert!(d <= 2e-3, "reduce {reduce}: {d:e}");
        // ... and differ from the f32 run, so the test sees the precision at all.
        let full = run_reference(&setup, false);
        assert!(max_diff(&got, &full) > 1e-6);
    }
    Ok(())
}

#[test]
fn losses_are_identical_on_every_rank_and_fall() -> anyhow::Result<()> {
    let results = SimWorld::run(2, SimConfig::default(), |comm| -> anyhow::Result<Vec<f64>> {
        let comm = Arc::new(comm);
        let mut fsdp = Fsdp::new(DataParallel::fsdp(comm.clone()), FsdpConfig::default())?;
        let dims = [8, 16, 4];
        let mlp = Mlp::register(&mut fsdp, init_layers(&dims, 3))?;
        let mut opt = ShardedOptimizer::new(OptimizerKind::sgd(0.1, 0.0));
        let (x, y) = batch(&dims, 16, 0);
        let mut losses = Vec::new();
        for _ in 0..30 {
            let r = comm.rank();
            let loss = mlp.forward_backward(&mut fsdp, &x[r * 64..(r + 1) * 64], &y[r * 32..(r + 1) * 32])?;
            fsdp.finalize_backward()?;
            losses.push(fsdp.mean_over_ranks(loss.view())?);
            opt.step(&mut fsdp)?;
            fsdp.zero_grad();
        }
        Ok(losses)
    })?;
    let all: Vec<Vec<f64>> = results.into_iter().map(|r| r.unwrap().unwrap()).collect();
    assert_eq!(all[0], all[1]);
    assert!(all[0].windows(2).all(|w| w[1] < w[0]), "{:?}", all[0]);
    assert!(all[0][29] < all[0][0] * 0.8, "{:?}", all[0]);
    Ok(())
}
