//! `chorus train`: a model under FSDP on simulated ranks (or a GPU backend):
//! the transformer through the candle adapter (`--model gpt`, the default),
//! the transformer with mixture-of-experts MLPs (`--model moe --experts N`),
//! a Hugging Face Llama, HF weights in and out (`--model llama`),
//! or the reference MLP (`--model mlp`, with PyTorch-compatible `.npy` input
//! and output, and `--bench` for FSDP's step time and host overhead).
//!
//! Nothing is written before the arguments are checked (bad ones exit 2,
//! the memory a run needs and the paths included); the out-dir (and the
//! checkpoint directory) is locked against another run, and the out-dir is
//! replaced when the run has written everything, only while it holds just
//! what a chorus run wrote ([`crate::outdir`]); a checkpoint directory with
//! another run's checkpoints is refused to a run not resuming from it; a
//! loss that stops being finite stops the run, which then writes its
//! summary marked failed.
//!
//! This file only dispatches. The job (model, data shape, FSDP, optimizer,
//! dtypes) is [`crate::job`]'s, shared with `chorus plan`; `args.rs` holds
//! the run's own arguments and their checks, `memory.rs` the memory check,
//! `loop_args.rs` the decoder loop's (schedule, validation, sample);
//! `ranks.rs` runs a job on the ranks of any backend; `resume.rs` checks a
//! `--resume` checkpoint against the run; `mlp.rs`, `gpt.rs` (and `moe.rs`)
//! and `llama.rs` train each model, `text_data.rs` reads the text they train
//! on, `outputs.rs` writes what the decoders' runs write alike; `gpt_bench.rs`
//! measures the transformer against plain candle (the MLP's benchmark is in
//! `mlp.rs`); `throughput.rs` gives tokens/s and MFU, `op_times.rs` the fused
//! ops' time per step (`--op-times`); `report.rs` holds what every run says
//! (lines on stdout, medians, loss summaries).

mod args;
mod gpt;
mod gpt_bench;
mod llama;
mod loop_args;
mod memory;
mod mlp;
mod moe;
mod op_times;
mod outputs;
mod ranks;
mod report;
mod resume;
mod text_data;
mod throughput;

#[cfg(test)]
pub(crate) use args::file_scope;
pub use args::{SaveDtypeArg, TrainArgs};

use crate::job::ModelArg;
use crate::Outcome;

/// Runs `chorus train`, its arguments read from this process's command
/// line with `--config`'s file.
pub fn run() -> anyhow::Result<Outcome> {
    let args = TrainArgs::resolve()?;
    args.usage()?;
    let args = &resume::resolve_auto(args)?;
    ranks::check_cpu_cache_setting()?;
    memory::check(args)?;
    throughput::check_peak(args)?;
    op_times::check(args)?;
    match (args.model(), args.bench) {
        (ModelArg::Mlp, false) => mlp::run(args),
        (ModelArg::Gpt, false) => gpt::run::<chorus_train::models::gpt::GptModel>(args),
        (ModelArg::Moe, false) => gpt::run::<chorus_train::models::moe::MoeModel>(args),
        // Refused by `usage` above already.
        (ModelArg::Moe, true) => Err(crate::usage(args::NO_MOE_BENCH)),
        (ModelArg::Mlp, true) => mlp::bench(args),
        (ModelArg::Gpt | ModelArg::Llama, true) => gpt_bench::run(args),
        (ModelArg::Llama, false) => llama::run(args),
    }
}
