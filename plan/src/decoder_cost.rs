//! A decoder's work per stage, op by op, from its shapes: the kernels of
//! the forward and the backward (with the recomputation first), and the
//! activation memory kept between them under each [`RecomputeMode`].
//!
//! The ops are those of `train/src/models/llama/mod.rs` and
//! `train/src/models/gpt.rs` in forward order; with [`Framework::TorchEager`]
//! the ones torchtitan's Llama runs in eager PyTorch where the two differ
//! (flash attention through SDPA, complex-multiply RoPE, no copies for head
//! transposes). FLOPs follow torchtitan's count
//! (`torchtitan/models/utils.py`, `get_dense_model_nparams_and_flops`; our
//! `cli/src/train/throughput.rs`): a GEMM of `k → n` on `T` tokens is
//! `2·T·k·n` forward and twice that backward (input and weight gradients);
//! attention is `4·T·S·H·Dh` forward (`Q·Kᵀ` and `P·V`, the full square,
//! not halved for the causal mask) and twice that backward, so one
//! training token costs `6·N + 12·L·H·Dh·S` without recomputation.
//!
//! With [`Framework::Chorus`] the ops are chorus's own fused kernels
//! (crate `chorus-kernels`: RMSNorm, rotary embedding, causal flash
//! attention with grouped-query heads, SwiGLU, cross-entropy) between
//! cuBLAS GEMMs, under candle's autograd: each op one kernel each way, and
//! candle's gradient store listed as the kernels it runs (a `zeros_like`
//! and an `add` per differentiable input of every op, candle-core's
//! `backprop.rs`). Attention's FLOPs are counted as above; the kernel does
//! the causal half, and its backward 2.5 times its forward (it recomputes
//! the scores from the saved log-sum-exp).
//!
//! What the forward keeps ([`RecomputeMode::None`]): candle's autograd
//! graph holds every op's output until the backward, so with
//! [`Framework::Candle`] every intermediate is kept, and with
//! [`Framework::Chorus`] every op's output plus what the fused ops save
//! (attention's and the loss's log-sum-exp); PyTorch's autograd keeps
//! what each op's backward reads (noted per op below). Full recomputation
//! keeps each stage's input only. Selective is torchtitan's op-level
//! policy (`_apply_ac_to_transformer_block`, torchtitan/models/llama3/
//! infra/parallelize.py, Dec 2024; since moved to torchtitan/distributed/
//! activation_checkpoint.py): inside a checkpointed block it saves the
//! outputs of `aten.mm` except every second one (a per-block counter: the
//! 1st, 3rd, 5th … are saved) and of scaled-dot-product attention (its
//! output and log-sum-exp), and recomputes everything else.

use crate::cost::{KernelCost, KernelKind, KernelOp};
use crate::workload::{DecoderKind, DecoderShape, RecomputeMode, StageWork};

/// Whose kernels run the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Framework {
    /// torchtitan's Llama in eager PyTorch on a GPU: SDPA flash attention
    /// (no `S × S` scores in memory), autograd keeping what each backward reads.
    TorchEager,
    /// chorus's candle models: attention with materialized scores, the
    /// graph keeping every intermediate.
    Candle,
    /// chorus's candle models on chorus's own fused kernels (`chorus-kernels`):
    /// flash attention (no `S × S` scores), one kernel per norm, rotary
    /// embedding, SwiGLU and loss, the graph keeping every op's output.
    Chorus,
}

