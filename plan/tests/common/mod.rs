//! What the planner's tests share: a cost model of constant rates, and
//! hand-built stage work.

#![allow(dead_code)]

use chorus_devices::DType;
use chorus_fsdp::{FsdpConfig, MixedPrecision};
use chorus_plan::cost::{KernelCost, KernelKind};
use chorus_plan::workload::StageWork;

/// The tests' cost model: round constant rates.
pub fn cost() -> std::sync::Arc<dyn chorus_plan::cost::CostModel> {
    std::sync::Arc::new(chorus_plan::constant::ConstantRates::round())
}

/// One GEMM of `flops` forward and two backward, keeping `saved` bytes.
pub fn stage(name: &str, flops: f64, saved: u64) -> StageWork {
    let k = |n: &str, f: f64| KernelCost::new(format!("{name}.{n}"), KernelKind::Gemm, f, 0.0);
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

/// FSDP with bf16 parameters and f32 gradient reduction (torchtitan's mixed precision).
pub fn bf16_f32() -> FsdpConfig {
    FsdpConfig {
        mixed_precision: MixedPrecision {
            param_dtype: Some(DType::BF16),
            reduce_dtype: Some(DType::F32),
            output_dtype: None,
            all_gather_dtype: None,
        },
        ..FsdpConfig::default()
    }
}
