//! What the modelled device and communicator ask of a cost model.
//!
//! Times are seconds of virtual time. Sizes are bytes. Nothing here moves
//! data: a [`KernelCost`] says how much arithmetic and memory traffic a
//! kernel has, a [`CollectiveShape`] how many bytes a collective moves over
//! which ranks, and the [`CostModel`] turns either into a duration.

use chorus_collectives::OpKind;
use chorus_devices::MemorySpace;

/// What bounds a kernel's time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum KernelKind {
    /// A matrix multiply: FLOPs at the GPU's calibrated GEMM throughput.
    Gemm,
    /// Attention (causal where the model is): FLOPs at the attention kernel's throughput.
    Attention,
    /// Elementwise, norm, copy-in/out, optimizer: bytes at HBM bandwidth.
    MemoryBound,
}

/// One kernel as the cost model sees it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KernelCost {
    /// What it is, for the timeline (`"attn.qkv"`, `"adamw_step"`).
    pub name: String,
    /// What bounds it.
    pub kind: KernelKind,
    /// Floating-point operations (a multiply-add is two).
    pub flops: f64,
    /// Bytes read plus bytes written in device memory.
    pub bytes: f64,
}

/// One collective as the cost model sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollectiveShape {
    /// The operation.
    pub op: OpKind,
    /// The larger of the per-rank input and output buffers, in bytes (an
    /// all-gather's output, a reduce-scatter's input, an all-reduce's buffer).
    pub bytes: u64,
    /// The global ranks of the communicator, in its rank order.
    pub ranks: Vec<usize>,
}

/// How long things take on one kind of machine.
pub trait CostModel: Send + Sync + std::fmt::Debug {
    /// Seconds for `kernel` on one GPU (or the cpu device).
    fn kernel_seconds(&self, kernel: &KernelCost) -> f64;
    /// Seconds from the moment the last rank of `shape.ranks` reaches the
    /// collective until it is complete on every rank.
    fn collective_seconds(&self, shape: &CollectiveShape) -> f64;
    /// Seconds for a copy of `bytes` from one memory space to another
    /// (device to device is HBM; host to device and back is PCIe).
    fn copy_seconds(&self, bytes: u64, from: MemorySpace, to: MemorySpace) -> f64;
    /// Dense bf16 peak FLOP/s of one GPU, for MFU (None for the cpu device).
    fn peak_flops(&self) -> Option<f64>;
    /// What issuing an operation costs the host, by who issues it. None by
    /// default: on a GPU the launch cost is in the fitted kernel efficiency
    /// (`gpu::EAGER_EFFICIENCY`), so the GPU models keep this default.
    fn host_cost(&self, issuer: Issuer) -> HostCost {
        let _ = issuer;
        HostCost::default()
    }
}

/// Who issues an operation, for [`CostModel::host_cost`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Issuer {
    /// The model's own kernels (a stage's forward and backward), issued by
    /// the training framework between FSDP's hooks.
    Model,
    /// What FSDP enqueues on its streams: copies, casts, fills, reductions,
    /// the optimizer step.
    Fsdp,
    /// A collective (the communicator enqueues it once every rank arrived).
    Collective,
}

/// What an operation costs the host thread that issues it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HostCost {
    /// Seconds the host is busy issuing it; the operation cannot start
    /// before the host is done (non-negative; anything else counts as 0).
    pub issue_s: f64,
    /// Whether the host thread runs the operation itself, and so is busy
    /// until it ends (candle's kernels on the cpu device, or a rank whose
    /// streams share its one core).
    pub runs_on_host: bool,
}