impl Framework {
    /// The stages of `shape` for one micro-batch of `micro_batch` sequences
    /// of `seq_len` tokens, computed in `compute_dtype_bytes`-byte floats,
    /// under `recompute`, with this framework's kernels.
    pub fn decoder_work(
        self,
        shape: &DecoderShape,
        micro_batch: usize,
        seq_len: usize,
        compute_dtype_bytes: usize,
        recompute: RecomputeMode,
    ) -> Vec<StageWork> {
        let dims = Dims::new(shape, micro_batch, seq_len, compute_dtype_bytes);
        let mut stages = Vec::with_capacity(shape.layers + 2);
        stages.push(embed_stage(self, &dims, shape.vocab as f64, recompute));
        for i in 0..shape.layers {
            let mut t = Trace::new(self, dims.c);
            layer_ops(&mut t, shape, &dims);
            stages.push(t.finish(format!("layers.{i}"), &dims, recompute, true));
        }
        let mut t = Trace::new(self, dims.c);
        rms_norm(&mut t, "norm", &dims);
        t.gemm("lm_head", &dims, dims.d, shape.vocab as f64, false);
        // torchtitan checkpoints the blocks only; `chorus train` recomputes
        // every group's stages whole, the root's (norm and head) included, while
        // the loss outside the stage keeps its graph.
        let recompute_head = self != Framework::TorchEager && recompute != RecomputeMode::None;
        t.outside_checkpoint();
        loss_ops(&mut t, &dims, shape.vocab as f64);
        let mut head = t.finish(
            "head".into(),
            &dims,
            if recompute_head { RecomputeMode::Full } else { RecomputeMode::None },
            false,
        );
        if self != Framework::Chorus {
            // The loss's working set: logits and their f32 copy in forward, the
            // log-softmax's output gradient and input gradient in backward (the
            // fused loss holds no f32 copy: its logits' gradient is the stage's
            // largest activation, in the transient already).
            let tv = dims.tokens * shape.vocab as f64;
            head.transient_bytes = head.transient_bytes.max((tv * 8.0).max(tv * (dims.c + 4.0)) as u64);
        }
        stages.push(head);
        stages
    }
}

/// Parameters of `shape` (embedding, layers, final norm, and the head unless tied).
pub fn param_count(shape: &DecoderShape) -> u64 {
    let (d, v) = (shape.d_model as u64, shape.vocab as u64);
    let table = v.saturating_mul(d);
    let head = if shape.tied_embeddings { 0 } else { table };
    table.saturating_add(layer_params(shape).saturating_mul(shape.layers as u64)).saturating_add(d).saturating_add(head)
}

/// The parameters that multiply activations, torchtitan's `N`: all but the
/// embedding table (a lookup) and the norms, the table counted once as the
/// head when tied.
pub fn matmul_param_count(shape: &DecoderShape) -> u64 {
    let (d, v) = (shape.d_model as u64, shape.vocab as u64);
    let norms = 2 * d;
    (layer_params(shape) - norms.min(layer_params(shape))).saturating_mul(shape.layers as u64).saturating_add(v * d)
}

/// One decoder layer's parameters.
fn layer_params(shape: &DecoderShape) -> u64 {
    let d = shape.d_model as u64;
    let dh = head_dim(shape) as u64;
    let (q, kv) = (shape.heads as u64 * dh, shape.kv_heads as u64 * dh);
    let f = shape.ffn_hidden as u64;
    let mlp = match shape.kind {
        DecoderKind::Llama => 3 * d * f,
        DecoderKind::Gpt => 2 * d * f,
    };
    2 * d * q + 2 * d * kv + mlp + 2 * d
}

/// Width of one attention head (`d_model / heads`, as both models define it).
pub fn head_dim(shape: &DecoderShape) -> usize {
    shape.d_model / shape.heads.max(1)
}

/// The sizes every op reads, as floats.
struct Dims {
    b: f64,
    s: f64,
    tokens: f64,
    d: f64,
    c: f64,
}

impl Dims {
    fn new(shape: &DecoderShape, b: usize, s: usize, c: usize) -> Dims {
        let (b, s) = (b as f64, s as f64);
        Dims { b, s, tokens: b * s, d: shape.d_model as f64, c: c as f64 }
    }
}

/// One recorded op.
struct Op {
    forward: KernelCost,
    backward: Vec<KernelCost>,
    /// Bytes of its output.
    out: f64,
    /// Bytes the framework's autograd keeps for the backward because of
    /// this op: PyTorch's, or candle's with chorus's fused ops (their
    /// output and what they save). Candle's composed ops keep their output.
    keep: f64,
    /// Bytes torchtitan's selective policy saves (0: recomputed).
    sac_save: f64,
    /// Inside the checkpointed region (the loss is not).
    checkpointed: bool,
}

