//! Float8 all-gather (torchao's `enable_fsdp_float8_all_gather`): the
//! parameters FSDP gathers as float8 arrive as `dequant(quant(full))` with
//! the scale of the whole parameter's amax, bit for bit; the others arrive
//! exactly in the param dtype; the all-gathers send half the bytes of bf16;
//! the backends move float8 but refuse to reduce it; and training with it
//! stays close to bf16 training (docs/fsdp.md, "Float8 all-gather").
//!
//! The expected values come from `torchao_float8`, a second, plainly
//! written implementation of torchao's recipe (the e4m3fn grid enumerated
//! from its definition, the nearest point taken by search), not from the
//! implementation's own conversions, so a wrong rounding or scale in
//! `chorus_devices` fails these cases in every CI run. Its own unit tests
//! check it against values worked out by hand.

use anyhow::{anyhow, ensure};
use chorus_collectives::backend::OpKind;
use chorus_collectives::{CommBackend, CommError, ReduceOp};
use chorus_devices::{bf16, Buffer, ComputeBackend, DType, Device, Element, Float8E4M3, Stream, StreamExt};
use chorus_fsdp::{gathers_as_float8, DataParallel, Fsdp, FsdpConfig, FsdpError, MixedPrecision, ParamInit};
use chorus_train::rng::SplitMix;

use super::{counted, max_diff, own_world, sgd, train_fsdp, train_reference, Setup};
use crate::{Case, Failure, RankCtx};

/// Mixed precision with the float8 all-gather on (or off) over `param`.
fn mp(param: DType, float8: bool) -> MixedPrecision {
    MixedPrecision {
        param_dtype: Some(param),
        reduce_dtype: Some(DType::F32),
        output_dtype: None,
        all_gather_dtype: float8.then_some(DType::F8E4M3),
    }
}

/// A parameter of `shape` with values uniform in ±`magnitude` (so each
/// parameter has its own amax; some beyond 448, some far below 1).
fn param(name: &str, shape: &[usize], magnitude: f32, seed: u64) -> ParamInit {
    let n: usize = shape.iter().product();
    let mut rng = SplitMix::new(seed);
    ParamInit {
        name: name.into(),
        shape: shape.to_vec(),
        values: (0..n).map(|_| rng.uniform(-1.0, 1.0) * magnitude).collect(),
    }
}

/// The group of the gather cases: float8 matrices (uneven rows, so trailing
/// ranks hold padding) mixed with a vector and a thin matrix that stay in
/// the param dtype.
fn mixed_group() -> Vec<ParamInit> {
    vec![
        param("w1", &[37, 64], 0.02, 1),
        param("b1", &[64], 3.0, 2),
        param("w2", &[33, 16], 700.0, 3),
        param("w3", &[5, 33], 1.5, 4),
        param("w4", &[16, 16], 1e-3, 5),
    ]
}

/// torchao's float8 recipe (`torchao/float8/float8_utils.py`), written
/// out plainly and apart from `chorus_devices::Float8E4M3`:
/// `amax_to_scale` (448 / max(amax, 1e-12) in float64, then float32),
/// `to_fp8_saturated` (x · scale in float32, clamped to ±448, rounded to
/// the nearest float8_e4m3fn value, ties to the even code) and the
/// dequantization FSDP applies after the gather (the float8 value, as
/// float32, divided by the scale in float32).
mod torchao_float8 {
    /// float8_e4m3fn's largest finite value.
    pub const MAX: f64 = 448.0;

    /// Every finite non-negative e4m3fn value with its code, ascending:
    /// exponent bits e (bias 7) and mantissa bits m give m/8 · 2^-6 for e = 0
    /// (subnormals), (1 + m/8) · 2^(e-7) otherwise; e = 15, m = 7 is NaN.
    fn grid() -> Vec<(f64, u8)> {
        let mut g = Vec::new();
        for e in 0..16u8 {
            for m in 0..8u8 {
                if (e, m) == (15, 7) {
                    continue;
                }
                let v = if e == 0 { m as f64 / 8.0 / 64.0 } else { (1.0 + m as f64 / 8.0) * 2f64.powi(e as i32 - 7) };
                g.push((v, (e << 3) | m));
            }
        }
        g
    }

