//! A device's data-movement operations (copy, host transfers, fill, cast,
//! scale, accumulate, axpy), its argument checking, and its memory
//! accounting, generic over the backend. Expected values are computed on the host in this file: IEEE
//! rounding written out in `common::round_to`, wrapping integer sums with
//! the standard library's `wrapping_add`.

use anyhow::{ensure, Result};
use chorus_devices::{
    bf16, f16, Buffer, ComputeBackend, DType, Device, DeviceError, ForeignBackend, MemoryStats, Scalar, Stream,
    StreamExt,
};

use crate::common::{assert_close, assert_same, encode, get, put, round_to, stream, unit_roundoff, Gate, Lcg, FLOATS};

/// Representable test values of any dtype: floats spread over [-100, 100),
/// integers over the dtype's whole range (i64 within ±2^53 so f64 holds them).
fn sample(dtype: DType, n: usize, seed: u64) -> Vec<f64> {
    let mut rng = Lcg::new(seed);
    let int = |rng: &mut Lcg, lo: i64, hi: i64| (lo + (rng.next_u64() % (hi - lo + 1) as u64) as i64) as f64;
    match dtype {
        DType::I8 => (0..n).map(|_| int(&mut rng, -128, 127)).collect(),
        DType::U8 => (0..n).map(|_| int(&mut rng, 0, 255)).collect(),
        DType::I32 => (0..n).map(|_| int(&mut rng, i32::MIN as i64, i32::MAX as i64)).collect(),
        DType::I64 => (0..n).map(|_| int(&mut rng, -(1 << 53), 1 << 53)).collect(),
        float => rng.values(float, n, -100.0, 100.0),
    }
}

fn is_invalid(e: &DeviceError, expected_op: &str) -> bool {
    matches!(e, DeviceError::InvalidArgument { op, .. } if *op == expected_op)
}

#[test]
fn the_reference_rounding_agrees_with_half_on_f32_inputs() {
    // `round_to` is the oracle of every cast test; check it against the f32
    // conversions of `half`, which see all of an f32's bits.
    let mut rng = Lcg::new(1);
    for _ in 0..20_000 {
        let bits = rng.next_u64() as u32;
        let v = f32::from_bits(bits);
        if v.is_nan() {
            continue;
        }
        let v = v as f64;
        assert_eq!(round_to(DType::F16, v).to_bits(), f16::from_f32(v as f32).to_f64().to_bits(), "f16 of {v:e}");
        assert_eq!(round_to(DType::BF16, v).to_bits(), bf16::from_f32(v as f32).to_f64().to_bits(), "bf16 of {v:e}");
    }
    // And on closed forms.
    let p = |e: i32| 2f64.powi(e);
    assert_eq!(round_to(DType::F16, 1.0 + p(-11)), 1.0);
    assert_eq!(round_to(DType::F16, 1.0 + p(-11) + p(-30)), 1.0 + p(-10));
    assert_eq!(round_to(DType::F16, 65520.0), f64::INFINITY);
    assert_eq!(round_to(DType::F16, 65519.0), 65504.0);
    assert_eq!(round_to(DType::F16, 3.0 * p(-25)), p(-23));
    assert_eq!(round_to(DType::BF16, 1.0 + p(-8) + p(-40)), 1.0 + p(-7));
    assert_eq!(round_to(DType::F32, 1.0 + p(-24) + p(-50)), 1.0 + p(-23));
    assert_eq!(round_to(DType::F32, 1e39), f64::INFINITY);
}

/// A case of the device suite.
pub fn copy_of_whole_buffers_and_sub_views_for_every_dtype<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        let values = sample(dtype, 16, 10 + i as u64);
        let background = sample(dtype, 16, 100 + i as u64);
        let (src, dst, part) = (dev.alloc(dtype, 16)?, dev.alloc(dtype, 16)?, dev.alloc(dtype, 16)?);
        put(&s, src.view(), &values)?;
        put(&s, part.view(), &background)?;

        s.copy(src.view(), dst.view())?;
        assert_same(&format!("{dtype} whole copy"), &get(&s, dst.view())?, &values);

        // Elements 3..8 of src into 10..15 of part; the rest of part is untouched.
        s.copy(src.slice(3, 5)?, part.slice(10, 5)?)?;
        let mut want = background.clone();
        want[10..15].copy_from_slice(&values[3..8]);
        assert_same(&format!("{dtype} sub-view copy"), &get(&s, part.view())?, &want);

        // A view of a view is relative to the inner view.
        let inner = src.view().slice(2, 10)?.slice(1, 3)?;
        assert_eq!((inner.offset(), inner.len()), (3, 3));
        assert_same(&format!("{dtype} nested view"), &get(&s, inner)?, &values[3..6]);
    }
    Ok(())
}

