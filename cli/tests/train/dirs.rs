//! The Llama bench, out-dirs and checkpoint directories, resume errors,
//! messages and --keep-last.

use super::*;

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

/// Issue 35: `chorus plan --out-dir DIR` where DIR is a finished `chorus
/// train` output deleted its model, summary, curve and config and exited 0.
/// Refused (exit 2), naming the command and what is there; every file kept;
/// a plan's own out-dir is replaced by the next plan, and refused to train.
#[test]
fn one_commands_out_dir_is_never_another_commands() {
    let root = scratch("other-command");
    let out = root.join("run");
    let o = gpt_into(&out, &["--steps", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let before = listing(&out);
    assert!(before.iter().any(|(n, _)| n == "summary.json"), "{before:?}");
    let plan = |dir: &Path| run(&["plan", "--model", "gpt", "--gpus", "2", "--out-dir", s(dir)]);
    let p = plan(&out);
    no_panic(&p);
    assert_eq!(p.status.code(), Some(2), "{}", stderr(&p));
    assert!(
        stderr(&p).contains("holds the output of `chorus train`") && stderr(&p).contains("config.toml"),
        "{}",
        stderr(&p)
    );
    assert_eq!(listing(&out), before, "every file of the train run kept");
    let planned = root.join("plan");
    for _ in 0..2 {
        let p = plan(&planned);
        assert!(p.status.success(), "a plan replaces its own out-dir: {}", stderr(&p));
    }
    let o = gpt_into(&planned, &["--steps", "2"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("holds the output of `chorus plan`"), "{}", stderr(&o));
    assert!(planned.join("plan.json").is_file());
    std::fs::remove_dir_all(&root).ok();
}
