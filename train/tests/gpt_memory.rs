//! Memory of the transformer under FSDP through the candle adapter with
//! reshard-after-forward true, at 4 simulated ranks, against bounds computed
//! here from the model's shapes (not from FSDP's layout types) and against
//! the unsharded model trained by plain candle.
//!
//! Two measurements:
//! - **device** bytes per rank, from the cpu device's exact counters: FSDP's
//!   sharded state, unsharded parameters and gradients, all-gather and
//!   reduce-scatter buffers;
//! - the **whole process's heap** (a counting global allocator): every
//!   rank's device bytes plus candle's activations and the adapter's copies
//!   of the group it computes, plus everything else the ranks allocate.
//!
//! The bounds: at most three block groups (the one computing, the one
//! prefetched, the one whose buffers are being released) and the root group
//! are unsharded at once. With recompute (the default) candle holds the
//! stage-boundary activations of the step and one stage's recomputation at a
//! time; without, it holds every stage's forward graph (its intermediates
//! and its group's parameters) from forward until that stage's backward.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{Device, Tensor};
use chorus_collectives::sim::{SimConfig, SimWorld};
use chorus_devices::cpu::CpuConfig;
use chorus_devices::Device as _;
use chorus_fsdp::{DataParallel, Fsdp, FsdpConfig, OptimizerKind, Reshard, ShardedOptimizer};
use chorus_fsdp_candle::Recompute;
use chorus_train::decoder::{loss, train_plain, Data, TrainSpec};
use chorus_train::models::gpt::{self, init_params, GptConfig, GptModel};
use chorus_train::text::{encode, generate, vocab_size, TextData};

/// Counts the heap bytes in use and their peak.
struct Counting;

static IN_USE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn note_alloc(bytes: usize) {
    let now = IN_USE.fetch_add(bytes, Ordering::SeqCst) + bytes;
    PEAK.fetch_max(now, Ordering::SeqCst);
}

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counters are only atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is the system allocator's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            note_alloc(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            note_alloc(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) };
        IN_USE.fetch_sub(layout.size(), Ordering::SeqCst);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            IN_USE.fetch_sub(layout.size(), Ordering::SeqCst);
            note_alloc(new_size);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn reset_peak() -> usize {
    let now = IN_USE.load(Ordering::SeqCst);
    PEAK.store(now, Ordering::SeqCst);
    now
}

const WORLD: usize = 4;
const BATCH: usize = 2;
const STEPS: u64 = 2;

fn config() -> GptConfig {
    GptConfig { vocab: vocab_size(), d_model: 64, layers: 12, heads: 4, d_ff: 256, seq_len: 16 }
}

fn spec() -> TrainSpec<GptModel> {
    let cfg = config();
    let data = Arc::new(Data::Text(TextData::new(encode(&generate(5000, 3)), cfg.seq_len, 9).unwrap()));
    let model = GptModel { config: cfg, init: init_params(&cfg, 5).unwrap() };
    TrainSpec::new(model, data, BATCH, STEPS + 1, OptimizerKind::adamw(1e-3, 0.01))
}

/// The model's sizes in elements, from its shapes (written out here, not
/// taken from the model's code).
struct Sizes {
    /// Elements of one block's parameters and of its padded shard.
    block: usize,
    block_shard: usize,
    /// The root group's (embedding, final norm, head).
    root: usize,
    root_shard: usize,
    /// Elements of the largest parameter.
    largest: usize,
    total: usize,
}

fn sizes(cfg: &GptConfig, world: usize) -> Sizes {
    let (v, d, f) = (cfg.vocab, cfg.d_model, cfg.d_ff);
    // Sharded on dim 0, rows padded to a multiple of the world.
    let shard = |rows: usize, inner: usize| rows.div_ceil(world) * inner;
    // attn_norm, q, k, v, o, mlp_norm, up [f, d], down [d, f]
    let block = d + 4 * d * d + d + f * d + d * f;
    let block_shard = 2 * shard(d, 1) + 4 * shard(d, d) + shard(f, d) + shard(d, f);
    // embed [v, d], norm [d], head [v, d]
    let root = 2 * v * d + d;
    let root_shard = 2 * shard(v, d) + shard(d, 1);
    Sizes { block, block_shard, root, root_shard, largest: (f * d).max(v * d), total: root + cfg.layers * block }
}

/// Bytes of FSDP's state between steps: the f32 master shard and AdamW's two
/// moments, per parameter.
fn device_idle(s: &Sizes, layers: usize) -> usize {
    4 * 3 * (s.root_shard + layers * s.block_shard)
}

