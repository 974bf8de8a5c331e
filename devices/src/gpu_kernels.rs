//! The compute kernels of the GPU devices, written once: one CUDA C++ source
//! that NVRTC (the cuda device, `cuda/kernels.rs`) and hipRTC (the hip
//! device, `hip/kernels.rs`) both compile at run time.
//!
//! What is per vendor stays in each backend: compiling, loading the module,
//! launching. What both share is here: the source (`gpu_kernels.cu` beside
//! this file, included as [`SOURCE`]), the names of its kernels,
//! the dtype codes they switch on, the block sizes, the scalars the
//! optimizer kernels take and how a launch's arguments are laid out (`Args`).
//!
//! The source is plain CUDA C++ that both compilers accept: no PTX assembly,
//! no vendor header, no `half` types. f16 and bf16 are bit patterns converted
//! by integer code (round to nearest even, NaN quieted as the `half` crate
//! does), f64 to f32 is the language's `(float)v` (round to nearest), and f64
//! to f16/bf16 rounds to odd into f32 first, so the final rounding is a single
//! rounding of the exact value, as on the cpu device. Every kernel is
//! `extern "C"`, takes its dtypes as codes ([`code`]; the switch is uniform
//! across a launch, and these kernels are bound by memory bandwidth, so one
//! kernel beats an instance per dtype combination) and walks its elements
//! with a grid-stride loop, so any grid covers any length.
//!
//! The arithmetic mirrors the cpu device (`cpu/kernels.rs`) bit for bit where
//! IEEE allows: f16/bf16 compute in f32 and round once, f64 in f64, integers
//! wrap, no multiply-add contraction (both backends compile with it off) and
//! IEEE division and square root. The reductions (`mse_loss`,
//! `sum_squares`) sum in f64 in a fixed order, which is deterministic (a
//! large `sum_squares` in fixed chunks over many blocks, then their sums in
//! one block: [`sum_squares_split`]); the tree
//! order differs from the host's left-to-right sum, so the last bits of an
//! f64 may. `chorus_matmul` (16×16 shared-memory tiles, f32 accumulation, f64
//! for f64) is what the hip device uses instead of a BLAS library; the cuda
//! device uses cuBLAS and never launches it, but it compiles there too.
//!
//! The host test `devices/tests/gpu_kernels_host/` compiles this same source
//! with the host C++ compiler (the CUDA keywords defined away, a block's
//! threads as OS threads) and checks every kernel against the cpu device and
//! the conversions against `half`, all 65536 patterns of f16 and bf16.

use crate::{AdamWParams, DType, SgdParams};

/// Threads per block of the elementwise kernels (`__launch_bounds__` in [`SOURCE`]).
pub const BLOCK: u32 = 256;
/// Threads of the single-block reductions (a power of two, at most the
/// source's shared array of 1024).
pub const REDUCE_BLOCK: u32 = 1024;
/// Side of `chorus_matmul`'s square tile: blocks are `TILE × TILE` threads.
pub const TILE: u32 = 16;
/// Most blocks a grid-stride launch uses.
pub const MAX_BLOCKS: u64 = 65_535;

/// How `chorus_sum_squares_part` splits `n` elements: `(chunk, parts)`, a
/// function of `n` alone (so the sum's order, and its bits, are too); one
/// part means the single-block `chorus_sum_squares` does the whole sum.
pub fn sum_squares_split(n: u64) -> (u64, u64) {
    const MIN_CHUNK: u64 = 1 << 16;
    const MAX_PARTS: u64 = 1024;
    let chunk = n.div_ceil(MAX_PARTS).max(MIN_CHUNK);
    (chunk, n.div_ceil(chunk).max(1))
}

/// Blocks of a grid-stride launch of [`BLOCK`] threads over `n` elements.
pub fn blocks_for(n: u64) -> u32 {
    n.div_ceil(BLOCK as u64).clamp(1, MAX_BLOCKS) as u32
}

