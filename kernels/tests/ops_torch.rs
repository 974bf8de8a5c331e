//! Every op of `chorus-kernels` on the CPU against PyTorch and transformers
//! themselves (`ci/kernels_torch.py`): `scaled_dot_product_attention` with
//! `enable_gqa` (`is_causal`, or an explicit mask where the keys outnumber
//! the queries), `rms_norm` and `LlamaRMSNorm`, `silu(g)·u`,
//! `cross_entropy(reduction="none")`, and `LlamaRotaryEmbedding` with
//! `apply_rotary_pos_emb`; outputs and every input's gradient (autograd on
//! both sides), and RoPE's tables.
//!
//! The bounds: f32 against f32, 1e-5. bf16 against PyTorch in f32 on the
//! same rounded inputs ("upcast"): [`common::tolerance`]'s 2 unit roundoffs
//! u (chorus's result is that reference rounded, with at most one more
//! rounding; measured ≤ 1.2 u). bf16 against PyTorch computing in bf16
//! ("native": what a PyTorch user runs): 6 u (2.3 %), chorus's 2 u plus
//! PyTorch's own bf16 error, which is larger: transformers' RoPE rounds its
//! tables and each product to bf16, `silu(g)·u` rounds twice, and SDPA's
//! backward rounds each query head's `dk`/`dv` before a group's heads are
//! summed (measured on 2026-11-27 with torch 2.15: up to 3.3 u at a
//! grouped-query ratio of 8, ≤ 2 u elsewhere).
//!
//! Needs the project's Python environment (`ci/python-env.sh`): the
//! interpreter comes from `CHORUS_PYTHON` (checked by `ci/torch_python.rs`);
//! a missing one fails the test, which runs only with `--ignored`.

use crate::common;
use crate::torch_python;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{DType, Device, Result, Tensor};
use chorus_kernels::{attention, cross_entropy, rms_norm, rope, swiglu, RopeCache};
use common::{assert_close, forward_backward, sci, tolerance, unit_roundoff, Inputs, Rng};
use serde_json::{json, Value};

const CPU: Device = Device::Cpu;

