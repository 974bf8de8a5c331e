//! Running a job on the ranks of any backend: threads of this process for
//! the simulated backends and the NCCL family without a launcher, one rank
//! per process under a launcher (this process's rank, its job joined
//! through `crate::process`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use chorus_collectives::sim::{SimConfig, SimWorld};
use chorus_collectives::{CommBackend, Communicator};
use chorus_devices::cpu::CpuConfig;
use chorus_devices::ComputeBackend;
use chorus_fsdp::Fsdp;
use chorus_train::decoder::{self, train_sharded, TrainReport};
use chorus_train::models::DecoderModel;
use chorus_train::train::{train, RankReport, TrainSpec};
use indicatif::{ProgressBar, ProgressStyle};

use super::throughput::Throughput;
use crate::backends::Backend;
use crate::size::{mapped_now, soft_limit};

/// What every rank runs: the MLP, the transformer or the Llama.
pub(crate) trait RankJob: Send + Sync + 'static {
    type Report: Send + 'static;
    /// Bytes of freed blocks a rank's cpu device keeps for reuse
    /// ([`CpuConfig::cache_limit`]).
    const CPU_CACHE_LIMIT: usize = chorus_devices::cpu::DEFAULT_CACHE_LIMIT;
    fn run<C: CommBackend + 'static>(
        &self,
        world: Arc<Communicator<C>>,
        on_step: &mut dyn FnMut(u64, f64),
    ) -> anyhow::Result<Self::Report>
    where
        C::B: ComputeBackend;
}

pub(super) struct MlpJob(pub(super) TrainSpec);

impl RankJob for MlpJob {
    type Report = RankReport;
    fn run<C: CommBackend + 'static>(
        &self,
        world: Arc<Communicator<C>>,
        on_step: &mut dyn FnMut(u64, f64),
    ) -> anyhow::Result<RankReport>
    where
        C::B: ComputeBackend,
    {
        Ok(train(world, &self.0, &mut |s, l| on_step(s as u64, l))?)
    }
}

/// A decoder model's run ([`train_sharded`]).
pub(super) struct DecoderJob<M>(pub(super) decoder::TrainSpec<M>);

impl<M: DecoderModel + 'static> RankJob for DecoderJob<M> {
    type Report = TrainReport;
    /// None: candle computes in the same process's memory, from the same
    /// allocator, so a block FSDP frees is best given back to it, where
    /// candle's tensors reuse it; a cache would hold it apart while
    /// candle's backward takes as much again (the 125M Llama's resident
    /// peak at 4 sim ranks, `docs/fsdp.md`).
    const CPU_CACHE_LIMIT: usize = 0;
    fn run<C: CommBackend + 'static>(
        &self,
        world: Arc<Communicator<C>>,
        on_step: &mut dyn FnMut(u64, f64),
    ) -> anyhow::Result<TrainReport>
    where
        C::B: ComputeBackend,
    {
        Ok(train_sharded(world, &self.0, on_step)?)
    }
}

/// Limits the threads candle's CPU kernels use to this rank's share of the
/// machine's cores, unless the user set `RAYON_NUM_THREADS`.
///
/// candle's CPU backend takes its thread count from `RAYON_NUM_THREADS`
/// (else the physical cores): its matmul splits each product into that many
/// tasks, and its element-wise kernels run on one process-wide pool of that
/// many threads, sized at its first use, behind one lock, whose workers
/// spin at a barrier. Ranks sharing the cores, each computing with every
/// core's worth of threads, oversubscribe them and queue on that lock
/// (measured: 4 sim ranks on 2 cores step about 2× slower than with one
/// thread each; `docs/benchmarks.md`). Ranks as threads of this process
/// share its cores; ranks as processes share the node's with
/// `LOCAL_WORLD_SIZE - 1` others. Called from the main thread before candle
/// computes anything or any other thread starts (the environment is not
/// written while another thread may read it).
pub(super) fn limit_candle_threads(backend: Backend, world: usize) {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", candle_threads(backend, world).to_string());
    }
}

