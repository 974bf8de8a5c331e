//! Causal scaled-dot-product attention with grouped-query heads, forward and
//! backward, without a `T × T` buffer: flash attention. The CUDA kernels are
//! `cuda/attention_forward.cuh` (online softmax over key tiles in shared
//! memory, bf16/f16 on the tensor cores) and `cuda/attention_backward.cuh`
//! (the scores recomputed tile by tile from the saved log-sum-exp).
//!
//! Shapes are the projections' own layout, so no transpose is made:
//! `q` `[batch, q_len, heads, head_dim]`, `k` and `v`
//! `[batch, kv_len, kv_heads, head_dim]`, the output like `q`. Query head
//! `h` reads key/value head `h / (heads / kv_heads)` (transformers'
//! `repeat_kv`). Query `i` sits at position `kv_len − q_len + i` and sees the
//! keys up to it (a decode step after a cache sees all of them).
//!
//! Per query row, with `s_j = scale · q·k_j` over the visible keys:
//! `lse = log Σ_j exp(s_j)`, `p_j = exp(s_j − lse)`, `o = Σ_j p_j v_j`.
//! Backward: `D = dO·o`, `dp_j = dO·v_j`, `ds_j = p_j (dp_j − D)`,
//! `dq = scale Σ_j ds_j k_j`, `dk_j += scale ds_j q`, `dv_j += p_j dO`.

use candle_core::{bail, CpuStorage, Result, Shape, Storage, Tensor};

pub use crate::attention_shape::AttentionShape;
use crate::host::{check_float, saved_f32};
use crate::op::{CpuInput, Kernel, Op};
use crate::saved::SavedLse;
use crate::timing::{timed, OpKind};

/// Causal attention of `q` over `k`, `v` (shapes in the module docs), each
/// score scaled by `scale` (usually `1 / sqrt(head_dim)`); f32, bf16 or f16,
/// the three of one dtype. Differentiable in `q`, `k` and `v`.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    const OP: &str = "attention";
    check_float(OP, "q", q.dtype())?;
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        bail!("{OP}: q, k, v are {:?}, {:?}, {:?}; they must match", q.dtype(), k.dtype(), v.dtype())
    }
    // The kernels compute in f32: a scale f32 cannot hold is refused, not rounded to infinity.
    if !(scale as f32).is_finite() {
        bail!("{OP}: scale {scale} is not finite in f32")
    }
    AttentionShape::of(q.shape(), k.shape(), v.shape())?;
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let op = Attention { scale: scale as f32, lse: SavedLse::new(OP) };
    timed(OpKind::Attention, q.device(), || q.apply_op3(&k, &v, Op(op)))
}

/// The forward on host values: `(o, lse)`, `lse` `[batch, heads, q_len]`.
pub fn forward(q: &[f32], k: &[f32], v: &[f32], sh: AttentionShape, scale: f32) -> (Vec<f32>, Vec<f32>) {
    let (d, group) = (sh.head_dim, sh.heads / sh.kv_heads);
    let mut o = vec![0f32; sh.q_elems()];
    let mut lse = vec![0f32; sh.batch * sh.heads * sh.q_len];
    let mut s = vec![0f32; sh.kv_len];
    for b in 0..sh.batch {
        for h in 0..sh.heads {
            for i in 0..sh.q_len {
                let qi = &q[sh.q_at(b, i, h)..][..d];
                let n = sh.visible(i);
                for (j, sj) in s[..n].iter_mut().enumerate() {
                    *sj = scale * dot(qi, &k[sh.kv_at(b, j, h / group)..][..d]);
                }
                let m = s[..n].iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
                let l: f32 = s[..n].iter().map(|x| (x - m).exp()).sum();
                let oi = &mut o[sh.q_at(b, i, h)..][..d];
                for (j, sj) in s[..n].iter().enumerate() {
                    let p = (sj - m).exp() / l;
                    for (oe, ve) in oi.iter_mut().zip(&v[sh.kv_at(b, j, h / group)..][..d]) {
                        *oe += p * ve;
                    }
                }
                lse[(b * sh.heads + h) * sh.q_len + i] = m + l.ln();
            }
        }
    }
    (o, lse)
}

