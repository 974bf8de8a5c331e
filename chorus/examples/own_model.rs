//! Your own candle model under FSDP on 2 ranks, 20 AdamW steps, checked
//! against the same model trained by plain candle in one process.
//!
//! ```sh
//! cargo run -p chorus --features candle --example own_model
//! ```
use chorus::candle_core::{DType, Device, Tensor};
use chorus::candle_nn::{
    linear, loss::mse, seq, Activation, AdamW, Module, Optimizer, ParamsAdamW, Sequential, VarBuilder,
};
use chorus::prelude::*;

/// The model's layers, written once in plain candle: 4 → 32 → 32 → 1 with ReLUs.
const LAYERS: [&str; 3] = ["l0", "l1", "head"];
fn layer(i: usize, vb: VarBuilder) -> candle_core::Result<Sequential> {
    let (inputs, outputs) = [(4, 32), (32, 32), (32, 1)][i];
    let l = seq().add(linear(inputs, outputs, vb)?);
    Ok(if i < 2 { l.add(Activation::Relu) } else { l })
}

fn main() -> anyhow::Result<()> {
    let (steps, lr, seed) = (20, 1e-2, 7);
    let x = Tensor::arange(0f32, 64., &Device::Cpu)?.reshape((16, 4))?.affine(1. / 64., -0.5)?;
    let y = x.sum_keepdim(1)?.sin()?;

    // FSDP on 2 ranks: each layer its own param group, each rank its slice of the batch.
    let (xs, ys) = (x.clone(), y.clone());
    let sharded = chorus::run(2, move |rank| -> chorus::Result<Vec<f64>> {
        let mut model = ShardBuilder::new(&rank, FsdpConfig::default()).seed(seed);
        for (i, name) in LAYERS.into_iter().enumerate() {
            model.layer(name, move |vb| layer(i, vb))?;
        }
        let model = model.build()?;
        let mut adamw = ShardedOptimizer::new(OptimizerKind::adamw(lr, 0.01));
        let (x, y) = (batch_slice(&xs, &rank)?, batch_slice(&ys, &rank)?);
        (0..steps)
            .map(|_| {
                let loss = mse(&model.forward(&x)?, &y)?;
                model.backward(&loss)?;
                model.step(&mut adamw)?;
                model.global_loss(&loss)
            })
            .collect()
    })?;

    // The same model and data in one process, plain candle.
    let (vars, device) = (SeededVars::new(seed), Device::Cpu);
    let vb = vars.var_builder(DType::F32, &device);
    let model: Vec<_> = LAYERS.into_iter().enumerate().map(|(i, n)| layer(i, vb.pp(n))).collect::<Result<_, _>>()?;
    let mut adamw = AdamW::new(vars.all_vars(), ParamsAdamW { lr, weight_decay: 0.01, ..Default::default() })?;
    for (step, fsdp_loss) in sharded[0].iter().enumerate() {
        let loss = mse(&model.iter().try_fold(x.clone(), |h, l| l.forward(&h))?, &y)?;
        adamw.backward_step(&loss)?;
        let one = loss.to_scalar::<f32>()? as f64;
        println!("step {step:2}: FSDP on 2 ranks {fsdp_loss:.7}, one-process candle {one:.7}");
        anyhow::ensure!((fsdp_loss - one).abs() <= 1e-5 * one.abs().max(1.0), "step {step}: {fsdp_loss} vs {one}");
    }
    Ok(())
}