/// A case of the device suite.
pub fn copy_between_overlapping_ranges_of_one_buffer_reads_the_source_first<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let buf = dev.alloc(DType::F32, 10)?;
    let start: Vec<f64> = (0..10).map(f64::from).collect();
    put(&s, buf.view(), &start)?;
    s.copy(buf.slice(0, 6)?, buf.slice(2, 6)?)?;
    assert_same("forward overlap", &get(&s, buf.view())?, &[0., 1., 0., 1., 2., 3., 4., 5., 8., 9.]);
    put(&s, buf.view(), &start)?;
    s.copy(buf.slice(4, 6)?, buf.slice(1, 6)?)?;
    assert_same("backward overlap", &get(&s, buf.view())?, &[0., 4., 5., 6., 7., 8., 9., 7., 8., 9.]);
    Ok(())
}

/// A case of the device suite.
pub fn copy_from_host_captures_the_host_bytes_before_returning<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let buf = dev.alloc(DType::I32, 8)?;
    let values = [1., -2., 3., -4.];
    let gate = Gate::close(&s)?;
    let mut host = encode(DType::I32, &values)?;
    s.copy_from_host(&host, buf.slice(2, 4)?)?;
    // The copy has not run yet (the stream is held), yet overwriting the
    // host bytes must not change what arrives.
    host.fill(0xAB);
    gate.open();
    assert_same("staged upload", &get(&s, buf.view())?, &[0., 0., 1., -2., 3., -4., 0., 0.]);

    // A host slice of the wrong byte length is refused and changes nothing.
    let e = s.copy_from_host(&host[..15], buf.slice(2, 4)?).unwrap_err();
    assert!(is_invalid(&e, "copy_from_host"), "{e:?}");
    let e = s.copy_from_host(&host, buf.view()).unwrap_err();
    assert!(is_invalid(&e, "copy_from_host"), "{e:?}");
    assert_same("after refused uploads", &get(&s, buf.view())?, &[0., 0., 1., -2., 3., -4., 0., 0.]);
    Ok(())
}

/// A case of the device suite.
pub fn copy_to_host_completes_when_the_copy_has_run_in_stream_order<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let buf = dev.alloc(DType::F64, 4)?;
    put(&s, buf.view(), &[1.5, 2.5, 3.5, 4.5])?;
    s.synchronize()?;

    let gate = Gate::close(&s)?;
    let held = std::time::Instant::now();
    let readback = s.copy_to_host(buf.slice(1, 2)?)?;
    // Enqueued after the readback: must not be what the readback sees.
    s.fill(buf.view(), Scalar::Float(-1.0))?;
    assert_eq!((readback.dtype(), readback.len(), readback.is_empty()), (DType::F64, 2, false));
    // Enqueueing must not wait for the stream: a call that did would outlast
    // the gate's limit, and the gate would let the stream go.
    assert!(
        !readback.is_ready(),
        "the readback completed while its stream was held (enqueueing the readback and the fill took {:?})",
        held.elapsed()
    );
    gate.open();
    assert_eq!(readback.wait_typed::<f64>()?, vec![2.5, 3.5]);
    assert_eq!(s.read_vec::<f64>(buf.view())?, vec![-1.0; 4]);

    // A typed wait with the wrong element type is a dtype error.
    let e = s.copy_to_host(buf.view())?.wait_typed::<f32>().unwrap_err();
    assert!(matches!(e, DeviceError::DTypeMismatch { expected: DType::F64, found: DType::F32, .. }), "{e:?}");
    let e = s.read_vec::<i64>(buf.view()).unwrap_err();
    assert!(matches!(e, DeviceError::DTypeMismatch { .. }), "{e:?}");
    Ok(())
}

