//! The Llama architecture for training, exactly as transformers'
//! `LlamaForCausalLM` computes it, on chorus's fused differentiable ops
//! (`chorus-kernels`): token embedding; per decoder layer RMSNorm → causal
//! self-attention with RoPE (rotate-half) and grouped-query heads (flash
//! attention: no `T × T` buffer) → residual → RMSNorm → SwiGLU MLP
//! `down(silu(gate(x)) · up(x))` → residual; final RMSNorm; LM head, tied to
//! the embedding or not. Parameters carry transformers' names. The heads
//! stay in the projections' layout, `[batch, seq, heads, head_dim]`, so no
//! transpose is made, and RoPE's tables are made once per device
//! ([`RopeCache`]).
//!
//! As a plain candle model ([`Llama`]) and under FSDP through the candle
//! adapter ([`shard`]; [`LlamaModel`] is what the training loop takes), wrapped as torchtitan wraps a Llama under
//! FSDP2: the embedding, each decoder layer, and the final norm with the
//! head are param groups of their own (tied embeddings: embedding, norm and
//! head one group).
//! [`init_params`] is transformers' initialisation as per-shard sources
//! (deferred init): deterministic from the seed, independent of the world
//! size.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{Device, Module, Tensor};
use candle_nn::{Embedding, VarBuilder};
use chorus_collectives::CommBackend;
use chorus_devices::ComputeBackend;
use chorus_fsdp::{DeferredParam, Fsdp, ShardSource};
use chorus_fsdp_candle::FsdpModel;
use chorus_kernels::{attention, rope, swiglu, RopeCache};

use super::layers::{Linear, RmsNorm};
use super::{DecoderModel, PlainDecoder, ShardedDecoder};
use crate::rng::mix;

pub mod config;
pub mod hf;

use config::LlamaConfig;

/// The prefixes of the parameters the decoder layers do not hold: the
/// embedding, then the final norm and the head.
pub const ROOT_PREFIXES: [&str; 3] = ["model.embed_tokens.", "model.norm.", "lm_head."];

/// The name of the embedding's own group (an untied model's; a tied one
/// keeps it in `root` with the head that shares its matrix).
pub const EMBED_GROUP: &str = "model.embed_tokens";

/// One of transformers' initial values: normal(0, `std`) per element, from a
/// counter-based generator keyed by the seed and the parameter's name, so
/// any rank computes any element alone; or ones (the norms).
struct InitSource {
    shape: Vec<usize>,
    /// `None`: every element is one.
    normal: Option<Normal>,
}

struct Normal {
    key: u64,
    std: f64,
    /// A row left at zero (the embedding's `padding_idx`).
    zero_row: Option<usize>,
}

