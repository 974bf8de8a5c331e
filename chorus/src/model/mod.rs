//! FSDP for your own candle model (feature `candle`): PyTorch FSDP2's
//! `fully_shard` per layer and on the root, for layers written with
//! candle_nn and a [`VarBuilder`].
//!
//! A model is a list of layers, each a function that builds a candle
//! [`Module`] from a `VarBuilder` (as candle_nn's `linear(4, 8, vb)` does).
//! [`ShardBuilder::layer`] makes each layer its own FSDP param group: its
//! parameters are all-gathered just before it runs and freed after (in
//! forward and again in backward), and its gradients reduce-scattered as
//! soon as backward has passed it. [`ShardBuilder::root_layer`] puts a layer
//! in the *root* group instead: the group FSDP2's `fully_shard(model)`
//! makes of the parameters no layer took (typically the embedding and the
//! output head), which is not freed after forward, since its layers run at
//! both ends of the step.
//!
//! Every rank starts from the same weights: drawn from a seed that is the
//! same everywhere ([`ShardBuilder::seed`], the default seed 0), or taken
//! from a `VarBuilder` ([`ShardBuilder::weights`]) and then optionally
//! broadcast from rank 0 ([`ShardBuilder::broadcast_from_rank0`]). Either
//! way [`ShardBuilder::build`] compares every rank's values and refuses to
//! train ([`Error::WeightsDiffer`]) when they differ.
//!
//! On a GPU backend, candle computes on the GPU (feature `candle-cuda`), or
//! `build` fails saying which feature is missing: never a silent fall back
//! to the CPU.
//!
//! ```
//! use chorus::prelude::*;
//! use chorus::candle_core::{Device, Tensor};
//! use chorus::candle_nn::{linear, loss::mse};
//!
//! let losses = chorus::testing::run_ranks(2, |rank| -> chorus::Result<Vec<f64>> {
//!     let mut model = ShardBuilder::new(&rank, FsdpConfig::default());
//!     model.layer("hidden", |vb| linear(3, 8, vb))?;
//!     model.layer("out", |vb| linear(8, 1, vb))?;
//!     let model = model.build()?;
//!     let mut adamw = ShardedOptimizer::new(OptimizerKind::adamw(1e-2, 0.0));
//!     let x = Tensor::arange(0f32, 12., &Device::Cpu)?.reshape((4, 3))?;
//!     let y = Tensor::ones((4, 1), chorus::candle_core::DType::F32, &Device::Cpu)?;
//!     let (x, y) = (batch_slice(&x, &rank)?, batch_slice(&y, &rank)?);
//!     (0..3).map(|_| {
//!         let loss = mse(&model.forward(&x)?, &y)?;
//!         model.backward(&loss)?;
//!         model.step(&mut adamw)?;
//!         model.global_loss(&loss)
//!     }).collect()
//! })?;
//! assert_eq!(losses[0], losses[1]); // the mean over the ranks, on every rank
//! # Ok::<(), chorus::Error>(())
//! ```

mod check;
mod init;

use std::sync::Arc;

use candle_core::{Device, Tensor};
use candle_nn::{Module, VarBuilder};
use chorus_collectives::{CommBackend, Communicator};
use chorus_devices::ComputeBackend;
use chorus_fsdp::{DataParallel, Fsdp, FsdpConfig, ShardedOptimizer};
use chorus_fsdp_candle::{FsdpModel, StageId};

pub use init::SeededVars;
use init::{Recorder, Source};

use crate::backend::SelectedBackend;
use crate::rank::Rank;
use crate::{Error, Result};

/// A layer of a [`ShardedModel`], to run it alone ([`ShardedModel::run`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Layer(StageId);

/// What a layer computes, applied to its group's unsharded parameters.
type LayerFn = dyn Fn(VarBuilder, &Tensor) -> candle_core::Result<Tensor> + Send + Sync;

struct LayerSpec {
    name: String,
    root: bool,
    forward: Arc<LayerFn>,
    params: Vec<(String, Tensor)>,
}

/// Builds a [`ShardedModel`] layer by layer: FSDP2's `fully_shard` on each
/// layer and on the root (see the [module documentation](self)).
pub struct ShardBuilder<C: CommBackend = SelectedBackend> {
    comm: Arc<Communicator<C>>,
    config: FsdpConfig,
    source: Source,
    broadcast: bool,
    layers: Vec<LayerSpec>,
}

