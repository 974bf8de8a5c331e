//! What the candle models' training loops ([`gpt_train`](crate::gpt_train),
//! [`llama_train`](crate::llama_train)) share and that does not depend on
//! the model: the data-parallel layout, the batch checks, the global loss,
//! the checkpoint options and configuration check of a resume, the
//! counters a report gives as differences, and the plain candle
//! reference's optimizer and clipping.

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{Device, Tensor, Var};
use candle_nn::Optimizer;
use chorus_collectives::{CommBackend, Communicator, Mesh};
use chorus_devices::ComputeBackend;
use chorus_fsdp::{CommCounts, DataParallel, Fsdp, HostOverhead, OptimizerKind};
use chorus_fsdp_candle::checkpoint::{self, SaveOptions};
use chorus_fsdp_candle::{AdapterTimes, Error, FsdpModel, Result, StageId};
use serde::Serialize;

/// How the model `config` differs from the one a checkpoint recorded
/// (`saved`, its training state's `model`): each differing field as
/// `"heads 4 -> 2"`; empty when they agree or none was recorded.
pub fn config_changes<T: Serialize>(saved: &serde_json::Value, config: &T) -> Vec<String> {
    let now = serde_json::to_value(config).unwrap_or_default();
    let (Some(saved), Some(now)) = (saved.as_object(), now.as_object()) else { return Vec::new() };
    now.iter()
        .filter(|(k, v)| saved.get(*k) != Some(v))
        .map(|(k, v)| format!("{k} {} -> {v}", saved.get(k).map_or_else(|| "unset".into(), |s| s.to_string())))
        .collect()
}

/// Token ids as a `rows × seq` tensor.
pub(crate) fn u32_tensor(v: Vec<u32>, rows: usize, seq: usize) -> Result<Tensor> {
    Ok(Tensor::from_vec(v, (rows, seq), &Device::Cpu)?)
}

/// The micro-batch count (at least one) that divides `batch` sequences per rank.
pub(crate) fn micro_batches(batch: usize, micro_batches: usize) -> Result<usize> {
    let micro = micro_batches.max(1);
    if batch == 0 || batch % micro != 0 {
        return Err(Error::InvalidArgument(format!(
            "batch {batch} must be a positive multiple of {micro} micro-batches"
        )));
    }
    Ok(micro)
}

/// FSDP over `world`, or HSDP with a replicate dimension of `replicate`.
pub(crate) fn data_parallel<C: CommBackend>(
    world: &Arc<Communicator<C>>,
    replicate: Option<usize>,
) -> Result<DataParallel<C>>
where
    C::B: ComputeBackend,
{
    let n = world.size();
    Ok(match replicate {
        Some(r) if r > 1 => {
            if n % r != 0 {
                return Err(Error::InvalidArgument(format!("--hsdp {r} does not divide {n} ranks")));
            }
            DataParallel::hsdp(
                &Mesh::new(world, &[("replicate", r), ("shard", n / r)]).map_err(chorus_fsdp::FsdpError::from)?,
            )?
        }
        _ => DataParallel::fsdp(world.clone()),
    })
}

/// The mean over every rank of this rank's `local` loss (a collective; blocks).
pub(crate) fn global_mean<C: CommBackend + 'static>(model: &FsdpModel<C>, local: f64) -> Result<f64>
where
    C::B: ComputeBackend,
    Fsdp<C>: Send,
{
    model.with_fsdp(|f| -> Result<f64> {
        let s = f.compute_stream();
        let buf = chorus_devices::StreamExt::buffer_from(s, &[local as f32]).map_err(chorus_fsdp::FsdpError::from)?;
        Ok(f.mean_over_ranks(chorus_devices::Buffer::view(&buf))?)
    })?
}

/// Each group's pre-forward also all-gathers the next one (`groups` in
/// forward order), as FSDP2's explicit forward prefetch.
pub(crate) fn chain_forward_prefetch<C: CommBackend + 'static>(model: &FsdpModel<C>, groups: &[usize]) -> Result<()>
where
    C::B: ComputeBackend,
    Fsdp<C>: Send,
{
    model.with_fsdp(|f| -> chorus_fsdp::Result<()> {
        for w in groups.windows(2) {
            f.set_forward_prefetch(w[0], vec![w[1]])?;
        }
        Ok(())
    })??;
    Ok(())
}

