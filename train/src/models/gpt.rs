//! A small decoder-only transformer on candle and chorus's fused ops (token
//! embedding, pre-norm blocks of causal flash attention and a GELU MLP with
//! RMSNorm, a final RMSNorm and an LM head), as a plain candle model ([`Gpt`]) and sharded
//! with FSDP through the candle adapter ([`shard`]): one param group per
//! block, plus the root group (embedding, final norm, head) with two
//! stages, as FSDP2 wraps a transformer. [`GptModel`] is what the training
//! loop takes.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, VarBuilder};
use chorus_collectives::CommBackend;
use chorus_devices::ComputeBackend;
use chorus_fsdp::Fsdp;
use chorus_fsdp_candle::{take_params, FsdpModel, GroupId, StageId};

use super::layers::{Linear, RmsNorm};
use super::{Initialised, PlainDecoder, ShardedDecoder};
use crate::rng::SplitMix;

/// The transformer's sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GptConfig {
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads (they divide `d_model`).
    pub heads: usize,
    /// Width of the MLP's hidden layer.
    pub d_ff: usize,
    /// Context length.
    pub seq_len: usize,
}

impl GptConfig {
    /// Checks the sizes.
    pub fn validate(&self) -> Result<(), String> {
        if [self.vocab, self.d_model, self.layers, self.heads, self.d_ff, self.seq_len].contains(&0) {
            return Err("every transformer size must be positive".into());
        }
        if self.d_model % self.heads != 0 {
            return Err(format!("{} heads do not divide d_model {}", self.heads, self.d_model));
        }
        Ok(())
    }

    /// Parameter names and shapes, in registration order.
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (d, f) = (self.d_model, self.d_ff);
        self.shapes_with_mlp(|p, out| {
            out.push((format!("{p}.mlp.up.weight"), vec![f, d]));
            out.push((format!("{p}.mlp.down.weight"), vec![d, f]));
        })
    }

    /// The transformer's parameter names and shapes, in registration order,
    /// each block's MLP (after its `mlp_norm`) written by `mlp` from the
    /// block's prefix: the dense MLP's, or the mixture of experts'
    /// ([`super::moe`]).
    pub(crate) fn shapes_with_mlp(
        &self,
        mlp: impl Fn(&str, &mut Vec<(String, Vec<usize>)>),
    ) -> Vec<(String, Vec<usize>)> {
        let (v, d) = (self.vocab, self.d_model);
        let mut out = vec![("embed.weight".to_string(), vec![v, d])];
        for i in 0..self.layers {
            let p = format!("blocks.{i}");
            out.push((format!("{p}.attn_norm.weight"), vec![d]));
            for w in ["q", "k", "v", "o"] {
                out.push((format!("{p}.attn.{w}.weight"), vec![d, d]));
            }
            out.push((format!("{p}.mlp_norm.weight"), vec![d]));
            mlp(&p, &mut out);
        }
        out.push(("norm.weight".to_string(), vec![d]));
        out.push(("head.weight".to_string(), vec![v, d]));
        out
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        self.param_shapes().iter().map(|(_, s)| s.iter().product::<usize>()).sum()
    }
}

/// Initial parameters from `seed` (GPT-2's scheme: normal-like weights of
/// scale 0.02, output projections scaled by 1/√(2·layers), norms at one),
/// drawn with chorus's own generator so every rank and every run agrees.
pub fn init_params(cfg: &GptConfig, seed: u64) -> candle_core::Result<Vec<(String, Tensor)>> {
    init_shapes(cfg.param_shapes(), cfg.layers, seed)
}

/// [`init_params`]'s scheme for any parameters named as the transformer's
/// (`*norm.weight` at one, `*.o.weight` and `*down.weight` scaled as output
/// projections of `layers` blocks), drawn in the order of `shapes`.
pub fn init_shapes(
    shapes: Vec<(String, Vec<usize>)>,
    layers: usize,
    seed: u64,
) -> candle_core::Result<Vec<(String, Tensor)>> {
    let mut rng = SplitMix::new(seed ^ 0x6_7074);
    let proj_scale = 1.0 / (2.0 * layers as f32).sqrt();
    shapes
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let values: Vec<f32> = if name.ends_with("norm.weight") {
                vec![1.0; n]
            } else {
                let scale =
                    if name.ends_with(".o.weight") || name.ends_with("down.weight") { 0.02 * proj_scale } else { 0.02 };
                // The sum of four uniforms is close to normal; variance 4/12 → scale by √3.
                (0..n)
                    .map(|_| (0..4).map(|_| rng.uniform(-1.0, 1.0)).sum::<f32>() * scale * 3f32.sqrt() / 2.0)
                    .collect()
            };
            Ok((name, Tensor::from_vec(values, shape, &Device::Cpu)?))
        })
        .collect()
}

const NORM_EPS: f64 = 1e-5;