/// The ops of one stage, in forward order.
struct Trace {
    framework: Framework,
    c: f64,
    ops: Vec<Op>,
    mm_count: usize,
    checkpointed: bool,
    /// PyTorch in half precision: the stage's first op is a norm that
    /// keeps the f32 cast of the input, not the input itself.
    input_kept_as_f32: bool,
}

fn kernel(name: &str, kind: KernelKind, flops: f64, bytes: f64) -> KernelCost {
    KernelCost::new(name, kind, flops, bytes)
}

/// candle's gradient store for one differentiable input of `bytes`: a
/// `zeros_like` (a fill) and an `add` of the op's gradient into it.
fn grad_store(name: &str, bytes: f64) -> [KernelCost; 2] {
    [
        kernel(&format!("{name}.grad.zeros"), KernelKind::MemoryBound, 0.0, bytes),
        kernel(&format!("{name}.grad.add"), KernelKind::MemoryBound, 0.0, 3.0 * bytes),
    ]
}

/// A backward kernel of candle's composed ops: issued with its gradient
/// store's two ops per differentiable input, which the workload does not
/// list as kernels of their own (their traffic is within the kernel's
/// doubled one, as `Framework::Candle` has always counted it).
fn candle_backward(k: KernelCost, inputs: u32) -> KernelCost {
    KernelCost { issues: 1 + 2 * inputs, ..k }
}

impl Trace {
    fn new(framework: Framework, c: f64) -> Trace {
        Trace { framework, c, ops: Vec::new(), mm_count: 0, checkpointed: true, input_kept_as_f32: false }
    }

    fn outside_checkpoint(&mut self) {
        self.checkpointed = false;
    }

    fn push(&mut self, forward: KernelCost, backward: Vec<KernelCost>, out: f64, keep: f64, sac_save: f64) {
        let checkpointed = self.checkpointed;
        self.ops.push(Op { forward, backward, out, keep, sac_save, checkpointed });
    }

    /// `T × k` times `k × n`; `keep_out`: PyTorch keeps the output (the next
    /// op's backward reads it; candle's graph always does). The selective
    /// policy counts it.
    fn gemm(&mut self, name: &str, dims: &Dims, k: f64, n: f64, keep_out: bool) {
        let (t, c) = (dims.tokens, self.c);
        let flops = 2.0 * t * k * n;
        let bytes = (t * k + k * n + t * n) * c;
        self.mm_count += 1;
        let out = t * n * c;
        let sac_save = if self.mm_count % 2 == 1 { out } else { 0.0 };
        let mut backward = vec![
            kernel(&format!("{name}.dgrad"), KernelKind::Gemm, flops, bytes),
            kernel(&format!("{name}.wgrad"), KernelKind::Gemm, flops, bytes),
        ];
        match self.framework {
            // Each of the two carries one input's gradient store (the activation's, the weight's).
            Framework::Candle => backward = backward.into_iter().map(|k| candle_backward(k, 1)).collect(),
            Framework::Chorus => {
                backward.extend(grad_store(&format!("{name}.input"), t * k * c));
                backward.extend(grad_store(&format!("{name}.weight"), k * n * c));
            }
            Framework::TorchEager => {}
        }
        let keep = if keep_out || self.framework == Framework::Chorus { out } else { 0.0 };
        self.push(kernel(name, KernelKind::Gemm, flops, bytes), backward, out, keep, sac_save);
    }

    /// A memory-bound op reading and writing `bytes` in all, whose output is
    /// `out` bytes, with `inputs` differentiable inputs; its backward reads
    /// the output gradient and what it saved and writes the input
    /// gradients, about twice the traffic.
    fn mem(&mut self, name: &str, bytes: f64, out: f64, keep: f64, inputs: u32) {
        let mut backward = kernel(&format!("{name}.backward"), KernelKind::MemoryBound, 0.0, 2.0 * bytes);
        if self.framework == Framework::Candle {
            backward = candle_backward(backward, inputs);
        }
        self.push(kernel(name, KernelKind::MemoryBound, 0.0, bytes), vec![backward], out, keep, 0.0);
    }

