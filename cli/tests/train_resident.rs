//! The process's resident peak of `chorus train` against FSDP's own count:
//! a 125M Llama (hidden 768, 12 layers, 12 heads / 4 key-value heads,
//! intermediate 2048, vocabulary 32000: `llama_bench`'s) on 4 simulated
//! ranks, batch 1 of 128 tokens, two AdamW steps and the Hugging Face
//! output, stays within the sum of the ranks' FSDP peaks + 1 GiB
//! (issue 35's bound; no weights file here, the model is initialised from
//! flags). The same run with what the fixes of `docs/fsdp.md` removed put
//! back — a 1 GiB block cache per rank (`CHORUS_CPU_CACHE_BYTES`) and
//! glibc's mmap threshold at its dynamic maximum, which keeps freed blocks
//! in the rank threads' arenas — breaks it: the judge can fail. A cache
//! size that is not a number is refused before anything runs.

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::{chorus, run_bounded, scratch, text};
use serde_json::Value;

const GIB: u64 = 1 << 30;

/// One run into `out`; `(process peak, Σ ranks' FSDP peaks)` in bytes.
fn run(out: &Path, kept: bool) -> (u64, u64) {
    let mut cmd = chorus();
    cmd.args(["train", "--model", "llama", "--world-size", "4", "--batch", "1", "--seq-len", "128", "--steps", "2"])
        .args(["--d-model", "768", "--layers", "12", "--heads", "12", "--kv-heads", "4", "--d-ff", "2048"])
        .args(["--vocab", "32000", "--optimizer", "adamw", "--out-dir"])
        .arg(out)
        .env_remove("GLIBC_TUNABLES")
        .env_remove("CHORUS_CPU_CACHE_BYTES");
    if kept {
        cmd.env("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=33554432").env("CHORUS_CPU_CACHE_BYTES", "1073741824");
    }
    let r = run_bounded(&mut cmd, Duration::from_secs(600));
    assert!(r.status.success(), "{}", text(&r.stderr));
    let summary: Value = serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let process = summary["process_peak_resident_bytes"].as_u64().expect("Linux reports the process's peak");
    let fsdp = summary["peak_memory_bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap()).sum();
    (process, fsdp)
}

#[test]
fn a_125m_llama_on_4_sim_ranks_stays_within_fsdps_count_and_a_gib() {
    let dir = scratch("train-resident");
    let (process, fsdp) = run(&dir.join("run"), false);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "process peak {:.0} MiB, FSDP's count {:.0} MiB + 1 GiB = {:.0} MiB",
        mib(process),
        mib(fsdp),
        mib(fsdp + GIB)
    );
    assert!(process <= fsdp + GIB, "the process peaked at {process} B, above FSDP's {fsdp} B + 1 GiB");
    // Freed blocks kept in a cache and in the arenas: the same run goes over.
    let (kept, _) = run(&dir.join("kept"), true);
    eprintln!("with freed blocks kept: {:.0} MiB", mib(kept));
    assert!(kept > fsdp + GIB, "a run whose arenas keep freed blocks stayed within the bound ({kept} B)");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_cache_size_that_is_not_a_number_is_refused() {
    let dir = scratch("train-cache-bytes");
    let out = dir.join("out");
    let r = run_bounded(
        chorus()
            .args(["train", "--model", "llama", "--world-size", "2", "--steps", "1", "--out-dir"])
            .arg(&out)
            .env("CHORUS_CPU_CACHE_BYTES", "1GiB"),
        Duration::from_secs(120),
    );
    assert_eq!(r.status.code(), Some(2), "{}", text(&r.stderr));
    assert!(text(&r.stderr).contains("CHORUS_CPU_CACHE_BYTES=\"1GiB\": not a number of bytes"), "{}", text(&r.stderr));
    assert!(!out.exists(), "nothing written");
    // Issue 43: `--bench` exited 1 with it (or ran), the variable read only once the ranks started: it is
    // checked with the arguments, whatever the model or mode.
    for model in ["mlp", "gpt", "llama"] {
        let r = run_bounded(
            chorus()
                .args(["train", "--bench", "--model", model, "--steps", "1"])
                .current_dir(&dir)
                .env("CHORUS_CPU_CACHE_BYTES", "abc"),
            Duration::from_secs(120),
        );
        assert_eq!(r.status.code(), Some(2), "--bench --model {model}: {}", text(&r.stderr));
        assert!(text(&r.stderr).contains("CHORUS_CPU_CACHE_BYTES=\"abc\""), "{}", text(&r.stderr));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
