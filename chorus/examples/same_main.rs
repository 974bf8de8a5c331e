//! One `main` for every backend: the backend is a cargo feature, the world
//! comes from the launcher (or threads of this process without one).
//!
//! ```sh
//! cargo run -p chorus --features candle --example same_main                 # 2 simulated ranks
//! cargo build -p chorus --features ucx,candle --example same_main           # CPU processes:
//! chorus launch --nproc-per-node 2 -- target/debug/examples/same_main
//! # NVIDIA GPUs: --features candle-cuda (docs/library.md, "The GPU in your crate"), then
//! torchrun --nproc-per-node 8 --no-python target/release/examples/same_main
//! ```
use chorus::candle_core::{DType, Tensor};
use chorus::candle_nn::{linear, loss::mse, seq, Activation};
use chorus::prelude::*;

fn main() -> chorus::Result<()> {
    let losses = chorus::run(2, |rank| -> chorus::Result<Vec<f64>> {
        let mut model = ShardBuilder::new(&rank, FsdpConfig::default()).seed(1);
        model.layer("hidden", |vb| Ok(seq().add(linear(8, 64, vb)?).add(Activation::Gelu)))?;
        model.layer("out", |vb| linear(64, 8, vb))?;
        let model = model.build()?; // on a GPU without candle-cuda: an error naming the feature
        let mut adamw = ShardedOptimizer::new(OptimizerKind::adamw(3e-3, 0.0));
        // Each rank its own slice of a global batch of 64 rows.
        let x = Tensor::arange(0f32, 512., model.device())?.reshape((64, 8))?.affine(1. / 512., 0.)?;
        let x = batch_slice(&x, &rank)?;
        let y = x.cos()?;
        (0..10)
            .map(|_| {
                let loss = mse(&model.forward(&x)?, &y.to_dtype(DType::F32)?)?;
                model.backward(&loss)?;
                model.step(&mut adamw)?;
                model.global_loss(&loss)
            })
            .collect()
    })?;
    let losses = &losses[0];
    println!(
        "{}: loss {:.5} → {:.5} in {} steps",
        chorus::SELECTED_BACKEND,
        losses[0],
        losses[losses.len() - 1],
        losses.len()
    );
    if losses[losses.len() - 1] >= losses[0] {
        return Err(chorus::Error::InvalidArgument("the loss did not go down".into()));
    }
    Ok(())
}