    /// `x` rounded to the nearest e4m3fn value, ties to the even code,
    /// saturated to ±448 (NaN stays NaN), as a float.
    pub fn round(x: f32) -> f32 {
        if x.is_nan() {
            return f32::NAN;
        }
        let a = (x.abs() as f64).min(MAX);
        let g = grid();
        let mut best = g[0];
        for &p in &g {
            let (d_best, d_p) = ((best.0 - a).abs(), (p.0 - a).abs());
            if d_p < d_best || (d_p == d_best && p.1 % 2 == 0 && best.1 % 2 == 1) {
                best = p;
            }
        }
        let v = best.0 as f32;
        if x < 0.0 {
            -v
        } else {
            v
        }
    }

    /// `amax_to_scale` for float8_e4m3fn.
    pub fn scale(amax: f32) -> f32 {
        (MAX / (amax as f64).max(1e-12)) as f32
    }

    /// What the gather delivers for a parameter whose full values are
    /// `values`: each quantized with the whole parameter's scale, then
    /// dequantized.
    pub fn quantize_dequantize(values: &[f32]) -> Vec<f32> {
        let amax = values.iter().fold(0.0f32, |m, v| if v.abs() > m { v.abs() } else { m });
        let s = scale(amax);
        values.iter().map(|v| round(v * s) / s).collect()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// Values worked out by hand from the format: steps of 1/8 in [1, 2),
        /// of 2^-9 among the subnormals, ties to the even mantissa, saturation.
        #[test]
        fn rounds_as_e4m3fn_is_defined() {
            assert_eq!(grid().len(), 127, "127 finite non-negative values (0x7f is NaN)");
            for (x, want) in [
                (1.0625f32, 1.0f32), // halfway 1.0 (m = 0) and 1.125 (m = 1): even
                (1.1875, 1.25),      // halfway 1.125 (m = 1) and 1.25 (m = 2): even
                (1.07, 1.125),
                (-3.3, -3.25), // steps of 0.25 in [2, 4)
                (448.0, 448.0),
                (464.0, 448.0), // saturated, not rounded up to 480
                (1e9, 448.0),
                (-1e9, -448.0),
                (0.001953125, 0.001953125), // 2^-9, the least subnormal
                (0.0009765625, 0.0),        // 2^-10: halfway 0 and 2^-9, to the even 0
                (0.0029296875, 0.00390625), // 3 · 2^-10: halfway 2^-9 (m = 1) and 2^-8 (m = 2)
                (0.015625, 0.015625),       // 2^-6, the least normal
            ] {
                assert_eq!(round(x), want, "{x}");
            }
            assert!(round(f32::NAN).is_nan());
            assert_eq!(scale(448.0), 1.0);
            assert_eq!(scale(0.0), (448.0f64 / 1e-12) as f32);
            // amax 700: scale 0.64; 700 · 0.64 = 448 back to 700 (within f32 rounding), 1 · 0.64 rounds to 0.625.
            let q = quantize_dequantize(&[700.0, 1.0, -700.0]);
            assert!((q[0] - 700.0).abs() < 1e-3 && (q[1] - 0.625 / 0.64).abs() < 1e-6 && q[2] == -q[0], "{q:?}");
        }
    }
}

/// What the float8 all-gather must deliver for a parameter with these full
/// values: torchao's recipe on the whole parameter ([`torchao_float8`]), or
/// the values in the param dtype.
fn expected<T: Element>(values: &[f32], float8: bool) -> Vec<T> {
    let values = if float8 { torchao_float8::quantize_dequantize(values) } else { values.to_vec() };
    values.iter().map(|v| T::from_f64(*v as f64)).collect()
}

/// The first element of `got` whose bits differ from `want`.
fn first_difference<T: Element>(got: &[T], want: &[T]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} elements, expected {}", got.len(), want.len()));
    }
    let i = got.iter().zip(want).position(|(a, b)| a.to_f64().to_bits() != b.to_f64().to_bits())?;
    Some(format!("[{i}] = {:?}, expected {:?}", got[i], want[i]))
}