/// Makes glibc's malloc return every freed block of 1 MiB or more to the
/// system at once when the ranks are threads of this process, unless the
/// user tuned the threshold (`GLIBC_TUNABLES`).
///
/// glibc raises its mmap threshold to the largest block freed (up to 32
/// MiB) and serves smaller blocks from per-thread arenas, which keep what is
/// freed. Ranks as threads each compute with candle on their own thread, so
/// each rank's arena kept its largest step's activations: 670 MiB of the
/// 125M Llama's peak at 4 sim ranks, with the step time unchanged by the
/// fixed threshold (`docs/fsdp.md`).
pub(super) fn return_freed_blocks(backend: Backend) {
    let tuned = std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("mmap_threshold"));
    if backend.runs_as_processes() || tuned {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt sets one parameter of the allocator, under its own lock.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

/// This rank's share of the machine's cores (at least one).
pub(super) fn candle_threads(backend: Backend, world: usize) -> usize {
    let local = if backend.runs_as_processes() {
        chorus_collectives::bootstrap::LaunchEnv::from_process_env().map_or(1, |env| env.local_world_size)
    } else {
        world
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / local.max(1)).max(1)
}

/// Threads each rank of a world run as threads of this process starts: its
/// own and its cpu device's five streams (compute, and FSDP's all-gather
/// copy-in, all-gather, reduce-scatter and all-reduce); 6 counted in runs
/// of every model (`/proc/PID/task`: 3 + 6 × world).
const THREADS_PER_RANK: u128 = 6;

/// Address space one such thread reserves: its stack (Rust's 2 MiB, or
/// `RUST_MIN_STACK`), the guard page below it, and the alternate signal
/// stack Rust's runtime maps for every thread, with its guard page.
fn thread_reserve() -> u128 {
    let stack = std::env::var("RUST_MIN_STACK").ok().and_then(|s| s.parse::<u128>().ok()).unwrap_or(2 << 20);
    stack + (80 << 10)
}

/// Address space each rank maps beyond its threads' stacks and the run's
/// data: its communicator's flight-recorder ring and its device's and
/// FSDP's bookkeeping. Measured 2026-11-29 (issue 43): a one-layer Llama
/// of hidden 32 peaked at 13.4 MiB of address space per rank from 100 to
/// 200 sim ranks (`VmPeak`), 0.9 MiB past its six threads' 12.5 MiB;
/// without it, 512 ranks passed the check under `ulimit -v 8000000` and ran
/// out of memory at rank 380. Counted with a margin.
const RANK_RESERVE: u128 = 2 << 20;

/// glibc's malloc arenas the threads may add, each reserving 64 MiB of
/// address space (at most 8 per core, the main one apart): counted, as
/// malloc takes them while it can (a run of 384 ranks peaked at 8.4 GiB
/// mapped, this estimate's figure, and failed within 7.6 GiB).
fn arenas_reserve(threads: u128) -> u128 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u128;
    threads.min(arena_max().unwrap_or(8 * cores)).saturating_sub(1) * (64 << 20)
}

/// The arenas glibc's malloc is told it may make: `MALLOC_ARENA_MAX`, or
/// `glibc.malloc.arena_max` in `GLIBC_TUNABLES` (which glibc reads first).
fn arena_max() -> Option<u128> {
    let tunable = std::env::var("GLIBC_TUNABLES").ok().and_then(|t| {
        t.split(':').find_map(|kv| kv.strip_prefix("glibc.malloc.arena_max=").and_then(|v| v.parse().ok()))
    });
    tunable.or_else(|| std::env::var("MALLOC_ARENA_MAX").ok().and_then(|v| v.trim().parse().ok())).filter(|n| *n > 0)
}