impl<C: CommBackend + 'static> ShardBuilder<C>
where
    C::B: ComputeBackend,
{
    /// A model sharded over every rank of `rank`'s world, with `config`
    /// (FSDP2's defaults: reshard after forward, f32 parameters and
    /// reductions) and weights drawn from seed 0.
    pub fn new(rank: &Rank<C>, config: FsdpConfig) -> Self {
        ShardBuilder {
            comm: rank.comm().clone(),
            config,
            source: Source::Seed(0),
            broadcast: false,
            layers: Vec::new(),
        }
    }

    /// Draws the initial weights from `seed` with candle_nn's initialisers
    /// (the same values on every rank, and in [`SeededVars::new`]`(seed)`).
    /// Set before adding layers.
    pub fn seed(mut self, seed: u64) -> Self {
        self.source = Source::Seed(seed);
        self
    }

    /// Takes the initial weights from `vb` by their full names (loaded
    /// safetensors, a `VarMap`). Set before adding layers.
    pub fn weights(mut self, vb: VarBuilder<'static>) -> Self {
        self.source = Source::Given(vb);
        self
    }

    /// Replaces every rank's initial weights by rank 0's before sharding
    /// (FSDP1's `sync_module_states`): for weights each rank made itself.
    pub fn broadcast_from_rank0(mut self) -> Self {
        self.broadcast = true;
        self
    }

    /// Adds a layer as its own param group. `build` makes the layer from a
    /// `VarBuilder` under the layer's `name` (its parameters are named
    /// `{name}.{…}`); it runs once here to make the initial weights, and at
    /// every application on the group's unsharded parameters, so it only
    /// looks up parameters and must not depend on anything else that changes.
    pub fn layer<M, F>(&mut self, name: &str, build: F) -> Result<Layer>
    where
        M: Module,
        F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
    {
        self.push(name, false, build)
    }

    /// Adds a layer to the root group (see the [module documentation](self)).
    pub fn root_layer<M, F>(&mut self, name: &str, build: F) -> Result<Layer>
    where
        M: Module,
        F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
    {
        self.push(name, true, build)
    }

    fn push<M, F>(&mut self, name: &str, root: bool, build: F) -> Result<Layer>
    where
        M: Module,
        F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
    {
        if name.is_empty() || name.contains(char::is_whitespace) {
            return Err(Error::InvalidArgument(format!("layer name {name:?}: a non-empty name without spaces")));
        }
        if self.layers.iter().any(|l| l.name == name) {
            return Err(Error::InvalidArgument(format!("a layer named `{name}` was added already")));
        }
        let recorder = Recorder::new(self.source.clone());
        build(recorder.var_builder().pp(name))?;
        let params: Vec<(String, Tensor)> =
            recorder.made().into_iter().map(|(n, v)| (n, v.as_tensor().clone())).collect();
        if params.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "layer `{name}` made no parameters from its VarBuilder: apply a layer without weights inside \
                 another layer's function"
            )));
        }
        let owned = name.to_string();
        let forward: Arc<LayerFn> = Arc::new(move |vb: VarBuilder, x: &Tensor| build(vb.pp(&owned))?.forward(x));
        // Stages are numbered in the order added (see `build`).
        let layer = Layer(StageId(self.layers.len()));
        self.layers.push(LayerSpec { name: name.to_string(), root, forward, params });
        Ok(layer)
    }

    /// Checks (or first broadcasts) the initial weights across ranks, then
    /// shards them: the root group first, then one group per other layer,
    /// in the order added. A collective: every rank builds the same layers.
    pub fn build(mut self) -> Result<ShardedModel<C>> {
        if self.layers.is_empty() {
            return Err(Error::InvalidArgument("a model needs at least one layer".into()));
        }
        let fsdp = Fsdp::new(DataParallel::fsdp(self.comm.clone()), self.config.clone())?;
        // Before any collective, so that every rank fails alike where candle has no device here.
        let mut model = FsdpModel::new(fsdp)?;
        // A stream of its own for the weights' check, so the caller's is left alone.
        let rank = Rank::new(self.comm.clone())?;
        let mut all: Vec<(String, Tensor)> = self.layers.iter().flat_map(|l| l.params.clone()).collect();
        if self.broadcast {
            check::from_rank0(&rank, &mut all)?;
            let mut it = all.into_iter();
            for l in &mut self.layers {
                l.params = it.by_ref().take(l.params.len()).collect();
            }
            all = self.layers.iter().flat_map(|l| l.params.clone()).collect();
        }
        check::same_on_every_rank(&rank, &all)?;
        let root_params: Vec<_> = self.layers.iter().filter(|l| l.root).flat_map(|l| l.params.clone()).collect();
        let root = match root_params.is_empty() {
            true => None,
            false => Some(model.add_group("root", root_params, true)?),
        };
        let mut names = Vec::with_capacity(self.layers.len());
        for l in self.layers {
            let group = match (l.root, root) {
                (true, Some(g)) => g,
                _ => model.add_group(&l.name, l.params, false)?,
            };
            let forward = l.forward;
            model.add_stage(group, move |vb, x| forward(vb, x))?;
            names.push(l.name);
        }
        Ok(ShardedModel { model, names })
    }
}