/// A standard normal for element `i` of the tensor keyed `key` (Box–Muller
/// on two uniforms drawn from the counter `2i`, `2i + 1`).
fn normal_at(key: u64, i: u64) -> f64 {
    let u = |c: u64| ((mix(key ^ mix(c)) >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
    let (u1, u2) = (u(2 * i), u(2 * i + 1));
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// FNV-1a of a name: the tensor's part of its generator key.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

impl ShardSource for InitSource {
    fn read_rows(&self, dim: usize, rows: Range<usize>) -> Result<Vec<f32>, String> {
        let n = *self.shape.get(dim).ok_or(format!("dim {dim} is out of range for {:?}", self.shape))?;
        if rows.end > n || rows.start > rows.end {
            return Err(format!("rows {rows:?} are out of range for {:?}", self.shape));
        }
        let outer: usize = self.shape[..dim].iter().product();
        let inner: usize = self.shape[dim + 1..].iter().product();
        let row_len = self.shape[1..].iter().product::<usize>();
        let mut out = Vec::with_capacity(outer * rows.len() * inner);
        for o in 0..outer {
            for r in rows.clone() {
                for k in 0..inner {
                    let flat = (o * n + r) * inner + k;
                    out.push(match &self.normal {
                        None => 1.0,
                        Some(nm) if nm.zero_row == Some(flat / row_len.max(1)) => 0.0,
                        Some(nm) => (nm.std * normal_at(nm.key, flat as u64)) as f32,
                    });
                }
            }
        }
        Ok(out)
    }
}

/// transformers' initialisation of `cfg` (`LlamaPreTrainedModel._init_weights`:
/// Linear and Embedding weights normal(0, `initializer_range`), the
/// embedding's `pad_token_id` row zero, RMSNorm weights one), as sources
/// each rank reads its shards from: element `i` of a tensor is a function
/// of `seed`, the tensor's name and `i` alone, so the model is the same at
/// every world size and nobody computes more than its shards.
pub fn init_params(cfg: &LlamaConfig, seed: u64) -> Vec<DeferredParam> {
    cfg.param_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let normal = (!name.ends_with("norm.weight")).then(|| Normal {
                key: mix(seed ^ mix(name_hash(&name))),
                std: cfg.initializer_range,
                zero_row: if name == "model.embed_tokens.weight" { cfg.pad_token_id } else { None },
            });
            DeferredParam { source: Arc::new(InitSource { shape: shape.clone(), normal }), name, shape }
        })
        .collect()
}

/// The whole of each parameter, read from its source (for plain candle,
/// which holds the whole model).
pub fn materialize(params: &[DeferredParam]) -> candle_core::Result<Vec<(String, Tensor)>> {
    params
        .iter()
        .map(|p| {
            let rows = p.shape.first().copied().unwrap_or(1);
            let values =
                p.source.read_rows(0, 0..rows).map_err(|e| candle_core::Error::msg(format!("{}: {e}", p.name)))?;
            Ok((p.name.clone(), Tensor::from_vec(values, p.shape.as_slice(), &Device::Cpu)?))
        })
        .collect()
}

/// One decoder layer's keys and values of the positions decoded so far
/// (`[batch, seen, kv_heads, head_dim]` each, after RoPE), so a step
/// computes only its new positions ([`Llama::forward_cached`]).
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    kv: Option<(Tensor, Tensor)>,
}

