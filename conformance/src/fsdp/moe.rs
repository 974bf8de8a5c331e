//! A mixture-of-experts test model at the device layer, so it trains on
//! every backend: each rank routes each row to one expert (top-1), so ranks
//! use different experts in a step, in different orders, and skip others.
//!
//! `moe.{l}` (the parent group, run on every rank) holds the router
//! `[experts, d]`; `moe.{l}.experts.{e}` (routed groups) each hold a Linear
//! `d → d` (weight `[d, d]`, bias `[d]`); `head` is a Linear `d → d_out`.
//! Layer `l` maps a row `x` to `x + p_e · relu(W_e x + b_e)` where `e` is the
//! argmax of the router's logits `R x` (lowest index on ties) and `p` their
//! softmax; the loss is the mean squared error of the head's output. The
//! routing decision and the softmax's scalar algebra run on the host (a
//! router's choice is read back there, as MoE implementations do to size
//! their expert batches); every matrix product runs on the device. f32 only.

use chorus_collectives::CommBackend;
use chorus_devices::{Backend, Buffer, ComputeBackend, ComputeStream, DType, MatmulSpec, Stream, StreamExt};
use chorus_fsdp::{Fsdp, FsdpError, ParamInit, Result};
use chorus_train::rng::SplitMix;

type Buf<C> = <<C as CommBackend>::B as Backend>::Buffer;

/// The model's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeShape {
    /// Width of the rows and of every expert.
    pub d: usize,
    /// Experts per layer.
    pub experts: usize,
    /// MoE layers.
    pub layers: usize,
    /// Outputs of the head.
    pub d_out: usize,
}

/// Every parameter's initial values, by name, from `seed`: the router
/// uniform in ±1 (so routing varies from row to row), Linears uniform in
/// ±1/√in as PyTorch's `nn.Linear`.
pub fn init_moe(shape: MoeShape, seed: u64) -> Vec<ParamInit> {
    let mut rng = SplitMix::new(seed);
    let mut uniform = |name: String, dims: Vec<usize>, bound: f32| {
        let values = (0..dims.iter().product::<usize>()).map(|_| rng.uniform(-bound, bound)).collect();
        ParamInit { name, shape: dims, values }
    };
    let (d, b) = (shape.d, 1.0 / (shape.d as f32).sqrt());
    let mut out = Vec::new();
    for l in 0..shape.layers {
        out.push(uniform(format!("moe.{l}.router.weight"), vec![shape.experts, d], 1.0));
        for e in 0..shape.experts {
            out.push(uniform(format!("moe.{l}.experts.{e}.weight"), vec![d, d], b));
            out.push(uniform(format!("moe.{l}.experts.{e}.bias"), vec![d], b));
        }
    }
    out.push(uniform("head.weight".into(), vec![shape.d_out, d], b));
    out.push(uniform("head.bias".into(), vec![shape.d_out], b));
    out
}

/// Each row's expert and gate: the argmax of `logits` (`rows × experts`,
/// lowest index on ties) and the softmax over the row (`probs`).
pub fn route(logits: &[f64], experts: usize) -> (Vec<usize>, Vec<Vec<f64>>) {
    logits
        .chunks(experts.max(1))
        .map(|row| {
            let top = row.iter().enumerate().fold(0, |best, (j, v)| if *v > row[best] { j } else { best });
            let exp: Vec<f64> = row.iter().map(|v| (v - row[top]).exp()).collect();
            let sum: f64 = exp.iter().sum();
            (top, exp.iter().map(|v| v / sum).collect())
        })
        .unzip()
}

/// The model registered with an [`Fsdp`]: per layer a parent group and its
/// routed experts ([`Fsdp::set_routed_groups`]), the head, and the root.
#[derive(Clone, Debug)]
pub struct MoeNet {
    shape: MoeShape,
    parents: Vec<usize>,
    experts: Vec<Vec<usize>>,
    head: usize,
    root: usize,
}

/// One expert's use in a layer's forward: the expert, its rows, their
/// inputs and post-ReLU outputs.
type ExpertUse<C> = (usize, Vec<usize>, Buf<C>, Buf<C>);

/// What one layer's forward keeps for its backward.
struct LayerSaved<C: CommBackend> {
    input: Buf<C>,
    top: Vec<usize>,
    probs: Vec<Vec<f64>>,
    /// In the order used.
    used: Vec<ExpertUse<C>>,
}

fn mm(m: usize, n: usize, k: usize, trans_a: bool, trans_b: bool, accumulate: bool) -> MatmulSpec {
    MatmulSpec { m, n, k, trans_a, trans_b, accumulate }
}

