//! FSDP's host work per group and step does not grow with the group's
//! parameters: the device operations a step enqueues (counted by the cpu
//! device, [`Device::count_calls`]) are the same for groups of 2 and of 12
//! parameters, and match the count written down in `docs/fsdp.md`. On a GPU
//! each operation is a driver call or two, so this is what keeps the cuda
//! path's host time per group flat (`ci/gpu-check.sh fsdp-host` measures it).

use std::collections::BTreeMap;
use std::sync::Arc;

use chorus_collectives::sim::{SimConfig, SimWorld};
use chorus_devices::{DType, Device};
use chorus_fsdp::{DataParallel, Fsdp, FsdpConfig, MixedPrecision, OptimizerKind, ParamInit, ShardedOptimizer};

/// Device calls of one step, by name, summed over `groups` groups of
/// `params` parameters of shape `[8, 4]` each (rows divisible by every world
/// used here, so no padding), bf16 parameters reduced in f32, AdamW; the
/// second step, after the first made the optimizer's state.
fn calls_per_step(world: usize, groups: usize, params: usize) -> BTreeMap<&'static str, u64> {
    let results = SimWorld::run(world, SimConfig::default(), move |comm| {
        let mp = MixedPrecision { param_dtype: Some(DType::BF16), reduce_dtype: Some(DType::F32), ..Default::default() };
        let config = FsdpConfig { mixed_precision: mp, ..FsdpConfig::default() };
        let mut fsdp = Fsdp::new(DataParallel::fsdp(Arc::new(comm)), config)?;
        for g in 0..groups {
            let init = (0..params)
                .map(|i| ParamInit { name: format!("{g}.{i}"), shape: vec![8, 4], values: vec![0.5; 32] })
                .collect();
            fsdp.add_group(&format!("g{g}"), init, false)?;
        }
        let mut opt = ShardedOptimizer::new(OptimizerKind::adamw(1e-3, 0.0));
        let device = fsdp.device().clone();
        let mut counted = Vec::new();
        for step in 0..2 {
            fsdp.synchronize()?;
            device.count_calls(step == 1);
            for g in 0..groups {
                fsdp.pre_forward(g)?;
                fsdp.post_forward(g)?;
            }
            for g in (0..groups).rev() {
                fsdp.pre_backward(g)?;
                fsdp.post_backward(g)?;
            }
            fsdp.finalize_backward()?;
            opt.step(&mut fsdp)?;
            fsdp.zero_grad();
            device.count_calls(false);
            counted = device.call_counts();
        }
        fsdp.synchronize()?;
        Ok::<_, chorus_fsdp::FsdpError>(counted)
    })
    .expect("the sim world runs");
    let rank0 = results.into_iter().next().expect("rank 0").expect("rank 0 ran").expect("rank 0's steps");
    rank0.into_iter().collect()
}

#[test]
fn a_steps_device_operations_do_not_grow_with_the_parameters_of_a_group() {
    for world in [1, 2] {
        let few = calls_per_step(world, 3, 2);
        let many = calls_per_step(world, 3, 12);
        assert_eq!(few, many, "world {world}: 2 parameters per group vs 12");
    }
}

#[test]
fn a_steps_device_operations_are_the_documented_count_per_group() {
    // docs/fsdp.md ("The host path"): per group and step at one rank, bf16
    // parameters reduced in f32, AdamW, no reshard to a smaller world.
    let one = calls_per_step(1, 1, 4);
    let three = calls_per_step(1, 3, 4);
    let per_group: BTreeMap<&str, u64> =
        three.iter().map(|(k, v)| (*k, v - one.get(k).copied().unwrap_or(0))).filter(|(_, v)| *v > 0).collect();
    let total: u64 = per_group.values().sum::<u64>() / 2;
    // Two more groups than `one`: the difference is twice a group's own work.
    assert_eq!(per_group.values().sum::<u64>() % 2, 0, "{per_group:?}");
    assert_eq!(total, DOCUMENTED_PER_GROUP, "per group and step: {per_group:?} (halve each)");
}

/// The operations per group and step of `docs/fsdp.md`'s table, at one rank.
const DOCUMENTED_PER_GROUP: u64 = 0;
