//! Job files: `--config FILE` sets any flag of the job (and, for `chorus
//! train`, of the run) from a TOML file, and `config.toml`, the effective
//! configuration every `chorus train` writes in its out-dir, is such a file.
//!
//! Generic over the flags: a key is a flag's long name or alias
//! (`world_size` or `world-size`), at the top level or in a table of any
//! name (`[training] steps = 10`, torchtitan's layout; the table's name only
//! groups), and becomes `--key=value` placed before the command line's
//! arguments. A flag the command line gives is left out of the file's, so
//! the command line wins. A switch (`--offload`) takes `true` or `false`; a
//! list flag (`--dims`) a TOML array or its comma-separated string. Paths
//! are as given, relative to the directory the command starts in. The
//! file's arguments are checked by clap alone, key by key, so an error names
//! the key; every check of the command then applies as to the command line.
//!
//! `chorus train` takes every key; `chorus plan` takes the job's
//! ([`super::JobArgs`]) and its own (`gpus`, `gpu`, ...) and passes over the
//! run's (`steps`, `out_dir`, ...), so a plan is made from the very job a
//! `config.toml` describes. An error that names a flag the file set says so
//! ([`with_sources`]).
//!
//! `config.toml` lists every flag: its value (a default too) and where it
//! came from, or a comment for a flag left unset (its default then depends
//! on the model). `chorus train --config OUT/config.toml --out-dir OUT2`
//! repeats the run; `chorus plan --config OUT/config.toml --gpus 64` plans it
//! at 64 GPUs.

use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgAction, Args, FromArgMatches};

use crate::usage;

/// The largest job file read (a job file is a few hundred bytes).
const MAX_BYTES: u64 = 1 << 20;

/// Flags a job file cannot set: `--config` itself, and clap's own.
const NOT_IN_FILE: [&str; 2] = ["config", "help"];

/// Which keys of a job file a command takes.
pub(crate) struct Scope {
    /// The flags a file may set: all of the command's where `None`.
    pub takes: Option<clap::Command>,
    /// Flags a file may hold that the command passes over: another
    /// command's settings (a plan reading `chorus train`'s `config.toml`).
    pub passes_over: Option<clap::Command>,
}

/// Arguments read from a command line and a job file.
pub(crate) struct Resolved<A> {
    /// The arguments.
    pub args: A,
    /// The effective configuration as `config.toml` holds it.
    pub effective: String,
}

/// The arguments of this process's subcommand `name` (`chorus NAME ...`),
/// with `--config`'s file read (see [`resolve`]).
pub(crate) fn resolve_process<A: Args + FromArgMatches>(
    name: &'static str,
    scope: Scope,
) -> anyhow::Result<Resolved<A>> {
    let mut argv = std::env::args_os().skip(1);
    match argv.next() {
        Some(first) if first == name => resolve(name, argv.collect(), scope),
        _ => Err(anyhow::anyhow!("chorus {name}: no `{name}` in this process's arguments")),
    }
}

/// The arguments `argv` (those after the subcommand's name) give, with
/// `--config`'s file read (the command line winning) as `scope` says.
pub(crate) fn resolve<A: Args + FromArgMatches>(
    name: &'static str,
    argv: Vec<OsString>,
    scope: Scope,
) -> anyhow::Result<Resolved<A>> {
    let cmd = A::augment_args(clap::Command::new(name)).no_binary_name(true);
    let line = cmd.clone().try_get_matches_from(&argv).map_err(clap_usage)?;
    let (file, all) = match line.get_one::<PathBuf>("config") {
        Some(path) => {
            let file = file_args(&cmd, &scope, path, &line)?;
            let mut all: Vec<OsString> = file.iter().flat_map(|(_, a)| a.clone()).collect();
            // The file's arguments together (a conflict among them is the file's).
            cmd.clone().try_get_matches_from(&all).map_err(|e| in_file(path, clap_message(&e)))?;
            all.extend(argv.iter().cloned());
            (Some((path.clone(), file)), all)
        }
        None => (None, argv),
    };
    let matches = cmd.clone().try_get_matches_from(&all).map_err(|e| match &file {
        Some((path, _)) => usage(format!("--config {} with the command line: {}", path.display(), clap_message(&e))),
        None => clap_usage(e),
    })?;
    let args = A::from_arg_matches(&matches).map_err(clap_usage)?;
    let from_file = file.as_ref().map(|(p, _)| p.as_path());
    match from_file {
        Some(path) => note_sources(&cmd, &matches, &line, path),
        None => FROM_FILE.with(|f| f.borrow_mut().clear()),
    }
    Ok(Resolved { args, effective: effective_text(name, &cmd, &matches, &line, from_file) })
}

