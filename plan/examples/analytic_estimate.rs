//! The planner's constants applied by hand to torchtitan's published Llama
//! 3.1 8B runs (benchmarks/llama3_h100_202412_torchtitan.md): step time and
//! peak memory from `decoder_work` and the GPU model, with the overlap
//! assumed rather than simulated (every all-gather and reduce-scatter
//! hidden under compute except the first all-gather and the last
//! reduce-scatter). The virtual run (`chorus plan`) replaces this estimate
//! with the FSDP state machine's own schedule; this is the check that the
//! constants land near the published numbers before it exists.
//!
//! `cargo run --release -p chorus-plan --example analytic_estimate`

use chorus_collectives::OpKind;
use chorus_plan::cost::{CollectiveShape, KernelCost, KernelKind};
use chorus_plan::decoder_cost::{param_count, Framework};
use chorus_plan::gpu::cost_model;
use chorus_plan::workload::{DecoderShape, RecomputeMode};

const GIB: f64 = (1u64 << 30) as f64;

struct Published {
    name: &'static str,
    gpu: &'static str,
    gpus: usize,
    batch: usize,
    tokens_per_s: f64,
    /// Not published for every row.
    memory_gib: Option<f64>,
}

fn main() -> Result<(), String> {
    let shape = DecoderShape::llama_3_1_8b();
    let s = 8192usize;
    let rows = [
        Published {
            name: "Table 1: FSDP, 8 GPUs",
            gpu: "h100-sxm-500w",
            gpus: 8,
            batch: 2,
            tokens_per_s: 5762.0,
            memory_gib: Some(82.4),
        },
        Published {
            name: "Table 3: FSDP, 128 GPUs",
            gpu: "h100-sxm-500w",
            gpus: 128,
            batch: 2,
            tokens_per_s: 5605.0,
            memory_gib: Some(67.0),
        },
        // torchtitan docs/performance.md (2024): Llama 3 8B, FSDP2 on 64 A100
        // 80GB, local batch 1, selective op AC: 2,973 tokens/s (58.2 % MFU).
        Published {
            name: "A100: FSDP, 64 GPUs",
            gpu: "a100-80gb",
            gpus: 64,
            batch: 1,
            tokens_per_s: 2973.0,
            memory_gib: None,
        },
    ];
    let n = param_count(&shape) as f64;
    let (d, v) = (shape.d_model as f64, shape.vocab as f64);
    let layer_params = (n - 2.0 * v * d - d) / shape.layers as f64;
    // torchtitan's root group: the embedding, the final norm and the output.
    let root_params = 2.0 * v * d + d;
    for row in &rows {
        // The published GPU, and for the 500 W rows the same at 700 W to show what the cap costs.
        let kinds: &[&str] = if row.gpu == "h100-sxm-500w" { &[row.gpu, "h100-sxm"] } else { &[row.gpu] };
        for &kind in kinds {
            let b = row.batch;
            let stages = Framework::TorchEager.decoder_work(&shape, b, s, 2, RecomputeMode::Selective);
            let model = cost_model(kind, 8)?;
            let seconds = |k: &KernelCost| model.kernel_seconds(k);
            let by_kind = |kind: KernelKind| -> f64 {
                stages
                    .iter()
                    .flat_map(|st| st.forward.iter().chain(&st.backward))
                    .filter(|k| k.kind == kind)
                    .map(seconds)
                    .sum()
            };
            let (gemm, attn, mem) =
                (by_kind(KernelKind::Gemm), by_kind(KernelKind::Attention), by_kind(KernelKind::MemoryBound));
            {
                let w = row.gpus as f64;
                let local = n / w;
                let mb = |name: &str, bytes: f64| KernelCost::new(name, KernelKind::MemoryBound, 0.0, bytes);
                // FSDP2: copy-in of the bf16 cast of the shard and copy-out of
                // the gathered parameters, forward and backward (blocks and the
                // root reshard after forward); the gradients cast to f32 for the
                // reduce-scatter and the shard accumulated; AdamW (p, g, m, v
                // read, p, m, v written, f32) and the gradient-norm clip.
                let fsdp = [
                    mb("all_gather.copy_in", 2.0 * local * 6.0),
                    mb("all_gather.copy_out", 2.0 * n * 4.0),
                    mb("reduce_scatter.copy_in", n * 6.0),
                    mb("grad.accumulate", local * 12.0),
                    mb("adamw", local * 28.0),
                    mb("clip_grad_norm", local * 12.0),
                ];
                let fsdp_s: f64 = fsdp.iter().map(seconds).sum();
                let ranks: Vec<usize> = (0..row.gpus).collect();
                let call = |op: OpKind, bytes: f64| {
                    model.collective_seconds(&CollectiveShape { op, bytes: bytes as u64, ranks: ranks.clone() })
                };
                let first_ag = call(OpKind::AllGather, root_params * 2.0);
                let last_rs = call(OpKind::ReduceScatter, root_params * 4.0);
                let layer_ag = call(OpKind::AllGather, layer_params * 2.0);
                let layer_rs = call(OpKind::ReduceScatter, layer_params * 4.0);
                let step = gemm + attn + mem + fsdp_s + first_ag + last_rs;
                let tps = (b * s) as f64 / step;
                // Peak at the start of the backward (the head's): f32 parameter
                // shards and AdamW's two moments (gradients are set to None each
                // step and not yet reduced), the root unsharded in bf16 with its
                // output-weight gradient, the last block (not resharded) and the
                // prefetched one, every stage's saved activations and the head's
                // loss working set.
                let states = local * 12.0;
                let unsharded = root_params * 2.0 + v * d * 2.0 + 2.0 * layer_params * 2.0;
                let saved: f64 = stages.iter().map(|st| st.saved_bytes as f64).sum();
                let transient = stages.last().map_or(0.0, |st| st.transient_bytes as f64);
                let peak = states + unsharded + saved + transient;
                println!(
                "{kind:14} {:26} gemm {gemm:.3} s, attention {attn:.3} s, memory-bound {mem:.3} s, fsdp+optimizer {fsdp_s:.3} s, \
                 exposed comm {:.1} ms (per layer all-gather {:.2} ms, reduce-scatter {:.2} ms hidden)",
                row.name,
                (first_ag + last_rs) * 1e3,
                layer_ag * 1e3,
                layer_rs * 1e3,
            );
                println!(
                    "{kind:14} {:26} step {step:.3} s -> {tps:.0} tokens/s/GPU (published {}: {:+.1} %), MFU {:.1} %; \
                 peak {:.1} GiB = states {:.1} + unsharded {:.1} + activations {:.1} + loss {:.1} (published {})",
                    row.name,
                    row.tokens_per_s,
                    (tps / row.tokens_per_s - 1.0) * 100.0,
                    tps * (6.0 * (n - v * d) + 12.0 * 32.0 * 4096.0 * s as f64)
                        / model.peak_flops().unwrap_or(f64::NAN)
                        * 100.0,
                    peak / GIB,
                    states / GIB,
                    unsharded / GIB,
                    saved / GIB,
                    transient / GIB,
                    row.memory_gib.map_or("no memory figure".to_string(), |m| format!(
                        "{m}: {:+.1} %",
                        (peak / GIB / m - 1.0) * 100.0
                    )),
                );
            }
        }
    }
    Ok(())
}