impl KvCache {
    /// The number of positions cached.
    pub fn len(&self) -> usize {
        self.kv.as_ref().and_then(|(k, _)| k.dim(1).ok()).unwrap_or(0)
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The model's RMSNorm (the fused op).
fn rms_norm(cfg: &LlamaConfig, vb: VarBuilder) -> candle_core::Result<RmsNorm> {
    RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, vb)
}

/// The RoPE tables of `cfg`'s head size and base, to share among its layers.
pub fn rope_cache(cfg: &LlamaConfig) -> candle_core::Result<Arc<RopeCache>> {
    RopeCache::new(cfg.head_dim, cfg.rope_theta)
}

/// One `LlamaDecoderLayer`.
pub struct DecoderLayer {
    input_layernorm: RmsNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    post_attention_layernorm: RmsNorm,
    gate: Linear,
    up: Linear,
    down: Linear,
    cfg: Arc<LlamaConfig>,
    rope: Arc<RopeCache>,
}

impl DecoderLayer {
    /// The layer whose parameters are under `vb` (`model.layers.{i}`),
    /// reading RoPE's tables from `rope` ([`rope_cache`]).
    pub fn new(cfg: Arc<LlamaConfig>, rope: Arc<RopeCache>, vb: VarBuilder) -> candle_core::Result<DecoderLayer> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let (q, kv) = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim);
        let a = vb.pp("self_attn");
        let m = vb.pp("mlp");
        Ok(DecoderLayer {
            input_layernorm: rms_norm(&cfg, vb.pp("input_layernorm"))?,
            q: Linear::new(h, q, a.pp("q_proj"))?,
            k: Linear::new(h, kv, a.pp("k_proj"))?,
            v: Linear::new(h, kv, a.pp("v_proj"))?,
            o: Linear::new(q, h, a.pp("o_proj"))?,
            post_attention_layernorm: rms_norm(&cfg, vb.pp("post_attention_layernorm"))?,
            gate: Linear::new(h, i, m.pp("gate_proj"))?,
            up: Linear::new(h, i, m.pp("up_proj"))?,
            down: Linear::new(i, h, m.pp("down_proj"))?,
            cfg,
            rope,
        })
    }

    /// Causal self-attention with RoPE and grouped-query attention (each
    /// key/value head serves `heads / kv_heads` consecutive query heads, as
    /// transformers' `repeat_kv`). With a cache, `x` holds the positions
    /// after the cached ones, which it attends to as well, and its keys and
    /// values are appended to the cache.
    fn attention(&self, x: &Tensor, cache: Option<&mut KvCache>) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim);
        let past = cache.as_ref().map_or(0, |c| c.len());
        let (cos, sin) = self.rope.tables(x.device(), past, t)?;
        let q = rope(&self.q.forward(x)?.reshape((b, t, nh, hd))?, &cos, &sin)?;
        let k = rope(&self.k.forward(x)?.reshape((b, t, nkv, hd))?, &cos, &sin)?;
        let v = self.v.forward(x)?.reshape((b, t, nkv, hd))?;
        let (k, v) = match cache {
            None => (k, v),
            Some(c) => {
                let kv = match c.kv.take() {
                    None => (k, v),
                    Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 1)?, Tensor::cat(&[&pv, &v], 1)?),
                };
                c.kv = Some(kv.clone());
                kv
            }
        };
        let out = attention(&q, &k, &v, 1.0 / (hd as f64).sqrt())?;
        self.o.forward(&out.reshape((b, t, nh * hd))?)
    }

    /// `x + attn(norm(x))`, then `+ down(silu(gate(·)) · up(·))` of its norm;
    /// `x` is `[batch, seq, hidden]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_cached(x, None)
    }

    /// [`forward`](Self::forward) of the positions after those in `cache`
    /// (none without one), appending theirs to it.
    pub fn forward_cached(&self, x: &Tensor, cache: Option<&mut KvCache>) -> candle_core::Result<Tensor> {
        let x = (x + self.attention(&self.input_layernorm.forward(x)?, cache)?)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        let mlp = self.down.forward(&swiglu(&self.gate.forward(&h)?, &self.up.forward(&h)?)?)?;
        x + mlp
    }
}

/// The token embedding of `ids` (`[batch, seq]`, u32).
pub fn embed(cfg: &LlamaConfig, vb: VarBuilder, ids: &Tensor) -> candle_core::Result<Tensor> {
    let w = vb.get((cfg.vocab_size, cfg.hidden_size), "model.embed_tokens.weight")?;
    Embedding::new(w, cfg.hidden_size).forward(ids)
}

/// The final norm and the LM head (the embedding's matrix when tied): logits `[batch, seq, vocab]`.
pub fn head(cfg: &LlamaConfig, vb: VarBuilder, x: &Tensor) -> candle_core::Result<Tensor> {
    let norm = rms_norm(cfg, vb.pp("model.norm"))?;
    let name = if cfg.tie_word_embeddings { "model.embed_tokens.weight" } else { "lm_head.weight" };
    let w = vb.get((cfg.vocab_size, cfg.hidden_size), name)?;
    let h = norm.forward(x)?;
    let (b, t, d) = h.dims3()?;
    // Computed as (w · hᵀ)ᵀ rather than h · wᵀ (candle's `Linear`): the
    // matrix, the model's largest, is then the product's own operand, so
    // backward makes its gradient with one product, not a product and then
    // a transposed copy of the whole matrix (a rank's peak is in the head's
    // backward: `docs/fsdp.md`). The transposed logits cost a copy of
    // batch × seq × vocab.
    w.matmul(&h.reshape((b * t, d))?.t()?)?.t()?.reshape((b, t, cfg.vocab_size))
}

/// The Llama as a plain candle model.
pub struct Llama {
    cfg: Arc<LlamaConfig>,
    vb: VarBuilder<'static>,
    layers: Vec<DecoderLayer>,
}