/// The transformer's RMSNorm (the fused op).
pub(crate) fn rms_norm(size: usize, vb: VarBuilder) -> candle_core::Result<RmsNorm> {
    RmsNorm::new(size, NORM_EPS, vb)
}

/// A block's attention half: `x + attn(norm(x))` (the MoE's layers share it).
pub struct Attention {
    norm: RmsNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    heads: usize,
}

impl Attention {
    /// The attention whose parameters are under `vb` (`blocks.{i}`:
    /// `attn_norm`, `attn.{q,k,v,o}`).
    pub fn new(cfg: &GptConfig, vb: &VarBuilder) -> candle_core::Result<Attention> {
        let d = cfg.d_model;
        Ok(Attention {
            norm: rms_norm(d, vb.pp("attn_norm"))?,
            q: Linear::new(d, d, vb.pp("attn.q"))?,
            k: Linear::new(d, d, vb.pp("attn.k"))?,
            v: Linear::new(d, d, vb.pp("attn.v"))?,
            o: Linear::new(d, d, vb.pp("attn.o"))?,
            heads: cfg.heads,
        })
    }

    /// `x + attn(norm(x))`; `x` is `[batch, seq, d_model]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let hd = d / self.heads;
        let h = self.norm.forward(x)?;
        let split = |y: Tensor| y.reshape((b, t, self.heads, hd));
        let (q, k, v) = (split(self.q.forward(&h)?)?, split(self.k.forward(&h)?)?, split(self.v.forward(&h)?)?);
        let attn = chorus_kernels::attention(&q, &k, &v, 1.0 / (hd as f64).sqrt())?;
        x + self.o.forward(&attn.reshape((b, t, d))?)?
    }
}

/// One pre-norm transformer block.
pub struct Block {
    attn: Attention,
    mlp_norm: RmsNorm,
    up: Linear,
    down: Linear,
}

impl Block {
    /// The block whose parameters are under `vb` (`blocks.{i}`).
    pub fn new(cfg: &GptConfig, vb: VarBuilder) -> candle_core::Result<Block> {
        let (d, f) = (cfg.d_model, cfg.d_ff);
        Ok(Block {
            attn: Attention::new(cfg, &vb)?,
            mlp_norm: rms_norm(d, vb.pp("mlp_norm"))?,
            up: Linear::new(d, f, vb.pp("mlp.up"))?,
            down: Linear::new(f, d, vb.pp("mlp.down"))?,
        })
    }

    /// `x + attn(norm(x))`, then `+ mlp(norm(·))`; `x` is `[batch, seq, d_model]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = self.attn.forward(x)?;
        let h = self.mlp_norm.forward(&x)?;
        let h = self.down.forward(&self.up.forward(&h)?.gelu()?)?;
        x + h
    }
}

/// The token embedding of `ids` (`[batch, seq]`, u32).
pub fn embed(cfg: &GptConfig, vb: VarBuilder, ids: &Tensor) -> candle_core::Result<Tensor> {
    Embedding::new(vb.get((cfg.vocab, cfg.d_model), "embed.weight")?, cfg.d_model).forward(ids)
}

/// The final norm and the LM head: logits `[batch, seq, vocab]`.
pub fn head(cfg: &GptConfig, vb: VarBuilder, x: &Tensor) -> candle_core::Result<Tensor> {
    let norm = rms_norm(cfg.d_model, vb.pp("norm"))?;
    let head = Linear::new(cfg.d_model, cfg.vocab, vb.pp("head"))?;
    head.forward(&norm.forward(x)?)
}

/// The transformer as a plain candle model.
pub struct Gpt {
    cfg: GptConfig,
    vb: VarBuilder<'static>,
    blocks: Vec<Block>,
}

impl Gpt {
    /// The model whose parameters are in `vb` (a `VarMap` for training, or
    /// safetensors files for inference).
    pub fn new(cfg: GptConfig, vb: VarBuilder<'static>) -> candle_core::Result<Gpt> {
        let blocks = (0..cfg.layers)
            .map(|i| Block::new(&cfg, vb.pp(format!("blocks.{i}"))))
            .collect::<candle_core::Result<_>>()?;
        Ok(Gpt { cfg, vb, blocks })
    }

    /// Logits of `ids` (`[batch, seq]`, u32).
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = embed(&self.cfg, self.vb.clone(), ids)?;
        for b in &self.blocks {
            x = b.forward(&x)?;
        }
        head(&self.cfg, self.vb.clone(), &x)
    }
}

/// The transformer to train: its sizes and initial parameters (e.g. from
/// [`init_params`]).
pub type GptModel = Initialised<GptConfig>;

super::decoder_config!(GptConfig, "transformer", vocab: |c: &GptConfig| c.vocab, shard: shard, plain: Gpt);

impl PlainDecoder for Gpt {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        Gpt::forward(self, ids)
    }
}