/// Refuses, before any rank starts, a world of `world` ranks as threads of
/// this process that its limits cannot hold: the address space (`ulimit
/// -v`: what is mapped now, `data(w)` bytes a run of `w` ranks allocates, and the ranks'
/// threads with their stacks and malloc arenas) and the threads a user may
/// run (`ulimit -u`, the kernel's `threads-max`). A thread that cannot get
/// its stack ends the process (Rust aborts when its signal stack cannot be
/// mapped), so this is found here, naming the limit and the largest world
/// that fits.
pub(super) fn check_thread_limits(world: usize, data: &dyn Fn(usize) -> u128) -> Result<(), String> {
    let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
    let threads = |w: u128| THREADS_PER_RANK * w;
    let world = world as u128;
    let now = mapped_now();
    // Each world's own data (not this one's scaled), so the count named below
    // is one that passes this check when it runs under the same limit.
    let needed = |w: u128| {
        let data = data(usize::try_from(w).unwrap_or(usize::MAX));
        let ranks = threads(w) * thread_reserve() + w * RANK_RESERVE;
        now.saturating_add(data).saturating_add(ranks + arenas_reserve(threads(w)))
    };
    if let Some(limit) = soft_limit(libc::RLIMIT_AS) {
        if needed(world) > limit {
            // The count named keeps one malloc arena (64 MiB) spare: whether a
            // thread of this process has made one by now varies from run to
            // run, and the world named must pass this check whichever.
            let fits = (0..world).rev().find(|w| needed(*w).saturating_add(64 << 20) <= limit).unwrap_or(0);
            return Err(format!(
                "--world-size {world}: its {} threads ({THREADS_PER_RANK} per rank) with their stacks and the \
                 run's data need about {:.1} GiB of address space, {:.2} GiB of it mapped now; this process may \
                 map {:.1} GiB (ulimit -v): at most {fits} ranks fit (raise the limit, or run fewer ranks)",
                threads(world),
                gib(needed(world)),
                gib(now),
                gib(limit)
            ));
        }
    }
    let kernel = std::fs::read_to_string("/proc/sys/kernel/threads-max").ok().and_then(|s| s.trim().parse().ok());
    for (limit, name) in [(soft_limit(libc::RLIMIT_NPROC), "ulimit -u"), (kernel, "kernel.threads-max")] {
        if let Some(limit) = limit.filter(|l| threads(world) + 3 > *l) {
            return Err(format!(
                "--world-size {world}: its {} threads ({THREADS_PER_RANK} per rank) are more than the {limit} a \
                 process may start here ({name}): at most {} ranks fit",
                threads(world),
                limit.saturating_sub(3) / THREADS_PER_RANK
            ));
        }
    }
    Ok(())
}

/// Whether this process writes the run's outputs: always when the ranks are
/// its threads; under a launcher (one rank per process), only rank 0.
pub(super) fn writes_outputs(backend: Backend) -> bool {
    !backend.runs_as_processes()
        || chorus_collectives::bootstrap::LaunchEnv::from_process_env().map_or(true, |env| env.rank == 0)
}

/// Runs `job` on `world` ranks of `backend` and returns every rank's report.
pub(super) fn run_on<J: RankJob>(
    backend: Backend,
    world: usize,
    job: J,
    bar: Option<ProgressBar>,
) -> anyhow::Result<Vec<J::Report>> {
    // Under a launcher, the GPU backends run one rank per process (as ucx always does).
    let process = if backend.runs_as_processes() { crate::process::RankProcess::detect()? } else { None };
    crate::with_backend!(
        backend,
        sim => run_sim(world, job, bar),
        ucx => train_ucx(process, world, &job, bar),
        vendor<L> => match process {
            Some(p) => train_vendor::<L, J>(p, world, &job, bar),
            None => run_vendor::<L, J>(world, job, bar),
        }
    )
}

/// Runs `job` on `world` ranks of `backend` ([`run_on`]) behind a
/// progress bar of its `steps` steps (with the `throughput` where given),
/// cleared when the ranks are done.
pub(super) fn run_with_progress<J: RankJob>(
    backend: Backend,
    world: usize,
    job: J,
    steps: u64,
    throughput: Option<&Throughput>,
) -> anyhow::Result<Vec<J::Report>> {
    let bar = ProgressBar::new(steps);
    bar.set_style(match throughput {
        Some(t) => t.style(),
        None => ProgressStyle::with_template("{spinner} step {pos}/{len} [{bar:30}] {msg} ({elapsed})")
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    });
    let reports = run_on(backend, world, job, Some(bar.clone()));
    bar.finish_and_clear();
    reports
}

/// Counts rank 0's step on the progress bar, with its loss.
pub(crate) fn progress(rank: usize, bar: &Option<ProgressBar>, loss: f64) {
    if let (0, Some(b)) = (rank, bar) {
        b.set_message(format!("loss {loss:.4}"));
        b.inc(1);
    }
}