/// A flag whose value a job file set (the command line did not).
struct FromFile {
    /// `--momentum`.
    flag: String,
    /// The job file.
    file: PathBuf,
    /// Whether its value is a relative path, taken from the working directory.
    relative_path: bool,
}

thread_local! {
    /// The flags the job file of the command this thread resolved set (the
    /// main thread's, which reports the command's errors).
    static FROM_FILE: std::cell::RefCell<Vec<FromFile>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Records which flags the job file `file` set (see [`with_sources`]).
fn note_sources(cmd: &clap::Command, matches: &clap::ArgMatches, line: &clap::ArgMatches, file: &Path) {
    let mut noted = Vec::new();
    for arg in cmd.get_arguments() {
        let id = arg.get_id().as_str();
        let from_file = matches.value_source(id) == Some(ValueSource::CommandLine)
            && line.value_source(id) != Some(ValueSource::CommandLine);
        if !from_file {
            continue;
        }
        let path_valued = arg.get_value_hint() == clap::ValueHint::AnyPath;
        let relative_path =
            path_valued && matches.get_raw(id).into_iter().flatten().any(|v| Path::new(v).is_relative());
        noted.push(FromFile { flag: format!("--{}", long(arg)), file: file.to_path_buf(), relative_path });
    }
    FROM_FILE.with(|f| *f.borrow_mut() = noted);
}

/// `msg` (an error of the command) with where each flag it names got its
/// value when a job file, not the command line, set it: an error about a
/// value the user did not type says so, and a relative path says which
/// directory it was taken from.
pub(crate) fn with_sources(msg: &str) -> String {
    FROM_FILE.with(|noted| sources_of(msg, &noted.borrow()))
}

fn sources_of(msg: &str, noted: &[FromFile]) -> String {
    let names = |flag: &str| {
        msg.match_indices(flag).any(|(at, _)| {
            let next = msg[at + flag.len()..].chars().next();
            !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        })
    };
    let mut out = msg.to_string();
    for f in noted.iter().filter(|f| names(&f.flag)) {
        out.push_str(&format!(" ({} is from --config {}", f.flag, f.file.display()));
        if f.relative_path {
            let cwd = std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_else(|_| "?".into());
            out.push_str(&format!(
                "; a job file's relative path is taken from the working directory, {cwd}, not the file's"
            ));
        }
        out.push(')');
    }
    out
}

/// The file's flags, each as its key and the arguments it stands for,
/// leaving out those the command line gives; each checked alone.
fn file_args(
    cmd: &clap::Command,
    scope: &Scope,
    path: &Path,
    line: &clap::ArgMatches,
) -> anyhow::Result<Vec<(String, Vec<OsString>)>> {
    let table = read_table(path)?;
    let mut entries: Vec<(String, toml::Value)> = Vec::new();
    for (key, value) in table {
        match value {
            // A table only groups (no flag takes one), so `[model]` may hold the model's sizes.
            toml::Value::Table(inner) => {
                for (k, v) in inner {
                    entries.push((format!("{key}.{k}"), v));
                }
            }
            v => entries.push((key, v)),
        }
    }
    let mut out: Vec<(String, Vec<OsString>)> = Vec::new();
    let mut seen: Vec<(String, String)> = Vec::new();
    for (key, value) in entries {
        if matches!(value, toml::Value::Table(_)) {
            return Err(in_file(path, format!("`{key}`: tables nest one level (`[section]` then `flag = value`)")));
        }
        let name = key.rsplit('.').next().unwrap_or(&key);
        let Some(arg) = find_arg(scope.takes.as_ref().unwrap_or(cmd), name) else {
            if scope.passes_over.as_ref().is_some_and(|other| find_arg(other, name).is_some()) {
                continue;
            }
            return Err(in_file(
                path,
                format!(
                    "`{key}` is no flag of chorus {} (keys are the long flag names: world_size, batch, lr, ...)",
                    cmd.get_name()
                ),
            ));
        };
        let id = arg.get_id().as_str().to_string();
        if let Some((earlier, _)) = seen.iter().find(|(_, i)| *i == id) {
            return Err(in_file(path, format!("`{key}` sets --{} again (as `{earlier}` did)", long(arg))));
        }
        seen.push((key.clone(), id.clone()));
        let args = arg_values(arg, &value).map_err(|why| in_file(path, format!("`{key}`: {why}")))?;
        // Checked even where the command line overrides it: the file is wrong either way.
        cmd.clone().try_get_matches_from(&args).map_err(|e| in_file(path, format!("`{key}`: {}", clap_message(&e))))?;
        // What the command line gives wins.
        if line.value_source(&id) != Some(ValueSource::CommandLine) {
            out.push((key, args));
        }
    }
    Ok(out)
}

/// The job file's top-level table: a regular TOML file of at most [`MAX_BYTES`].
fn read_table(path: &Path) -> anyhow::Result<toml::Table> {
    let ext = path.extension().map(|e| e.to_ascii_lowercase());
    if ext.as_deref() == Some(OsStr::new("json")) {
        return Err(in_file(
            path,
            "a .json file is not a job file (TOML); a Llama's config.json is read from its directory with --init-from DIR for now"
                .into(),
        ));
    }
    let bad = |e: std::io::Error| in_file(path, e.to_string());
    chorus_train::files::regular_file(path).map_err(bad)?;
    let len = std::fs::metadata(path).map_err(bad)?.len();
    if len > MAX_BYTES {
        return Err(in_file(path, format!("{len} bytes is more than a job file holds (at most {MAX_BYTES})")));
    }
    // Read at most one byte past the limit: a file that grew since is refused too.
    let mut bytes = Vec::new();
    std::fs::File::open(path).and_then(|f| f.take(MAX_BYTES + 1).read_to_end(&mut bytes)).map_err(bad)?;
    if bytes.len() as u64 > MAX_BYTES {
        return Err(in_file(path, format!("more than a job file holds (at most {MAX_BYTES} bytes)")));
    }
    let text = String::from_utf8(bytes).map_err(|_| in_file(path, "not UTF-8 text".into()))?;
    text.parse::<toml::Table>().map_err(|e| in_file(path, format!("not TOML: {}", e.to_string().trim_end())))
}

/// The flag a key names by its long name or an alias (`-` or `_` between
/// words); not `--config` nor a hidden one.
fn find_arg<'a>(cmd: &'a clap::Command, key: &str) -> Option<&'a clap::Arg> {
    let want = key.replace('_', "-");
    cmd.get_arguments().find(|a| {
        let named = a.get_long() == Some(want.as_str())
            || a.get_all_aliases().is_some_and(|aliases| aliases.contains(&want.as_str()));
        named && !a.is_hide_set() && !NOT_IN_FILE.contains(&a.get_id().as_str())
    })
}

