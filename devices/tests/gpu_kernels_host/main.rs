//! The shared GPU kernel source (`chorus_devices::gpu_kernels::SOURCE`, what
//! NVRTC and hipRTC compile) compiled by the host's C++ compiler and run on
//! the CPU, so its arithmetic is checked where there is no GPU:
//!
//! - the f16/bf16 conversions against the `half` crate: all 65536 patterns of
//!   each widened, and f32 → f16/bf16 on every tie of either format, its
//!   neighbours, NaNs, infinities, subnormals and a million random patterns;
//! - every kernel against the cpu device (the reference), bit for bit, on
//!   every dtype combination the streams launch.
//!
//! A small prelude defines the CUDA keywords away (`host_build`); a block's
//! threads are OS threads with a real barrier for `__syncthreads` (`lanes`),
//! so the tiled matmul and the tree reductions run as written; `compare`
//! holds each result against the reference. The conversions' tests are in
//! `conversions`, the kernels' here. What this cannot show: the GPU
//! compilers' code generation, the hardware's own conversions (`(float)` of
//! an f64, NaN payloads) and the launch paths — those need a GPU
//! (`ci/gpu-check.sh`). Without a C++ compiler (`CXX`, `c++`, `g++`,
//! `clang++`; `ci/vendor-cxx.sh` installs g++) every test fails, saying so.
#![cfg(any(feature = "cuda", feature = "rocm"))]

mod batch;
#[path = "../common/mod.rs"]
mod common;
mod compare;
mod conversions;
mod host_build;
mod inputs;
mod lanes;

use std::ffi::c_void;

use chorus_devices::gpu_kernels::{self, code, AdamWScalars, SgdScalars, SOURCE};
use chorus_devices::{
    AdamWOperands, AdamWParams, Buffer, ComputeStream, DType, MatmulSpec, Scalar, SgdOperands, SgdParams, Stream,
};

use common::FLOATS;
use compare::{assert_agree, sides, Agree, Data};
use conversions::cast;
use inputs::{dyadic, specials, Rng};
use lanes::{ELEMENTWISE, SEQUENTIAL, TREE};

type Scale = unsafe extern "C" fn(*mut c_void, i32, u64, f64);

// ---- the source itself (no compiler needed) -------------------------------------------

#[test]
fn the_source_defines_every_named_kernel_once_with_the_shared_sizes() {
    for name in gpu_kernels::NAMES {
        assert_eq!(SOURCE.matches(&format!(" {name}(")).count(), 1, "{name}");
    }
    assert_eq!(SOURCE.matches("extern \"C\" __global__").count(), gpu_kernels::NAMES.len());
    for (define, value) in [
        ("CHORUS_BLOCK", gpu_kernels::BLOCK),
        ("CHORUS_REDUCE_BLOCK", gpu_kernels::REDUCE_BLOCK),
        ("CHORUS_TILE", gpu_kernels::TILE),
    ] {
        assert!(SOURCE.contains(&format!("#define {define} {value}\n")), "{define}");
    }
    assert!(gpu_kernels::REDUCE_BLOCK.is_power_of_two() && gpu_kernels::REDUCE_BLOCK <= 1024);
    assert!(!SOURCE.contains("asm"), "no vendor assembly in the shared source");
}

#[test]
fn dtype_codes_are_distinct_and_match_the_source() {
    let all = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::I8, DType::U8];
    for (i, d) in all.iter().enumerate() {
        assert_eq!(code(*d), i as i32);
        let tag = format!("#define T_{} {i}\n", d.name().to_uppercase());
        assert!(SOURCE.contains(&tag), "{tag}");
    }
}

// ---- every kernel against the cpu device ---------------------------------------------

