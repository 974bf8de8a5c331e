//! Throughput of a `--model gpt|llama` run: tokens per second (global and
//! per rank) and MFU, per step and as medians, in the progress bar and in
//! `summary.json`.
//!
//! Model FLOPs per token are torchtitan's (`get_dense_model_nparams_and_flops`
//! in `torchtitan/models/utils.py`): 6·N for the parameters' matmuls
//! (forward 2, backward 4), N without the token-embedding table (a lookup,
//! no matmul), plus 12·L·H·Dh·T for attention's two matmuls per layer (Q·Kᵀ
//! and P·V), not halved for the causal mask, as torchtitan counts, and
//! recomputation (`--recompute`) not counted. A tied table (a Llama with
//! `tie_word_embeddings`) is the output projection too, so it stays in N.
//! docs/llama.md writes the formula out. MFU is the model FLOPs one rank
//! computes per second over one device's peak, in percent, as torchtitan's
//! `mfu(%)`; the peak is `--peak-tflops` or known for the GPU (bf16 dense,
//! torchtitan's `get_peak_flops` numbers), and the CPU has none.

use indicatif::{ProgressState, ProgressStyle};
use serde_json::{json, Map, Value};

use chorus_train::models::gpt::GptConfig;
use chorus_train::models::llama::config::LlamaConfig;
use chorus_train::models::moe::MoeConfig;

use super::args::TrainArgs;
use super::report::median;
use crate::job::ModelArg;
use crate::usage;

/// What one step computes and against which peak.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Throughput {
    /// Tokens one rank trains on per step (its batch × the sequence length).
    pub tokens_per_rank_step: f64,
    /// Ranks.
    pub world: usize,
    /// Model FLOPs per token ([`flops_per_token`]).
    pub flops_per_token: f64,
    /// One device's peak in FLOP/s, where known.
    pub peak_flops: Option<f64>,
}

/// Training FLOPs per token: 6·`params` (without the embedding table) +
/// 12·`layers`·`heads`·`head_dim`·`seq_len`.
pub(super) fn flops_per_token(params: usize, layers: usize, heads: usize, head_dim: usize, seq_len: usize) -> f64 {
    6.0 * params as f64 + 12.0 * layers as f64 * heads as f64 * head_dim as f64 * seq_len as f64
}

/// Peaks (bf16 dense, FLOP/s) by the GPU's name, the more specific first.
const PEAKS: [(&[&str], f64); 6] = [
    (&["h200", "nvl"], 836e12),
    (&["h200"], 989e12),
    (&["h100", "nvl"], 835e12),
    (&["h100", "pcie"], 756e12),
    (&["h100"], 989e12),
    (&["a100"], 312e12),
];

/// The peak of a device called `name` (as the driver names it), where known.
pub(super) fn known_peak(name: &str) -> Option<f64> {
    let name = name.to_ascii_lowercase();
    PEAKS.iter().find(|(words, _)| words.iter().all(|w| name.contains(w))).map(|(_, peak)| *peak)
}

/// One device's peak for a run on `backend`: `--peak-tflops`, else the
/// GPU's where known (the first device: ranks run on alike ones), else none.
pub(super) fn peak_flops(peak_tflops: Option<f64>, backend: crate::backends::Backend) -> Option<f64> {
    if let Some(t) = peak_tflops {
        return Some(t * 1e12);
    }
    gpu_name(backend).as_deref().and_then(known_peak)
}

#[cfg(feature = "cuda")]
fn gpu_name(backend: crate::backends::Backend) -> Option<String> {
    // Candle computes on the GPU only on nccl (a CPU-side run has no peak to compare with).
    if backend.name() != "nccl" {
        return None;
    }
    chorus_devices::cuda::CudaDevice::new(0).ok().map(|d| d.gpu_name().to_string())
}

#[cfg(not(feature = "cuda"))]
fn gpu_name(_backend: crate::backends::Backend) -> Option<String> {
    None
}