    /// One attention matmul (or the fused kernel) of `flops` forward
    /// (candle's: a batched matmul of two differentiable inputs).
    fn attention(&mut self, name: &str, flops: f64, bytes: f64, out: f64, keep: f64, sac_save: f64) {
        let mut forward = kernel(name, KernelKind::Attention, flops, bytes);
        let mut backward = kernel(&format!("{name}.backward"), KernelKind::Attention, 2.0 * flops, 2.0 * bytes);
        match self.framework {
            // candle's attention is two batched cuBLAS matmuls over the whole square.
            Framework::Candle => {
                forward = forward.with_op(KernelOp::Gemm);
                backward = candle_backward(backward.with_op(KernelOp::Gemm), 2);
            }
            _ => backward = backward.with_op(KernelOp::AttentionBackward),
        }
        self.push(forward, vec![backward], out, keep, sac_save);
    }

    /// One of chorus's fused ops (`op` forward, `backward_op` backward):
    /// `fwd` and `bwd` its (FLOPs, bytes), `held` the bytes of its output
    /// and of what candle's graph keeps of it (with what the op saves),
    /// `inputs` the bytes of each differentiable input (each with its
    /// gradient store).
    fn fused(
        &mut self,
        name: &str,
        (op, backward_op): (KernelOp, KernelOp),
        fwd: (f64, f64),
        bwd: (f64, f64),
        (out, keep): (f64, f64),
        inputs: &[(&str, f64)],
    ) {
        let kind = if fwd.0 > 0.0 { KernelKind::Attention } else { KernelKind::MemoryBound };
        let mut backward = vec![kernel(&format!("{name}.backward"), kind, bwd.0, bwd.1).with_op(backward_op)];
        for (input, bytes) in inputs {
            backward.extend(grad_store(&format!("{name}.{input}"), *bytes));
        }
        self.push(kernel(name, kind, fwd.0, fwd.1).with_op(op), backward, out, keep, 0.0);
    }

    /// candle's own element-wise op under chorus's kernels (a residual sum,
    /// a cast): its backward is its gradient store alone.
    fn candle_op(&mut self, name: &str, bytes: f64, out: f64, inputs: &[(&str, f64)]) {
        let backward = inputs.iter().flat_map(|(input, b)| grad_store(&format!("{name}.{input}"), *b)).collect();
        self.push(kernel(name, KernelKind::MemoryBound, 0.0, bytes), backward, out, out, 0.0);
    }

    /// The stage: its kernels and memory under `mode` (`checkpointable`:
    /// whether `mode` applies to it; torchtitan checkpoints the blocks only).
    fn finish(self, name: String, dims: &Dims, mode: RecomputeMode, checkpointable: bool) -> StageWork {
        let mode = if checkpointable || self.framework != Framework::TorchEager { mode } else { RecomputeMode::None };
        let input = dims.tokens * dims.d * dims.c;
        let kept = |op: &Op| match self.framework {
            Framework::Candle => op.out,
            Framework::TorchEager | Framework::Chorus => op.keep,
        };
        let recomputed = |op: &Op| {
            op.checkpointed
                && match mode {
                    RecomputeMode::None => false,
                    RecomputeMode::Full => true,
                    RecomputeMode::Selective => op.sac_save == 0.0,
                }
        };
        // A checkpointed region keeps its input whatever runs inside it;
        // without one, autograd keeps only what the ops' backwards read.
        let mut saved = if self.input_kept_as_f32 && mode == RecomputeMode::None { 0.0 } else { input };
        let mut rebuilt = 0.0;
        for op in &self.ops {
            match (op.checkpointed, mode) {
                (false, _) | (true, RecomputeMode::None) => saved += kept(op),
                (true, RecomputeMode::Full) => rebuilt += kept(op),
                (true, RecomputeMode::Selective) if op.sac_save > 0.0 => saved += op.sac_save,
                (true, RecomputeMode::Selective) => rebuilt += kept(op),
            }
        }
        let largest = self.ops.iter().map(|op| op.out).fold(0.0, f64::max);
        let mut backward: Vec<KernelCost> = self
            .ops
            .iter()
            .filter(|op| recomputed(op))
            .map(|op| KernelCost { name: format!("recompute.{}", op.forward.name), ..op.forward.clone() })
            .collect();
        backward.extend(self.ops.iter().rev().flat_map(|op| op.backward.iter().cloned()));
        StageWork {
            name,
            forward: self.ops.iter().map(|op| op.forward.clone()).collect(),
            backward,
            saved_bytes: saved as u64,
            // What the recomputation rebuilds lives through the stage's
            // backward; the gradient in flight and the one being written
            // are at most two of the largest activation (three under
            // chorus's kernels, whose gradient store's `zeros_like` is
            // live beside them).
            transient_bytes: (rebuilt + largest * if self.framework == Framework::Chorus { 3.0 } else { 2.0 }) as u64,
        }
    }
}

