//! The ops on candle's CUDA device against the same ops on candle's CPU
//! (their references), forward and backward through candle's autograd, on
//! awkward shapes: the tensor-core attention (bf16, f16; head_dim 64, 128;
//! grouped-query ratios 1, 4, 8; sequences not a multiple of the tile; an
//! offset), its fallback (f32, odd head_dim), and the other ops in f32, bf16
//! and f16. Inputs are random and fresh per case; the GPU's outputs are
//! compared by `max |gpu − cpu| / max |cpu|`.
//!
//! They need an NVIDIA GPU and run on one through `ci/gpu-check.sh kernels`
//! (`--include-ignored`); a plain `cargo test` lists them as ignored.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor, Var};
use chorus_kernels::{attention, cross_entropy, rms_norm, rope, swiglu, RopeCache};

fn gpu() -> Device {
    Device::new_cuda(0).expect("candle's CUDA device 0")
}

struct Rng(u64);

impl Rng {
    fn tensor(&mut self, shape: &[usize], scale: f32, dtype: DType) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
    }
}

/// `max |a − b| / max |b|` in f32, failing on a non-finite value of `a`.
fn rel(what: &str, a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let b = b.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let (a, b) = (a.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
    assert_eq!(a.len(), b.len(), "{what}");
    assert!(a.iter().all(|x| x.is_finite()), "{what}: a non-finite value on the GPU");
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(f32::MIN_POSITIVE);
    a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Runs `f` on `inputs` on the CPU and on the GPU, each input a variable,
/// and compares the output and every input's gradient of `sum(out · g)`
/// (g random) within `tol`.
fn compare(what: &str, inputs: &[Tensor], tol: f32, f: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>) {
    let mut rng = Rng(99);
    let run = |dev: &Device, g: &Tensor| {
        let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(&t.to_device(dev).unwrap()).unwrap()).collect();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let out = f(&ts).unwrap();
        let g = g.to_device(dev).unwrap();
        let grads = (out.to_dtype(DType::F32).unwrap() * g.to_dtype(DType::F32).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let gs: Vec<Tensor> = vars.iter().map(|v| grads.get(v.as_tensor()).expect("a gradient").clone()).collect();
        (out, gs)
    };
    let probe = f(inputs).unwrap();
    let g = rng.tensor(probe.dims(), 1.0, DType::F32);
    let (cpu_out, cpu_grads) = run(&Device::Cpu, &g);
    let (gpu_out, gpu_grads) = run(&gpu(), &g);
    let e = rel(what, &gpu_out, &cpu_out);
    println!("{what}: output {e:.2e}");
    assert!(e <= tol, "{what}: output differs by {e:.2e}");
    for (i, (a, b)) in gpu_grads.iter().zip(&cpu_grads).enumerate() {
        let e = rel(what, a, b);
        println!("{what}: gradient {i} {e:.2e}");
        assert!(e <= 2.0 * tol, "{what}: gradient of input {i} differs by {e:.2e}");
    }
}

fn tol(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 5e-3,
        _ => 2e-2,
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (ci/gpu-check.sh kernels)"]
fn rms_norm_rope_swiglu_cross_entropy_on_the_gpu_equal_the_cpu() {
    let mut rng = Rng(1);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let (x, w) = (rng.tensor(&[3, 77, 2048], 2.0, dtype), rng.tensor(&[2048], 1.0, dtype));
        compare(&format!("rms_norm {dtype:?}"), &[x, w], tol(dtype), |t| rms_norm(&t[0], &t[1], 1e-5));
        let (g, u) = (rng.tensor(&[5, 1001], 4.0, dtype), rng.tensor(&[5, 1001], 1.0, dtype));
        compare(&format!("swiglu {dtype:?}"), &[g, u], tol(dtype), |t| swiglu(&t[0], &t[1]));
        let x = rng.tensor(&[2, 77, 6, 64], 1.0, dtype);
        let cache = RopeCache::new(64, 10000.0).unwrap();
        compare(&format!("rope {dtype:?}"), &[x], tol(dtype), |t| {
            let (cos, sin) = cache.tables(t[0].device(), 3, 77)?;
            rope(&t[0], &cos, &sin)
        });
        let logits = rng.tensor(&[37, 32000], 6.0, dtype);
        let targets =
            Tensor::from_vec((0..37u32).map(|i| i * 7919 % 32000).collect::<Vec<_>>(), 37, &Device::Cpu).unwrap();
        compare(&format!("cross_entropy {dtype:?}"), &[logits], tol(dtype), |t| {
            cross_entropy(&t[0], &targets.to_device(t[0].device())?)
        });
    }
}

/// `(batch, queries, keys, heads, kv_heads, head_dim)`.
type AttentionDims = (usize, usize, usize, usize, usize, usize);

/// The attention cases: seed, dtype, dims and tolerance. bf16 and f16 with
/// head_dim 64 or 128 take the tensor-core kernel, the others its fallback.
const ATTENTION_CASES: [(u64, DType, AttentionDims, f32); 9] = [
    // Tensor cores: GQA ratios 1, 4, 8; 300 queries (not a multiple of 64); head_dim 64 and 128; an offset.
    (1, DType::BF16, (2, 300, 300, 8, 8, 64), 3e-2),
    (2, DType::BF16, (1, 300, 300, 8, 2, 64), 3e-2),
    (3, DType::BF16, (1, 257, 257, 8, 1, 128), 3e-2),
    (4, DType::F16, (1, 200, 200, 4, 1, 64), 1e-2),
    (5, DType::BF16, (2, 100, 230, 4, 2, 64), 3e-2),
    // The 1.1B Llama's head layout at its sequence length (4 query heads of its 32).
    (6, DType::BF16, (1, 1024, 1024, 4, 1, 64), 3e-2),
    // The fallback: f32, and a head_dim the tensor-core kernel does not take.
    (7, DType::F32, (2, 130, 130, 4, 2, 64), 1e-4),
    (8, DType::F32, (1, 40, 60, 3, 1, 24), 1e-4),
    (9, DType::BF16, (1, 70, 70, 4, 4, 40), 2e-2),
];

#[test]
#[ignore = "needs an NVIDIA GPU (ci/gpu-check.sh kernels)"]
fn attention_on_the_gpu_equals_the_cpu() {
    for (seed, dtype, (b, t, s, h, kvh, d), tol) in ATTENTION_CASES {
        let mut rng = Rng(seed);
        let q = rng.tensor(&[b, t, h, d], 1.5, dtype);
        let k = rng.tensor(&[b, s, kvh, d], 1.5, dtype);
        let v = rng.tensor(&[b, s, kvh, d], 1.0, dtype);
        let what = format!("attention {dtype:?} b{b} t{t} s{s} h{h} kvh{kvh} d{d}");
        compare(&what, &[q, k, v], tol, |x| attention(&x[0], &x[1], &x[2], 1.0 / (d as f64).sqrt()));
    }
}
