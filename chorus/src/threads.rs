//! Ranks as threads of this process: each rank's communicator made on its
//! thread by the selected backend's maker, the first failure (an error, a
//! panic, a thread that cannot start, a deadline) aborting the world so the
//! others end at once, and each rank's results in rank order.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
#[cfg(any(feature = "ucx", feature = "nccl", feature = "rccl"))]
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[cfg(feature = "sim")]
use chorus_collectives::sim::{SimComm, SimConfig, SimWorld};
use chorus_collectives::{CommBackend, Communicator};
#[cfg(feature = "sim")]
use chorus_devices::cpu::CpuConfig;

use crate::backend::SelectedBackend;
use crate::rank::Rank;
use crate::{BoxError, Error, Result};

/// Makes a rank's communicator on its thread, and aborts the whole world.
pub(crate) struct Maker<C: CommBackend> {
    /// Rank `r`'s communicator (called on rank `r`'s thread: a GPU
    /// communicator's init waits for every rank).
    pub(crate) make: Box<dyn Fn(usize) -> Result<Arc<Communicator<C>>> + Send + Sync>,
    /// Aborts every rank's communicator made so far and any made later.
    pub(crate) abort: Box<dyn Fn(&str) + Send + Sync>,
}

/// How the ranks' threads run: the whole run's deadline, and the size of
/// each rank's own thread pool for candle (`None`: the cores shared out).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RankThreads {
    pub(crate) deadline: Option<Duration>,
    pub(crate) pool: Option<usize>,
}

/// What a rank's thread sends back.
enum Outcome<T> {
    Done(T),
    Failed(Error),
}

/// Runs `body` on `n` threads, rank `r`'s communicator made on its thread
/// by `maker`; see [`World::run`] for how failures end the world.
pub(crate) fn run_on_threads<C, T, E, F>(n: usize, maker: Maker<C>, how: RankThreads, body: F) -> Result<Vec<T>>
where
    C: CommBackend + 'static,
    T: Send + 'static,
    E: Into<BoxError> + Send + 'static,
    F: Fn(Rank<C>) -> std::result::Result<T, E> + Send + Sync + 'static,
{
    if n == 0 {
        return Err(Error::InvalidArgument("a world needs at least one rank".into()));
    }
    let maker = Arc::new(maker);
    let body = Arc::new(body);
    // The rank that failed first, claimed before it aborts the world: the
    // failures that abort causes on the other ranks may arrive before its own.
    let first = Arc::new(AtomicUsize::new(usize::MAX));
    let (tx, rx) = mpsc::channel::<(usize, Outcome<T>)>();
    for rank in 0..n {
        let (rank_maker, body, tx, first) = (maker.clone(), body.clone(), tx.clone(), first.clone());
        let spawned = std::thread::Builder::new().name(format!("chorus-rank{rank}")).spawn(move || {
            let maker = rank_maker;
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let comm = (maker.make)(rank)?;
                let r = Rank::new(comm)?;
                in_rank_pool(rank, n, how.pool, || body(r).map_err(|e| Error::Rank { rank, error: e.into() }))?
            }));
            let outcome = match outcome {
                Ok(Ok(v)) => Outcome::Done(v),
                Ok(Err(e)) => Outcome::Failed(e),
                Err(payload) => Outcome::Failed(Error::Panicked { rank, message: panic_message(&*payload) }),
            };
            if let Outcome::Failed(e) = &outcome {
                let _ = first.compare_exchange(usize::MAX, rank, Ordering::AcqRel, Ordering::Acquire);
                (maker.abort)(&format!("rank {rank} failed: {e}"));
            }
            let _ = tx.send((rank, outcome));
        });
        if let Err(e) = spawned {
            // The ranks already started would wait for this one: end them now.
            let reason = format!("rank {rank}'s thread could not be started: {e}");
            (maker.abort)(&reason);
            return Err(Error::Unsupported(format!("{reason} (a world of {n} ranks as threads of this process)")));
        }
    }
    drop(tx);
    collect(n, &rx, how.deadline, &*maker.abort, &first)
}

