//! A device's compute operations, generic over the backend: matmul, bias_add, relu and its
//! backward, the MSE loss and gradient, column sums, sums of squares, and the
//! SGD and AdamW steps. Every expected value comes from a plain host loop in
//! f64 written here (PyTorch's update formulas for the optimizers), compared
//! with a tolerance derived from the precision the device computes in.

use anyhow::Result;
use chorus_devices::{
    AdamWOperands, AdamWParams, Backend, Buffer, ComputeBackend, ComputeStream, DType, Device, DeviceError, MatmulSpec,
    SgdOperands, SgdParams, Stream, StreamExt,
};

use crate::common::{assert_close, assert_same, get, put, round_to, stream, unit_roundoff, Lcg, FLOATS};

/// The type f16/bf16/f32 arithmetic is done in (PyTorch's opmath).
fn opmath(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// A buffer of `dtype` holding `values` (already representable).
fn buffer<B: Backend>(dev: &B::Device, s: &B::Stream, dtype: DType, values: &[f64]) -> Result<B::Buffer> {
    let b = dev.alloc(dtype, values.len())?;
    put(s, b.view(), values)?;
    Ok(b)
}

fn is_invalid(e: &DeviceError, expected_op: &str) -> bool {
    matches!(e, DeviceError::InvalidArgument { op, .. } if *op == expected_op)
}

/// `C (+)= op(A) op(B)` in f64 with A stored `[m,k]` (`[k,m]` transposed) and
/// B stored `[k,n]` (`[n,k]` transposed); also returns `Σ|a||b|` (+ `|c|`)
/// per element, the scale of the rounding error of any summation order.
fn reference_matmul(spec: MatmulSpec, a: &[f64], b: &[f64], c: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let MatmulSpec { m, n, k, trans_a, trans_b, accumulate } = spec;
    let at = |i: usize, p: usize| if trans_a { a[p * m + i] } else { a[i * k + p] };
    let bt = |p: usize, j: usize| if trans_b { b[j * k + p] } else { b[p * n + j] };
    let (mut out, mut scale) = (vec![0.0; m * n], vec![0.0; m * n]);
    for i in 0..m {
        for j in 0..n {
            let (mut sum, mut mag) = (0.0, 0.0);
            for p in 0..k {
                sum += at(i, p) * bt(p, j);
                mag += (at(i, p) * bt(p, j)).abs();
            }
            if accumulate {
                sum += c[i * n + j];
                mag += c[i * n + j].abs();
            }
            out[i * n + j] = sum;
            scale[i * n + j] = mag;
        }
    }
    (out, scale)
}

/// A case of the device suite.
pub fn matmul_matches_a_naive_product_for_every_transpose_and_dtype<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let dtypes = [
        (DType::F32, DType::F32),
        (DType::BF16, DType::F32),
        (DType::F16, DType::F32),
        (DType::F64, DType::F64),
        (DType::F64, DType::F32),
        (DType::BF16, DType::BF16),
        (DType::F16, DType::F16),
    ];
    let shapes = [(1, 1, 1), (3, 5, 7), (17, 9, 33), (64, 48, 80), (4, 3, 0)];
    let mut seed = 1000;
    for (input, output) in dtypes {
        for (m, n, k) in shapes {
            for (trans_a, trans_b) in [(false, false), (true, false), (false, true), (true, true)] {
                for accumulate in [false, true] {
                    seed += 1;
                    let spec = MatmulSpec { m, n, k, trans_a, trans_b, accumulate };
                    let a = Lcg::new(seed).values(input, m * k, -1.0, 1.0);
                    let b = Lcg::new(seed + 7919).values(input, k * n, -1.0, 1.0);
                    let c = Lcg::new(seed + 104_729).values(output, m * n, -1.0, 1.0);
                    let (ab, bb, cb) = (
                        buffer::<B>(&dev, &s, input, &a)?,
                        buffer::<B>(&dev, &s, input, &b)?,
                        buffer::<B>(&dev, &s, output, &c)?,
                    );
                    s.matmul(spec, ab.view(), bb.view(), cb.view())?;
                    let (want, scale) = reference_matmul(spec, &a, &b, &c);
                    // Accumulated in the opmath of the inputs (f32, or f64),
                    // then rounded to the output dtype: once, or with
                    // `accumulate` twice, since cuBLAS may round the product
                    // to the output dtype before adding C (bf16 on an H100,
                    // cuBLAS 13: one output ulp from the nearest value).
                    let u = unit_roundoff(opmath(input));
                    let uo = unit_roundoff(output);
                    let tol = |i: usize| {
                        let product = if accumulate { uo * scale[i] } else { 0.0 };
                        (k + 2) as f64 * u * scale[i] + uo * want[i].abs() * 1.0001 + product
                    };
                    let what =
                        format!("matmul {input}->{output} {m}x{n}x{k} ta={trans_a} tb={trans_b} acc={accumulate}");
                    assert_close(&what, &get(&s, cb.view())?, &want, tol);
                }
            }
        }
    }
    Ok(())
}

