//! `Fsdp::clip_grad_norm_async`: the norm, the coefficient and the scaling
//! are enqueued on the compute stream and the optimizer step after them,
//! with no host wait, and the norm read later is the closed form's.

use std::sync::{mpsc, Arc};
use std::time::Duration;

use chorus_collectives::sim::{SimConfig, SimWorld};
use chorus_devices::{Scalar, Stream};
use chorus_fsdp::{DataParallel, Fsdp, FsdpConfig, FsdpError, OptimizerKind, ParamInit, ShardedOptimizer};

/// Every rank's backward writes 0.25 into each of 64 gradient elements, so
/// the averaged gradient's norm is √(64 · 0.25²) = 2.
const NORM: f64 = 2.0;
const MAX_NORM: f64 = 0.5;

#[test]
fn clipping_and_the_step_are_enqueued_behind_a_busy_stream_and_the_norm_is_read_after() {
    let results = SimWorld::run(2, SimConfig::default(), |comm| {
        let mut fsdp = Fsdp::new(DataParallel::fsdp(Arc::new(comm)), FsdpConfig::default())?;
        let init =
            (0..2).map(|i| ParamInit { name: format!("p{i}"), shape: vec![8, 4], values: vec![1.0; 32] }).collect();
        let g = fsdp.add_group("g", init, false)?;
        let mut opt = ShardedOptimizer::new(OptimizerKind::sgd(1.0, 0.0));
        fsdp.pre_forward(g)?;
        fsdp.post_forward(g)?;
        fsdp.pre_backward(g)?;
        for i in 0..2 {
            fsdp.compute_stream().fill(fsdp.grad(g, i)?, Scalar::Float(0.25))?;
        }
        fsdp.post_backward(g)?;
        fsdp.finalize_backward()?;
        // The stream is held by a host function until the host lets it go: a
        // host wait for the stream below would not return before the deadline.
        let (release, gate) = mpsc::channel::<()>();
        fsdp.compute_stream().launch_host_fn(Box::new(move |_| {
            let _ = gate.recv_timeout(Duration::from_secs(30));
        }))?;
        let norm = fsdp.clip_grad_norm_async(MAX_NORM)?;
        opt.step(&mut fsdp)?;
        fsdp.zero_grad();
        let enqueued_without_waiting = !norm.is_ready();
        release.send(()).map_err(|_| FsdpError::InvalidArgument("the gate's host function is gone".into()))?;
        let norm = norm.read()?;
        Ok::<_, FsdpError>((enqueued_without_waiting, norm, fsdp.read_shard(g, 0)?))
    })
    .expect("the sim world runs");
    for (rank, r) in results.into_iter().enumerate() {
        let (enqueued_without_waiting, norm, shard) = r.expect("the rank ran").expect("its step");
        assert!(enqueued_without_waiting, "rank {rank}: clipping or the step waited for the stream");
        assert_eq!(norm, NORM, "rank {rank}");
        // SGD with lr 1 on the clipped gradient, in f32 as the device scales it.
        let coef = (MAX_NORM / (NORM + 1e-6)) as f32;
        assert!(shard.iter().all(|&w| w == 1.0 - 0.25 * coef), "rank {rank}: {shard:?}");
    }
}

#[test]
fn a_max_norm_that_is_negative_or_not_finite_is_refused_before_any_work() {
    let results = SimWorld::run(1, SimConfig::default(), |comm| {
        let mut fsdp = Fsdp::new(DataParallel::fsdp(Arc::new(comm)), FsdpConfig::default())?;
        let init = vec![ParamInit { name: "p".into(), shape: vec![4], values: vec![1.0; 4] }];
        fsdp.add_group("g", init, false)?;
        let refused = [-1.0, f64::NAN, f64::INFINITY]
            .map(|m| matches!(fsdp.clip_grad_norm(m), Err(FsdpError::InvalidArgument(_))));
        // Zero is a valid bound: every gradient becomes zero.
        Ok::<_, FsdpError>((refused, fsdp.clip_grad_norm(0.0)?))
    })
    .expect("the sim world runs");
    let (refused, zero) = results.into_iter().next().expect("rank 0").expect("rank 0 ran").expect("its calls");
    assert_eq!(refused, [true; 3]);
    assert_eq!(zero, 0.0, "no backward ran, so there are no gradients to measure");
}
