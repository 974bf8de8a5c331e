//! The Llama benchmark of `docs/benchmarks.md`: a Llama of about 125 M
//! parameters (hidden 768, 12 layers, 12 heads / 4 key-value heads,
//! intermediate 2048, vocab 32000) written as a Hugging Face directory
//! (bf16, split in 100 MiB files; nothing downloaded), loaded with each
//! rank reading only its shards, and trained a few steps at 4 simulated
//! ranks against plain single-process candle on the same global batch.
//! Each side runs in a process of its own (candle sizes its thread pool
//! once per process: one thread per rank for FSDP, every core for plain):
//!
//! ```text
//! cargo run -p chorus-train --example llama_bench -- write DIR
//! RAYON_NUM_THREADS=1 cargo run -p chorus-train --example llama_bench -- fsdp DIR
//! cargo run -p chorus-train --example llama_bench -- plain DIR
//! ```
//!
//! (the workspace's dev profile is optimized). Prints one JSON object per
//! side; the FSDP side's peak covers the steps and writing the trained
//! model back as a Hugging Face directory (one gathered tensor at a time).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus_collectives::sim::{SimConfig, SimWorld};
use chorus_devices::cpu::CpuConfig;
use chorus_devices::Device as _;
use chorus_fsdp::{DataParallel, Fsdp, FsdpConfig, OptimizerKind};
use chorus_train::decoder::{train_plain, train_sharded, Data, TokenRows, TrainSpec};
use chorus_train::models::llama::config::LlamaConfig;
use chorus_train::models::llama::hf::{self as llama_hf, SaveDtype};
use chorus_train::models::llama::{self, init_params, LlamaModel};
use chorus_train::npy::Tokens;

const WORLD: usize = 4;
const BATCH: usize = 1;
const SEQ: usize = 64;
const STEPS: u64 = 3;

fn config() -> LlamaConfig {
    LlamaConfig { head_dim: 64, ..LlamaConfig::new(32000, 768, 2048, 12, 12, 4) }
}

fn data(vocab: usize) -> Data {
    let rows = WORLD * BATCH * STEPS as usize;
    let cols = SEQ + 1;
    let ids = (0..rows * cols).map(|i| ((i as u64 * 2654435761) % vocab as u64) as u32).collect();
    Data::Tokens(TokenRows::new(Tokens::from_ids(rows, cols, ids).expect("ids"), vocab, WORLD * BATCH).expect("data"))
}

