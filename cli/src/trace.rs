//! `chorus trace DIR`: reads every rank's flight-recorder dump in DIR and
//! says, in one screen (or as JSON), what went wrong: the first call ranks
//! disagree on, the ranks that never reached a call the others are blocked
//! in, and the calls that never started or never completed.

mod analysis;

use std::path::{Path, PathBuf};

use anyhow::Context;
use chorus_collectives::recorder::{RankDump, FORMAT_VERSION};
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

/// Reads and checks every dump: one per rank, of this format's version.
pub fn read_dumps(dir: &Path) -> anyhow::Result<Vec<RankDump>> {
    let mut dumps: Vec<(PathBuf, RankDump)> = Vec::new();
    for path in dump_files(dir)? {
        let len = path.metadata().with_context(|| format!("reading {}", path.display()))?.len();
        if len > MAX_DUMP_BYTES {
            anyhow::bail!("{}: {len} bytes, more than a dump can be ({MAX_DUMP_BYTES})", path.display());
        }
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        let dump: RankDump = serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not a chorus flight-recorder dump", path.display()))?;
        if dump.version != FORMAT_VERSION {
            anyhow::bail!(
                "{}: dump format version {}, this chorus reads version {FORMAT_VERSION}",
                path.display(),
                dump.version
            );
        }
        if let Some((other, _)) = dumps.iter().find(|(_, d)| d.rank == dump.rank) {
            anyhow::bail!(
                "two dumps of rank {}: {} and {} (dumps of different jobs? give each job its own directory)",
                dump.rank,
                other.display(),
                path.display()
            );
        }
        dumps.push((path, dump));
    }
    let sizes: std::collections::BTreeSet<u64> = dumps.iter().map(|(_, d)| d.world_size).collect();
    if sizes.len() > 1 {
        anyhow::bail!("the dumps in {} are of worlds of different sizes {sizes:?}: of different jobs", dir.display());
    }
    Ok(dumps.into_iter().map(|(_, d)| d).collect())
}

/// `chorus trace`.
pub fn run(args: &TraceArgs) -> anyhow::Result<Outcome> {
    let dumps = read_dumps(&args.dir)?;
    let report = analysis::analyse(&dumps);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(Outcome::Passed)
}

/// The report as text: the verdict first, then the evidence, in one screen.
fn render(r: &Report) -> String {
    let mut out = String::new();
    let hosts: std::collections::BTreeSet<&str> = r.dumps.iter().map(|d| d.host.as_str()).collect();
    let ranks: Vec<u64> = r.dumps.iter().map(|d| d.rank).collect();
    out.push_str(&format!(
        "{} dump(s) of a world of {} ranks: ranks {} on {}\n",
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
