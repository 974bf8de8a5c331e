//! `chorus trace DIR`: reads every rank's flight-recorder dump in DIR and
//! says, in one screen (or as JSON), what went wrong: the first call ranks
//! disagree on, the ranks that never reached a call the others are blocked
//! in, and the calls that never started or never completed.

mod analysis;

use std::path::{Path, PathBuf};

use anyhow::Context;
use chorus_collectives::recorder::{RankDump, FORMAT_VERSION, MAX_WORLD_SIZE};
use clap::Args;

use crate::{Outcome, UsageError};
use analysis::{ranks_text, Report};

/// Arguments of `chorus trace`.
#[derive(Debug, Args)]
pub struct TraceArgs {
    /// The directory of the dumps (`rank*.json`; `chorus launch` prints it when a job fails).
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
    /// Print the analysis as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Largest dump file read (a ring of the largest size is well below it).
const MAX_DUMP_BYTES: u64 = 1 << 30;

/// The dump files of `dir` (`rank*.json`), sorted by name.
fn dump_files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    if !dir.is_dir() {
        return Err(UsageError(format!("{} is not a directory", dir.display())).into());
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with("rank") && name.ends_with(".json") && p.is_file()
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(UsageError(format!("no flight-recorder dumps (rank*.json) in {}", dir.display())).into());
    }
    Ok(files)
}

/// The dumps of one run, and the files of other runs left out.
pub struct Dumps {
    /// The latest run's dumps, one per rank.
    pub dumps: Vec<RankDump>,
    /// The runs left out (older ones in the same directory), each with its files.
    pub other_runs: Vec<(String, Vec<PathBuf>)>,
}

/// Which run a dump is of: its run id and start (`chorus launch` sets both;
/// a process started otherwise has at most the run id).
fn run_key(d: &RankDump) -> (Option<u64>, Option<String>) {
    (d.run_started_us, d.run_id.clone())
}

/// "run "job1" started 2026-11-25 18:58:20 UTC".
fn describe_run(key: &(Option<u64>, Option<String>)) -> String {
    let id = key.1.as_deref().map_or_else(|| "a run without a run id".to_string(), |id| format!("run {id:?}"));
    match key.0 {
        Some(us) => format!("{id} started at {} (Unix time, s)", us / 1_000_000),
        None => format!("{id} (start unknown)"),
    }
}

/// Reads and checks one dump: of this format's version, its sizes bounded.
fn read_dump(path: &Path) -> anyhow::Result<RankDump> {
    let len = path.metadata().with_context(|| format!("reading {}", path.display()))?.len();
    if len > MAX_DUMP_BYTES {
        anyhow::bail!("{}: {len} bytes, more than a dump can be ({MAX_DUMP_BYTES})", path.display());
    }
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let dump: RankDump = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not a chorus flight-recorder dump", path.display()))?;
    if dump.version != FORMAT_VERSION {
        anyhow::bail!(
            "{}: dump format version {}, this chorus reads version {FORMAT_VERSION}",
            path.display(),
            dump.version
        );
    }
    if dump.world_size == 0 || dump.world_size > MAX_WORLD_SIZE {
        anyhow::bail!(
            "{}: world_size {} is not a world chorus runs (1 to {MAX_WORLD_SIZE} ranks)",
            path.display(),
            dump.world_size
        );
    }
    if dump.rank >= dump.world_size {
        anyhow::bail!("{}: rank {} in a world of {} ranks", path.display(), dump.rank, dump.world_size);
    }
    Ok(dump)
}

