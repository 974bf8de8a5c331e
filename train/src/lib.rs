//! The reference models and the training loop that drive FSDP through its
//! public API: an example of using `chorus-fsdp`, not part of it.
//!
//! - [`mlp`]: an MLP whose forward and backward are device-layer operations,
//!   registered as one FSDP param group per layer, so the same model trains
//!   on every backend; with a deterministic initialisation.
//! - [`train`]: the loop behind `chorus train` — data, optimizer, clipping,
//!   losses, step times, peak memory and FSDP's host overhead per rank.
//! - [`gpt`]: a small decoder-only transformer written with candle-nn, as a
//!   plain candle model and sharded through the candle adapter
//!   (`chorus-fsdp-candle`), trained on [`text`] generated from a grammar.
//! - [`llama`]: the Llama architecture exactly as transformers'
//!   `LlamaForCausalLM` computes it, plain and under FSDP (one group per
//!   decoder layer plus the root), with [`llama_config`] (`config.json` in
//!   both transformers spellings), [`llama_hf`] (Hugging Face model
//!   directories in, memory-mapped and read shard by shard, and out) and
//!   [`llama_train`] (the loop on `.npy` token ids or text).
//! - [`fsdp_loop`]: what those loops share that does not depend on the model.
//! - [`model_out`]: the trained model written at a run's end, one gathered
//!   parameter at a time (no rank holds the whole model).
//! - [`npy`]: float32 `.npy` files, the interchange with PyTorch and NumPy
//!   users for initial weights, data and trained parameters, and token files
//!   (read memory-mapped; written row by row by [`npy::TokenWriter`]).
//! - [`tokenizer`]: a Hugging Face `tokenizer.json` with its special tokens,
//!   and byte-level BPE training; [`tokenize`]: text files into token rows.
//!
//! Everything here uses only what `chorus-fsdp` exports, and reports errors
//! as [`FsdpError`](chorus_fsdp::FsdpError) so a caller handles one error
//! type for a training step.
#![warn(missing_docs)]

pub mod fsdp_loop;
pub mod gpt;
pub mod gpt_train;
pub mod llama;
pub mod llama_config;
pub mod llama_hf;
pub mod llama_train;
pub mod mlp;
pub mod model_out;
pub mod npy;
pub mod text;
pub mod tokenize;
pub mod tokenizer;
pub mod train;