/// A case of the device suite.
pub fn fill_sets_every_element_of_the_view_for_every_dtype<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let cases = [
        (DType::F32, Scalar::Float(1.5), 1.5),
        (DType::F32, Scalar::Int(-3), -3.0),
        (DType::F64, Scalar::Float(-2.25), -2.25),
        (DType::F64, Scalar::Float(0.1), 0.1),
        (DType::F16, Scalar::Float(0.1), round_to(DType::F16, 0.1)),
        (DType::F16, Scalar::Int(2049), 2048.0),
        (DType::BF16, Scalar::Float(0.1), round_to(DType::BF16, 0.1)),
        (DType::BF16, Scalar::Int(-257), -256.0),
        (DType::I32, Scalar::Int(i32::MIN as i64), i32::MIN as f64),
        (DType::I32, Scalar::Float(3.0), 3.0),
        (DType::I64, Scalar::Int(-(1 << 40)), -(2f64.powi(40))),
        (DType::I8, Scalar::Int(-128), -128.0),
        (DType::I8, Scalar::Float(127.0), 127.0),
        (DType::U8, Scalar::Int(255), 255.0),
    ];
    for (dtype, value, want) in cases {
        let buf = dev.alloc(dtype, 12)?;
        s.fill(buf.slice(4, 5)?, value)?;
        let mut expected = vec![0.0; 12];
        expected[4..9].fill(want);
        assert_same(&format!("fill {dtype} with {value:?}"), &get(&s, buf.view())?, &expected);
        s.fill(buf.view(), value)?;
        assert_same(&format!("fill {dtype} with {value:?}"), &get(&s, buf.view())?, &[want; 12]);
    }
    // i64 extremes, which f64 cannot hold, read back typed.
    let buf = dev.alloc(DType::I64, 3)?;
    s.fill(buf.view(), Scalar::Int(i64::MAX))?;
    assert_eq!(s.read_vec::<i64>(buf.view())?, vec![i64::MAX; 3]);
    s.fill(buf.slice(1, 1)?, Scalar::Int(i64::MIN))?;
    assert_eq!(s.read_vec::<i64>(buf.view())?, vec![i64::MAX, i64::MIN, i64::MAX]);
    Ok(())
}

/// A case of the device suite.
pub fn fill_rounds_float_values_to_nearest_even<B: ComputeBackend>(make: &dyn Fn() -> Result<B::Device>) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let p = |e: i32| 2f64.powi(e);
    let cases = [
        (DType::F16, 1.0 + p(-11)),          // a tie: to even, down
        (DType::F16, 1.0 + 3.0 * p(-11)),    // a tie: to even, up
        (DType::F16, 1.0 + p(-11) + p(-30)), // just above a tie: up
        (DType::F16, 1.0 + p(-11) + p(-45)), // just above a tie, below f32's precision: up
        (DType::F16, 65519.0),               // below the overflow threshold: the max
        (DType::F16, 65520.0),               // at it: infinity
        (DType::F16, -3.0 * p(-25)),         // subnormal tie: to even
        (DType::F16, p(-25) + p(-40)),       // above the smallest subnormal's half: up
        (DType::BF16, 1.0 + p(-8)),          // a tie: down
        (DType::BF16, 1.0 + p(-8) + p(-30)), // just above a tie: up
        (DType::BF16, -(1.0 + 3.0 * p(-8))), // a tie: up in magnitude
        (DType::F32, 1.0 + p(-24)),          // a tie: down
        (DType::F32, 1.0 + p(-24) + p(-50)), // just above: up
        (DType::F32, 1e39),                  // overflow
    ];
    for (dtype, v) in cases {
        let buf = dev.alloc(dtype, 3)?;
        s.fill(buf.view(), Scalar::Float(v))?;
        assert_same(&format!("fill {dtype} with {v:e}"), &get(&s, buf.view())?, &[round_to(dtype, v); 3]);
    }
    Ok(())
}

/// A case of the device suite.
pub fn fill_with_a_value_out_of_the_dtype_range_is_refused_and_changes_nothing<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let cases = [
        (DType::I8, Scalar::Int(128)),
        (DType::I8, Scalar::Int(-129)),
        (DType::U8, Scalar::Int(-1)),
        (DType::U8, Scalar::Int(256)),
        (DType::U8, Scalar::Float(-1.0)),
        (DType::I32, Scalar::Int(1 << 31)),
        (DType::I32, Scalar::Int(-(1 << 31) - 1)),
        (DType::I32, Scalar::Float(0.5)),
        (DType::I32, Scalar::Float(f64::INFINITY)),
        (DType::I64, Scalar::Float(f64::NAN)),
        (DType::I64, Scalar::Float(1e300)),
    ];
    for (i, (dtype, value)) in cases.into_iter().enumerate() {
        let before = sample(dtype, 6, 40 + i as u64);
        let buf = dev.alloc(dtype, 6)?;
        put(&s, buf.view(), &before)?;
        let e = s.fill(buf.view(), value).unwrap_err();
        assert!(is_invalid(&e, "fill"), "fill {dtype} with {value:?}: {e:?}");
        assert_same(&format!("{dtype} after refused fill"), &get(&s, buf.view())?, &before);
    }
    s.synchronize()?;
    Ok(())
}

