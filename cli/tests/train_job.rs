//! `chorus train --config job.toml` and the run's `config.toml` (a run
//! repeated from its out-dir alone gives the same losses, bit for bit), and
//! the throughput in `summary.json` (tokens/s from the run's own step
//! times, MFU from the closed-form FLOPs of a tiny model worked by hand).

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::{chorus, run_bounded, scratch, text};
use serde_json::Value;

const LIMIT: Duration = Duration::from_secs(300);

fn train(args: &[&str]) -> std::process::Output {
    let out = run_bounded(chorus().arg("train").args(args), LIMIT);
    let err = text(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    out
}

fn ok(args: &[&str]) {
    let out = train(args);
    assert!(out.status.success(), "chorus train {args:?}: {}\n{}", text(&out.stdout), text(&out.stderr));
}

fn summary(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

#[test]
fn a_run_repeats_from_its_config_toml_with_the_same_losses() {
    let dir = scratch("job-repeat");
    let (first, second) = (dir.join("first"), dir.join("second"));
    let job = dir.join("job.toml");
    std::fs::write(
        &job,
        format!(
            "steps = 3\nworld_size = 2\nbatch = 2\nout_dir = {:?}\n[model]\nd-model = 16\nlayers = 1\nheads = 2\nseq_len = 8\n\
             [optimizer]\nlr = 0.01\n",
            first.to_str().unwrap()
        ),
    )
    .unwrap();
    // The command line wins over the file: 4 steps, seed 3.
    ok(&["--config", job.to_str().unwrap(), "--steps", "4", "--seed", "3"]);
    let a = summary(&first);
    assert_eq!(a["losses"].as_array().unwrap().len(), 4);
    assert_eq!(a["config"]["world_size"], 2);
    assert_eq!(a["config"]["seed"], 3);
    assert_eq!(a["config"]["transformer"]["d_model"], 16);
    let config = std::fs::read_to_string(first.join("config.toml")).unwrap();
    assert!(config.contains("steps = 4  # command line\n"), "{config}");
    assert!(config.contains(&format!("world_size = 2  # --config {}\n", job.display())), "{config}");
    assert!(config.contains("micro_batches = 1  # default\n"), "{config}");
    // The out-dir's marker lists config.toml with what the run wrote.
    assert!(std::fs::read_to_string(first.join(".chorus-out")).unwrap().contains("config.toml"));

    ok(&["--config", first.join("config.toml").to_str().unwrap(), "--out-dir", second.to_str().unwrap()]);
    let b = summary(&second);
    // Bit for bit: the JSON text of every loss, and the f64s themselves.
    assert_eq!(a["losses"].to_string(), b["losses"].to_string());
    let bits = |v: &Value| floats(v).iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a["losses"]), bits(&b["losses"]));
    // The same configuration but where the output went.
    let again = std::fs::read_to_string(second.join("config.toml")).unwrap();
    let strip = |t: &str| {
        t.lines()
            .filter(|l| !l.starts_with("out_dir"))
            .map(|l| l.split("  #").next().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(strip(&config), strip(&again));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_mlp_writes_its_config_toml_too_and_repeats_from_it() {
    let dir = scratch("job-mlp");
    let (first, second) = (dir.join("first"), dir.join("second"));
    ok(&[
        "--model",
        "mlp",
        "--steps",
        "3",
        "--world-size",
        "2",
        "--dims",
        "4,8,2",
        "--out-dir",
        first.to_str().unwrap(),
    ]);
    let config = std::fs::read_to_string(first.join("config.toml")).unwrap();
    assert!(config.contains("dims = [4, 8, 2]  # command line\n"), "{config}");
    ok(&["--config", first.join("config.toml").to_str().unwrap(), "--out-dir", second.to_str().unwrap()]);
    assert_eq!(summary(&first)["losses"].to_string(), summary(&second)["losses"].to_string());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_bad_job_file_is_refused_before_anything_is_written() {
    let dir = scratch("job-bad");
    let out_dir = dir.join("out");
    let o = out_dir.to_str().unwrap();
    let job = dir.join("job.toml");
    let j = job.to_str().unwrap();
    for (file, expected) in [
        ("steps = 2\nstepz = 3\n", "`stepz` is no flag of chorus train"),
        // Wrong even where the command line's --steps overrides it.
        ("[training]\nsteps = \"two\"\n", "`training.steps`"),
        ("allow_nonfinite = \"yes\"\n", "a switch takes true or false"),
        ("lr = -1\n", "--lr -1 must be"),
    ] {
        std::fs::write(&job, file).unwrap();
        let out = train(&["--config", j, "--out-dir", o, "--steps", "1"]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{file}: {err}");
        assert!(err.contains(expected), "{file}: {err}");
        if !expected.starts_with("--lr") {
            assert!(err.contains(j), "{file}: {err}");
        }
        assert!(!out_dir.exists(), "{file}");
    }
    let json = dir.join("config.json");
    std::fs::write(&json, "{}").unwrap();
    let out = train(&["--config", json.to_str().unwrap(), "--out-dir", o]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--init-from"), "{}", text(&out.stderr));
    let out = train(&["--config", dir.to_str().unwrap(), "--out-dir", o]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("directory"), "{}", text(&out.stderr));
    assert!(!out_dir.exists());
    std::fs::remove_dir_all(&dir).ok();
}

/// Tokens/s recomputed from the run's own step times: every step's, and
/// the median over the steps after the first.
fn check_tokens_per_s(s: &Value, tokens_per_rank_step: f64, world: f64) -> f64 {
    let times = floats(&s["step_times_s"]);
    let per_rank: Vec<f64> = times.iter().map(|t| tokens_per_rank_step / t).collect();
    let global: Vec<f64> = per_rank.iter().map(|r| r * world).collect();
    for (got, want) in floats(&s["step_tokens_per_s"]).iter().zip(&global) {
        assert!(close(*got, *want), "{got} vs {want}");
    }
    assert_eq!(s["step_tokens_per_s"].as_array().unwrap().len(), times.len());
    let tps = s["tokens_per_s"].as_f64().unwrap();
    assert!(close(tps, median(&global[1..])), "{tps} vs {}", median(&global[1..]));
    let per = s["tokens_per_s_per_rank"].as_f64().unwrap();
    assert!(close(per, median(&per_rank[1..])));
    per
}

#[test]
fn the_transformers_throughput_and_mfu_are_the_formulas() {
    let dir = scratch("job-gpt-mfu");
    let out = dir.join("out");
    ok(&[
        "--model",
        "gpt",
        "--world-size",
        "2",
        "--batch",
        "3",
        "--d-model",
        "16",
        "--layers",
        "2",
        "--heads",
        "2",
        "--d-ff",
        "24",
        "--seq-len",
        "8",
        "--steps",
        "4",
        "--peak-tflops",
        "0.002",
        "--out-dir",
        out.to_str().unwrap(),
    ]);
    let s = summary(&out);
    // 3 sequences of 8 tokens per rank and step.
    let per_rank = check_tokens_per_s(&s, 24.0, 2.0);
    // Without the embedding table (29 × 16): per layer 2 norms (2·16), q k v o (4·16·16), up and down (2·16·24);
    // the final norm (16) and the head (29·16).
    let n = 2.0 * (2.0 * 16.0 + 4.0 * 256.0 + 2.0 * 16.0 * 24.0) + 16.0 + 29.0 * 16.0;
    assert_eq!(n, 4128.0);
    // Attention: 12 · 2 layers · 2 heads · 8 wide · 8 tokens.
    let flops = 6.0 * n + 12.0 * 2.0 * 2.0 * 8.0 * 8.0;
    assert_eq!(s["flops_per_token"].as_f64().unwrap(), flops);
    let mfu = s["mfu"].as_f64().unwrap();
    assert!(close(mfu, 100.0 * flops * per_rank / 2e9), "{mfu}");
    assert_eq!(s["step_mfu"].as_array().unwrap().len(), 4);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_llamas_throughput_is_the_formula_and_the_cpu_has_no_mfu() {
    let dir = scratch("job-llama-mfu");
    let out = dir.join("out");
    let flags = "--model llama --world-size 2 --batch 2 --hidden 16 --layers 1 --heads 4 --kv-heads 2 \
                 --intermediate 24 --seq-len 8 --steps 3";
    let mut args: Vec<&str> = flags.split_whitespace().collect();
    args.extend(["--out-dir", out.to_str().unwrap()]);
    ok(&args);
    let s = summary(&out);
    check_tokens_per_s(&s, 16.0, 2.0);
    // Without embed_tokens (29 × 16): q and o (16·16 each), k and v (16 × 2 heads of 4: 16·8 each), gate up down
    // (3·16·24), 2 norms; the final norm and lm_head (29·16).
    let n = 2.0 * 256.0 + 2.0 * 128.0 + 3.0 * 16.0 * 24.0 + 2.0 * 16.0 + 16.0 + 29.0 * 16.0;
    let flops = 6.0 * n + 12.0 * 1.0 * 4.0 * 4.0 * 8.0;
    assert_eq!(s["flops_per_token"].as_f64().unwrap(), flops);
    // The CPU's peak is not known: no MFU.
    assert_eq!(s["mfu"], Value::Null);
    assert_eq!(s["peak_tflops"], Value::Null);
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 43: an error about a value the job file set, not the command line,
/// said `--momentum is for --optimizer sgd` as if the user had typed it;
/// it names the file, and a relative path in it the directory it was taken
/// from. `chorus plan` reads the same file and says the same.
#[test]
fn an_error_about_a_job_files_value_names_the_file() {
    let dir = scratch("train-job-sources");
    let job = dir.join("job.toml");
    std::fs::write(&job, "momentum = 0.9\n[data]\ntokenizer = \"no-such/tokenizer.json\"\n").unwrap();
    let j = job.display().to_string();
    for command in ["train", "plan"] {
        let r = run_bounded(chorus().args([command, "--config", &j, "--model", "llama"]).current_dir(&dir), LIMIT);
        let err = text(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{command}: {err}");
        assert!(err.contains(&format!("--momentum is for --optimizer sgd (--momentum is from --config {j})")), "{err}");
    }
    std::fs::write(&job, "[data]\ntokenizer = \"no-such/tokenizer.json\"\n").unwrap();
    let r = train(&["--config", &j, "--model", "llama", "--text", "x.txt", "--steps", "1"]);
    let err = text(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(
        err.contains("no-such/tokenizer.json") && err.contains("relative path is taken from the working directory"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
