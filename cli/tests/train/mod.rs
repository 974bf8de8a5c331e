//! `chorus train` as a hostile user runs it: every case of "nothing lost,
//! nothing hidden" gives a clear error (exit 2 for bad arguments, before
//! anything is written) or a correct result, never a panic, an abort or a
//! mixed out-dir; and the transformer's default-style run learns, plots,
//! checkpoints and resumes.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common;
use crate::common::scratch;

/// The binary, the signals the tests send at their defaults (as `common::chorus`).
fn chorus() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_chorus"));
    common::default_signals(&mut cmd);
    cmd
}

fn run(args: &[&str]) -> Output {
    chorus().args(args).stdin(Stdio::null()).output().expect("run chorus")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn no_panic(o: &Output) {
    let e = stderr(o);
    assert!(!e.contains("panicked") && !e.contains("RUST_BACKTRACE"), "panicked: {e}");
    assert!(o.status.code().is_some(), "killed by a signal: {e}");
}

/// A small transformer (seconds in a debug build): its checkpoints resume
/// only into a model of these sizes.
const SMALL_GPT_MODEL: &[&str] = &["train", "--model", "gpt", "--d-model", "32", "--layers", "1", "--seq-len", "16"];

/// The arguments of a run of the small transformer on 2 ranks of 4
/// sequences, then `extra`.
fn small_gpt<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    [SMALL_GPT_MODEL, &["--world-size", "2", "--batch", "4"], extra].concat()
}

fn gpt(extra: &[&str]) -> Output {
    run(&small_gpt(extra))
}

/// Starts chorus with `args` in the background, its output discarded, with
/// SIGINT's default action whatever this process inherited (a test run
/// from a script in the background has SIGINT ignored, and the child would
/// inherit that).
fn spawn_quiet(args: &[&str]) -> Child {
    let mut cmd = chorus();
    cmd.args(args).stdout(Stdio::null()).stderr(Stdio::null());
    cmd.spawn().expect("start chorus")
}

/// Runs `args` to the end, or kills it after `limit` (then `None`): a check
/// that must come before training is found within the limit.
fn run_within(args: &[&str], limit: Duration, cwd: Option<&Path>) -> Option<Output> {
    let mut cmd = chorus();
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    if let Some(dir) = cwd {
        cmd.current_dir(dir);
    }
    let mut child = cmd.spawn().expect("start chorus");
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if child.try_wait().unwrap().is_some() {
            return Some(child.wait_with_output().unwrap());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    None
}

/// A small transformer run into `out` that lasts until it is killed.
fn spawn_endless_gpt(out: &Path) -> Child {
    spawn_quiet(&small_gpt(&["--steps", "100000", "--out-dir", out.to_str().unwrap()]))
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

fn listing(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap()))
        .collect();
    out.sort();
    out
}

/// `args` as owned strings, so that one table holds fixed and built argument lists.
fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

// The cases, by what they exercise (the module `train` of the test binary).
mod dirs;
mod float8;
mod runs;
