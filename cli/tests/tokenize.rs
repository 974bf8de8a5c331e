//! `chorus tokenize` end to end: a byte-level BPE trained on the input, the
//! input packed into token rows (checked against the documents encoded one
//! by one here and packed independently), JSON lines, the refusals (nothing
//! written, nothing left behind), and `chorus train --model llama
//! --tokenizer … --text` carrying the tokenizer into its model directory.
//!
//! The `#[ignore]`d tests check the same files with transformers
//! (`ci/tokenizer_check.py` under `$CHORUS_PYTHON`, see `ci/python-env.sh`):
//! `PreTrainedTokenizerFast(tokenizer_file=…)` encodes to chorus's ids and
//! decodes back, and `AutoTokenizer` / `AutoModelForCausalLM` load the
//! trained model's directory.

use crate::common;
use crate::torch_python;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use chorus_train::tokenizer::HfTokenizer;
use common::{chorus, run_bounded, scratch, text, Scratch};

const LIMIT: Duration = Duration::from_secs(300);

/// Paragraphs of words (some multi-byte) separated by blank lines.
fn corpus(docs: usize) -> String {
    let words = ["the", "cat", "sat", "on", "mat", "dog", "ran", "far", "naïve", "café", "日本語", "über", "a", "of"];
    let mut s = String::new();
    for d in 0..docs {
        for line in 0..1 + d % 3 {
            let n = 3 + (d * 5 + line) % 9;
            let ws: Vec<&str> = (0..n).map(|i| words[(d * 7 + line * 3 + i * 11) % words.len()]).collect();
            s.push_str(&ws.join(" "));
            s.push_str(if d % 4 == 0 { ".\n" } else { "\n" });
        }
        s.push_str(if d % 5 == 0 { "\n  \n" } else { "\n" });
    }
    s
}

fn run(args: &[&str]) -> Output {
    run_bounded(chorus().args(args), LIMIT)
}

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "{}\nstdout: {}\nstderr: {}", out.status, text(&out.stdout), text(&out.stderr));
    text(&out.stdout)
}

fn usage_error(out: &Output, says: &str) {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stdout: {}\nstderr: {err}", text(&out.stdout));
    assert!(err.contains(says), "expected {says:?} in: {err}");
}

/// A token file read independently of chorus: its descriptor, shape and ids.
fn read_npy(path: &Path) -> (String, usize, usize, Vec<u32>) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..8], b"\x93NUMPY\x01\x00");
    let len = u16::from_le_bytes([b[8], b[9]]) as usize;
    assert_eq!((10 + len) % 64, 0, "the data starts 64-byte aligned");
    let h = std::str::from_utf8(&b[10..10 + len]).unwrap();
    let descr = h.split("'descr': '").nth(1).unwrap().split('\'').next().unwrap().to_string();
    let shape = h.split("'shape': (").nth(1).unwrap().split(')').next().unwrap();
    let dims: Vec<usize> =
        shape.split(',').filter(|s| !s.trim().is_empty()).map(|s| s.trim().parse().unwrap()).collect();
    let data = &b[10 + len..];
    let ids: Vec<u32> = match descr.as_str() {
        "<u2" => data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u32).collect(),
        "<u4" => data.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        d => panic!("unexpected dtype {d}"),
    };
    assert_eq!(ids.len(), dims[0] * dims[1]);
    (descr, dims[0], dims[1], ids)
}

/// The rows the documents should give: each encoded, followed by the
/// end-of-text id, all in order, cut into rows of `cols` (the tail dropped).
fn expected_rows(tok: &HfTokenizer, docs: &[&str], cols: usize) -> (Vec<u32>, usize) {
    let eos = tok.eos_id().unwrap();
    let mut stream = Vec::new();
    for d in docs {
        stream.extend(tok.encode_plain(d).unwrap());
        stream.push(eos);
    }
    let rows = stream.len() / cols;
    let dropped = stream.len() - rows * cols;
    stream.truncate(rows * cols);
    (stream, dropped)
}

/// Trains a tokenizer on a corpus and tokenizes it: returns the directory,
/// the tokenizer's path and the corpus.
fn trained(name: &str) -> (Scratch, PathBuf, String) {
    let dir = scratch(name);
    let corpus = corpus(300);
    std::fs::write(dir.join("corpus.txt"), &corpus).unwrap();
    let tok = dir.join("tok/tokenizer.json");
    std::fs::create_dir_all(dir.join("tok")).unwrap();
    let d = |p: &str| dir.join(p).display().to_string();
    let out = run(&[
        "tokenize",
        "--train-tokenizer",
        "--vocab-size",
        "320",
        "--tokenizer",
        &tok.display().to_string(),
        "--input",
        &d("corpus.txt"),
        "--out",
        &d("tokens.npy"),
        "--seq-len",
        "16",
    ]);
    let said = ok(&out);
    assert!(said.contains("documents") && said.contains("tail tokens dropped"), "{said}");
    (dir, tok, corpus)
}