/// Runs `f` in a thread pool of this rank's own (`threads`, else this
/// process's cores shared out among its `n` ranks), where candle's CPU
/// matrix products split their work.
#[cfg(feature = "candle")]
fn in_rank_pool<R: Send>(rank: usize, n: usize, threads: Option<usize>, f: impl FnOnce() -> R + Send) -> Result<R> {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let threads = threads.unwrap_or(cores / n.max(1)).max(1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(move |i| format!("chorus-rank{rank}-pool{i}"))
        .build()
        .map_err(|e| Error::Unsupported(format!("rank {rank}'s thread pool of {threads} threads: {e}")))?;
    Ok(pool.install(f))
}

#[cfg(not(feature = "candle"))]
fn in_rank_pool<R>(_rank: usize, _n: usize, _threads: Option<usize>, f: impl FnOnce() -> R) -> Result<R> {
    Ok(f())
}

/// Waits for every rank's outcome (up to `deadline`) and returns the values
/// in rank order, or the failure of the rank that failed first (`first`):
/// the others usually failed because of it (the world was aborted).
fn collect<T>(
    n: usize,
    rx: &mpsc::Receiver<(usize, Outcome<T>)>,
    deadline: Option<Duration>,
    abort: &(dyn Fn(&str) + Send + Sync),
    first: &AtomicUsize,
) -> Result<Vec<T>> {
    let start = Instant::now();
    let mut values: Vec<Option<T>> = (0..n).map(|_| None).collect();
    let mut failures: Vec<Option<Error>> = (0..n).map(|_| None).collect();
    let mut arrived = vec![false; n];
    for _ in 0..n {
        let next = match deadline {
            None => rx.recv().map_err(|_| None),
            Some(d) => rx.recv_timeout(d.saturating_sub(start.elapsed())).map_err(|e| match e {
                mpsc::RecvTimeoutError::Timeout => Some(d),
                mpsc::RecvTimeoutError::Disconnected => None,
            }),
        };
        match next {
            Ok((rank, outcome)) => {
                arrived[rank] = true;
                match outcome {
                    Outcome::Done(v) => values[rank] = Some(v),
                    Outcome::Failed(e) => failures[rank] = Some(e),
                }
            }
            Err(Some(d)) => {
                let ranks: Vec<usize> = (0..n).filter(|r| !arrived[*r]).collect();
                abort(&format!("the world's deadline of {:.1} s passed", d.as_secs_f64()));
                return Err(first_of(failures, first).unwrap_or(Error::Deadline { ranks, seconds: d.as_secs_f64() }));
            }
            // A rank's thread ended without a word: only a panic inside the
            // panic handler does that; report what is known.
            Err(None) => break,
        }
    }
    if let Some(e) = first_of(failures, first) {
        return Err(e);
    }
    values
        .into_iter()
        .enumerate()
        .map(|(rank, v)| v.ok_or_else(|| Error::Panicked { rank, message: "its thread ended without a result".into() }))
        .collect()
}

/// The failure of the rank that claimed `first`, else the lowest rank's.
fn first_of(mut failures: Vec<Option<Error>>, first: &AtomicUsize) -> Option<Error> {
    let claimed = first.load(Ordering::Acquire);
    failures.get_mut(claimed).and_then(Option::take).or_else(|| failures.into_iter().flatten().next())
}

/// A panic's message, where it is text.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a text message".into()
    }
}

/// Communicators made as they are asked for, kept so that an abort reaches
/// every one made so far; one asked for after an abort fails at once.
/// (The sim world aborts itself, and every communicator split from it.)
#[cfg(any(feature = "ucx", feature = "nccl", feature = "rccl"))]
pub(crate) struct Registry<C: CommBackend> {
    state: Mutex<Registered<C>>,
}

#[cfg(any(feature = "ucx", feature = "nccl", feature = "rccl"))]
struct Registered<C: CommBackend> {
    comms: Vec<Arc<Communicator<C>>>,
    /// Why the world was aborted, once it was.
    aborted: Option<String>,
}

#[cfg(any(feature = "ucx", feature = "nccl", feature = "rccl"))]
impl<C: CommBackend> Registry<C> {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Registry { state: Mutex::new(Registered { comms: Vec::new(), aborted: None }) })
    }

    /// Keeps `comm` for [`Registry::abort`]; refuses it after an abort.
    pub(crate) fn keep(&self, comm: Communicator<C>) -> Result<Arc<Communicator<C>>> {
        let comm = Arc::new(comm);
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(reason) = &state.aborted {
            comm.abort(reason);
            return Err(Error::InvalidArgument(format!("the world was aborted before this rank joined: {reason}")));
        }
        state.comms.push(comm.clone());
        Ok(comm)
    }

    pub(crate) fn abort(&self, reason: &str) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.aborted.get_or_insert_with(|| reason.to_string());
        for c in &state.comms {
            c.abort(reason);
        }
    }
}

