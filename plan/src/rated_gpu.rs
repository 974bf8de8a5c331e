//! chorus's own trainer on a GPU (`chorus plan --kernels candle|chorus`):
//! each kernel at the rates a kernel-rates file gives for its kind
//! ([`crate::kernel_rates`]), the host's time per operation it issues from
//! the same file, and the GPU's links, PCIe and memory from its
//! [`GpuSpec`]. Unlike [`GpuModel`], which prices eager PyTorch with one
//! fitted efficiency and no host, this one says when the host is the
//! bottleneck: an operation cannot start before the host has issued it.

use chorus_devices::MemorySpace;

use crate::cost::{CollectiveShape, CostModel, HostCost, Issuer, KernelCost, KernelOp};
use crate::gpu::{GpuModel, GpuSpec, CAUSAL_WORK_FRACTION};
use crate::kernel_rates::KernelRates;

/// A GPU priced from a kernel-rates file.
#[derive(Clone, Debug, PartialEq)]
pub struct RatedGpuModel {
    /// The rates.
    pub rates: KernelRates,
    /// The GPU's links, PCIe, peak and memory.
    pub gpu: GpuModel,
}

impl RatedGpuModel {
    /// `spec` in nodes of `gpus_per_node`, its kernels and host at `rates`.
    pub fn new(rates: KernelRates, spec: GpuSpec, gpus_per_node: usize) -> RatedGpuModel {
        RatedGpuModel { rates, gpu: GpuModel::new(spec, gpus_per_node) }
    }
}

impl CostModel for RatedGpuModel {
    fn kernel_seconds(&self, k: &KernelCost) -> f64 {
        let kernels = &self.rates.kernels;
        let (flops_per_s, gb_per_s, launch_us) = match kernels.rate(k.op) {
            None => (Some(self.rates.gemm_flops_per_s(k.flops)), kernels.gemm.gb_per_s, kernels.gemm.launch_us),
            Some(r) => (r.tflop_per_s.map(|t| t * 1e12), r.gb_per_s, r.launch_us),
        };
        // A causal attention kernel does half of the square its FLOPs count.
        let done = match k.op {
            KernelOp::Attention | KernelOp::AttentionBackward => k.flops * CAUSAL_WORK_FRACTION,
            _ => k.flops,
        };
        let compute = flops_per_s.map_or(0.0, |r| done / r);
        compute.max(k.bytes / (gb_per_s * 1e9)) + launch_us * 1e-6
    }

    fn collective_seconds(&self, shape: &CollectiveShape) -> f64 {
        self.gpu.collective_seconds(shape)
    }

    /// A device copy at the file's copy rate; across PCIe as the GPU's spec says.
    fn copy_seconds(&self, bytes: u64, from: MemorySpace, to: MemorySpace) -> f64 {
        match (from, to) {
            (MemorySpace::Device, MemorySpace::Device) => {
                let c = &self.rates.kernels.copy;
                2.0 * bytes as f64 / (c.gb_per_s * 1e9) + c.launch_us * 1e-6
            }
            _ => self.gpu.copy_seconds(bytes, from, to),
        }
    }

    fn peak_flops(&self) -> Option<f64> {
        self.gpu.peak_flops()
    }

    /// The file's host constants; the host issues, the GPU runs.
    fn host_cost(&self, issuer: Issuer) -> HostCost {
        let h = &self.rates.host;
        let us = match issuer {
            Issuer::Model => h.model_op_us,
            Issuer::Fsdp => h.fsdp_op_us,
            Issuer::CopyPiece => h.copy_piece_us,
            Issuer::Optimizer => h.optimizer_launch_us,
            Issuer::Hook => h.fsdp_hook_us,
            Issuer::Collective => h.collective_us,
        };
        HostCost { issue_s: us * 1e-6, runs_on_host: false }
    }

    fn prices_alike(&self, a: &[usize], b: &[usize]) -> bool {
        self.gpu.prices_alike(a, b)
    }
}