/// `--peak-tflops`: a finite number above 0, for the models that report MFU.
pub(super) fn check_peak(args: &TrainArgs) -> anyhow::Result<()> {
    match args.peak_tflops {
        Some(_) if args.model() == ModelArg::Mlp => Err(usage("--peak-tflops is for --model gpt, moe and llama")),
        Some(t) if !(t.is_finite() && t > 0.0) => Err(usage(format!("--peak-tflops {t} must be a finite number > 0"))),
        _ => Ok(()),
    }
}

impl Throughput {
    /// The transformer's: its token embedding is a table apart from the head.
    pub(super) fn gpt(cfg: &GptConfig, args: &TrainArgs) -> Throughput {
        let params = cfg.num_params().saturating_sub(cfg.vocab.saturating_mul(cfg.d_model));
        let flops = flops_per_token(params, cfg.layers, cfg.heads, cfg.d_model / cfg.heads.max(1), cfg.seq_len);
        Throughput::of(args, cfg.seq_len, flops)
    }

    /// The mixture-of-experts transformer's: a token computes with its one
    /// expert per layer (and the router), not the others.
    pub(super) fn moe(cfg: &MoeConfig, args: &TrainArgs) -> Throughput {
        let b = &cfg.base;
        let params = cfg.active_params().saturating_sub(b.vocab.saturating_mul(b.d_model));
        let flops = flops_per_token(params, b.layers, b.heads, b.d_model / b.heads.max(1), b.seq_len);
        Throughput::of(args, b.seq_len, flops)
    }

    /// The Llama's at `seq_len`: its `embed_tokens` table is left out unless
    /// tied (then it is `lm_head` too).
    pub(super) fn llama(cfg: &LlamaConfig, seq_len: usize, args: &TrainArgs) -> Throughput {
        let table = if cfg.tie_word_embeddings { 0 } else { cfg.vocab_size.saturating_mul(cfg.hidden_size) };
        let params = cfg.num_params().saturating_sub(table);
        let flops = flops_per_token(params, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim, seq_len);
        Throughput::of(args, seq_len, flops)
    }

    fn of(args: &TrainArgs, seq_len: usize, flops_per_token: f64) -> Throughput {
        Throughput {
            tokens_per_rank_step: args.job.batch as f64 * seq_len as f64,
            world: args.world(),
            flops_per_token,
            peak_flops: peak_flops(args.peak_tflops, args.backend),
        }
    }

    /// Tokens of one step over all ranks.
    pub(super) fn tokens_per_step(&self) -> f64 {
        self.tokens_per_rank_step * self.world as f64
    }

    /// MFU in percent at `tokens_per_s_per_rank`, where the peak is known.
    fn mfu(&self, tokens_per_s_per_rank: f64) -> Option<f64> {
        self.peak_flops.map(|peak| 100.0 * self.flops_per_token * tokens_per_s_per_rank / peak)
    }

    /// The summary's keys for a run whose steps took `step_times_s`:
    /// per step (`step_tokens_per_s`, `step_tokens_per_s_per_rank`,
    /// `step_mfu`) and their medians (`tokens_per_s`,
    /// `tokens_per_s_per_rank`, `mfu`; null without a peak), the medians
    /// leaving out the first step (it includes the warm-up: candle's first
    /// allocations, FSDP's lazy init) where there are more.
    pub(super) fn summary(&self, step_times_s: &[f64]) -> Map<String, Value> {
        let per_rank: Vec<f64> = step_times_s.iter().map(|t| self.tokens_per_rank_step / t).collect();
        let global: Vec<f64> = per_rank.iter().map(|r| r * self.world as f64).collect();
        let timed = |v: &[f64]| median(if v.len() > 1 { &v[1..] } else { v });
        let mfu: Option<Vec<f64>> = per_rank.iter().map(|r| self.mfu(*r)).collect();
        let summary = json!({
            "tokens_per_step": self.tokens_per_step(),
            "flops_per_token": self.flops_per_token,
            "peak_tflops": self.peak_flops.map(|p| p / 1e12),
            "step_tokens_per_s": global,
            "step_tokens_per_s_per_rank": per_rank,
            "step_mfu": mfu,
            "tokens_per_s": timed(&global),
            "tokens_per_s_per_rank": timed(&per_rank),
            "mfu": mfu.as_deref().map(timed),
        });
        match summary {
            Value::Object(map) => map,
            _ => Map::new(),
        }
    }

