//! `Fsdp::pre_backward_without_grads` and `Fsdp::ensure_grads`: a group's
//! unsharded gradients exist only from the moment the model asks for them,
//! and a step made so equals one whose pre-backward made them.

use std::sync::Arc;

use chorus_collectives::sim::{SimConfig, SimWorld};
use chorus_devices::{Device, Scalar, Stream, StreamExt};
use chorus_fsdp::{DataParallel, Fsdp, FsdpConfig, FsdpError, OptimizerKind, ParamInit, ShardedOptimizer};

/// Bytes of the group's two `[8, 4]` f32 parameters, unsharded.
const GROUP_BYTES: usize = 2 * 32 * 4;

/// One SGD step on `world` ranks whose backward writes 0.25 into every
/// unsharded gradient; the gradients made at pre-backward or on request.
/// Returns rank 0's first shard after the step.
fn step(world: usize, deferred: bool) -> Vec<f32> {
    let results = SimWorld::run(world, SimConfig::default(), move |comm| {
        let mut fsdp = Fsdp::new(DataParallel::fsdp(Arc::new(comm)), FsdpConfig::default())?;
        let init = (0..2)
            .map(|i| ParamInit {
                name: format!("p{i}"),
                shape: vec![8, 4],
                values: (0..32).map(|x| x as f32).collect(),
            })
            .collect();
        let g = fsdp.add_group("g", init, false)?;
        let mut opt = ShardedOptimizer::new(OptimizerKind::sgd(0.5, 0.0));
        fsdp.pre_forward(g)?;
        fsdp.post_forward(g)?;
        match deferred {
            true => {
                fsdp.pre_backward_without_grads(g)?;
                assert!(
                    matches!(fsdp.grad(g, 0), Err(FsdpError::State { .. })),
                    "no gradients before they are asked for"
                );
                let before = fsdp.device().memory_stats().bytes_in_use;
                fsdp.ensure_grads(g)?;
                assert_eq!(fsdp.device().memory_stats().bytes_in_use, before + GROUP_BYTES);
                // Asking again keeps them.
                fsdp.ensure_grads(g)?;
                assert_eq!(fsdp.device().memory_stats().bytes_in_use, before + GROUP_BYTES);
                assert_eq!(fsdp.compute_stream().read_vec::<f32>(fsdp.grad(g, 1)?)?, vec![0.0; 32]);
            }
            false => fsdp.pre_backward(g)?,
        }
        for i in 0..2 {
            fsdp.compute_stream().fill(fsdp.grad(g, i)?, Scalar::Float(0.25))?;
        }
        fsdp.post_backward(g)?;
        fsdp.finalize_backward()?;
        opt.step(&mut fsdp)?;
        // Outside a backward there is nothing to make gradients for.
        assert!(matches!(fsdp.ensure_grads(g), Err(FsdpError::State { .. })));
        fsdp.read_shard(g, 0)
    })
    .expect("the sim world runs");
    results.into_iter().next().expect("rank 0").expect("rank 0 ran").expect("rank 0's step")
}

#[test]
fn gradients_made_on_request_exist_only_from_then_and_step_the_same() {
    for world in [1, 2] {
        let (made_first, on_request) = (step(world, false), step(world, true));
        assert_eq!(made_first, on_request, "world {world}");
        // Independently: 0.25 on every rank, averaged, times the learning rate 0.5.
        let rows = 8 / world;
        let expected: Vec<f32> = (0..rows * 4).map(|x| x as f32 - 0.125).collect();
        assert_eq!(on_request, expected, "world {world}");
    }
}
