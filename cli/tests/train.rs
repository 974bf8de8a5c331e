//! `chorus train` as a hostile user runs it: every case of "nothing lost,
//! nothing hidden" gives a clear error (exit 2 for bad arguments, before
//! anything is written) or a correct result, never a panic, an abort or a
//! mixed out-dir; and the transformer's default-style run learns, plots,
//! checkpoints and resumes.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn chorus() -> Command {
    Command::new(env!("CARGO_BIN_EXE_chorus"))
}

fn run(args: &[&str]) -> Output {
    chorus().args(args).stdin(Stdio::null()).output().expect("run chorus")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("chorus-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
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
    default_sigint(&mut cmd);
    cmd.spawn().expect("start chorus")
}

/// Gives the child SIGINT's default action and an empty signal mask.
fn default_sigint(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            if libc::signal(libc::SIGINT, libc::SIG_DFL) == libc::SIG_ERR {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
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

#[test]
fn the_transformer_learns_plots_checkpoints_and_resumes() {
    let root = scratch("gpt");
    let out = root.join("out");
    let ckpt = root.join("ckpt");
    let o = gpt(&[
        "--steps",
        "40",
        "--lr",
        "1e-2",
        "--save-every",
        "20",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
        "--out-dir",
        out.to_str().unwrap(),
    ]);
    no_panic(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("mean of steps 0-3") && stdout.contains("mean of steps 36-39") && stdout.contains("sample:"),
        "{stdout}"
    );
    let s = summary(&out);
    let losses: Vec<f64> = serde_json::from_value(s["losses"].clone()).unwrap();
    assert_eq!(losses.len(), 40);
    let (start, end) = (s["loss_start_mean"].as_f64().unwrap(), s["loss_end_mean"].as_f64().unwrap());
    assert!(
        (start - losses[..4].iter().sum::<f64>() / 4.0).abs() < 1e-12,
        "the start mean is the mean of the first tenth"
    );
    assert!(end < start - 0.3, "the loss did not fall visibly: {start} -> {end}");
    assert_eq!(s["config"]["optimizer"]["kind"], "adamw", "structured configuration");
    assert_eq!(s["status"], "completed");
    assert_eq!(s["config"]["transformer"]["d_model"], 32);
    let svg = std::fs::read_to_string(out.join("loss.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("polyline") || svg.contains("<path"), "loss.svg");
    let st = std::fs::read(out.join("model.safetensors")).unwrap();
    assert_eq!(
        safetensors::SafeTensors::deserialize(&st).unwrap().len(),
        2 + 1 + 8,
        "root (3) + one block (8) tensors"
    );
    assert_eq!(std::fs::read_to_string(ckpt.join("latest")).unwrap().trim(), "step-00000040");
    assert!(ckpt.join("step-00000020").join("chorus_checkpoint.json").exists());

    // Resume from step 20 to 40 at another world size: the losses continue.
    let resumed = root.join("resumed");
    let o = run(&[
        SMALL_GPT_MODEL,
        &["--world-size", "4", "--batch", "2", "--steps", "40", "--lr", "1e-2"],
        &["--resume", ckpt.join("step-00000020").to_str().unwrap(), "--out-dir", resumed.to_str().unwrap()],
    ]
    .concat());
    no_panic(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    // The closing line is about this run's steps, 20 to 39.
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("mean of steps 20-21") && stdout.contains("mean of steps 38-39"), "{stdout}");
    let r: Vec<f64> = serde_json::from_value(summary(&resumed)["losses"].clone()).unwrap();
    assert_eq!(r.len(), 40, "the summary holds the whole curve");
    assert_eq!(r[..20], losses[..20], "the first half comes from the checkpoint");
    for (a, b) in r[20..].iter().zip(&losses[20..]) {
        assert!((a - b).abs() < 1e-4 * (1.0 + b.abs()), "{:?} vs {:?}", &r[20..], &losses[20..]);
    }
    // The last checkpoint as plain safetensors: the trained model, tensor for tensor.
    let consolidated = root.join("consolidated");
    let o = run(&["consolidate", ckpt.to_str().unwrap(), consolidated.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(consolidated.join("model.safetensors.index.json")).unwrap()).unwrap();
    let file = consolidated.join(index["weight_map"]["head.weight"].as_str().unwrap());
    let bytes = std::fs::read(file).unwrap();
    let (whole, model) =
        (safetensors::SafeTensors::deserialize(&bytes).unwrap(), safetensors::SafeTensors::deserialize(&st).unwrap());
    for (name, t) in model.tensors() {
        assert_eq!(whole.tensor(&name).unwrap().data(), t.data(), "{name}");
    }
    let o = run(&["consolidate", ckpt.to_str().unwrap(), consolidated.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "never overwrites: {}", stderr(&o));
    let o = run(&["consolidate", root.join("nothing").to_str().unwrap(), root.join("c2").to_str().unwrap()]);
    no_panic(&o);
    assert_eq!(o.status.code(), Some(2), "a checkpoint that is not there is a usage error, as for --resume");
    assert!(stderr(&o).contains("nothing"), "{}", stderr(&o));
    // Resuming past the end is a usage error.
    let o = gpt(&["--steps", "40", "--resume", ckpt.to_str().unwrap(), "--out-dir", root.join("x").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn bad_arguments_exit_2_before_anything_is_written() {
    let root = scratch("usage");
    let out = root.join("out");
    let o = out.to_str().unwrap();
    let mlp = |extra: &[&str]| train_args("mlp", o, extra);
    let gpt_args = |extra: &[&str]| train_args("gpt", o, extra);
    let cases: Vec<(Vec<String>, &str)> = vec![
        (mlp(&["--layers", "18446744073709551615", "--width", "4"]), "--layers"),
        (mlp(&["--world-size", "18446744073709551615"]), "--world-size"),
        (mlp(&["--steps", "18446744073709551615"]), "memory"),
        (mlp(&["--steps", "10000000000"]), "memory"),
        (mlp(&["--batch", "100000000"]), "memory"),
        (mlp(&["--dims", "100000,100000"]), "memory"),
        (mlp(&["--dims", "4294967296,4294967296,1"]), "memory"),
        (mlp(&["--steps", "0"]), "--steps"),
        (mlp(&["--lr", "nan"]), "--lr"),
        (mlp(&["--lr", "inf"]), "--lr"),
        (mlp(&["--lr", "-1"]), "--lr"),
        (mlp(&["--max-grad-norm", "-1"]), "--max-grad-norm"),
        (mlp(&["--max-grad-norm", "nan"]), "--max-grad-norm"),
        (mlp(&["--weight-decay", "nan"]), "--weight-decay"),
        (mlp(&["--world-size", "4", "--reshard-after-forward", "3"]), "--reshard-after-forward 3"),
        (mlp(&["--world-size", "4", "--hsdp", "3"]), "--hsdp"),
        (mlp(&["--save-every", "5"]), "--model gpt"),
        (strings(&["train", "--bench", "--world-size", "2"]), "--bench"),
        (strings(&["train", "--bench", "--out-dir", o]), "--bench"),
        (gpt_args(&["--heads", "5"]), "heads"),
        (gpt_args(&["--d-model", "0"]), "positive"),
        (gpt_args(&["--dims", "4,4"]), "--model mlp"),
        (gpt_args(&["--micro-batches", "3"]), "--micro-batches"),
        (mlp(&["--dims", "18446744073709551615,18446744073709551615,18446744073709551615"]), "memory"),
        (mlp(&["--bench", "--init-dir", o]), "--bench does not use --init-dir"),
        (gpt_args(&["--steps", "0"]), "--steps"),
        (gpt_args(&["--world-size", "4", "--reshard-after-forward", "3"]), "--reshard-after-forward 3"),
        (gpt_args(&["--world-size", "4", "--hsdp", "2", "--reshard-after-forward", "4"]), "--reshard-after-forward 4"),
        (gpt_args(&["--lr", "nan"]), "--lr"),
        (gpt_args(&["--lr", "inf"]), "--lr"),
        (gpt_args(&["--max-grad-norm", "-1"]), "--max-grad-norm"),
        (gpt_args(&["--max-grad-norm", "nan"]), "--max-grad-norm"),
        (gpt_args(&["--layers", "18446744073709551615"]), "at most"),
        (gpt_args(&["--d-model", "18446744073709551612"]), "at most"),
        (gpt_args(&["--seq-len", "18446744073709551615"]), "at most"),
        (gpt_args(&["--steps", "10000000000"]), "memory"),
        (gpt_args(&["--batch", "100000000"]), "memory"),
        (gpt_args(&["--world-size", "18446744073709551615"]), "--world-size"),
        (gpt_args(&["--save-every", "0"]), "--save-every"),
        (gpt_args(&["--save-every", "1", "--keep-last", "0"]), "--keep-last"),
        (gpt_args(&["--keep-last", "2"]), "--keep-last goes with"),
        (gpt_args(&["--allow-optimizer-change"]), "--allow-optimizer-change goes with --resume"),
        (gpt_args(&["--text", "/nonexistent/corpus.txt"]), "--text /nonexistent/corpus.txt"),
        (gpt_args(&["--resume", "/nonexistent/ckpt"]), "no such checkpoint directory"),
        (gpt_args(&["--layers", "2", "--recompute", "root,blocks.2"]), "blocks.2"),
        (gpt_args(&["--recompute", "root,,blocks.0"]), "--recompute"),
        (mlp(&["--recompute", "false"]), "--recompute is for --model gpt"),
        (gpt_args(&["--init-dir", o]), "--model mlp"),
        (strings(&["train", "--bench", "--model", "gpt", "--out-dir", o]), "--bench"),
        (strings(&["train", "--bench", "--model", "gpt", "--resume", o]), "--bench"),
        (strings(&["train", "--bench", "--model", "gpt", "--param-dtype", "bf16"]), "--bench"),
        (strings(&["bench", "--max-bytes", "1T"]), "memory"),
        (strings(&["bench", "--max-bytes", "18446744073709551615"]), "memory"),
    ];
    for (args, why) in cases {
        let started = Instant::now();
        let out_ = chorus().args(&args).output().unwrap();
        no_panic(&out_);
        assert_eq!(out_.status.code(), Some(2), "{args:?}: {}", stderr(&out_));
        assert!(stderr(&out_).contains(why), "{args:?}: expected `{why}` in {}", stderr(&out_));
        assert!(started.elapsed() < Duration::from_secs(10), "{args:?} took {:?}", started.elapsed());
        assert!(!out.exists(), "{args:?} wrote {}", out.display());
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0, "{args:?} left files in {}", root.display());
    }
    std::fs::remove_dir_all(&root).ok();
}

/// `args` as owned strings, so that one table holds fixed and built argument lists.
fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// `chorus train --model <model> --out-dir <out>`, then `extra`.
fn train_args(model: &str, out: &str, extra: &[&str]) -> Vec<String> {
    strings(&[&["train", "--model", model, "--out-dir", out][..], extra].concat())
}

fn write_npy(path: &Path, shape: &[usize], values: &[f32]) {
    let shape_text = match shape.len() {
        1 => format!("({},)", shape[0]),
        _ => format!("({})", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    };
    let mut h = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_text}, }}");
    while (10 + h.len() + 1) % 64 != 0 {
        h.push(' ');
    }
    h.push('\n');
    let mut f = b"\x93NUMPY\x01\x00".to_vec();
    f.extend_from_slice(&(h.len() as u16).to_le_bytes());
    f.extend_from_slice(h.as_bytes());
    for v in values {
        f.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, f).unwrap();
}

/// An init dir for an MLP 3 → 4 → 2 with 8 rows.
fn init_dir(dir: &Path, weight0: f32) {
    std::fs::create_dir_all(dir).unwrap();
    let mut w0 = vec![0.1f32; 12];
    w0[0] = weight0;
    write_npy(&dir.join("layers.0.weight.npy"), &[4, 3], &w0);
    write_npy(&dir.join("layers.0.bias.npy"), &[4], &[0.05; 4]);
    write_npy(&dir.join("layers.1.weight.npy"), &[2, 4], &[0.2; 8]);
    write_npy(&dir.join("layers.1.bias.npy"), &[2], &[0.0; 2]);
    write_npy(&dir.join("x.npy"), &[8, 3], &(0..24).map(|i| i as f32 / 24.0).collect::<Vec<_>>());
    write_npy(&dir.join("y.npy"), &[8, 2], &[0.5; 16]);
}

fn mlp_from(init: &Path, out: &Path, extra: &[&str]) -> Output {
    let args: Vec<&str> = ["train", "--model", "mlp", "--world-size", "2", "--batch", "4", "--steps", "3"]
        .iter()
        .copied()
        .chain(["--init-dir", init.to_str().unwrap(), "--out-dir", out.to_str().unwrap()])
        .chain(extra.iter().copied())
        .collect();
    run(&args)
}

#[test]
fn failed_runs_leave_the_out_dir_as_it_was() {
    let root = scratch("outdir");
    let out = root.join("out");
    let o = run(&["train", "--model", "mlp", "--seed", "1", "--steps", "3", "--out-dir", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let before = listing(&out);
    let init_before = listing(&out.join("init"));
    // A usage error (exit 2) changes nothing; a run stopped by a NaN loss
    // (exit 1) replaces it with its summary, marked failed, and no weights.
    let o = run(&[
        "train",
        "--model",
        "mlp",
        "--seed",
        "2",
        "--reshard-after-forward",
        "3",
        "--out-dir",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    let nan_init = root.join("nan");
    init_dir(&nan_init, f32::NAN);
    let o = mlp_from(&nan_init, &out, &[]);
    no_panic(&o);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    // ReLU propagates NaN (PyTorch's semantics), so the loss is NaN and the run stops.
    assert!(stderr(&o).contains("the loss became NaN"), "{}", stderr(&o));
    let s = summary(&out);
    assert_eq!(s["status"], "failed");
    assert_eq!(s["stopped_at_step"], 0);
    assert!(s["losses"][0].is_null());
    assert!(!out.join("layers.0.weight.npy").exists(), "no weights of a diverged run");
    let _ = (before, init_before);
    // With --allow-nonfinite it runs to the end, and says the losses are NaN (null in JSON).
    let o = mlp_from(&nan_init, &out, &["--allow-nonfinite"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(summary(&out)["losses"][0].is_null());
    // The NaN reached the outputs: every weight of the output layer is NaN.
    let w1 = std::fs::read(out.join("layers.1.weight.npy")).unwrap();
    let vals: Vec<f32> = w1[w1.len() - 32..].chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert!(vals.iter().all(|v| v.is_nan()), "{vals:?}");
    // A new successful run replaces the whole directory: no file of the earlier one survives.
    assert!(!out.join("init").exists(), "--init-dir runs write no init/; the earlier init/ is gone");
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn init_dirs_with_leftover_or_malformed_files_are_refused() {
    let root = scratch("init");
    let init = root.join("init");
    init_dir(&init, 0.1);
    let out = root.join("out");
    assert!(mlp_from(&init, &out, &[]).status.success());
    // A leftover deeper layer.
    write_npy(&init.join("layers.3.weight.npy"), &[2, 2], &[0.0; 4]);
    let o = mlp_from(&init, &out, &[]);
    no_panic(&o);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("layers.3.weight.npy"), "{}", stderr(&o));
    std::fs::remove_file(init.join("layers.3.weight.npy")).unwrap();
    // Malformed headers, non-ASCII, overflowing shapes, empty data: errors naming the file.
    for (header, data) in [
        ("{'descr': '<f4', 'fortran_order': False, 'shape': ), }", 0usize),
        ("{'descr': '<f\u{e9}', 'fortran_order': False, 'shape': (8, 3), }", 96),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 2), }", 0),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 3), }", 0),
    ] {
        let mut f = b"\x93NUMPY\x01\x00".to_vec();
        f.extend_from_slice(&(header.len() as u16).to_le_bytes());
        f.extend_from_slice(header.as_bytes());
        f.extend(std::iter::repeat_n(0u8, data));
        std::fs::write(init.join("x.npy"), &f).unwrap();
        let o = mlp_from(&init, &out, &[]);
        no_panic(&o);
        assert_eq!(o.status.code(), Some(1), "{header}: {}", stderr(&o));
        assert!(stderr(&o).contains("x.npy") || stderr(&o).contains("x ["), "{header}: {}", stderr(&o));
    }
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn a_second_run_into_a_live_out_dir_is_refused() {
    let root = scratch("lock");
    let out = root.join("out");
    let mut first = spawn_endless_gpt(&out);
    let lock = root.join(".out.lock");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !lock.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(lock.exists(), "the first run never took the lock");
    let o = gpt(&["--steps", "2", "--out-dir", out.to_str().unwrap()]);
    no_panic(&o);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("another chorus run"), "{}", stderr(&o));
    first.kill().unwrap();
    first.wait().unwrap();
    assert!(!out.exists(), "the killed run wrote its out-dir");
    // Its lock is stale now: the next run takes it over and succeeds.
    let o = gpt(&["--steps", "2", "--out-dir", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.join("summary.json").exists());
    assert!(!std::fs::read_dir(&root).unwrap().flatten().any(|e| e.file_name().to_string_lossy().contains("partial")));
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn stdout_errors_are_handled() {
    let root = scratch("stdout");
    // A closed pipe ends the output quietly.
    let o = Command::new("bash")
        .args([
            "-c",
            &format!(
                "set -o pipefail; {} train --bench --steps 1 --layers 2 --width 8 | head -1",
                env!("CARGO_BIN_EXE_chorus")
            ),
        ])
        .output()
        .unwrap();
    no_panic(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 1);
    // A full disk is an error that says so.
    if Path::new("/dev/full").exists() {
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
        let o = chorus()
            .args(small_gpt(&["--steps", "2", "--out-dir", root.join("out").to_str().unwrap()]))
            .stdout(full)
            .output()
            .unwrap();
        no_panic(&o);
        assert_eq!(o.status.code(), Some(1));
        assert!(stderr(&o).contains("No space left on device"), "{}", stderr(&o));
    }
    // An out-dir that cannot be created is found before training, with
    // generated data and with an --init-dir.
    let o = run(&["train", "--model", "mlp", "--out-dir", "/proc/version/out"]);
    no_panic(&o);
    assert_eq!(o.status.code(), Some(2), "a bad --out-dir is a usage error");
    assert!(stderr(&o).contains("/proc/version"), "{}", stderr(&o));
    let init = root.join("init");
    init_dir(&init, 0.1);
    let started = Instant::now();
    let o = run(&[
        "train",
        "--model",
        "mlp",
        "--world-size",
        "2",
        "--batch",
        "4",
        "--steps",
        "1000000",
        "--init-dir",
        init.to_str().unwrap(),
        "--out-dir",
        "/proc/version/out",
    ]);
    no_panic(&o);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("/proc/version"), "{}", stderr(&o));
    assert!(started.elapsed() < Duration::from_secs(10), "found only after training: {:?}", started.elapsed());
    std::fs::remove_dir_all(&root).ok();
}

/// The run the kill test stops mid-save and resumes: big enough that a save
/// takes long enough to be caught.
const KILLED_RUN: [&str; 13] = [
    "train",
    "--model",
    "gpt",
    "--world-size",
    "4",
    "--batch",
    "1",
    "--d-model",
    "128",
    "--layers",
    "4",
    "--seq-len",
    "8",
];
/// Kills a run while it saves a checkpoint (its temporary directory
/// exists) and shows the previous checkpoint intact: `latest` names a
/// complete checkpoint whose every file passes its checksum on resume.
#[test]
fn a_save_killed_midway_leaves_the_previous_checkpoint_intact() {
    let root = scratch("kill");
    let (ckpt, out) = (root.join("ckpt"), root.join("out"));
    let saving_every_step = [
        &KILLED_RUN[..],
        &["--steps", "100000", "--save-every", "1", "--checkpoint-dir", ckpt.to_str().unwrap()],
        &["--out-dir", out.to_str().unwrap()],
    ]
    .concat();
    for attempt in 0..3 {
        let mut child = spawn_quiet(&saving_every_step);
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut caught = false;
        while Instant::now() < deadline {
            let saving = std::fs::read_dir(&ckpt).into_iter().flatten().flatten().any(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                n.starts_with(".tmp-step-") && e.path().read_dir().is_ok_and(|mut d| d.next().is_some())
            });
            if saving && ckpt.join("latest").exists() {
                child.kill().unwrap();
                caught = true;
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        child.wait().unwrap();
        assert!(caught, "attempt {attempt}: never saw a save in progress after a complete one");
        let latest = std::fs::read_to_string(ckpt.join("latest")).unwrap();
        let step: u64 = latest.trim().trim_start_matches("step-").parse().unwrap();
        // Resuming reads every shard and checks every checksum.
        let (steps, out) = ((step + 1).to_string(), root.join(format!("resumed{attempt}")));
        let mut resume = KILLED_RUN.to_vec();
        resume.extend(["--steps", &steps, "--resume", ckpt.to_str().unwrap(), "--out-dir", out.to_str().unwrap()]);
        let o = run(&resume);
        no_panic(&o);
        assert!(
            o.status.success(),
            "attempt {attempt}: the previous checkpoint (step {step}) does not load: {}",
            stderr(&o)
        );
    }
    std::fs::remove_dir_all(&root).ok();
}

/// Ctrl-C in the middle of a run, and a write that fails (a file-size limit
/// standing in for a full disk), leave the previous out-dir as it was; the
/// failed write is an error naming the file; the next run clears what the
/// interrupted one left.
#[test]
fn interrupted_runs_and_failed_writes_leave_the_out_dir_as_it_was() {
    use std::os::unix::process::CommandExt;
    let root = scratch("interrupt");
    let out = root.join("out");
    let o = gpt(&["--steps", "2", "--out-dir", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let before = listing(&out);

    let mut child = spawn_endless_gpt(&out);
    let prefix = format!(".out.partial-{}-", child.id());
    let staging =
        || std::fs::read_dir(&root).unwrap().flatten().any(|e| e.file_name().to_string_lossy().starts_with(&prefix));
    let deadline = Instant::now() + Duration::from_secs(60);
    while !staging() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(staging(), "the run never started staging");
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: kill(2) on the child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    assert!(!child.wait().unwrap().success());
    assert_eq!(listing(&out), before, "Ctrl-C changed the out-dir");

    let mut limited = chorus();
    limited.args(small_gpt(&["--steps", "2", "--out-dir", out.to_str().unwrap()]));
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        limited.pre_exec(|| {
            // Past 16 KiB a write fails with EFBIG instead of killing the process.
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let limit = libc::rlimit { rlim_cur: 16 << 10, rlim_max: 16 << 10 };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let o = limited.stdin(Stdio::null()).output().unwrap();
    no_panic(&o);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("model.safetensors") && e.contains("File too large"), "{e}");
    assert_eq!(listing(&out), before, "a failed write changed the out-dir");

    let o = gpt(&["--steps", "2", "--out-dir", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let left: Vec<String> =
        std::fs::read_dir(&root).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(left, ["out"], "staging directories or locks left behind");
    std::fs::remove_dir_all(&root).ok();
}

/// A transformer whose loss becomes NaN stops with an error and writes its
/// summary, marked failed, with the losses until then, and the curve with
/// the non-finite step marked; with --allow-nonfinite it runs to the end
/// and says so (null).
#[test]
fn a_transformer_whose_loss_becomes_nan_stops() {
    let root = scratch("gpt-nan");
    let out = root.join("out");
    let o = gpt(&["--steps", "5", "--optimizer", "sgd", "--lr", "1e30", "--out-dir", out.to_str().unwrap()]);
    no_panic(&o);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("the loss became NaN"), "{}", stderr(&o));
    let s = summary(&out);
    assert_eq!(s["status"], "failed", "{s}");
    let losses = s["losses"].as_array().unwrap();
    let stop = s["stopped_at_step"].as_u64().unwrap() as usize;
    assert_eq!(losses.len(), stop + 1, "every step until the divergence");
    assert!(losses[..stop].iter().all(|l| l.as_f64().is_some_and(f64::is_finite)) && losses[stop].is_null(), "{s}");
    let svg = std::fs::read_to_string(out.join("loss.svg")).unwrap();
    assert!(svg.contains("loss NaN or infinite") && svg.contains("#FF0000"), "the non-finite step is marked");
    assert!(!out.join("model.safetensors").exists(), "no weights of a diverged run");
    let o = gpt(&[
        "--steps",
        "5",
        "--optimizer",
        "sgd",
        "--lr",
        "1e30",
        "--allow-nonfinite",
        "--out-dir",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(summary(&out)["losses"].as_array().unwrap().iter().any(|l| l.is_null()));
    std::fs::remove_dir_all(&root).ok();
}

/// `chorus train --bench --model gpt --json`: both sides measured, the
/// ratio is theirs, and the ranks got their share of the cores.
#[test]
fn the_transformer_bench_reports_both_sides() {
    let o = run(&[
        "train",
        "--bench",
        "--model",
        "gpt",
        "--world-size",
        "2",
        "--batch",
        "2",
        "--d-model",
        "16",
        "--layers",
        "1",
        "--seq-len",
        "8",
        "--steps",
        "2",
        "--recompute",
        "false",
        "--json",
    ]);
    no_panic(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["recompute"], "false");
    let (plain, fsdp) =
        (v["plain"]["median_step_time_s"].as_f64().unwrap(), v["fsdp"]["median_step_time_s"].as_f64().unwrap());
    assert!(plain > 0.0 && fsdp > 0.0, "{v}");
    assert!((v["ratio"].as_f64().unwrap() - fsdp / plain).abs() < 1e-9, "{v}");
    assert_eq!(v["plain_runs"].as_array().unwrap().len(), 2, "candle's default threads and one thread");
    assert_eq!(v["fsdp"]["groups"], 2, "the root and one block");
    assert!(v["fsdp"]["peak_memory_bytes_per_rank"].as_u64().unwrap() > 0);
    let cores = std::thread::available_parallelism().unwrap().get();
    assert_eq!(v["fsdp"]["candle_threads"], (cores / 2).max(1).to_string(), "{v}");
    assert_eq!(v["global_batch"], 4);
}

/// Issue 28: `chorus train --bench --model llama` (refused before): FSDP on
/// sim ranks and plain candle train the same init on the same batches, so
/// every step's loss agrees (f32), and the JSON says by how much.
#[test]
fn the_llama_bench_trains_both_sides_alike() {
    let o = run(&[
        "train",
        "--bench",
        "--model",
        "llama",
        "--world-size",
        "2",
        "--batch",
        "2",
        "--layers",
        "2",
        "--hidden",
        "32",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--intermediate",
        "64",
        "--seq-len",
        "16",
        "--steps",
        "2",
        "--json",
    ]);
    no_panic(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["model"], "llama");
    let (plain, fsdp) = (v["plain"]["losses"].as_array().unwrap(), v["fsdp"]["losses"].as_array().unwrap());
    assert_eq!(plain.len(), 5, "3 warm-up and 2 timed steps: {v}");
    assert_eq!(plain.len(), fsdp.len(), "{v}");
    let worst =
        plain.iter().zip(fsdp).map(|(a, b)| (a.as_f64().unwrap() - b.as_f64().unwrap()).abs()).fold(0.0, f64::max);
    assert!(worst < 1e-5, "{v}");
    assert!((v["max_loss_difference"].as_f64().unwrap() - worst).abs() < 1e-12, "{v}");
}

/// `args` with the out-dir `out` after the small transformer's.
fn gpt_into(out: &Path, extra: &[&str]) -> Output {
    gpt(&[extra, &["--out-dir", out.to_str().unwrap()]].concat())
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Issue 19: an out-dir is replaced only when a chorus run wrote it, and no
/// input or checkpoint lies inside it; each refusal exits 2 before anything
/// is written, leaving every file as it was.
#[test]
fn out_dirs_that_are_not_chorus_runs_or_hold_inputs_are_refused() {
    let root = scratch("foreign");
    // A project directory with a corpus and notes.
    let proj = root.join("proj");
    std::fs::create_dir_all(&proj).unwrap();
    std::fs::write(proj.join("corpus.txt"), "the cat sees the moon. ".repeat(20)).unwrap();
    std::fs::write(proj.join("notes.md"), "notes").unwrap();
    let o = gpt_into(&proj, &["--steps", "2", "--text", s(&proj.join("corpus.txt"))]);
    no_panic(&o);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("inside --out-dir") || stderr(&o).contains("no chorus run wrote"), "{}", stderr(&o));
    let o = gpt_into(&proj, &["--steps", "2"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("no chorus run wrote") && stderr(&o).contains("corpus.txt"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(proj.join("notes.md")).unwrap(), "notes");
    assert!(proj.join("corpus.txt").exists());
    // A checkpoint directory inside the out-dir.
    let o1 = root.join("o1");
    let o = gpt_into(&o1, &["--steps", "2", "--checkpoint-dir", s(&o1.join("ckpt"))]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--checkpoint-dir") && stderr(&o).contains("inside --out-dir"), "{}", stderr(&o));
    assert!(!o1.exists(), "nothing written");
    // A checkpoint resumed from inside an out-dir of an earlier run.
    let o4 = root.join("o4");
    assert!(gpt_into(&o4, &["--steps", "2"]).status.success());
    let ckpt = o4.join("ckpt");
    let o = gpt_into(&root.join("elsewhere"), &["--steps", "2", "--checkpoint-dir", s(&ckpt)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = gpt_into(&o4, &["--steps", "3", "--resume", s(&ckpt)]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--resume") && stderr(&o).contains("inside --out-dir"), "{}", stderr(&o));
    assert!(ckpt.join("latest").exists(), "the checkpoint is kept");
    // An init dir inside the out-dir of the run that wrote it.
    let m2 = root.join("m2");
    let o = run(&["train", "--model", "mlp", "--steps", "2", "--out-dir", s(&m2)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = run(&["train", "--model", "mlp", "--steps", "2", "--init-dir", s(&m2.join("init")), "--out-dir", s(&m2)]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--init-dir") && stderr(&o).contains("inside --out-dir"), "{}", stderr(&o));
    assert!(m2.join("init").join("x.npy").exists(), "the init is kept");
    std::fs::remove_dir_all(&root).ok();
}

/// Issue 19: an out-dir that is a symbolic link is written through (its
/// target gets the results, the link stays); `--out-dir .` is refused
/// before training.
#[test]
fn a_linked_out_dir_is_written_through_and_the_current_directory_is_refused() {
    let root = scratch("link");
    let target = root.join("target");
    std::fs::create_dir_all(&target).unwrap();
    let link = root.join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let o = gpt_into(&link, &["--steps", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link stays a link");
    assert!(target.join("summary.json").exists(), "the results reach the link's target");
    // The current directory: refused at once, whatever it holds.
    let cwd = root.join("cwd");
    std::fs::create_dir_all(&cwd).unwrap();
    let o = run_within(&small_gpt(&["--steps", "100000", "--out-dir", "."]), Duration::from_secs(30), Some(&cwd))
        .expect("--out-dir . must be refused before training");
    no_panic(&o);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("current directory"), "{}", stderr(&o));
    assert_eq!(std::fs::read_dir(&cwd).unwrap().count(), 0);
    std::fs::remove_dir_all(&root).ok();
}

/// Issue 19: an unusable checkpoint directory is found before training,
/// and a second run into a live run's checkpoint directory is refused.
#[test]
fn checkpoint_dirs_are_checked_and_locked_before_training() {
    let root = scratch("ckpt-dir");
    let file = root.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let out = root.join("out");
    for dir in [Path::new("/proc/ck"), file.as_path()] {
        let args = small_gpt(&["--steps", "100000", "--checkpoint-dir", s(dir), "--out-dir", s(&out)]);
        let o = run_within(&args, Duration::from_secs(30), None).expect("found only after training");
        no_panic(&o);
        assert_eq!(o.status.code(), Some(2), "{dir:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("--checkpoint-dir"), "{}", stderr(&o));
    }
    let ckpt = root.join("shared");
    let mut first = spawn_quiet(&small_gpt(&[
        "--steps",
        "100000",
        "--save-every",
        "1",
        "--checkpoint-dir",
        s(&ckpt),
        "--out-dir",
        s(&root.join("a")),
    ]));
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ckpt.join("latest").exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(ckpt.join("latest").exists(), "the first run never saved");
    let o = gpt_into(&root.join("b"), &["--steps", "2", "--checkpoint-dir", s(&ckpt)]);
    first.kill().unwrap();
    first.wait().unwrap();
    no_panic(&o);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("another chorus run"), "{}", stderr(&o));
    // The killed run's lock and staging are cleared by the next run (which starts over).
    let o = gpt_into(&root.join("b"), &["--steps", "2", "--checkpoint-dir", s(&ckpt), "--overwrite-checkpoints"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let left: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    std::fs::remove_dir_all(&root).ok();
}

/// A two-layer transformer's arguments (the small one has one layer).
fn two_layer(extra: &[&str]) -> Vec<String> {
    let base = ["train", "--model", "gpt", "--d-model", "32", "--seq-len", "16", "--world-size", "2", "--batch", "4"];
    strings(&[&base[..], extra].concat())
}

/// Issue 19: a resume uses every saved tensor under the configuration it
/// was saved with, and the optimizer's settings; another is refused with
/// exit 2 (a changed optimizer setting only with --allow-optimizer-change,
/// and then reported).
#[test]
fn resume_refuses_another_model_or_optimizer() {
    let root = scratch("resume-config");
    let ckpt = root.join("ckpt");
    let out = root.join("out");
    let o = chorus()
        .args(two_layer(&["--layers", "2", "--steps", "2", "--checkpoint-dir", s(&ckpt)]))
        .args(["--out-dir", s(&out)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let r = root.join("r");
    let resume = |extra: &[&str]| {
        let base = ["--steps", "3", "--resume", s(&ckpt), "--out-dir", s(&r)];
        chorus().args(two_layer(&[&base[..], extra].concat())).output().unwrap()
    };
    for (extra, why) in [
        (&["--layers", "1"][..], "layers 2 -> 1"),
        (&["--layers", "2", "--heads", "2"], "heads 4 -> 2"),
        (&["--layers", "2", "--lr", "0.01"], "lr 0.003 -> 0.01"),
        (&["--layers", "2", "--optimizer", "sgd"], "adamw"),
        (&["--layers", "2", "--seed", "3"], "--seed"),
    ] {
        let o = resume(extra);
        no_panic(&o);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(why), "{extra:?}: expected `{why}` in {}", stderr(&o));
        assert!(!root.join("r").exists());
    }
    let o = resume(&["--layers", "2", "--lr", "0.01", "--allow-optimizer-change"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("changed optimizer settings: lr 0.003 -> 0.01"), "{}", stderr(&o));
    assert_eq!(summary(&root.join("r"))["config"]["optimizer_changes"][0], "lr 0.003 -> 0.01");
    std::fs::remove_dir_all(&root).ok();
}

/// Issue 19: a missing directory, one that is not a checkpoint, and a
/// `latest` naming nothing are three messages; an OS error is printed once.
#[test]
fn resume_errors_name_the_problem() {
    let root = scratch("resume-msg");
    let out = s(&root.join("out")).to_string();
    let resume = |dir: &Path| gpt(&["--steps", "2", "--resume", s(dir), "--out-dir", &out]);
    let empty = root.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let dangling = root.join("dangling");
    std::fs::create_dir_all(&dangling).unwrap();
    std::fs::write(dangling.join("latest"), "step-00000009\n").unwrap();
    for (dir, why) in [
        (root.join("missing"), "no such checkpoint directory"),
        (empty, "not a checkpoint"),
        (dangling, "names `step-00000009`"),
    ] {
        let o = resume(&dir);
        no_panic(&o);
        assert_eq!(o.status.code(), Some(2), "{dir:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(why), "{dir:?}: expected `{why}` in {}", stderr(&o));
    }
    let odd = root.join("odd");
    std::fs::create_dir_all(odd.join("chorus_checkpoint.json")).unwrap();
    let o = resume(&odd);
    no_panic(&o);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(stderr(&o).matches("os error").count(), 1, "the OS error once: {}", stderr(&o));
    std::fs::remove_dir_all(&root).ok();
}

/// Issue 19: `--text` in Latin-1 trains (the help says other characters
/// become spaces); `--param-dtype` lists only what it takes; a one-step
/// run's closing line names its step.
#[test]
fn text_dtype_and_closing_line_messages() {
    let root = scratch("messages");
    let text = root.join("latin1.txt");
    let mut bytes = b"the cat sees the moon. ".repeat(20);
    bytes.extend_from_slice(b"caf\xe9 cr\xe8me. ");
    std::fs::write(&text, &bytes).unwrap();
    let o = gpt(&["--steps", "1", "--text", s(&text), "--out-dir", s(&root.join("out"))]);
    assert!(o.status.success(), "{}", stderr(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("(mean of step 0)") && !stdout.contains("first 1 steps"), "{stdout}");
    let o = run(&["train", "--param-dtype", "xx"]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(e.contains("f32, bf16 or f16") && !e.contains("f64") && !e.contains("i32"), "{e}");
    std::fs::remove_dir_all(&root).ok();
}

/// Issue 19: --keep-last N keeps the newest N checkpoints, never the one
/// `latest` names nor the one the run resumed from.
#[test]
fn keep_last_prunes_old_checkpoints() {
    let root = scratch("keep-last");
    let ckpt = root.join("ckpt");
    let steps = |dir: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("step-"))
            .collect();
        v.sort();
        v
    };
    let o = gpt_into(
        &root.join("a"),
        &["--steps", "5", "--save-every", "1", "--keep-last", "2", "--checkpoint-dir", s(&ckpt)],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(steps(&ckpt), ["step-00000004", "step-00000005"]);
    let from = ckpt.join("step-00000004");
    let o = gpt_into(
        &root.join("b"),
        &["--steps", "7", "--save-every", "1", "--keep-last", "1", "--checkpoint-dir", s(&ckpt), "--resume", s(&from)],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(steps(&ckpt), ["step-00000004", "step-00000007"], "the resumed-from checkpoint is kept");
    assert_eq!(std::fs::read_to_string(ckpt.join("latest")).unwrap().trim(), "step-00000007");
    std::fs::remove_dir_all(&root).ok();
}
