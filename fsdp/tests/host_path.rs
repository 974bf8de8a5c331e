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
        let mp =
            MixedPrecision { param_dtype: Some(DType::BF16), reduce_dtype: Some(DType::F32), ..Default::default() };
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

/// One group's device operations per step on `world` ranks: two more groups
/// than one, halved.
fn per_group(world: usize) -> BTreeMap<&'static str, u64> {
    let one = calls_per_step(world, 1, 4);
    let three = calls_per_step(world, 3, 4);
    let twice: BTreeMap<&str, u64> =
        three.iter().map(|(k, v)| (*k, v - one.get(k).copied().unwrap_or(0))).filter(|(_, v)| *v > 0).collect();
    assert!(twice.values().all(|v| v % 2 == 0), "{twice:?}");
    twice.into_iter().map(|(k, v)| (k, v / 2)).collect()
}

#[test]
fn a_steps_device_operations_are_the_documented_count_per_group() {
    assert_eq!(per_group(1), DOCUMENTED_PER_GROUP.into_iter().collect(), "docs/fsdp.md's count changed");
    // More ranks add the packing and the reduce-scatter that one rank does without.
    let mut more: BTreeMap<&str, u64> = DOCUMENTED_PER_GROUP.into_iter().collect();
    for (op, n) in DOCUMENTED_WITH_MORE_RANKS {
        *more.entry(op).or_default() += n;
    }
    assert_eq!(per_group(2), more, "docs/fsdp.md's count at more ranks changed");
}

/// `docs/fsdp.md`'s count ("The host path") of one group's device operations
/// per step at one rank (bf16 parameters reduced in f32, AdamW, reshard
/// after forward), FSDP's own and, per collective, the sim communicator's.
const DOCUMENTED_PER_GROUP: [(&str, u64); 9] = [
    // The optimizer: one kernel over the group's flat shard.
    ("adamw_step", 1),
    // Forward and backward (the communicator's operation).
    ("all_gather", 2),
    // Two all-gather outputs, two unsharded parameters, the unsharded
    // gradients and their f32 cast (which is the sharded gradient at one rank).
    ("alloc", 6),
    // Two copy-ins (the whole f32 shard to bf16), the gradients to f32.
    ("cast", 3),
    // Two copy-outs, one batch each.
    ("copy_2d_batch", 2),
    // The flight recorder's, one per collective until its ring is full;
    // FSDP's events come from its pool.
    ("create_event", 3),
    // Zeroing the unsharded gradients.
    ("fill", 1),
    // FSDP's 9 (3 per unshard, 3 per reduction) and the flight recorder's 2.
    ("record", 11),
    // 4 per unshard, 1 per reduction, 1 at finalize.
    ("wait", 10),
];

/// What a group adds per step on more than one rank: the reduce-scatter
/// input and output, the packing, the collective with the flight recorder's
/// record, and the compute stream's wait for the previous reduce-scatter.
const DOCUMENTED_WITH_MORE_RANKS: [(&str, u64); 5] =
    [("alloc", 2), ("copy_2d_batch", 1), ("reduce_scatter", 1), ("record", 1), ("wait", 1)];
