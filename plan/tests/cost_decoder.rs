//! decoder_work against closed forms computed here from the shapes alone:
//! torchtitan's FLOPs per token, what recomputation adds, the bytes each
//! recompute mode keeps, and the 8B Llama's parameter count.

use chorus_plan::cost::{KernelCost, KernelKind, KernelOp};
use chorus_plan::decoder_cost::{matmul_param_count, param_count, Framework};
use chorus_plan::workload::{DecoderKind, DecoderShape, RecomputeMode, StageWork};

fn llama_8b() -> DecoderShape {
    DecoderShape::llama_3_1_8b()
}

/// A tiny GQA Llama: d 64, 4 heads of 16, 2 key/value heads, ffn 96, vocab 50.
fn tiny_llama() -> DecoderShape {
    DecoderShape {
        kind: DecoderKind::Llama,
        layers: 3,
        d_model: 64,
        heads: 4,
        kv_heads: 2,
        ffn_hidden: 96,
        vocab: 50,
        tied_embeddings: false,
    }
}

fn tiny_gpt() -> DecoderShape {
    DecoderShape {
        kind: DecoderKind::Gpt,
        layers: 2,
        d_model: 32,
        heads: 4,
        kv_heads: 4,
        ffn_hidden: 128,
        vocab: 40,
        tied_embeddings: false,
    }
}

fn flops(stages: &[StageWork], backward: bool, kinds: &[KernelKind]) -> f64 {
    stages
        .iter()
        .flat_map(|s| if backward { &s.backward } else { &s.forward })
        .filter(|k| kinds.contains(&k.kind))
        .map(|k| k.flops)
        .sum()
}

fn total(stages: &[StageWork]) -> f64 {
    let all = [KernelKind::Gemm, KernelKind::Attention, KernelKind::MemoryBound];
    flops(stages, false, &all) + flops(stages, true, &all)
}

#[test]
fn the_8b_llama_has_8_03_billion_parameters() {
    let s = llama_8b();
    // Embedding and head 128256 × 4096 each; per layer q, o 4096², k, v
    // 4096 × 1024, gate, up, down 4096 × 14336, two norms; the final norm.
    let per_layer: u64 = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096;
    let expected = 2 * 128256 * 4096 + 32 * per_layer + 4096;
    assert_eq!(param_count(&s), expected);
    assert_eq!(param_count(&s), 8_030_261_248);
    // torchtitan's N leaves out the table and the norms.
    assert_eq!(matmul_param_count(&s), 128256 * 4096 + 32 * (per_layer - 2 * 4096));
}

#[test]
fn forward_gemm_flops_are_twice_the_matmul_parameters_per_token() {
    for (shape, per_layer) in [
        // q 64², k, v 64 × 32, o 64², gate, up, down 64 × 96.
        (tiny_llama(), 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96),
        // q, k, v, o 32², up, down 32 × 128.
        (tiny_gpt(), 4 * 32 * 32 + 2 * 32 * 128),
    ] {
        let n = (shape.layers * per_layer + shape.vocab * shape.d_model) as f64;
        let (b, s) = (2, 12);
        for fw in [Framework::TorchEager, Framework::Candle, Framework::Chorus] {
            let stages = fw.decoder_work(&shape, b, s, 2, RecomputeMode::None);
            let tokens = (b * s) as f64;
            assert_eq!(flops(&stages, false, &[KernelKind::Gemm]) / tokens, 2.0 * n, "{fw:?} {:?}", shape.kind);
            // Attention: Q·Kᵀ and P·V, 2·S·Dh per head each, per token and layer.
            let attention = shape.layers as f64 * 4.0 * s as f64 * shape.d_model as f64;
            assert_eq!(flops(&stages, false, &[KernelKind::Attention]) / tokens, attention);
        }
    }
}

