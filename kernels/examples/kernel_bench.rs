//! Times chorus's fused ops and cuBLAS's matrix products (through candle) on
//! candle's CUDA device at one Llama layer's shapes, in bf16: device time per
//! op kind from the ops' own event timing (`chorus_kernels::timing`), the
//! products by synchronised wall time, and the host's cost of issuing a
//! small candle op. Prints a table and one JSON line per measurement
//! (`{"bench": ..., "ms": ..., "tflops" | "gbps": ...}`): what `chorus plan
//! --kernels chorus` is calibrated from, and what `ci/kernels_torch_bench.py`
//! measures for PyTorch on the same shapes in the same GPU session.
//!
//! ```text
//! kernel_bench [--batch 4] [--seq 1024] [--hidden 2048] [--heads 32] [--kv-heads 8]
//!              [--intermediate 8192] [--vocab 32000] [--iters 20]
//! ```

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use chorus_kernels::timing::{self, OpKind};
use chorus_kernels::{attention, cross_entropy, rms_norm, rope, swiglu, RopeCache};

struct Shape {
    batch: usize,
    seq: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    intermediate: usize,
    vocab: usize,
    iters: usize,
}

fn parse() -> Result<Shape> {
    let mut s = Shape {
        batch: 4,
        seq: 1024,
        hidden: 2048,
        heads: 32,
        kv_heads: 8,
        intermediate: 8192,
        vocab: 32000,
        iters: 20,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let value = args.get(i + 1).with_context(|| format!("{} needs a value", args[i]))?;
        let v: usize = value.parse().with_context(|| format!("{}: {value} is not a count", args[i]))?;
        match args[i].as_str() {
            "--batch" => s.batch = v,
            "--seq" => s.seq = v,
            "--hidden" => s.hidden = v,
            "--heads" => s.heads = v,
            "--kv-heads" => s.kv_heads = v,
            "--intermediate" => s.intermediate = v,
            "--vocab" => s.vocab = v,
            "--iters" => s.iters = v,
            other => bail!("unknown flag {other}"),
        }
        i += 2;
    }
    if [s.batch, s.seq, s.hidden, s.heads, s.kv_heads, s.intermediate, s.vocab, s.iters].contains(&0)
        || s.hidden % s.heads != 0
        || s.heads % s.kv_heads != 0
    {
        bail!("sizes must be positive, heads must divide hidden and kv-heads heads")
    }
    Ok(s)
}

fn random(shape: &[usize], scale: f64, dev: &Device) -> Result<Tensor> {
    Ok((Tensor::randn(0f32, 1f32, shape, dev)? * scale)?.to_dtype(DType::BF16)?)
}

fn report(bench: &str, ms: f64, rate_name: &str, rate: f64) {
    println!("{bench:<40} {ms:>9.4} ms  {rate:>9.1} {rate_name}");
    println!("{}", serde_json::json!({"bench": bench, "ms": ms, rate_name.replace('/', "_per_").to_lowercase(): rate}));
}

/// Runs `f` (forward and backward of one op) `iters` times with the ops'
/// timing on; returns each kind's mean device time in ms.
fn op_times(iters: usize, dev: &Device, f: impl Fn() -> Result<()>) -> Result<Vec<(OpKind, f64)>> {
    f()?; // warm-up: module load, allocator
    dev.synchronize()?;
    timing::take()?;
    timing::set_enabled(true);
    for _ in 0..iters {
        f()?;
    }
    dev.synchronize()?;
    timing::set_enabled(false);
    let times = timing::take()?;
    Ok(times
        .into_iter()
        .filter(|(_, t)| t.calls > 0)
        .map(|(k, t)| (k, t.time.as_secs_f64() * 1e3 / iters as f64))
        .collect())
}

/// Mean wall time in ms of `f` (one product) over `iters` calls, synchronised.
fn wall(iters: usize, dev: &Device, f: impl Fn() -> candle_core::Result<Tensor>) -> Result<f64> {
    f()?;
    dev.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    dev.synchronize()?;
    Ok(t0.elapsed().as_secs_f64() * 1e3 / iters as f64)
}

