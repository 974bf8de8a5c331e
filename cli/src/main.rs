//! `chorus`: the command line of the chorus workspace.
//!
//! - `chorus train`: a transformer (candle, through the FSDP adapter), a
//!   Hugging Face Llama or the reference MLP under FSDP, with sharded
//!   checkpoints, and `--bench` for FSDP's step time and host overhead;
//! - `chorus generate`: text from a Hugging Face Llama directory, KV-cached,
//!   greedy or sampled as transformers' `generate`;
//! - `chorus consolidate`: a sharded checkpoint as full tensors (plain
//!   safetensors, or a Hugging Face directory for the Llama);
//! - `chorus info`: the backends compiled into this binary and whether their
//!   libraries are available here;
//! - `chorus bench`: nccl-tests-style bandwidth tables, checked results, and
//!   an efficiency ratio against a memcpy reference measured in the same run;
//! - `chorus conformance`: the conformance suite on one backend;
//! - `chorus launch`: torchrun's role — start the ranks of a job on this
//!   node with torchrun's variables and the job's store;
//! - `chorus tokenize`: text files into the token rows `train --data` reads,
//!   with a Hugging Face tokenizer or a byte-level BPE trained on them;
//! - `chorus plan`: predict per-GPU memory, step time and every rank's
//!   collectives at N GPUs by running FSDP on a virtual device;
//! - `chorus trace`: read the ranks' flight-recorder dumps and name the rank
//!   and call that diverged.
//!
//! Exit status: 0 on success, 1 when a run fails (a wrong value, a failed
//! case, a backend error), 2 for bad arguments.

// Built without any backend feature, the binary only has `info`; the
// measuring and checking code is then unused, which is expected.
#![cfg_attr(not(feature = "sim"), allow(dead_code))]
// The arguments' doc comments are `--help` text, where `<out-dir>` and
// `</s>` are meant literally, not as HTML.
#![allow(rustdoc::invalid_html_tags)]

mod backends;
mod bench;
mod conformance;
mod consolidate;
mod gate;
mod generate;
mod interrupt;
#[cfg(feature = "sim")]
mod job;
mod launch;
mod outcome;
#[cfg(feature = "sim")]
mod outdir;
#[cfg(feature = "sim")]
mod plan;
#[cfg(feature = "sim")]
mod plot;
mod process;
mod size;
mod tokenize;
mod trace;
#[cfg(feature = "sim")]
mod train;

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

pub use outcome::{print_out, usage, Outcome, UsageError};

