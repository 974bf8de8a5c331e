//! The GPU kinds `chorus plan --gpu` knows: each one's compute, memory and
//! links, every constant with its published source, as a [`CostModel`].
//!
//! A kernel takes the longer of its arithmetic at the calibrated fraction of
//! the peak and its memory traffic at the calibrated fraction of HBM
//! bandwidth (a roofline), plus a floor for the shortest kernel; a
//! collective takes NCCL's own model of itself ([`crate::nccl`]).
//!
//! The calibration constants were fixed from the sources cited here before
//! any comparison with a training run (`docs/plan-costs.md`).

use std::sync::Arc;

use chorus_devices::MemorySpace;

use crate::cost::{CollectiveShape, CostModel, KernelCost, KernelKind};
use crate::cpu_model::CpuModel;
use crate::decoder_cost::Framework;
use crate::nccl::{Fabric, NCCL_RING, NCCL_TREE};

/// One GPU kind.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuSpec {
    /// The name `--gpu` takes.
    pub name: &'static str,
    /// Dense bf16 peak FLOP/s at the datasheet's boost clock, for MFU.
    pub peak_flops: f64,
    /// Dense bf16 FLOP/s the GPU reaches at its clocks under its power
    /// limit: the peak unless the power cap lowers the clock.
    pub clocked_flops: f64,
    /// Fraction of `clocked_flops` a large bf16 GEMM reaches (cuBLAS).
    pub gemm_efficiency: f64,
    /// Fraction of `clocked_flops` the attention kernel reaches, counting
    /// the FLOPs a causal kernel actually does (half the square).
    pub attention_efficiency: f64,
    /// Device memory bandwidth, bytes/s (datasheet).
    pub hbm_bytes_per_s: f64,
    /// Fraction of it an element-wise kernel reaches.
    pub memory_efficiency: f64,
    /// The shortest a kernel takes, seconds.
    pub kernel_floor_s: f64,
    /// Host↔device copies of pinned memory, bytes/s.
    pub pcie_bytes_per_s: f64,
    /// NCCL bus bandwidth of a ring inside a node, bytes/s.
    pub nvlink_busbw: f64,
    /// One GPU's NIC, bytes/s.
    pub nic_bytes_per_s: f64,
    /// Device memory a process can use, bytes (nvidia-smi's total).
    pub memory_bytes: u64,
}

/// nvidia-smi's total memory of an H100 80GB HBM3: 81,559 MiB (the H100
/// node of 2026-11-27, `docs/plan-costs.md`, "Kernel rates").
const H100_MEMORY: u64 = 81_559 << 20;

/// A causal kernel computes only the blocks on and below the diagonal:
/// half of the `S × S` product that [`crate::decoder_cost`] counts (as
/// torchtitan counts it). The attention efficiencies below are quoted on
/// the FLOPs actually done, as the FlashAttention papers quote them.
pub const CAUSAL_WORK_FRACTION: f64 = 0.5;

/// H100 SXM5 dense bf16 peak: 1,979 TFLOP/s "with sparsity" on NVIDIA's
/// datasheet (https://www.nvidia.com/en-us/data-center/h100/), half dense.
const H100_PEAK: f64 = 989e12;

/// H100 NVL dense bf16 peak, 1,671 TFLOP/s with sparsity at a 350–400 W
/// limit (same datasheet): the second point of the power interpolation.
const H100_NVL_PEAK: f64 = 835.5e12;

/// The best bf16 matmul throughput measured on an H100 SXM, 792.1 TFLOP/s
/// = 80.1 % of 989 (stas00/ml-engineering, compute/accelerator/README.md,
/// "Maximum Achievable Matmul FLOPS comparison table", CUDA 12.1).
const H100_GEMM_EFFICIENCY: f64 = 0.801;

/// FlashAttention-2 on an H100 reaches 35 % of the bf16 peak (Shah et al.,
/// FlashAttention-3, arXiv:2407.08608, abstract and §1). torch's SDPA
/// (what torchtitan's Llama calls) runs FlashAttention-2 kernels on Hopper.
const H100_FA2_EFFICIENCY: f64 = 0.35;