/// One rank per device of the NCCL family, as threads of this process,
/// bootstrapped through an in-memory store.
pub(super) fn run_vendor<L, J: RankJob>(
    world: usize,
    job: J,
    bar: Option<ProgressBar>,
) -> anyhow::Result<Vec<J::Report>>
where
    L: chorus_collectives::nccl_family::VendorLib,
    L::B: chorus_conformance::vendor::HarnessDevice + chorus_devices::ComputeBackend,
    Fsdp<chorus_collectives::nccl_family::VendorComm<L>>: Send,
{
    use chorus_collectives::bootstrap::MemStore;
    use chorus_collectives::nccl_family::{VendorComm, VendorConfig};
    use chorus_conformance::vendor::HarnessDevice;
    let devices = L::B::count().map_err(anyhow::Error::msg)?;
    if world > devices {
        anyhow::bail!("{world} ranks need as many devices (one rank per device); {devices} visible");
    }
    let store = MemStore::new();
    let comms = Aborts::default();
    // Every rank's thread is started before any begins: the library's
    // initialisation waits for all ranks without a deadline, so a thread
    // that cannot start must stop the others before they enter it.
    let results = crate::gate::run_gated(world, |rank| -> anyhow::Result<J::Report> {
        let device = L::B::make(rank, Duration::from_secs(300))?;
        let comm = comms.keep(VendorComm::<L>::init(&store, rank, world, device, VendorConfig::default())?);
        let report = job.run(comm, &mut |_, loss| progress(rank, &bar, loss));
        if let Some(e) = report.as_ref().err().filter(|e| !aborted(e)) {
            // As in run_sim; the library's abort reaches only the communicator it is called on, so every rank's is.
            comms.abort(rank, &format!("rank {rank} failed: {e:#}"));
        }
        report.with_context(|| format!("rank {rank}"))
    });
    first_failure(results?, comms.first())
}

/// The communicators of a world's ranks as threads of this process, so the
/// first rank to fail can abort every one: a vendor library's abort fails
/// the calls of the communicator it is called on, not its peers'.
struct Aborts<C: CommBackend> {
    state: Mutex<Kept<C>>,
}

struct Kept<C: CommBackend> {
    comms: Vec<Arc<Communicator<C>>>,
    /// The rank whose failure aborted them, and why, once one did.
    aborted: Option<(usize, String)>,
}

impl<C: CommBackend> Default for Aborts<C> {
    fn default() -> Self {
        Aborts { state: Mutex::new(Kept { comms: Vec::new(), aborted: None }) }
    }
}

impl<C: CommBackend> Aborts<C> {
    /// Keeps `comm` for [`Aborts::abort`]; one kept after an abort is aborted at once.
    fn keep(&self, comm: Communicator<C>) -> Arc<Communicator<C>> {
        let comm = Arc::new(comm);
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match &state.aborted {
            Some((_, reason)) => comm.abort(reason),
            None => state.comms.push(comm.clone()),
        }
        comm
    }

    /// Aborts every communicator kept, for `rank`'s failure. The first rank
    /// and reason are kept (for later ones), claimed before any abort: the
    /// others' failures that follow (a library's `ncclRemoteError` is no
    /// `Aborted`) are not the run's error.
    fn abort(&self, rank: usize, reason: &str) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let reason = state.aborted.get_or_insert_with(|| (rank, reason.to_string())).1.clone();
        for c in &state.comms {
            c.abort(&reason);
        }
    }

    /// The rank whose failure aborted the world, if one did.
    fn first(&self) -> Option<usize> {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).aborted.as_ref().map(|(rank, _)| *rank)
    }
}

/// Whether a rank's failure follows from another's (`Aborted`): the other
/// rank aborts the world, and its error is the one reported. A rank failing
/// so aborts nothing: that could end the other's last call before it has its
/// own error (a failed write of the model, which every rank agrees on).
fn aborted(e: &anyhow::Error) -> bool {
    use chorus_collectives::CommError;
    use chorus_fsdp::FsdpError;
    let comm = |c: &CommError| matches!(c, CommError::Aborted { .. });
    let fsdp = |f: &FsdpError| matches!(f, FsdpError::Comm(c) if comm(c));
    // FSDP's and the adapter's errors carry the communicator's transparently,
    // so it is not a link of the chain of its own.
    e.chain().any(|c| {
        c.downcast_ref().is_some_and(comm)
            || c.downcast_ref().is_some_and(fsdp)
            || matches!(c.downcast_ref(), Some(chorus_fsdp_candle::Error::Fsdp(f)) if fsdp(f))
    })
}

/// Every rank's report, or the error of the rank that failed first: the one
/// whose failure aborted the world (`first`), else the lowest that failed on
/// its own, not with another's `Aborted` that followed from it.
fn first_failure<T>(results: Vec<anyhow::Result<T>>, first: Option<usize>) -> anyhow::Result<Vec<T>> {
    let first = first.filter(|r| results.get(*r).is_some_and(|x| x.is_err()));
    if let Some(i) = first.or_else(|| results.iter().position(|r| r.as_ref().is_err_and(|e| !aborted(e)))) {
        return results.into_iter().nth(i).into_iter().collect();
    }
    results.into_iter().collect()
}