#[test]
fn cast_scale_accumulate_and_axpy_match_the_cpu_device() {
    let sides = sides();
    let (k, s) = (sides.k, &sides.s);
    let mut rng = Rng(11);
    type Acc = unsafe extern "C" fn(*const c_void, i32, *mut c_void, i32, u64);
    type Axpy = unsafe extern "C" fn(f64, *const c_void, i32, *mut c_void, i32, u64);
    let (scale, acc, axpy): (Scale, Acc, Axpy) =
        (k.get("chorus_scale"), k.get("chorus_accumulate"), k.get("chorus_axpy"));
    for xt in FLOATS {
        let mut vals = rng.values(300);
        vals.extend(specials());
        let x = Data::from_f64(xt, &vals);
        let (px, n) = (x.ptr(), x.len as u64);
        for alpha in [0.3, -1.7, 1e-3] {
            sides.compare(
                &format!("scale {xt} by {alpha}"),
                Agree::Value,
                ELEMENTWISE,
                [("x", &x)],
                // SAFETY: n elements of xt.
                |[p]| unsafe { scale(p as _, code(xt), n, alpha) },
                |[cx]| s.scale(cx, alpha),
            );
        }
        for yt in FLOATS {
            let y = Data::from_f64(yt, &rng.values(x.len));
            let cy = s.alloc(yt, x.len).unwrap();
            s.cast(sides.upload(&x).view(), cy.view()).unwrap();
            assert_agree(&format!("cast {xt} -> {yt}"), &cast(k, &x, yt), &Data::from_cpu(s, &cy), Agree::Bits);
            sides.compare(
                &format!("accumulate {xt} into {yt}"),
                Agree::Value,
                ELEMENTWISE,
                [("y", &y)],
                // SAFETY: n elements each.
                |[py]| unsafe { acc(px as _, code(xt), py as _, code(yt), n) },
                |[cy]| s.accumulate(sides.upload(&x).view(), cy),
            );
            sides.compare(
                &format!("axpy {xt} into {yt}"),
                Agree::Value,
                ELEMENTWISE,
                [("y", &y)],
                // SAFETY: n elements each.
                |[py]| unsafe { axpy(-0.7, px as _, code(xt), py as _, code(yt), n) },
                |[cy]| s.axpy(-0.7, sides.upload(&x).view(), cy),
            );
        }
    }
}

#[test]
fn integer_accumulate_wraps_and_fill_writes_every_width_like_the_cpu_device() {
    let sides = sides();
    let (k, s) = (sides.k, &sides.s);
    let mut rng = Rng(5);
    type AccInt = unsafe extern "C" fn(*const c_void, *mut c_void, i32, u64);
    type Fill = unsafe extern "C" fn(*mut c_void, i32, u64, u64);
    let (acc, fill): (AccInt, Fill) = (k.get("chorus_accumulate_int"), k.get("chorus_fill"));
    for t in [DType::I32, DType::I64, DType::I8, DType::U8] {
        let words = |rng: &mut Rng| (0..257).flat_map(|_| rng.next().to_le_bytes()).collect::<Vec<u8>>();
        let a = Data::from_bytes(t, &words(&mut rng)[..257 * t.size()]);
        let b = Data::from_bytes(t, &words(&mut rng)[..257 * t.size()]);
        let (pa, n) = (a.ptr(), a.len as u64);
        sides.compare(
            &format!("accumulate {t}"),
            Agree::Bits,
            ELEMENTWISE,
            [("b", &b)],
            // SAFETY: n elements of t each.
            |[pb]| unsafe { acc(pa as _, pb as _, code(t), n) },
            |[cb]| s.accumulate(sides.upload(&a).view(), cb),
        );
    }
    for (t, value) in [
        (DType::U8, Scalar::Int(0xa5)),
        (DType::F16, Scalar::Float(-1.5)),
        (DType::BF16, Scalar::Float(3.0)),
        (DType::F32, Scalar::Float(0.1)),
        (DType::I32, Scalar::Int(-7)),
        (DType::F64, Scalar::Float(-0.1)),
        (DType::I64, Scalar::Int(i64::MIN + 3)),
    ] {
        let pattern = value.encode(t).unwrap();
        let mut word = [0u8; 8];
        word[..pattern.len()].copy_from_slice(&pattern);
        let zeros = Data::from_bytes(t, &vec![0u8; 101 * t.size()]);
        sides.compare(
            &format!("fill {t}"),
            Agree::Bits,
            ELEMENTWISE,
            [("x", &zeros)],
            // SAFETY: 101 elements of the pattern's width.
            |[p]| unsafe { fill(p as _, t.size() as i32, 101, u64::from_le_bytes(word)) },
            |[cx]| s.fill(cx, value),
        );
    }
}