/// RMSNorm as both implementations compute it (candle-nn's `forward_diff`,
/// torchtitan's `RMSNorm`): to f32, square, mean, scale by the reciprocal
/// root, back to the compute dtype, times the weight. PyTorch keeps the f32
/// input (for `pow` and the scaling), the normalized value (for the
/// weight's gradient) and the output (the next GEMMs read it). chorus's
/// fused kernel reads the input and the weight and writes the output (its
/// backward recomputes the reciprocal root from the input).
fn rms_norm(t: &mut Trace, name: &str, dims: &Dims) {
    let (n, c) = (dims.tokens * dims.d, t.c);
    if t.framework == Framework::Chorus {
        let w = dims.d * c;
        let fwd = (0.0, 2.0 * n * c + w);
        let bwd = (0.0, 3.0 * n * c + w + dims.d * 4.0);
        let norm = (KernelOp::RmsNorm, KernelOp::RmsNormBackward);
        t.fused(name, norm, fwd, bwd, (n * c, n * c), &[("input", n * c), ("weight", w)]);
        return;
    }
    let half = c < 4.0;
    if half && t.ops.is_empty() && t.framework == Framework::TorchEager {
        t.input_kept_as_f32 = true;
    }
    if half {
        t.mem(&format!("{name}.to_f32"), n * (c + 4.0), n * 4.0, n * 4.0, 1);
    }
    t.mem(&format!("{name}.square"), n * 8.0, n * 4.0, 0.0, 1);
    t.mem(&format!("{name}.mean"), n * 4.0 + dims.tokens * 4.0, dims.tokens * 4.0, dims.tokens * 4.0, 1);
    t.mem(&format!("{name}.scale"), n * 8.0, n * 4.0, if half { 0.0 } else { n * 4.0 }, 2);
    if half {
        t.mem(&format!("{name}.to_dtype"), n * (4.0 + c), n * c, n * c, 1);
    }
    t.mem(&format!("{name}.weight"), n * 2.0 * c + dims.d * c, n * c, n * c, 2);
}

/// RoPE on `n` elements (queries or keys) of `seq` positions and heads
/// `head_dim` wide: candle's rotate-half (negate, concatenate, two
/// products, a sum), torchtitan's complex product (to f32, multiply, back)
/// or chorus's fused kernel on `[batch, seq, heads, head_dim]` (reading
/// the f32 cosine and sine tables, built once per device). PyTorch keeps
/// neither output: attention keeps its inputs.
fn rope(t: &mut Trace, name: &str, n: f64, seq: f64, head_dim: f64) {
    let c = t.c;
    match t.framework {
        Framework::Candle => {
            t.mem(&format!("{name}.rope.neg"), n * c, n * c / 2.0, 0.0, 1);
            t.mem(&format!("{name}.rope.cat"), 2.0 * n * c, n * c, 0.0, 2);
            t.mem(&format!("{name}.rope.cos"), 2.0 * n * c, n * c, 0.0, 1);
            t.mem(&format!("{name}.rope.sin"), 2.0 * n * c, n * c, 0.0, 1);
            t.mem(&format!("{name}.rope.add"), 3.0 * n * c, n * c, 0.0, 2);
        }
        Framework::TorchEager => {
            if c < 4.0 {
                t.mem(&format!("{name}.rope.to_f32"), n * (c + 4.0), n * 4.0, 0.0, 1);
            }
            t.mem(&format!("{name}.rope.mul"), n * 8.0, n * 4.0, 0.0, 1);
            if c < 4.0 {
                t.mem(&format!("{name}.rope.to_dtype"), n * (4.0 + c), n * c, 0.0, 1);
            }
        }
        Framework::Chorus => {
            let io = (0.0, 2.0 * n * c + seq * head_dim * 4.0);
            let ops = (KernelOp::Rope, KernelOp::RopeBackward);
            t.fused(&format!("{name}.rope"), ops, io, io, (n * c, n * c), &[("input", n * c)]);
        }
    }
}