/// A case of the device suite.
pub fn matmul_works_on_sub_views<B: ComputeBackend>(make: &dyn Fn() -> Result<B::Device>) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    // A = [[1,2],[3,4]], B = [[5,6],[7,8]] inside larger buffers.
    let a = s.buffer_from(&[9.0f32, 1.0, 2.0, 3.0, 4.0, 9.0])?;
    let b = s.buffer_from(&[5.0f32, 6.0, 7.0, 8.0])?;
    let c = s.buffer_from(&[-1.0f32; 7])?;
    let spec = MatmulSpec { m: 2, n: 2, k: 2, trans_a: false, trans_b: false, accumulate: false };
    s.matmul(spec, a.slice(1, 4)?, b.view(), c.slice(2, 4)?)?;
    assert_eq!(s.read_vec::<f32>(c.view())?, vec![-1.0, -1.0, 19.0, 22.0, 43.0, 50.0, -1.0]);
    Ok(())
}

/// A case of the device suite.
pub fn matmul_refuses_bad_shapes_and_dtypes<B: ComputeBackend>(make: &dyn Fn() -> Result<B::Device>) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let spec = MatmulSpec { m: 2, n: 3, k: 4, trans_a: false, trans_b: false, accumulate: false };
    let (a, b, c) = (dev.alloc(DType::F32, 8)?, dev.alloc(DType::F32, 12)?, dev.alloc(DType::F32, 6)?);
    s.matmul(spec, a.view(), b.view(), c.view())?;
    for (a_len, b_len, c_len) in [(7, 12, 6), (8, 13, 6), (8, 12, 5)] {
        let (a, b, c) = (dev.alloc(DType::F32, a_len)?, dev.alloc(DType::F32, b_len)?, dev.alloc(DType::F32, c_len)?);
        let e = s.matmul(spec, a.view(), b.view(), c.view()).unwrap_err();
        assert!(is_invalid(&e, "matmul"), "{a_len},{b_len},{c_len}: {e:?}");
    }
    let b16 = dev.alloc(DType::BF16, 12)?;
    let e = s.matmul(spec, a.view(), b16.view(), c.view()).unwrap_err();
    assert!(matches!(e, DeviceError::DTypeMismatch { op: "matmul", .. }), "{e:?}");
    // bf16 inputs may write bf16 or f32, not f16.
    let (a16, c16) = (dev.alloc(DType::BF16, 8)?, dev.alloc(DType::F16, 6)?);
    let e = s.matmul(spec, a16.view(), b16.view(), c16.view()).unwrap_err();
    assert!(is_invalid(&e, "matmul"), "{e:?}");
    let (ai, bi, ci) = (dev.alloc(DType::I32, 8)?, dev.alloc(DType::I32, 12)?, dev.alloc(DType::I32, 6)?);
    let e = s.matmul(spec, ai.view(), bi.view(), ci.view()).unwrap_err();
    assert!(is_invalid(&e, "matmul"), "{e:?}");
    s.synchronize()?;
    Ok(())
}