/// Values that probe rounding from every float dtype into every other:
/// ties and near-ties of each narrower format, overflow thresholds,
/// subnormals, signed zeros, infinities, NaN, and a random spread of magnitudes.
fn cast_probes() -> Vec<f64> {
    let p = |e: i32| 2f64.powi(e);
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        // f16 around 1: ties, sticky bits inside f32's precision and beyond it.
        1.0 + p(-11),
        1.0 + 3.0 * p(-11),
        1.0 + p(-11) + p(-23),
        1.0 + p(-11) + p(-30),
        1.0 + p(-11) + p(-45),
        -(1.0 + p(-11) + p(-45)),
        1.0 + p(-11) - p(-40),
        // bf16 around 1.
        1.0 + p(-8),
        1.0 + 3.0 * p(-8),
        1.0 + p(-8) + p(-23),
        1.0 + p(-8) + p(-40),
        -(1.0 + p(-8) + p(-50)),
        // f32 around 1.
        1.0 + p(-24),
        1.0 + 3.0 * p(-24),
        1.0 + p(-24) + p(-50),
        // Overflow thresholds.
        65504.0,
        65519.0,
        65520.0,
        65520.0 - p(-30),
        -65536.0,
        (2.0 - p(-7)) * p(127),          // bf16 max
        (2.0 - p(-8)) * p(127),          // bf16 max + half an ulp: overflows bf16 by the tie rule
        (2.0 - p(-8) - p(-30)) * p(127), // just below that: bf16 max
        (2.0 - p(-23)) * p(127),         // f32 max
        (2.0 - p(-24)) * p(127),         // f32 max + half an ulp: overflows f32
        1e39,
        -1e300,
        // Subnormals of each format.
        p(-24),
        p(-25),
        3.0 * p(-25),
        p(-25) + p(-40),
        -p(-26),
        p(-133),
        p(-134),
        3.0 * p(-134),
        p(-149),
        p(-150),
        p(-150) + p(-170),
        1e-300,
        // Decimal fractions, inexact everywhere.
        0.1,
        -1.0 / 3.0,
        std::f64::consts::PI * 1e4,
    ];
    let mut rng = Lcg::new(7);
    for e in -30..20 {
        let mantissa = rng.uniform(1.0, 2.0);
        let sign = if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
        v.push(sign * mantissa * p(e));
    }
    v
}

/// A case of the device suite.
pub fn cast_between_every_pair_of_float_dtypes_rounds_to_nearest_even<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let probes = cast_probes();
    for from in FLOATS {
        let values: Vec<f64> = probes.iter().map(|v| round_to(from, *v)).collect();
        let src = dev.alloc(from, values.len())?;
        put(&s, src.view(), &values)?;
        for to in FLOATS {
            let dst = dev.alloc(to, values.len())?;
            s.cast(src.view(), dst.view())?;
            let want: Vec<f64> = values.iter().map(|v| round_to(to, *v)).collect();
            assert_same(&format!("cast {from} -> {to}"), &get(&s, dst.view())?, &want);
        }
    }
    // The f32 -> bf16 / f16 results are those of `half`'s f32 conversions.
    let values: Vec<f32> = Lcg::new(3).values(DType::F32, 257, -1e5, 1e5).iter().map(|v| *v as f32).collect();
    let src = s.buffer_from(&values)?;
    let (b, h) = (s.alloc(DType::BF16, values.len())?, s.alloc(DType::F16, values.len())?);
    s.cast(src.view(), b.view())?;
    s.cast(src.view(), h.view())?;
    assert_eq!(s.read_vec::<bf16>(b.view())?, values.iter().map(|v| bf16::from_f32(*v)).collect::<Vec<_>>());
    assert_eq!(s.read_vec::<f16>(h.view())?, values.iter().map(|v| f16::from_f32(*v)).collect::<Vec<_>>());
    Ok(())
}

/// A case of the device suite.
pub fn cast_of_a_sub_view_writes_only_that_range<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let src = s.buffer_from(&[1.25f64, 2.5, 3.75, 5.0, 6.25])?;
    let dst = s.buffer_from(&[f16::from_f32(-1.0); 6])?;
    s.cast(src.slice(1, 3)?, dst.slice(2, 3)?)?;
    assert_same("partial cast", &get(&s, dst.view())?, &[-1.0, -1.0, 2.5, 3.75, 5.0, -1.0]);
    Ok(())
}

/// A case of the device suite.
pub fn cast_refuses_integer_dtypes_and_length_mismatches<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let f = dev.alloc(DType::F32, 4)?;
    for int in [DType::I32, DType::I64, DType::I8, DType::U8] {
        let i = dev.alloc(int, 4)?;
        let e = s.cast(i.view(), f.view()).unwrap_err();
        assert!(is_invalid(&e, "cast"), "{int} -> f32: {e:?}");
        let e = s.cast(f.view(), i.view()).unwrap_err();
        assert!(is_invalid(&e, "cast"), "f32 -> {int}: {e:?}");
    }
    let g = dev.alloc(DType::F16, 5)?;
    let e = s.cast(f.view(), g.view()).unwrap_err();
    assert!(is_invalid(&e, "cast"), "{e:?}");
    s.synchronize()?;
    Ok(())
}