/// One op on one set of inputs, as chorus computed it.
struct Case {
    name: String,
    /// How PyTorch computes it: "native" (in the inputs' dtype) or "upcast" (f32).
    mode: &'static str,
    /// `name`, `op`, `mode` and the op's parameters, for the script.
    json: Value,
    /// The inputs by the script's names (targets as i64, which torch indexes with).
    inputs: Vec<(&'static str, Tensor)>,
    dy: Tensor,
    /// chorus's output and its gradients by input name (`dx`, ...).
    y: Tensor,
    grads: Vec<(String, Tensor)>,
    /// RoPE's tables, each `[t, d]` as transformers lays them out (`cat(c, c)`).
    tables: Option<(Tensor, Tensor)>,
}

impl Case {
    /// Runs `op` (on the float inputs, in order) forward and backward from `dy`.
    fn new(
        op: &str,
        mode: &'static str,
        params: Value,
        inputs: Vec<(&'static str, Tensor)>,
        dy: Tensor,
        run: impl Fn(&[Tensor]) -> Result<Tensor>,
    ) -> Case {
        let dtype = inputs[0].1.dtype();
        let tag: String =
            params.to_string().chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
        let name = format!("{op}-{mode}-{dtype:?}-{tag}");
        let float: Vec<&(&str, Tensor)> = inputs.iter().filter(|(_, t)| t.dtype().is_float()).collect();
        let args: Vec<&Tensor> = float.iter().map(|(_, t)| t).collect();
        let (y, grads) = forward_backward(&args, &dy, run).unwrap_or_else(|e| panic!("{name}: chorus: {e}"));
        let grads = float.iter().zip(grads).map(|((n, _), g)| (format!("d{n}"), g)).collect();
        let mut json = json!({ "name": name, "op": op, "mode": mode });
        if let (Value::Object(j), Value::Object(p)) = (&mut json, params) {
            j.extend(p);
        }
        Case { name, mode, json, inputs, dy, y, grads, tables: None }
    }

    /// The bound this case's results in `dtype` are held to (the module's
    /// docs; cross-entropy's loss is f32 from bf16 logits).
    fn tolerance(&self, dtype: DType) -> f32 {
        match (dtype, self.mode) {
            (DType::F32, _) => tolerance(DType::F32),
            (d, "upcast") => tolerance(d),
            (d, _) => 6.0 * unit_roundoff(d),
        }
    }
}

fn cases() -> Vec<Case> {
    let mut rng = Rng(7);
    let mut cases = Vec::new();
    // (dtype, mode): f32; bf16 against PyTorch in f32 and in bf16.
    let modes = [(DType::F32, "native"), (DType::BF16, "upcast"), (DType::BF16, "native")];
    for (dtype, mode) in modes {
        // rms_norm: torch.nn.functional's (f32) and transformers' LlamaRMSNorm
        // (whose bf16 rounding chorus follows; in f32 from bf16 inputs it does
        // not round, so the upcast case is functional's alone).
        for (shape, eps) in [(&[13usize, 300][..], 1e-6), (&[2, 5, 24], 1e-5)] {
            let d = *shape.last().unwrap();
            for imp in ["functional", "llama"] {
                if (imp == "functional" && mode == "native" && dtype != DType::F32)
                    || (imp == "llama" && mode == "upcast")
                {
                    continue;
                }
                let x = rng.tensor(shape, 2.0, dtype);
                let w = (rng.tensor(&[d], 0.5, DType::F32) + 1.0).unwrap().to_dtype(dtype).unwrap();
                let dy = rng.tensor(shape, 1.0, dtype);
                let params = json!({ "impl": imp, "eps": eps, "shape": shape });
                cases.push(Case::new("rms_norm", mode, params, vec![("x", x), ("w", w)], dy, |a| {
                    rms_norm(&a[0], &a[1], eps)
                }));
            }
        }
        // rope: transformers' tables and rotation; chorus's cache.
        for (b, t, h, d, start, theta) in [(2usize, 13usize, 3usize, 8usize, 0usize, 1e4), (1, 67, 4, 128, 1000, 5e5)] {
            let cache = RopeCache::new(d, theta).unwrap();
            let (cos, sin) = cache.tables(&CPU, start, t).unwrap();
            let x = rng.tensor(&[b, t, h, d], 2.0, dtype);
            let dy = rng.tensor(&[b, t, h, d], 1.0, dtype);
            let params = json!({ "theta": theta, "start": start, "shape": [b, t, h, d] });
            let mut case = Case::new("rope", mode, params, vec![("x", x)], dy, |a| rope(&a[0], &cos, &sin));
            let full = |c: &Tensor| Tensor::cat(&[c, c], 1).unwrap();
            case.tables = Some((full(&cos), full(&sin)));
            cases.push(case);
        }
        for shape in [&[3usize, 7, 37][..], &[1, 1031]] {
            let (g, u) = (rng.tensor(shape, 6.0, dtype), rng.tensor(shape, 2.0, dtype));
            let dy = rng.tensor(shape, 1.0, dtype);
            let params = json!({ "shape": shape });
            cases.push(Case::new("swiglu", mode, params, vec![("g", g), ("u", u)], dy, |a| swiglu(&a[0], &a[1])));
        }
        for (b, t, s, h, kvh, d) in [
            (2usize, 13usize, 13usize, 4usize, 4usize, 8usize),
            (1, 67, 100, 8, 2, 24),
            (2, 130, 130, 8, 1, 64),
            (1, 70, 135, 8, 1, 128),
            (2, 1, 37, 4, 1, 64),
        ] {
            let q = rng.tensor(&[b, t, h, d], 2.0, dtype);
            let (k, v) = (rng.tensor(&[b, s, kvh, d], 2.0, dtype), rng.tensor(&[b, s, kvh, d], 1.0, dtype));
            let dy = rng.tensor(&[b, t, h, d], 1.0, dtype);
            let scale = 1.0 / (d as f64).sqrt();
            let params = json!({ "scale": scale, "q": [b, t, h, d], "kv": [b, s, kvh, d] });
            let inputs = vec![("q", q), ("k", k), ("v", v)];
            cases.push(Case::new("attention", mode, params, inputs, dy, |a| attention(&a[0], &a[1], &a[2], scale)));
        }
        // PyTorch's bf16 cross-entropy returns a bf16 loss; chorus's is f32
        // from the bf16 logits: the upcast case is the one to compare.
        if mode == "upcast" || dtype == DType::F32 {
            for (rows, vocab) in [(37usize, 1031usize), (5, 32_000)] {
                let logits = rng.tensor(&[rows, vocab], 8.0, dtype);
                let ids = rng.ids(rows, vocab);
                let targets = Tensor::from_vec(ids.clone(), rows, &CPU).unwrap();
                let wide_ids = Tensor::from_vec(ids.iter().map(|&i| i as i64).collect(), rows, &CPU).unwrap();
                let dy = rng.tensor(&[rows], 1.0, DType::F32);
                let params = json!({ "shape": [rows, vocab] });
                let inputs = vec![("logits", logits), ("targets", wide_ids)];
                cases.push(Case::new("cross_entropy", mode, params, inputs, dy, |a| cross_entropy(&a[0], &targets)));
            }
        }
    }
    cases
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ci/kernels_torch.py")
}

/// PyTorch's results of `cases`, by `"<case>.<what>"`.
fn torch_results(cases: &[Case]) -> HashMap<String, Tensor> {
    let python = torch_python::torch_python("torch, transformers, safetensors");
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("kernels-torch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut inputs = HashMap::new();
    for c in cases {
        for (n, t) in &c.inputs {
            inputs.insert(format!("{}.{n}", c.name), t.clone());
        }
        inputs.insert(format!("{}.dy", c.name), c.dy.clone());
    }
    candle_core::safetensors::save(&inputs, dir.join("inputs.safetensors")).unwrap();
    let list: Vec<&Value> = cases.iter().map(|c| &c.json).collect();
    std::fs::write(dir.join("cases.json"), serde_json::to_string_pretty(&list).unwrap()).unwrap();
    // `timeout` bounds the run: a wedged interpreter fails the test instead of hanging it.
    let out = Command::new("timeout")
        .args(["600", &python])
        .arg(script())
        .arg(&dir)
        .output()
        .unwrap_or_else(|e| panic!("running timeout {python}: {e}"));
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    assert!(
        out.status.success(),
        "kernels_torch.py failed ({}):\n{}\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    eprint!("{}", text(&out.stdout));
    let results = candle_core::safetensors::load(dir.join("torch.safetensors"), &CPU).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    results
}

#[test]
#[ignore = "needs PyTorch and transformers (ci/python-env.sh)"]
fn ops_equal_pytorch() {
    let cases = cases();
    let torch = torch_results(&cases);
    let theirs = |c: &Case, what: &str| {
        torch.get(&format!("{}.{what}", c.name)).unwrap_or_else(|| panic!("{}: PyTorch wrote no {what}", c.name))
    };
    for c in &cases {
        let tol = |t: &Tensor| c.tolerance(t.dtype());
        let mut errs = vec![assert_close(&format!("{} y", c.name), &c.y, theirs(c, "y"), tol(&c.y))];
        for (what, g) in &c.grads {
            errs.push(assert_close(&format!("{} {what}", c.name), g, theirs(c, what), tol(g)));
        }
        // The tables are f32 on both sides where transformers makes them in f32.
        if let (Some((cos, sin)), true) = (&c.tables, c.mode == "upcast" || c.y.dtype() == DType::F32) {
            errs.push(assert_close(&format!("{} cos", c.name), cos, theirs(c, "cos"), tolerance(DType::F32)));
            errs.push(assert_close(&format!("{} sin", c.name), sin, theirs(c, "sin"), tolerance(DType::F32)));
        }
        eprintln!("{}: errors {} (bound {:.1e})", c.name, sci(&errs), c.tolerance(c.inputs[0].1.dtype()));
    }
}