/// The code of `d` that the kernels switch on.
pub fn code(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        DType::I32 => 4,
        DType::I64 => 5,
        DType::I8 => 6,
        DType::U8 => 7,
        DType::F8E4M3 => 8,
    }
}

/// Every kernel [`SOURCE`] defines, by its `extern "C"` name.
pub const NAMES: &[&str] = &[
    "chorus_fill",
    "chorus_cast",
    "chorus_scale",
    "chorus_clip_scale",
    "chorus_accumulate",
    "chorus_accumulate_int",
    "chorus_axpy",
    "chorus_bias_add",
    "chorus_relu",
    "chorus_relu_backward",
    "chorus_mse_grad",
    "chorus_mse_loss",
    "chorus_column_sums",
    "chorus_sum_squares",
    "chorus_sum_squares_part",
    "chorus_sum_squares_finish",
    "chorus_abs_max",
    "chorus_quantize_f8",
    "chorus_dequantize_f8",
    "chorus_sgd",
    "chorus_adamw",
    "chorus_matmul",
    "chorus_copy_batch",
    "chorus_fill_batch",
];

/// The scalars of `chorus_sgd`, as torch's single-tensor SGD computes them
/// (f64 parameters applied in f32), in the kernel's parameter order after the
/// pointers and the length.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdScalars {
    /// Learning rate.
    pub lr: f32,
    /// Weight decay.
    pub weight_decay: f32,
    /// Momentum.
    pub momentum: f32,
    /// `1 - dampening`.
    pub one_minus_dampening: f32,
    /// Whether the weight decay term is added (1) or not (0).
    pub has_weight_decay: i32,
    /// Whether the momentum buffer is used (1) or not (0).
    pub use_momentum: i32,
    /// Whether the buffer is set to the gradient (the first step).
    pub first_step: i32,
    /// Nesterov momentum.
    pub nesterov: i32,
}

impl SgdScalars {
    /// The scalars of `params`; `has_buffer` says whether a momentum buffer was given.
    pub fn new(params: &SgdParams, has_buffer: bool) -> SgdScalars {
        SgdScalars {
            lr: params.lr as f32,
            weight_decay: params.weight_decay as f32,
            momentum: params.momentum as f32,
            one_minus_dampening: (1.0 - params.dampening) as f32,
            has_weight_decay: (params.weight_decay != 0.0) as i32,
            use_momentum: (params.momentum != 0.0 && has_buffer) as i32,
            first_step: params.first_step as i32,
            nesterov: params.nesterov as i32,
        }
    }
}

/// The scalars of `chorus_adamw`, as torch's single-tensor AdamW computes
/// them (in f64, as Python does, then applied in f32), in the kernel's
/// parameter order after the pointers and the length.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWScalars {
    /// `1 - lr * weight_decay`.
    pub decay: f32,
    /// `1 - beta1`.
    pub one_minus_beta1: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `sqrt(1 - beta2^step)`.
    pub bias_correction2_sqrt: f32,
    /// `lr / (1 - beta1^step)`.
    pub step_size: f32,
    /// `eps`.
    pub eps: f32,
}

impl AdamWScalars {
    /// The scalars of `params` (a step of 0 counts as 1, as on the cpu device).
    pub fn new(params: &AdamWParams) -> AdamWScalars {
        let step = params.step.max(1) as i32;
        AdamWScalars {
            decay: (1.0 - params.lr * params.weight_decay) as f32,
            one_minus_beta1: (1.0 - params.beta1) as f32,
            beta2: params.beta2 as f32,
            one_minus_beta2: (1.0 - params.beta2) as f32,
            bias_correction2_sqrt: (1.0 - params.beta2.powi(step)).sqrt() as f32,
            step_size: (params.lr / (1.0 - params.beta1.powi(step))) as f32,
            eps: params.eps as f32,
        }
    }
}