/// A case of the device suite.
pub fn scale_multiplies_in_the_dtype_opmath_and_rounds_once<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    for (i, dtype) in FLOATS.into_iter().enumerate() {
        for alpha in [0.5, -3.0, 0.1, 1e-3, 0.0] {
            let x = Lcg::new(20 + i as u64).values(dtype, 33, -50.0, 50.0);
            let buf = dev.alloc(dtype, x.len())?;
            put(&s, buf.view(), &x)?;
            s.scale(buf.slice(1, 31)?, alpha)?;
            // f16/bf16 compute in f32: alpha and the product are f32 values,
            // then the product is rounded to the dtype. Products of two f32s
            // are exact in f64, so `round_to` is a single rounding each time.
            let want: Vec<f64> = x
                .iter()
                .enumerate()
                .map(|(j, v)| {
                    if j == 0 || j == 32 {
                        return *v;
                    }
                    match dtype {
                        DType::F64 => v * alpha,
                        _ => round_to(dtype, round_to(DType::F32, v * round_to(DType::F32, alpha))),
                    }
                })
                .collect();
            assert_same(&format!("scale {dtype} by {alpha}"), &get(&s, buf.view())?, &want);
        }
    }
    for int in [DType::I32, DType::I64, DType::I8, DType::U8] {
        let e = s.scale(dev.alloc(int, 3)?.view(), 2.0).unwrap_err();
        assert!(is_invalid(&e, "scale"), "{int}: {e:?}");
    }
    Ok(())
}

/// A case of the device suite.
pub fn accumulate_of_same_dtype_floats_rounds_the_sum_once<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    for (i, dtype) in FLOATS.into_iter().enumerate() {
        let a = Lcg::new(50 + i as u64).values(dtype, 40, -100.0, 100.0);
        let b = Lcg::new(60 + i as u64).values(dtype, 40, -100.0, 100.0);
        let (src, dst) = (dev.alloc(dtype, 40)?, dev.alloc(dtype, 40)?);
        put(&s, src.view(), &a)?;
        put(&s, dst.view(), &b)?;
        s.accumulate(src.view(), dst.view())?;
        // Sums of two values of these dtypes in this range are exact in f64.
        let want: Vec<f64> = a
            .iter()
            .zip(&b)
            .map(|(x, y)| if dtype == DType::F64 { x + y } else { round_to(dtype, round_to(DType::F32, x + y)) })
            .collect();
        assert_same(&format!("accumulate {dtype}"), &get(&s, dst.view())?, &want);
    }
    Ok(())
}

/// A case of the device suite.
pub fn accumulate_of_integers_wraps_like_twos_complement<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;

    let (a, b) = ([100i8, -128, 127, -1, 5, 0], [100i8, -1, 1, -128, -5, -128]);
    let (src, dst) = (s.buffer_from(&a)?, s.buffer_from(&b)?);
    s.accumulate(src.view(), dst.view())?;
    let want: Vec<i8> = a.iter().zip(&b).map(|(x, y)| y.wrapping_add(*x)).collect();
    assert_eq!(s.read_vec::<i8>(dst.view())?, want);
    assert_eq!(want, vec![-56, 127, -128, 127, 0, -128]);

    let (a, b) = ([250u8, 255, 0, 128, 1], [10u8, 1, 0, 128, 254]);
    let (src, dst) = (s.buffer_from(&a)?, s.buffer_from(&b)?);
    s.accumulate(src.view(), dst.view())?;
    assert_eq!(s.read_vec::<u8>(dst.view())?, a.iter().zip(&b).map(|(x, y)| y.wrapping_add(*x)).collect::<Vec<_>>());

    let (a, b) = ([i32::MAX, i32::MIN, 7, -5], [1i32, -1, -7, i32::MIN]);
    let (src, dst) = (s.buffer_from(&a)?, s.buffer_from(&b)?);
    s.accumulate(src.view(), dst.view())?;
    assert_eq!(s.read_vec::<i32>(dst.view())?, a.iter().zip(&b).map(|(x, y)| y.wrapping_add(*x)).collect::<Vec<_>>());

    let (a, b) = ([i64::MAX, i64::MIN, 1 << 40, 3], [1i64, -1, 3, i64::MAX]);
    let (src, dst) = (s.buffer_from(&a)?, s.buffer_from(&b)?);
    s.accumulate(src.view(), dst.view())?;
    assert_eq!(s.read_vec::<i64>(dst.view())?, a.iter().zip(&b).map(|(x, y)| y.wrapping_add(*x)).collect::<Vec<_>>());

    // Sub-views: only the destination range changes.
    let src = s.buffer_from(&[1i32, 2, 3, 4])?;
    let dst = s.buffer_from(&[10i32, 20, 30, 40])?;
    s.accumulate(src.slice(0, 2)?, dst.slice(2, 2)?)?;
    assert_eq!(s.read_vec::<i32>(dst.view())?, vec![10, 20, 31, 42]);
    Ok(())
}