#[test]
fn a_trained_tokenizer_packs_the_documents_into_rows() {
    let (dir, tok_path, corpus) = trained("tokenize-train");
    assert!(tok_path.with_file_name("tokenizer_config.json").is_file());
    let tok = HfTokenizer::from_file(&tok_path).unwrap();
    assert!((280..=320).contains(&tok.vocab_size()), "{} merges learnt", tok.vocab_size() - 257);
    assert_eq!((tok.eos_id(), tok.bos_id(), tok.pad_id()), (Some(0), Some(0), Some(0)));
    // Documents as the docs define them: runs of lines ended by a blank line, the last line break dropped.
    let docs: Vec<&str> = corpus
        .split("\n\n")
        .map(|d| d.trim_start_matches("  \n").trim_end_matches('\n'))
        .filter(|d| !d.is_empty())
        .collect();
    assert_eq!(docs.len(), 300);
    let (want, dropped) = expected_rows(&tok, &docs, 17);
    let (descr, rows, cols, ids) = read_npy(&dir.join("tokens.npy"));
    assert_eq!((descr.as_str(), cols), ("<u2", 17));
    assert_eq!(ids, want);
    assert!(rows > 100, "{rows} rows");
    assert!(dropped < 17);
    assert!(ids.iter().all(|i| (*i as usize) < tok.vocab_size()));
    // Nothing staged is left beside the outputs.
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.iter().all(|n| !n.to_string_lossy().contains("partial")), "{left:?}");
    // Tokenized again with the written tokenizer (the existing --out refused first, then replaced).
    let d = |p: &str| dir.join(p).display().to_string();
    let again = |extra: &[&str]| {
        let mut a = vec!["tokenize", "--tokenizer"];
        let t = tok_path.display().to_string();
        let (input, out) = (d("corpus.txt"), d("tokens.npy"));
        a.extend([t.as_str(), "--input", &input, "--out", &out, "--seq-len", "16"]);
        a.extend(extra);
        run(&a)
    };
    let before = std::fs::read(dir.join("tokens.npy")).unwrap();
    usage_error(&again(&[]), "exists; give --overwrite");
    ok(&again(&["--overwrite"]));
    assert_eq!(std::fs::read(dir.join("tokens.npy")).unwrap(), before, "the same tokenizer gives the same file");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn json_lines_and_the_refusals() {
    let (dir, tok_path, _) = trained("tokenize-jsonl");
    let tok = HfTokenizer::from_file(&tok_path).unwrap();
    let docs = ["the cat sat", "naïve café\nover two lines", "", "日本語 dog ran far"];
    let lines: Vec<String> = docs.iter().map(|d| serde_json::json!({"id": 1, "text": d}).to_string()).collect();
    std::fs::write(dir.join("a.jsonl"), lines[..2].join("\n") + "\n\n").unwrap();
    std::fs::write(dir.join("b.jsonl"), lines[2..].join("\n")).unwrap();
    let (t, a, b) = (tok_path.display().to_string(), dir.join("a.jsonl"), dir.join("b.jsonl"));
    let (a, b, out) = (a.display().to_string(), b.display().to_string(), dir.join("j.npy").display().to_string());
    let base = ["tokenize", "--tokenizer", &t, "--out", &out];
    let with = |extra: &[&str]| run(&[&base[..], extra].concat());
    ok(&with(&["--input", &a, &b, "--field", "text", "--seq-len", "2"]));
    // The empty document gives nothing, not even an end-of-text token.
    let nonempty: Vec<&str> = docs.iter().copied().filter(|d| !d.is_empty()).collect();
    let (want, _) = expected_rows(&tok, &nonempty, 3);
    assert_eq!(read_npy(Path::new(&out)).3, want);
    std::fs::remove_file(&out).unwrap();

    // A bad line in the second file: an error naming it, and no output at all.
    std::fs::write(dir.join("c.jsonl"), format!("{}\n{{\"body\": \"x\"}}\n", lines[0])).unwrap();
    let c = dir.join("c.jsonl").display().to_string();
    let failed = with(&["--input", &a, &c, "--field", "text", "--seq-len", "2"]);
    assert_eq!(failed.status.code(), Some(1));
    assert!(text(&failed.stderr).contains("c.jsonl:2: no field \"text\""), "{}", text(&failed.stderr));
    let left: Vec<_> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(!left.iter().any(|n| n.starts_with("j.npy") || n.contains("partial")), "{left:?}");
    // Not UTF-8; too little text for one row; bad sizes and paths: refused, nothing written.
    std::fs::write(dir.join("latin1.txt"), b"caf\xe9 au lait\n").unwrap();
    let latin1 = dir.join("latin1.txt").display().to_string();
    let bad = with(&["--input", &latin1, "--seq-len", "2"]);
    assert!(text(&bad.stderr).contains("latin1.txt:1: not UTF-8"), "{}", text(&bad.stderr));
    assert!(text(&with(&["--input", &a, "--field", "text", "--seq-len", "1000"]).stderr).contains("fewer than one row"));
    usage_error(&with(&["--input", &a, "--seq-len", "0"]), "--seq-len must be from 1");
    usage_error(&with(&["--input", &dir.display().to_string(), "--seq-len", "4"]), "is a directory");
    usage_error(&with(&["--input", &a, "--seq-len", "4", "--eos", "<nope>"]), "\"<nope>\" (--eos) is not a token");
    let dir_out =
        run(&["tokenize", "--tokenizer", &t, "--out", &dir.display().to_string(), "--input", &a, "--seq-len", "4"]);
    usage_error(&dir_out, "not a regular file");
    let nowhere = dir.join("missing/j.npy").display().to_string();
    let no_dir = run(&["tokenize", "--tokenizer", &t, "--out", &nowhere, "--input", &a, "--seq-len", "4"]);
    usage_error(&no_dir, "does not exist");
    assert!(!Path::new(&out).exists());
    // A tokenizer without a known end-of-text token needs --eos.
    let renamed = std::fs::read_to_string(&tok_path).unwrap().replace("<|endoftext|>", "<|zzz|>");
    std::fs::create_dir_all(dir.join("noeos")).unwrap();
    let noeos = dir.join("noeos/tokenizer.json");
    std::fs::write(&noeos, renamed).unwrap();
    let n = noeos.display().to_string();
    let args = ["tokenize", "--tokenizer", &n, "--out", &out, "--input", &a, "--field", "text", "--seq-len", "2"];
    usage_error(&run(&args), "no end-of-text token");
    ok(&run(&[&args[..], &["--eos", "<|zzz|>"]].concat()));
    let (want_a, _) = expected_rows(&tok, &docs[..2], 3);
    assert_eq!(read_npy(Path::new(&out)).3, want_a, "the same id (0) ends the documents");
    std::fs::remove_dir_all(&dir).ok();
}

