//! The watchdog: one background thread per process that follows every
//! NCCL-family communicator's launches.
//!
//! A collective on a GPU whose peer has died never completes, and the GPU
//! cannot say so. So each launch is recorded between two events on its
//! stream; the watchdog polls them and the communicator's asynchronous error
//! from an ordinary thread (never from a host function, where the driver may
//! not be called). A launch's deadline starts when its stream reaches it (the
//! first event completes), not when the host enqueued it, so a collective
//! queued behind long compute does not time out. An asynchronous error or an
//! expired deadline aborts the communicator — which makes its kernels return
//! — and fails the launch's stream from the launch on, so every host wait on
//! that stream ends with the error instead of hanging.
//!
//! The watchdog never blocks: one thread watches every communicator of the
//! process, so a poll that waited for one communicator's lock (held by a
//! blocking call, or by an abort stuck in the library) would leave all the
//! others unwatched. A poll only tries the locks that calls into the library
//! hold, and the abort it decides releases the handle on a thread of its own.

use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::Duration;

/// Something the watchdog follows: a communicator with launches in flight.
pub(crate) trait Watched: Send + Sync {
    /// Checks the launches and the communicator once; `true` while anything
    /// is still pending (the watchdog keeps polling it). Must never block:
    /// every other communicator waits for it. Work that may block (releasing
    /// an aborted handle) goes to another thread, which the `Arc` is for.
    fn poll(self: Arc<Self>) -> bool;
}

/// The watchdog thread's name: the simulated library refuses a blocking
/// teardown on it.
pub(crate) const THREAD_NAME: &str = "chorus-watchdog";

/// Whether the calling thread is the watchdog.
pub(crate) fn on_watchdog_thread() -> bool {
    std::thread::current().name() == Some(THREAD_NAME)
}

/// How often the watchdog polls while launches are pending. The trade-off:
/// a launch's deadline starts at the first poll that sees its stream reach
/// it, and its expiry is seen at the first poll after, so a timeout is
/// reported between the deadline and the deadline plus two intervals; the
/// events of finished launches go back to the pool only at a poll (so about
/// one interval's worth of launches holds two events each); and each poll
/// costs one event query per pending launch (two until its stream reaches
/// it) and one `ncclCommGetAsyncError` per communicator with launches
/// pending. Deadlines are seconds to minutes (300 s by default), so 100 ms
/// (PyTorch's NCCL watchdog sleeps as long between its checks) delays no
/// failure by anything a caller can tell, where the earlier 2 ms made fifty
/// times the driver calls for nothing.
const INTERVAL: Duration = Duration::from_millis(100);

struct Watchdog {
    entries: Mutex<Vec<Weak<dyn Watched>>>,
    wake: Condvar,
}

fn watchdog() -> &'static Watchdog {
    static DOG: OnceLock<Watchdog> = OnceLock::new();
    static STARTED: OnceLock<()> = OnceLock::new();
    let dog = DOG.get_or_init(|| Watchdog { entries: Mutex::new(Vec::new()), wake: Condvar::new() });
    STARTED.get_or_init(|| {
        // If the thread cannot start, watching degrades to the host waits'
        // own deadlines (every device wait has one); say so once.
        if let Err(e) = std::thread::Builder::new().name(THREAD_NAME.into()).spawn(move || run(dog)) {
            eprintln!(
                "chorus: the communicator watchdog could not start ({e}); collectives rely on the device deadlines"
            );
        }
    });
    dog
}

fn run(dog: &'static Watchdog) {
    loop {
        let entries: Vec<Weak<dyn Watched>> = match dog.entries.lock() {
            Ok(mut e) => {
                while e.is_empty() {
                    e = match dog.wake.wait_timeout(e, Duration::from_secs(1)) {
                        Ok((e, _)) => e,
                        Err(_) => return,
                    };
                }
                std::mem::take(&mut *e)
            }
            Err(_) => return,
        };
        let mut still = Vec::with_capacity(entries.len());
        for weak in entries {
            // The strong reference lives for the poll alone: a communicator
            // dropped meanwhile is torn down on another thread (see
            // `Shared`'s drop), never waited for here.
            if let Some(w) = weak.upgrade() {
                if w.poll() {
                    still.push(weak);
                }
            }
        }
        if let Ok(mut e) = dog.entries.lock() {
            e.extend(still);
        }
        std::thread::sleep(INTERVAL);
    }
}

/// Starts following `w` (again) until it reports nothing pending.
pub(crate) fn watch(w: &Arc<dyn Watched>) {
    let dog = watchdog();
    if let Ok(mut e) = dog.entries.lock() {
        let weak = Arc::downgrade(w);
        if !e.iter().any(|x| Weak::ptr_eq(x, &weak)) {
            e.push(weak);
        }
    }
    dog.wake.notify_one();
}