/// A simulated world of `n` ranks whose waits end after `timeout`.
#[cfg(feature = "sim")]
pub(crate) fn sim_world(n: usize, timeout: Duration) -> Result<SimWorld> {
    if n == 0 {
        return Err(Error::InvalidArgument("a world needs at least one rank".into()));
    }
    // The devices' own host waits outlast the collectives' deadline, so a
    // missing peer is reported as the collective's timeout.
    let device = CpuConfig::default().with_timeout(timeout * 2 + Duration::from_secs(10));
    Ok(SimWorld::new(n, SimConfig { timeout, device })?)
}

/// The ranks of a simulated world: its communicators, and its own abort.
#[cfg(feature = "sim")]
pub(crate) fn sim_maker(world: SimWorld) -> Maker<SimComm> {
    let aborts = world.clone();
    Maker {
        make: Box::new(move |rank| Ok(Arc::new(world.communicator(rank)?))),
        abort: Box::new(move |reason| aborts.abort(reason)),
    }
}

/// The sim backend: one simulated world, a cpu device per rank, the
/// stream sanitizer on (the strictest checks, as in tests).
#[cfg(all(feature = "sim", not(any(feature = "nccl", feature = "rccl", feature = "ucx"))))]
pub(crate) fn maker(n: usize, timeout: Duration) -> Result<Maker<SelectedBackend>> {
    Ok(sim_maker(sim_world(n, timeout)?))
}

/// The ucx backend: every rank in this process, over an in-memory store.
#[cfg(all(feature = "ucx", not(any(feature = "nccl", feature = "rccl"))))]
pub(crate) fn maker(n: usize, timeout: Duration) -> Result<Maker<SelectedBackend>> {
    use chorus_collectives::bootstrap::MemStore;
    use chorus_collectives::ucx::{UcxComm, UcxConfig};
    use chorus_devices::cpu::{CpuConfig, CpuDevice};
    let store = Arc::new(MemStore::new());
    let registry = Registry::<SelectedBackend>::new();
    let aborts = registry.clone();
    Ok(Maker {
        make: Box::new(move |rank| {
            let device = CpuDevice::new(CpuConfig::default().with_ordinal(rank).with_timeout(timeout * 2));
            let config = UcxConfig { timeout, prefix: "chorus/world/ucx".into(), ..UcxConfig::default() };
            registry.keep(UcxComm::init(store.clone(), rank, n, device, config)?)
        }),
        abort: Box::new(move |reason| aborts.abort(reason)),
    })
}

/// The NCCL family: one rank per visible GPU, the unique id through an
/// in-memory store.
#[cfg(any(feature = "nccl", feature = "rccl"))]
pub(crate) fn maker(n: usize, timeout: Duration) -> Result<Maker<SelectedBackend>> {
    use chorus_collectives::bootstrap::MemStore;
    use chorus_collectives::nccl_family::VendorConfig;
    let visible = gpu::count()?;
    if n > visible {
        return Err(Error::InvalidArgument(format!(
            "{n} ranks as threads need as many GPUs (one rank per GPU); {visible} visible"
        )));
    }
    let store = MemStore::new();
    let registry = Registry::<SelectedBackend>::new();
    let aborts = registry.clone();
    Ok(Maker {
        make: Box::new(move |rank| {
            let device = gpu::device(rank, timeout)?;
            let config =
                VendorConfig { timeout, store_key: "chorus/world/unique_id".into(), ..VendorConfig::default() };
            registry.keep(SelectedBackend::init(&store, rank, n, device, config)?)
        }),
        abort: Box::new(move |reason| aborts.abort(reason)),
    })
}

#[cfg(feature = "nccl")]
pub(crate) mod gpu {
    use super::*;
    use chorus_devices::cuda::{CudaConfig, CudaDevice};
    pub(crate) fn count() -> Result<usize> {
        Ok(chorus_devices::cuda::device_count()?)
    }
    pub(crate) fn device(ordinal: usize, timeout: Duration) -> Result<CudaDevice> {
        Ok(CudaDevice::with_config(CudaConfig { ordinal, timeout })?)
    }
}

#[cfg(all(feature = "rccl", not(feature = "nccl")))]
pub(crate) mod gpu {
    use super::*;
    use chorus_devices::hip::{HipConfig, HipDevice};
    pub(crate) fn count() -> Result<usize> {
        Ok(chorus_devices::hip::device_count()?)
    }
    pub(crate) fn device(ordinal: usize, timeout: Duration) -> Result<HipDevice> {
        Ok(HipDevice::new(HipConfig { ordinal, timeout, ..HipConfig::default() })?)
    }
}