/// A candle model sharded by FSDP; see the [module documentation](self).
pub struct ShardedModel<C: CommBackend = SelectedBackend> {
    model: FsdpModel<C>,
    names: Vec<String>,
}

impl<C: CommBackend + 'static> ShardedModel<C>
where
    C::B: ComputeBackend,
{
    /// Every layer in the order added, each on the previous one's output.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.clone();
        for stage in 0..self.names.len() {
            x = self.model.run(StageId(stage), &x)?;
        }
        Ok(x)
    }

    /// One layer on `x`, for models that are not a plain sequence. Every
    /// layer runs exactly once per step.
    pub fn run(&self, layer: Layer, x: &Tensor) -> Result<Tensor> {
        Ok(self.model.run(layer.0, x)?)
    }

    /// candle's backward from `loss`, through every layer's FSDP backward
    /// (the gradients reduce-scattered and averaged over the ranks).
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        Ok(self.model.backward(loss)?)
    }

    /// One optimizer step on this rank's shards, then the gradients dropped.
    pub fn step(&self, optimizer: &mut ShardedOptimizer<C>) -> Result<()> {
        Ok(self.model.optimizer_step(optimizer)?)
    }

    /// Clips the gradients' global norm to `max_norm` (between `backward`
    /// and `step`); returns the norm before clipping, waiting for it.
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<f64> {
        Ok(self.model.clip_grad_norm(max_norm)?)
    }

    /// [`ShardedModel::clip_grad_norm`] without waiting: the clipping is
    /// enqueued on the device and `step` can follow at once; the norm is read
    /// from the handle (`read`) when wanted, as PyTorch's `clip_grad_norm_`
    /// returns a tensor.
    pub fn clip_grad_norm_async(&self, max_norm: f64) -> Result<chorus_fsdp::PendingValue> {
        Ok(self.model.clip_grad_norm_async(max_norm)?)
    }

    /// The mean over every rank of this rank's `loss` (one value): the
    /// loss of the global batch when each rank's is its slice's mean. A
    /// collective; blocks until the value is on the host.
    pub fn global_loss(&self, loss: &Tensor) -> Result<f64> {
        Ok(self.global_loss_async(loss)?.read()?)
    }

    /// [`ShardedModel::global_loss`] without waiting: the mean is enqueued
    /// on the device behind the work already there, and read (`read`) when
    /// wanted. A loop that reads a step's loss once the next step is
    /// enqueued never waits for the device in between. A collective.
    pub fn global_loss_async(&self, loss: &Tensor) -> Result<chorus_fsdp::PendingValue> {
        if loss.elem_count() != 1 {
            return Err(Error::InvalidArgument(format!("global_loss: a loss of one value, not {:?}", loss.shape())));
        }
        Ok(self.model.mean_over_ranks_async(loss)?)
    }

    /// The candle device the layers compute on; inputs and targets belong there.
    pub fn device(&self) -> &Device {
        self.model.device()
    }

    /// The layers' names, in the order added.
    pub fn layer_names(&self) -> &[String] {
        &self.names
    }

    /// Every parameter's full values (f32, on the CPU), all-gathered from
    /// the shards. A collective.
    pub fn full_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self.model.full_parameters()?)
    }

    /// The adapter underneath (recompute choices, prefetch, checkpoints).
    pub fn fsdp_model(&self) -> &FsdpModel<C> {
        &self.model
    }
}

/// This rank's rows of a global `batch` (its first dimension split into
/// equal, consecutive slices in rank order), for data parallelism.
pub fn batch_slice<C: CommBackend>(batch: &Tensor, rank: &Rank<C>) -> Result<Tensor> {
    let rows = batch.dims().first().copied().unwrap_or(0);
    let n = rank.size();
    if rows % n != 0 {
        return Err(Error::InvalidArgument(format!(
            "a batch of {rows} rows does not split into {n} equal slices (one per rank)"
        )));
    }
    let per = rows / n;
    Ok(batch.narrow(0, rank.rank() * per, per)?)
}