/// One decoder layer: `x + attn(norm(x))`, then `+ mlp(norm(·))`.
fn layer_ops(t: &mut Trace, shape: &DecoderShape, dims: &Dims) {
    let (tok, d, c) = (dims.tokens, dims.d, t.c);
    let dh = head_dim(shape) as f64;
    let (hq, hkv) = (shape.heads as f64, shape.kv_heads as f64);
    let (dq, dkv, f) = (hq * dh, hkv * dh, shape.ffn_hidden as f64);
    let llama = shape.kind == DecoderKind::Llama;
    let candle = t.framework == Framework::Candle;
    let chorus = t.framework == Framework::Chorus;

    rms_norm(t, "attn_norm", dims);
    t.gemm("attn.q", dims, d, dq, false);
    t.gemm("attn.k", dims, d, dkv, false);
    t.gemm("attn.v", dims, d, dkv, false);
    if candle {
        // `reshape(b, t, heads, hd).transpose(1, 2).contiguous()` copies.
        for (name, n) in [("attn.q.heads", tok * dq), ("attn.k.heads", tok * dkv), ("attn.v.heads", tok * dkv)] {
            t.mem(name, 2.0 * n * c, n * c, 0.0, 1);
        }
    }
    if llama {
        rope(t, "attn.q", tok * dq, dims.s, dh);
        rope(t, "attn.k", tok * dkv, dims.s, dh);
    }
    if dkv < dq && !chorus {
        // Grouped-query attention repeats each key/value head (transformers'
        // `repeat_kv`, torchtitan's `repeat_kv`): a copy to the query width.
        // chorus's kernel reads the grouped heads where they are.
        t.mem("attn.k.repeat", (tok * dkv + tok * dq) * c, tok * dq * c, 0.0, 1);
        t.mem("attn.v.repeat", (tok * dkv + tok * dq) * c, tok * dq * c, 0.0, 1);
    }
    // Each of Q·Kᵀ and P·V: 2·S·Dh FLOPs per token per head.
    let matmul_flops = 2.0 * tok * dims.s * dq;
    let probs = dims.b * hq * dims.s * dims.s;
    let lse = dims.b * hq * dims.s * 4.0;
    match t.framework {
        Framework::TorchEager => {
            // SDPA (flash) keeps q, k, v, its output and the log-sum-exp.
            let io = 4.0 * tok * dq * c;
            t.attention("attn.sdpa", 2.0 * matmul_flops, io + lse, tok * dq * c, io + lse, tok * dq * c + lse);
        }
        Framework::Chorus => {
            // Reads q, k, v (grouped) and writes the output and the
            // log-sum-exp; backward reads those and the output's gradient
            // and writes q's, k's and v's (and the per-row dot of the
            // output with its gradient).
            let fwd = (2.0 * matmul_flops, (2.0 * dq + 2.0 * dkv) * tok * c + lse);
            let bwd = (2.5 * fwd.0, (4.0 * dq + 4.0 * dkv) * tok * c + 2.0 * lse);
            let inputs = [("q", tok * dq * c), ("k", tok * dkv * c), ("v", tok * dkv * c)];
            let ops = (KernelOp::Attention, KernelOp::AttentionBackward);
            t.fused("attn.flash", ops, fwd, bwd, (tok * dq * c, tok * dq * c + lse), &inputs);
        }
        Framework::Candle => {
            let w = if llama { 4.0 } else { c };
            t.mem("attn.k.transpose", 2.0 * tok * dq * c, tok * dq * c, 0.0, 1);
            t.attention("attn.scores", matmul_flops, (2.0 * tok * dq + probs) * c, probs * c, 0.0, 0.0);
            t.mem("attn.scale", 2.0 * probs * c, probs * c, 0.0, 1);
            t.mem("attn.mask", 2.0 * probs * c + dims.s * dims.s * c, probs * c, 0.0, 1);
            if llama && c < 4.0 {
                t.mem("attn.scores.to_f32", probs * (c + 4.0), probs * 4.0, 0.0, 1);
            }
            // candle-nn's `softmax`: max, subtract, exp, sum, divide.
            t.mem("attn.softmax.max", probs * w, probs / dims.s * w, 0.0, 1);
            t.mem("attn.softmax.sub", 2.0 * probs * w, probs * w, 0.0, 2);
            t.mem("attn.softmax.exp", 2.0 * probs * w, probs * w, 0.0, 1);
            t.mem("attn.softmax.sum", probs * w, probs / dims.s * w, 0.0, 1);
            t.mem("attn.softmax.div", 2.0 * probs * w, probs * w, 0.0, 2);
            if llama && c < 4.0 {
                t.mem("attn.probs.to_dtype", probs * (4.0 + c), probs * c, 0.0, 1);
            }
            t.attention("attn.pv", matmul_flops, (probs + 2.0 * tok * dq) * c, tok * dq * c, 0.0, 0.0);
        }
    }
    if !chorus {
        // `transpose(1, 2).contiguous()` back to `[b, t, heads · hd]`; the
        // output projection keeps it. PyTorch's SDPA returns a transposed
        // view of `[b, t, heads, hd]` memory, so the copy is a no-op and
        // what the projection keeps is the storage SDPA already keeps.
        // chorus's kernel writes `[b, t, heads, hd]`: a reshape, no copy.
        t.mem("attn.out.transpose", 2.0 * tok * dq * c, tok * dq * c, 0.0, 1);
    }
    t.gemm("attn.o", dims, dq, d, false);
    let n = tok * f;
    let x = tok * d * c;
    if chorus {
        t.candle_op("attn.residual", 3.0 * x, x, &[("input", x), ("attn", x)]);
        rms_norm(t, "mlp_norm", dims);
        if llama {
            t.gemm("mlp.gate", dims, d, f, true);
            t.gemm("mlp.up", dims, d, f, true);
            let ops = (KernelOp::Swiglu, KernelOp::SwigluBackward);
            t.fused(
                "mlp.swiglu",
                ops,
                (0.0, 3.0 * n * c),
                (0.0, 5.0 * n * c),
                (n * c, n * c),
                &[("gate", n * c), ("up", n * c)],
            );
        } else {
            // The transformer's GELU is candle's (chorus has no fused GELU):
            // a kernel each way, its gradient store on top.
            t.gemm("mlp.up", dims, d, f, true);
            let gelu = kernel("mlp.gelu", KernelKind::MemoryBound, 0.0, 2.0 * n * c);
            let mut backward = vec![kernel("mlp.gelu.backward", KernelKind::MemoryBound, 0.0, 4.0 * n * c)];
            backward.extend(grad_store("mlp.gelu.input", n * c));
            t.push(gelu, backward, n * c, n * c, 0.0);
        }
        t.gemm("mlp.down", dims, f, d, false);
        // The layer's output is the next stage's input, counted there.
        t.candle_op("mlp.residual", 3.0 * x, 0.0, &[("input", x), ("mlp", x)]);
        return;
    }
    // The residual sum; in f32 the next norm keeps it as its input.
    t.mem("attn.residual", 3.0 * x, x, if c < 4.0 { 0.0 } else { x }, 2);
    rms_norm(t, "mlp_norm", dims);
    if llama {
        // `down(silu(gate(h)) · up(h))`: silu keeps its input, the product both factors.
        t.gemm("mlp.gate", dims, d, f, true);
        t.mem("mlp.silu", 2.0 * n * c, n * c, n * c, 1);
        t.gemm("mlp.up", dims, d, f, true);
        t.mem("mlp.mul", 3.0 * n * c, n * c, n * c, 2);
    } else {
        t.gemm("mlp.up", dims, d, f, true);
        t.mem("mlp.gelu", 2.0 * n * c, n * c, n * c, 1);
    }
    t.gemm("mlp.down", dims, f, d, false);
    t.mem("mlp.residual", 3.0 * x, 0.0, 0.0, 2);
}

