//! Whole runs: the transformer learns, checkpoints and resumes; bad
//! arguments, failed, interrupted and killed runs leave nothing mixed; the
//! benches report both sides.

use super::*;

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
/// failed write is an error naming the file, and ends the run at once on
/// every rank (issue 43: the other rank waited out the collective timeout);
/// the next run clears what the interrupted one left.
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

    // Rank 0 writes the model; on both kinds of ranks as threads the others
    // must stop with it, not wait for it in their next collective.
    for backend in ["sim", "simnccl"] {
        let mut limited = chorus();
        limited.args(small_gpt(&["--backend", backend, "--steps", "2", "--out-dir", out.to_str().unwrap()]));
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
        let started = Instant::now();
        let o = limited.stdin(Stdio::null()).output().unwrap();
        // A bound on a hang, not a speed target (the run takes well under a
        // second): rank 1 waited for rank 0 until its timeouts (simnccl: 420 s).
        assert!(started.elapsed() < Duration::from_secs(30), "{backend}: ended after {:?}", started.elapsed());
        no_panic(&o);
        assert_eq!(o.status.code(), Some(1), "{backend}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains("model.safetensors") && e.contains("File too large"), "{backend}: {e}");
        assert_eq!(listing(&out), before, "{backend}: a failed write changed the out-dir");
    }

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

/// Issue 35: `--world-size 512` (the most the sim accepts) aborted on
/// allocation within a second under an address-space limit (`ulimit -v`):
/// 6 threads a rank, each with a 2 MiB stack. A world whose threads and
/// data the limit cannot hold is refused up front (exit 2), naming the
/// limit and the largest world that fits; that world runs to the end under
/// the same limit.
#[test]
fn worlds_beyond_the_address_space_limit_are_refused_and_the_largest_that_fits_runs() {
    use std::os::unix::process::CommandExt;
    let root = scratch("world-limit");
    let limited = |world: &str| {
        let mut cmd = chorus();
        cmd.args(["train", "--world-size", world, "--steps", "1", "--out-dir"]).arg(root.join(format!("w{world}")));
        // SAFETY: setrlimit is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                let limit = libc::rlimit { rlim_cur: 1536 << 20, rlim_max: 1536 << 20 };
                if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.stdin(Stdio::null()).output().expect("run chorus")
    };
    let o = limited("512");
    no_panic(&o);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("3072 threads (6 per rank)") && err.contains("(ulimit -v)"), "{err}");
    let fits: usize = err.split("at most ").nth(1).and_then(|r| r.split(' ').next()).unwrap().parse().unwrap();
    assert!((8..512).contains(&fits), "{err}");
    let o = limited(&fits.to_string());
    no_panic(&o);
    assert!(o.status.success(), "{fits} ranks: {:?} {}", o.status, stderr(&o));
    std::fs::remove_dir_all(&root).ok();
}
