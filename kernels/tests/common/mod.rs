//! What the op tests share (`ops.rs` against candle's composed ops,
//! `ops_torch.rs` against PyTorch): deterministic inputs, forward and
//! backward of an op through candle's autograd, and the judge that compares
//! two results and is itself shown to fail on a perturbed reference.
#![allow(dead_code)] // each test file uses what it needs

use candle_core::{DType, Device, Result, Tensor, Var};

// The generator of the host kernels' tests (`host/`, a module of this test
// binary), so both draw inputs alike.
pub use crate::host::Rng;

/// Candle tensors and token ids drawn from an [`Rng`].
pub trait Inputs {
    /// A tensor of `shape`, uniform in [-scale, scale), rounded to `dtype`.
    fn tensor(&mut self, shape: &[usize], scale: f32, dtype: DType) -> Tensor;

    /// `n` ids below `below`.
    fn ids(&mut self, n: usize, below: usize) -> Vec<u32>;
}

impl Inputs for Rng {
    fn tensor(&mut self, shape: &[usize], scale: f32, dtype: DType) -> Tensor {
        let n = shape.iter().product();
        Tensor::from_vec(self.values(n, scale), shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
    }

    fn ids(&mut self, n: usize, below: usize) -> Vec<u32> {
        (0..n).map(|_| (((self.uniform() + 1.0) / 2.0 * below as f32) as usize).min(below - 1) as u32).collect()
    }
}

/// The dtypes the ops take.
pub const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// The unit roundoff of `dtype`'s round-to-nearest: half its spacing at 1,
/// the largest relative error of one rounding.
pub fn unit_roundoff(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 2f32.powi(-8),
        DType::F16 => 2f32.powi(-11),
        _ => 2f32.powi(-24),
    }
}

/// The error an op's result in `dtype` may have against a reference computed
/// in f32 from the same (rounded) inputs, relative to the reference's
/// largest magnitude (see [`normwise_err`]).
///
/// f32: 1e-5, the bound (the op and the composed ops sum in other
/// orders: a few hundred f32 roundings at most, ~1e-6 at these sizes).
///
/// bf16 and f16: 2 unit roundoffs `u` (2⁻⁸, 2⁻¹¹). The op computes in f32
/// and rounds its output once: ≤ u of that element, so ≤ u of the largest.
/// In places it also computes from one intermediate held in the dtype, as
/// transformers does or the CUDA kernel must: RMSNorm's normalised row
/// (rounded before the weight; the reference rounds it too, so only a tie
/// the two f32 values put on other sides differs, by one spacing of that
/// element), attention's backward reading the rounded output `o` in
/// `D = dO·o`, RMSNorm's `dw` summing `dy·x̂` where the reference sums
/// `dy·round(x̂)`: each adds at most about u of the result's scale. The f32
/// noise on top is below 1e-5. Measured (2026-11-27, the inputs of `ops.rs`):
/// at most 1.3 u. A placement bug (a rounding missing or extra where it
/// changes the result, a wrong element) is far larger, and the f32 runs
/// check the arithmetic itself to 1e-5.
pub fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-5,
        d => 2.0 * unit_roundoff(d),
    }
}

/// `max |got − want| / max |want|`; an error names a length mismatch or the
/// first element of `got` that is not finite where `want`'s is.
pub fn normwise_err(got: &[f32], want: &[f32]) -> std::result::Result<f32, String> {
    if got.len() != want.len() {
        return Err(format!("{} elements, expected {}", got.len(), want.len()));
    }
    if let Some(i) = (0..got.len()).find(|&i| !got[i].is_finite() && want[i].is_finite()) {
        return Err(format!("element {i} is {} where the reference has {}", got[i], want[i]));
    }
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(f32::MIN_POSITIVE);
    Ok(got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale)
}

/// Whether `got` is within `tol` of `want` ([`normwise_err`]); the error says by how much not.
pub fn judge(got: &[f32], want: &[f32], tol: f32) -> std::result::Result<f32, String> {
    let err = normwise_err(got, want)?;
    if err <= tol {
        Ok(err)
    } else {
        Err(format!("relative error {err:.3e} > {tol:.1e}"))
    }
}

/// The values of `t` in f32, flattened.
pub fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// Asserts `got` equals `want` within `tol` and that their shapes agree; then
/// shows the judge is not blind: `want` with one element (chosen from
/// `what`) moved by 3 `tol` of its largest magnitude must fail it.
/// Returns the error measured.
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f32) -> f32 {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let (got, mut want) = (f32s(got), f32s(want));
    let err = match judge(&got, &want, tol) {
        Ok(err) => err,
        Err(why) => panic!("{what}: {why}"),
    };
    if !want.is_empty() {
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let i = what.bytes().fold(7usize, |h, b| h.wrapping_mul(31).wrapping_add(b as usize)) % want.len();
        // 3 tol moves the error past tol whichever sign it had; an exact
        // comparison (tol 0) fails on any move.
        want[i] += (3.0 * tol * scale).max(scale * 2f32.powi(-20)).max(f32::MIN_POSITIVE);
        assert!(judge(&got, &want, tol).is_err(), "{what}: the judge passes a reference perturbed at element {i}");
    }
    err
}

/// An op's output and the gradients of `inputs` when the output's gradient
/// is `dy`: the op applied to `inputs` as `Var`s, then backward from
/// `sum(y · dy)` (whose gradient at `y` is exactly `dy`, in any dtype).
pub fn forward_backward(
    inputs: &[&Tensor],
    dy: &Tensor,
    op: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<(Tensor, Vec<Tensor>)> {
    let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t)).collect::<Result<_>>()?;
    let args: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = op(&args)?;
    let grads = (y.to_dtype(dy.dtype())? * dy)?.sum_all()?.backward()?;
    let g = vars
        .iter()
        .map(|v| grads.get(v.as_tensor()).cloned().ok_or_else(|| candle_core::Error::msg("an input has no gradient")))
        .collect::<Result<_>>()?;
    Ok((y, g))
}

/// `t` widened to f32 (the reference computes from the op's rounded inputs).
pub fn wide(t: &Tensor) -> Tensor {
    t.to_dtype(DType::F32).unwrap()
}

/// Errors as `[1.2e-7, 3.0e-6]`, for the tests' logs.
pub fn sci(errs: &[f32]) -> String {
    let each: Vec<String> = errs.iter().map(|e| format!("{e:.1e}")).collect();
    format!("[{}]", each.join(", "))
}
