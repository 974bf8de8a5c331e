//! The decoder's fused differentiable ops, each a candle custom op with its
//! backward, a CPU reference and a CUDA kernel: [`rms_norm`](mod@rms_norm), [`rope`](mod@rope),
//! [`swiglu`](mod@swiglu), [`attention`](mod@attention) (causal flash attention with grouped-query
//! heads) and [`cross_entropy`](mod@cross_entropy). Every model that `chorus train` runs (the
//! Llama, the transformer, the mixture of experts) calls these; they know
//! nothing of sharding or backends.
//!
//! Each op is one file with its forward and backward side by side (as
//! llm.c's `llmc/*.cuh`): the CPU reference there is plain f32 code that
//! a reader can check by eye, and the CUDA kernels are in `cuda/`
//! (compiled by `build.rs` with the `cuda` feature). Inputs are f32, bf16
//! or f16; arithmetic is f32 and outputs are rounded once to the inputs'
//! dtype. The CUDA source is also compiled by the host's C++ compiler in the
//! tests and checked against the references ([`CUDA_SOURCES`]).
//!
//! [`timing`] records device time per kind of op when asked.
#![warn(missing_docs)]

mod attention_shape;
mod host;
mod op;
mod saved;

pub mod attention;
pub mod cross_entropy;
pub mod rms_norm;
pub mod rope;
pub mod swiglu;
pub mod timing;

#[cfg(feature = "cuda")]
mod cuda;

pub use attention::{attention, AttentionShape};
pub use cross_entropy::cross_entropy;
pub use rms_norm::rms_norm;
pub use rope::{rope, RopeCache};
pub use swiglu::swiglu;

/// The CUDA sources, `(file name, text)`, in `cuda/`: what nvcc compiles
/// (`chorus_kernels.cu` includes the rest) and what the host tests compile.
pub const CUDA_SOURCES: [(&str, &str); 8] = [
    ("chorus_kernels.cu", include_str!("../cuda/chorus_kernels.cu")),
    ("common.cuh", include_str!("../cuda/common.cuh")),
    ("rms_norm.cuh", include_str!("../cuda/rms_norm.cuh")),
    ("rope.cuh", include_str!("../cuda/rope.cuh")),
    ("swiglu.cuh", include_str!("../cuda/swiglu.cuh")),
    ("cross_entropy.cuh", include_str!("../cuda/cross_entropy.cuh")),
    ("attention_forward.cuh", include_str!("../cuda/attention_forward.cuh")),
    ("attention_backward.cuh", include_str!("../cuda/attention_backward.cuh")),
];