#[test]
fn training_flops_per_token_are_torchtitans_formula_and_full_recompute_adds_a_forward() {
    let shape = tiny_llama();
    let (b, s) = (3, 16);
    let tokens = (b * s) as f64;
    let n = matmul_param_count(&shape) as f64;
    let (l, h, dh) = (shape.layers as f64, shape.heads as f64, (shape.d_model / shape.heads) as f64);
    let none = Framework::TorchEager.decoder_work(&shape, b, s, 2, RecomputeMode::None);
    assert_eq!(total(&none) / tokens, 6.0 * n + 12.0 * l * h * dh * s as f64);

    // torchtitan recomputes the blocks only: one more forward of every layer.
    let layer_forward = l * (2.0 * (n - (shape.vocab * shape.d_model) as f64) / l + 4.0 * s as f64 * h * dh);
    let full = Framework::TorchEager.decoder_work(&shape, b, s, 2, RecomputeMode::Full);
    assert_eq!(total(&full) / tokens, 6.0 * n + 12.0 * l * h * dh * s as f64 + layer_forward);

    // Selective recomputes the 2nd, 4th and 6th matmul of a layer: k, o, up.
    let (d, kv, f) = (64.0, 32.0, 96.0);
    let selective = Framework::TorchEager.decoder_work(&shape, b, s, 2, RecomputeMode::Selective);
    let extra = l * 2.0 * (d * kv + d * d + d * f);
    assert_eq!(total(&selective) / tokens, 6.0 * n + 12.0 * l * h * dh * s as f64 + extra);
}

#[test]
fn recomputation_comes_first_in_the_backward() {
    let stages = Framework::TorchEager.decoder_work(&tiny_llama(), 1, 8, 2, RecomputeMode::Full);
    let layer = &stages[1];
    assert_eq!(layer.name, "layers.0");
    let n = layer.forward.len();
    assert!(layer.backward[..n].iter().all(|k| k.name.starts_with("recompute.")));
    assert!(layer.backward[n..].iter().all(|k| !k.name.starts_with("recompute.")));
    let names: Vec<&str> = stages.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["embed", "layers.0", "layers.1", "layers.2", "head"]);
}

#[test]
fn saved_bytes_per_mode_match_the_hand_count() {
    let shape = tiny_llama();
    let (b, s, c) = (2usize, 8usize, 2usize);
    let t = (b * s) as u64;
    let (d, q, kv, f, h, c) = (64u64, 64u64, 32u64, 96u64, 4u64, c as u64);
    let input = t * d * c;
    let layer = |mode| Framework::TorchEager.decoder_work(&shape, b, s, c as usize, mode)[1].saved_bytes;
    assert_eq!(layer(RecomputeMode::Full), input);
    // Selective: the layer input, the outputs of q, v, gate and down (1st,
    // 3rd, 5th, 7th matmul), attention's output and its f32 log-sum-exp.
    let lse = b as u64 * h * s as u64 * 4;
    assert_eq!(
        layer(RecomputeMode::Selective),
        input + t * q * c + t * kv * c + t * q * c + lse + t * f * c + t * d * c
    );
    // None, PyTorch: per norm the f32 input, the f32 mean, the normalized
    // value and the output (not the bf16 input: the f32 cast is what the
    // norm's backward reads); attention's q, k, v (repeated to the query
    // width), output (o_proj's input is a view of it) and log-sum-exp; the
    // MLP's gate output, silu output, up output and their product.
    // (`saved_torch.rs` checks the same count against PyTorch's autograd.)
    let norm = t * d * 4 + t * 4 + t * d * c + t * d * c;
    let attention = 4 * t * q * c + lse;
    assert_eq!(layer(RecomputeMode::None), 2 * norm + attention + 4 * t * f * c);
    // In f32 the norm reads its input itself, so the input is kept.
    let f32_norm = t * 4 + t * d * 4 + t * d * 4;
    let none_f32 = Framework::TorchEager.decoder_work(&shape, b, s, 4, RecomputeMode::None)[1].saved_bytes;
    let f32_attention = 4 * t * q * 4 + lse;
    assert_eq!(none_f32, t * d * 4 + 2 * f32_norm + t * d * 4 + f32_attention + 4 * t * f * 4);
    // The embedding keeps its ids; the head its loss's log-softmax (f32)
    // and the final norm's, whatever the mode (torchtitan checkpoints blocks only).
    for mode in [RecomputeMode::None, RecomputeMode::Full, RecomputeMode::Selective] {
        let stages = Framework::TorchEager.decoder_work(&shape, b, s, c as usize, mode);
        assert_eq!(stages[0].saved_bytes, t * 8);
        assert_eq!(stages[4].saved_bytes, norm + t * 50 * 4);
    }
}