fn sim() -> SimConfig {
    // SAFETY: as `chorus train`: FSDP's cross-stream orderings are checked
    // with the sanitizer by the conformance suite.
    SimConfig { timeout: Duration::from_secs(600), device: unsafe { CpuConfig::default().without_sanitizer() } }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(mode), Some(dir)) = (args.get(1), args.get(2).map(PathBuf::from)) else {
        return Err("usage: llama_bench write|fsdp|plain DIR".into());
    };
    let cfg = config();
    match mode.as_str() {
        "write" => {
            std::fs::create_dir(&dir)?;
            let t0 = Instant::now();
            let params: Vec<(String, Vec<f32>)> = llama::materialize(&init_params(&cfg, 0))?
                .into_iter()
                .map(|(n, t)| Ok((n, t.flatten_all()?.to_vec1::<f32>()?)))
                .collect::<candle_core::Result<_>>()?;
            let files = llama_hf::write(&dir, &cfg, &params, SaveDtype::BF16, 100 << 20)?;
            println!(
                "{}",
                serde_json::json!({"wrote": files.len(), "parameters": cfg.num_params(), "seconds": t0.elapsed().as_secs_f64()})
            );
        }
        "fsdp" => {
            // Loading alone: open the directory and shard it, each rank reading its rows.
            let d = dir.clone();
            let loads = SimWorld::run(WORLD, sim(), move |comm| -> Result<(f64, usize), String> {
                let t0 = Instant::now();
                let hf = llama_hf::open(&d).map_err(|e| e.to_string())?;
                let fsdp =
                    Fsdp::new(DataParallel::fsdp(Arc::new(comm)), FsdpConfig::default()).map_err(|e| e.to_string())?;
                let m = llama::shard(fsdp, Arc::new(hf.config), hf.params, true).map_err(|e| e.to_string())?;
                let secs = t0.elapsed().as_secs_f64();
                let peak = m.model.with_fsdp(|f| f.device().memory_stats().peak_bytes).map_err(|e| e.to_string())?;
                Ok((secs, peak))
            })?;
            let loads: Vec<(f64, usize)> = loads
                .into_iter()
                .map(|r| r.map_err(|e| e.to_string()).and_then(|x| x))
                .collect::<Result<_, String>>()?;
            let hf = llama_hf::open(&dir)?;
            // The whole run: the steps, then the trained model written back as a
            // Hugging Face directory (gathered one tensor at a time) beside DIR.
            let out = dir.with_extension(format!("out-{}", std::process::id()));
            let config = Arc::new(hf.config);
            let output = llama_hf::HfOutput {
                dir: Some(out.clone()),
                config: config.clone(),
                layout: llama_hf::HfLayout::new(&config, SaveDtype::BF16, 100 << 20),
            };
            let spec = Arc::new(TrainSpec {
                output: Some(Arc::new(output)),
                ..TrainSpec::new(
                    LlamaModel { config, init: hf.params },
                    Arc::new(data(cfg.vocab_size)),
                    BATCH,
                    STEPS,
                    OptimizerKind::adamw(1e-4, 0.0),
                )
            });
            let reports = SimWorld::run(WORLD, sim(), move |comm| {
                train_sharded(Arc::new(comm), &spec, &mut |_, _| {}).map_err(|e| e.to_string())
            })?;
            let reports: Vec<_> = reports
                .into_iter()
                .map(|r| r.map_err(|e| e.to_string()).and_then(|x| x))
                .collect::<Result<_, String>>()?;
            let r = &reports[0];
            let written = llama_hf::open(&out).map(|m| m.params.len());
            let _ = std::fs::remove_dir_all(&out);
            println!(
                "{}",
                serde_json::json!({
                    "side": "fsdp", "ranks": WORLD, "parameters": cfg.num_params(),
                    "global_batch": WORLD * BATCH, "seq_len": SEQ,
                    "load_seconds": loads.iter().map(|l| l.0).collect::<Vec<_>>(),
                    "load_peak_device_bytes": loads.iter().map(|l| l.1).collect::<Vec<_>>(),
                    "losses": r.losses, "step_times_s": r.step_times_s,
                    "train_peak_device_bytes": reports.iter().map(|r| r.peak_memory_bytes).collect::<Vec<_>>(),
                    "hf_output_tensors": written?,
                    "fsdp_host_overhead_per_group_per_step_s":
                        r.overhead.total.as_secs_f64() / (r.groups as f64 * r.losses.len() as f64),
                })
            );
        }
        "plain" => {
            let t0 = Instant::now();
            let hf = llama_hf::open(&dir)?;
            let spec = TrainSpec::new(
                LlamaModel { config: Arc::new(hf.config), init: hf.params },
                Arc::new(data(cfg.vocab_size)),
                BATCH,
                STEPS,
                OptimizerKind::adamw(1e-4, 0.0),
            );
            let r = train_plain(&spec, WORLD)?;
            println!(
                "{}",
                serde_json::json!({
                    "side": "plain", "global_batch": WORLD * BATCH, "seq_len": SEQ,
                    "losses": r.losses, "step_times_s": r.step_times_s, "seconds": t0.elapsed().as_secs_f64(),
                })
            );
        }
        m => return Err(format!("unknown mode {m}: write, fsdp or plain").into()),
    }
    Ok(())
}