/// A case of the device suite.
pub fn bias_add_adds_the_bias_to_every_row<B: ComputeBackend>(make: &dyn Fn() -> Result<B::Device>) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let pairs = [
        (DType::F32, DType::F32),
        (DType::BF16, DType::F32),
        (DType::F16, DType::F16),
        (DType::F64, DType::F32),
        (DType::F32, DType::BF16),
    ];
    let (rows, cols) = (6, 5);
    for (i, (x_dtype, b_dtype)) in pairs.into_iter().enumerate() {
        let x = Lcg::new(300 + i as u64).values(x_dtype, rows * cols, -10.0, 10.0);
        let bias = Lcg::new(310 + i as u64).values(b_dtype, cols, -10.0, 10.0);
        let (xb, bb) = (buffer::<B>(&dev, &s, x_dtype, &x)?, buffer::<B>(&dev, &s, b_dtype, &bias)?);
        s.bias_add(xb.view(), bb.view())?;
        // The sum of two such values is exact in f64: round it in x's opmath, then to x.
        let want: Vec<f64> = x
            .iter()
            .enumerate()
            .map(|(j, v)| round_to(x_dtype, round_to(opmath(x_dtype), v + bias[j % cols])))
            .collect();
        assert_same(&format!("bias_add {x_dtype} + {b_dtype}"), &get(&s, xb.view())?, &want);
    }
    let (x, b) = (dev.alloc(DType::F32, 10)?, dev.alloc(DType::F32, 3)?);
    let e = s.bias_add(x.view(), b.view()).unwrap_err();
    assert!(is_invalid(&e, "bias_add"), "{e:?}");
    let e = s.bias_add(x.view(), b.slice(0, 0)?).unwrap_err();
    assert!(is_invalid(&e, "bias_add"), "{e:?}");
    let e = s.bias_add(dev.alloc(DType::I32, 6)?.view(), b.view()).unwrap_err();
    assert!(is_invalid(&e, "bias_add"), "{e:?}");
    Ok(())
}

/// PyTorch's ReLU propagates NaN (`relu(nan) = nan`) and its backward
/// (`threshold_backward`) zeroes the gradient only where the output is <= 0.
pub fn relu_propagates_nan_like_pytorch<B: ComputeBackend>(make: &dyn Fn() -> Result<B::Device>) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    for dtype in FLOATS {
        let x = [f64::NAN, -1.0, 2.0, f64::INFINITY, f64::NEG_INFINITY, 0.0];
        let xb = buffer::<B>(&dev, &s, dtype, &x)?;
        let yb = dev.alloc(dtype, x.len())?;
        s.relu(xb.view(), yb.view())?;
        let y = get(&s, yb.view())?;
        assert!(y[0].is_nan(), "relu(NaN) in {dtype} is {}", y[0]);
        assert_eq!(&y[1..], &[0.0, 2.0, f64::INFINITY, 0.0, 0.0], "{dtype}");
        let gob = buffer::<B>(&dev, &s, dtype, &[1.0; 6])?;
        let gib = dev.alloc(dtype, x.len())?;
        s.relu_backward(gob.view(), yb.view(), gib.view())?;
        assert_eq!(get(&s, gib.view())?, vec![1.0, 0.0, 1.0, 1.0, 0.0, 0.0], "relu_backward {dtype}");
    }
    Ok(())
}

