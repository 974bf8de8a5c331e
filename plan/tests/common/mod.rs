//! What the planner's tests share: a cost model of constant rates, and
//! hand-built stage work.

#![allow(dead_code)]

use chorus_devices::MemorySpace;
use chorus_plan::cost::{CollectiveShape, CostModel, KernelCost, KernelKind};
use chorus_plan::workload::StageWork;

/// Constant rates: 1 TFLOP/s, 1 GB/s memory and copies, collectives at
/// 1 GB/s plus 10 µs.
#[derive(Debug)]
pub struct Constant;

impl CostModel for Constant {
    fn kernel_seconds(&self, k: &KernelCost) -> f64 {
        match k.kind {
            KernelKind::MemoryBound => k.bytes * 1e-9,
            KernelKind::Gemm | KernelKind::Attention => k.flops * 1e-12,
        }
    }
    fn collective_seconds(&self, s: &CollectiveShape) -> f64 {
        1e-5 + s.bytes as f64 * 1e-9
    }
    fn copy_seconds(&self, bytes: u64, _: MemorySpace, _: MemorySpace) -> f64 {
        bytes as f64 * 1e-9
    }
    fn peak_flops(&self) -> Option<f64> {
        Some(1e12)
    }
}

/// One GEMM of `flops` forward and two backward, keeping `saved` bytes.
pub fn stage(name: &str, flops: f64, saved: u64) -> StageWork {
    let k = |n: &str, f: f64| KernelCost { name: format!("{name}.{n}"), kind: KernelKind::Gemm, flops: f, bytes: 0.0 };
    StageWork {
        name: name.to_string(),
        forward: vec![k("fwd", flops)],
        backward: vec![k("bwd", 2.0 * flops)],
        saved_bytes: saved,
        transient_bytes: saved / 2,
    }
}

/// A decoder's stages: embed, `layers` layers, head.
pub fn decoder_work(layers: usize, flops: f64, saved: u64) -> Vec<StageWork> {
    let mut w = vec![stage("embed", flops, saved)];
    w.extend((0..layers).map(|i| stage(&format!("layers.{i}"), flops, saved)));
    w.push(stage("head", flops, saved));
    w
}