/// Reads and checks every dump of `dir`: the latest run's, one per rank, of
/// this format's version. Dumps of older runs (a directory used again, a
/// run id given again) are left out and named, not mixed in.
pub fn read_dumps(dir: &Path) -> anyhow::Result<Dumps> {
    let mut all: Vec<(PathBuf, RankDump)> = Vec::new();
    for path in dump_files(dir)? {
        let dump = read_dump(&path)?;
        all.push((path, dump));
    }
    // The latest run: the latest start, then the latest dump.
    let latest =
        all.iter().max_by_key(|(_, d)| (d.run_started_us, d.dumped_us)).map(|(_, d)| run_key(d)).unwrap_or_default();
    let mut other_runs: Vec<(String, Vec<PathBuf>)> = Vec::new();
    let mut dumps: Vec<(PathBuf, RankDump)> = Vec::new();
    for (path, dump) in all {
        let key = run_key(&dump);
        if key == latest {
            dumps.push((path, dump));
            continue;
        }
        let run = describe_run(&key);
        match other_runs.iter_mut().find(|(r, _)| *r == run) {
            Some((_, files)) => files.push(path),
            None => other_runs.push((run, vec![path])),
        }
    }
    for (i, (path, dump)) in dumps.iter().enumerate() {
        if let Some((other, _)) = dumps[..i].iter().find(|(_, d)| d.rank == dump.rank) {
            anyhow::bail!(
                "two dumps of rank {}: {} and {} (dumps of different jobs? give each job its own directory)",
                dump.rank,
                other.display(),
                path.display()
            );
        }
    }
    let sizes: std::collections::BTreeSet<u64> = dumps.iter().map(|(_, d)| d.world_size).collect();
    if sizes.len() > 1 {
        anyhow::bail!("the dumps in {} are of worlds of different sizes {sizes:?}: of different jobs", dir.display());
    }
    Ok(Dumps { dumps: dumps.into_iter().map(|(_, d)| d).collect(), other_runs })
}

/// `chorus trace`.
pub fn run(args: &TraceArgs) -> anyhow::Result<Outcome> {
    let Dumps { dumps, other_runs } = read_dumps(&args.dir)?;
    let mut report = analysis::analyse(&dumps);
    for (run, files) in &other_runs {
        let names: Vec<String> = files
            .iter()
            .map(|f| f.file_name().map_or_else(|| f.display().to_string(), |n| n.to_string_lossy().into()))
            .collect();
        report.other_runs.push(format!("{} dump(s) of {run} left out: {}", files.len(), names.join(", ")));
    }
    if let Some(d) = dumps.first().filter(|d| d.run_id.is_some() || d.run_started_us.is_some()) {
        report.run = Some(describe_run(&run_key(d)));
    }
    if args.json {
        crate::print_out(format_args!("{}\n", serde_json::to_string_pretty(&report)?))?;
    } else {
        crate::print_out(format_args!("{}", render(&report)))?;
    }
    Ok(Outcome::Passed)
}

/// The report as text: the verdict first, then the evidence, in one screen.
fn render(r: &Report) -> String {
    let mut out = String::new();
    for line in &r.other_runs {
        out.push_str(&format!("note: {line} (this analysis reads only the latest run's dumps)\n"));
    }
    let hosts: std::collections::BTreeSet<&str> = r.dumps.iter().map(|d| d.host.as_str()).collect();
    let ranks: Vec<u64> = r.dumps.iter().map(|d| d.rank).collect();
    let run = r.run.as_deref().map(|run| format!(" of {run}")).unwrap_or_default();
    out.push_str(&format!(
        "{} dump(s){run} of a world of {} ranks: ranks {} on {}\n",
        r.dumps.len(),
        r.world_size,
        ranks_text(&ranks),
        hosts.into_iter().collect::<Vec<_>>().join(", ")
    ));
    for line in &r.verdict {
        out.push_str(&format!("  {line}\n"));
    }
    // Why each rank dumped, grouped (one line per reason).
    let mut reasons: Vec<(&str, Vec<u64>)> = Vec::new();
    for d in &r.dumps {
        match reasons.iter_mut().find(|(why, _)| *why == d.reason) {
            Some((_, ranks)) => ranks.push(d.rank),
            None => reasons.push((&d.reason, vec![d.rank])),
        }
    }
    out.push_str("dumped because:\n");
    for (why, ranks) in reasons.iter().take(8) {
        out.push_str(&format!("  ranks {}: {why}\n", ranks_text(ranks)));
    }
    if reasons.len() > 8 {
        out.push_str(&format!("  ... and {} more reasons (--json has them all)\n", reasons.len() - 8));
    }
    for c in &r.communicators {
        if c.unfinished.is_empty() && c.mismatch.is_none() {
            continue;
        }
        out.push_str(&format!(
            "communicator {} (size {}, ranks {}): first unfinished launch per rank:\n",
            c.id,
            c.size,
            ranks_text(&c.members)
        ));
        for u in c.unfinished.iter().take(16) {
            out.push_str(&format!("  rank {}: {} {}\n", u.rank, u.call, u.state.name()));
        }
        if c.unfinished.len() > 16 {
            out.push_str(&format!("  ... {} more ranks (--json has them all)\n", c.unfinished.len() - 16));
        }
    }
    out
}