/// A case of the device suite.
pub fn relu_and_its_backward_for_every_float_dtype<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    for (i, dtype) in FLOATS.into_iter().enumerate() {
        let mut x = Lcg::new(400 + i as u64).values(dtype, 31, -5.0, 5.0);
        x[0] = 0.0;
        x[1] = -0.0;
        let relu: Vec<f64> = x.iter().map(|v| if *v > 0.0 { *v } else { 0.0 }).collect();
        let xb = buffer::<B>(&dev, &s, dtype, &x)?;
        let yb = dev.alloc(dtype, x.len())?;
        s.relu(xb.view(), yb.view())?;
        assert_close(&format!("relu {dtype}"), &get(&s, yb.view())?, &relu, |_| 0.0);
        // In place.
        s.relu(xb.view(), xb.view())?;
        assert_close(&format!("relu in place {dtype}"), &get(&s, xb.view())?, &relu, |_| 0.0);

        let grad_out = Lcg::new(410 + i as u64).values(dtype, x.len(), -3.0, 3.0);
        let gob = buffer::<B>(&dev, &s, dtype, &grad_out)?;
        let gib = dev.alloc(dtype, x.len())?;
        s.relu_backward(gob.view(), yb.view(), gib.view())?;
        let want: Vec<f64> = grad_out.iter().zip(&relu).map(|(g, o)| if *o > 0.0 { *g } else { 0.0 }).collect();
        assert_close(&format!("relu_backward {dtype}"), &get(&s, gib.view())?, &want, |_| 0.0);
    }
    let (f, d) = (dev.alloc(DType::F32, 4)?, dev.alloc(DType::F64, 4)?);
    let e = s.relu(f.view(), d.view()).unwrap_err();
    assert!(matches!(e, DeviceError::DTypeMismatch { op: "relu", .. }), "{e:?}");
    let e = s.relu(f.view(), dev.alloc(DType::F32, 3)?.view()).unwrap_err();
    assert!(is_invalid(&e, "relu"), "{e:?}");
    let e = s.relu_backward(f.view(), d.view(), f.view()).unwrap_err();
    assert!(matches!(e, DeviceError::DTypeMismatch { op: "relu_backward", .. }), "{e:?}");
    let i = dev.alloc(DType::I32, 4)?;
    let e = s.relu(i.view(), i.view()).unwrap_err();
    assert!(is_invalid(&e, "relu"), "{e:?}");
    Ok(())
}

/// A case of the device suite.
pub fn mse_loss_and_gradient<B: ComputeBackend>(make: &dyn Fn() -> Result<B::Device>) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let n = 257;
    let combos = [
        (DType::F32, DType::F32, DType::F32),
        (DType::F32, DType::F32, DType::F64),
        (DType::BF16, DType::F32, DType::F64),
        (DType::F64, DType::F64, DType::F64),
        (DType::F16, DType::BF16, DType::F32),
    ];
    for (i, (pd, td, ld)) in combos.into_iter().enumerate() {
        let pred = Lcg::new(500 + i as u64).values(pd, n, -4.0, 4.0);
        let target = Lcg::new(510 + i as u64).values(td, n, -4.0, 4.0);
        let (pb, tb) = (buffer::<B>(&dev, &s, pd, &pred)?, buffer::<B>(&dev, &s, td, &target)?);
        let scale = 1.0 / n as f64;
        let sum: f64 = pred.iter().zip(&target).map(|(p, t)| (p - t) * (p - t)).sum();
        let want = scale * sum;
        let loss = dev.alloc(ld, 1)?;
        s.mse_loss(pb.view(), tb.view(), loss.view(), scale)?;
        // Summed in f64 (any order), rounded once to the loss dtype.
        let tol = 1e-13 * want + unit_roundoff(ld) * want;
        assert_close(&format!("mse_loss {pd},{td}->{ld}"), &get(&s, loss.view())?, &[want], |_| tol);

        // The gradient in its own dtype's opmath: 2·scale·(p − t).
        for gd in [DType::F32, pd] {
            let grad = dev.alloc(gd, n)?;
            s.mse_grad(pb.view(), tb.view(), grad.view(), scale)?;
            let want: Vec<f64> = pred.iter().zip(&target).map(|(p, t)| 2.0 * scale * (p - t)).collect();
            let u = unit_roundoff(opmath(gd));
            let tol = |j: usize| {
                4.0 * u * 2.0 * scale * (pred[j].abs() + target[j].abs()) + unit_roundoff(gd) * want[j].abs() * 1.0001
            };
            assert_close(&format!("mse_grad {pd},{td}->{gd}"), &get(&s, grad.view())?, &want, tol);
        }
    }
    let (p, t) = (dev.alloc(DType::F32, 4)?, dev.alloc(DType::F32, 4)?);
    for bad in [dev.alloc(DType::F32, 2)?, dev.alloc(DType::BF16, 1)?, dev.alloc(DType::I64, 1)?] {
        let e = s.mse_loss(p.view(), t.view(), bad.view(), 1.0).unwrap_err();
        assert!(is_invalid(&e, "mse_loss"), "{e:?}");
    }
    let e = s.mse_loss(p.view(), t.slice(0, 3)?, dev.alloc(DType::F32, 1)?.view(), 1.0).unwrap_err();
    assert!(is_invalid(&e, "mse_loss"), "{e:?}");
    let e = s.mse_grad(p.view(), t.view(), dev.alloc(DType::F32, 3)?.view(), 1.0).unwrap_err();
    assert!(is_invalid(&e, "mse_grad"), "{e:?}");
    Ok(())
}

