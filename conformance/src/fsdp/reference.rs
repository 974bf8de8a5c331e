//! A plain host implementation of the reference MLP and its optimizers, in
//! f64, written independently of the device layer: the parity oracle.

use chorus_devices::bf16;

/// Which optimizer the reference applies.
#[derive(Clone, Copy, Debug)]
pub enum RefOpt {
    /// SGD with momentum (dampening 0, no weight decay).
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum.
        momentum: f64,
    },
    /// AdamW with PyTorch's default betas and eps.
    AdamW {
        /// Learning rate.
        lr: f64,
        /// Decoupled weight decay.
        weight_decay: f64,
    },
}

/// The MLP: `layers.{i}` = Linear(d_i → d_{i+1}), ReLU between layers.
pub struct RefMlp {
    /// Layer widths.
    pub dims: Vec<usize>,
    /// Weights, `[out, in]` row-major.
    pub w: Vec<Vec<f64>>,
    /// Biases.
    pub b: Vec<Vec<f64>>,
    mom: Vec<(Vec<f64>, Vec<f64>)>,
    adam: Vec<[Vec<f64>; 4]>,
    step: u64,
}

/// Gradients of one batch.
pub struct Grads {
    /// Weight gradients.
    pub w: Vec<Vec<f64>>,
    /// Bias gradients.
    pub b: Vec<Vec<f64>>,
    /// The batch's loss.
    pub loss: f64,
}

fn round_bf16(v: f64) -> f64 {
    bf16::from_f64(v).to_f64()
}

/// The `m × n` row-major product of `a` (`m × inner`) and `b` (`inner × n`),
/// read through index functions so that one loop serves every transpose the
/// backward pass needs; each element summed in `inner` order.
fn matmul(
    m: usize,
    n: usize,
    inner: usize,
    a: impl Fn(usize, usize) -> f64,
    b: impl Fn(usize, usize) -> f64,
) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0;
            for t in 0..inner {
                acc += a(i, t) * b(t, j);
            }
            out[i * n + j] = acc;
        }
    }
    out
}

impl RefMlp {
    /// The model with the named initial parameters.
    pub fn new(dims: &[usize], params: &[(String, Vec<f32>)]) -> Self {
        let mut w: Vec<Vec<f64>> = Vec::new();
        let mut b: Vec<Vec<f64>> = Vec::new();
        for i in 0..dims.len() - 1 {
            let get = |n: String| -> Vec<f64> {
                params.iter().find(|p| p.0 == n).map(|p| p.1.iter().map(|v| *v as f64).collect()).unwrap_or_default()
            };
            w.push(get(format!("layers.{i}.weight")));
            b.push(get(format!("layers.{i}.bias")));
        }
        let mom = w.iter().zip(&b).map(|(w, b)| (vec![0.0; w.len()], vec![0.0; b.len()])).collect();
        let adam = w
            .iter()
            .zip(&b)
            .map(|(w, b)| [vec![0.0; w.len()], vec![0.0; w.len()], vec![0.0; b.len()], vec![0.0; b.len()]])
            .collect();
        RefMlp { dims: dims.to_vec(), w, b, mom, adam, step: 0 }
    }