fn long(arg: &clap::Arg) -> &str {
    arg.get_long().unwrap_or(arg.get_id().as_str())
}

/// The arguments a TOML value stands for: `--flag` for a switch set true
/// (nothing for false), else `--flag=VALUE`.
fn arg_values(arg: &clap::Arg, value: &toml::Value) -> Result<Vec<OsString>, String> {
    let flag = format!("--{}", long(arg));
    if matches!(arg.get_action(), ArgAction::SetTrue) {
        return match value {
            toml::Value::Boolean(true) => Ok(vec![flag.into()]),
            toml::Value::Boolean(false) => Ok(Vec::new()),
            other => Err(format!("a switch takes true or false, not {}", other.type_str())),
        };
    }
    let text = match value {
        toml::Value::Array(items) => {
            let delimiter = arg.get_value_delimiter().ok_or_else(|| format!("{flag} takes one value, not an array"))?;
            let items: Result<Vec<String>, String> = items.iter().map(scalar).collect();
            items?.join(&delimiter.to_string())
        }
        v => scalar(v)?,
    };
    Ok(vec![format!("{flag}={text}").into()])
}

/// A scalar as the command line would spell it.
fn scalar(value: &toml::Value) -> Result<String, String> {
    match value {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(f.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        other => Err(format!("takes a string, number or boolean, not {}", other.type_str())),
    }
}

/// `config.toml`: every flag of the command `name` with its value and
/// source, unset ones as comments.
fn effective_text(
    name: &str,
    cmd: &clap::Command,
    matches: &clap::ArgMatches,
    line: &clap::ArgMatches,
    file: Option<&Path>,
) -> String {
    let mut text = format!(
        "# The effective configuration of a `chorus {name}` run: every flag, with where its value came from.\n\
         # Repeat the run: chorus train --config config.toml --out-dir OTHER_DIR\n\
         # Plan it: chorus plan --config config.toml --gpus N\n"
    );
    for arg in cmd.get_arguments().filter(|a| !a.is_hide_set() && !NOT_IN_FILE.contains(&a.get_id().as_str())) {
        let id = arg.get_id().as_str();
        let key = long(arg).replace('-', "_");
        let source = match (matches.value_source(id), line.value_source(id)) {
            (Some(ValueSource::CommandLine), Some(ValueSource::CommandLine)) => "command line".to_string(),
            (Some(ValueSource::CommandLine), _) => match file {
                Some(f) => format!("--config {}", f.display()),
                None => "command line".to_string(),
            },
            // A default that a flag given conflicts with (--batch beside --global-batch) is not
            // in effect, and as a value it would make the file refuse itself.
            (Some(ValueSource::DefaultValue), _) if conflicts_with_given(cmd, matches, arg) => {
                text.push_str(&format!("# {key}: its default is not in effect (a flag given conflicts with it)\n"));
                continue;
            }
            (Some(ValueSource::DefaultValue), _) => "default".to_string(),
            (Some(_), _) => "environment".to_string(),
            (None, _) => {
                let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
                let help = help.lines().next().unwrap_or("").to_string();
                text.push_str(&format!("# {key}: not set ({help})\n"));
                continue;
            }
        };
        let raw: Vec<&OsStr> = matches.get_raw(id).map(|v| v.collect()).unwrap_or_default();
        let value = match (arg.get_action(), raw.as_slice()) {
            (ArgAction::SetTrue, [v]) => (v.to_str() == Some("true")).to_string(),
            (_, [v]) => toml_scalar(v),
            (_, values) => format!("[{}]", values.iter().map(|v| toml_scalar(v)).collect::<Vec<_>>().join(", ")),
        };
        text.push_str(&format!("{key} = {value}  # {source}\n"));
    }
    text
}

/// Whether a flag set on the command line or in the job file conflicts with
/// `arg` (either side may declare the conflict).
fn conflicts_with_given(cmd: &clap::Command, matches: &clap::ArgMatches, arg: &clap::Arg) -> bool {
    let given = |b: &clap::Arg| matches!(matches.value_source(b.get_id().as_str()), Some(ValueSource::CommandLine));
    cmd.get_arguments().filter(|b| given(b)).any(|b| {
        cmd.get_arg_conflicts_with(b).iter().any(|c| c.get_id() == arg.get_id())
            || cmd.get_arg_conflicts_with(arg).iter().any(|c| c.get_id() == b.get_id())
    })
}

/// A command-line value as TOML: an integer, float or boolean where it reads
/// back to the same text, else a string (a path that is not UTF-8, lossily).
fn toml_scalar(raw: &OsStr) -> String {
    let s = raw.to_string_lossy();
    if s.parse::<i64>().is_ok_and(|i| i.to_string() == s) || s == "true" || s == "false" {
        return s.into_owned();
    }
    if s.parse::<f64>().is_ok_and(|f| f.is_finite() && s.contains('.') && f.to_string() == s) {
        return s.into_owned();
    }
    toml::Value::String(s.into_owned()).to_string()
}

fn in_file(path: &Path, msg: String) -> anyhow::Error {
    usage(format!("--config {}: {msg}", path.display()))
}

/// clap's message without its `error: ` prefix and usage lines.
fn clap_message(e: &clap::Error) -> String {
    let text = e.to_string();
    let first = text.lines().next().unwrap_or("").trim();
    first.strip_prefix("error: ").unwrap_or(first).to_string()
}

fn clap_usage(e: clap::Error) -> anyhow::Error {
    usage(clap_message(&e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::TrainArgs;

    fn job(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("chorus-job-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("job.toml");
        std::fs::write(&path, text).unwrap();
        path
    }

    fn argv(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    fn train(v: &[&str]) -> anyhow::Result<Resolved<TrainArgs>> {
        resolve("train", argv(v), crate::train::file_scope())
    }

    fn err(v: &[&str]) -> String {
        train(v).err().expect("accepted").to_string()
    }

    #[test]
    fn the_file_sets_flags_and_the_command_line_wins() {
        let path = job(
            "sets",
            "steps = 7\nworld_size = 2\n[model]\nhidden = 32\nmicro_batches = 2\n[optimizer]\nlr = 0.5\nallow_nonfinite = true\n",
        );
        let p = path.to_str().unwrap();
        let Resolved { args, effective: text } = train(&["--config", p, "--steps", "9"]).unwrap();
        assert_eq!(args.steps, Some(9));
        assert_eq!(args.job.world_size, Some(2));
        // An alias is a key too: --hidden is --d-model.
        assert_eq!(args.job.d_model, Some(32));
        assert_eq!(args.job.micro_batches, 2);
        assert_eq!(args.job.lr, Some(0.5));
        assert!(args.allow_nonfinite);
        assert!(text.contains("steps = 9  # command line\n"), "{text}");
        assert!(text.contains(&format!("world_size = 2  # --config {p}\n")), "{text}");
        assert!(text.contains(&format!("d_model = 32  # --config {p}\n")), "{text}");
        assert!(text.contains("lr = 0.5  # --config"), "{text}");
        assert!(text.contains("batch = 8  # default\n"), "{text}");
        assert!(text.contains("bench = false  # default\n"), "{text}");
        assert!(text.contains("# hsdp: not set ("), "{text}");
        assert!(!text.contains("config ="), "{text}");
        std::fs::remove_dir_all(path.parent().unwrap()).ok();
    }

    #[test]
    fn config_toml_read_back_gives_the_same_arguments() {
        let first = train(&[
            "--model",
            "llama",
            "--dims=3,4,5",
            "--lr",
            "1e-3",
            "--out-dir",
            "a b/\"q\"",
            "--reshard-after-forward",
            "2",
            "--recompute",
            "root,model.layers.0",
            "--momentum",
            "0.25",
        ])
        .unwrap();
        let path = job("back", &first.effective);
        let again = train(&["--config", path.to_str().unwrap()]).unwrap().args;
        // Debug lists every field: the two parses agree on all of them but the job file's.
        let strip = |mut a: TrainArgs| {
            (a.config, a.effective) = (None, None);
            format!("{a:?}")
        };
        let (dims, lr) = (again.job.dims.clone(), again.job.lr);
        assert_eq!(strip(again), strip(first.args));
        assert_eq!(dims, Some(vec![3, 4, 5]));
        assert_eq!(lr, Some(1e-3));
        std::fs::remove_dir_all(path.parent().unwrap()).ok();
    }

    #[test]
    fn a_default_that_conflicts_with_a_given_flag_is_left_out_so_the_file_reads_back() {
        let first = train(&["--model", "llama", "--global-batch", "4"]).unwrap();
        let text = &first.effective;
        assert!(text.contains("# batch: its default is not in effect"), "{text}");
        assert!(text.contains("global_batch = 4  # command line\n"), "{text}");
        let path = job("default-in-conflict", text);
        let again = train(&["--config", path.to_str().unwrap()]).unwrap().args;
        assert_eq!((again.job.global_batch, again.job.batch), (Some(4), first.args.job.batch));
        std::fs::remove_dir_all(path.parent().unwrap()).ok();
    }

    #[test]
    fn bad_files_name_the_file_and_the_key() {
        let path = job("bad", "stepz = 3\n");
        let p = path.to_str().unwrap();
        let e = err(&["--config", p]);
        assert!(e.contains(p) && e.contains("`stepz` is no flag of chorus train"), "{e}");
        std::fs::write(&path, "steps = \"many\"\n").unwrap();
        let e = err(&["--config", p]);
        assert!(e.contains("`steps`") && e.contains("many"), "{e}");
        std::fs::write(&path, "bench = 1\n").unwrap();
        assert!(err(&["--config", p]).contains("`bench`: a switch takes true or false"));
        std::fs::write(&path, "steps = [1, 2]\n").unwrap();
        assert!(err(&["--config", p]).contains("not an array"));
        std::fs::write(&path, "steps = 1\n[t]\nsteps = 2\n").unwrap();
        assert!(err(&["--config", p]).contains("`t.steps` sets --steps again"));
        std::fs::write(&path, "[a.b]\nsteps = 2\n").unwrap();
        assert!(err(&["--config", p]).contains("`a.b`: tables nest one level"));
        std::fs::write(&path, "world_size = 1\nworld-size = 2\n").unwrap();
        assert!(err(&["--config", p]).contains("again"));
        std::fs::write(&path, "d_model = 32\nhidden = 32\n").unwrap();
        assert!(err(&["--config", p]).contains("`hidden` sets --d-model again"));
        std::fs::write(&path, "config = \"x.toml\"\n").unwrap();
        assert!(err(&["--config", p]).contains("`config` is no flag"));
        std::fs::write(&path, "dims = [4, 4]\nlayers = 2\n").unwrap();
        assert!(err(&["--config", p]).contains(p));
        std::fs::write(&path, "steps = \n").unwrap();
        assert!(err(&["--config", p]).contains("not TOML"));
        std::fs::write(&path, vec![b'#'; MAX_BYTES as usize + 1]).unwrap();
        assert!(err(&["--config", p]).contains("more than a job file holds"));
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        assert!(err(&["--config", p]).contains("not UTF-8"));
        let dir = path.parent().unwrap();
        assert!(err(&["--config", dir.to_str().unwrap()]).contains("directory"));
        let json = dir.join("config.json");
        std::fs::write(&json, "{}").unwrap();
        assert!(err(&["--config", json.to_str().unwrap()]).contains("--init-from"));
        let e = err(&["--config", dir.join("missing.toml").to_str().unwrap()]);
        assert!(e.contains("missing.toml"), "{e}");
        std::fs::remove_dir_all(dir).ok();
    }

    /// Issue 43: an error about a value the user did not type says it came
    /// from the job file, and a relative path from it which directory it
    /// was taken from; a flag the command line gave is not annotated.
    #[test]
    fn errors_name_the_job_file_a_value_came_from() {
        let path = job("sources", "momentum = 0.9\ntokenizer = \"tok/tokenizer.json\"\n");
        let p = path.to_str().unwrap();
        train(&["--config", p, "--model", "llama", "--steps", "3"]).unwrap();
        let e = with_sources("--momentum is for --optimizer sgd");
        assert!(e.starts_with("--momentum is for --optimizer sgd (--momentum is from --config "), "{e}");
        assert!(e.contains(p) && !e.contains("working directory"), "{e}");
        let e = with_sources("--tokenizer tok/tokenizer.json: No such file or directory");
        let cwd = std::env::current_dir().unwrap();
        assert!(
            e.contains("relative path is taken from the working directory") && e.contains(&cwd.display().to_string()),
            "{e}"
        );
        // Given on the command line, or only a longer flag's prefix: nothing added.
        assert_eq!(with_sources("--steps 3 is too many"), "--steps 3 is too many");
        assert_eq!(with_sources("--momentum-like words"), "--momentum-like words");
        std::fs::remove_dir_all(path.parent().unwrap()).ok();
    }

    /// Issue 43: a plan's own keys in a job file are passed over by train
    /// (as a plan passes over the run's), so one file trains and plans.
    #[test]
    fn train_passes_over_a_plans_own_keys() {
        let path = job("plan-keys", "gpus = 8\ngpu = \"h100-sxm\"\nsteps = 3\n");
        let args = train(&["--config", path.to_str().unwrap()]).unwrap().args;
        assert_eq!(args.steps, Some(3));
        std::fs::remove_dir_all(path.parent().unwrap()).ok();
    }

    #[test]
    fn a_conflict_between_the_file_and_the_command_line_is_named() {
        let path = job("conflict", "dims = \"4,4\"\n");
        let e = err(&["--config", path.to_str().unwrap(), "--layers", "2"]);
        assert!(e.contains("with the command line") && e.contains("--layers"), "{e}");
        std::fs::remove_dir_all(path.parent().unwrap()).ok();
    }
}
