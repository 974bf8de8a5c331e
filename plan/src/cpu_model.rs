//! A cost model of this machine's cpu device as `chorus train` uses it on
//! the sim backend: candle computes the model on the CPU (its matmul on
//! `cores / ranks` threads per rank), the cpu device runs FSDP's copies and
//! the optimizer, and the sim communicator moves bytes between rank threads.
//!
//! The rates are frozen from `plan/examples/calibrate_cpu.rs` (run it in
//! release to measure again); the date and the machine are noted with them.
//! They describe one small shared VM, so they say whether the planner's
//! machinery adds up on a machine we can measure, not what any other CPU does.

use chorus_devices::MemorySpace;

use crate::cost::{CollectiveShape, CostModel, KernelCost, KernelKind};

/// Calibrated on: `nproc` 2, AMD EPYC KVM guest (AVX-512, L2 4 MiB), 23 GiB
/// RAM, Linux, rustc 1.95.0, candle 0.11.1, release build, 2026-11-26
/// (`plan/examples/calibrate_cpu.rs`).
pub const CALIBRATED_ON: &str = "2-core AMD EPYC KVM guest (AVX-512), candle 0.11.1 release, 2026-11-26";

/// Cores of the calibration machine.
pub const CORES: usize = 2;

/// candle's f32 matmul on one thread, FLOP/s, for the small GEMMs of the
/// bench models (`calibrate_cpu` "gemm" rows, median over its shapes).
pub const GEMM_FLOPS_PER_THREAD: f64 = 20e9;

/// candle's batched attention matmuls (`[b·h, s, hd]` by `[b·h, hd, s]`), FLOP/s.
pub const ATTENTION_FLOPS_PER_THREAD: f64 = 8e9;

/// candle's element-wise ops on large tensors, bytes read plus written per second.
pub const MEMORY_BYTES_PER_S: f64 = 6e9;

/// The fixed cost of one candle op (allocation, dispatch, the graph node):
/// the time of an op on a 64-element tensor.
pub const OP_OVERHEAD_S: f64 = 4e-6;

/// One memcpy between host buffers, bytes/s (`docs/benchmarks.md`, the
/// reference memcpy column of the sim rows: 24.5–27.0 GB/s).
pub const HOST_COPY_BYTES_PER_S: f64 = 25e9;

/// A small sim collective, seconds: a 2-rank all_reduce of a few elements
/// takes a median 45.9 µs (`docs/benchmarks.md`, the flight recorder's cost).
pub const SIM_CALL_S: f64 = 45.9e-6;

/// The sim's bus bandwidth on this machine, bytes/s: 1.73–2.25 GB/s at 16–64
/// MiB on 8 ranks (`docs/benchmarks.md`, "Results: sim backend").
pub const SIM_BUSBW: f64 = 1.9e9;

/// The cpu device's cost model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuModel {
    /// Threads candle gives each rank (`chorus train`: cores / ranks, at least one).
    pub threads: usize,
    /// Matmul FLOP/s per thread.
    pub gemm_flops_per_thread: f64,
    /// Attention matmul FLOP/s per thread.
    pub attention_flops_per_thread: f64,
    /// Element-wise bytes/s (one thread: candle's element-wise kernels do not split small tensors).
    pub memory_bytes_per_s: f64,
    /// Fixed cost per op, seconds.
    pub op_overhead_s: f64,
    /// Fixed cost per collective, seconds.
    pub call_s: f64,
    /// Collective bus bandwidth, bytes/s.
    pub busbw: f64,
}

impl CpuModel {
    /// The frozen calibration for one rank alone on the machine.
    pub fn frozen() -> CpuModel {
        CpuModel::for_ranks(1)
    }

    /// The frozen calibration when `ranks` sim ranks share the machine
    /// (each gets `CORES / ranks` candle threads, at least one; more ranks
    /// than cores share the cores, so each runs proportionally slower).
    pub fn for_ranks(ranks: usize) -> CpuModel {
        let ranks = ranks.max(1);
        let share = if ranks > CORES { CORES as f64 / ranks as f64 } else { 1.0 };
        CpuModel {
            threads: (CORES / ranks).max(1),
            gemm_flops_per_thread: GEMM_FLOPS_PER_THREAD * share,
            attention_flops_per_thread: ATTENTION_FLOPS_PER_THREAD * share,
            memory_bytes_per_s: MEMORY_BYTES_PER_S * share,
            op_overhead_s: OP_OVERHEAD_S / share,
            call_s: SIM_CALL_S,
            busbw: SIM_BUSBW,
        }
    }
}

impl CostModel for CpuModel {
    fn kernel_seconds(&self, kernel: &KernelCost) -> f64 {
        let threads = self.threads as f64;
        let compute = match kernel.kind {
            KernelKind::Gemm => kernel.flops / (self.gemm_flops_per_thread * threads),
            KernelKind::Attention => kernel.flops / (self.attention_flops_per_thread * threads),
            KernelKind::MemoryBound => 0.0,
        };
        self.op_overhead_s + compute.max(kernel.bytes / self.memory_bytes_per_s)
    }

    fn collective_seconds(&self, shape: &CollectiveShape) -> f64 {
        if shape.ranks.len() <= 1 {
            return 0.0;
        }
        let moved = crate::nccl::bytes_moved(shape.op, shape.bytes, shape.ranks.len());
        self.call_s + moved / self.busbw
    }

    fn copy_seconds(&self, bytes: u64, _from: MemorySpace, _to: MemorySpace) -> f64 {
        // Host and device memory are the same RAM on the cpu device.
        bytes as f64 / HOST_COPY_BYTES_PER_S
    }

    fn peak_flops(&self) -> Option<f64> {
        None
    }
}