    /// The progress bar: the step, the loss (the bar's message) and the
    /// throughput at the bar's recent rate of steps.
    pub(super) fn style(&self) -> ProgressStyle {
        let this = *self;
        let template = "{spinner} step {pos}/{len} [{bar:30}] {msg} {throughput} ({elapsed})";
        ProgressStyle::with_template(template)
            .map(|s| {
                s.progress_chars("=> ").with_key(
                    "throughput",
                    move |state: &ProgressState, w: &mut dyn std::fmt::Write| {
                        let _ = w.write_str(&this.bar_text(state.per_sec()));
                    },
                )
            })
            .unwrap_or_else(|_| ProgressStyle::default_bar())
    }

    /// `N tok/s (M/rank), MFU x%` at `steps_per_s` (nothing before a rate is known).
    fn bar_text(&self, steps_per_s: f64) -> String {
        if !(steps_per_s.is_finite() && steps_per_s > 0.0) {
            return String::new();
        }
        let per_rank = steps_per_s * self.tokens_per_rank_step;
        let mut text = format!("{:.0} tok/s ({:.0}/rank)", per_rank * self.world as f64, per_rank);
        if let Some(mfu) = self.mfu(per_rank) {
            text.push_str(&format!(", MFU {mfu:.1}%"));
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_table_matches_the_most_specific_name() {
        assert_eq!(known_peak("NVIDIA H100 80GB HBM3"), Some(989e12));
        assert_eq!(known_peak("NVIDIA H100 PCIe"), Some(756e12));
        assert_eq!(known_peak("NVIDIA H100 NVL"), Some(835e12));
        assert_eq!(known_peak("NVIDIA H200"), Some(989e12));
        assert_eq!(known_peak("NVIDIA A100-SXM4-80GB"), Some(312e12));
        assert_eq!(known_peak("cpu"), None);
    }

    #[test]
    fn medians_leave_out_the_first_step_and_mfu_needs_a_peak() {
        // 2 ranks of 64 tokens a step; 1000 FLOPs a token; a peak of 1e6 FLOP/s.
        let t = Throughput { tokens_per_rank_step: 64.0, world: 2, flops_per_token: 1000.0, peak_flops: Some(1e6) };
        let s = t.summary(&[10.0, 0.5, 0.25, 1.0]);
        assert_eq!(s["step_tokens_per_s"], json!([12.8, 256.0, 512.0, 128.0]));
        assert_eq!(s["tokens_per_s"], json!(256.0));
        assert_eq!(s["tokens_per_s_per_rank"], json!(128.0));
        // 128 tokens/s per rank × 1000 FLOPs = 1.28e5 of 1e6: 12.8%.
        assert!((s["mfu"].as_f64().unwrap() - 12.8).abs() < 1e-9);
        assert_eq!(s["step_mfu"].as_array().unwrap().len(), 4);
        let none = Throughput { peak_flops: None, ..t }.summary(&[1.0]);
        assert_eq!((none["mfu"].clone(), none["step_mfu"].clone()), (Value::Null, Value::Null));
        assert_eq!(none["tokens_per_s"], json!(128.0));
        assert_eq!(t.bar_text(0.0), "");
        assert_eq!(t.bar_text(2.0), "256 tok/s (128/rank), MFU 12.8%");
    }
}