#[test]
fn bias_add_relu_and_its_backward_match_the_cpu_device_nan_included() {
    let sides = sides();
    let (k, s) = (sides.k, &sides.s);
    let mut rng = Rng(3);
    type Bias = unsafe extern "C" fn(*mut c_void, i32, *const c_void, i32, u64, u64);
    type Relu = unsafe extern "C" fn(*const c_void, *mut c_void, i32, u64);
    type ReluBack = unsafe extern "C" fn(*const c_void, *const c_void, *mut c_void, i32, u64);
    let (bias_add, relu, relu_back): (Bias, Relu, ReluBack) =
        (k.get("chorus_bias_add"), k.get("chorus_relu"), k.get("chorus_relu_backward"));
    let cols = 17;
    for xt in FLOATS {
        for bt in FLOATS {
            let x = Data::from_f64(xt, &rng.values(cols * 9));
            let b = Data::from_f64(bt, &rng.values(cols));
            let (pb, n) = (b.ptr(), x.len as u64);
            sides.compare(
                &format!("bias_add {bt} to {xt}"),
                Agree::Value,
                ELEMENTWISE,
                [("x", &x)],
                // SAFETY: n elements of xt, cols of bt.
                |[px]| unsafe { bias_add(px as _, code(xt), pb as _, code(bt), n, cols as u64) },
                |[cx]| s.bias_add(cx, sides.upload(&b).view()),
            );
        }
        let mut vals = rng.values(200);
        vals.extend(specials());
        let x = Data::from_f64(xt, &vals);
        let nines = Data::from_f64(xt, &vec![9.0; x.len]);
        let (px, n) = (x.ptr(), x.len as u64);
        let [y] = sides.compare(
            &format!("relu {xt}"),
            Agree::Bits,
            ELEMENTWISE,
            [("y", &nines)],
            // SAFETY: n elements of xt each.
            |[py]| unsafe { relu(px as _, py as _, code(xt), n) },
            |[cy]| s.relu(sides.upload(&x).view(), cy),
        );
        // NaN stays NaN, -0 and negatives become +0.
        for (i, v) in vals.iter().enumerate() {
            let y = y.get(i);
            if v.is_nan() {
                assert!(y.is_nan(), "relu({v}) = {y}");
            } else if *v <= 0.0 {
                assert!(y == 0.0 && y.is_sign_positive(), "relu({v}) = {y}");
            }
        }
        let grad = Data::from_f64(xt, &rng.values(x.len));
        let pg = grad.ptr();
        sides.compare(
            &format!("relu_backward {xt}"),
            Agree::Bits,
            ELEMENTWISE,
            [("grad_in", &nines)],
            // SAFETY: n elements of xt each.
            |[pi]| unsafe { relu_back(pg as _, px as _, pi as _, code(xt), n) },
            |[ci]| s.relu_backward(sides.upload(&grad).view(), sides.upload(&x).view(), ci),
        );
    }
}

