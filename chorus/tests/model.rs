//! FSDP for a user's candle model: initial weights the same on every rank
//! or refused, candle never silently on the CPU for a GPU device, and the
//! sharded model's weights and loss against plain candle.
#![cfg(feature = "candle")]

use std::collections::HashMap;
use std::sync::Arc;

use chorus::candle_core::{DType, Device, Tensor};
use chorus::candle_nn::{linear, VarBuilder};
use chorus::collectives::sim::{SimConfig, SimWorld};
use chorus::devices::cpu::CpuConfig;
use chorus::fsdp::{DataParallel, Fsdp};
use chorus::fsdp_candle::FsdpModel;
use chorus::prelude::*;
use chorus::testing::run_ranks;
use chorus::Error;

/// Weights of two layers (`a`: 3 → 4, `b`: 4 → 2), every value `base + i / 100`,
/// with `bump` added to element `at` of `b.weight` (the perturbation).
fn weights(base: f32, bump: f32, at: usize) -> VarBuilder<'static> {
    let mut map = HashMap::new();
    for (name, shape) in [("a.weight", vec![4, 3]), ("a.bias", vec![4]), ("b.weight", vec![2, 4]), ("b.bias", vec![2])]
    {
        let n: usize = shape.iter().product();
        let mut v: Vec<f32> = (0..n).map(|i| base + i as f32 / 100.0).collect();
        if name == "b.weight" {
            v[at] += bump;
        }
        map.insert(name.to_string(), Tensor::from_vec(v, shape, &Device::Cpu).unwrap());
    }
    VarBuilder::from_tensors(map, DType::F32, &Device::Cpu)
}

/// A rank's full parameters: names and values.
type Params = Vec<(String, Vec<f32>)>;

/// Builds the two-layer model on every rank from `vb(rank)`; returns each rank's full parameters.
fn build(
    n: usize,
    vb: impl Fn(usize) -> VarBuilder<'static> + Send + Sync + 'static,
    broadcast: bool,
) -> chorus::Result<Vec<Params>> {
    run_ranks(n, move |rank| -> chorus::Result<_> {
        let mut b = ShardBuilder::new(&rank, FsdpConfig::default()).weights(vb(rank.rank()));
        if broadcast {
            b = b.broadcast_from_rank0();
        }
        b.layer("a", |vb| linear(3, 4, vb))?;
        b.layer("b", |vb| linear(4, 2, vb))?;
        let model = b.build()?;
        model.full_parameters()?.into_iter().map(|(n, t)| Ok((n, t.flatten_all()?.to_vec1::<f32>()?))).collect()
    })
}

#[test]
fn ranks_with_the_same_weights_train_and_get_them_back_whole() {
    let params = build(3, |_| weights(0.5, 0.0, 0), false).unwrap();
    assert!(params.iter().all(|p| p == &params[0]));
    let b_weight = params[0].iter().find(|(n, _)| n == "b.weight").unwrap();
    assert_eq!(b_weight.1, (0..8).map(|i| 0.5 + i as f32 / 100.0).collect::<Vec<_>>());
}

#[test]
fn ranks_with_different_weights_are_refused() {
    let err = build(3, |rank| weights(rank as f32, 0.0, 0), false).unwrap_err();
    let differ = err.rank_error::<Error>();
    assert!(matches!(differ, Some(Error::WeightsDiffer { param, rank: 1 }) if param == "a.weight"), "{err}");
}

#[test]
fn one_value_perturbed_on_one_rank_is_found() {
    let err = build(3, |rank| weights(0.5, if rank == 2 { 1e-6 } else { 0.0 }, 5), false).unwrap_err();
    let differ = err.rank_error::<Error>();
    assert!(matches!(differ, Some(Error::WeightsDiffer { param, rank: 2 }) if param == "b.weight"), "{err}");
}

#[test]
fn broadcast_from_rank0_gives_every_rank_rank0s_weights() {
    let params = build(3, |rank| weights(rank as f32, 0.0, 0), true).unwrap();
    let want = build(3, |_| weights(0.0, 0.0, 0), false).unwrap();
    assert_eq!(params, want);
}

#[test]
fn seeded_weights_are_seeded_vars_values() {
    let params = run_ranks(2, |rank| -> chorus::Result<_> {
        let mut b = ShardBuilder::new(&rank, FsdpConfig::default()).seed(11);
        b.layer("a", |vb| linear(3, 4, vb))?;
        b.root_layer("b", |vb| linear(4, 2, vb))?;
        b.build()?.full_parameters()
    })
    .unwrap();
    let vars = SeededVars::new(11);
    let vb = vars.var_builder(DType::F32, &Device::Cpu);
    linear(3, 4, vb.pp("a")).unwrap();
    linear(4, 2, vb.pp("b")).unwrap();
    for (name, var) in vars.named_vars() {
        for rank in &params {
            let (_, t) = rank.iter().find(|(n, _)| n == &name).unwrap();
            let got = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(got, var.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap(), "{name}");
        }
    }
}

