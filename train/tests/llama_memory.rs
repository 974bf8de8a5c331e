//! Loading a Hugging Face Llama under FSDP never holds the whole model on a
//! rank: with a counting allocator, each of 4 simulated ranks (loading one
//! at a time, so the process-wide count is that rank's) peaks within its
//! sharded masters plus two copies of one tensor's slice (the slice read
//! from the mapped file, and the device stream's staging of it), while
//! materialising the model first, as before deferred init, does not.
//!
//! And a whole run — loading, training steps, the final checkpoint and the
//! Hugging Face output — stays within `docs/fsdp.md`'s per-rank formula at
//! 1, 2 and 4 ranks, while gathering the whole model on every rank (what
//! a run's end did before it wrote tensor by tensor) does not at 4, and
//! keeping one f32 copy of the model anywhere in the process does not at
//! any: the formula's slack is under half a copy of the model.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use chorus_collectives::sim::{SimComm, SimConfig, SimWorld};
use chorus_collectives::Communicator;
use chorus_devices::cpu::CpuConfig;
use chorus_fsdp::{DataParallel, Fsdp, FsdpConfig, ParamInit};
use chorus_train::models::llama::config::LlamaConfig;
use chorus_train::models::llama::hf as llama_hf;
use chorus_train::models::llama::{self, materialize, ROOT_PREFIXES};

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, forwarded.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = CURRENT.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
            PEAK.fetch_max(now, Ordering::SeqCst);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, forwarded.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            let now = CURRENT.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
            PEAK.fetch_max(now, Ordering::SeqCst);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: a pointer this allocator returned, with its layout.
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::SeqCst);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        // SAFETY: a pointer this allocator returned, with its layout.
        let p = unsafe { System.realloc(ptr, layout, new) };
        if !p.is_null() {
            if new >= layout.size() {
                let now = CURRENT.fetch_add(new - layout.size(), Ordering::SeqCst) + new - layout.size();
                PEAK.fetch_max(now, Ordering::SeqCst);
            } else {
                CURRENT.fetch_sub(layout.size() - new, Ordering::SeqCst);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Bytes allocated at the peak of `f`, above what was allocated when it started.
/// Held by each test while it measures: the counters are the process's.
static MEASURING: Mutex<()> = Mutex::new(());

fn peak_of<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = CURRENT.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    let r = f();
    (r, PEAK.load(Ordering::SeqCst) - base)
}

fn config() -> LlamaConfig {
    LlamaConfig { head_dim: 32, ..LlamaConfig::new(2048, 128, 256, 2, 4, 2) }
}

fn make_dir(dir: &Path, cfg: &LlamaConfig) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let params: Vec<(String, Vec<f32>)> = cfg
        .param_shapes()
        .into_iter()
        .map(|(n, s)| {
            let k: usize = s.iter().product();
            (n, (0..k).map(|i| (i % 97) as f32 / 97.0).collect())
        })
        .collect();
    // Split in several files with the index, in bf16 as hub models are.
    llama_hf::write(dir, cfg, &params, llama_hf::SaveDtype::BF16, 600 << 10).unwrap();
}

/// This rank's sharded masters: ceil(rows / world) rows of every parameter, in f32.
fn sharded_bytes(cfg: &LlamaConfig, world: usize) -> (usize, usize) {
    let mut total = 0;
    let mut largest = 0;
    for (_, shape) in cfg.param_shapes() {
        let inner: usize = shape[1..].iter().product();
        let slice = shape[0].div_ceil(world) * inner * 4;
        total += slice;
        largest = largest.max(slice);
    }
    (total, largest)
}

