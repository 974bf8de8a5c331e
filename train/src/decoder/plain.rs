//! The plain candle reference: the same training as single-process candle
//! on the global batch, with candle-nn's own optimizers — an implementation
//! independent of chorus's FSDP, which the sharded runs are checked against.

use std::time::Instant;

use candle_core::{Device, Var};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use chorus_fsdp::OptimizerKind;
use chorus_fsdp_candle::{Error, Result};

use super::spec::{PlainReport, TrainSpec, Validation};
use super::{loss, u32_tensor};
use crate::models::{DecoderModel, PlainDecoder};

/// The same training as plain single-process candle on the global batch of
/// `ranks × batch` sequences, with candle-nn's own optimizers (`SGD` without
/// momentum, `AdamW`). With `spec.max_grad_norm`, the gradients are clipped
/// as `torch.nn.utils.clip_grad_norm_` does (scaled by `max / (norm + 1e-6)`
/// when that is below one). The FSDP settings, micro-batches and prefetch do
/// not apply: they must not change the result.
pub fn train_plain<M: DecoderModel>(spec: &TrainSpec<M>, ranks: usize) -> Result<PlainReport> {
    train_plain_on(spec, ranks, &Device::Cpu)
}

/// [`train_plain`] with the model on `device` (candle's CUDA device for the
/// comparison on a GPU).
pub fn train_plain_on<M: DecoderModel>(spec: &TrainSpec<M>, ranks: usize, device: &Device) -> Result<PlainReport> {
    let varmap = VarMap::new();
    let init = spec.model.init_tensors()?;
    {
        let mut data = varmap.data().lock().map_err(|_| Error::InvalidArgument("VarMap lock poisoned".into()))?;
        for (name, t) in &init {
            data.insert(name.clone(), Var::from_tensor(&t.to_device(device)?)?);
        }
    }
    let vb = VarBuilder::from_varmap(&varmap, candle_core::DType::F32, device);
    let model = spec.model.plain(vb)?;
    let mut opt = PlainOptimizer::new(spec.optimizer, varmap.all_vars())?;
    let base_lr = spec.optimizer.lr();
    spec.schedule.validate(spec.steps, base_lr).map_err(Error::InvalidArgument)?;
    let rows = ranks * spec.batch;
    let seq = spec.data.seq_len();
    let (mut losses, mut lrs, mut times, mut val_losses) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for step in 0..spec.steps {
        let t0 = Instant::now();
        let lr = spec.schedule.lr(step, spec.steps, base_lr);
        opt.set_learning_rate(lr);
        lrs.push(lr);
        let (x, y) = spec.data.rows(step, 0, rows);
        let (x, y) = (u32_tensor(x, rows, seq)?.to_device(device)?, u32_tensor(y, rows, seq)?.to_device(device)?);
        let l = loss(&model.forward(&x)?, &y)?;
        losses.push(l.to_scalar::<f32>()? as f64);
        let mut grads = l.backward()?;
        if let Some(max) = spec.max_grad_norm {
            clip_grad_norm(&mut grads, &varmap.all_vars(), max)?;
        }
        opt.step(&grads)?;
        times.push(t0.elapsed().as_secs_f64());
        if let Some(v) = spec.validation.as_ref().filter(|v| v.due(step + 1, spec.steps)) {
            val_losses.push((step + 1, validate(&*model, v, rows, device)?));
        }
    }
    let data = varmap.data().lock().map_err(|_| Error::InvalidArgument("VarMap lock poisoned".into()))?;
    let params = init
        .iter()
        .map(|(name, _)| {
            let v = data.get(name).ok_or_else(|| Error::InvalidArgument(format!("no variable {name}")))?;
            Ok((name.clone(), v.as_tensor().flatten_all()?.to_vec1::<f32>()?))
        })
        .collect::<Result<_>>()?;
    Ok(PlainReport { losses, lrs, val_losses, step_times_s: times, params })
}

/// The mean over `v`'s global batches (of `rows` sequences each, whole) of
/// the model's loss, without a graph.
fn validate(model: &dyn PlainDecoder, v: &Validation, rows: usize, device: &Device) -> Result<f64> {
    let seq = v.data.seq_len();
    let mut total = 0.0f64;
    for b in 0..v.batches {
        let (x, y) = v.data.rows(b as u64, 0, rows);
        let (x, y) = (u32_tensor(x, rows, seq)?.to_device(device)?, u32_tensor(y, rows, seq)?.to_device(device)?);
        total += loss(&model.forward(&x)?.detach(), &y)?.to_scalar::<f32>()? as f64;
    }
    Ok(total / v.batches.max(1) as f64)
}

/// candle-nn's own optimizer matching `kind` (the plain reference's):
/// `SGD` without momentum or weight decay, `AdamW`.
enum PlainOptimizer {
    Sgd(candle_nn::SGD),
    AdamW(candle_nn::AdamW),
}

impl PlainOptimizer {
    fn new(kind: OptimizerKind, vars: Vec<Var>) -> Result<PlainOptimizer> {
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

    fn set_learning_rate(&mut self, lr: f64) {
        match self {
            PlainOptimizer::Sgd(o) => o.set_learning_rate(lr),
            PlainOptimizer::AdamW(o) => o.set_learning_rate(lr),
        }
    }

    fn step(&mut self, grads: &candle_core::backprop::GradStore) -> Result<()> {
        match self {
            PlainOptimizer::Sgd(o) => o.step(grads)?,
            PlainOptimizer::AdamW(o) => o.step(grads)?,
        }
        Ok(())
    }
}

/// Scales the gradients of `vars` in `grads` as `clip_grad_norm_` does: the
/// global L2 norm (summed in f64), then `max / (norm + 1e-6)` if below one.
fn clip_grad_norm(grads: &mut candle_core::backprop::GradStore, vars: &[Var], max: f64) -> Result<()> {
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