/// The transformer under FSDP through the candle adapter: the root group
/// (`embed.`, `norm.`, `head.`; not resharded after forward) with the
/// embedding and head stages, and one group per block, as FSDP2 wraps a
/// transformer. `params` come from [`init_params`] or a checkpoint. With
/// `forward_prefetch`, each group's pre-forward also all-gathers the next
/// group, so the all-gather of block `i + 1` runs while candle computes
/// block `i` (the root's backward prefetch is FSDP's default).
pub fn shard<C: CommBackend + 'static>(
    fsdp: Fsdp<C>,
    cfg: GptConfig,
    mut params: Vec<(String, Tensor)>,
    forward_prefetch: bool,
) -> chorus_fsdp_candle::Result<ShardedDecoder<C>>
where
    C::B: ComputeBackend,
{
    let (mut model, root, embed_stage) = root_with_embedding(fsdp, &cfg, &mut params)?;
    let mut blocks = Vec::with_capacity(cfg.layers);
    let mut groups = vec![root.0];
    for i in 0..cfg.layers {
        let prefix = format!("blocks.{i}.");
        let g = model.add_group(&format!("blocks.{i}"), take_params(&mut params, &[&prefix]), false)?;
        groups.push(g.0);
        blocks.push(model.add_stage(g, move |vb, x| Block::new(&cfg, vb.pp(format!("blocks.{i}")))?.forward(x))?);
    }
    let head_stage = head_after_all_grouped(&mut model, root, &cfg, &params)?;
    ShardedDecoder::new(model, (embed_stage, blocks, head_stage), &groups, forward_prefetch)
}

/// The root group of a transformer sharded by groups (`embed.`, `norm.`,
/// `head.`, taken out of `params`; not resharded after forward) and its
/// embedding stage: the start of [`shard`] and of the MoE's.
pub(super) fn root_with_embedding<C: CommBackend + 'static>(
    fsdp: Fsdp<C>,
    cfg: &GptConfig,
    params: &mut Vec<(String, Tensor)>,
) -> chorus_fsdp_candle::Result<(FsdpModel<C>, GroupId, StageId)>
where
    C::B: ComputeBackend,
{
    let mut model = FsdpModel::new(fsdp)?;
    let root = model.add_group("root", take_params(params, &["embed.", "norm.", "head."]), true)?;
    let cfg = *cfg;
    let embed_stage = model.add_stage(root, move |vb, ids| embed(&cfg, vb, ids))?;
    Ok((model, root, embed_stage))
}

/// The root group's head stage, once every parameter has a group (one left
/// in `params` is an error): the end of [`shard`] and of the MoE's.
pub(super) fn head_after_all_grouped<C: CommBackend + 'static>(
    model: &mut FsdpModel<C>,
    root: GroupId,
    cfg: &GptConfig,
    params: &[(String, Tensor)],
) -> chorus_fsdp_candle::Result<StageId>
where
    C::B: ComputeBackend,
{
    if let Some((name, _)) = params.first() {
        return Err(chorus_fsdp_candle::Error::InvalidArgument(format!("parameter `{name}` belongs to no group")));
    }
    let cfg = *cfg;
    model.add_stage(root, move |vb, x| head(&cfg, vb, x))
}

/// The groups [`shard`] registers, without values (for `chorus plan`).
pub fn groups(cfg: &GptConfig) -> chorus_fsdp_candle::Result<super::DecoderGroups> {
    let mut spec = vec![("root".to_string(), vec!["embed.".into(), "norm.".into(), "head.".into()], true)];
    spec.extend((0..cfg.layers).map(|i| (format!("blocks.{i}"), vec![format!("blocks.{i}.")], false)));
    Ok(super::DecoderGroups { groups: super::group_shapes(cfg.param_shapes(), &spec)?, embed: 0, head: 0 })
}

/// Continues `prompt` by `n` characters with the model whose full
/// parameters are `params` (greedy decoding, plain candle): a look at what
/// the model learned.
pub fn sample(cfg: &GptConfig, params: &[(String, Vec<f32>)], prompt: &str, n: usize) -> candle_core::Result<String> {
    let shapes = cfg.param_shapes();
    let mut tensors = std::collections::HashMap::new();
    for (name, values) in params {
        let shape =
            shapes.iter().find(|(n, _)| n == name).map(|(_, s)| s.clone()).unwrap_or_else(|| vec![values.len()]);
        tensors.insert(name.clone(), Tensor::from_vec(values.clone(), shape, &Device::Cpu)?);
    }
    let gpt = Gpt::new(*cfg, VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu))?;
    let mut tokens = crate::text::encode(prompt);
    for _ in 0..n {
        let ctx = &tokens[tokens.len().saturating_sub(cfg.seq_len)..];
        let ids = Tensor::from_vec(ctx.to_vec(), (1, ctx.len()), &Device::Cpu)?;
        let logits = gpt.forward(&ids)?.squeeze(0)?;
        let last = logits.get(ctx.len() - 1)?;
        tokens.push(last.argmax(0)?.to_scalar::<u32>()?);
    }
    Ok(crate::text::decode(&tokens))
}