/// A case of the device suite.
pub fn accumulate_widens_f16_and_bf16_into_f32<B: ComputeBackend>(make: &dyn Fn() -> Result<B::Device>) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    for (i, half_dtype) in [DType::F16, DType::BF16].into_iter().enumerate() {
        let a = Lcg::new(70 + i as u64).values(half_dtype, 50, -1000.0, 1000.0);
        let b = Lcg::new(80 + i as u64).values(DType::F32, 50, -1.0, 1.0);
        let (src, dst) = (dev.alloc(half_dtype, 50)?, dev.alloc(DType::F32, 50)?);
        put(&s, src.view(), &a)?;
        put(&s, dst.view(), &b)?;
        s.accumulate(src.view(), dst.view())?;
        // The widening is exact; the f32 sum (exact in f64) is rounded once.
        let want: Vec<f64> = a.iter().zip(&b).map(|(x, y)| round_to(DType::F32, x + y)).collect();
        assert_same(&format!("accumulate {half_dtype} into f32"), &get(&s, dst.view())?, &want);
    }
    Ok(())
}

/// A case of the device suite.
pub fn accumulate_refuses_mixed_integer_dtypes_and_length_mismatches<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let pairs = [(DType::I32, DType::F32), (DType::F32, DType::I32), (DType::I8, DType::I32), (DType::U8, DType::I8)];
    for (src_dtype, dst_dtype) in pairs {
        let (src, dst) = (dev.alloc(src_dtype, 4)?, dev.alloc(dst_dtype, 4)?);
        let e = s.accumulate(src.view(), dst.view()).unwrap_err();
        assert!(
            matches!(e, DeviceError::DTypeMismatch { op: "accumulate", .. }),
            "{src_dtype} into {dst_dtype}: {e:?}"
        );
    }
    let (src, dst) = (dev.alloc(DType::F32, 4)?, dev.alloc(DType::F32, 5)?);
    let e = s.accumulate(src.view(), dst.view()).unwrap_err();
    assert!(is_invalid(&e, "accumulate"), "{e:?}");
    s.synchronize()?;
    Ok(())
}

/// A case of the device suite.
pub fn axpy_adds_a_scaled_vector_of_any_float_dtype<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let pairs = [
        (DType::F32, DType::F32),
        (DType::BF16, DType::F32),
        (DType::F16, DType::F32),
        (DType::F64, DType::F64),
        (DType::F32, DType::F64),
        (DType::F32, DType::BF16),
        (DType::F16, DType::F16),
    ];
    for (i, (x_dtype, y_dtype)) in pairs.into_iter().enumerate() {
        for alpha in [0.75, -0.1, 3.0] {
            let x = Lcg::new(90 + i as u64).values(x_dtype, 30, -10.0, 10.0);
            let y = Lcg::new(95 + i as u64).values(y_dtype, 30, -10.0, 10.0);
            let (xb, yb) = (dev.alloc(x_dtype, 30)?, dev.alloc(y_dtype, 30)?);
            put(&s, xb.view(), &x)?;
            put(&s, yb.view(), &y)?;
            s.axpy(alpha, xb.view(), yb.view())?;
            let want: Vec<f64> = x.iter().zip(&y).map(|(x, y)| y + alpha * x).collect();
            // Computed in y's opmath (f32, or f64 for f64): a rounded alpha,
            // a rounded product and a rounded sum, then y's own rounding.
            let opmath = if y_dtype == DType::F64 { DType::F64 } else { DType::F32 };
            let u = unit_roundoff(opmath);
            let tol = |j: usize| {
                let (ax, yv) = ((alpha * x[j]).abs(), y[j].abs());
                3.0 * u * (ax + yv) + unit_roundoff(y_dtype) * want[j].abs() * 1.0001
            };
            assert_close(&format!("axpy {x_dtype} into {y_dtype} alpha {alpha}"), &get(&s, yb.view())?, &want, tol);
        }
    }
    let (i, f) = (dev.alloc(DType::I32, 3)?, dev.alloc(DType::F32, 3)?);
    for (x, y) in [(&i, &f), (&f, &i)] {
        let e = s.axpy(1.0, x.view(), y.view()).unwrap_err();
        assert!(is_invalid(&e, "axpy"), "{e:?}");
    }
    let e = s.axpy(1.0, f.view(), dev.alloc(DType::F32, 4)?.view()).unwrap_err();
    assert!(is_invalid(&e, "axpy"), "{e:?}");
    Ok(())
}

