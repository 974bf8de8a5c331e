//! The one training loop for the decoder models ([`crate::models`]): a
//! [`TrainSpec`] holding any [`DecoderModel`](crate::models::DecoderModel)
//! trains under FSDP ([`train_sharded`], behind `chorus train --model
//! gpt|llama`) or as plain single-process candle on the global batch
//! ([`train_plain`], the reference the FSDP runs are checked against), and
//! reports a [`TrainReport`].
//!
//! - [`data`]: token-id rows or text windows, the same batches at every world size.
//! - [`spec`]: the spec and the reports.
//! - [`sharded`]: the FSDP step loop.
//! - [`plain`]: the plain candle reference.
//! - [`progress`]: how far a run got (`progress.json`), which a resumed run reads to say the work a fault lost.
//! - [`memory`]: the process's resident memory, reported beside FSDP's count.

pub mod data;
pub mod memory;
pub mod plain;
pub mod progress;
pub mod sharded;
pub mod spec;

use candle_core::{Device, Tensor};
use chorus_fsdp_candle::Result;

pub use data::{Data, TokenRows};
pub use plain::{train_plain, train_plain_on};
pub use sharded::{config_changes, train_sharded};
pub use spec::{NonFinite, PlainReport, Sample, SaveTime, TrainReport, TrainSpec, Validation};

/// Mean next-token cross-entropy of `logits` `[batch, seq, vocab]` against
/// `targets` `[batch, seq]`: chorus's fused cross-entropy (f32 arithmetic
/// whatever the logits' dtype, no probability tensor), averaged.
pub fn loss(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    chorus_kernels::cross_entropy(&logits.reshape((b * t, v))?, &targets.reshape(b * t)?)?.mean_all()
}

/// Token ids as a `rows × seq` tensor.
pub(crate) fn u32_tensor(v: Vec<u32>, rows: usize, seq: usize) -> Result<Tensor> {
    Ok(Tensor::from_vec(v, (rows, seq), &Device::Cpu)?)
}