/// A kernel's arguments in [`SOURCE`]'s parameter order, each in an 8-byte
/// slot (a 4-byte argument is read from the slot's low half, which
/// little-endian puts first): `cuLaunchKernel` and `hipModuleLaunchKernel`
/// take them alike, as pointers to each value, and copy the values at the launch.
#[derive(Debug, Default)]
pub(crate) struct Args {
    slots: Vec<u64>,
}

impl Args {
    /// A device address.
    pub(crate) fn ptr(mut self, p: u64) -> Self {
        self.slots.push(p);
        self
    }
    /// A `u64` (lengths).
    pub(crate) fn u64(mut self, v: u64) -> Self {
        self.slots.push(v);
        self
    }
    /// A `double`.
    pub(crate) fn f64(mut self, v: f64) -> Self {
        self.slots.push(v.to_bits());
        self
    }
    /// A `float`.
    pub(crate) fn f32(mut self, v: f32) -> Self {
        self.slots.push(v.to_bits() as u64);
        self
    }
    /// An `int` (dtype codes, flags).
    pub(crate) fn i32(mut self, v: i32) -> Self {
        self.slots.push(v as u32 as u64);
        self
    }
    /// `chorus_sgd`'s scalars, after its pointers and length.
    pub(crate) fn sgd(self, sc: &SgdScalars) -> Self {
        self.f32(sc.lr)
            .f32(sc.weight_decay)
            .f32(sc.momentum)
            .f32(sc.one_minus_dampening)
            .i32(sc.has_weight_decay)
            .i32(sc.use_momentum)
            .i32(sc.first_step)
            .i32(sc.nesterov)
    }
    /// `chorus_adamw`'s scalars, after its pointers and length.
    pub(crate) fn adamw(self, sc: &AdamWScalars) -> Self {
        self.f32(sc.decay)
            .f32(sc.one_minus_beta1)
            .f32(sc.beta2)
            .f32(sc.one_minus_beta2)
            .f32(sc.bias_correction2_sqrt)
            .f32(sc.step_size)
            .f32(sc.eps)
    }
    /// The `kernelParams` array of a launch: a pointer to each slot, valid
    /// while `self` is neither moved nor dropped.
    pub(crate) fn pointers(&mut self) -> Vec<*mut std::ffi::c_void> {
        self.slots.iter_mut().map(|s| s as *mut u64 as *mut std::ffi::c_void).collect()
    }
}

/// The kernels, for NVRTC and hipRTC alike (`gpu_kernels.cu` beside this file).
pub const SOURCE: &str = include_str!("gpu_kernels.cu");

#[cfg(test)]
mod tests {
    use super::*;

    /// A 4-byte argument sits in its slot's low half with the high half zero,
    /// and the optimizer scalars follow the kernels' parameter order.
    #[test]
    fn arguments_fill_one_slot_each_in_parameter_order() {
        let sgd =
            SgdParams { lr: 0.5, momentum: 0.25, dampening: 0.0, weight_decay: 2.0, nesterov: true, first_step: false };
        let args = Args::default().i32(-1).f32(1.5).f64(-2.0).ptr(0xdead_beef).u64(7).sgd(&SgdScalars::new(&sgd, true));
        let f = |v: f32| v.to_bits() as u64;
        let expected =
            [0xffff_ffff, f(1.5), (-2.0f64).to_bits(), 0xdead_beef, 7, f(0.5), f(2.0), f(0.25), f(1.0), 1, 1, 0, 1];
        assert_eq!(args.slots, expected);
        let adamw = AdamWParams { lr: 0.5, beta1: 0.5, beta2: 0.75, eps: 0.125, weight_decay: 1.0, step: 1 };
        let s = AdamWScalars::new(&adamw);
        let order =
            [s.decay, s.one_minus_beta1, s.beta2, s.one_minus_beta2, s.bias_correction2_sqrt, s.step_size, s.eps];
        assert_eq!(Args::default().adamw(&s).slots, order.map(f));
    }
}