/// A case of the device suite.
pub fn views_out_of_range_are_errors<B: ComputeBackend>(make: &dyn Fn() -> Result<B::Device>) -> Result<()> {
    let dev = make()?;
    let buf = dev.alloc(DType::F32, 9)?;
    for (offset, len) in [(5, 10), (10, 0), (0, 10), (usize::MAX, 2), (2, usize::MAX)] {
        let e = buf.slice(offset, len).unwrap_err();
        assert!(is_invalid(&e, "slice"), "slice({offset}, {len}): {e:?}");
    }
    let e = buf.slice(2, 5)?.slice(3, 3).unwrap_err();
    assert!(is_invalid(&e, "slice"), "{e:?}");
    // The edges themselves are fine.
    assert!(buf.slice(9, 0)?.is_empty());
    assert_eq!(buf.slice(0, 9)?.len(), 9);

    let third = buf.view().chunk(1, 3)?;
    assert_eq!((third.offset(), third.len(), third.byte_range()), (3, 3, 12..24));
    for (index, parts) in [(3, 3), (0, 4), (0, 0)] {
        let e = buf.view().chunk(index, parts).unwrap_err();
        assert!(is_invalid(&e, "chunk"), "chunk({index}, {parts}): {e:?}");
    }
    Ok(())
}

/// A case of the device suite.
pub fn argument_errors_are_typed_and_enqueue_nothing<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let (s, other_stream) = (stream(&dev)?, stream(&dev)?);
    let a = s.buffer_from(&[1.0f32, 2.0, 3.0, 4.0])?;
    let wide = s.buffer_from(&[1.0f64, 2.0, 3.0, 4.0])?;
    let short = s.buffer_from(&[9.0f32; 3])?;
    s.synchronize()?;

    let e = s.copy(wide.view(), a.view()).unwrap_err();
    assert!(matches!(e, DeviceError::DTypeMismatch { op: "copy", expected: DType::F32, found: DType::F64 }), "{e:?}");
    let e = s.copy(short.view(), a.view()).unwrap_err();
    assert!(is_invalid(&e, "copy"), "{e:?}");
    let e = s.upload(&[1.0f64; 4], a.view()).unwrap_err();
    assert!(matches!(e, DeviceError::DTypeMismatch { op: "upload", .. }), "{e:?}");
    let e = s.upload(&[1.0f32; 5], a.view()).unwrap_err();
    assert!(is_invalid(&e, "copy_from_host"), "{e:?}");

    // Nothing was enqueued: the data is as it was, the stream is healthy,
    // and the sanitizer recorded no access on `s`, so another stream may
    // write `a` without waiting for `s`.
    assert_eq!(s.read_vec::<f32>(a.view())?, vec![1.0, 2.0, 3.0, 4.0]);
    s.synchronize()?;
    let e = s.copy(short.view(), a.view()).unwrap_err();
    assert!(is_invalid(&e, "copy"), "{e:?}");
    other_stream.fill(a.view(), Scalar::Float(5.0))?;
    assert_eq!(other_stream.read_vec::<f32>(a.view())?, vec![5.0; 4]);
    Ok(())
}

/// A case of the device suite.
pub fn views_events_and_buffers_of_another_device_are_refused<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let (dev, elsewhere) = (make()?, make()?);
    let (s, t) = (stream(&dev)?, stream(&elsewhere)?);
    let mine = s.buffer_from(&[1.0f32; 4])?;
    let theirs = t.buffer_from(&[2.0f32; 4])?;
    s.synchronize()?;
    t.synchronize()?;

    let e = s.copy(theirs.view(), mine.view()).unwrap_err();
    assert!(is_invalid(&e, "copy"), "{e:?}");
    let e = s.copy(mine.view(), theirs.view()).unwrap_err();
    assert!(is_invalid(&e, "copy"), "{e:?}");
    let e = s.fill(theirs.view(), Scalar::Float(0.0)).unwrap_err();
    assert!(is_invalid(&e, "fill"), "{e:?}");
    let e = s.copy_to_host(theirs.view()).unwrap_err();
    assert!(is_invalid(&e, "copy_to_host"), "{e:?}");
    let e = s.copy_from_host(&[0u8; 16], theirs.view()).unwrap_err();
    assert!(is_invalid(&e, "copy_from_host"), "{e:?}");
    let e = s.scale(theirs.view(), 2.0).unwrap_err();
    assert!(is_invalid(&e, "scale"), "{e:?}");
    let e = s.accumulate(mine.view(), theirs.view()).unwrap_err();
    assert!(is_invalid(&e, "accumulate"), "{e:?}");
    let their_event = elsewhere.create_event()?;
    let e = s.record(&their_event).unwrap_err();
    assert!(is_invalid(&e, "record"), "{e:?}");
    t.record(&their_event)?;
    let e = s.wait(&their_event).unwrap_err();
    assert!(is_invalid(&e, "wait"), "{e:?}");

    assert_eq!(t.read_vec::<f32>(theirs.view())?, vec![2.0; 4]);
    assert_eq!(s.read_vec::<f32>(mine.view())?, vec![1.0; 4]);
    s.synchronize()?;
    Ok(())
}