#[test]
fn layers_without_parameters_and_uneven_batches_are_argument_errors() {
    let err = run_ranks(2, |rank| -> chorus::Result<()> {
        let mut b = ShardBuilder::new(&rank, FsdpConfig::default());
        b.layer("relu", |_| Ok(chorus::candle_nn::Activation::Relu))?;
        Ok(())
    })
    .unwrap_err();
    assert!(err.to_string().contains("made no parameters"), "{err}");
    let err = run_ranks(2, |rank| batch_slice(&Tensor::zeros((5, 2), DType::F32, &Device::Cpu)?, &rank)).unwrap_err();
    assert!(err.to_string().contains("5 rows does not split into 2"), "{err}");
}

/// The decision behind "never a silent CPU fallback", on a machine without
/// a GPU: a device whose kernels cannot reach host memory (as a GPU's) is
/// refused where this build has no candle device for it, and the same
/// device with host kernels (the cpu device) is accepted.
#[test]
fn a_gpu_like_device_without_candles_gpu_feature_is_an_error() {
    for off_host in [true, false] {
        let device = if off_host { CpuConfig::default().with_kernels_off_host() } else { CpuConfig::default() };
        let world = SimWorld::new(1, SimConfig { device, ..SimConfig::default() }).unwrap();
        let comm = Arc::new(world.communicator(0).unwrap());
        let fsdp = Fsdp::new(DataParallel::fsdp(comm), FsdpConfig::default()).unwrap();
        match (off_host, FsdpModel::new(fsdp)) {
            (true, Err(e)) => assert!(e.to_string().contains("candle-cuda"), "{e}"),
            (false, Ok(_)) => {}
            (true, Ok(_)) => panic!("candle would compute on the CPU for a device off host memory"),
            (false, Err(e)) => panic!("the cpu device was refused: {e}"),
        }
    }
}

/// Each rank's candle matmuls split over a pool of its own: the cores
/// shared out by default, or the count asked for.
#[test]
fn each_rank_computes_in_a_pool_of_its_own() {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let pools = run_ranks(2, |_| Ok::<_, Error>(rayon::current_num_threads())).unwrap();
    assert_eq!(pools, vec![(cores / 2).max(1); 2]);
    let pools = chorus::testing::SimRanks::new(2)
        .threads_per_rank(3)
        .run(|_| Ok::<_, Error>(rayon::current_num_threads()))
        .unwrap();
    assert_eq!(pools, vec![3, 3]);
    let pools = World::threads(4).threads_per_rank(1).run(|_| Ok::<_, Error>(rayon::current_num_threads())).unwrap();
    assert_eq!(pools, vec![1; 4]);
}

/// A step's global loss is enqueued behind the work on the device and read
/// later: `global_loss_async` returns while the compute stream is still held
/// by earlier work, and reads the mean of the ranks' losses once it is let go.
#[test]
fn the_global_loss_is_enqueued_behind_the_device_and_read_later() {
    let results = run_ranks(2, |rank| -> chorus::Result<(bool, f64)> {
        let mut b = ShardBuilder::new(&rank, FsdpConfig::default()).weights(weights(0.5, 0.0, 0));
        b.layer("a", |vb| linear(3, 4, vb))?;
        let model = b.build()?;
        let (release, gate) = std::sync::mpsc::channel::<()>();
        model.fsdp_model().with_fsdp(|f| {
            f.compute_stream().launch_host_fn(Box::new(move |_| {
                let _ = gate.recv_timeout(std::time::Duration::from_secs(30));
            }))
        })??;
        // Rank r's loss is r + 1: the mean over two ranks is 1.5.
        let loss = Tensor::new(rank.rank() as f32 + 1.0, &Device::Cpu)?;
        let pending = model.global_loss_async(&loss)?;
        let enqueued_without_waiting = !pending.is_ready();
        release.send(()).map_err(|_| Error::InvalidArgument("the gate's host function is gone".into()))?;
        Ok((enqueued_without_waiting, pending.read()?))
    })
    .unwrap();
    assert_eq!(results, vec![(true, 1.5); 2]);
    let err = run_ranks(1, |rank| -> chorus::Result<()> {
        let mut b = ShardBuilder::new(&rank, FsdpConfig::default()).weights(weights(0.5, 0.0, 0));
        b.layer("a", |vb| linear(3, 4, vb))?;
        let model = b.build()?;
        model.global_loss_async(&Tensor::zeros(2, DType::F32, &Device::Cpu)?).map(drop)
    })
    .unwrap_err();
    assert!(err.to_string().contains("a loss of one value"), "{err}");
}