impl MoeNet {
    /// Registers `params` (from [`init_moe`], in its order) as groups of `fsdp`.
    pub fn register<C: CommBackend>(fsdp: &mut Fsdp<C>, shape: MoeShape, params: Vec<ParamInit>) -> Result<MoeNet> {
        let want = init_moe(shape, 0);
        if params.len() != want.len() || params.iter().zip(&want).any(|(p, w)| p.name != w.name || p.shape != w.shape) {
            return Err(FsdpError::InvalidArgument(format!("the parameters do not match the shape {shape:?}")));
        }
        if fsdp.mixed_precision().param() != DType::F32 {
            return Err(FsdpError::InvalidArgument("the MoE test model computes in f32 only".into()));
        }
        let mut it = params.into_iter();
        let mut take = |n: usize| it.by_ref().take(n).collect::<Vec<_>>();
        let (mut parents, mut experts) = (Vec::new(), Vec::new());
        for l in 0..shape.layers {
            let parent = fsdp.add_group(&format!("moe.{l}"), take(1), false)?;
            let mut routed = Vec::new();
            for e in 0..shape.experts {
                routed.push(fsdp.add_group(&format!("moe.{l}.experts.{e}"), take(2), false)?);
            }
            fsdp.set_routed_groups(parent, &routed)?;
            parents.push(parent);
            experts.push(routed);
        }
        let head = fsdp.add_group("head", take(2), false)?;
        let root = fsdp.add_group("root", Vec::new(), true)?;
        Ok(MoeNet { shape, parents, experts, head, root })
    }

    /// The shape.
    pub fn shape(&self) -> MoeShape {
        self.shape
    }

    /// Forward and backward of one micro-batch (`x`: `[rows, d]`, `y`:
    /// `[rows, d_out]`, f32 on the host). Returns the rank's loss (one f32;
    /// read it after synchronizing) and, per layer, the expert each row was
    /// routed to.
    pub fn forward_backward<C: CommBackend>(
        &self,
        fsdp: &mut Fsdp<C>,
        x: &[f32],
        y: &[f32],
    ) -> Result<(Buf<C>, Vec<Vec<usize>>)>
    where
        C::B: ComputeBackend,
    {
        let MoeShape { d, d_out, .. } = self.shape;
        let rows = x.len() / d.max(1);
        if d == 0 || x.len() != rows * d || y.len() != rows * d_out {
            return Err(FsdpError::InvalidArgument(format!(
                "x has {} values and y {}, which are not [rows, {d}] and [rows, {d_out}]",
                x.len(),
                y.len()
            )));
        }
        fsdp.pre_forward(self.root)?;
        let mut h = fsdp.compute_stream().buffer_from(x)?;
        let mut saved = Vec::new();
        for l in 0..self.shape.layers {
            let (next, layer) = self.layer_forward(fsdp, l, h, rows)?;
            saved.push(layer);
            h = next;
        }
        let (head, dh) = (self.head, d);
        let out = fsdp.forward(head, |f| {
            let s = f.compute_stream();
            let out = s.alloc(DType::F32, rows * d_out)?;
            s.matmul(mm(rows, d_out, dh, false, true, false), h.view(), f.param(head, 0)?, out.view())?;
            s.bias_add(out.view(), f.param(head, 1)?)?;
            Ok(out)
        })?;
        fsdp.post_forward(self.root)?;

        let s = fsdp.compute_stream();
        let target = s.buffer_from(y)?;
        let scale = 1.0 / (rows * d_out).max(1) as f64;
        let loss = s.alloc(DType::F32, 1)?;
        s.mse_loss(out.view(), target.view(), loss.view(), scale)?;
        let grad = s.alloc(DType::F32, rows * d_out)?;
        s.mse_grad(out.view(), target.view(), grad.view(), scale)?;

        fsdp.pre_backward(self.root)?;
        let mut dh_buf = fsdp.backward(head, |f| {
            let s = f.compute_stream();
            s.matmul(mm(d_out, dh, rows, true, false, true), grad.view(), h.view(), f.grad(head, 0)?)?;
            s.column_sums(grad.view(), f.grad(head, 1)?, true)?;
            let dx = s.alloc(DType::F32, rows * dh)?;
            s.matmul(mm(rows, dh, d_out, false, false, false), grad.view(), f.param(head, 0)?, dx.view())?;
            Ok(dx)
        })?;
        let routes = saved.iter().map(|s| s.top.clone()).collect();
        for (l, layer) in saved.into_iter().enumerate().rev() {
            dh_buf = self.layer_backward(fsdp, l, layer, dh_buf, rows)?;
        }
        fsdp.post_backward(self.root)?;
        Ok((loss, routes))
    }