/// A case of the device suite.
pub fn column_sums_over_rows_with_and_without_accumulation<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let (rows, cols) = (37, 6);
    let pairs =
        [(DType::F32, DType::F32), (DType::BF16, DType::F32), (DType::F64, DType::F64), (DType::F16, DType::F16)];
    for (i, (xd, od)) in pairs.into_iter().enumerate() {
        let x = Lcg::new(600 + i as u64).values(xd, rows * cols, -2.0, 2.0);
        let old = Lcg::new(610 + i as u64).values(od, cols, -2.0, 2.0);
        let xb = buffer::<B>(&dev, &s, xd, &x)?;
        for accumulate in [false, true] {
            let out = buffer::<B>(&dev, &s, od, &old)?;
            s.column_sums(xb.view(), out.view(), accumulate)?;
            let mut want = if accumulate { old.clone() } else { vec![0.0; cols] };
            let mut mag: Vec<f64> = want.iter().map(|v| v.abs()).collect();
            for r in 0..rows {
                for c in 0..cols {
                    want[c] += x[r * cols + c];
                    mag[c] += x[r * cols + c].abs();
                }
            }
            let u = unit_roundoff(opmath(od));
            let tol = |c: usize| (rows + 2) as f64 * u * mag[c] + unit_roundoff(od) * want[c].abs() * 1.0001;
            assert_close(&format!("column_sums {xd}->{od} acc={accumulate}"), &get(&s, out.view())?, &want, tol);
        }
    }
    let e = s.column_sums(dev.alloc(DType::F32, 10)?.view(), dev.alloc(DType::F32, 3)?.view(), false).unwrap_err();
    assert!(is_invalid(&e, "column_sums"), "{e:?}");
    let e = s.column_sums(dev.alloc(DType::F32, 10)?.view(), dev.alloc(DType::F32, 0)?.view(), false).unwrap_err();
    assert!(is_invalid(&e, "column_sums"), "{e:?}");
    Ok(())
}

