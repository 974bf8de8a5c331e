//! The layers the decoder models share, on chorus's fused ops
//! (`chorus-kernels`): a bias-free [`Linear`] computed as one matrix
//! product over every token (the leading dims flattened, so cuBLAS sees one
//! `[tokens, in] × [in, out]` product instead of a batch of small ones), and
//! [`RmsNorm`] through the fused, differentiable `rms_norm`.

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;

/// `y = x · Wᵀ` with `W` `[out, in]` (transformers' and candle-nn's layout), no bias.
#[derive(Clone, Debug)]
pub struct Linear {
    weight: Tensor,
}

impl Linear {
    /// The layer whose weight is `vb`'s `weight`, `[out, in]`.
    pub fn new(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
        Ok(Linear { weight: vb.get((out_dim, in_dim), "weight")? })
    }

    /// The layer of `weight` (`[out, in]`).
    pub fn from_weight(weight: Tensor) -> Linear {
        Linear { weight }
    }

    /// `x · Wᵀ` over `x`'s last dim; the leading dims are kept.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims();
        let Some((&last, lead)) = dims.split_last() else { candle_core::bail!("linear: a scalar input") };
        let rows: usize = lead.iter().product();
        let y = x.reshape((rows, last))?.matmul(&self.weight.t()?)?;
        let mut out = lead.to_vec();
        out.push(self.weight.dim(0)?);
        y.reshape(out)
    }
}

/// RMSNorm over the last dim with a learned weight (transformers' `LlamaRMSNorm`).
#[derive(Clone, Debug)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// The norm whose weight is `vb`'s `weight`, `[size]`.
    pub fn new(size: usize, eps: f64, vb: VarBuilder) -> Result<RmsNorm> {
        Ok(RmsNorm { weight: vb.get(size, "weight")?, eps })
    }

    /// `x` normalised and scaled, differentiable in `x` and the weight.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        chorus_kernels::rms_norm(x, &self.weight, self.eps)
    }
}