/// NCCL ring bus bandwidth inside an 8-GPU HGX H100 node: 741.34 GB/s
/// bidirectional measured for the all-reduce ring (ASTRA-sim's validation,
/// https://astra-sim.github.io/astra-sim-docs/validation/hardware/gpu-validation-hgx-h100.html),
/// 370.7 GB/s each way, against NVLink 4's 450 GB/s each way.
const H100_NVLINK_BUSBW: f64 = 370e9;

/// 400 Gb/s InfiniBand/RoCE per GPU (DGX H100; torchtitan's benchmark
/// hosts: "400 Gb/s per GPU"), at 0.92 of line rate: NCCL's own allowance
/// for protocol overhead (`tuning.cc`, "120.0/128.0"). No nccl-tests
/// multi-node result was found to check it against.
const NIC_400G: f64 = 50e9 * 0.92;

/// An element-wise kernel streams at about 90 % of HBM bandwidth: an
/// assumption (STREAM-like copies on H100 are commonly reported near
/// 3.0 TB/s of 3.35), not a citation.
const MEMORY_EFFICIENCY: f64 = 0.9;

/// A kernel launch and its tail on the GPU, seconds: an assumption (a few
/// µs is the usual empty-kernel time), which matters only for tiny kernels.
const KERNEL_FLOOR: f64 = 3e-6;

/// PCIe Gen5 x16: 32 GT/s × 16 lanes × 128/130 = 63 GB/s each way;
/// pinned copies reach about 85 % of it (an assumption).
const PCIE5_X16: f64 = 63e9 * 0.85;

/// PCIe Gen4 x16 (A100): 31.5 GB/s each way, the same 85 %.
const PCIE4_X16: f64 = 31.5e9 * 0.85;

/// The kinds `--gpu` takes (`a100` is accepted for `a100-80gb`).
pub const GPU_KINDS: [&str; 5] = ["h100-sxm", "h100-sxm-500w", "h200", "a100-80gb", "cpu"];