#[test]
fn the_mse_loss_gradient_and_sums_match_the_cpu_device() {
    let sides = sides();
    let (k, s) = (sides.k, &sides.s);
    let mut rng = Rng(17);
    type Grad = unsafe extern "C" fn(*const c_void, i32, *const c_void, i32, *mut c_void, i32, u64, f64);
    type Loss = Grad;
    type SumSq = unsafe extern "C" fn(*const c_void, i32, *mut c_void, i32, u64, i32);
    type ColSums = unsafe extern "C" fn(*const c_void, i32, *mut c_void, i32, u64, u64, i32);
    let (mse_grad, mse_loss, sum_sq, col_sums): (Grad, Loss, SumSq, ColSums) =
        (k.get("chorus_mse_grad"), k.get("chorus_mse_loss"), k.get("chorus_sum_squares"), k.get("chorus_column_sums"));
    let n = 333;
    let scale = 1.0 / n as f64;
    // The reductions in one thread (the cpu device's order) and as a tree.
    let reductions = [(SEQUENTIAL, Agree::Bits), (TREE, Agree::Relative(1e-6))];
    for pt in FLOATS {
        for tt in FLOATS {
            let p = Data::from_f64(pt, &rng.values(n));
            let t = Data::from_f64(tt, &rng.values(n));
            let (pp, tp) = (p.ptr(), t.ptr());
            for gt in FLOATS {
                sides.compare(
                    &format!("mse_grad {pt} {tt} -> {gt}"),
                    Agree::Value,
                    ELEMENTWISE,
                    [("grad", &Data::from_f64(gt, &vec![0.0; n]))],
                    // SAFETY: n elements of each dtype.
                    |[g]| unsafe { mse_grad(pp as _, code(pt), tp as _, code(tt), g as _, code(gt), n as u64, scale) },
                    |[cg]| s.mse_grad(sides.upload(&p).view(), sides.upload(&t).view(), cg, scale),
                );
            }
            for lt in [DType::F32, DType::F64] {
                for (launch, how) in reductions {
                    sides.compare(
                        &format!("mse_loss {pt} {tt} -> {lt}"),
                        how,
                        launch,
                        [("loss", &Data::from_f64(lt, &[0.0]))],
                        // SAFETY: n elements of pt and tt, one of lt.
                        |[l]| unsafe {
                            mse_loss(pp as _, code(pt), tp as _, code(tt), l as _, code(lt), n as u64, scale)
                        },
                        |[cl]| s.mse_loss(sides.upload(&p).view(), sides.upload(&t).view(), cl, scale),
                    );
                }
            }
        }
    }
    for xt in FLOATS {
        let x = Data::from_f64(xt, &rng.values(n));
        let px = x.ptr();
        for ot in [DType::F32, DType::F64] {
            for accumulate in [false, true] {
                for (launch, how) in reductions {
                    sides.compare(
                        &format!("sum_squares {xt} -> {ot} ({accumulate})"),
                        how,
                        launch,
                        [("out", &Data::from_f64(ot, &[2.5]))],
                        // SAFETY: n elements of xt, one of ot.
                        |[o]| unsafe { sum_sq(px as _, code(xt), o as _, code(ot), n as u64, accumulate as i32) },
                        |[co]| s.sum_squares(sides.upload(&x).view(), co, accumulate),
                    );
                }
            }
        }
        let cols = 37;
        let x = Data::from_f64(xt, &rng.values(cols * 9));
        let px = x.ptr();
        for ot in FLOATS {
            for accumulate in [false, true] {
                sides.compare(
                    &format!("column_sums {xt} -> {ot} ({accumulate})"),
                    Agree::Value,
                    ELEMENTWISE,
                    [("out", &Data::from_f64(ot, &rng.values(cols)))],
                    // SAFETY: 9 rows of `cols` elements of xt, `cols` of ot.
                    |[o]| unsafe { col_sums(px as _, code(xt), o as _, code(ot), 9, cols as u64, accumulate as i32) },
                    |[co]| s.column_sums(sides.upload(&x).view(), co, accumulate),
                );
            }
        }
    }
}

/// Gradient clipping's scaling with the norm read on the device, for every
/// dtype of `x` and of the norm's two parts, below, at and above `max_norm`
/// and with a NaN norm.
#[test]
fn clip_scale_matches_the_cpu_device() {
    let sides = sides();
    let (k, s) = (sides.k, &sides.s);
    let mut rng = Rng(23);
    type Clip = unsafe extern "C" fn(*mut c_void, i32, u64, *const c_void, i32, *const c_void, i32, f64);
    let clip: Clip = k.get("chorus_clip_scale");
    for xt in FLOATS {
        let mut vals = rng.values(300);
        vals.extend(specials());
        let x = Data::from_f64(xt, &vals);
        let n = x.len as u64;
        for pt in [DType::F32, DType::F64] {
            for (a, b, max_norm) in [(16.0, 9.0, 2.0), (0.3, 0.1, 0.5), (16.0, 9.0, 10.0), (f64::NAN, 1.0, 1.0)] {
                let (pa, pb) = (Data::from_f64(pt, &[a]), Data::from_f64(pt, &[b]));
                let (ppa, ppb) = (pa.ptr(), pb.ptr());
                sides.compare(
                    &format!("clip_scale {xt} by parts {pt} ({a}, {b}, {max_norm})"),
                    Agree::Value,
                    ELEMENTWISE,
                    [("x", &x)],
                    // SAFETY: n elements of xt, one of pt each.
                    |[px]| unsafe { clip(px as _, code(xt), n, ppa as _, code(pt), ppb as _, code(pt), max_norm) },
                    |[cx]| s.clip_scale(cx, [sides.upload(&pa).view(), sides.upload(&pb).view()], max_norm),
                );
            }
        }
    }
}

