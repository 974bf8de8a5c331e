//! The host reference of the MoE test model ([`super::moe`]): one process,
//! f64, the whole global batch at once, written from the model's definition
//! (not from the device code). Every parameter gets a gradient every step,
//! zero for an expert no row used, as FSDP's routed groups give.

use std::collections::BTreeMap;

use super::moe::{init_moe, route, MoeShape};
use super::reference::{adamw, sgd, RefOpt};

/// The model's parameters and optimizer state.
pub struct RefMoe {
    shape: MoeShape,
    params: BTreeMap<String, Vec<f64>>,
    /// Per parameter: momentum, or AdamW's first and second moments.
    state: BTreeMap<String, [Vec<f64>; 2]>,
    step: u64,
}

/// `out[i][j] = Σ_t a[i][t] · b[j][t]` for row-major `a` (`m × k`) and `b` (`n × k`).
fn times_t(a: &[f64], b: &[f64], m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|t| a[i * k + t] * b[j * k + t]).sum();
        }
    }
    out
}

impl RefMoe {
    /// The model initialised as [`init_moe`] with `seed`.
    pub fn new(shape: MoeShape, seed: u64) -> Self {
        let params: BTreeMap<String, Vec<f64>> =
            init_moe(shape, seed).into_iter().map(|p| (p.name, p.values.iter().map(|v| *v as f64).collect())).collect();
        let state = params.iter().map(|(n, v)| (n.clone(), [vec![0.0; v.len()], vec![0.0; v.len()]])).collect();
        RefMoe { shape, params, state, step: 0 }
    }

    fn p(&self, name: &str) -> &[f64] {
        self.params.get(name).map(|v| v.as_slice()).unwrap_or(&[])
    }

    /// The gradients of the mean squared error over `x` (`[rows, d]`) and
    /// `y`, and each layer's routing of the rows.
    pub fn grads(&self, x: &[f32], y: &[f32]) -> (BTreeMap<String, Vec<f64>>, Vec<Vec<usize>>) {
        let MoeShape { d, experts, layers, d_out } = self.shape;
        let rows = x.len() / d;
        let mut grads = BTreeMap::new();
        let mut h: Vec<f64> = x.iter().map(|v| *v as f64).collect();
        // Per layer: input, routing, softmax, each row's post-ReLU expert output.
        let mut saved = Vec::new();
        for l in 0..layers {
            let logits = times_t(&h, self.p(&format!("moe.{l}.router.weight")), rows, experts, d);
            let (top, probs) = route(&logits, experts);
            let mut out = h.clone();
            let mut act = vec![0.0; rows * d];
            for r in 0..rows {
                let e = top[r];
                let (w, b) =
                    (self.p(&format!("moe.{l}.experts.{e}.weight")), self.p(&format!("moe.{l}.experts.{e}.bias")));
                let z = times_t(&h[r * d..(r + 1) * d], w, 1, d, d);
                for i in 0..d {
                    act[r * d + i] = (z[i] + b[i]).max(0.0);
                    out[r * d + i] += probs[r][e] * act[r * d + i];
                }
            }
            saved.push((h, top, probs, act));
            h = out;
        }
        let out = times_t(&h, self.p("head.weight"), rows, d_out, d);
        let hb = self.p("head.bias");
        let scale = 1.0 / (rows * d_out) as f64;
        let dout: Vec<f64> = (0..rows * d_out).map(|i| 2.0 * scale * (out[i] + hb[i % d_out] - y[i] as f64)).collect();
        let hw = self.p("head.weight");
        let (mut gw, mut gb) = (vec![0.0; d_out * d], vec![0.0; d_out]);
        let mut dh = vec![0.0; rows * d];
        for r in 0..rows {
            for o in 0..d_out {
                let g = dout[r * d_out + o];
                gb[o] += g;
                for i in 0..d {
                    gw[o * d + i] += g * h[r * d + i];
                    dh[r * d + i] += g * hw[o * d + i];
                }
            }
        }
        grads.insert("head.weight".into(), gw);
        grads.insert("head.bias".into(), gb);
        let mut routes = Vec::new();
        for (l, (input, top, probs, act)) in saved.into_iter().enumerate().rev() {
            let router = self.p(&format!("moe.{l}.router.weight"));
            let mut g_router = vec![0.0; experts * d];
            let mut g_experts = vec![(vec![0.0; d * d], vec![0.0; d]); experts];
            let mut dx = dh.clone();
            for r in 0..rows {
                let e = top[r];
                let w = self.p(&format!("moe.{l}.experts.{e}.weight"));
                let dgate: f64 = (0..d).map(|i| dh[r * d + i] * act[r * d + i]).sum();
                // Through the gate into the router: d p_e / d z_j = p_e (δ_ej − p_j).
                for j in 0..experts {
                    let delta = if j == e { 1.0 } else { 0.0 };
                    let dz = dgate * probs[r][e] * (delta - probs[r][j]);
                    for i in 0..d {
                        g_router[j * d + i] += dz * input[r * d + i];
                        dx[r * d + i] += dz * router[j * d + i];
                    }
                }
                // Through the expert.
                for o in 0..d {
                    let dpre = if act[r * d + o] > 0.0 { dh[r * d + o] * probs[r][e] } else { 0.0 };
                    g_experts[e].1[o] += dpre;
                    for i in 0..d {
                        g_experts[e].0[o * d + i] += dpre * input[r * d + i];
                        dx[r * d + i] += dpre * w[o * d + i];
                    }
                }
            }
            grads.insert(format!("moe.{l}.router.weight"), g_router);
            for (e, (w, b)) in g_experts.into_iter().enumerate() {
                grads.insert(format!("moe.{l}.experts.{e}.weight"), w);
                grads.insert(format!("moe.{l}.experts.{e}.bias"), b);
            }
            routes.push(top);
            dh = dx;
        }
        routes.reverse();
        (grads, routes)
    }

    /// One optimizer step with `grads` (every parameter stepped, as torch
    /// does for a parameter whose gradient exists, zero or not).
    pub fn apply(&mut self, grads: &BTreeMap<String, Vec<f64>>, opt: RefOpt) {
        self.step += 1;
        for (name, p) in self.params.iter_mut() {
            let (Some(g), Some([a, b])) = (grads.get(name), self.state.get_mut(name)) else { continue };
            match opt {
                RefOpt::Sgd { lr, momentum } => sgd(p, g, a, lr, momentum, self.step == 1),
                RefOpt::AdamW { lr, weight_decay } => adamw(p, g, a, b, lr, weight_decay, self.step),
            }
        }
    }

    /// The parameters in [`init_moe`]'s order.
    pub fn named(&self) -> Vec<(String, Vec<f64>)> {
        init_moe(self.shape, 0).into_iter().map(|p| (p.name.clone(), self.p(&p.name).to_vec())).collect()
    }
}
