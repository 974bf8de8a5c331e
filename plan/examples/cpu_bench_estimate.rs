//! The cpu model applied by hand to `chorus train --bench --model gpt` (the
//! transformer d_model 64 × 2 blocks, 4 heads, d_ff 256, vocab 29, 8
//! sequences of 32 tokens per rank, f32, every group recomputed, AdamW) at
//! 1 and 2 sim ranks: every kernel of `decoder_work` at the calibrated
//! rates, AdamW on the local shard, and each rank's collectives (all-gather
//! per block forward and backward, the root once; one reduce-scatter per
//! group; the loss all-reduce) added rather than overlapped, since the sim's
//! collectives run on the same two cores. FSDP's host time in its hooks is
//! not a kernel and is left out (the bench reports it separately).
//!
//! `cargo run -p chorus-plan --example cpu_bench_estimate`

use chorus_collectives::OpKind;
use chorus_plan::cost::{CollectiveShape, CostModel, KernelCost, KernelKind};
use chorus_plan::cpu_model::CpuModel;
use chorus_plan::decoder_cost::{decoder_work_for, param_count, Framework};
use chorus_plan::workload::{DecoderKind, DecoderShape, RecomputeMode};

fn gpt(d_model: usize, layers: usize) -> DecoderShape {
    DecoderShape {
        kind: DecoderKind::Gpt,
        layers,
        d_model,
        heads: 4,
        kv_heads: 4,
        ffn_hidden: 4 * d_model,
        vocab: 29,
        tied_embeddings: false,
    }
}

/// Kernels of one rank's step at `world` ranks: (seconds at the model's rates, kernel count).
fn kernels(shape: &DecoderShape, model: &CpuModel) -> (f64, usize) {
    let stages = decoder_work_for(Framework::Candle, shape, 8, 32, 4, RecomputeMode::Full);
    let all = || stages.iter().flat_map(|s| s.forward.iter().chain(&s.backward));
    (all().map(|k| model.kernel_seconds(k)).sum(), all().count())
}

fn main() {
    // The microbenchmarks' medians of short runs catch the machine's quiet
    // moments; a whole step does not. How much slower a real step ran at
    // the time is fitted on the larger bench model (d_model 128 × 4 blocks,
    // 1 rank: FSDP step 229.6 / 230.3 / 286.0 ms, median 230.3; its
    // collectives are free at one rank) and applied to the default one.
    let big = gpt(128, 4);
    let big_model = CpuModel::for_ranks(1);
    let (big_s, big_count) = kernels(&big, &big_model);
    let big_n = param_count(&big) as f64;
    let big_adamw = KernelCost { name: "adamw".into(), kind: KernelKind::MemoryBound, flops: 0.0, bytes: big_n * 28.0 };
    let slowdown = 0.2303 / (big_s + big_model.kernel_seconds(&big_adamw));
    println!(
        "fit on d128 x 4 at 1 rank: {big_count} kernels, {:.2} ms at the calibrated rates; the step ran {slowdown:.2}x slower",
        big_s * 1e3
    );
    let shape = gpt(64, 2);
    let n = param_count(&shape) as f64;
    let root = 2.0 * 29.0 * 64.0 + 64.0;
    let block = (n - root) / 2.0;
    // Medians of three runs each, 2026-11-26 01:56 UTC, load average 17.
    for (world, measured_s) in [(1usize, 0.05618), (2, 0.08645)] {
        let model = CpuModel::for_ranks(world);
        let (kernels, count) = kernels(&shape, &model);
        let w = world as f64;
        let adamw = KernelCost { name: "adamw".into(), kind: KernelKind::MemoryBound, flops: 0.0, bytes: n / w * 28.0 };
        let ranks: Vec<usize> = (0..world).collect();
        let call = |op: OpKind, bytes: f64| {
            model.collective_seconds(&CollectiveShape { op, bytes: bytes as u64, ranks: ranks.clone() })
        };
        let comm = call(OpKind::AllGather, root * 4.0)
            + 2.0 * 2.0 * call(OpKind::AllGather, block * 4.0)
            + call(OpKind::ReduceScatter, root * 4.0)
            + 2.0 * call(OpKind::ReduceScatter, block * 4.0)
            + call(OpKind::AllReduce, 4.0);
        let predicted = kernels + model.kernel_seconds(&adamw) + comm;
        let refit = predicted * slowdown;
        println!(
            "world {world}: {count} kernels {:.2} ms + AdamW {:.3} ms + collectives {:.2} ms = {:.2} ms predicted; \
             measured {:.2} ms ({:+.1} %)",
            kernels * 1e3,
            model.kernel_seconds(&adamw) * 1e3,
            comm * 1e3,
            predicted * 1e3,
            measured_s * 1e3,
            (predicted / measured_s - 1.0) * 100.0
        );
        println!(
            "world {world}: times the fitted slowdown {:.2} ms predicted; measured {:.2} ms ({:+.1} %)",
            refit * 1e3,
            measured_s * 1e3,
            (refit / measured_s - 1.0) * 100.0
        );
    }
}