/// Unshards `params` as one group under `mixed` and checks every gathered
/// parameter; returns this rank's all-gather bytes and its (all-reduce calls, bytes).
fn gather_and_check<C: CommBackend, T: Element>(
    ctx: &RankCtx<'_, C>,
    params: Vec<ParamInit>,
    mixed: MixedPrecision,
) -> Result<(usize, (usize, usize)), Failure>
where
    C::B: ComputeBackend,
{
    let n = ctx.size();
    let (world, counts) = counted(ctx)?;
    let config = FsdpConfig { mixed_precision: mixed, ..FsdpConfig::default() };
    let mut fsdp = Fsdp::new(DataParallel::fsdp(world), config)?;
    let full: Vec<(String, Vec<usize>, Vec<f32>)> =
        params.iter().map(|p| (p.name.clone(), p.shape.clone(), p.values.clone())).collect();
    let g = fsdp.add_group("g", params, false)?;
    counts.clear();
    fsdp.pre_forward(g)?;
    for (i, (name, shape, values)) in full.iter().enumerate() {
        let got: Vec<T> = fsdp.compute_stream().read_vec(fsdp.param(g, i)?)?;
        let want = expected::<T>(values, mixed.float8_all_gather() && gathers_as_float8(shape));
        if let Some(d) = first_difference(&got, &want) {
            return Err(anyhow!("{name} {shape:?} in {}: {d}", T::DTYPE));
        }
    }
    fsdp.post_forward(g)?;
    fsdp.synchronize()?;
    let all_reduce = (counts.get(OpKind::AllReduce, n), counts.bytes(OpKind::AllReduce, n));
    Ok((counts.bytes(OpKind::AllGather, n), all_reduce))
}

/// Bytes of one rank's padded shard of `shape` in `dtype` (sharded on dim 0).
fn shard_bytes(shape: &[usize], world: usize, dtype: DType) -> usize {
    shape[0].div_ceil(world) * shape[1..].iter().product::<usize>() * dtype.size()
}

fn gather_case<C: CommBackend, T: Element>() -> Case<C>
where
    C::B: ComputeBackend,
{
    let name = format!("fsdp/float8/gather-equals-dequantized-global-quantization/{}", T::DTYPE);
    Case::new(name, |ctx: &RankCtx<'_, C>| {
        let n = ctx.size();
        let (gathered, (all_reduces, amax_bytes)) = gather_and_check::<C, T>(ctx, mixed_group(), mp(T::DTYPE, true))?;
        // One all-reduce of the group's three amaxes; float8 matrices at one
        // byte per element, the rest in the param dtype.
        ensure!((all_reduces, amax_bytes) == (1, 3 * 4), "amax all-reduces: {all_reduces} of {amax_bytes} B");
        let want: usize = mixed_group()
            .iter()
            .map(|p| {
                let d = if gathers_as_float8(&p.shape) { DType::F8E4M3 } else { T::DTYPE };
                shard_bytes(&p.shape, n, d)
            })
            .sum();
        ensure!(gathered == want, "all-gathers sent {gathered} B, expected {want} B");
        // Without the option the same group gathers exactly in the param dtype.
        gather_and_check::<C, T>(ctx, mixed_group(), mp(T::DTYPE, false))?;
        Ok(())
    })
}

fn bytes_halve_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/float8/all-gather-bytes-halve-against-bf16", |ctx: &RankCtx<'_, C>| {
        let matrices =
            || vec![param("a", &[64, 48], 1.0, 11), param("b", &[96, 64], 0.1, 12), param("c", &[50, 16], 9.0, 13)];
        let (f8, _) = gather_and_check::<C, bf16>(ctx, matrices(), mp(DType::BF16, true))?;
        let (plain, (all_reduces, _)) = gather_and_check::<C, bf16>(ctx, matrices(), mp(DType::BF16, false))?;
        ensure!(all_reduces == 0, "bf16 all-gather issued {all_reduces} all-reduces");
        ensure!(2 * f8 == plain, "float8 all-gathers sent {f8} B, bf16 ones {plain} B: not half");
        Ok(())
    })
}

