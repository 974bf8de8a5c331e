//! `chorus conformance`: the conformance suite on one backend.

use clap::Args;

use crate::backends::{parse_backend, Backend};
use crate::Outcome;

/// Arguments of `chorus conformance`.
#[derive(Debug, Args)]
pub struct ConformanceArgs {
    /// The communication backend to test: sim or simnccl (ranks as threads of this process), ucx (one rank per
    /// process under a launcher), nccl or rccl (one rank per GPU); ucx, nccl and rccl in builds with those features.
    #[arg(long, default_value = "sim", value_parser = parse_backend)]
    pub backend: Backend,
    /// Number of ranks.
    #[arg(long, default_value_t = 4, value_parser = parse_world_size)]
    pub world_size: usize,
    /// Run only the cases whose name contains this text; comma-separated
    /// terms run the cases matching any, and a term written `!text` leaves
    /// out the cases containing `text` (`--filter '!fsdp'`).
    #[arg(long, value_name = "PATTERN")]
    pub filter: Option<String>,
    /// Print the names of the cases that would run, and run none.
    #[arg(long)]
    pub list: bool,
}

/// Parses a world size: at least one rank.
pub fn parse_world_size(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("a world needs at least one rank".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{text}` is not a number of ranks")),
    }
}

/// One line per case: `passed|failed|skipped  <name>  (reason)`.
pub fn outcome_line(o: &chorus_conformance::CaseOutcome) -> String {
    use chorus_conformance::Status;
    match &o.status {
        Status::Passed => format!("passed   {}", o.name),
        Status::Failed(reason) => format!("failed   {}  ({reason})", o.name),
        Status::Skipped(reason) => format!("skipped  {}  ({reason})", o.name),
    }
}

/// `chorus conformance`.
pub fn run(args: &ConformanceArgs) -> anyhow::Result<Outcome> {
    use chorus_conformance::vendor::VendorHarness;
    // Under a launcher, a backend that can runs one rank per process.
    let process = match args.backend.runs_as_processes() && !args.list {
        true => crate::process::RankProcess::detect()?,
        false => None,
    };
    crate::with_backend!(
        args.backend,
        sim => run_harness(&chorus_conformance::sim::SimHarness, args),
        ucx => {
            let harness = chorus_conformance::ucx::UcxHarness::default();
            match (process, args.list) {
                (_, true) => run_harness(&harness, args),
                (Some(p), false) => run_processes(&harness, args, p),
                (None, false) => run_processes(&harness, args, crate::process::RankProcess::require("ucx")?),
            }
        },
        vendor<L> => match process {
            Some(p) => run_processes(&VendorHarness::<L>::default(), args, p),
            None => run_harness(&VendorHarness::<L>::default(), args),
        }
    )
}

/// The suite with this process as one rank of a launched job: every rank
/// runs the cases, rank 0 prints the outcomes; every rank exits with the
/// same status.
fn run_processes<H: chorus_conformance::process::RankHarness>(
    harness: &H,
    args: &ConformanceArgs,
    p: crate::process::RankProcess,
) -> anyhow::Result<Outcome> {
    use chorus_conformance::process::{run_rank, RankEnv};
    use std::io::Write;
    p.check_world_size(args.world_size)?;
    let env = RankEnv {
        rank: p.env.rank,
        size: p.env.world_size,
        local_rank: p.env.local_rank,
        store: p.store(),
        prefix: p.prefix("conformance"),
    };
    if chorus_conformance::harness::select(harness, env.size, args.filter.as_deref()).is_empty() {
        let what = args.filter.as_deref().unwrap_or("");
        return Err(
            crate::UsageError(format!("no conformance case name contains `{what}` (`--list` prints them)")).into()
        );
    }
    let mut stdout = std::io::stdout();
    let leader = env.rank == 0;
    if leader {
        let _ = writeln!(
            stdout,
            "# {} conformance: {} ranks, one per process ({})",
            harness.name(),
            env.size,
            p.env.launcher
        );
    }
    let summary = run_rank(harness, &env, args.filter.as_deref(), &mut |o| {
        if leader {
            let _ = writeln!(stdout, "{}", outcome_line(o));
            let _ = stdout.flush();
        }
    });
    p.finish("conformance", std::time::Duration::from_secs(120))?;
    if leader {
        let _ = writeln!(stdout, "{}", summary.line());
    }
    Ok(if summary.failed == 0 && summary.passed > 0 { Outcome::Passed } else { Outcome::Failed })
}

/// Runs (or with `--list`, lists without a device) the suite on `harness`.
fn run_harness<H: chorus_conformance::harness::Harness>(
    harness: &H,
    args: &ConformanceArgs,
) -> anyhow::Result<Outcome> {
    use crate::UsageError;
    use std::io::Write;

    // Here the ranks are threads of this process (a backend that runs them as
    // processes only lists here): a list says what a run would do, so it is
    // refused where the run would be.
    if !(args.list && args.backend.runs_as_processes()) {
        crate::backends::check_thread_world(args.backend, args.world_size).map_err(UsageError)?;
    }
    let listed = chorus_conformance::harness::list(harness, args.world_size, args.filter.as_deref());
    if listed.is_empty() {
        let what = args.filter.as_deref().unwrap_or("");
        let all = chorus_conformance::harness::case_names(harness, args.world_size).len();
        return Err(UsageError(format!(
            "no conformance case name contains `{what}` ({all} cases for {} ranks; `--list` prints them)",
            args.world_size
        ))
        .into());
    }
    let mut stdout = std::io::stdout();
    if args.list {
        for (name, skip) in listed {
            match skip {
                None => writeln!(stdout, "run      {name}")?,
                Some(reason) => writeln!(stdout, "skip     {name}  ({reason})")?,
            }
        }
        return Ok(Outcome::Passed);
    }
    let summary = chorus_conformance::harness::run(harness, args.world_size, args.filter.as_deref(), &mut |o| {
        // A closed pipe (`| head`) must not stop the run; the exit status still counts.
        let _ = writeln!(stdout, "{}", outcome_line(o));
        let _ = stdout.flush();
    });
    let _ = writeln!(stdout, "{}", summary.line());
    Ok(if summary.failed == 0 { Outcome::Passed } else { Outcome::Failed })
}

#[cfg(test)]
mod tests {
    use super::*;
    use chorus_conformance::{CaseOutcome, Status};
    use std::time::Duration;

    #[test]
    fn lines_name_the_status_the_case_and_the_reason() {
        let o =
            |status| CaseOutcome { name: "all_reduce/sum/f32".into(), world_size: 4, status, duration: Duration::ZERO };
        assert_eq!(outcome_line(&o(Status::Passed)), "passed   all_reduce/sum/f32");
        assert_eq!(
            outcome_line(&o(Status::Failed("rank 1: boom".into()))),
            "failed   all_reduce/sum/f32  (rank 1: boom)"
        );
        assert_eq!(
            outcome_line(&o(Status::Skipped("needs 2 ranks".into()))),
            "skipped  all_reduce/sum/f32  (needs 2 ranks)"
        );
    }

    #[test]
    fn a_world_needs_a_rank() {
        assert!(parse_world_size("0").is_err());
        assert!(parse_world_size("x").is_err());
        assert_eq!(parse_world_size("8"), Ok(8));
    }
}