/// A case of the device suite.
pub fn sum_squares_with_and_without_accumulation<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    for (i, xd) in FLOATS.into_iter().enumerate() {
        let x = Lcg::new(700 + i as u64).values(xd, 1000, -3.0, 3.0);
        let xb = buffer::<B>(&dev, &s, xd, &x)?;
        let sum: f64 = x.iter().map(|v| v * v).sum();
        for od in [DType::F32, DType::F64] {
            let out = buffer::<B>(&dev, &s, od, &[1.5])?;
            s.sum_squares(xb.view(), out.view(), false)?;
            let tol = |w: f64| 1e-13 * w + unit_roundoff(od) * w;
            assert_close(&format!("sum_squares {xd}->{od}"), &get(&s, out.view())?, &[sum], |_| tol(sum));
            s.sum_squares(xb.view(), out.view(), true)?;
            let twice = round_to(od, sum) + sum;
            assert_close(&format!("sum_squares acc {xd}->{od}"), &get(&s, out.view())?, &[twice], |_| tol(twice));
        }
    }
    let e = s.sum_squares(dev.alloc(DType::F32, 4)?.view(), dev.alloc(DType::F32, 2)?.view(), false).unwrap_err();
    assert!(is_invalid(&e, "sum_squares"), "{e:?}");
    let e = s.sum_squares(dev.alloc(DType::I8, 4)?.view(), dev.alloc(DType::F32, 1)?.view(), false).unwrap_err();
    assert!(is_invalid(&e, "sum_squares"), "{e:?}");
    Ok(())
}

/// A case of the device suite: `clip_scale` against `clip_grad_norm_`'s formula
/// computed here, for every float dtype of `x` and both dtypes of the parts;
/// a norm at or under `max_norm` (and a NaN one) leaves `x` alone.
pub fn clip_scale_scales_only_above_the_max_norm<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    for (i, xd) in FLOATS.into_iter().enumerate() {
        let x = Lcg::new(800 + i as u64).values(xd, 777, -3.0, 3.0);
        for pd in [DType::F32, DType::F64] {
            // (sharded part, replicated part, max_norm): 5 > 2, 5 < 10, 5 = 5 + 1e-6 margin, NaN.
            for (a, b, max_norm) in [(16.0, 9.0, 2.0), (16.0, 9.0, 10.0), (25.0, 0.0, 5.0), (f64::NAN, 1.0, 1.0)] {
                let xb = buffer::<B>(&dev, &s, xd, &x)?;
                let (pa, pb) = (buffer::<B>(&dev, &s, pd, &[a])?, buffer::<B>(&dev, &s, pd, &[b])?);
                s.clip_scale(xb.view(), [pa.view(), pb.view()], max_norm)?;
                let coef = max_norm / ((a + b).sqrt() + 1e-6);
                let want: Vec<f64> = if coef < 1.0 {
                    // Scaled in the dtype's opmath (f32 below f64) by the coefficient rounded to it.
                    let c = round_to(opmath(xd), coef);
                    x.iter().map(|v| round_to(xd, v * c)).collect()
                } else {
                    x.clone()
                };
                // One rounding of the product in opmath, then to the dtype: within an ulp of it.
                let tol = |j: usize| 2.0 * unit_roundoff(xd) * want[j].abs() * 1.0001;
                assert_close(
                    &format!("clip_scale {xd} by parts {pd} ({a}, {b}, {max_norm})"),
                    &get(&s, xb.view())?,
                    &want,
                    tol,
                );
            }
        }
    }
    let (x, one) = (dev.alloc(DType::F32, 8)?, dev.alloc(DType::F32, 1)?);
    let bad: [(&str, Result<(), DeviceError>); 5] = [
        ("a part of two elements", s.clip_scale(x.view(), [dev.alloc(DType::F32, 2)?.view(), one.view()], 1.0)),
        ("an integer part", s.clip_scale(x.view(), [one.view(), dev.alloc(DType::I32, 1)?.view()], 1.0)),
        ("a part inside x", s.clip_scale(x.view(), [x.view().slice(3, 1)?, one.view()], 1.0)),
        ("a negative max_norm", s.clip_scale(x.view(), [one.view(), one.view()], -1.0)),
        ("a NaN max_norm", s.clip_scale(x.view(), [one.view(), one.view()], f64::NAN)),
    ];
    for (what, r) in bad {
        let e = r.expect_err(what);
        assert!(is_invalid(&e, "clip_scale"), "{what}: {e:?}");
    }
    Ok(())
}