/// The spec of GPU `kind` (not `cpu`).
pub fn gpu_spec(kind: &str) -> Option<GpuSpec> {
    let h100 = GpuSpec {
        name: "h100-sxm",
        peak_flops: H100_PEAK,
        clocked_flops: H100_PEAK,
        gemm_efficiency: H100_GEMM_EFFICIENCY,
        attention_efficiency: H100_FA2_EFFICIENCY,
        // HBM3 3.35 TB/s (H100 SXM datasheet).
        hbm_bytes_per_s: 3.35e12,
        memory_efficiency: MEMORY_EFFICIENCY,
        kernel_floor_s: KERNEL_FLOOR,
        pcie_bytes_per_s: PCIE5_X16,
        nvlink_busbw: H100_NVLINK_BUSBW,
        nic_bytes_per_s: NIC_400G,
        memory_bytes: H100_MEMORY,
    };
    match kind {
        "h100-sxm" => Some(h100),
        // torchtitan's benchmark GPUs (benchmarks/llama3_h100_202412_torchtitan.md):
        // H100 SXM with 96 GB HBM2e at 2.4 TB/s, run at the default 500 W
        // limit. What a lower limit does to the clock is not published for
        // the SXM part; torchtitan's note says its peak "is between SXM and
        // NVL". We interpolate linearly in power between the two datasheet
        // points, SXM 989 TFLOP/s at 700 W and NVL 835.5 at 400 W:
        // 835.5 + (989 − 835.5) · (500 − 400) / (700 − 400) = 886.7 TFLOP/s.
        // Its 96 GB of HBM2e: 96 GiB (no nvidia-smi reading of this part was found).
        "h100-sxm-500w" => Some(GpuSpec {
            name: "h100-sxm-500w",
            clocked_flops: H100_NVL_PEAK + (H100_PEAK - H100_NVL_PEAK) * (500.0 - 400.0) / (700.0 - 400.0),
            hbm_bytes_per_s: 2.4e12,
            memory_bytes: 96 << 30,
            ..h100
        }),
        // H200 SXM: the H100's die (989 TFLOP/s dense bf16), 141 GB HBM3e at
        // 4.8 TB/s (https://www.nvidia.com/en-us/data-center/h200/); matmul
        // 794.5 TFLOP/s = 80.3 % (ml-engineering's "H100/H200 SXM" MAMF).
        // nvidia-smi's total: 143,771 MiB (the H200 node of 2026-11-27, `docs/plan-costs.md`).
        "h200" => Some(GpuSpec {
            name: "h200",
            gemm_efficiency: 0.803,
            hbm_bytes_per_s: 4.8e12,
            memory_bytes: 143_771 << 20,
            ..h100
        }),
        // A100 SXM 80GB: 312 TFLOP/s dense bf16, HBM2e 2,039 GB/s (NVIDIA A100
        // datasheet); matmul 267.9 TFLOP/s = 85.9 % (ml-engineering MAMF
        // table); FlashAttention-2 reaches 50–73 % of peak on A100 (Dao,
        // arXiv:2307.08691, abstract): the middle, 60 %; NCCL caps an A100
        // ring's bus bandwidth at 235 GB/s (`tuning.cc`, compCap80) of
        // NVLink 3's 300 GB/s each way; DGX A100 has one 200 Gb/s HDR NIC per
        // GPU.
        "a100-80gb" | "a100" => Some(GpuSpec {
            name: "a100-80gb",
            peak_flops: 312e12,
            clocked_flops: 312e12,
            gemm_efficiency: 0.859,
            attention_efficiency: 0.60,
            hbm_bytes_per_s: 2.039e12,
            memory_efficiency: MEMORY_EFFICIENCY,
            kernel_floor_s: KERNEL_FLOOR,
            pcie_bytes_per_s: PCIE4_X16,
            nvlink_busbw: 235e9,
            nic_bytes_per_s: 25e9 * 0.92,
            // 80 GiB: nvidia-smi's 81,920 MiB on an A100-SXM4-80GB.
            memory_bytes: 80 << 30,
        }),
        _ => None,
    }
}

/// The share of the roofline time eager PyTorch reaches on a GPU: the gaps
/// between kernel launches and the element-wise ops it does not fuse, which
/// the per-kernel rooflines above do not carry. Fitted on one published
/// point only — torchtitan's `docs/performance.md` row for Llama 3 8B with
/// FSDP2 on 64 × A100 80GB (local batch 1, sequence 8192, selective op AC:
/// 2,973 tokens/s per GPU), which `chorus plan` predicted at 3,513.0
/// tokens/s with this factor 1 and every other constant as sourced: 2973 /
/// 3513.0. (Refitted the same way on 2026-11-26 when FSDP's copy-out became
/// a few copies per parameter instead of one per rank; the first fit,
/// 2973 / 3328.5, priced a kernel floor per rank.) The H100 rows of
/// torchtitan's table were not used to set it; they are the held-out check
/// (`docs/plan.md`).
pub const EAGER_EFFICIENCY: f64 = 2973.0 / 3513.0;

/// Peak reserved memory over peak allocated memory of PyTorch's CUDA caching
/// allocator (block rounding, cached free segments, fragmentation), which is
/// what torchtitan reports as memory. Fitted once, on 2026-11-26, on one
/// published point only — torchtitan's 128 × H100 FSDP row (Llama 3.1 8B,
/// local batch 2: 67.0 GiB), which `chorus plan` predicted at 58.112 GiB
/// allocated: 67.0 / 58.112. (Refitted on 2026-11-26 when the activation
/// count came to equal PyTorch's autograd, `plan/tests/saved_torch.rs`;
/// the first fit was 67.0 / 58.237.) The 8 × H100 row is the held-out check.
pub const RESERVED_OVER_ALLOCATED: f64 = 67.0 / 58.112;

