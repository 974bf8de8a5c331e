//! Loading a Hugging Face Llama under FSDP never holds the whole model on a
//! rank: with a counting allocator, each of 4 simulated ranks (loading one
//! at a time, so the process-wide count is that rank's) peaks within its
//! sharded masters plus two copies of one tensor's slice (the slice read
//! from the mapped file, and the device stream's staging of it), while
//! materialising the model first, as before deferred init, does not.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use chorus_collectives::sim::{SimComm, SimConfig, SimWorld};
use chorus_collectives::Communicator;
use chorus_devices::cpu::CpuConfig;
use chorus_fsdp::{DataParallel, Fsdp, FsdpConfig, ParamInit};
use chorus_train::llama::{materialize, ShardedLlama, ROOT_PREFIXES};
use chorus_train::llama_config::LlamaConfig;
use chorus_train::llama_hf;

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
    let peaks = on_sim_ranks(world, move |comm| {
        let fsdp = Fsdp::new(DataParallel::fsdp(comm), FsdpConfig::default()).unwrap();
        let _turn = lock.lock().unwrap();
        let (model, peak) = peak_of(|| {
            let hf = llama_hf::open(&d).unwrap();
            ShardedLlama::new(fsdp, Arc::new(hf.config), hf.params, false).unwrap()
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
    // is checked with the sanitizer on by the conformance suite.
    let device = unsafe { CpuConfig::default().without_sanitizer() };
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
