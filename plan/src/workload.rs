//! A decoder's work per stage: the kernels of its forward and backward and
//! the activation memory it keeps, from the model's shapes alone.
//!
//! Stages follow `chorus train`'s candle stages (`train/src/models`): the
//! embedding, one per decoder layer, and the head (final norm, output
//! projection and the loss), in forward order.

use chorus_train::models::gpt::GptConfig;
use chorus_train::models::llama::config::LlamaConfig;

use crate::cost::KernelCost;

/// Which decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DecoderKind {
    /// The Hugging Face Llama (`train/src/models/llama`): RMSNorm, RoPE, GQA, SwiGLU.
    Llama,
    /// chorus's transformer (`train/src/models/gpt.rs`).
    Gpt,
}

/// The shapes that set a decoder's work.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DecoderShape {
    /// Which decoder.
    pub kind: DecoderKind,
    /// Decoder layers.
    pub layers: usize,
    /// Hidden size.
    pub d_model: usize,
    /// Attention heads.
    pub heads: usize,
    /// Key/value heads (equal to `heads` without GQA).
    pub kv_heads: usize,
    /// The MLP's inner size.
    pub ffn_hidden: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Whether the output projection is the embedding.
    pub tied_embeddings: bool,
}

impl DecoderShape {
    /// Llama 3.1 8B (its `config.json`): the model of torchtitan's published
    /// H100 runs that `docs/plan.md` compares against.
    pub fn llama_3_1_8b() -> DecoderShape {
        DecoderShape {
            kind: DecoderKind::Llama,
            layers: 32,
            d_model: 4096,
            heads: 32,
            kv_heads: 8,
            ffn_hidden: 14336,
            vocab: 128256,
            tied_embeddings: false,
        }
    }
}

/// The shape of `chorus train`'s transformer.
impl From<&GptConfig> for DecoderShape {
    fn from(c: &GptConfig) -> DecoderShape {
        DecoderShape {
            kind: DecoderKind::Gpt,
            layers: c.layers,
            d_model: c.d_model,
            heads: c.heads,
            kv_heads: c.heads,
            ffn_hidden: c.d_ff,
            vocab: c.vocab,
            tied_embeddings: false,
        }
    }
}

/// The shape of a Llama configuration (`chorus train --model llama`, or a
/// Hugging Face `config.json`).
impl From<&LlamaConfig> for DecoderShape {
    fn from(c: &LlamaConfig) -> DecoderShape {
        DecoderShape {
            kind: DecoderKind::Llama,
            layers: c.num_hidden_layers,
            d_model: c.hidden_size,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            ffn_hidden: c.intermediate_size,
            vocab: c.vocab_size,
            tied_embeddings: c.tie_word_embeddings,
        }
    }
}

/// torchtitan's activation checkpointing modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RecomputeMode {
    /// Keep every activation the backward needs.
    None,
    /// Keep each layer's input only; run the layer's forward again in backward.
    Full,
    /// torchtitan's op-level selective checkpointing: save the outputs of
    /// the ops its policy lists, recompute the rest.
    Selective,
}

/// One stage's work for one micro-batch on one rank.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StageWork {
    /// The stage (`"embed"`, `"layers.3"`, `"head"`).
    pub name: String,
    /// Kernels of the forward, in order.
    pub forward: Vec<KernelCost>,
    /// Kernels of the backward, in order, recomputation first.
    pub backward: Vec<KernelCost>,
    /// Bytes the forward keeps for the backward (freed at the end of the stage's backward).
    pub saved_bytes: u64,
    /// Largest extra bytes live at once inside the forward or the backward
    /// (freed when the stage's forward or backward ends).
    pub transient_bytes: u64,
}