/// The gradient norm's reduction over many blocks (fixed chunks, then one
/// block over their sums) against the cpu device's left-to-right sum.
#[test]
fn sum_squares_over_many_blocks_matches_the_cpu_device() {
    let sides = sides();
    let (k, s) = (sides.k, &sides.s);
    let mut rng = Rng(23);
    type Part = unsafe extern "C" fn(*const c_void, i32, *mut c_void, u64, u64);
    type Finish = unsafe extern "C" fn(*const c_void, u64, *mut c_void, i32, i32);
    let (part, finish): (Part, Finish) = (k.get("chorus_sum_squares_part"), k.get("chorus_sum_squares_finish"));
    let n = 200_003u64;
    let (chunk, parts) = gpu_kernels::sum_squares_split(n);
    assert!(parts > 1 && chunk * parts >= n && chunk * (parts - 1) < n, "{chunk} × {parts} for {n}");
    assert_eq!(gpu_kernels::sum_squares_split(1000), (1 << 16, 1));
    for xt in FLOATS {
        let x = Data::from_f64(xt, &rng.values(n as usize));
        let mut partials = Data::from_f64(DType::F64, &vec![f64::NAN; parts as usize]);
        let (px, pp) = (x.ptr(), partials.ptr_mut());
        // SAFETY: n elements of xt in, `parts` f64 out.
        k.launch(((parts as u32, 1), (64, 1)), || unsafe { part(px as _, code(xt), pp as _, n, chunk) });
        for ot in [DType::F32, DType::F64] {
            for accumulate in [false, true] {
                sides.compare(
                    &format!("sum_squares over {parts} blocks {xt} -> {ot} ({accumulate})"),
                    Agree::Relative(1e-6),
                    TREE,
                    [("out", &Data::from_f64(ot, &[2.5]))],
                    // SAFETY: `parts` f64 partial sums, one element of ot.
                    |[o]| unsafe { finish(pp as _, parts, o as _, code(ot), accumulate as i32) },
                    |[co]| s.sum_squares(sides.upload(&x).view(), co, accumulate),
                );
            }
        }
    }
}

