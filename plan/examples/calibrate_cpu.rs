//! Measures the rates `cpu_model.rs` freezes: candle's f32 matmul and
//! batched attention matmul, its element-wise throughput on large tensors
//! and its fixed cost per op, on this machine. Run it in release with the
//! thread count a rank gets (`chorus train` gives each sim rank
//! `cores / ranks` candle threads):
//!
//! `RAYON_NUM_THREADS=1 cargo run --release -p chorus-plan --example calibrate_cpu`
//!
//! Prints one JSON object per measurement and a summary line.

use std::time::Instant;

use candle_core::{Device, Tensor, Var};

/// Median seconds of `reps` runs of `f` after two warm-ups.
fn median_s(reps: usize, mut f: impl FnMut() -> candle_core::Result<()>) -> candle_core::Result<f64> {
    f()?;
    f()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into());
    let mut gemm_rates = Vec::new();
    // Tokens × in → out, the bench models' shapes and two larger ones.
    for (m, k, n) in [(256, 64, 64), (256, 64, 256), (256, 256, 64), (256, 64, 96), (512, 256, 256), (1024, 512, 512)] {
        let a = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
        let s = median_s(50, || a.matmul(&w.t()?).map(|_| ()))?;
        let rate = 2.0 * (m * k * n) as f64 / s;
        println!("{{\"kind\":\"gemm\",\"m\":{m},\"k\":{k},\"n\":{n},\"threads\":\"{threads}\",\"seconds\":{s:.3e},\"flops_per_s\":{rate:.3e}}}");
        if m * k * n >= 256 * 256 * 64 {
            gemm_rates.push(rate);
        }
    }
    // [b·h, s, hd] · [b·h, hd, s]: the bench transformer's scores.
    let mut attn_rates = Vec::new();
    for (bh, s, hd) in [(32, 32, 16), (32, 64, 16), (64, 128, 32)] {
        let q = Tensor::randn(0f32, 1.0, (bh, s, hd), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (bh, hd, s), &dev)?;
        let t = median_s(50, || q.matmul(&k).map(|_| ()))?;
        let rate = 2.0 * (bh * s * s * hd) as f64 / t;
        println!("{{\"kind\":\"attention\",\"bh\":{bh},\"s\":{s},\"hd\":{hd},\"threads\":\"{threads}\",\"seconds\":{t:.3e},\"flops_per_s\":{rate:.3e}}}");
        attn_rates.push(rate);
    }
    // Element-wise: x + y on 4 Mi floats reads 32 MiB and writes 16 MiB.
    let n = 1 << 22;
    let x = Tensor::randn(0f32, 1.0, n, &dev)?;
    let y = Tensor::randn(0f32, 1.0, n, &dev)?;
    let s = median_s(20, || (&x + &y).map(|_| ()))?;
    let bytes_per_s = (12 * n) as f64 / s;
    println!("{{\"kind\":\"elementwise\",\"elements\":{n},\"seconds\":{s:.3e},\"bytes_per_s\":{bytes_per_s:.3e}}}");
    // The fixed cost of an op: x + y on 64 floats.
    let xs = Tensor::randn(0f32, 1.0, 64, &dev)?;
    let ys = Tensor::randn(0f32, 1.0, 64, &dev)?;
    let overhead = median_s(1000, || (&xs + &ys).map(|_| ()))?;
    println!("{{\"kind\":\"op_overhead\",\"elements\":64,\"seconds\":{overhead:.3e}}}");
    // An op inside a training graph at the bench models' activation size
    // ([256, 64] f32): a chain of 100 tracked element-wise ops (scale, add
    // a tensor), forward then backward, per op. candle's backward of an op
    // runs several tensor ops (the gradient, the accumulation into the
    // sum of gradients), which is what a kernel of the cost model's trace
    // stands for.
    let v = Var::from_tensor(&Tensor::randn(0f32, 1.0, (256, 64), &dev)?)?;
    let c = Tensor::randn(0f32, 1.0, (256, 64), &dev)?;
    let ops = 100;
    let chain = || -> candle_core::Result<Tensor> {
        let mut y = v.as_tensor().clone();
        for i in 0..ops / 2 {
            y = ((y * (1.0 + 1e-4 * i as f64))? + &c)?;
        }
        y.sum_all()
    };
    let forward = median_s(20, || chain().map(|_| ()))?;
    let both = median_s(20, || chain()?.backward().map(|_| ()))?;
    let tracked = both / ops as f64;
    println!(
        "{{\"kind\":\"graph_op\",\"shape\":[256,64],\"ops\":{ops},\"forward_s\":{forward:.3e},\"forward_and_backward_s\":{both:.3e},\"per_op_s\":{tracked:.3e}}}"
    );
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    println!(
        "summary threads={threads}: gemm {:.2} GFLOP/s, attention {:.2} GFLOP/s, element-wise {:.2} GB/s, op {:.2} µs, \
         tracked op forward+backward {:.2} µs",
        median(gemm_rates) / 1e9,
        median(attn_rates) / 1e9,
        bytes_per_s / 1e9,
        overhead * 1e6,
        tracked * 1e6
    );
    Ok(())
}