/// The backend moves float8 as bytes (an all-gather of codes that are NaN,
/// ±448 and subnormals arrives intact) and refuses to reduce it; FSDP
/// refuses float8 as a compute dtype.
fn movement_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/float8/moved-as-bytes-never-reduced", |ctx: &RankCtx<'_, C>| {
        let world = own_world(ctx)?;
        let (n, r) = (world.size(), world.rank());
        let s = ctx.device().create_stream(chorus_devices::Priority::Normal)?;
        let codes = |rank: usize| -> Vec<Float8E4M3> {
            (0..256).map(|k| Float8E4M3(((k * 7 + rank * 13) % 256) as u8)).collect()
        };
        let buf = s.alloc(DType::F8E4M3, 256 * n)?;
        s.upload(&codes(r), buf.slice(r * 256, 256)?)?;
        world.all_gather_in_place(buf.view(), &s)?;
        let got: Vec<Float8E4M3> = s.read_vec(buf.view())?;
        let want: Vec<Float8E4M3> = (0..n).flat_map(codes).collect();
        ensure!(got.iter().map(|c| c.0).eq(want.iter().map(|c| c.0)), "float8 all-gather changed bytes");
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            match world.all_reduce_in_place(buf.slice(0, 256)?, op, &s) {
                Err(CommError::InvalidArgument { .. }) => {}
                other => return Err(anyhow!("all_reduce {op:?} of float8: expected InvalidArgument, got {other:?}")),
            }
        }
        let bad = MixedPrecision { param_dtype: Some(DType::F8E4M3), ..MixedPrecision::default() };
        match Fsdp::new(DataParallel::fsdp(world.clone()), FsdpConfig { mixed_precision: bad, ..FsdpConfig::default() })
        {
            Err(FsdpError::InvalidArgument(_)) => {}
            Err(e) => return Err(anyhow!("float8 param dtype: expected InvalidArgument, got {e}")),
            Ok(_) => return Err(anyhow!("float8 accepted as a param dtype")),
        }
        s.synchronize()?;
        Ok(())
    })
}

/// The largest parameter difference float8 all-gather may make against the
/// same training with bf16 all-gather (4 SGD steps of the reference MLP):
/// float8 weights are within 2^-4 relative of bf16's, and SGD at lr 0.05 moves
/// parameters by about lr · |grad| per step, so the gap stays well under 0.02.
pub const TRAINING_TOLERANCE: f64 = 2e-2;

fn training_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/float8/training-stays-close-to-bf16", |ctx: &RankCtx<'_, C>| {
        let with = |float8| Setup {
            config: FsdpConfig { mixed_precision: mp(DType::BF16, float8), ..FsdpConfig::default() },
            ..Setup::new(sgd(0.05, 0.0))
        };
        let f8 = train_fsdp(own_world(ctx)?, &with(true))?;
        let plain = train_fsdp(own_world(ctx)?, &with(false))?;
        let as_f64 = |p: &[(String, Vec<f32>)]| -> Vec<(String, Vec<f64>)> {
            p.iter().map(|(n, v)| (n.clone(), v.iter().map(|x| *x as f64).collect())).collect()
        };
        let gap = max_diff(&f8, &as_f64(&plain))?;
        ensure!(gap <= TRAINING_TOLERANCE, "float8 against bf16 all-gather: max |Δparam| {gap:e}");
        ensure!(gap > 0.0, "float8 all-gather changed nothing: was it used?");
        // Both against the f32 reference: float8 is the coarser one, not broken.
        let f32_ref = train_reference(&with(false), ctx.size(), false);
        let (d8, d16) = (max_diff(&f8, &f32_ref)?, max_diff(&plain, &f32_ref)?);
        ensure!(d8 <= TRAINING_TOLERANCE, "float8 against the f32 reference: {d8:e} (bf16: {d16:e})");
        Ok(())
    })
}

/// The float8 all-gather cases.
pub fn cases<C: CommBackend>() -> Vec<Case<C>>
where
    C::B: ComputeBackend,
{
    vec![gather_case::<C, bf16>(), gather_case::<C, f32>(), bytes_halve_case(), movement_case(), training_case()]
}