/// Bytes FSDP may hold on the device during a step with reshard-after-forward
/// true and one group of forward prefetch (`A` is a group's all-gather
/// output or reduce-scatter input, padded over the world; `N` its unsharded
/// parameters):
/// - always: the idle state, and up to two sharded gradients per parameter
///   (the reduce-scatter's output and the gradient made from it);
/// - the root group (never resharded in forward): its parameters and
///   gradients, one all-gather output and one reduce-scatter input;
/// - forward of block `i`: `N_i`, its all-gather output `A_i` (kept until the
///   next copy-out) and the prefetched `A_{i+1}`; backward of block `i`:
///   `N_i`, its gradients, the backward prefetch `A_{i-1}`, its own
///   reduce-scatter input and the previous one still in flight — so at most
///   `2 N + 3 A` of blocks;
/// - the adapter's staged upload of one gradient.
fn device_bound(s: &Sizes, layers: usize, world: usize) -> usize {
    let sharded = s.root_shard + layers * s.block_shard;
    let (gathered_root, gathered_block) = (world * s.root_shard, world * s.block_shard);
    4 * (3 * sharded + 2 * sharded + 2 * s.root + 2 * gathered_root + 2 * s.block + 3 * gathered_block + s.largest)
        + 4096 // the loss's scalars
}

/// Bytes candle and the adapter hold on one rank during a step.
///
/// With recompute: the activations at stage boundaries (kept by candle's
/// graph until backward), the loss's, and one stage at a time: the adapter's
/// copies of its group's parameters (as variables, their gradients) and the
/// recomputed block's intermediates and their gradients.
///
/// Without: every stage keeps its graph from forward to its backward — its
/// input's copy, its intermediates and its output (also returned to candle)
/// — and every group's parameters as variables; in backward one block's
/// gradients at a time.
fn candle_bound(cfg: &GptConfig, s: &Sizes, batch: usize, recompute: bool) -> usize {
    let (d, f, v, h, t, l) = (cfg.d_model, cfg.d_ff, cfg.vocab, cfg.heads, cfg.seq_len, cfg.layers);
    let btd = batch * t * d;
    let boundaries = (l + 1) * btd + 6 * batch * t * v;
    let group = s.block.max(s.root);
    let copies = 4 * group + 3 * s.largest;
    let block_intermediates = 25 * btd + 5 * batch * t * f + 6 * batch * h * t * t;
    if recompute {
        4 * (boundaries + copies + 3 * block_intermediates)
    } else {
        4 * (3 * boundaries + s.total + copies + (l + 3) * block_intermediates)
    }
}

struct RankMemory {
    device_idle: usize,
    device_peak: usize,
}

/// Trains on one rank with the adapter's public API: a warm-up step (the
/// optimizer's state is made), then `STEPS` measured ones; the process heap
/// peak is reset by rank 0 between barriers, when every rank is idle.
fn rank(
    comm: chorus_collectives::Communicator<chorus_collectives::sim::SimComm>,
    reshard: Reshard,
    recompute: &Recompute,
    heap: &[AtomicUsize; 2],
) -> RankMemory {
    let spec = spec();
    let cfg = spec.model.config;
    let world = Arc::new(comm);
    let r = world.rank();
    let fsdp_config = FsdpConfig { reshard_after_forward: reshard, ..FsdpConfig::default() };
    let fsdp = Fsdp::new(DataParallel::fsdp(world.clone()), fsdp_config).unwrap();
    let gpt = gpt::shard(fsdp, cfg, spec.model.init.clone(), true).unwrap();
    gpt.model.apply_recompute(recompute).unwrap();
    drop(spec.model.init);
    let mut opt = ShardedOptimizer::new(spec.optimizer);
    let seq = cfg.seq_len;
    let step = |s: u64, opt: &mut ShardedOptimizer<_>| {
        let (x, y) = spec.data.rows(s, r * BATCH, BATCH);
        let x = Tensor::from_vec(x, (BATCH, seq), &Device::Cpu).unwrap();
        let y = Tensor::from_vec(y, (BATCH, seq), &Device::Cpu).unwrap();
        let l = loss(&gpt.forward(&x).unwrap(), &y).unwrap();
        gpt.model.backward(&l).unwrap();
        gpt.model.optimizer_step(opt).unwrap();
        gpt.model.with_fsdp(|f| f.synchronize()).unwrap().unwrap();
    };
    let barrier = || {
        gpt.model
            .with_fsdp(|f| {
                f.data_parallel().shard.barrier(f.compute_stream()).unwrap();
                f.synchronize().unwrap();
            })
            .unwrap()
    };
    step(0, &mut opt);
    barrier();
    if r == 0 {
        heap[0].store(reset_peak(), Ordering::SeqCst);
    }
    let device_idle = gpt
        .model
        .with_fsdp(|f| {
            f.device().reset_peak_memory();
            f.device().memory_stats().bytes_in_use
        })
        .unwrap();
    barrier();
    for s in 1..=STEPS {
        step(s, &mut opt);
    }
    barrier();
    if r == 0 {
        heap[1].store(PEAK.load(Ordering::SeqCst), Ordering::SeqCst);
    }
    let device_peak = gpt.model.with_fsdp(|f| f.device().memory_stats().peak_bytes).unwrap();
    barrier();
    RankMemory { device_idle, device_peak }
}