/// `chorus train --model llama --tokenizer … --text`: trains on the text as
/// tokenized here, and the model directory carries the tokenizer.
#[test]
fn train_with_a_tokenizer_writes_it_into_the_model_directory() {
    train_with_a_tokenizer("tokenize-train-llama", false);
}

fn train_with_a_tokenizer(name: &str, check_with_transformers: bool) {
    let (dir, tok_path, _) = trained(name);
    let (t, corpus, out) =
        (tok_path.display().to_string(), dir.join("corpus.txt").display().to_string(), dir.join("run"));
    let o = out.display().to_string();
    let base = ["train", "--model", "llama", "--tokenizer", &t, "--text", &corpus, "--world-size", "2", "--steps", "3"];
    let small = ["--batch", "2", "--seq-len", "16", "--hidden", "32", "--heads", "2", "--layers", "1", "--out-dir", &o];
    usage_error(&run(&[&base[..], &small, &["--vocab", "100"]].concat()), "more than the model's vocabulary of 100");
    ok(&run(&[&base[..], &small].concat()));
    let model = out.join("model");
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(model.join("config.json")).unwrap()).unwrap();
    let vocab = HfTokenizer::from_file(&tok_path).unwrap().vocab_size();
    assert_eq!((config["vocab_size"].as_u64(), config["eos_token_id"].as_u64()), (Some(vocab as u64), Some(0)));
    assert_eq!(std::fs::read(model.join("tokenizer.json")).unwrap(), std::fs::read(&tok_path).unwrap());
    let tc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(model.join("tokenizer_config.json")).unwrap()).unwrap();
    assert_eq!(tc["tokenizer_class"], "PreTrainedTokenizerFast");
    assert_eq!(tc["eos_token"], "<|endoftext|>");
    let gc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(model.join("generation_config.json")).unwrap()).unwrap();
    assert_eq!(gc, serde_json::json!({"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}));
    let summary: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["config"]["tokenizer"], t.as_str());
    // Without --text there is nothing to tokenize.
    let o2 = dir.join("run2").display().to_string();
    let no_text = ["train", "--model", "llama", "--tokenizer", &t, "--steps", "1", "--out-dir", &o2];
    usage_error(&run(&no_text), "needs --text");
    if check_with_transformers {
        transformers_loads(&model, &dir, vocab);
    }
    std::fs::remove_dir_all(&dir).ok();
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ci/tokenizer_check.py")
}

fn python(args: &[&str]) -> serde_json::Value {
    let py = torch_python::torch_python("transformers");
    let out = run_bounded(std::process::Command::new(py).arg(script()).args(args), LIMIT);
    serde_json::from_str(&ok(&out)).unwrap()
}

const SAMPLE: &str = "The cat sat on the mat.  Naïve café!\n\tüber 日本語 <|endoftext|> and 42 dogs, ran far\n\n";

/// transformers loads the model directory (tokenizer and model) and agrees on ids.
fn transformers_loads(model: &Path, dir: &Path, vocab: usize) {
    std::fs::write(dir.join("sample.txt"), SAMPLE).unwrap();
    let got = python(&["load", &model.display().to_string(), &dir.join("sample.txt").display().to_string()]);
    let tok = HfTokenizer::from_file(&model.join("tokenizer.json")).unwrap();
    let ids: Vec<u64> = tok.encode(SAMPLE).unwrap().into_iter().map(u64::from).collect();
    assert_eq!(got["ids"], serde_json::json!(ids));
    assert_eq!(got["decoded"], SAMPLE);
    assert_eq!(got["fast"], true, "{got}");
    for key in ["eos_token_id", "bos_token_id", "pad_token_id", "generation_eos_token_id", "generation_bos_token_id"] {
        assert_eq!(got[key], 0, "{key}: {got}");
    }
    assert_eq!(got["logits_shape"], serde_json::json!([1, ids.len(), vocab]));
}

#[test]
#[ignore = "needs PyTorch and transformers (ci/python-env.sh)"]
fn transformers_encodes_to_the_same_ids() {
    let (dir, tok_path, _) = trained("tokenize-transformers");
    std::fs::write(dir.join("sample.txt"), SAMPLE).unwrap();
    let got = python(&["ids", &tok_path.display().to_string(), &dir.join("sample.txt").display().to_string()]);
    let tok = HfTokenizer::from_file(&tok_path).unwrap();
    let ids: Vec<u64> = tok.encode(SAMPLE).unwrap().into_iter().map(u64::from).collect();
    assert!(ids.contains(&0), "the special token in the text is one id");
    assert_eq!(got["ids"], serde_json::json!(ids));
    assert_eq!(got["decoded"], SAMPLE);
    assert_eq!(tok.decode(&tok.encode(SAMPLE).unwrap()).unwrap(), SAMPLE);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
#[ignore = "needs PyTorch and transformers (ci/python-env.sh)"]
fn transformers_loads_the_trained_model_directory() {
    train_with_a_tokenizer("tokenize-train-llama-hf", true);
}

/// The names in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

/// Issue 35: `--out` is never an input or the tokenizer, however it is
/// spelled (the same path, `..`, a symbolic link to the input's folder, a
/// hard link), with or without `--overwrite`; with `--train-tokenizer`,
/// `--tokenizer` (and its `tokenizer_config.json`) is never `--out` or an
/// input, even before either exists. Each refusal leaves every file as it was.
#[test]
fn an_output_is_never_an_input() {
    let (dir, tok_path, corpus) = trained("tokenize-overlap");
    let d = |p: &str| dir.join(p).display().to_string();
    let t = tok_path.display().to_string();
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::os::unix::fs::symlink(&dir, dir.join("link")).unwrap();
    std::fs::hard_link(dir.join("corpus.txt"), dir.join("hard.txt")).unwrap();
    let before = listing(&dir);
    let input = d("corpus.txt");
    for out in [d("corpus.txt"), d("sub/../corpus.txt"), d("link/corpus.txt"), d("hard.txt"), t.clone()] {
        for overwrite in [false, true] {
            let mut args = vec!["tokenize", "--tokenizer", &t, "--input", &input, "--out", &out, "--seq-len", "8"];
            if overwrite {
                args.push("--overwrite");
            }
            let r = run(&args);
            assert_eq!(r.status.code(), Some(2), "--out {out} overwrite {overwrite}: {}", text(&r.stderr));
            let err = text(&r.stderr);
            assert!(err.contains("--out") && err.contains("an output never replaces what the run reads"), "{err}");
        }
    }
    assert_eq!(std::fs::read_to_string(dir.join("corpus.txt")).unwrap(), corpus);
    assert_eq!(listing(&dir), before);
    // --train-tokenizer --tokenizer X --out X, X new: refused before training.
    let x = d("new.json");
    for extra in [&[][..], &["--overwrite"]] {
        let args = [
            &["tokenize", "--train-tokenizer", "--vocab-size", "300", "--tokenizer", &x, "--input", &input],
            &["--out", &x, "--seq-len", "8"][..],
            extra,
        ]
        .concat();
        let r = run(&args);
        assert_eq!(r.status.code(), Some(2), "{}", text(&r.stderr));
        assert!(text(&r.stderr).contains("--tokenizer") && text(&r.stderr).contains("is --out"), "{}", text(&r.stderr));
    }
    // The trained tokenizer written over an input, or its config over an input.
    let into_input = run(&[
        "tokenize",
        "--train-tokenizer",
        "--vocab-size",
        "300",
        "--tokenizer",
        &d("hard.txt"),
        "--input",
        &input,
        "--out",
        &d("t.npy"),
        "--seq-len",
        "8",
        "--overwrite",
    ]);
    assert_eq!(into_input.status.code(), Some(2), "{}", text(&into_input.stderr));
    assert!(text(&into_input.stderr).contains("is --input"), "{}", text(&into_input.stderr));
    assert_eq!(listing(&dir), before);
    assert_eq!(std::fs::read_to_string(dir.join("corpus.txt")).unwrap(), corpus);
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 35: `--train-tokenizer --tokenizer dir/new.json --overwrite`
/// replaced the `tokenizer_config.json` of another tokenizer in that
/// folder. A config that describes another tokenizer (the folder's
/// `tokenizer.json`, or one beside a `--tokenizer` not yet written) is
/// never replaced; the pair a run wrote is replaced with `--overwrite`.
#[test]
fn a_companion_config_of_another_tokenizer_is_never_replaced() {
    let (dir, tok_path, _) = trained("tokenize-companion");
    let d = |p: &str| dir.join(p).display().to_string();
    let folder = tok_path.parent().unwrap().to_path_buf();
    let config = folder.join("tokenizer_config.json");
    let theirs = std::fs::read(&config).unwrap();
    let (input, out) = (d("corpus.txt"), d("t.npy"));
    let train = |tokenizer: &str, overwrite: bool| {
        let mut args = vec!["tokenize", "--train-tokenizer", "--vocab-size", "290", "--tokenizer", tokenizer];
        args.extend(["--input", &input, "--out", &out, "--seq-len", "8"]);
        if overwrite {
            args.push("--overwrite");
        }
        run(&args)
    };
    let new = folder.join("new.json").display().to_string();
    for overwrite in [false, true] {
        let r = train(&new, overwrite);
        assert_eq!(r.status.code(), Some(2), "{}", text(&r.stderr));
        let err = text(&r.stderr);
        assert!(
            err.contains("tokenizer_config.json") && err.contains("describes") && err.contains("tokenizer.json"),
            "{err}"
        );
    }
    assert_eq!(std::fs::read(&config).unwrap(), theirs);
    assert!(!folder.join("new.json").exists());
    // The folder's own tokenizer and its config are replaced together, with --overwrite only.
    let own = tok_path.display().to_string();
    usage_error(&train(&own, false), "give --overwrite");
    ok(&train(&own, true));
    let now = HfTokenizer::from_file(&tok_path).unwrap();
    assert!(now.vocab_size() <= 290, "{}", now.vocab_size());
    // A config left in a folder whose tokenizer is gone describes none this run writes.
    std::fs::remove_file(&tok_path).unwrap();
    let r = train(&own, true);
    assert_eq!(r.status.code(), Some(2), "{}", text(&r.stderr));
    assert!(text(&r.stderr).contains("does not exist, so it describes another tokenizer"), "{}", text(&r.stderr));
    std::fs::remove_dir_all(&dir).ok();
}

/// A corpus of `mb` megabytes (documents of a few lines).
fn big_corpus(path: &Path, mb: usize) {
    let block = corpus(200);
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut written = 0;
    while written < mb << 20 {
        std::io::Write::write_all(&mut f, block.as_bytes()).unwrap();
        written += block.len();
    }
}

/// Issue 35: an interrupted `tokenize` left `.OUT.PID.partial` files that
/// no later run removed. SIGTERM and SIGINT remove this run's and end it as
/// the signal would; a later run removes those of dead processes and keeps
/// a live process's.
#[test]
fn interrupted_runs_leave_no_staged_files() {
    use std::os::unix::process::ExitStatusExt;
    let (dir, tok_path, _) = trained("tokenize-signals");
    big_corpus(&dir.join("big.txt"), 48);
    let d = |p: &str| dir.join(p).display().to_string();
    let t = tok_path.display().to_string();
    for signal in [libc::SIGTERM, libc::SIGINT] {
        let (input, out) = (d("big.txt"), d("big.npy"));
        let mut child = chorus()
            .args(["tokenize", "--tokenizer", &t, "--input", &input, "--out", &out, "--seq-len", "64"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let staged = dir.join(format!(".big.npy.{}.partial", child.id()));
        let start = std::time::Instant::now();
        while !staged.exists() {
            assert!(start.elapsed() < LIMIT && child.try_wait().unwrap().is_none(), "no staged file appeared");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(300));
        // SAFETY: kill(2) on the child's pid; no memory involved.
        unsafe { libc::kill(child.id() as libc::pid_t, signal) };
        let status = common::wait_bounded(child, Duration::from_secs(30)).status;
        assert_eq!(status.signal(), Some(signal), "ended by the signal: {status:?}");
        assert!(!staged.exists(), "the staged file was removed");
        assert!(!dir.join("big.npy").exists());
    }
    // Left by a process that died without a chance to clean up, and by a live one (this test).
    let mut dead = std::process::Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    let stale = dir.join(format!(".small.npy.{dead_pid}.partial"));
    let live = dir.join(format!(".small.npy.{}.partial", std::process::id()));
    std::fs::write(&stale, vec![0u8; 1 << 20]).unwrap();
    std::fs::write(&live, b"in progress").unwrap();
    let (input, out) = (d("corpus.txt"), d("small.npy"));
    let r = run(&["tokenize", "--tokenizer", &t, "--input", &input, "--out", &out, "--seq-len", "8"]);
    ok(&r);
    assert!(text(&r.stderr).contains("left by an interrupted run"), "{}", text(&r.stderr));
    assert!(!stale.exists(), "a dead process's staged file is removed");
    assert!(live.exists(), "a live process's is kept");
    std::fs::remove_dir_all(&dir).ok();
}

/// Runs `chorus args` with its address space limited to `bytes`.
fn run_limited(args: &[&str], bytes: u64) -> Output {
    use std::os::unix::process::CommandExt;
    let mut cmd = chorus();
    cmd.args(args);
    // SAFETY: setrlimit is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(move || {
            let limit = libc::rlimit { rlim_cur: bytes, rlim_max: bytes };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    run_bounded(&mut cmd, LIMIT)
}

/// Issue 35: a 2 GB `tokenizer.json` was read (a gigabyte of it) before it
/// was refused; its size refuses it first, within 512 MiB of address space.
#[test]
fn a_huge_tokenizer_is_refused_by_its_size() {
    let dir = scratch("tokenize-huge");
    let tok = dir.join("tokenizer.json");
    std::fs::File::create(&tok).unwrap().set_len(2 << 30).unwrap();
    std::fs::write(dir.join("c.txt"), corpus(10)).unwrap();
    let d = |p: &str| dir.join(p).display().to_string();
    let (t, input, out) = (tok.display().to_string(), d("c.txt"), d("t.npy"));
    let r =
        run_limited(&["tokenize", "--tokenizer", &t, "--input", &input, "--out", &out, "--seq-len", "8"], 512 << 20);
    usage_error(&r, "2147483648 bytes, more than");
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 35: one document of 16.8 MB (a single line, and as a JSON string)
/// took 1.9 GB to tokenize; pieces of at most a megabyte bound it. Under a
/// 1 GiB address space both tokenize, to the same rows.
#[test]
fn one_huge_document_tokenizes_in_bounded_memory() {
    let (dir, tok_path, _) = trained("tokenize-huge-doc");
    let words = ["the", "cat", "sat", "on", "mat", "naïve", "café", "日本語"];
    let line: String = (0..3_150_000).map(|i| words[(i * 7) % words.len()]).collect::<Vec<_>>().join(" ");
    assert!(line.len() > 16_000_000 && line.len() < 16 << 20, "{}", line.len());
    std::fs::write(dir.join("one.txt"), format!("{line}\n")).unwrap();
    std::fs::write(dir.join("one.jsonl"), format!("{}\n", serde_json::json!({ "text": line }))).unwrap();
    let d = |p: &str| dir.join(p).display().to_string();
    let t = tok_path.display().to_string();
    let (one, jsonl, a, b) = (d("one.txt"), d("one.jsonl"), d("a.npy"), d("b.npy"));
    let limit = 1 << 30;
    ok(&run_limited(&["tokenize", "--tokenizer", &t, "--input", &one, "--out", &a, "--seq-len", "64"], limit));
    let args = ["tokenize", "--tokenizer", &t, "--input", &jsonl, "--field", "text", "--out", &b, "--seq-len", "64"];
    ok(&run_limited(&args, limit));
    let (rows_a, rows_b) = (read_npy(Path::new(&a)), read_npy(Path::new(&b)));
    assert_eq!(rows_a.3, rows_b.3, "the line and the JSON string give the same rows");
    // One document: at most one end-of-text token (none where it fell in the dropped tail).
    assert!(rows_a.1 > 10_000 && rows_a.3.iter().filter(|i| **i == 0).count() <= 1, "{} rows", rows_a.1);
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 35: a JSON-lines file that starts with a byte-order mark was "not
/// JSON at line 1 column 1"; a line that is an array had "no field text".
#[test]
fn json_lines_with_a_byte_order_mark_or_an_array() {
    let (dir, tok_path, _) = trained("tokenize-bom");
    let tok = HfTokenizer::from_file(&tok_path).unwrap();
    let d = |p: &str| dir.join(p).display().to_string();
    let t = tok_path.display().to_string();
    std::fs::write(dir.join("bom.jsonl"), "\u{feff}{\"text\": \"the cat sat\"}\n{\"text\": \"on the mat\"}\n").unwrap();
    let (bom, out) = (d("bom.jsonl"), d("bom.npy"));
    ok(&run(&["tokenize", "--tokenizer", &t, "--input", &bom, "--field", "text", "--out", &out, "--seq-len", "2"]));
    let (want, _) = expected_rows(&tok, &["the cat sat", "on the mat"], 3);
    assert_eq!(read_npy(Path::new(&out)).3, want, "the mark is no part of the text");
    std::fs::write(dir.join("array.jsonl"), "{\"text\": \"the cat\"}\n[\"the cat\", 1]\n").unwrap();
    let (array, out2) = (d("array.jsonl"), d("array.npy"));
    let r =
        run(&["tokenize", "--tokenizer", &t, "--input", &array, "--field", "text", "--out", &out2, "--seq-len", "2"]);
    assert_eq!(r.status.code(), Some(1), "{}", text(&r.stderr));
    let err = text(&r.stderr);
    assert!(err.contains("array.jsonl:2: a JSON line is an array, not an object"), "{err}");
    assert!(!Path::new(&out2).exists());
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 35: SIGUSR1 (a flight-recorder dump) while `chorus train` tokenized
/// its `--text` killed it (exit 138); it is answered from the start, and the
/// run goes on to the end.
#[test]
fn sigusr1_while_train_tokenizes_its_text_does_not_end_it() {
    let (dir, tok_path, _) = trained("tokenize-sigusr1");
    big_corpus(&dir.join("big.txt"), 24);
    let (t, text_path, out) = (tok_path.display().to_string(), dir.join("big.txt"), dir.join("run"));
    let child = chorus()
        .args(["train", "--model", "llama", "--tokenizer", &t, "--text"])
        .arg(&text_path)
        .args(["--world-size", "1", "--steps", "1", "--batch", "1", "--seq-len", "16", "--hidden", "32"])
        .args(["--heads", "2", "--layers", "1", "--out-dir"])
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Well inside the tokenization of 24 MB (seconds), after the process has started.
    std::thread::sleep(Duration::from_millis(700));
    assert!(!out.join("summary.json").exists(), "still preparing");
    // SAFETY: kill(2) on the child's pid; no memory involved.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGUSR1) };
    let r = common::wait_bounded(child, LIMIT);
    assert!(r.status.success(), "{:?}: {}", r.status, text(&r.stderr));
    assert!(text(&r.stderr).contains("SIGUSR1"), "the signal was answered: {}", text(&r.stderr));
    assert!(out.join("summary.json").is_file());
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 43: `--out` over the `tokenizer_config.json` beside `--tokenizer`
/// (which the run reads for its end-of-text token) was written with
/// `--overwrite`, the tokenizer unusable afterwards; it is read, so it is
/// never an output, however spelled, and the refusal does not advise
/// `--overwrite`.
#[test]
fn out_is_never_the_tokenizers_own_config() {
    let (dir, tok_path, _) = trained("tokenize-own-config");
    let config = tok_path.with_file_name("tokenizer_config.json");
    let before = std::fs::read(&config).unwrap();
    let t = tok_path.display().to_string();
    let input = dir.join("corpus.txt").display().to_string();
    let spelled = dir.join("tok/../tok/tokenizer_config.json").display().to_string();
    for out in [config.display().to_string(), spelled] {
        let r =
            run(&["tokenize", "--tokenizer", &t, "--input", &input, "--out", &out, "--seq-len", "16", "--overwrite"]);
        usage_error(&r, "is --tokenizer's tokenizer_config.json");
        assert!(!text(&r.stderr).contains("give --overwrite"), "{}", text(&r.stderr));
    }
    assert_eq!(std::fs::read(&config).unwrap(), before, "the tokenizer's config is untouched");
    ok(&run(&["tokenize", "--tokenizer", &t, "--input", &input, "--out", &d_out(&dir), "--seq-len", "16"]));
    std::fs::remove_dir_all(&dir).ok();
}

fn d_out(dir: &Path) -> String {
    dir.join("again.npy").display().to_string()
}

/// Issue 43: `chorus tokenize ... | true` panicked ("failed printing to
/// stdout: Broken pipe", exit 101). A closed stdout loses the summary
/// line only: the outputs are written and the run succeeds.
#[test]
fn a_closed_stdout_loses_only_the_summary() {
    let (dir, tok_path, _) = trained("tokenize-closed-stdout");
    let d = |p: &str| dir.join(p).display().to_string();
    let (t, input) = (tok_path.display().to_string(), d("corpus.txt"));
    let trained_tok = d("new/tokenizer.json");
    std::fs::create_dir_all(dir.join("new")).unwrap();
    for args in [
        vec!["tokenize", "--tokenizer", &t, "--input", &input, "--out", "OUT", "--seq-len", "16"],
        vec!["tokenize", "--train-tokenizer", "--vocab-size", "300", "--tokenizer", &trained_tok, "--input", &input]
            .into_iter()
            .chain(["--out", "OUT", "--seq-len", "16"])
            .collect(),
    ] {
        let out = d(&format!("closed-{}.npy", args.len()));
        let args: Vec<&str> = args.iter().map(|a| if *a == "OUT" { out.as_str() } else { a }).collect();
        let mut child = chorus()
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // The read end closed before anything is printed.
        drop(child.stdout.take());
        let r = common::wait_bounded(child, LIMIT);
        assert_eq!(r.status.code(), Some(0), "{args:?}: {}", text(&r.stderr));
        assert!(!text(&r.stderr).contains("panicked"), "{}", text(&r.stderr));
        assert!(Path::new(&out).is_file(), "{args:?}: the token rows are written");
    }
    assert!(dir.join("new/tokenizer.json").is_file() && dir.join("new/tokenizer_config.json").is_file());
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 43: under `ulimit -v 300000` a 3 MiB line aborted the process
/// ("memory allocation of 33554432 bytes failed", SIGABRT) and left its
/// staged file. The address space encoding needs is checked first: a
/// usage error naming the limit, nothing staged or written.
#[test]
fn an_address_space_too_small_to_encode_is_refused_first() {
    let (dir, tok_path, _) = trained("tokenize-address-space");
    let line: String = (0..700_000).map(|i| ["the", "cat", "sat", "naïve"][i % 4]).collect::<Vec<_>>().join(" ");
    std::fs::write(dir.join("line.txt"), format!("{line}\n")).unwrap();
    let d = |p: &str| dir.join(p).display().to_string();
    let (t, input, out) = (tok_path.display().to_string(), d("line.txt"), d("line.npy"));
    let r = run_limited(
        &["tokenize", "--tokenizer", &t, "--input", &input, "--out", &out, "--seq-len", "16"],
        300_000 << 10,
    );
    usage_error(&r, "(ulimit -v 300000): raise the limit");
    let left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("line.npy"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 43: SIGUSR1 (the flight-recorder dump chorus documents) killed
/// `chorus tokenize` (exit 138), its staged file left behind; it is
/// answered, and the run goes on to the end.
#[test]
fn sigusr1_does_not_end_tokenize() {
    let (dir, tok_path, _) = trained("tokenize-usr1");
    big_corpus(&dir.join("big.txt"), 24);
    let d = |p: &str| dir.join(p).display().to_string();
    let (t, input, out) = (tok_path.display().to_string(), d("big.txt"), d("big.npy"));
    let child = chorus()
        .args(["tokenize", "--tokenizer", &t, "--input", &input, "--out", &out, "--seq-len", "64"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let staged = dir.join(format!(".big.npy.{}.partial", child.id()));
    let start = std::time::Instant::now();
    while !staged.exists() && start.elapsed() < LIMIT {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(staged.exists(), "no staged file appeared");
    // SAFETY: kill(2) on the child's pid; no memory involved.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGUSR1) };
    let r = common::wait_bounded(child, LIMIT);
    assert!(r.status.success(), "{:?}: {}", r.status, text(&r.stderr));
    assert!(text(&r.stderr).contains("SIGUSR1"), "the signal was answered: {}", text(&r.stderr));
    assert!(Path::new(&out).is_file() && !staged.exists());
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 43: under an address-space limit, `train --tokenizer --text` named
/// the most ranks that fit, and that count was then refused after the text
/// was tokenized with a smaller one: two checks, two answers. The limit is
/// checked once, with the text's token rows counted before they are made,
/// and the count it names runs. (One malloc arena, so the count does not
/// depend on this machine's cores.)
#[test]
fn the_ranks_an_address_space_limit_allows_run() {
    let (dir, tok_path, _) = trained("tokenize-rank-limit");
    big_corpus(&dir.join("big.txt"), 8);
    let t = tok_path.display().to_string();
    let train = |world: usize| {
        let script = format!(
            "ulimit -v 800000 && exec {} train --model llama --layers 1 --hidden 32 --heads 2 --kv-heads 1 \
             --intermediate 64 --vocab 320 --seq-len 16 --batch 1 --steps 1 --tokenizer {t} --text {} \
             --world-size {world} --out-dir {}",
            common::chorus_path(),
            dir.join("big.txt").display(),
            dir.join(format!("run-{world}")).display()
        );
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", &script]).env("MALLOC_ARENA_MAX", "1");
        run_bounded(&mut cmd, LIMIT)
    };
    let r = train(512);
    let err = text(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    let fits: usize = err
        .split("at most ")
        .nth(1)
        .and_then(|s| s.split(" ranks fit").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count named: {err}"));
    assert!((2..512).contains(&fits), "{err}");
    let r = train(fits);
    assert!(r.status.success(), "{fits} ranks, named as fitting: {}", text(&r.stderr));
    std::fs::remove_dir_all(&dir).ok();
}
