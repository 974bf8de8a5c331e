//! What the modelled device and communicator ask of a cost model.
//!
//! Times are seconds of virtual time. Sizes are bytes. Nothing here moves
//! data: a [`KernelCost`] says how much arithmetic and memory traffic a
//! kernel has, a [`CollectiveShape`] how many bytes a collective moves over
//! which ranks, and the [`CostModel`] turns either into a duration.

use chorus_collectives::OpKind;
use chorus_devices::MemorySpace;

/// The host's memory bandwidth per GPU for an offloaded optimizer step on a
/// GPU server, bytes/s: the DGX H100's two Xeon Platinum 8480C (DGX H100
/// user guide) have 8 channels of DDR5-4800 each (Intel ARK), 8 × 4.8 GT/s ×
/// 8 B = 307.2 GB/s per socket, 614.4 GB/s for the node's 8 GPUs' processes:
/// 76.8 GB/s each. A bound: the step is priced as one pass over its bytes
/// (`docs/plan-costs.md`).
pub const HOST_STEP_BYTES_PER_S: f64 = 614.4e9 / 8.0;

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

/// Which kernel it is, for a cost model calibrated kernel by kernel
/// ([`crate::kernel_rates`]: one achieved rate per entry). chorus's own
/// fused kernels (crate `chorus-kernels`) each have a forward and a
/// backward entry; everything else is a GEMM or an element-wise kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelOp {
    /// A matrix multiply on cuBLAS (bf16 or f32 in, f32 accumulation), candle's batched attention matmuls included.
    Gemm,
    /// chorus's fused RMSNorm, forward.
    RmsNorm,
    /// Its backward (the weight's gradient included).
    RmsNormBackward,
    /// chorus's rotary embedding on `[batch, seq, heads, head_dim]`, forward.
    Rope,
    /// Its backward (the rotation by the opposite angle).
    RopeBackward,
    /// chorus's causal flash attention with grouped-query heads, forward (and PyTorch's SDPA).
    Attention,
    /// Its backward: the scores recomputed from the saved log-sum-exp.
    AttentionBackward,
    /// chorus's fused `silu(gate) · up`, forward.
    Swiglu,
    /// Its backward.
    SwigluBackward,
    /// chorus's fused cross-entropy over the logits (no f32 probabilities), forward.
    CrossEntropy,
    /// Its backward.
    CrossEntropyBackward,
    /// Any other memory-bound kernel: candle's unary and binary ops, casts,
    /// the embedding's gather and scatter, FSDP's casts, fills,
    /// accumulations and optimizer steps.
    Elementwise,
}

impl KernelOp {
    /// What a kernel of `kind` is when nothing more is known.
    pub fn of_kind(kind: KernelKind) -> KernelOp {
        match kind {
            KernelKind::Gemm => KernelOp::Gemm,
            KernelKind::Attention => KernelOp::Attention,
            KernelKind::MemoryBound => KernelOp::Elementwise,
        }
    }
}

/// One kernel as the cost model sees it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KernelCost {
    /// What it is, for the timeline (`"attn.qkv"`, `"adamw_step"`).
    pub name: String,
    /// What bounds it.
    pub kind: KernelKind,
    /// Which kernel it is, for per-kernel rates.
    pub op: KernelOp,
    /// Floating-point operations (a multiply-add is two). Attention's are
    /// counted on the whole `S × S` square, as torchtitan counts them; a
    /// causal kernel does half ([`crate::gpu::CAUSAL_WORK_FRACTION`]).
    pub flops: f64,
    /// Bytes read plus bytes written in device memory.
    pub bytes: f64,
    /// Operations the framework issues on the host for this kernel: 1, or
    /// more where the workload lists one kernel for several (candle's
    /// backward of an op also runs its gradient store's `zeros_like` and
    /// `add` for each differentiable input: `GradStore::or_insert` in
    /// candle-core's `backprop.rs`).
    pub issues: u32,
}

impl KernelCost {
    /// A kernel issued once, whose [`KernelOp`] follows from its `kind`.
    pub fn new(name: impl Into<String>, kind: KernelKind, flops: f64, bytes: f64) -> KernelCost {
        KernelCost { name: name.into(), kind, op: KernelOp::of_kind(kind), flops, bytes, issues: 1 }
    }

    /// The same kernel as `op`.
    pub fn with_op(self, op: KernelOp) -> KernelCost {
        KernelCost { op, ..self }
    }
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
    /// default: the PyTorch GPU model's launch cost is in its fitted kernel
    /// efficiency (`gpu::EAGER_EFFICIENCY`), so it keeps this default.
    fn host_cost(&self, issuer: Issuer) -> HostCost {
        let _ = issuer;
        HostCost::default()
    }
    /// Whether every collective over the global ranks `a` costs what it
    /// costs over `b` (what lets one rank stand for the others,
    /// `run::Ranks::Symmetric`). The default is for models whose
    /// collectives depend on the number of ranks alone; a model of a
    /// topology compares where the ranks sit.
    fn prices_alike(&self, a: &[usize], b: &[usize]) -> bool {
        a.len() == b.len()
    }
}

/// Who issues an operation, for [`CostModel::host_cost`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Issuer {
    /// The model's own kernels (a stage's forward and backward), issued by
    /// the training framework between FSDP's hooks: per operation issued
    /// ([`KernelCost::issues`]).
    Model,
    /// What FSDP enqueues on its streams: copies, casts, fills, reductions.
    Fsdp,
    /// Each piece of a batched 2-D copy beyond the batch's own operation
    /// (the cuda device issues one driver call per piece; the cpu device
    /// runs the batch as one job).
    CopyPiece,
    /// One optimizer step kernel (one per parameter shard).
    Optimizer,
    /// One of FSDP's hooks on one group (pre/post forward, pre/post
    /// backward): its own host work besides the operations it issues.
    Hook,
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