#[test]
fn candle_keeps_every_intermediate_and_its_attention_scores() {
    let shape = tiny_gpt();
    let (b, s) = (2usize, 8usize);
    let none = Framework::Candle.decoder_work(&shape, b, s, 4, RecomputeMode::None);
    let full = Framework::Candle.decoder_work(&shape, b, s, 4, RecomputeMode::Full);
    let probs = (b * shape.heads * s * s * 4) as u64;
    let layer_none = &none[1];
    // Scores, scaled, masked, softmax's difference, exponent and result: six
    // [b, h, s, s] tensors at least.
    assert!(layer_none.saved_bytes > 6 * probs);
    // Full recomputation keeps the input and rebuilds all of it in backward.
    assert_eq!(full[1].saved_bytes, (b * s * shape.d_model * 4) as u64);
    assert!(full[1].transient_bytes >= layer_none.saved_bytes - full[1].saved_bytes);
    // torch's flash attention has no score matrix at all.
    let torch = Framework::TorchEager.decoder_work(&shape, b, s, 4, RecomputeMode::None);
    assert!(torch[1].saved_bytes < layer_none.saved_bytes);
}

#[test]
fn the_head_holds_the_logits_working_set() {
    let shape = llama_8b();
    let stages = Framework::TorchEager.decoder_work(&shape, 2, 8192, 2, RecomputeMode::Selective);
    let tv = 2 * 8192 * 128256u64;
    let head = stages.last().map(|s| (s.saved_bytes, s.transient_bytes));
    let (saved, transient) = head.unwrap_or_default();
    assert!(saved >= tv * 4, "log-softmax output kept: {saved}");
    assert!(transient >= tv * 8, "two f32 logit gradients live: {transient}");
}

#[test]
fn zero_sizes_give_no_work_and_no_panic() {
    let mut shape = tiny_llama();
    shape.heads = 0;
    shape.kv_heads = 0;
    let stages = Framework::TorchEager.decoder_work(&shape, 0, 0, 2, RecomputeMode::Selective);
    assert_eq!(stages.len(), shape.layers + 2);
    assert_eq!(total(&stages), 0.0);
}