fn measure(reshard: Reshard, recompute: Recompute) -> (Vec<RankMemory>, usize, usize) {
    let heap = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
    let h = heap.clone();
    let config = SimConfig {
        // SAFETY: FSDP orders every cross-stream access with events (checked
        // with the sanitizer on in the conformance suite); the sanitizer's
        // own bookkeeping would count as heap here. The device's cache is
        // off: its free blocks (reported apart, `CpuDevice::cache_stats`)
        // would count as heap too, and are returned only when the world's
        // executor threads exit after the run, during the plain measurement.
        device: unsafe { CpuConfig::default().without_sanitizer() }.with_cache_limit(0),
        ..SimConfig::default()
    };
    let ranks = SimWorld::run(WORLD, config, move |comm| rank(comm, reshard, &recompute, &h))
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    (ranks, heap[0].load(Ordering::SeqCst), heap[1].load(Ordering::SeqCst))
}

#[test]
fn per_rank_memory_is_the_sharded_state_plus_what_prefetch_allows_plus_activations() {
    let cfg = config();
    let s = sizes(&cfg, WORLD);
    let idle = device_idle(&s, cfg.layers);
    let bound = device_bound(&s, cfg.layers, WORLD);
    let unsharded_state = 4 * 4 * s.total; // parameters, gradients and AdamW's moments in f32

    let (no_reshard, _, _) = measure(Reshard::No, Recompute::All);
    // The unsharded model trained by plain candle on the same global batch:
    // what one step adds to the heap.
    let mut plain_spec = spec();
    plain_spec.steps = 1;
    let plain_start = reset_peak();
    train_plain(&plain_spec, WORLD).unwrap();
    let plain_step = PEAK.load(Ordering::SeqCst) - plain_start;
    let kib = |b: usize| b as f64 / 1024.0;
    eprintln!("transformer: {} parameters ({:.0} KiB f32), {WORLD} ranks x batch {BATCH}", s.total, kib(4 * s.total));
    eprintln!("unsharded training state (16 B/parameter) {:.0} KiB", kib(unsharded_state));
    eprintln!("plain candle, one step on the global batch: heap growth {:.0} KiB", kib(plain_step));

    let mut growths = Vec::new();
    for recompute in [true, false] {
        let candle = candle_bound(&cfg, &s, BATCH, recompute);
        let choice = if recompute { Recompute::All } else { Recompute::Nothing };
        let (ranks, heap_idle, heap_peak) = measure(Reshard::Yes, choice);
        let peak = ranks.iter().map(|r| r.device_peak).max().unwrap();
        let heap_growth = heap_peak - heap_idle;
        let per_rank_heap = heap_peak / WORLD;
        eprintln!("recompute {recompute}: device per rank: idle {:.0} KiB (formula {:.0}), peak {:.0} KiB (bound {:.0}), reshard-after-forward false {:.0} KiB",
            kib(ranks[0].device_idle), kib(idle), kib(peak), kib(bound), kib(no_reshard[0].device_peak));
        eprintln!("recompute {recompute}: process heap ({WORLD} ranks): between steps {:.0} KiB, step peak {:.0} KiB, growth {:.0} KiB (bound {:.0}); per rank {:.0} KiB",
            kib(heap_idle), kib(heap_peak), kib(heap_growth), kib(WORLD * (bound - idle + candle)), kib(per_rank_heap));

        for r in &ranks {
            assert_eq!(r.device_idle, idle, "between steps a rank holds exactly its shards and their AdamW moments");
            assert!(
                r.device_peak <= bound,
                "recompute {recompute}: device peak {} over the bound {bound}",
                r.device_peak
            );
            // Not vacuous: a block's parameters and gradients and the root's are unsharded at some point.
            assert!(r.device_peak >= idle + 4 * 2 * (s.block + s.root));
        }
        assert!(
            peak < unsharded_state / 2,
            "a rank's FSDP memory {peak} is not well below the unsharded state {unsharded_state}"
        );
        // Everything the ranks allocate during a step: FSDP's buffers, candle's
        // activations and the adapter's copies.
        assert!(heap_growth <= WORLD * (bound - idle + candle), "recompute {recompute}: heap growth {heap_growth}");
        if recompute {
            // Without resharding every block's parameters are unsharded at the end of forward.
            for r in &no_reshard {
                assert!(r.device_peak >= idle + 4 * cfg.layers * s.block, "reshard false: {}", r.device_peak);
                assert!(r.device_peak > peak, "resharding after forward saves nothing: {} vs {peak}", r.device_peak);
            }
            assert!(
                per_rank_heap * 2 < plain_step,
                "a rank's whole heap {per_rank_heap} vs plain candle's step {plain_step}"
            );
        } else {
            // A quarter of plain's batch with the whole model's graph: below plain's step.
            assert!(
                per_rank_heap < plain_step,
                "a rank's whole heap {per_rank_heap} vs plain candle's step {plain_step}"
            );
        }
        growths.push(heap_growth);
    }
    // Keeping the graphs holds every block's intermediates and parameters
    // until backward; recomputing holds about one block's at a time.
    let kept = 4 * (cfg.layers - 2) * s.block;
    assert!(growths[1] >= growths[0] + WORLD * kept, "kept graphs {} vs recomputed {}", growths[1], growths[0]);
}
