//! A small mixture-of-experts transformer: the [`gpt`]
//! transformer whose every MLP is a router and `experts` MLPs with top-1
//! routing, as the Switch Transformer: each token goes to the expert of its
//! largest router logit, and that expert's output is scaled by the token's
//! softmax gate (the router's probability of that expert).
//!
//! Under FSDP ([`shard`]) each block is a param group (attention,
//! the MLP's norm and the router) and each expert a group of its own,
//! declared routed to its block's with `Fsdp::set_routed_groups`: a rank
//! runs only the experts its tokens were routed to, and FSDP still issues
//! every expert's collectives on every rank in a fixed order, so the ranks'
//! different routings never leave one waiting (docs/fsdp.md, "routed
//! groups"). A block's group has two stages around its experts: the first
//! computes the attention, the normed input and the router logits; the host
//! reads the routing and runs each used expert's stage on its tokens; the
//! second combines. The plain form ([`Moe`]) runs every expert on every
//! token and masks, so the reference shares no dispatch code with it.

use candle_core::{Tensor, D};
use candle_nn::VarBuilder;
use chorus_collectives::CommBackend;
use chorus_devices::ComputeBackend;
use chorus_fsdp::Fsdp;
use chorus_fsdp_candle::{take_params, Error, FsdpModel, StageId};

use super::gpt::{self, rms_norm, Attention, GptConfig};
use super::layers::{Linear, RmsNorm};
use super::{Initialised, Layer, PlainDecoder, RoutedLayer, ShardedDecoder};

/// The most experts per layer this model takes (a bound on the groups and
/// the parameters a flag can ask for).
pub const MAX_EXPERTS: usize = 256;

/// The mixture-of-experts transformer's sizes: the transformer's, with
/// `d_ff` each expert's hidden width.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MoeConfig {
    /// The transformer's sizes.
    #[serde(flatten)]
    pub base: GptConfig,
    /// Experts per layer (1 ..= [`MAX_EXPERTS`]).
    pub experts: usize,
}

impl MoeConfig {
    /// Checks the sizes.
    pub fn validate(&self) -> Result<(), String> {
        self.base.validate()?;
        if !(1..=MAX_EXPERTS).contains(&self.experts) {
            return Err(format!("{} experts: between 1 and {MAX_EXPERTS} per layer", self.experts));
        }
        Ok(())
    }

    /// Parameter names and shapes, in registration order: the
    /// transformer's, each block's MLP a router and its experts.
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let GptConfig { d_model: d, d_ff: f, .. } = self.base;
        self.base.shapes_with_mlp(|p, out| {
            out.push((format!("{p}.router.weight"), vec![self.experts, d]));
            for e in 0..self.experts {
                out.push((format!("{p}.experts.{e}.up.weight"), vec![f, d]));
                out.push((format!("{p}.experts.{e}.down.weight"), vec![d, f]));
            }
        })
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        self.param_shapes().iter().map(|(_, s)| s.iter().product::<usize>()).sum()
    }

    /// Parameters one token computes with (its one expert per layer, not
    /// the others), for FLOPs per token.
    pub fn active_params(&self) -> usize {
        let per_expert = 2 * self.base.d_model * self.base.d_ff;
        self.num_params() - self.base.layers * self.experts.saturating_sub(1) * per_expert
    }
}

/// Initial parameters from `seed`, by the transformer's scheme
/// ([`gpt::init_params`]; the router's weights as any other matrix's).
pub fn init_params(cfg: &MoeConfig, seed: u64) -> candle_core::Result<Vec<(String, Tensor)>> {
    gpt::init_shapes(cfg.param_shapes(), cfg.base.layers, seed)
}

/// The expert of each row of router `logits` (`[.., experts]`, the largest
/// logit; no gradient) and its gate (that expert's softmax probability, with
/// its gradient), both `[.., 1]`. The plain and the sharded forms share it.
fn route(logits: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let choice = logits.argmax_keepdim(D::Minus1)?;
    let gate = candle_nn::ops::softmax(logits, D::Minus1)?.gather(&choice, D::Minus1)?;
    Ok((choice, gate))
}

/// One expert: `down(gelu(up(x)))`.
struct Expert {
    up: Linear,
    down: Linear,
}