/// chorus's fused kernels (`Framework::Chorus`) on the tiny GQA Llama in
/// bf16, 2 × 12 tokens: one kernel each way per norm, rotation, attention,
/// SwiGLU and loss; attention's FLOPs `4·B·H·S²·Dh` counted (the kernel does
/// the causal half) and 2.5 times that backward, reading the grouped keys
/// and values where they are (no repeat, no `S × S` buffer); candle's
/// gradient store two kernels per differentiable input; what the graph
/// keeps, closed form.
#[test]
fn chorus_kernels_one_fused_kernel_per_op() {
    let shape = tiny_llama();
    let (b, s, c) = (2.0, 12.0, 2.0);
    let (t, d, f, v) = (b * s, 64.0, 96.0, 50.0);
    let (dq, dkv, h) = (64.0, 32.0, 4.0);
    let stages = Framework::Chorus.decoder_work(&shape, 2, 12, 2, RecomputeMode::None);
    let layer = &stages[1];
    let ops = |ks: &[KernelCost], op| ks.iter().filter(|k| k.op == op).count();
    for (op, back, n) in [
        (KernelOp::RmsNorm, KernelOp::RmsNormBackward, 2),
        (KernelOp::Rope, KernelOp::RopeBackward, 2),
        (KernelOp::Attention, KernelOp::AttentionBackward, 1),
        (KernelOp::Swiglu, KernelOp::SwigluBackward, 1),
    ] {
        assert_eq!((ops(&layer.forward, op), ops(&layer.backward, back)), (n, n), "{op:?}");
    }
    assert_eq!(ops(&layer.forward, KernelOp::Gemm), 7);
    // Forward: the GEMMs, the fused ops and the two residual sums; nothing else.
    assert_eq!(layer.forward.len(), 7 + 2 + 2 + 1 + 1 + 2);
    assert!(!layer.forward.iter().any(|k| k.name.contains("repeat") || k.name.contains("transpose")));
    let attn = layer.forward.iter().find(|k| k.op == KernelOp::Attention).unwrap();
    assert_eq!(attn.flops, 4.0 * b * h * s * s * (dq / h));
    let attn_back = layer.backward.iter().find(|k| k.op == KernelOp::AttentionBackward).unwrap();
    assert_eq!(attn_back.flops, 2.5 * attn.flops);
    let lse = b * h * s * 4.0;
    assert_eq!(attn.bytes, (2.0 * dq + 2.0 * dkv) * t * c + lse);
    // Backward: each op's kernel(s), and a zeros and an add per differentiable input.
    let inputs = 7 * 2 + 2 * 2 + 2 + 3 + 2 + 2 * 2;
    assert_eq!(layer.backward.len(), 7 * 2 + 2 + 2 + 1 + 1 + 2 * inputs);
    assert_eq!(layer.backward.iter().filter(|k| k.name.ends_with(".grad.zeros")).count(), inputs);
    assert!(layer.backward.iter().chain(&layer.forward).all(|k| k.issues == 1));
    // candle's graph keeps every op's output and attention's log-sum-exp;
    // the layer's input is kept as the stage's.
    let x = t * d * c;
    let kept = x // the input
        + 2.0 * x // the two norms' outputs
        + (dq + 2.0 * dkv) * t * c // q, k, v
        + (dq + dkv) * t * c // the rotated q and k
        + dq * t * c + lse // attention's output and log-sum-exp
        + x // the output projection
        + x // the first residual sum
        + 2.0 * f * t * c // gate and up
        + f * t * c // SwiGLU
        + x; // down
    assert_eq!(layer.saved_bytes, kept as u64);
    // The loss: fused, one kernel each way, no f32 copy of the logits; it keeps a log-sum-exp per token.
    let head = stages.last().unwrap();
    assert_eq!(ops(&head.forward, KernelOp::CrossEntropy), 1);
    assert!(!head.forward.iter().any(|k| k.name.contains("to_f32") || k.name.contains("log_softmax")));
    let logits = t * v * c;
    assert_eq!(head.saved_bytes, (x + x + logits + t * 4.0) as u64);
    // The gradient in flight, the one being written and the store's zeros:
    // three of the stage's largest activation (here the norm's output).
    assert_eq!(head.transient_bytes, (3.0 * logits.max(x)) as u64);
}

#[test]
fn chorus_kernels_keep_no_score_matrix() {
    // Four times the sequence at a quarter of the batch: the same tokens.
    // Materialised scores grow with the sequence; chorus's attention keeps
    // a log-sum-exp per query, the same.
    let shape = tiny_llama();
    let saved = |fw: Framework, b, s| fw.decoder_work(&shape, b, s, 2, RecomputeMode::None)[1].saved_bytes;
    assert_eq!(saved(Framework::Chorus, 8, 16), saved(Framework::Chorus, 2, 64));
    assert!(saved(Framework::Candle, 2, 64) > saved(Framework::Candle, 8, 16));
}

/// candle's composed ops list one backward kernel per op; the host issues
/// it with its gradient store's two ops per differentiable input.
#[test]
fn candles_backward_is_issued_with_its_gradient_store() {
    let stages = Framework::Candle.decoder_work(&tiny_llama(), 2, 12, 4, RecomputeMode::None);
    let layer = &stages[1];
    assert!(layer.forward.iter().all(|k| k.issues == 1));
    let issues = |name: &str| layer.backward.iter().find(|k| k.name == name).unwrap().issues;
    // A GEMM's two kernels each carry one input's store: the activation's, the weight's.
    assert_eq!((issues("attn.q.dgrad"), issues("attn.q.wgrad")), (3, 3));
    // One input (an exp), two (a product).
    assert_eq!((issues("attn.softmax.exp.backward"), issues("mlp.mul.backward")), (3, 5));
    // PyTorch's autograd has no such store.
    let torch = Framework::TorchEager.decoder_work(&tiny_llama(), 2, 12, 4, RecomputeMode::None);
    assert!(torch.iter().flat_map(|s| s.forward.iter().chain(&s.backward)).all(|k| k.issues == 1));
}
