//! A cost model of constant rates: every GEMM at one FLOP rate, every
//! memory-bound kernel and copy at one bandwidth, every collective at one
//! latency plus its bytes at one bandwidth. What the planner's own tests
//! use (values they can compute by hand), and a first-order model of a
//! machine whose rates are measured.

use chorus_devices::MemorySpace;

use crate::cost::{CollectiveShape, CostModel, KernelCost, KernelKind};

/// Constant rates (per second; the latency in seconds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ConstantRates {
    /// FLOP/s of GEMMs and attention.
    pub flops: f64,
    /// Bytes/s of memory-bound kernels and copies.
    pub memory_bytes: f64,
    /// Seconds every collective takes besides its bytes.
    pub collective_latency: f64,
    /// Bytes/s of a collective's larger buffer.
    pub collective_bytes: f64,
    /// The peak FLOP/s MFU is taken against.
    pub peak_flops: Option<f64>,
}

impl ConstantRates {
    /// 1 TFLOP/s, 1 GB/s, collectives 10 µs + 1 GB/s, peak 1 TFLOP/s: round numbers for tests.
    pub fn round() -> ConstantRates {
        ConstantRates {
            flops: 1e12,
            memory_bytes: 1e9,
            collective_latency: 1e-5,
            collective_bytes: 1e9,
            peak_flops: Some(1e12),
        }
    }
}

impl CostModel for ConstantRates {
    fn kernel_seconds(&self, k: &KernelCost) -> f64 {
        match k.kind {
            KernelKind::MemoryBound => k.bytes / self.memory_bytes,
            KernelKind::Gemm | KernelKind::Attention => k.flops / self.flops,
        }
    }
    fn collective_seconds(&self, s: &CollectiveShape) -> f64 {
        self.collective_latency + s.bytes as f64 / self.collective_bytes
    }
    fn copy_seconds(&self, bytes: u64, _from: MemorySpace, _to: MemorySpace) -> f64 {
        bytes as f64 / self.memory_bytes
    }
    fn peak_flops(&self) -> Option<f64> {
        self.peak_flops
    }
}