impl Expert {
    /// The expert under `vb` (`blocks.{i}.experts.{e}`).
    fn new(cfg: &GptConfig, vb: VarBuilder) -> candle_core::Result<Expert> {
        Ok(Expert {
            up: Linear::new(cfg.d_model, cfg.d_ff, vb.pp("up"))?,
            down: Linear::new(cfg.d_ff, cfg.d_model, vb.pp("down"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.down.forward(&self.up.forward(x)?.gelu()?)
    }
}

/// What a block computes before its experts: `h = x + attn(norm(x))`, the
/// experts' input `norm(h)` and the router's logits.
struct Front {
    attn: Attention,
    norm: RmsNorm,
    router: Linear,
}

impl Front {
    /// The block's front under `vb` (`blocks.{i}`).
    fn new(cfg: &MoeConfig, vb: &VarBuilder) -> candle_core::Result<Front> {
        let d = cfg.base.d_model;
        Ok(Front {
            attn: Attention::new(&cfg.base, vb)?,
            norm: rms_norm(d, vb.pp("mlp_norm"))?,
            router: Linear::new(d, cfg.experts, vb.pp("router"))?,
        })
    }

    /// `(h, norm(h), logits)` of `x` (`[batch, seq, d_model]`).
    fn forward(&self, x: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let h = self.attn.forward(x)?;
        let n = self.norm.forward(&h)?;
        let logits = self.router.forward(&n)?;
        Ok((h, n, logits))
    }
}

/// The transformer with mixture-of-experts MLPs as a plain candle model:
/// every expert computes every token and the routing masks (the reference).
pub struct Moe {
    cfg: MoeConfig,
    vb: VarBuilder<'static>,
    blocks: Vec<(Front, Vec<Expert>)>,
}

impl Moe {
    /// The model whose parameters are in `vb`.
    pub fn new(cfg: MoeConfig, vb: VarBuilder<'static>) -> candle_core::Result<Moe> {
        let blocks = (0..cfg.base.layers)
            .map(|i| {
                let b = vb.pp(format!("blocks.{i}"));
                let experts = (0..cfg.experts)
                    .map(|e| Expert::new(&cfg.base, b.pp(format!("experts.{e}"))))
                    .collect::<candle_core::Result<_>>()?;
                Ok((Front::new(&cfg, &b)?, experts))
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(Moe { cfg, vb, blocks })
    }

    /// Logits of `ids` (`[batch, seq]`, u32).
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.forward_routed(ids)?.0)
    }

    /// Logits of `ids`, and each layer's expert of each token (`[batch · seq]`).
    pub fn forward_routed(&self, ids: &Tensor) -> candle_core::Result<(Tensor, Vec<Vec<u32>>)> {
        let mut x = gpt::embed(&self.cfg.base, self.vb.clone(), ids)?;
        let mut routes = Vec::with_capacity(self.blocks.len());
        for (front, experts) in &self.blocks {
            let (h, n, logits) = front.forward(&x)?;
            let (choice, gate) = route(&logits)?;
            let mut y = h.zeros_like()?;
            for (e, expert) in experts.iter().enumerate() {
                let mask = choice.eq(e as u32)?.to_dtype(h.dtype())?;
                y = (y + expert.forward(&n)?.broadcast_mul(&mask)?)?;
            }
            x = (h + y.broadcast_mul(&gate)?)?;
            routes.push(choice.flatten_all()?.to_vec1::<u32>()?);
        }
        Ok((gpt::head(&self.cfg.base, self.vb.clone(), &x)?, routes))
    }
}

impl PlainDecoder for Moe {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        Moe::forward(self, ids)
    }
}

/// A mixture-of-experts block under FSDP: the block group's two stages and
/// one stage per expert (see the module docs).
pub struct MoeLayer {
    front: StageId,
    experts: Vec<StageId>,
    combine: StageId,
    d_model: usize,
}

impl<C: CommBackend + 'static> RoutedLayer<C> for MoeLayer
where
    C::B: ComputeBackend,
{
    /// The block on `x` (`[batch, seq, d_model]`): the front stage, each
    /// expert's stage on the tokens routed to it (an expert with none is
    /// not run: FSDP finishes it at the block's hooks), then the combine.
    fn forward(&self, model: &FsdpModel<C>, x: &Tensor) -> chorus_fsdp_candle::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (d, rows) = (self.d_model, b * t);
        let front = model.run(self.front, x)?;
        let n = front.narrow(D::Minus1, d, d)?.reshape((rows, d))?;
        let logits = front.narrow(D::Minus1, 2 * d, self.experts.len())?;
        let choice = logits.argmax(D::Minus1)?.flatten_all()?.to_vec1::<u32>()?;
        // The experts' outputs in expert order, then back in token order.
        let (mut outs, mut order) = (Vec::new(), Vec::with_capacity(rows));
        for (e, stage) in self.experts.iter().enumerate() {
            let tokens: Vec<u32> = (0..rows as u32).filter(|&r| choice[r as usize] == e as u32).collect();
            if tokens.is_empty() {
                continue;
            }
            let idx = Tensor::from_vec(tokens.clone(), tokens.len(), front.device())?;
            outs.push(model.run(*stage, &n.index_select(&idx, 0)?)?);
            order.extend(tokens);
        }
        let mut back = vec![0u32; rows];
        for (pos, &row) in order.iter().enumerate() {
            back[row as usize] = pos as u32;
        }
        let back = Tensor::from_vec(back, rows, front.device())?;
        let y = Tensor::cat(&outs, 0)?.index_select(&back, 0)?.reshape((b, t, d))?;
        let h = front.narrow(D::Minus1, 0, d)?;
        model.run(self.combine, &Tensor::cat(&[&h, &y, &logits], D::Minus1)?)
    }
}

/// The mixture-of-experts transformer to train: its sizes and initial
/// parameters (e.g. from [`init_params`]).
pub type MoeModel = Initialised<MoeConfig>;

super::decoder_config!(MoeConfig, "mixture-of-experts transformer", vocab: |c: &MoeConfig| c.base.vocab, shard: shard, plain: Moe);

/// The model under FSDP: the root group (`embed.`, `norm.`, `head.`) with
/// the embedding and head stages, per block a group `blocks.{i}` (the
/// attention, `mlp_norm`, the router) with its front and combine stages, and
/// per expert a group `blocks.{i}.experts.{e}` routed to its block's. With
/// `forward_prefetch`, the root's and blocks' pre-forwards chain (the
/// experts are gathered at their block's hooks whatever the prefetch).
pub fn shard<C: CommBackend + 'static>(
    fsdp: Fsdp<C>,
    cfg: MoeConfig,
    mut params: Vec<(String, Tensor)>,
    forward_prefetch: bool,
) -> chorus_fsdp_candle::Result<ShardedDecoder<C>>
where
    C::B: ComputeBackend,
{
    cfg.validate().map_err(Error::InvalidArgument)?;
    let base = cfg.base;
    let (mut model, root, embed_stage) = gpt::root_with_embedding(fsdp, &base, &mut params)?;
    let (mut layers, mut groups) = (Vec::with_capacity(base.layers), vec![root.0]);
    for i in 0..base.layers {
        let p = format!("blocks.{i}");
        // The block's prefix covers its experts' parameters: those are taken out first.
        let expert_params: Vec<_> =
            (0..cfg.experts).map(|e| take_params(&mut params, &[&format!("{p}.experts.{e}.")])).collect();
        let block = model.add_group(&p, take_params(&mut params, &[&format!("{p}.")]), false)?;
        let experts: Vec<_> = expert_params
            .into_iter()
            .enumerate()
            .map(|(e, own)| {
                let name = format!("{p}.experts.{e}");
                let g = model.add_group(&name, own, false)?;
                let stage = model.add_stage(g, move |vb, x| Expert::new(&base, vb.pp(&name))?.forward(x))?;
                Ok((g, stage))
            })
            .collect::<chorus_fsdp_candle::Result<_>>()?;
        let prefix = p.clone();
        let front = model.add_stage(block, move |vb, x| {
            let (h, n, logits) = Front::new(&cfg, &vb.pp(&prefix))?.forward(x)?;
            Tensor::cat(&[&h, &n, &logits], D::Minus1)
        })?;
        let combine = model.add_stage(block, move |_, z| {
            let d = base.d_model;
            let (h, y, logits) =
                (z.narrow(D::Minus1, 0, d)?, z.narrow(D::Minus1, d, d)?, z.narrow(D::Minus1, 2 * d, cfg.experts)?);
            h + y.broadcast_mul(&route(&logits)?.1)?
        })?;
        let routed: Vec<usize> = experts.iter().map(|(g, _)| g.0).collect();
        model.with_fsdp(|f| f.set_routed_groups(block.0, &routed))??;
        groups.push(block.0);
        let experts = experts.into_iter().map(|(_, s)| s).collect();
        layers.push(Layer::Routed(Box::new(MoeLayer { front, experts, combine, d_model: base.d_model })));
    }
    let head_stage = gpt::head_after_all_grouped(&mut model, root, &base, &params)?;
    ShardedDecoder::with_layers(model, (embed_stage, layers, head_stage), &groups, forward_prefetch)
}