/// A case of the device suite.
pub fn memory_statistics_are_exact<B: ComputeBackend>(make: &dyn Fn() -> Result<B::Device>) -> Result<()> {
    let dev = make()?;
    let stats = |in_use, peak, live| MemoryStats { bytes_in_use: in_use, peak_bytes: peak, live_allocations: live };
    assert_eq!(dev.memory_stats(), stats(0, 0, 0));

    let a = dev.alloc(DType::F32, 1000)?;
    assert_eq!(dev.memory_stats(), stats(4000, 4000, 1));
    let b = dev.alloc(DType::BF16, 3)?;
    assert_eq!(dev.memory_stats(), stats(4006, 4006, 2));
    // Streams, events and views own no device memory.
    let s = stream(&dev)?;
    let _event = dev.create_event()?;
    let _view = a.slice(10, 20)?;
    assert_eq!(dev.memory_stats(), stats(4006, 4006, 2));
    // A stream-ordered allocation is counted when it is made.
    let c = s.alloc(DType::I64, 10)?;
    assert_eq!(dev.memory_stats(), stats(4086, 4086, 3));
    s.synchronize()?;

    drop(a);
    assert_eq!(dev.memory_stats(), stats(86, 4086, 2));
    dev.reset_peak_memory();
    assert_eq!(dev.memory_stats(), stats(86, 86, 2));
    let d = dev.alloc(DType::U8, 5)?;
    assert_eq!(dev.memory_stats(), stats(91, 91, 3));
    drop((b, c));
    assert_eq!(dev.memory_stats(), stats(5, 91, 1));
    drop(d);
    assert_eq!(dev.memory_stats(), stats(0, 91, 0));
    dev.reset_peak_memory();
    assert_eq!(dev.memory_stats(), stats(0, 0, 0));

    // Another device keeps its own counters.
    let other = make()?;
    let _x = other.alloc(DType::F64, 8)?;
    assert_eq!(other.memory_stats(), stats(64, 64, 1));
    assert_eq!(dev.memory_stats(), stats(0, 0, 0));
    Ok(())
}

/// A case of the device suite.
pub fn dropping_buffers_with_queued_work_frees_them_after_the_work<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let n = 1 << 16;
    let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let bytes = n * 4;

    let gate = Gate::close(&s)?;
    let src = s.buffer_from(&values)?;
    let dst = s.alloc(DType::F32, n)?;
    s.copy(src.view(), dst.view())?;
    s.scale(dst.view(), 2.0)?;
    let readback = s.copy_to_host(dst.view())?;
    drop(src);
    drop(dst);
    // In stream-ordered terms the memory is free once the handles are gone;
    // the queued jobs still hold the bytes, so they run on valid memory.
    let held = dev.memory_stats();
    assert_eq!((held.bytes_in_use, held.live_allocations), (0, 0));

    gate.open();
    let got = readback.wait_typed::<f32>()?;
    assert_eq!(got, values.iter().map(|v| v * 2.0).collect::<Vec<_>>());
    s.synchronize()?;
    let after = dev.memory_stats();
    assert_eq!((after.bytes_in_use, after.live_allocations, after.peak_bytes), (0, 0, 2 * bytes));
    Ok(())
}

/// A case of the device suite: a host function launched on a stream that
/// has failed (from another thread, as a collective's watchdog fails one)
/// still runs after the work enqueued before it, told of the failure. A GPU
/// device's readbacks and staged copies return their pinned blocks to a
/// pool from such functions: run at once instead, they would hand a block
/// to the next copy while the queued one still writes it (issue 35).
pub fn a_host_function_on_a_failed_stream_runs_after_the_work_before_it<B: ComputeBackend + ForeignBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let gate = Gate::close(&s)?;
    let failure = DeviceError::InvalidArgument { op: "test", reason: "the stream failed from another thread".into() };
    B::failure_handle(&s).fail(0, failure);
    let (tx, rx) = std::sync::mpsc::channel();
    s.launch_host_fn(Box::new(move |outcome| {
        let _ = tx.send(outcome.is_err());
    }))?;
    let early = rx.recv_timeout(std::time::Duration::from_millis(300));
    ensure!(early.is_err(), "the host function ran before the work queued before it (told {early:?})");
    gate.open();
    let told_failure = rx.recv_timeout(std::time::Duration::from_secs(20))?;
    ensure!(told_failure, "the host function was not told of the failure");
    ensure!(s.synchronize().is_err(), "the failed stream synchronized without an error");
    Ok(())
}
