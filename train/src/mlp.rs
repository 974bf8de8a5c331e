//! The reference model: an MLP whose forward and backward run through the
//! device layer under FSDP, so the same code trains on every backend.
//!
//! `layers.{i}` is Linear(d_i → d_{i+1}) with weight `[out, in]` and bias
//! `[out]`, ReLU between layers and none after the last; the loss is the mean
//! squared error over the rank's rows and outputs. With a bf16 param dtype it
//! follows PyTorch's mixed precision: bf16 operands, f32 accumulation, each
//! Linear's result (after the bias add) rounded to bf16, ReLU in bf16, the
//! output cast to f32 for an f32 loss, gradients flowing back in bf16.

use chorus_collectives::CommBackend;
use chorus_devices::{Backend, Buffer, ComputeBackend, ComputeStream, DType, MatmulSpec, Stream, StreamExt, View};
use chorus_fsdp::{Fsdp, FsdpError, ParamInit, Result};

use crate::rng::SplitMix;

/// A device buffer of the backend behind communicator `C`.
type Buf<C> = <<C as CommBackend>::B as Backend>::Buffer;

/// The parameters of an MLP with layer widths `dims`, initialised like
/// PyTorch's `nn.Linear` (uniform in ±1/√in) from `seed`; one group per layer.
pub fn init_layers(dims: &[usize], seed: u64) -> Vec<Vec<ParamInit>> {
    let mut rng = SplitMix::new(seed);
    dims.windows(2)
        .enumerate()
        .map(|(i, w)| {
            let (din, dout) = (w[0], w[1]);
            let bound = 1.0 / (din as f32).sqrt();
            let weight = (0..din * dout).map(|_| rng.uniform(-bound, bound)).collect();
            let bias = (0..dout).map(|_| rng.uniform(-bound, bound)).collect();
            vec![
                ParamInit { name: format!("layers.{i}.weight"), shape: vec![dout, din], values: weight },
                ParamInit { name: format!("layers.{i}.bias"), shape: vec![dout], values: bias },
            ]
        })
        .collect()
}

/// An MLP registered with an [`Fsdp`]: one group per Linear, plus the root.
#[derive(Clone, Debug)]
pub struct Mlp {
    dims: Vec<usize>,
    layers: Vec<usize>,
    root: usize,
}

struct Saved<C: CommBackend> {
    inputs: Vec<Buf<C>>,
    outputs: Vec<Buf<C>>,
}

impl Mlp {
    /// Registers the layers (from [`init_layers`] or loaded values) as groups of `fsdp`.
    pub fn register<C: CommBackend>(fsdp: &mut Fsdp<C>, layers: Vec<Vec<ParamInit>>) -> Result<Mlp>
    where
        C::B: ComputeBackend,
    {
        let mut dims = Vec::new();
        for (i, l) in layers.iter().enumerate() {
            let [w, b] = l.as_slice() else {
                return Err(FsdpError::InvalidArgument(format!("layer {i} needs a weight and a bias")));
            };
            let (dout, din) = match w.shape.as_slice() {
                [o, i] => (*o, *i),
                s => return Err(FsdpError::InvalidArgument(format!("layers.{i}.weight has shape {s:?}"))),
            };
            if b.shape != [dout] {
                return Err(FsdpError::InvalidArgument(format!("layers.{i}.bias has shape {:?}", b.shape)));
            }
            if let Some(prev) = dims.last() {
                if *prev != din {
                    return Err(FsdpError::InvalidArgument(format!(
                        "layers.{i} takes {din} inputs, previous gives {prev}"
                    )));
                }
            } else {
                dims.push(din);
            }
            dims.push(dout);
        }
        if dims.len() < 2 {
            return Err(FsdpError::InvalidArgument("an MLP needs at least one layer".into()));
        }
        let mut groups = Vec::new();
        for (i, l) in layers.into_iter().enumerate() {
            groups.push(fsdp.add_group(&format!("layers.{i}"), l, false)?);
        }
        let root = fsdp.add_group("root", Vec::new(), true)?;
        Ok(Mlp { dims, layers: groups, root })
    }

    /// Layer widths.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// The group of each layer, in order.
    pub fn layer_groups(&self) -> &[usize] {
        &self.layers
    }

    /// The root group.
    pub fn root_group(&self) -> usize {
        self.root
    }