/// Cross-entropy over the vocabulary in f32 (`chorus train`: candle-nn's
/// `cross_entropy` of the logits in f32; torchtitan: `cross_entropy(pred.float())`):
/// PyTorch keeps the log-softmax's output; candle keeps each step's.
/// chorus's fused loss reads the logits in their dtype once each way and
/// keeps a log-sum-exp per token (no f32 probabilities).
fn loss_ops(t: &mut Trace, dims: &Dims, vocab: f64) {
    let (tv, c) = (dims.tokens * vocab, t.c);
    if t.framework == Framework::Chorus {
        let small = dims.tokens * 12.0;
        let ops = (KernelOp::CrossEntropy, KernelOp::CrossEntropyBackward);
        t.fused(
            "loss.cross_entropy",
            ops,
            (0.0, tv * c + small),
            (0.0, 2.0 * tv * c + small),
            (4.0, dims.tokens * 4.0),
            &[("logits", tv * c)],
        );
        return;
    }
    if c < 4.0 {
        t.mem("loss.to_f32", tv * (c + 4.0), tv * 4.0, 0.0, 1);
    }
    match t.framework {
        Framework::TorchEager => t.mem("loss.log_softmax", tv * 12.0, tv * 4.0, tv * 4.0, 1),
        _ => {
            t.mem("loss.max", tv * 4.0, dims.tokens * 4.0, 0.0, 1);
            t.mem("loss.sub", tv * 8.0, tv * 4.0, 0.0, 2);
            t.mem("loss.exp", tv * 8.0, tv * 4.0, 0.0, 1);
            t.mem("loss.sum", tv * 4.0, dims.tokens * 4.0, 0.0, 1);
            t.mem("loss.log_softmax", tv * 8.0, tv * 4.0, 0.0, 2);
        }
    }
    t.mem("loss.nll", dims.tokens * 12.0, 4.0, 0.0, 1);
}