impl Llama {
    /// The model whose parameters are in `vb` (a `VarMap` for training, or
    /// safetensors files).
    pub fn new(cfg: Arc<LlamaConfig>, vb: VarBuilder<'static>) -> candle_core::Result<Llama> {
        let rope = rope_cache(&cfg)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::new(cfg.clone(), rope.clone(), vb.pp(format!("model.layers.{i}"))))
            .collect::<candle_core::Result<_>>()?;
        Ok(Llama { cfg, vb, layers })
    }

    /// Logits of `ids` (`[batch, seq]`, u32).
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = embed(&self.cfg, self.vb.clone(), ids)?;
        for l in &self.layers {
            x = l.forward(&x)?;
        }
        head(&self.cfg, self.vb.clone(), &x)
    }

    /// Empty caches, one per decoder layer, for [`forward_cached`](Self::forward_cached).
    pub fn new_cache(&self) -> Vec<KvCache> {
        vec![KvCache::default(); self.layers.len()]
    }

    /// The logits of the last of `ids` (`[batch, seq]`, u32; `[batch, vocab]`),
    /// `ids` being the positions after those in `cache` (from
    /// [`new_cache`](Self::new_cache)), whose keys and values it appends:
    /// a prompt once, then one token per step, each step attending to the
    /// cache instead of recomputing the sequence.
    pub fn forward_cached(&self, ids: &Tensor, cache: &mut [KvCache]) -> candle_core::Result<Tensor> {
        if cache.len() != self.layers.len() {
            return Err(candle_core::Error::msg(format!(
                "{} caches for {} decoder layers",
                cache.len(),
                self.layers.len()
            )));
        }
        let mut x = embed(&self.cfg, self.vb.clone(), ids)?;
        for (l, c) in self.layers.iter().zip(cache.iter_mut()) {
            x = l.forward_cached(&x, Some(c))?;
        }
        // The head is per position: only the last one's logits are needed.
        let t = x.dim(1)?;
        let last = x.narrow(1, t.saturating_sub(1), 1)?;
        head(&self.cfg, self.vb.clone(), &last)?.squeeze(1)
    }
}

/// Removes and returns the parameters whose names start with one of `prefixes`.
fn take(params: &mut Vec<DeferredParam>, prefixes: &[&str]) -> Vec<DeferredParam> {
    let (taken, kept): (Vec<_>, Vec<_>) =
        std::mem::take(params).into_iter().partition(|p| prefixes.iter().any(|x| p.name.starts_with(x)));
    *params = kept;
    taken
}

/// The Llama to train: its configuration and initial parameters as sources
/// of their shards ([`init_params`], or Hugging Face weights).
#[derive(Clone, Debug)]
pub struct LlamaModel {
    /// The model's config.
    pub config: Arc<LlamaConfig>,
    /// Initial parameters.
    pub init: Vec<DeferredParam>,
}

impl DecoderModel for LlamaModel {
    fn name(&self) -> &'static str {
        "Llama configuration"
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn config_json(&self) -> chorus_fsdp_candle::Result<serde_json::Value> {
        serde_json::to_value(&*self.config).map_err(|e| chorus_fsdp_candle::Error::InvalidArgument(e.to_string()))
    }

    fn shard<C>(&self, fsdp: Fsdp<C>, forward_prefetch: bool) -> chorus_fsdp_candle::Result<ShardedDecoder<C>>
    where
        C: CommBackend + 'static,
        C::B: ComputeBackend,
    {
        shard(fsdp, self.config.clone(), self.init.clone(), forward_prefetch)
    }

    fn init_tensors(&self) -> chorus_fsdp_candle::Result<Vec<(String, Tensor)>> {
        Ok(materialize(&self.init)?)
    }

    fn plain(&self, vb: VarBuilder<'static>) -> chorus_fsdp_candle::Result<Box<dyn PlainDecoder>> {
        Ok(Box::new(Llama::new(self.config.clone(), vb)?))
    }
}

