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

#[test]
fn a_steps_device_operations_are_the_documented_count_per_group() {
    // Two more groups than `one`: the difference is twice one group's work.
    let one = calls_per_step(1, 1, 4);
    let three = calls_per_step(1, 3, 4);
    let twice: BTreeMap<&str, u64> =
        three.iter().map(|(k, v)| (*k, v - one.get(k).copied().unwrap_or(0))).filter(|(_, v)| *v > 0).collect();
    assert!(twice.values().all(|v| v % 2 == 0), "{twice:?}");
    let per_group: BTreeMap<&str, u64> = twice.into_iter().map(|(k, v)| (k, v / 2)).collect();
    assert_eq!(per_group, DOCUMENTED_PER_GROUP.into_iter().collect(), "docs/fsdp.md's count changed");
}

/// `docs/fsdp.md`'s count ("The host path") of one group's device operations
/// per step at one rank (bf16 parameters reduced in f32, AdamW, reshard
/// after forward), FSDP's own and, per collective, the sim communicator's.
const DOCUMENTED_PER_GROUP: [(&str, u64); 10] = [
    // The optimizer: one kernel over the group's flat shard.
    ("adamw_step", 1),
    // Forward and backward (the communicator's operation).
    ("all_gather", 2),
    // Two all-gather outputs, two unsharded parameters, the unsharded
    // gradients and their f32 cast, the reduce-scatter input and output.
    ("alloc", 8),
    // Two copy-ins (the whole f32 shard to bf16), the gradients to f32.
    ("cast", 3),
    // Two copy-outs and the reduce-scatter's packing, one batch each.
    ("copy_2d_batch", 3),
    // The flight recorder's, one per collective until its ring is full;
    // FSDP's events come from its pool.
    ("create_event", 3),
    // Zeroing the unsharded gradients.
    ("fill", 1),
    // FSDP's 9 (3 per unshard, 3 per reduction) and the flight recorder's 3.
    ("record", 12),
    ("reduce_scatter", 1),
    // 4 per unshard, 2 per reduction, 1 at finalize.
    ("wait", 11),
];
