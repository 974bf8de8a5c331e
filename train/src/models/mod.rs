//! The decoder models the training loop ([`decoder`](crate::decoder))
//! trains, each behind one trait, [`DecoderModel`]: its name, its
//! configuration as JSON (recorded in checkpoints), its sharded form under
//! FSDP and its plain candle form (the reference). A model is a decoder
//! stack — an embedding stage, one stage per layer, a head stage — so its
//! sharded form is always a [`ShardedDecoder`]; adding a model (a Mistral or
//! Qwen2 variant of the Llama) is a file here implementing the trait.
//!
//! - [`gpt`]: a small decoder-only transformer written with candle-nn.
//! - [`llama`]: the Llama exactly as transformers' `LlamaForCausalLM`
//!   computes it, with its `config.json` ([`llama::config`]) and Hugging
//!   Face directories in and out ([`llama::hf`]).
//! - [`moe`]: the transformer with a mixture of experts (top-1 routing) as
//!   each block's MLP, each expert its own routed param group.
//! - [`layers`]: the linear layer and the norm they share, on chorus's
//!   fused ops (`chorus-kernels`), which every model calls for its norms,
//!   attention, SwiGLU and loss.
//!
//! Nothing here depends on the loop.

pub mod gpt;
pub mod layers;
pub mod llama;
pub mod moe;

use candle_core::Tensor;
use candle_nn::VarBuilder;
use chorus_collectives::CommBackend;
use chorus_devices::ComputeBackend;
use chorus_fsdp::Fsdp;
use chorus_fsdp_candle::{FsdpModel, Result, StageId};
use serde::Serialize;

/// A param group of a decoder's sharded form without its values: its name,
/// its parameters' names and shapes in registration order, and whether it is
/// FSDP2's root. What `chorus plan` runs FSDP on instead of the tensors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupShape {
    /// The group's name.
    pub name: String,
    /// Its parameters' full names and shapes.
    pub params: Vec<(String, Vec<usize>)>,
    /// Not resharded after forward.
    pub root: bool,
}

/// A decoder's param groups as its `shard` registers them, and the groups
/// its embedding and head stages use (each layer's stage uses the group
/// after the embedding's, in order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecoderGroups {
    /// The groups in registration order.
    pub groups: Vec<GroupShape>,
    /// The embedding stage's group.
    pub embed: usize,
    /// The head stage's group.
    pub head: usize,
}

/// Splits `shapes` (registration order) into groups as the adapter's
/// `take_params` does: each `(name, prefixes, root)` in turn takes the
/// parameters left whose names start with one of its prefixes. A parameter
/// no group takes is an error, as in `shard`.
pub fn group_shapes(
    mut shapes: Vec<(String, Vec<usize>)>,
    groups: &[(String, Vec<String>, bool)],
) -> Result<Vec<GroupShape>> {
    let mut out = Vec::with_capacity(groups.len());
    for (name, prefixes, root) in groups {
        let (taken, kept) = std::mem::take(&mut shapes)
            .into_iter()
            .partition(|(n, _): &(String, Vec<usize>)| prefixes.iter().any(|p| n.starts_with(p.as_str())));
        shapes = kept;
        out.push(GroupShape { name: name.clone(), params: taken, root: *root });
    }
    if let Some((name, _)) = shapes.first() {
        return Err(chorus_fsdp_candle::Error::InvalidArgument(format!("parameter `{name}` belongs to no group")));
    }
    Ok(out)
}

/// A decoder model to train: its configuration and initial parameters, and
/// how to build it sharded (every rank) or plain (the reference).
pub trait DecoderModel: Send + Sync {
    /// What the model is called in messages ("transformer", "Llama configuration").
    fn name(&self) -> &'static str;

    /// Tokens in the vocabulary.
    fn vocab_size(&self) -> usize;

    /// The configuration, recorded in every checkpoint and compared field by
    /// field on resume.
    fn config_json(&self) -> Result<serde_json::Value>;