impl PlainDecoder for Llama {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        Llama::forward(self, ids)
    }
}

/// The Llama under FSDP through the candle adapter, grouped as torchtitan
/// groups it: the embedding ([`EMBED_GROUP`]), one group per decoder layer,
/// and `root` (final norm and head; not resharded after forward); with tied
/// embeddings, the embedding is in `root` too. Each rank reads only its
/// shards from the sources of `params` ([`init_params`], or Hugging Face
/// weights). With `forward_prefetch`, each group's pre-forward also
/// all-gathers the next group.
pub fn shard<C: CommBackend + 'static>(
    fsdp: Fsdp<C>,
    cfg: Arc<LlamaConfig>,
    mut params: Vec<DeferredParam>,
    forward_prefetch: bool,
) -> chorus_fsdp_candle::Result<ShardedDecoder<C>>
where
    C::B: ComputeBackend,
{
    let mut model = FsdpModel::new(fsdp)?;
    // As torchtitan wraps a Llama: the embedding its own group (resharded
    // after forward, like a layer), the final norm and the head one group
    // (not resharded after forward: its backward comes first), so only
    // the group in use is unsharded. Tied embeddings make the head's
    // matrix the embedding's: then the three are one group.
    let tied = cfg.tie_word_embeddings;
    let first = match tied {
        true => model.add_group_deferred("root", take(&mut params, &ROOT_PREFIXES), true)?,
        false => model.add_group_deferred(EMBED_GROUP, take(&mut params, &["model.embed_tokens."]), false)?,
    };
    let c = cfg.clone();
    let embed_stage = model.add_stage(first, move |vb, ids| embed(&c, vb, ids))?;
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    let mut groups = vec![first.0];
    // One set of RoPE tables for every layer (and the recomputations in backward).
    let rope = rope_cache(&cfg)?;
    for i in 0..cfg.num_hidden_layers {
        let prefix = format!("model.layers.{i}");
        let g = model.add_group_deferred(&prefix, take(&mut params, &[&format!("{prefix}.")]), false)?;
        groups.push(g.0);
        let (c, r) = (cfg.clone(), rope.clone());
        layers.push(
            model.add_stage(g, move |vb, x| DecoderLayer::new(c.clone(), r.clone(), vb.pp(&prefix))?.forward(x))?,
        );
    }
    let last = match tied {
        true => first,
        false => {
            let g = model.add_group_deferred("root", take(&mut params, &ROOT_PREFIXES[1..]), true)?;
            groups.push(g.0);
            g
        }
    };
    if let Some(p) = params.first() {
        return Err(chorus_fsdp_candle::Error::InvalidArgument(format!("parameter `{}` belongs to no group", p.name)));
    }
    let c = cfg.clone();
    let head_stage = model.add_stage(last, move |vb, x| head(&c, vb, x))?;
    ShardedDecoder::new(model, (embed_stage, layers, head_stage), &groups, forward_prefetch)
}

/// The groups [`shard`] registers, without values (for `chorus plan`).
pub fn groups(cfg: &LlamaConfig) -> chorus_fsdp_candle::Result<super::DecoderGroups> {
    let prefixes = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let layers =
        (0..cfg.num_hidden_layers).map(|i| (format!("model.layers.{i}"), vec![format!("model.layers.{i}.")], false));
    let (spec, head): (Vec<_>, usize) = match cfg.tie_word_embeddings {
        true => (std::iter::once(("root".to_string(), prefixes(&ROOT_PREFIXES), true)).chain(layers).collect(), 0),
        false => {
            let embed = (EMBED_GROUP.to_string(), prefixes(&ROOT_PREFIXES[..1]), false);
            let root = ("root".to_string(), prefixes(&ROOT_PREFIXES[1..]), true);
            (std::iter::once(embed).chain(layers).chain(std::iter::once(root)).collect(), cfg.num_hidden_layers + 1)
        }
    };
    Ok(super::DecoderGroups { groups: super::group_shapes(cfg.param_shapes(), &spec)?, embed: 0, head })
}