/// Bytes of freed blocks each rank's cpu device keeps: `CHORUS_CPU_CACHE_BYTES`
/// (as PyTorch's `PYTORCH_CUDA_ALLOC_CONF` tunes its caching allocator),
/// else the job's [`RankJob::CPU_CACHE_LIMIT`].
fn cpu_cache_limit<J: RankJob>() -> anyhow::Result<usize> {
    Ok(cpu_cache_setting()?.unwrap_or(J::CPU_CACHE_LIMIT))
}

/// `CHORUS_CPU_CACHE_BYTES`, `None` where it is not set; a value that is
/// no number of bytes is a usage error.
fn cpu_cache_setting() -> anyhow::Result<Option<usize>> {
    match std::env::var("CHORUS_CPU_CACHE_BYTES") {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Ok(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
            crate::usage(format!("CHORUS_CPU_CACHE_BYTES={v:?}: not a number of bytes (0 keeps no freed block)"))
        }),
        Err(e) => Err(crate::usage(format!("CHORUS_CPU_CACHE_BYTES: {e}"))),
    }
}

/// Checks `CHORUS_CPU_CACHE_BYTES` with the arguments, before anything is
/// read or run: a bad value exits 2 whatever the model or mode.
pub(super) fn check_cpu_cache_setting() -> anyhow::Result<()> {
    cpu_cache_setting().map(|_| ())
}

/// Runs `job` on `world` simulated ranks and returns every rank's report.
pub(super) fn run_sim<J: RankJob>(world: usize, job: J, bar: Option<ProgressBar>) -> anyhow::Result<Vec<J::Report>> {
    let job = Arc::new(job);
    let config = SimConfig {
        timeout: Duration::from_secs(300),
        // SAFETY: FSDP orders every cross-stream access with events, and the
        // conformance suite checks each of those orderings with the sanitizer
        // on (conformance/src/fsdp); the model's own work is on one stream.
        // Training runs without the sanitizer's per-operation bookkeeping.
        device: unsafe { CpuConfig::default().without_sanitizer() }.with_cache_limit(cpu_cache_limit::<J>()?),
    };
    let bar = Arc::new(Mutex::new(bar));
    let results = SimWorld::run(world, config, move |comm| {
        let rank = comm.rank();
        let bar = bar.lock().map(|b| b.clone()).unwrap_or(None);
        let comm = Arc::new(comm);
        let report = job.run(comm.clone(), &mut |_, loss| progress(rank, &bar, loss));
        if let Some(e) = report.as_ref().err().filter(|e| !aborted(e)) {
            // The other ranks would wait for this one in their next collective until the timeout (a stream
            // thread that could not start, a file that could not be read): they fail now instead.
            comm.abort(&format!("rank {rank} failed: {e:#}"));
        }
        report
    })?;
    let results: Vec<anyhow::Result<J::Report>> = results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.map_err(anyhow::Error::from).and_then(|v| v.with_context(|| format!("rank {rank}"))))
        .collect();
    // The sim's abort reaches every rank as `Aborted`.
    first_failure(results, None)
}

/// Trains on this process's rank of the job with `comm`; rank 0 returns its
/// report (the one `chorus train` writes out), the other ranks none.
fn train_rank<C, J>(
    p: &crate::process::RankProcess,
    comm: chorus_collectives::Communicator<C>,
    job: &J,
    bar: Option<indicatif::ProgressBar>,
) -> anyhow::Result<Vec<J::Report>>
where
    C: chorus_collectives::CommBackend + 'static,
    C::B: chorus_devices::ComputeBackend,
    J: RankJob,
{
    let rank = p.env.rank;
    let report =
        job.run(Arc::new(comm), &mut |_, loss| progress(rank, &bar, loss)).with_context(|| format!("rank {rank}"))?;
    p.finish("train", Duration::from_secs(300))?;
    Ok(if rank == 0 { vec![report] } else { Vec::new() })
}