/// `(dq, dk, dv)` on host values, from the forward's `o` and `lse`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    lse: &[f32],
    d_o: &[f32],
    sh: AttentionShape,
    scale: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (d, group) = (sh.head_dim, sh.heads / sh.kv_heads);
    let (mut dq, mut dk, mut dv) = (vec![0f32; sh.q_elems()], vec![0f32; sh.kv_elems()], vec![0f32; sh.kv_elems()]);
    for b in 0..sh.batch {
        for h in 0..sh.heads {
            for i in 0..sh.q_len {
                let at = sh.q_at(b, i, h);
                let (qi, doi) = (&q[at..][..d], &d_o[at..][..d]);
                let big_d = dot(doi, &o[at..][..d]);
                let l = lse[(b * sh.heads + h) * sh.q_len + i];
                for j in 0..sh.visible(i) {
                    let kv = sh.kv_at(b, j, h / group);
                    let p = (scale * dot(qi, &k[kv..][..d]) - l).exp();
                    let ds = p * (dot(doi, &v[kv..][..d]) - big_d);
                    for e in 0..d {
                        dq[at + e] += scale * ds * k[kv + e];
                        dk[kv + e] += scale * ds * qi[e];
                        dv[kv + e] += p * doi[e];
                    }
                }
            }
        }
    }
    (dq, dk, dv)
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The forward op on `(q, k, v)`; keeps the log-sum-exp for the backward.
struct Attention {
    scale: f32,
    lse: SavedLse,
}

impl Kernel<3> for Attention {
    const NAME: &'static str = "chorus-attention";

    fn shape(&self, [q, k, v]: [&Shape; 3]) -> Result<Shape> {
        AttentionShape::of(q, k, v)?;
        Ok(q.clone())
    }

    fn cpu(&self, [q, k, v]: [CpuInput; 3]) -> Result<Vec<f32>> {
        let sh = AttentionShape::of(q.shape(), k.shape(), v.shape())?;
        let (o, lse) = forward(&q.f32()?, &k.f32()?, &v.f32()?, sh, self.scale);
        self.lse.keep(Storage::Cpu(CpuStorage::F32(lse)), (sh.batch, sh.heads, sh.q_len))?;
        Ok(o)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, [(q, lq), (k, lk), (v, lv)]: [crate::op::CudaInput; 3]) -> Result<candle_core::CudaStorage> {
        let sh = AttentionShape::of(lq.shape(), lk.shape(), lv.shape())?;
        let (o, lse) = crate::cuda::attention_forward(q, lq, k, lk, v, lv, sh, self.scale)?;
        self.lse.keep(Storage::Cuda(lse), (sh.batch, sh.heads, sh.q_len))?;
        Ok(o)
    }

    fn bwd(&self, [q, k, v]: [&Tensor; 3], o: &Tensor, d_o: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let lse = self.lse.get()?;
        let sh = AttentionShape::of(q.shape(), k.shape(), v.shape())?;
        let d_o = d_o.contiguous()?;
        let op =
            AttentionBackward { scale: self.scale, sh, saved: [q.clone(), k.clone(), v.clone(), o.contiguous()?, lse] };
        // One launch sequence writes the three gradients into one buffer: `[dq | dk | dv]`.
        let all = timed(OpKind::AttentionBackward, q.device(), || d_o.apply_op1_no_bwd(&Op(op)))?;
        let (nq, nkv) = (sh.q_elems(), sh.kv_elems());
        let dq = all.narrow(0, 0, nq)?.reshape(q.shape())?;
        let dk = all.narrow(0, nq, nkv)?.reshape(k.shape())?;
        let dv = all.narrow(0, nq + nkv, nkv)?.reshape(v.shape())?;
        Ok([Some(dq), Some(dk), Some(dv)])
    }
}

/// `[dq | dk | dv]` (flat, in `q`'s dtype) from `dO`, with the forward's
/// inputs, output and log-sum-exp.
struct AttentionBackward {
    scale: f32,
    sh: AttentionShape,
    /// `q`, `k`, `v`, `o` (contiguous) and `lse` (f32).
    saved: [Tensor; 5],
}

impl Kernel<1> for AttentionBackward {
    const NAME: &'static str = "chorus-attention-backward";

    fn shape(&self, _: [&Shape; 1]) -> Result<Shape> {
        Ok(Shape::from(self.sh.q_elems() + 2 * self.sh.kv_elems()))
    }

    fn cpu(&self, [d_o]: [CpuInput; 1]) -> Result<Vec<f32>> {
        let d_o = d_o.f32()?;
        let mut host = Vec::with_capacity(5);
        for t in &self.saved {
            host.push(saved_f32(Self::NAME, "a saved tensor", t)?);
        }
        let (dq, dk, dv) = backward(&host[0], &host[1], &host[2], &host[3], &host[4], &d_o, self.sh, self.scale);
        let mut all = dq;
        all.extend(dk);
        all.extend(dv);
        Ok(all)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, [(d_o, ldo)]: [crate::op::CudaInput; 1]) -> Result<candle_core::CudaStorage> {
        crate::cuda::attention_backward(d_o, ldo, &self.saved, self.sh, self.scale)
    }
}