fn main() -> Result<()> {
    let s = parse()?;
    let dev = Device::new_cuda(0).context("candle's CUDA device 0")?;
    let (m, h, hd) = (s.batch * s.seq, s.hidden, s.hidden / s.heads);
    println!(
        "# kernel_bench: batch {} seq {} hidden {} heads {}/{} head_dim {hd} intermediate {} vocab {}, bf16, {} iterations",
        s.batch, s.seq, h, s.heads, s.kv_heads, s.intermediate, s.vocab, s.iters
    );
    let bytes = |elems: usize| (elems * 2) as f64;
    let gbps = |b: f64, ms: f64| b / ms / 1e6;

    // RMSNorm over [tokens, hidden].
    let x = Var::from_tensor(&random(&[m, h], 1.0, &dev)?)?;
    let w = Var::from_tensor(&random(&[h], 1.0, &dev)?)?;
    for (k, ms) in op_times(s.iters, &dev, || {
        rms_norm(x.as_tensor(), w.as_tensor(), 1e-5)?.sum_all()?.backward()?;
        Ok(())
    })? {
        // Forward reads x and writes y; backward reads x, dy and writes dx (and reads x, dy again for dw).
        let moved = if k == OpKind::RmsNorm { bytes(2 * m * h) } else { bytes(5 * m * h) };
        report(k.name(), ms, "GB/s", gbps(moved, ms));
    }

    // RoPE on q [batch, seq, heads, head_dim].
    let q = Var::from_tensor(&random(&[s.batch, s.seq, s.heads, hd], 1.0, &dev)?)?;
    let cache = RopeCache::new(hd, 10000.0)?;
    let (cos, sin) = cache.tables(&dev, 0, s.seq)?;
    for (k, ms) in op_times(s.iters, &dev, || {
        rope(q.as_tensor(), &cos, &sin)?.sum_all()?.backward()?;
        Ok(())
    })? {
        report(k.name(), ms, "GB/s", gbps(bytes(2 * m * h), ms));
    }

    // SwiGLU over [tokens, intermediate].
    let g = Var::from_tensor(&random(&[m, s.intermediate], 2.0, &dev)?)?;
    let u = Var::from_tensor(&random(&[m, s.intermediate], 1.0, &dev)?)?;
    for (k, ms) in op_times(s.iters, &dev, || {
        swiglu(g.as_tensor(), u.as_tensor())?.sum_all()?.backward()?;
        Ok(())
    })? {
        let moved = if k == OpKind::Swiglu { 3 } else { 5 } * m * s.intermediate;
        report(k.name(), ms, "GB/s", gbps(bytes(moved), ms));
    }

    // Causal attention: forward 4·B·H·T²·D/2 FLOPs, backward 2.5 times that.
    let q = Var::from_tensor(&random(&[s.batch, s.seq, s.heads, hd], 1.0, &dev)?)?;
    let k = Var::from_tensor(&random(&[s.batch, s.seq, s.kv_heads, hd], 1.0, &dev)?)?;
    let v = Var::from_tensor(&random(&[s.batch, s.seq, s.kv_heads, hd], 1.0, &dev)?)?;
    let scale = 1.0 / (hd as f64).sqrt();
    let fwd_flops = 2.0 * (s.batch * s.heads * s.seq * s.seq * hd) as f64;
    for (kind, ms) in op_times(s.iters, &dev, || {
        attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), scale)?.sum_all()?.backward()?;
        Ok(())
    })? {
        let flops = if kind == OpKind::Attention { fwd_flops } else { 2.5 * fwd_flops };
        report(kind.name(), ms, "TFLOP/s", flops / ms / 1e9);
    }

    // Cross-entropy over [tokens, vocab].
    let logits = Var::from_tensor(&random(&[m, s.vocab], 3.0, &dev)?)?;
    let targets = Tensor::from_vec((0..m as u32).map(|i| i * 7919 % s.vocab as u32).collect::<Vec<_>>(), m, &dev)?;
    for (k, ms) in op_times(s.iters, &dev, || {
        cross_entropy(logits.as_tensor(), &targets)?.mean_all()?.backward()?;
        Ok(())
    })? {
        let moved = if k == OpKind::CrossEntropy { 1 } else { 2 } * m * s.vocab;
        report(k.name(), ms, "GB/s", gbps(bytes(moved), ms));
    }

    // cuBLAS through candle: the layer's products, forward (x·Wᵀ) and the two of backward.
    let kv = s.kv_heads * hd;
    for (name, n_out, k_in) in [
        ("q_proj", h, h),
        ("kv_proj", kv, h),
        ("o_proj", h, h),
        ("gate_up_proj", s.intermediate, h),
        ("down_proj", h, s.intermediate),
        ("lm_head", s.vocab, h),
    ] {
        let x = random(&[m, k_in], 1.0, &dev)?;
        let w = random(&[n_out, k_in], 0.02, &dev)?;
        let dy = random(&[m, n_out], 1.0, &dev)?;
        let flops = 2.0 * (m * n_out * k_in) as f64;
        let ms = wall(s.iters, &dev, || x.matmul(&w.t()?))?;
        report(&format!("matmul {name} x·wT"), ms, "TFLOP/s", flops / ms / 1e9);
        let ms = wall(s.iters, &dev, || dy.matmul(&w))?;
        report(&format!("matmul {name} dy·w"), ms, "TFLOP/s", flops / ms / 1e9);
        let ms = wall(s.iters, &dev, || dy.t()?.matmul(&x))?;
        report(&format!("matmul {name} dyT·x"), ms, "TFLOP/s", flops / ms / 1e9);
    }

    // The host's cost of issuing one small candle op (allocation and launch), device idle.
    let a = random(&[256], 1.0, &dev)?;
    dev.synchronize()?;
    let n = 2000;
    let t0 = Instant::now();
    let mut acc = a.clone();
    for _ in 0..n {
        acc = (&acc + &a)?;
    }
    let issue_us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
    dev.synchronize()?;
    println!("{:<40} {issue_us:>9.2} us", "host issue per candle op");
    println!("{}", serde_json::json!({"bench": "host_issue_per_candle_op", "us": issue_us}));
    Ok(())
}