/// `torch.optim.SGD`'s update of one element, in f64.
fn sgd_reference(p: &SgdParams, w: &mut f64, g: f64, buf: &mut f64) {
    let mut d = g;
    if p.weight_decay != 0.0 {
        d += p.weight_decay * *w;
    }
    if p.momentum != 0.0 {
        *buf = if p.first_step { d } else { p.momentum * *buf + (1.0 - p.dampening) * d };
        d = if p.nesterov { d + p.momentum * *buf } else { *buf };
    }
    *w -= p.lr * d;
}

/// A case of the device suite.
pub fn sgd_step_matches_pytorch_with_and_without_momentum_nesterov_and_weight_decay<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let base =
        SgdParams { lr: 0.1, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false, first_step: true };
    let configs = [
        base,
        SgdParams { weight_decay: 0.01, ..base },
        SgdParams { momentum: 0.9, ..base },
        SgdParams { momentum: 0.9, dampening: 0.1, weight_decay: 0.01, lr: 0.05, ..base },
        SgdParams { momentum: 0.9, nesterov: true, weight_decay: 1e-3, ..base },
    ];
    let n = 37;
    for (ci, config) in configs.into_iter().enumerate() {
        let mut w = Lcg::new(800 + ci as u64).values(DType::F32, n, -1.0, 1.0);
        let mut buf_ref = vec![0.0; n];
        let param = buffer::<B>(&dev, &s, DType::F32, &w)?;
        let grad = dev.alloc(DType::F32, n)?;
        let momentum = (config.momentum != 0.0).then(|| dev.alloc(DType::F32, n)).transpose()?;
        for step in 0..4 {
            let g = Lcg::new(900 + 10 * ci as u64 + step).values(DType::F32, n, -1.0, 1.0);
            put(&s, grad.view(), &g)?;
            let params = SgdParams { first_step: step == 0, ..config };
            let momentum_buf = momentum.as_ref().map(|m| m.view());
            s.sgd_step(params, SgdOperands { param: param.view(), grad: grad.view(), momentum_buf })?;
            for j in 0..n {
                sgd_reference(&params, &mut w[j], g[j], &mut buf_ref[j]);
            }
            let what = format!("sgd {config:?} step {step}");
            assert_close(&what, &get(&s, param.view())?, &w, |j| 1e-6 * (1.0 + w[j].abs()));
            if let Some(m) = &momentum {
                assert_close(&format!("{what} momentum"), &get(&s, m.view())?, &buf_ref, |j| {
                    1e-6 * (1.0 + buf_ref[j].abs())
                });
            }
        }
    }

    let (p, g, m) = (dev.alloc(DType::F32, 8)?, dev.alloc(DType::F32, 8)?, dev.alloc(DType::F32, 8)?);
    let momentum = SgdParams { momentum: 0.9, ..base };
    let f64_grad = dev.alloc(DType::F64, 8)?;
    let sgd = |params, param, grad, momentum_buf| s.sgd_step(params, SgdOperands { param, grad, momentum_buf });
    let e = sgd(momentum, p.view(), g.view(), None).unwrap_err();
    assert!(is_invalid(&e, "sgd_step"), "{e:?}");
    let e = sgd(base, p.slice(0, 4)?, p.slice(2, 4)?, None).unwrap_err();
    assert!(is_invalid(&e, "sgd_step"), "{e:?}");
    let e = sgd(momentum, p.view(), g.view(), Some(g.view())).unwrap_err();
    assert!(is_invalid(&e, "sgd_step"), "{e:?}");
    let e = sgd(base, p.view(), g.slice(0, 7)?, None).unwrap_err();
    assert!(is_invalid(&e, "sgd_step"), "{e:?}");
    let e = sgd(base, p.view(), f64_grad.view(), None).unwrap_err();
    assert!(matches!(e, DeviceError::DTypeMismatch { op: "sgd_step", .. }), "{e:?}");
    sgd(momentum, p.view(), g.view(), Some(m.view()))?;
    s.synchronize()?;
    Ok(())
}