#[test]
fn sgd_and_adamw_steps_match_the_cpu_device() {
    let sides = sides();
    let (k, s) = (sides.k, &sides.s);
    let mut rng = Rng(23);
    let n = 300;
    type Sgd = unsafe extern "C" fn(*mut f32, *const f32, *mut f32, u64, f32, f32, f32, f32, i32, i32, i32, i32);
    type AdamW = unsafe extern "C" fn(*mut f32, *const f32, *mut f32, *mut f32, u64, f32, f32, f32, f32, f32, f32, f32);
    let (sgd, adamw): (Sgd, AdamW) = (k.get("chorus_sgd"), k.get("chorus_adamw"));
    let f32s = |rng: &mut Rng| Data::from_f64(DType::F32, &rng.values(n));
    for (momentum, nesterov, weight_decay, first_step) in
        [(0.0, false, 0.0, false), (0.9, false, 0.01, true), (0.9, true, 0.01, false), (0.5, false, 0.0, false)]
    {
        let params = SgdParams { lr: 0.05, momentum, dampening: 0.1, weight_decay, nesterov, first_step };
        let (w, g, buf) = (f32s(&mut rng), f32s(&mut rng), f32s(&mut rng));
        let sc = SgdScalars::new(&params, momentum != 0.0);
        let pg = g.ptr();
        sides.compare(
            &format!("sgd {params:?}"),
            Agree::Bits,
            ELEMENTWISE,
            [("param", &w), ("buffer", &buf)],
            // SAFETY: n f32 each, disjoint.
            |[pw, pb]| unsafe {
                sgd(
                    pw as _,
                    pg as _,
                    pb as _,
                    n as u64,
                    sc.lr,
                    sc.weight_decay,
                    sc.momentum,
                    sc.one_minus_dampening,
                    sc.has_weight_decay,
                    sc.use_momentum,
                    sc.first_step,
                    sc.nesterov,
                )
            },
            |[cw, cb]| {
                let grad = sides.upload(&g);
                let momentum_buf = (momentum != 0.0).then_some(cb);
                s.sgd_step(params, SgdOperands { param: cw, grad: grad.view(), momentum_buf })
            },
        );
    }
    for step in [1, 2, 10] {
        let params = AdamWParams { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, step };
        let (w, g, m) = (f32s(&mut rng), f32s(&mut rng), f32s(&mut rng));
        let v = Data::from_f64(DType::F32, &rng.values(n).iter().map(|x| x * x).collect::<Vec<_>>());
        let sc = AdamWScalars::new(&params);
        let pg = g.ptr();
        sides.compare(
            &format!("adamw step {step}"),
            Agree::Bits,
            ELEMENTWISE,
            [("param", &w), ("exp_avg", &m), ("exp_avg_sq", &v)],
            // SAFETY: n f32 each, disjoint.
            |[pw, pm, pv]| unsafe {
                adamw(
                    pw as _,
                    pg as _,
                    pm as _,
                    pv as _,
                    n as u64,
                    sc.decay,
                    sc.one_minus_beta1,
                    sc.beta2,
                    sc.one_minus_beta2,
                    sc.bias_correction2_sqrt,
                    sc.step_size,
                    sc.eps,
                )
            },
            |[cw, cm, cv]| {
                let grad = sides.upload(&g);
                s.adamw_step(params, AdamWOperands { param: cw, grad: grad.view(), exp_avg: cm, exp_avg_sq: cv })
            },
        );
    }
}

/// The tiled matmul with 16×16 threads per block, on shapes that are not
/// multiples of the tile and a grid too short for the rows (so blocks stride
/// over row tiles). Inputs are multiples of 1/8 so every product and sum is
/// exact and the order of summation cannot matter: the results must be the
/// cpu device's bit for bit, including the final rounding into C.
#[test]
fn the_tiled_matmul_matches_the_cpu_device() {
    let sides = sides();
    let (k, s) = (sides.k, &sides.s);
    let mut rng = Rng(29);
    type Matmul =
        unsafe extern "C" fn(*const c_void, *const c_void, i32, *mut c_void, i32, u64, u64, u64, i32, i32, i32);
    let matmul: Matmul = k.get("chorus_matmul");
    let (m, n, kk) = (35usize, 21usize, 19usize);
    let tile = gpu_kernels::TILE;
    let grid = ((n as u32).div_ceil(tile), 2);
    let mut pairs: Vec<(DType, DType)> = FLOATS.iter().map(|t| (*t, *t)).collect();
    pairs.extend([(DType::F64, DType::F32), (DType::F16, DType::F32), (DType::BF16, DType::F32)]);
    for (t, ct) in pairs {
        for (trans_a, trans_b, accumulate) in
            [(false, false, false), (true, false, true), (false, true, true), (true, true, false)]
        {
            let spec = MatmulSpec { m, n, k: kk, trans_a, trans_b, accumulate };
            let a = Data::from_f64(t, &dyadic(&mut rng, m * kk));
            let b = Data::from_f64(t, &dyadic(&mut rng, kk * n));
            let c = Data::from_f64(ct, &rng.values(m * n));
            let (pa, pb) = (a.ptr(), b.ptr());
            let flags = (trans_a as i32, trans_b as i32, accumulate as i32);
            sides.compare(
                &format!("matmul {t} -> {ct} {spec:?}"),
                Agree::Bits,
                (grid, (tile, tile)),
                [("c", &c)],
                // SAFETY: shapes as the spec says.
                |[pc]| unsafe {
                    let (m, n, kk) = (m as u64, n as u64, kk as u64);
                    matmul(pa as _, pb as _, code(t), pc as _, code(ct), m, n, kk, flags.0, flags.1, flags.2)
                },
                |[cc]| s.matmul(spec, sides.upload(&a).view(), sides.upload(&b).view(), cc),
            );
        }
    }
}