#[test]
fn loading_peaks_within_the_shards_plus_one_slice() {
    let _measuring = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let cfg = config();
    let dir: PathBuf = std::env::temp_dir().join(format!("chorus-llama-memory-{}", std::process::id()));
    make_dir(&dir, &cfg);
    let world = 4;
    let full = cfg.num_params() * 4;
    let (shards, slice) = sharded_bytes(&cfg, world);
    // Bookkeeping: names, shapes, the mapped files' headers, the groups' records.
    let slack = 96 << 10;
    let bound = shards + 2 * slice + slack;
    assert!(bound < full / 2, "the test's model is too small to tell: bound {bound}, model {full}");
    let one_at_a_time = Arc::new(Mutex::new(()));
    let (d, lock) = (dir.clone(), one_at_a_time.clone());
    let all_loaded = Arc::new(std::sync::Barrier::new(world));
    let all_ready = Arc::new(std::sync::Barrier::new(world));
    let peaks = on_sim_ranks(world, move |comm| {
        let fsdp = Fsdp::new(DataParallel::fsdp(comm), FsdpConfig::default()).unwrap();
        // No rank measures while another is still setting up (its allocations would count).
        all_ready.wait();
        let _turn = lock.lock().unwrap();
        let (model, peak) = peak_of(|| {
            let hf = llama_hf::open(&d).unwrap();
            llama::shard(fsdp, Arc::new(hf.config), hf.params, false).unwrap()
        });
        drop(_turn);
        // No rank gathers (allocating the whole model) before every rank has loaded.
        all_loaded.wait();
        // Every rank must still be loaded and right: gather and check one value.
        let params = model.model.with_fsdp(|f| f.full_parameters()).unwrap().unwrap();
        assert_eq!(params.len(), cfg_len());
        peak
    });
    for (rank, peak) in peaks.iter().enumerate() {
        eprintln!("rank {rank}: peak {peak} B while loading; shards {shards} B + 2 × slice {slice} B (model {full} B)");
        assert!(*peak <= bound, "rank {rank} peaked at {peak} B, above {bound} B");
        assert!(*peak >= shards, "rank {rank}: {peak} B cannot hold its shards of {shards} B");
    }
    // Materialising the whole model first (what a rank did before deferred init) passes the bound.
    let (d, lock) = (dir.clone(), one_at_a_time);
    let eager = on_sim_ranks(1, move |comm| {
        let fsdp = Fsdp::new(DataParallel::fsdp(comm), FsdpConfig::default()).unwrap();
        let _turn = lock.lock().unwrap();
        peak_of(|| {
            let hf = llama_hf::open(&d).unwrap();
            let whole = materialize(&hf.params).unwrap();
            let by_name: HashMap<String, _> = whole.into_iter().collect();
            let inits: Vec<ParamInit> = hf
                .params
                .iter()
                .filter(|p| ROOT_PREFIXES.iter().any(|x| p.name.starts_with(x)))
                .map(|p| ParamInit {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                    values: by_name[&p.name].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                })
                .collect();
            let mut fsdp = fsdp;
            fsdp.add_group("root", inits, true).unwrap();
        })
        .1
    });
    assert!(eager[0] > bound, "materialising the model peaked at only {} B", eager[0]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Runs `body` on `ranks` simulated ranks without the device's race
/// sanitizer, whose per-buffer bookkeeping would count as the rank's memory.
fn on_sim_ranks<T: Send + 'static>(
    ranks: usize,
    body: impl Fn(Arc<Communicator<SimComm>>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    // SAFETY: loading uses one stream per rank; the ordering FSDP relies on
    // is checked with the sanitizer on by the conformance suite. No cache of
    // freed blocks: what a rank holds is then what it uses, whatever order
    // its streams return blocks in (the cache's reserve is bounded by the
    // peak in use on its own: `devices/src/cpu/pool.rs`).
    let device = unsafe { CpuConfig::default().without_sanitizer() }.with_cache_limit(0);
    let config = SimConfig { device, ..SimConfig::default() };
    SimWorld::run(ranks, config, move |comm| body(Arc::new(comm)))
        .expect("sim world")
        .into_iter()
        .map(|r| r.expect("rank finished"))
        .collect()
}

fn cfg_len() -> usize {
    config().param_shapes().len()
}

/// The whole run's model: many small groups (32 layers), so the model is
/// many times one group, one tensor and, at 2 and 4 ranks, one shard.
fn run_config() -> LlamaConfig {
    LlamaConfig::new(256, 128, 256, 32, 4, 2)
}

const RUN_SEQ: usize = 8;
const RUN_STEPS: u64 = 2;

/// `docs/fsdp.md`'s bound on one rank's memory over a whole run, in bytes,
/// from the model's shapes (sharded on dim 0 over `world`), with AdamW
/// (two moments), batch 1 of `RUN_SEQ` tokens, recompute on:
/// - `S`: the f32 master shards, one sharded gradient (the reduce-scatter's
///   output is the gradient after `zero_grad`, `fsdp/src/storage.rs`) and
///   the two moments: `4·(2 + 2)·Σ ceil(rows/W)·inner`;
/// - `U`: training's unsharded working set: FSDP's (the group computing:
///   its gradients, its parameters released once candle has its copies,
///   `Fsdp::release_params_in_backward`; the prefetched group's all-gather
///   output; its reduce-scatter input and the previous one in flight: `4·G`,
///   `G` the largest group padded) and the adapter's (its candle copies of
///   one group's parameters and their gradients, `4·G`, and three of the
///   largest parameter `T`): `4·(8·G + 3·T)`;
/// - `A`: the activations: with recompute, each stage keeps only its input
///   (`L + 2` of `b·t·h`), and one stage's intermediates live at a time:
///   `4·b·t·((L + 2)·h + 10h + 4f + 3·heads·t + 3v)`;
/// - `O`: the output or the save, whichever is larger: one parameter
///   gathered whole (padded), a piece of it and its encoding, two write
///   buffers; or one parameter's shard with its moments, each read and cut.
fn run_bound(cfg: &LlamaConfig, world: usize) -> (usize, usize) {
    let padded = |shape: &[usize]| shape[0].div_ceil(world) * shape[1..].iter().product::<usize>();
    let shapes = cfg.param_shapes();
    let sharded: usize = shapes.iter().map(|(_, s)| padded(s)).sum();
    let group = |prefix: &str| -> usize {
        shapes.iter().filter(|(n, _)| n.starts_with(prefix)).map(|(_, s)| world * padded(s)).sum()
    };
    let largest_group = (0..cfg.num_hidden_layers)
        .map(|i| group(&format!("model.layers.{i}.")))
        .chain([group("model.embed_tokens."), group("model.norm.") + group("lm_head.")])
        .max()
        .unwrap_or(0);
    let largest = shapes.iter().map(|(_, s)| world * padded(s)).max().unwrap_or(0);
    let largest_shard = shapes.iter().map(|(_, s)| padded(s)).max().unwrap_or(0);
    let (b, t, l) = (1, RUN_SEQ, cfg.num_hidden_layers);
    let (h, f, heads, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.vocab_size);
    let s = 4 * 4 * sharded;
    let u = 4 * (8 * largest_group + 3 * largest);
    let a = 4 * b * t * ((l + 2) * h + 10 * h + 4 * f + 3 * heads * t + 3 * v);
    let piece = chorus_train::model_out::PIECE;
    let buffers = 2 * chorus_fsdp_candle::safetensors_io::WRITE_BUFFER;
    let o = (4 * largest + 8 * piece + buffers).max(4 * 6 * largest_shard + buffers);
    (s + u + a + o, 4 * cfg.num_params())
}

/// How a whole run is perturbed to show that the test can tell.
#[derive(Clone, Copy, PartialEq)]
enum Perturb {
    /// As `chorus train` runs.
    None,
    /// Every rank gathers the whole model at the end (what a run's end did before).
    GatherOnEveryRank,
    /// The process keeps one f32 copy of the whole model through the run
    /// (what a loader or an adapter that kept the model once would cost).
    KeepOneCopy,
}

/// One whole run on `world` simulated ranks: loaded from the model
/// directory `init`, trained, checkpointed into `ck` and written as a
/// Hugging Face directory into `out`; the process's heap peak over it.
fn whole_run(world: usize, init: &Path, ck: &Path, out: &Path, perturb: Perturb) -> usize {
    use chorus_fsdp::OptimizerKind;
    use chorus_train::decoder::{train_sharded, Data, TokenRows, TrainSpec};
    use chorus_train::models::llama::LlamaModel;
    use chorus_train::npy::Tokens;
    let cfg = run_config();
    let rows = 8;
    let ids = (0..rows * (RUN_SEQ + 1)).map(|i| ((i * 31 + 7) % cfg.vocab_size) as u32).collect();
    let tokens = Tokens::from_ids(rows, RUN_SEQ + 1, ids).unwrap();
    let data = Arc::new(Data::Tokens(TokenRows::new(tokens, cfg.vocab_size, world).unwrap()));
    let (init, ck, out) = (init.to_path_buf(), ck.to_path_buf(), out.to_path_buf());
    let collect = perturb == Perturb::GatherOnEveryRank;
    let base = CURRENT.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    let copy = (perturb == Perturb::KeepOneCopy).then(|| vec![0f32; cfg.num_params()]);
    let losses = on_sim_ranks(world, move |comm| {
        let hf = llama_hf::open(&init).unwrap();
        let layout = llama_hf::HfLayout::new(&hf.config, llama_hf::SaveDtype::F32, 1 << 20);
        let config = Arc::new(hf.config);
        let output = llama_hf::HfOutput { dir: Some(out.clone()), config: config.clone(), layout };
        let spec = TrainSpec {
            checkpoint_dir: Some(ck.clone()),
            output: Some(Arc::new(output)),
            collect_params: collect,
            ..TrainSpec::new(
                LlamaModel { config, init: hf.params },
                data.clone(),
                1,
                RUN_STEPS,
                OptimizerKind::adamw(1e-3, 0.0),
            )
        };
        train_sharded(comm, &spec, &mut |_, _| {}).unwrap().losses
    });
    let peak = PEAK.load(Ordering::SeqCst) - base;
    drop(copy);
    assert!(losses.iter().all(|l| l.len() == RUN_STEPS as usize && l == &losses[0]));
    peak
}

#[test]
fn a_whole_run_with_its_outputs_stays_within_the_per_rank_formula() {
    let _measuring = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let cfg = run_config();
    let root = std::env::temp_dir().join(format!("chorus-run-memory-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let init = root.join("init");
    make_dir(&init, &cfg);
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let mut measured = Vec::new();
    for world in [1, 2, 4] {
        let (bound, model) = run_bound(&cfg, world);
        let run = |perturb: Perturb| {
            let tag = perturb as u8;
            let (ck, out) = (root.join(format!("ck-{world}-{tag}")), root.join(format!("out-{world}-{tag}")));
            let peak = whole_run(world, &init, &ck, &out, perturb);
            // The run wrote its model: every parameter, whole, readable.
            let hf = llama_hf::open(&out).unwrap();
            assert_eq!(hf.params.len(), cfg.param_shapes().len());
            assert!(ck.join("latest").is_file(), "the final checkpoint");
            peak
        };
        let peak = run(Perturb::None);
        // Gathering the model whole on every rank at the end (what a run did
        // before) breaks the formula at 4 ranks: the test can tell. (At 2 the
        // whole model, 2·S, fits in what a step's two sharded gradients and
        // working set free by then.)
        let gathered = (world == 4).then(|| run(Perturb::GatherOnEveryRank));
        // So does one copy of the model kept anywhere in the process, at
        // every world size: the formula's slack is less than one copy.
        let kept = run(Perturb::KeepOneCopy);
        eprintln!(
            "{world} rank(s): process peak {:.2} MiB = {:.2} MiB/rank; formula {:.2} MiB/rank (slack {:.2} MiB in all); model {:.2} MiB (f32); one copy of it kept: {:.2} MiB; gathering it whole on each rank: {:?} MiB",
            mib(peak),
            mib(peak / world),
            mib(bound),
            mib((world * bound).saturating_sub(peak)),
            mib(model),
            mib(kept),
            gathered.map(mib)
        );
        measured.push((world, peak, bound, model, kept, gathered));
    }
    for (world, peak, bound, model, kept, gathered) in measured {
        // Each rank stays within the formula at every moment, so the process within world times it.
        assert!(peak <= world * bound, "{world} ranks peaked at {peak} B, above {world} × {bound} B");
        // The model is large enough for the test to tell a whole copy of it
        // from the run's own variation (well under a MiB between runs here).
        assert!(
            world * bound < peak + model / 2,
            "{world} ranks: the formula's slack ({} B) would hide half a copy of the model ({model} B)",
            world * bound - peak
        );
        assert!(kept > world * bound, "{world} ranks: a whole copy of the model kept stayed within the bound");
        if let Some(gathered) = gathered {
            assert!(gathered > world * bound, "{world} ranks: gathering everything stayed within the bound");
        }
    }
    std::fs::remove_dir_all(&root).ok();
}