    /// Shards the initial parameters with `fsdp` (each rank keeps only its
    /// shards). With `forward_prefetch`, each group's pre-forward also
    /// all-gathers the next group.
    fn shard<C>(&self, fsdp: Fsdp<C>, forward_prefetch: bool) -> Result<ShardedDecoder<C>>
    where
        C: CommBackend + 'static,
        C::B: ComputeBackend;

    /// The initial parameters whole, in registration order (for plain
    /// candle, which holds the whole model).
    fn init_tensors(&self) -> Result<Vec<(String, Tensor)>>;

    /// The plain candle model whose parameters are in `vb`.
    fn plain(&self, vb: VarBuilder<'static>) -> Result<Box<dyn PlainDecoder>>;
}

/// What a decoder's sizes (its configuration) say about the model they
/// describe, so that sizes and initial parameters ([`Initialised`]) are a
/// [`DecoderModel`] written once for every such model.
pub trait DecoderConfig: Copy + Serialize + Send + Sync {
    /// What the model is called in messages ([`DecoderModel::name`]).
    const NAME: &'static str;

    /// Tokens in the vocabulary.
    fn vocab_size(&self) -> usize;

    /// The model of these sizes whose initial parameters are `params`, sharded
    /// with `fsdp` (see [`DecoderModel::shard`]).
    fn shard<C>(
        self,
        fsdp: Fsdp<C>,
        params: Vec<(String, Tensor)>,
        forward_prefetch: bool,
    ) -> Result<ShardedDecoder<C>>
    where
        C: CommBackend + 'static,
        C::B: ComputeBackend;

    /// The plain candle model of these sizes whose parameters are in `vb`.
    fn plain(self, vb: VarBuilder<'static>) -> Result<Box<dyn PlainDecoder>>;
}

/// Implements [`DecoderConfig`] for the sizes `$config` of a model called
/// `$name`, whose vocabulary is `$vocab(&sizes)`, sharded by the function
/// `$shard(fsdp, sizes, params, forward_prefetch)` and plain by
/// `$plain::new(sizes, vb)`: each model states these once, the trait's
/// signatures are written here.
macro_rules! decoder_config {
    ($config:ty, $name:literal, vocab: $vocab:expr, shard: $shard:path, plain: $plain:ty) => {
        impl $crate::models::DecoderConfig for $config {
            const NAME: &'static str = $name;

            fn vocab_size(&self) -> usize {
                $vocab(self)
            }

            fn shard<C>(
                self,
                fsdp: chorus_fsdp::Fsdp<C>,
                params: Vec<(String, candle_core::Tensor)>,
                forward_prefetch: bool,
            ) -> chorus_fsdp_candle::Result<$crate::models::ShardedDecoder<C>>
            where
                C: chorus_collectives::CommBackend + 'static,
                C::B: chorus_devices::ComputeBackend,
            {
                $shard(fsdp, self, params, forward_prefetch)
            }

            fn plain(
                self,
                vb: candle_nn::VarBuilder<'static>,
            ) -> chorus_fsdp_candle::Result<Box<dyn $crate::models::PlainDecoder>> {
                Ok(Box::new(<$plain>::new(self, vb)?))
            }
        }
    };
}
pub(crate) use decoder_config;

/// A model to train: its sizes and initial parameters (names and values).
#[derive(Clone, Debug)]
pub struct Initialised<K> {
    /// The model's sizes.
    pub config: K,
    /// Initial parameters.
    pub init: Vec<(String, Tensor)>,
}

impl<K: DecoderConfig> DecoderModel for Initialised<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size()
    }

    fn config_json(&self) -> Result<serde_json::Value> {
        serde_json::to_value(self.config).map_err(|e| chorus_fsdp_candle::Error::InvalidArgument(e.to_string()))
    }

