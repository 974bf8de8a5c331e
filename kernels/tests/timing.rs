//! `chorus_kernels::timing` on the CPU: off, nothing is recorded; on, every
//! forward and backward kind counts its calls and their wall time, within
//! the wall time around them; `take` empties this thread's record and sees
//! no other thread's. One test, since the switch is process-wide.

use crate::common;

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use chorus_kernels::timing::{self, OpKind, OpTime};
use chorus_kernels::{attention, cross_entropy, rms_norm, rope, swiglu, RopeCache};
use common::{forward_backward, Inputs, Rng};

/// Each op once, forward and backward.
fn run_every_op(rng: &mut Rng) {
    let cpu = Device::Cpu;
    let x = rng.tensor(&[2, 9, 4, 16], 1.0, DType::F32);
    let w = rng.tensor(&[16], 1.0, DType::F32);
    forward_backward(&[&x, &w], &x, |a| rms_norm(&a[0], &a[1], 1e-5)).unwrap();
    let (cos, sin) = RopeCache::new(16, 1e4).unwrap().tables(&cpu, 0, 9).unwrap();
    forward_backward(&[&x], &x, |a| rope(&a[0], &cos, &sin)).unwrap();
    forward_backward(&[&x, &x], &x, |a| swiglu(&a[0], &a[1])).unwrap();
    let kv = rng.tensor(&[2, 12, 2, 16], 1.0, DType::F32);
    forward_backward(&[&x, &kv, &kv], &x, |a| attention(&a[0], &a[1], &a[2], 0.25)).unwrap();
    let logits = rng.tensor(&[6, 50], 3.0, DType::F32);
    let targets = Tensor::from_vec(rng.ids(6, 50), 6, &cpu).unwrap();
    forward_backward(&[&logits], &rng.tensor(&[6], 1.0, DType::F32), |a| cross_entropy(&a[0], &targets)).unwrap();
}

fn calls(record: &[(OpKind, OpTime)]) -> Vec<(OpKind, usize)> {
    record.iter().map(|(k, t)| (*k, t.calls)).collect()
}

#[test]
fn timing_counts_every_kind_only_when_on_and_per_thread() {
    let mut rng = Rng(3);
    timing::set_enabled(false);
    run_every_op(&mut rng);
    let off = timing::take().unwrap();
    assert_eq!(off.iter().map(|(k, _)| *k).collect::<Vec<_>>(), OpKind::ALL, "every kind, in ALL's order");
    assert!(off.iter().all(|(_, t)| *t == OpTime::default()), "recorded while off: {off:?}");

    timing::set_enabled(true);
    assert!(timing::enabled());
    let t0 = Instant::now();
    run_every_op(&mut rng);
    let wall = t0.elapsed();
    let on = timing::take().unwrap();
    // RMSNorm's backward times its `dx` and its `dw` pass apart: two calls.
    let want: Vec<(OpKind, usize)> =
        OpKind::ALL.iter().map(|k| (*k, if *k == OpKind::RmsNormBackward { 2 } else { 1 })).collect();
    assert_eq!(calls(&on), want);
    assert!(on.iter().all(|(_, t)| t.time > Duration::ZERO), "a kind ran in no time: {on:?}");
    let total: Duration = on.iter().map(|(_, t)| t.time).sum();
    assert!(total <= wall, "the ops' {total:?} exceed the {wall:?} around them");

    // Taken: the record starts again.
    assert!(timing::take().unwrap().iter().all(|(_, t)| t.calls == 0));
    // Another thread's ops are its own.
    let theirs = std::thread::spawn(|| {
        run_every_op(&mut Rng(4));
        timing::take().unwrap()
    })
    .join()
    .unwrap();
    assert_eq!(calls(&theirs), want);
    assert!(timing::take().unwrap().iter().all(|(_, t)| t.calls == 0), "another thread's ops were recorded here");
    timing::set_enabled(false);
}