/// The token embedding: a gather forward, a scatter-add into a zeroed
/// table gradient backward; the ids are kept (u32 in candle, i64 in PyTorch).
/// candle's recomputation (every group of `chorus train` recomputes by
/// default) runs the gather again first; under chorus's kernels the
/// table's gradient goes through candle's gradient store.
fn embed_stage(framework: Framework, dims: &Dims, vocab: f64, mode: RecomputeMode) -> StageWork {
    let (tok, d, c) = (dims.tokens, dims.d, dims.c);
    let gather = kernel("embed.gather", KernelKind::MemoryBound, 0.0, 2.0 * tok * d * c + tok * 4.0);
    let mut backward = Vec::new();
    if framework != Framework::TorchEager && mode != RecomputeMode::None {
        backward.push(KernelCost { name: format!("recompute.{}", gather.name), ..gather.clone() });
    }
    let scatter = kernel("embed.scatter_add", KernelKind::MemoryBound, 0.0, vocab * d * c + 2.0 * tok * d * c);
    match framework {
        Framework::Candle => backward.push(candle_backward(scatter, 1)),
        Framework::Chorus => {
            backward.push(scatter);
            backward.extend(grad_store("embed.weight", vocab * d * c));
        }
        Framework::TorchEager => backward.push(scatter),
    }
    StageWork {
        name: "embed".into(),
        forward: vec![gather],
        backward,
        saved_bytes: (tok * if framework == Framework::TorchEager { 8.0 } else { 4.0 }) as u64,
        transient_bytes: 0,
    }
}