    fn layer_forward<C: CommBackend>(
        &self,
        fsdp: &mut Fsdp<C>,
        l: usize,
        input: Buf<C>,
        rows: usize,
    ) -> Result<(Buf<C>, LayerSaved<C>)>
    where
        C::B: ComputeBackend,
    {
        let MoeShape { d, experts, .. } = self.shape;
        let parent = self.parents[l];
        fsdp.pre_forward(parent)?;
        let s = fsdp.compute_stream();
        let logits = s.alloc(DType::F32, rows * experts)?;
        s.matmul(mm(rows, experts, d, false, true, false), input.view(), fsdp.param(parent, 0)?, logits.view())?;
        let host: Vec<f64> = s.read_vec::<f32>(logits.view())?.into_iter().map(f64::from).collect();
        let (top, probs) = route(&host, experts);
        let out = s.alloc(DType::F32, rows * d)?;
        s.copy(input.view(), out.view())?;
        // Experts in the order this rank's rows first use them: the order differs across ranks.
        let mut order: Vec<usize> = Vec::new();
        for e in &top {
            if !order.contains(e) {
                order.push(*e);
            }
        }
        let mut used = Vec::new();
        for e in order {
            let g = self.experts[l][e];
            let mine: Vec<usize> = (0..rows).filter(|r| top[*r] == e).collect();
            let n = mine.len();
            let (xe, he) = fsdp.forward(g, |f| {
                let s = f.compute_stream();
                let xe = s.alloc(DType::F32, n * d)?;
                for (j, r) in mine.iter().enumerate() {
                    s.copy(input.slice(r * d, d)?, xe.slice(j * d, d)?)?;
                }
                let he = s.alloc(DType::F32, n * d)?;
                s.matmul(mm(n, d, d, false, true, false), xe.view(), f.param(g, 0)?, he.view())?;
                s.bias_add(he.view(), f.param(g, 1)?)?;
                s.relu(he.view(), he.view())?;
                for (j, r) in mine.iter().enumerate() {
                    s.axpy(probs[*r][e], he.slice(j * d, d)?, out.slice(r * d, d)?)?;
                }
                Ok((xe, he))
            })?;
            used.push((e, mine, xe, he));
        }
        fsdp.post_forward(parent)?;
        Ok((out, LayerSaved { input, top, probs, used }))
    }

    fn layer_backward<C: CommBackend>(
        &self,
        fsdp: &mut Fsdp<C>,
        l: usize,
        saved: LayerSaved<C>,
        grad_out: Buf<C>,
        rows: usize,
    ) -> Result<Buf<C>>
    where
        C::B: ComputeBackend,
    {
        let MoeShape { d, experts, .. } = self.shape;
        let parent = self.parents[l];
        fsdp.pre_backward(parent)?;
        let s = fsdp.compute_stream();
        let dx = s.alloc(DType::F32, rows * d)?;
        s.copy(grad_out.view(), dx.view())?;
        // d loss / d gate of each row: the dot product of its output gradient and its expert's output.
        let dgate = s.alloc(DType::F32, rows.max(1))?;
        for (e, mine, xe, he) in saved.used.iter().rev() {
            let (g, n) = (self.experts[l][*e], mine.len());
            fsdp.backward(g, |f| {
                let s = f.compute_stream();
                let dh = s.alloc(DType::F32, n * d)?;
                for (j, r) in mine.iter().enumerate() {
                    let (dy, hj) = (grad_out.slice(r * d, d)?, he.slice(j * d, d)?);
                    s.matmul(mm(1, 1, d, false, false, false), dy, hj, dgate.slice(*r, 1)?)?;
                    s.copy(dy, dh.slice(j * d, d)?)?;
                    s.scale(dh.slice(j * d, d)?, saved.probs[*r][*e])?;
                }
                s.relu_backward(dh.view(), he.view(), dh.view())?;
                s.matmul(mm(d, d, n, true, false, true), dh.view(), xe.view(), f.grad(g, 0)?)?;
                s.column_sums(dh.view(), f.grad(g, 1)?, true)?;
                let dxe = s.alloc(DType::F32, n * d)?;
                s.matmul(mm(n, d, d, false, false, false), dh.view(), f.param(g, 0)?, dxe.view())?;
                for (j, r) in mine.iter().enumerate() {
                    s.accumulate(dxe.slice(j * d, d)?, dx.slice(r * d, d)?)?;
                }
                Ok(())
            })?;
        }
        let s = fsdp.compute_stream();
        let dg = if saved.used.is_empty() { Vec::new() } else { s.read_vec::<f32>(dgate.view())? };
        // Softmax backward at the chosen expert: d p_e / d z_j = p_e (δ_ej − p_j).
        let mut dlogits = vec![0.0f32; rows * experts];
        for r in 0..rows {
            let (e, p) = (saved.top[r], &saved.probs[r]);
            for j in 0..experts {
                let delta = if j == e { 1.0 } else { 0.0 };
                dlogits[r * experts + j] = (f64::from(dg[r]) * p[e] * (delta - p[j])) as f32;
            }
        }
        let dz = s.buffer_from(&dlogits)?;
        s.matmul(mm(experts, d, rows, true, false, true), dz.view(), saved.input.view(), fsdp.grad(parent, 0)?)?;
        s.matmul(mm(rows, d, experts, false, false, true), dz.view(), fsdp.param(parent, 0)?, dx.view())?;
        fsdp.post_backward(parent)?;
        Ok(dx)
    }
}