    /// Mean-squared-error gradients over the rows of `x`. With `bf16` the
    /// arithmetic is rounded where PyTorch's bf16 autocast-free mixed
    /// precision rounds: inputs, each Linear's output, and gradients.
    pub fn grads(&self, x: &[f32], y: &[f32], bf16_compute: bool) -> Grads {
        let r = |v: f64| if bf16_compute { round_bf16(v) } else { v };
        let rf32 = |v: f64| if bf16_compute { v as f32 as f64 } else { v };
        let n_layers = self.dims.len() - 1;
        let d0 = self.dims[0];
        let rows = x.len() / d0;
        let w: Vec<Vec<f64>> = self.w.iter().map(|w| w.iter().map(|v| r(*v)).collect()).collect();
        let b: Vec<Vec<f64>> = self.b.iter().map(|b| b.iter().map(|v| r(*v)).collect()).collect();
        let mut acts: Vec<Vec<f64>> = vec![x.iter().map(|v| r(*v as f64)).collect()];
        for l in 0..n_layers {
            let (din, dout) = (self.dims[l], self.dims[l + 1]);
            let h = &acts[l];
            // z = h · wᵀ
            let mut z = matmul(rows, dout, din, |i, k| h[i * din + k], |k, o| w[l][o * din + k]);
            for (idx, v) in z.iter_mut().enumerate() {
                // f32 accumulation, then the bias, then one rounding.
                *v = r(rf32(rf32(*v) + b[l][idx % dout]));
            }
            if l + 1 < n_layers {
                z.iter_mut().for_each(|v| *v = v.max(0.0));
            }
            acts.push(z);
        }
        let dl = self.dims[n_layers];
        let out = &acts[n_layers];
        let scale = 1.0 / (rows * dl) as f64;
        let loss = out.iter().zip(y).map(|(o, t)| (o - *t as f64).powi(2)).sum::<f64>() * scale;
        let mut grad: Vec<f64> = out.iter().zip(y).map(|(o, t)| r(rf32(2.0 * scale * (o - *t as f64)))).collect();
        let mut gw = vec![Vec::new(); n_layers];
        let mut gb = vec![Vec::new(); n_layers];
        for l in (0..n_layers).rev() {
            let (din, dout) = (self.dims[l], self.dims[l + 1]);
            if l + 1 < n_layers {
                for (g, a) in grad.iter_mut().zip(&acts[l + 1]) {
                    if *a <= 0.0 {
                        *g = 0.0;
                    }
                }
            }
            let h = &acts[l];
            // w_grad = gradᵀ · h
            let mut w_grad = matmul(dout, din, rows, |o, i| grad[i * dout + o], |i, k| h[i * din + k]);
            w_grad.iter_mut().for_each(|v| *v = r(rf32(*v)));
            let b_grad: Vec<f64> = (0..dout).map(|o| r(rf32((0..rows).map(|i| grad[i * dout + o]).sum()))).collect();
            // next = grad · w
            let mut next = matmul(rows, din, dout, |i, o| grad[i * dout + o], |o, k| w[l][o * din + k]);
            next.iter_mut().for_each(|v| *v = r(rf32(*v)));
            gw[l] = w_grad;
            gb[l] = b_grad;
            grad = next;
        }
        Grads { w: gw, b: gb, loss }
    }

    /// One optimizer step with `g`.
    pub fn apply(&mut self, g: &Grads, opt: RefOpt) {
        self.step += 1;
        let step = self.step;
        for l in 0..self.w.len() {
            match opt {
                RefOpt::Sgd { lr, momentum } => {
                    sgd(&mut self.w[l], &g.w[l], &mut self.mom[l].0, lr, momentum, step == 1);
                    sgd(&mut self.b[l], &g.b[l], &mut self.mom[l].1, lr, momentum, step == 1);
                }
                RefOpt::AdamW { lr, weight_decay } => {
                    let [mw, vw, mb, vb] = &mut self.adam[l];
                    adamw(&mut self.w[l], &g.w[l], mw, vw, lr, weight_decay, step);
                    adamw(&mut self.b[l], &g.b[l], mb, vb, lr, weight_decay, step);
                }
            }
        }
    }

    /// The parameters by name, as FSDP exports them.
    pub fn named(&self) -> Vec<(String, Vec<f64>)> {
        let mut out = Vec::new();
        for l in 0..self.w.len() {
            out.push((format!("layers.{l}.weight"), self.w[l].clone()));
            out.push((format!("layers.{l}.bias"), self.b[l].clone()));
        }
        out
    }
}

/// torch's SGD on one parameter (momentum buffer `buf`; the first step seeds it).
pub fn sgd(p: &mut [f64], g: &[f64], buf: &mut [f64], lr: f64, momentum: f64, first: bool) {
    for i in 0..p.len() {
        let d = if momentum != 0.0 {
            buf[i] = if first { g[i] } else { momentum * buf[i] + g[i] };
            buf[i]
        } else {
            g[i]
        };
        p[i] -= lr * d;
    }
}

/// torch's AdamW on one parameter (moments `m`, `v`; betas 0.9, 0.999, eps 1e-8).
pub fn adamw(p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64], lr: f64, wd: f64, step: u64) {
    let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
    let bc1 = 1.0 - b1.powi(step as i32);
    let bc2 = 1.0 - b2.powi(step as i32);
    for i in 0..p.len() {
        p[i] *= 1.0 - lr * wd;
        m[i] = b1 * m[i] + (1.0 - b1) * g[i];
        v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
        p[i] -= lr / bc1 * m[i] / ((v[i] / bc2).sqrt() + eps);
    }
}