/// A case of the device suite.
pub fn adamw_step_matches_pytorch_over_several_steps<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let configs = [
        AdamWParams { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, step: 1 },
        AdamWParams { lr: 1e-3, beta1: 0.8, beta2: 0.99, eps: 1e-6, weight_decay: 0.0, step: 1 },
        AdamWParams { lr: 0.1, beta1: 0.5, beta2: 0.9, eps: 1e-3, weight_decay: 0.1, step: 1 },
    ];
    let n = 29;
    for (ci, config) in configs.into_iter().enumerate() {
        let mut w = Lcg::new(1000 + ci as u64).values(DType::F32, n, -1.0, 1.0);
        let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
        let param = buffer::<B>(&dev, &s, DType::F32, &w)?;
        let (grad, exp_avg, exp_avg_sq) =
            (dev.alloc(DType::F32, n)?, dev.alloc(DType::F32, n)?, dev.alloc(DType::F32, n)?);
        for step in 1..=6u64 {
            let g = Lcg::new(1100 + 10 * ci as u64 + step).values(DType::F32, n, -1.0, 1.0);
            put(&s, grad.view(), &g)?;
            let p = AdamWParams { step, ..config };
            let operands = AdamWOperands {
                param: param.view(),
                grad: grad.view(),
                exp_avg: exp_avg.view(),
                exp_avg_sq: exp_avg_sq.view(),
            };
            s.adamw_step(p, operands)?;
            // torch.optim.AdamW, single tensor: decoupled decay, moment
            // updates, bias correction, eps outside the square root.
            let bc1 = 1.0 - p.beta1.powi(step as i32);
            let bc2 = 1.0 - p.beta2.powi(step as i32);
            for j in 0..n {
                w[j] *= 1.0 - p.lr * p.weight_decay;
                m[j] = p.beta1 * m[j] + (1.0 - p.beta1) * g[j];
                v[j] = p.beta2 * v[j] + (1.0 - p.beta2) * g[j] * g[j];
                let denom = v[j].sqrt() / bc2.sqrt() + p.eps;
                w[j] -= p.lr / bc1 * m[j] / denom;
            }
            let what = format!("adamw {config:?} step {step}");
            let tol = |x: &[f64]| x.iter().map(|x| 1e-7 + 1e-5 * x.abs()).collect::<Vec<_>>();
            let (tw, tm, tv) = (tol(&w), tol(&m), tol(&v));
            assert_close(&format!("{what} param"), &get(&s, param.view())?, &w, |j| tw[j]);
            assert_close(&format!("{what} exp_avg"), &get(&s, exp_avg.view())?, &m, |j| tm[j]);
            assert_close(&format!("{what} exp_avg_sq"), &get(&s, exp_avg_sq.view())?, &v, |j| tv[j]);
        }
    }

    let p = AdamWParams { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, step: 1 };
    let b = dev.alloc(DType::F32, 16)?;
    let (x, y, z) = (b.slice(0, 4)?, b.slice(4, 4)?, b.slice(8, 4)?);
    // Only the second moment varies: overlapping, short, of another dtype, right.
    let bf16_moment = dev.alloc(DType::BF16, 4)?;
    let adamw = |exp_avg_sq| s.adamw_step(p, AdamWOperands { param: x, grad: y, exp_avg: z, exp_avg_sq });
    let e = adamw(b.slice(10, 4)?).unwrap_err();
    assert!(is_invalid(&e, "adamw_step"), "{e:?}");
    let e = adamw(b.slice(12, 3)?).unwrap_err();
    assert!(is_invalid(&e, "adamw_step"), "{e:?}");
    let e = adamw(bf16_moment.view()).unwrap_err();
    assert!(matches!(e, DeviceError::DTypeMismatch { op: "adamw_step", .. }), "{e:?}");
    adamw(b.slice(12, 4)?)?;
    s.synchronize()?;
    Ok(())
}
