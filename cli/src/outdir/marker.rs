//! The marker of an out-dir ([`MARKER`]): which command wrote the directory
//! and every path it wrote, and the refusal of a directory that holds
//! anything else (another command's output included).

use std::path::Path;

use anyhow::Context;

use crate::usage;

/// The file in every out-dir a chorus run wrote, by which a later run
/// recognises one it may replace.
pub const MARKER: &str = ".chorus-out";

/// The marker's first line; then [`COMMAND_KEY`] and the command that
/// wrote the directory, then the paths it wrote, one a line (directories
/// with a trailing `/`).
pub(super) const MARKER_HEAD: &str =
    "written by chorus: the next run of the same command into this directory replaces the files \
     listed below, and refuses to while it holds any other; other commands refuse to write here\n";

/// What starts the marker's second line, before the command's name.
const COMMAND_KEY: &str = "command: ";

/// Writes the marker of the staged out-dir `stage` of `chorus {command}`: every path in it.
pub(super) fn write_marker(stage: &Path, command: &str) -> anyhow::Result<()> {
    fn walk(dir: &Path, rel: &str, out: &mut Vec<String>) -> anyhow::Result<()> {
        for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let entry = entry.with_context(|| format!("reading {}", dir.display()))?;
            let path = format!("{rel}{}", entry.file_name().to_string_lossy());
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                walk(&entry.path(), &format!("{path}/"), out)?;
                out.push(format!("{path}/"));
            } else if path != MARKER {
                out.push(path);
            }
        }
        Ok(())
    }
    let mut paths = Vec::new();
    walk(stage, "", &mut paths)?;
    paths.sort();
    let listed = paths.iter().map(|p| format!("{p}\n")).collect::<String>();
    let path = stage.join(MARKER);
    std::fs::write(&path, format!("{MARKER_HEAD}{COMMAND_KEY}{command}\n{listed}"))
        .with_context(|| format!("writing {}", path.display()))
}

/// What an out-dir's marker says: the command that wrote the directory and
/// the paths it wrote.
struct Marker {
    command: String,
    paths: std::collections::BTreeSet<String>,
}

/// The out-dir `dest`'s marker, or `None` where there is no marker, or one
/// from a chorus that did not name its command or list its files.
fn marker(dest: &Path) -> Option<Marker> {
    let text = std::fs::read_to_string(dest.join(MARKER)).ok()?;
    let mut lines = text.strip_prefix(MARKER_HEAD)?.lines();
    let command = lines.next()?.strip_prefix(COMMAND_KEY)?.to_string();
    Some(Marker { command, paths: lines.map(str::to_string).collect() })
}

/// The paths in the out-dir `dest` its marker does not list (a directory
/// not listed counts as one path, `name/`).
fn foreign(dest: &Path, listed: &std::collections::BTreeSet<String>) -> anyhow::Result<Vec<String>> {
    fn walk(
        dir: &Path,
        rel: &str,
        listed: &std::collections::BTreeSet<String>,
        out: &mut Vec<String>,
    ) -> anyhow::Result<()> {
        for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let entry = entry.with_context(|| format!("reading {}", dir.display()))?;
            let path = format!("{rel}{}", entry.file_name().to_string_lossy());
            if rel.is_empty() && path == MARKER {
                continue;
            }
            // A link is judged as the link, never followed.
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                let as_dir = format!("{path}/");
                if listed.contains(&as_dir) {
                    walk(&entry.path(), &as_dir, listed, out)?;
                } else {
                    out.push(as_dir);
                }
            } else if !listed.contains(&path) {
                out.push(path);
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dest, "", listed, &mut out)?;
    out.sort();
    Ok(out)
}

/// Refuses an existing non-empty out-dir that holds anything no run of
/// `chorus {command}` wrote there, naming it.
pub(super) fn refuse_foreign(given: &Path, dest: &Path, command: &str) -> anyhow::Result<()> {
    let names = |paths: &[String]| {
        let shown = paths.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
        let more = if paths.len() > 5 { format!(" and {} more", paths.len() - 5) } else { String::new() };
        format!("{shown}{more}")
    };
    if let Some(marker) = marker(dest) {
        if marker.command != command {
            let held: Vec<String> = marker.paths.iter().filter(|p| !p.ends_with('/')).cloned().collect();
            return Err(usage(format!(
                "--out-dir {} holds the output of `chorus {}` ({}); `chorus {command}` never replaces another \
                 command's output: choose another out-dir",
                given.display(),
                marker.command,
                names(&held)
            )));
        }
        let extra = foreign(dest, &marker.paths)?;
        if extra.is_empty() {
            return Ok(());
        }
        return Err(usage(format!(
            "--out-dir {} holds files no chorus run wrote ({}); the run replaces what chorus wrote there and would lose them: move them out, or choose another out-dir",
            given.display(),
            names(&extra)
        )));
    }
    let mut all: Vec<String> = std::fs::read_dir(dest)
        .map_err(|e| usage(format!("--out-dir {}: {e}", given.display())))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    if all.is_empty() {
        return Ok(());
    }
    all.sort();
    if dest.join(MARKER).is_file() {
        // Every marker chorus ever wrote starts so; anything else is damaged, or another program's file.
        let older = std::fs::read(dest.join(MARKER)).is_ok_and(|t| t.starts_with(b"written by chorus"));
        let why = if older {
            format!(
                "was written by an older chorus, whose {MARKER} does not say which command wrote it or list its files"
            )
        } else {
            format!("has a {MARKER} that is no marker chorus wrote (damaged, or another program's), which cannot say which command wrote the directory or list its files")
        };
        return Err(usage(format!(
            "--out-dir {} {why}, so neither can be told ({}): remove it, or choose another out-dir",
            given.display(),
            names(&all)
        )));
    }
    Err(usage(format!(
        "--out-dir {} holds files no chorus run wrote ({}); the out-dir is replaced when the run ends, so choose an empty or new directory",
        given.display(),
        names(&all)
    )))
}