    fn shard<C>(&self, fsdp: Fsdp<C>, forward_prefetch: bool) -> Result<ShardedDecoder<C>>
    where
        C: CommBackend + 'static,
        C::B: ComputeBackend,
    {
        self.config.shard(fsdp, self.init.clone(), forward_prefetch)
    }

    fn init_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self.init.clone())
    }

    fn plain(&self, vb: VarBuilder<'static>) -> Result<Box<dyn PlainDecoder>> {
        self.config.plain(vb)
    }
}

/// A decoder as a plain candle model.
pub trait PlainDecoder {
    /// Logits `[batch, seq, vocab]` of `ids` (`[batch, seq]`, u32).
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor>;
}

/// A decoder under FSDP through the candle adapter: an embedding stage, the
/// layers and a head stage, run in that order.
pub struct ShardedDecoder<C: CommBackend> {
    /// The adapter (and the [`Fsdp`] inside it).
    pub model: FsdpModel<C>,
    embed: StageId,
    layers: Vec<Layer<C>>,
    head: StageId,
}

/// One layer of a [`ShardedDecoder`].
pub enum Layer<C: CommBackend> {
    /// One stage.
    Stage(StageId),
    /// Stages the host routes between (a mixture of experts,
    /// [`moe::MoeLayer`]).
    Routed(Box<dyn RoutedLayer<C>>),
}

/// A layer whose stages the host routes the tokens between: it runs its
/// stages of `model` on `x` (`[batch, seq, d_model]`).
pub trait RoutedLayer<C: CommBackend>: Send + Sync {
    /// The layer's output on `x`.
    fn forward(&self, model: &FsdpModel<C>, x: &Tensor) -> Result<Tensor>;
}

impl<C: CommBackend + 'static> ShardedDecoder<C>
where
    C::B: ComputeBackend,
{
    /// The decoder whose stages `model` holds; `groups` (the param groups in
    /// forward order) chain each group's forward prefetch to the next one's
    /// when `forward_prefetch` is set, as FSDP2's explicit forward prefetch.
    pub fn new(
        model: FsdpModel<C>,
        (embed, layers, head): (StageId, Vec<StageId>, StageId),
        groups: &[usize],
        forward_prefetch: bool,
    ) -> Result<Self> {
        let layers = layers.into_iter().map(Layer::Stage).collect();
        Self::with_layers(model, (embed, layers, head), groups, forward_prefetch)
    }

    /// [`ShardedDecoder::new`] with any [`Layer`]s; `groups` are those every
    /// rank runs (a routed group has no prefetch of its own).
    pub fn with_layers(
        model: FsdpModel<C>,
        (embed, layers, head): (StageId, Vec<Layer<C>>, StageId),
        groups: &[usize],
        forward_prefetch: bool,
    ) -> Result<Self> {
        if forward_prefetch {
            model.with_fsdp(|f| -> chorus_fsdp::Result<()> {
                for w in groups.windows(2) {
                    f.set_forward_prefetch(w[0], vec![w[1]])?;
                }
                Ok(())
            })??;
        }
        Ok(ShardedDecoder { model, embed, layers, head })
    }

    /// Logits of `ids` (`[batch, seq]`, u32), carrying candle's graph
    /// through every stage: in the param dtype, or cast (differentiably) to
    /// the mixed-precision policy's output dtype when it names one, as
    /// FSDP2's root casts the model's outputs.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let mut x = self.model.run(self.embed, ids)?;
        for l in &self.layers {
            x = match l {
                Layer::Stage(s) => self.model.run(*s, &x)?,
                Layer::Routed(r) => r.forward(&self.model, &x)?,
            };
        }
        let logits = self.model.run(self.head, &x)?;
        match self.model.with_fsdp(|f| f.mixed_precision().output_dtype)? {
            Some(d) => Ok(logits.to_dtype(chorus_fsdp_candle::convert::candle_dtype(d)?)?),
            None => Ok(logits),
        }
    }
}