/// One collective-communication API with NCCL semantics over several backends.
#[derive(Debug, Parser)]
#[command(name = "chorus", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List the compiled backends and whether their libraries are available here.
    Info,
    /// Measure collectives like nccl-tests: time, algbw, busbw, checked results, efficiency vs memcpy.
    Bench(bench::BenchArgs),
    /// Run the conformance suite on a backend.
    Conformance(conformance::ConformanceArgs),
    /// Start N ranks of PROGRAM on this node with torchrun's variables; host or join the job's store.
    Launch(launch::LaunchArgs),
    /// Train a transformer (candle, --model gpt), a Hugging Face Llama (--model llama) or the reference MLP under FSDP:
    /// summary.json, loss.svg, the trained model, checkpoints; --bench measures FSDP.
    #[cfg(feature = "sim")]
    Train(Box<train::TrainArgs>),
    /// Write a sharded checkpoint of `chorus train` as full tensors: plain safetensors files for --model gpt (candle
    /// and Python load them), a Hugging Face model directory for --model llama.
    Consolidate(consolidate::ConsolidateArgs),
    /// Continue --prompt with a Hugging Face Llama directory (its tokenizer.json): KV-cached on the CPU, greedy or
    /// sampled (--temperature, --top-k, --top-p, --seed) as transformers' generate; tokens/s on stderr.
    Generate(generate::GenerateArgs),
    /// Predict per-GPU peak memory (with its breakdown), step time, tokens/s, MFU and exposed communication at
    /// --gpus N by running FSDP for every rank on a virtual device; checks every rank issues the same collectives.
    #[cfg(feature = "sim")]
    Plan(Box<plan::PlanArgs>),
    /// Read every rank's flight-recorder dump in DIR and say which rank and call diverged (or --json).
    Trace(trace::TraceArgs),
    /// Text files into token rows for `train --model llama --data` (a tokenizer.json, or --train-tokenizer to train a
    /// byte-level BPE on them).
    Tokenize(tokenize::TokenizeArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let subcommand = match &cli.command {
        Command::Info => "info",
        Command::Bench(_) => "bench",
        Command::Conformance(_) => "conformance",
        Command::Launch(_) => "launch",
        #[cfg(feature = "sim")]
        Command::Train(_) => "train",
        Command::Consolidate(_) => "consolidate",
        Command::Generate(_) => "generate",
        #[cfg(feature = "sim")]
        Command::Plan(_) => "plan",
        Command::Trace(_) => "trace",
        Command::Tokenize(_) => "tokenize",
    };
    // Every command but these answers the signals chorus documents (`interrupt`): `info` and `trace` only read, and
    // `launch` forwards them to its ranks.
    if !matches!(subcommand, "info" | "trace" | "launch") {
        interrupt::answer_signals();
    }
    let result = match cli.command {
        Command::Info => backends::info(),
        Command::Bench(args) => bench::run(&args),
        Command::Conformance(args) => conformance::run(&args),
        Command::Launch(args) => launch::run(&args),
        #[cfg(feature = "sim")]
        Command::Train(_) => train::run(),
        Command::Consolidate(args) => consolidate::run(&args),
        Command::Generate(args) => generate::run(&args),
        #[cfg(feature = "sim")]
        Command::Plan(_) => plan::run_cli(),
        Command::Trace(args) => trace::run(&args),
        Command::Tokenize(args) => tokenize::run(&args),
    };
    match result {
        Ok(Outcome::Passed) => ExitCode::SUCCESS,
        Ok(Outcome::Failed) => ExitCode::from(1),
        Err(e) => match e.downcast_ref::<UsageError>() {
            Some(usage) => {
                let mut cli = Cli::command();
                cli.build();
                let kind = clap::error::ErrorKind::ValueValidation;
                let msg = with_sources(&usage.0);
                match cli.find_subcommand_mut(subcommand) {
                    Some(sub) => sub.error(kind, msg).exit(),
                    None => cli.error(kind, msg).exit(),
                }
            }
            // A closed pipe (`chorus ... | head`) ends the output, not the program with an error.
            None if is_broken_pipe(&e) => ExitCode::SUCCESS,
            None => {
                eprintln!("error: {}", with_sources(&format!("{e:#}")));
                ExitCode::from(1)
            }
        },
    }
}

/// `msg` with where the flags it names got values the user did not type (a job file).
fn with_sources(msg: &str) -> String {
    #[cfg(feature = "sim")]
    return job::file::with_sources(msg);
    #[cfg(not(feature = "sim"))]
    msg.to_string()
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    /// Every backend name `--backend` can accept (in some build) is in the
    /// help of every subcommand's `--backend`.
    #[test]
    fn backend_help_names_every_backend() {
        let mut cli = Cli::command();
        cli.build();
        let subcommands: &[&str] =
            if cfg!(feature = "sim") { &["train", "bench", "conformance"] } else { &["bench", "conformance"] };
        for sub in subcommands {
            let cmd = cli.find_subcommand(sub).unwrap_or_else(|| panic!("no `{sub}`"));
            let arg =
                cmd.get_arguments().find(|a| a.get_id() == "backend").unwrap_or_else(|| panic!("{sub}: no --backend"));
            let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
            let words: Vec<&str> = help.split(|c: char| !c.is_ascii_alphanumeric()).collect();
            for name in ["sim", "simnccl", "ucx", "nccl", "rccl"] {
                assert!(words.contains(&name), "`{sub} --backend` help omits {name}: {help}");
            }
        }
    }
}