/// What PyTorch's caching allocator would reserve for a peak of `allocated`
/// bytes on `--gpu KIND` (None on the cpu device, whose allocator is ours).
pub fn reserved_estimate(gpu: &str, allocated: u64) -> Option<u64> {
    gpu_spec(gpu).map(|_| (allocated as f64 * RESERVED_OVER_ALLOCATED) as u64)
}

/// A GPU kind's cost model.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuModel {
    /// The GPU.
    pub spec: GpuSpec,
    /// Its links.
    pub fabric: Fabric,
}

impl GpuModel {
    /// `spec` in nodes of `gpus_per_node`.
    pub fn new(spec: GpuSpec, gpus_per_node: usize) -> GpuModel {
        let fabric = Fabric {
            gpus_per_node,
            nvlink_busbw: spec.nvlink_busbw,
            nic_bytes_per_s: spec.nic_bytes_per_s,
            ring: NCCL_RING,
            tree: NCCL_TREE,
        };
        GpuModel { spec, fabric }
    }

    fn memory_seconds(&self, bytes: f64) -> f64 {
        bytes / (self.spec.hbm_bytes_per_s * self.spec.memory_efficiency)
    }
}

impl CostModel for GpuModel {
    fn kernel_seconds(&self, kernel: &KernelCost) -> f64 {
        let s = &self.spec;
        let compute = match kernel.kind {
            KernelKind::Gemm => kernel.flops / (s.clocked_flops * s.gemm_efficiency),
            KernelKind::Attention => kernel.flops * CAUSAL_WORK_FRACTION / (s.clocked_flops * s.attention_efficiency),
            KernelKind::MemoryBound => 0.0,
        };
        compute.max(self.memory_seconds(kernel.bytes)).max(s.kernel_floor_s) / EAGER_EFFICIENCY
    }

    fn collective_seconds(&self, shape: &CollectiveShape) -> f64 {
        self.fabric.collective_seconds(shape)
    }

    fn copy_seconds(&self, bytes: u64, from: MemorySpace, to: MemorySpace) -> f64 {
        let b = bytes as f64;
        match (from, to) {
            // A device copy reads and writes every byte.
            (MemorySpace::Device, MemorySpace::Device) => self.memory_seconds(2.0 * b),
            (MemorySpace::Host, MemorySpace::Host) => b / crate::cpu_model::HOST_COPY_BYTES_PER_S,
            _ => b / self.spec.pcie_bytes_per_s,
        }
        .max(self.spec.kernel_floor_s)
    }

    fn peak_flops(&self) -> Option<f64> {
        Some(self.spec.peak_flops)
    }

    /// NCCL's model depends on how the ranks sit on the nodes.
    fn prices_alike(&self, a: &[usize], b: &[usize]) -> bool {
        let gpn = self.fabric.gpus_per_node;
        crate::nccl::Placement::of(a, gpn) == crate::nccl::Placement::of(b, gpn)
    }
}

/// The cost model of `--gpu KIND` in nodes of `gpus_per_node` (the cpu
/// device ignores it: the sim's ranks share one process).
pub fn cost_model(gpu: &str, gpus_per_node: usize) -> Result<Arc<dyn CostModel>, String> {
    if gpus_per_node == 0 {
        return Err("--gpus-per-node must be at least 1".into());
    }
    if gpu == "cpu" {
        return Ok(Arc::new(CpuModel::frozen()));
    }
    match gpu_spec(gpu) {
        Some(spec) => Ok(Arc::new(GpuModel::new(spec, gpus_per_node))),
        None => Err(format!("unknown --gpu `{gpu}`; known: {}", GPU_KINDS.join(", "))),
    }
}

/// How the model's operations run on `--gpu KIND`: PyTorch-style kernels
/// with flash attention on a GPU (what the published numbers ran), candle's
/// with materialized attention scores on the cpu device (what `chorus
/// train` runs there).
pub fn framework(gpu: &str) -> Framework {
    if gpu == "cpu" {
        Framework::Candle
    } else {
        Framework::TorchEager
    }
}
