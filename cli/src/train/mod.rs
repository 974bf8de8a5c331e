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
//! `args.rs` holds the arguments and every check made before anything is
//! written; `job.rs` reads `--config`'s job file into them and writes the
//! effective configuration back (`config.toml`); `ranks.rs` runs a job on the ranks of any backend; `resume.rs` checks a
//! `--resume` checkpoint against the run; `mlp.rs`,
//! `gpt.rs` and `llama.rs` train each model and write its outputs (`gpt.rs`
//! also the mixture-of-experts transformer, `--model moe`, described in `moe.rs`); `gpt_bench.rs` measures
//! the transformer against plain candle (the MLP's benchmark is in `mlp.rs`);
//! `throughput.rs` gives the candle models' tokens/s and MFU, `op_times.rs`
//! their fused ops' time per step (`--op-times`).

mod args;
mod gpt;
mod gpt_bench;
mod job;
mod llama;
mod loop_args;
mod mlp;
mod moe;
mod op_times;
mod outputs;
mod ranks;
mod resume;
mod throughput;

use std::io::Write;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

pub(crate) use args::parse_all_gather_dtype;
pub use args::{BenchPart, ModelArg, SaveDtypeArg, TrainArgs};
pub(crate) use llama::CHECKPOINT_CONFIG as LLAMA_CHECKPOINT_CONFIG;
pub(crate) use ranks::{progress, RankJob};

use crate::backends::Backend;
use crate::{Outcome, UsageError};

/// Runs `chorus train`.
pub fn run(args: &TrainArgs) -> anyhow::Result<Outcome> {
    // SIGUSR1 (a flight-recorder dump) must not end the run while it reads or tokenizes its data.
    chorus_collectives::recorder::answer_signals();
    // Read back from the command line with --config's file and each value's source.
    let args = &job::resolve_process(args)?;
    // --global-batch resolved into the per-rank batch it implies.
    let resolved = args.with_global_batch()?;
    let args = resolved.as_ref().unwrap_or(args);
    args.usage()?;
    throughput::check_peak(args)?;
    op_times::check(args)?;
    match (args.model(), args.bench) {
        (ModelArg::Mlp, false) => mlp::run(args),
        (ModelArg::Gpt, false) => gpt::run::<chorus_train::models::gpt::GptModel>(args),
        (ModelArg::Moe, false) => gpt::run::<chorus_train::models::moe::MoeModel>(args),
        // Refused by `usage` above already.
        (ModelArg::Moe, true) => Err(usage(args::NO_MOE_BENCH)),
        (ModelArg::Mlp, true) => mlp::bench(args),
        (ModelArg::Gpt, true) => gpt_bench::run(args),
        (ModelArg::Llama, false) => llama::run(args),
        (ModelArg::Llama, true) => gpt_bench::run(args),
    }
}

/// The text of a `--text` file (either model's): UTF-8, or else Latin-1
/// (every byte one character), so that any file reads; characters outside
/// the vocabulary become spaces when encoded. Only a regular file is read
/// (a FIFO would block the run).
fn read_text(path: &std::path::Path) -> anyhow::Result<String> {
    let bad = |e: std::io::Error| usage(format!("--text {}: {e}", path.display()));
    chorus_train::npy::regular_file(path).map_err(bad)?;
    let bytes = std::fs::read(path).map_err(bad)?;
    Ok(String::from_utf8(bytes).unwrap_or_else(|e| e.into_bytes().iter().map(|b| char::from(*b)).collect()))
}

fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Writes a line to stdout; a closed pipe or a full disk is an error the
/// caller returns (main ends a broken pipe quietly), never a panic.
fn say(line: std::fmt::Arguments<'_>) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(line).and_then(|_| out.write_all(b"\n")).and_then(|_| out.flush()).context("writing to stdout")
}

/// The honest summary of a loss curve: the mean of the first and of the
/// last `window` steps (a tenth of the run, at least one step).
struct LossSummary {
    window: usize,
    start: f64,
    end: f64,
}

/// `n` steps from `first`, as a closing line names them: "step 7" or "steps 7-9".
fn span(first: u64, n: usize) -> String {
    match n {
        0 | 1 => format!("step {first}"),
        n => format!("steps {first}-{}", first + n as u64 - 1),
    }
}

fn summarize(losses: &[f64]) -> LossSummary {
    let window = (losses.len() / 10).max(1);
    LossSummary {
        window,
        start: mean(&losses[..window.min(losses.len())]),
        end: mean(&losses[losses.len().saturating_sub(window)..]),
    }
}

/// Runs `job` on `world` ranks of `backend` ([`ranks::run_on`]) behind a
/// progress bar of its `steps` steps (with the `throughput` where given),
/// cleared when the ranks are done.
fn run_with_progress<J: RankJob>(
    backend: Backend,
    world: usize,
    job: J,
    steps: u64,
    throughput: Option<&throughput::Throughput>,
) -> anyhow::Result<Vec<J::Report>> {
    let bar = ProgressBar::new(steps);
    bar.set_style(match throughput {
        Some(t) => t.style(),
        None => ProgressStyle::with_template("{spinner} step {pos}/{len} [{bar:30}] {msg} ({elapsed})")
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    });
    let reports = ranks::run_on(backend, world, job, Some(bar.clone()));
    bar.finish_and_clear();
    reports
}
