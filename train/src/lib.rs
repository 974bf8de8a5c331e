//! The reference models and the training loop that drive FSDP through its
//! public API: an example of using `chorus-fsdp`, not part of it.
//!
//! - [`mlp`]: an MLP whose forward and backward are device-layer operations,
//!   registered as one FSDP param group per layer, so the same model trains
//!   on every backend; with a deterministic initialisation.
//! - [`train`]: the MLP's training loop (`chorus train --model mlp` and
//!   `--bench`) — data, optimizer, clipping, losses, step times, peak memory
//!   and FSDP's host overhead per rank.
//! - [`models`]: the decoder models, each behind one trait
//!   ([`DecoderModel`](models::DecoderModel)): [`models::gpt`], a small
//!   decoder-only transformer written with candle-nn and trained on [`text`]
//!   generated from a grammar; [`models::llama`], the Llama architecture
//!   exactly as transformers' `LlamaForCausalLM` computes it, with its
//!   `config.json` ([`models::llama::config`]) and Hugging Face model
//!   directories in (memory-mapped, read shard by shard) and out
//!   ([`models::llama::hf`]).
//! - [`decoder`]: the one training loop for those models, under FSDP
//!   through the candle adapter (`chorus-fsdp-candle`) and as the plain
//!   candle reference, on `.npy` token ids or text.
//! - [`schedule`]: the lr schedule (warmup, then linear or cosine decay),
//!   with PyTorch's `LambdaLR` semantics.
//! - [`codec`]: text to token ids and back, for a run's closing sample.
//! - [`generate`]: a Llama directory as a KV-cached decoder, greedy or
//!   sampled as transformers' `generate` (behind `chorus generate`).
//! - [`model_out`]: the trained model written at a run's end, one gathered
//!   parameter at a time (no rank holds the whole model).
//! - [`npy`]: float32 `.npy` files, the interchange with PyTorch and NumPy
//!   users for initial weights, data and trained parameters, and token files
//!   (read memory-mapped; written row by row by [`npy::TokenWriter`]).
//! - [`tokenizer`]: a Hugging Face `tokenizer.json` with its special tokens,
//!   and byte-level BPE training; [`tokenize`]: text files into token rows.
//! - [`rng`]: the seeded generator (SplitMix64) behind every initialisation
//!   and data draw; [`files`]: the file-system checks made before a path is
//!   read or written.
//!
//! Everything here uses only what `chorus-fsdp` exports. Errors are typed by
//! the layer they come from: a training step's are FSDP's
//! ([`FsdpError`](chorus_fsdp::FsdpError), or the candle adapter's
//! [`Error`](chorus_fsdp_candle::Error) for the decoders), a file's are
//! [`npy::NpyError`], [`files::PathError`], [`models::llama::hf::HfError`],
//! [`tokenizer::TokenizerError`] and [`tokenize::TextInError`], and
//! generation's [`generate::GenerateError`].
#![warn(missing_docs)]

pub mod codec;
pub mod decoder;
pub mod files;
pub mod generate;
pub mod mlp;
pub mod model_out;
pub mod models;
pub mod npy;
pub use chorus_fsdp_candle::rng;
pub mod schedule;
pub mod text;
pub mod tokenize;
pub mod tokenizer;
pub mod train;