/// `chorus train --backend ucx`: this process's rank over UCX (`process`:
/// the job, when the caller has joined it already; the store is joined once).
#[cfg(feature = "ucx")]
fn train_ucx<J: RankJob>(
    process: Option<crate::process::RankProcess>,
    world: usize,
    job: &J,
    bar: Option<indicatif::ProgressBar>,
) -> anyhow::Result<Vec<J::Report>> {
    use chorus_collectives::ucx::UcxComm;
    use chorus_devices::cpu::{CpuConfig, CpuDevice};
    let p = match process {
        Some(p) => p,
        None => crate::process::RankProcess::require("ucx")?,
    };
    p.check_world_size(world)?;
    let timeout = crate::process::RankProcess::ucx_timeout(Duration::from_secs(300));
    let cache_limit = cpu_cache_limit::<J>()?;
    // SAFETY: as for the sim backend's training ([`run_sim`]): FSDP
    // orders every cross-stream access with events, which the conformance
    // suite checks with the sanitizer on.
    let config = unsafe {
        CpuConfig::default()
            .with_ordinal(p.env.rank)
            .with_timeout(timeout * 2 + Duration::from_secs(10))
            .with_cache_limit(cache_limit)
            .without_sanitizer()
    };
    let ucx = p.ucx_config("train/ucx", timeout);
    let comm = UcxComm::init(p.store(), p.env.rank, p.env.world_size, CpuDevice::new(config), ucx)?;
    train_rank(&p, comm, job, bar)
}

/// `chorus train --backend nccl|rccl` under a launcher: this process's rank,
/// its GPU picked by `LOCAL_RANK`, the unique id through the job's store.
fn train_vendor<L, J: RankJob>(
    p: crate::process::RankProcess,
    world: usize,
    job: &J,
    bar: Option<indicatif::ProgressBar>,
) -> anyhow::Result<Vec<J::Report>>
where
    L: chorus_collectives::nccl_family::VendorLib,
    L::B: chorus_conformance::vendor::HarnessDevice + chorus_devices::ComputeBackend,
    chorus_fsdp::Fsdp<chorus_collectives::nccl_family::VendorComm<L>>: Send,
{
    use chorus_collectives::nccl_family::{VendorComm, VendorConfig};
    use chorus_conformance::vendor::HarnessDevice;
    p.check_world_size(world)?;
    let device = L::B::make(p.env.local_rank, Duration::from_secs(300))?;
    let config = VendorConfig { store_key: format!("{}/unique_id", p.prefix("train/nccl")), ..VendorConfig::default() };
    let comm = VendorComm::<L>::init(&*p.store(), p.env.rank, p.env.world_size, device, config)?;
    train_rank(&p, comm, job, bar)
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use chorus_devices::{Device, Priority, Stream};

    use super::*;

    /// Rank 1 fails before its first collective; the others are in theirs.
    struct FailsOnRankOne;

    impl RankJob for FailsOnRankOne {
        type Report = ();
        fn run<C: CommBackend + 'static>(
            &self,
            world: Arc<Communicator<C>>,
            _on_step: &mut dyn FnMut(u64, f64),
        ) -> anyhow::Result<()>
        where
            C::B: ComputeBackend,
        {
            if world.rank() == 1 {
                anyhow::bail!("rank 1 could not start its streams");
            }
            let stream = world.device().create_stream(Priority::Normal)?;
            world.barrier(&stream)?;
            stream.synchronize()?;
            Ok(())
        }
    }

    /// Issue 43: a rank that fails (a thread it could not start) left the
    /// others waiting in their collective until the 300 s timeout, the run
    /// silent; they fail at once, and its error is the one reported.
    #[test]
    fn a_failing_rank_stops_the_others_at_once() {
        let started = Instant::now();
        let err = run_sim(4, FailsOnRankOne, None).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(60), "the ranks waited: {:?}", started.elapsed());
        assert!(format!("{err:#}").contains("rank 1 could not start its streams"), "{err:#}");
    }

    /// The same on the NCCL family's ranks as threads (the simulated
    /// library): the others waited in their barrier until the library's
    /// 300 s timeout, as its abort reaches only the communicator it is called on.
    #[test]
    fn a_failing_vendor_rank_stops_the_others_at_once() {
        let started = Instant::now();
        let err =
            run_vendor::<chorus_collectives::nccl_family::simlib::SimNccl228, _>(4, FailsOnRankOne, None).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(60), "the ranks waited: {:?}", started.elapsed());
        assert!(format!("{err:#}").contains("rank 1 could not start its streams"), "{err:#}");
    }
}