    /// Forward and backward of one micro-batch: `x` is `[batch, d_0]`, `y`
    /// `[batch, d_last]`, both f32 on the host. Gradients go to FSDP (reduced
    /// or accumulated per its switches). Returns the rank's loss as a
    /// one-element f32 buffer (read it after synchronizing).
    pub fn forward_backward<C: CommBackend>(&self, fsdp: &mut Fsdp<C>, x: &[f32], y: &[f32]) -> Result<Buf<C>>
    where
        C::B: ComputeBackend,
    {
        let (d0, dl) = (self.dims[0], *self.dims.last().unwrap_or(&0));
        if d0 == 0 || x.len() % d0 != 0 || y.len() != x.len() / d0 * dl {
            return Err(FsdpError::InvalidArgument(format!(
                "x has {} values and y {}, which are not [batch, {d0}] and [batch, {dl}]",
                x.len(),
                y.len()
            )));
        }
        let batch = x.len() / d0;
        let pd = fsdp.mixed_precision().param();
        let saved = self.forward(fsdp, x, batch, pd)?;
        let s = fsdp.compute_stream();
        let out = saved.outputs.last().ok_or_else(|| FsdpError::InvalidArgument("no layers".into()))?;
        // The policy's output dtype applies to the model's output; the loss is f32.
        let cast_out;
        let out = match fsdp.mixed_precision().output_dtype {
            Some(d) if d != out.dtype() => {
                cast_out = to_dtype(s, out.view(), d)?;
                cast_out.view()
            }
            _ => out.view(),
        };
        let out32 = to_dtype(s, out, DType::F32)?;
        let target = s.buffer_from(y)?;
        let scale = 1.0 / (batch * dl).max(1) as f64;
        let loss = s.alloc(DType::F32, 1)?;
        s.mse_loss(out32.view(), target.view(), loss.view(), scale)?;
        let grad32 = s.alloc(DType::F32, batch * dl)?;
        s.mse_grad(out32.view(), target.view(), grad32.view(), scale)?;
        let grad = to_dtype(s, grad32.view(), pd)?;
        self.backward(fsdp, saved, grad, batch, pd)?;
        Ok(loss)
    }

    fn forward<C: CommBackend>(&self, fsdp: &mut Fsdp<C>, x: &[f32], batch: usize, pd: DType) -> Result<Saved<C>>
    where
        C::B: ComputeBackend,
    {
        fsdp.pre_forward(self.root)?;
        let x32 = fsdp.compute_stream().buffer_from(x)?;
        let mut input = to_dtype(fsdp.compute_stream(), x32.view(), pd)?;
        let mut saved = Saved { inputs: Vec::new(), outputs: Vec::new() };
        let last = self.layers.len() - 1;
        for (i, g) in self.layers.iter().copied().enumerate() {
            let (din, dout) = (self.dims[i], self.dims[i + 1]);
            let out = fsdp.forward(g, |f| {
                let s = f.compute_stream();
                let (w, b) = (f.param(g, 0)?, f.param(g, 1)?);
                let spec = MatmulSpec { m: batch, n: dout, k: din, trans_a: false, trans_b: true, accumulate: false };
                let y = s.alloc(pd, batch * dout)?;
                if pd == DType::F32 {
                    s.matmul(spec, input.view(), w, y.view())?;
                    s.bias_add(y.view(), b)?;
                } else {
                    // One rounding to the param dtype, after the bias add (PyTorch's addmm).
                    let acc = s.alloc(DType::F32, batch * dout)?;
                    s.matmul(spec, input.view(), w, acc.view())?;
                    s.bias_add(acc.view(), b)?;
                    s.cast(acc.view(), y.view())?;
                }
                if i != last {
                    s.relu(y.view(), y.view())?;
                }
                Ok(y)
            })?;
            saved.inputs.push(std::mem::replace(&mut input, out));
        }
        saved.outputs.push(input);
        fsdp.post_forward(self.root)?;
        Ok(saved)
    }

    fn backward<C: CommBackend>(
        &self,
        fsdp: &mut Fsdp<C>,
        saved: Saved<C>,
        grad_out: Buf<C>,
        batch: usize,
        pd: DType,
    ) -> Result<()>
    where
        C::B: ComputeBackend,
    {
        fsdp.pre_backward(self.root)?;
        let last = self.layers.len() - 1;
        let mut grad = grad_out;
        for (i, g) in self.layers.iter().copied().enumerate().rev() {
            let (din, dout) = (self.dims[i], self.dims[i + 1]);
            let x = &saved.inputs[i];
            // Layer i's (post-ReLU) output is layer i+1's input.
            let out = saved.inputs.get(i + 1).or(saved.outputs.last());
            grad = fsdp.backward(g, |f| {
                let s = f.compute_stream();
                if i != last {
                    let out = out.ok_or_else(|| FsdpError::InvalidArgument("missing activation".into()))?;
                    s.relu_backward(grad.view(), out.view(), grad.view())?;
                }
                let gw = MatmulSpec { m: dout, n: din, k: batch, trans_a: true, trans_b: false, accumulate: true };
                s.matmul(gw, grad.view(), x.view(), f.grad(g, 0)?)?;
                s.column_sums(grad.view(), f.grad(g, 1)?, true)?;
                let dx = s.alloc(pd, batch * din)?;
                if i > 0 {
                    let spec =
                        MatmulSpec { m: batch, n: din, k: dout, trans_a: false, trans_b: false, accumulate: false };
                    s.matmul(spec, grad.view(), f.param(g, 0)?, dx.view())?;
                }
                Ok(dx)
            })?;
        }
        fsdp.post_backward(self.root)?;
        Ok(())
    }
}

fn to_dtype<S: Stream>(s: &S, src: View<'_, S::B>, dtype: DType) -> chorus_devices::Result<<S::B as Backend>::Buffer> {
    let out = s.alloc(dtype, src.len())?;
    if src.dtype() == dtype {
        s.copy(src, out.view())?;
    } else {
        s.cast(src, out.view())?;
    }
    Ok(out)
}