#[test]
fn float8_amax_and_scaled_casts_match_the_cpu_device() {
    let sides = sides();
    let (k, s) = (sides.k, &sides.s);
    let mut rng = Rng(23);
    type AbsMax = unsafe extern "C" fn(*const c_void, i32, *mut c_void, u64, i32);
    type Quantize = unsafe extern "C" fn(*const c_void, i32, *const c_void, *mut c_void, u64);
    type Dequantize = unsafe extern "C" fn(*const c_void, *const c_void, *mut c_void, i32, u64);
    let (abs_max, quantize, dequantize): (AbsMax, Quantize, Dequantize) =
        (k.get("chorus_abs_max"), k.get("chorus_quantize_f8"), k.get("chorus_dequantize_f8"));
    // 2^-12 .. 2^12 in magnitude: past 448 and into e4m3's subnormals at every scale below.
    let n = 333;
    let amaxes = [0.0, 1e-3, 3.7, 448.0, 9000.0];
    for xt in FLOATS {
        let x = Data::from_f64(xt, &rng.values(n));
        let px = x.ptr();
        for accumulate in [false, true] {
            // A max is the same in any order: bits in one thread and as a tree.
            for launch in [SEQUENTIAL, TREE] {
                sides.compare(
                    &format!("abs_max {xt} ({accumulate})"),
                    Agree::Bits,
                    launch,
                    [("out", &Data::from_f64(DType::F32, &[2.5]))],
                    // SAFETY: n elements of xt, one f32.
                    |[o]| unsafe { abs_max(px as _, code(xt), o as _, n as u64, accumulate as i32) },
                    |[co]| s.abs_max(sides.upload(&x).view(), co, accumulate),
                );
            }
        }
        let mut with_specials = rng.values(n);
        with_specials.extend(specials());
        let x = Data::from_f64(xt, &with_specials);
        let (px, m) = (x.ptr(), with_specials.len());
        for a in amaxes {
            let amax = Data::from_f64(DType::F32, &[a]);
            let pa = amax.ptr();
            sides.compare(
                &format!("quantize_f8 {xt} (amax {a})"),
                Agree::Value,
                ELEMENTWISE,
                [("q", &Data::from_f64(DType::F8E4M3, &vec![0.0; m]))],
                // SAFETY: m elements of xt and of f8, one f32 amax.
                |[q]| unsafe { quantize(px as _, code(xt), pa as _, q as _, m as u64) },
                |[cq]| s.quantize_f8(sides.upload(&x).view(), sides.upload(&amax).view(), cq),
            );
        }
    }
    // Every finite code (NaN's result is NaN either way, its payload the compiler's).
    let codes: Vec<f64> =
        (0u8..=255).filter(|c| c & 0x7f != 0x7f).map(|c| chorus_devices::Float8E4M3(c).to_f32() as f64).collect();
    let q = Data::from_f64(DType::F8E4M3, &codes);
    let pq = q.ptr();
    for dt in FLOATS {
        for a in amaxes {
            let amax = Data::from_f64(DType::F32, &[a]);
            let pa = amax.ptr();
            sides.compare(
                &format!("dequantize_f8 -> {dt} (amax {a})"),
                Agree::Bits,
                ELEMENTWISE,
                [("out", &Data::from_f64(dt, &vec![0.0; codes.len()]))],
                // SAFETY: codes.len() elements of f8 and of dt, one f32 amax.
                |[o]| unsafe { dequantize(pq as _, pa as _, o as _, code(dt), codes.len() as u64) },
                |[co]| s.dequantize_f8(sides.upload(&q).view(), sides.upload(&amax).view(), co),
            );
        }
    }
}