/// Logits of `ids` (`[batch, seq]`, u32) through a decoder stack's stages
/// (embedding, each layer, head), carrying candle's graph through every
/// stage: in the param dtype, or cast (differentiably) to the
/// mixed-precision policy's output dtype when it names one, as FSDP2's root
/// casts the model's outputs.
pub(crate) fn forward_stages<C: CommBackend + 'static>(
    model: &FsdpModel<C>,
    embed: StageId,
    layers: &[StageId],
    head: StageId,
    ids: &Tensor,
) -> Result<Tensor>
where
    C::B: ComputeBackend,
    Fsdp<C>: Send,
{
    let mut x = model.run(embed, ids)?;
    for l in layers {
        x = model.run(*l, &x)?;
    }
    let logits = model.run(head, &x)?;
    match model.with_fsdp(|f| f.mixed_precision().output_dtype)? {
        Some(d) => Ok(logits.to_dtype(chorus_fsdp_candle::convert::candle_dtype(d)?)?),
        None => Ok(logits),
    }
}

/// How a run's saves prune: `keep_last`, never the checkpoint resumed from.
pub(crate) fn save_options(keep_last: Option<usize>, resume: Option<&PathBuf>) -> SaveOptions {
    SaveOptions { keep_last, keep: resume.iter().filter_map(|d| checkpoint::resolve(d).ok()).collect() }
}

/// FSDP's and the adapter's running counters at one moment; a report gives
/// the difference between two ([`Counters::since`]).
pub(crate) struct Counters {
    pub(crate) overhead: HostOverhead,
    pub(crate) comm: CommCounts,
    pub(crate) adapter: AdapterTimes,
}

impl Counters {
    /// The counters of `model` now.
    pub(crate) fn of<C: CommBackend + 'static>(model: &FsdpModel<C>) -> Result<Counters>
    where
        C::B: ComputeBackend,
        Fsdp<C>: Send,
    {
        Ok(Counters {
            overhead: model.with_fsdp(|f| f.host_overhead())?,
            comm: model.with_fsdp(|f| f.comm_counts())?,
            adapter: model.times()?,
        })
    }

    /// What was counted from `earlier` to `self`.
    pub(crate) fn since(&self, earlier: &Counters) -> Counters {
        Counters {
            overhead: self.overhead.since(&earlier.overhead),
            comm: CommCounts {
                all_gathers: self.comm.all_gathers - earlier.comm.all_gathers,
                reduce_scatters: self.comm.reduce_scatters - earlier.comm.reduce_scatters,
                all_reduces: self.comm.all_reduces - earlier.comm.all_reduces,
            },
            adapter: AdapterTimes {
                transfer: self.adapter.transfer - earlier.adapter.transfer,
                compute: self.adapter.compute - earlier.adapter.compute,
                stage_calls: self.adapter.stage_calls - earlier.adapter.stage_calls,
                recomputed: self.adapter.recomputed - earlier.adapter.recomputed,
            },
        }
    }
}

/// candle-nn's own optimizer matching `kind` (the plain reference's):
/// `SGD` without momentum or weight decay, `AdamW`.
pub(crate) enum PlainOptimizer {
    Sgd(candle_nn::SGD),
    AdamW(candle_nn::AdamW),
}

impl PlainOptimizer {
    pub(crate) fn new(kind: OptimizerKind, vars: Vec<Var>) -> Result<PlainOptimizer> {
        Ok(match kind {
            OptimizerKind::Sgd { lr, momentum, weight_decay, .. } if momentum == 0.0 && weight_decay == 0.0 => {
                PlainOptimizer::Sgd(candle_nn::SGD::new(vars, lr)?)
            }
            OptimizerKind::AdamW { lr, beta1, beta2, eps, weight_decay } => PlainOptimizer::AdamW(
                candle_nn::AdamW::new(vars, candle_nn::ParamsAdamW { lr, beta1, beta2, eps, weight_decay })?,
            ),
            k => return Err(Error::InvalidArgument(format!("candle-nn has no optimizer matching {k:?}"))),
        })
    }

    pub(crate) fn step(&mut self, grads: &candle_core::backprop::GradStore) -> Result<()> {
        match self {
            PlainOptimizer::Sgd(o) => o.step(grads)?,
            PlainOptimizer::AdamW(o) => o.step(grads)?,
        }
        Ok(())
    }
}

/// Scales the gradients of `vars` in `grads` as `clip_grad_norm_` does: the
/// global L2 norm (summed in f64), then `max / (norm + 1e-6)` if below one.
pub(crate) fn clip_grad_norm(grads: &mut candle_core::backprop::GradStore, vars: &[Var], max: f64) -> Result<()> {
    let mut total = 0.0f64;
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            total += g.flatten_all()?.to_vec1::<f32>()?.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>();
        }
    }
    let coef = max / (total.sqrt() + 1e-6);
    if coef < 1.0 {
        for v in vars {
            if let Some(g) = grads.get(v.as_tensor()) {
                let scaled = (g * coef)?;
                grads.insert(v.as_tensor(), scaled);
            }
        }
    }
    Ok(())
}
