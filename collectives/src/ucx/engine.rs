//! The safe layer over UCP: one progress thread per job owns the UCP
//! context, worker and endpoints; everything else talks to it through
//! commands and waits on [`Completion`]s.
//!
//! Why one owner thread: a worker in `UCS_THREAD_MODE_SINGLE` needs no locks
//! inside UCX (and no `--enable-mt` build), every UCX call and callback
//! happens on one thread, and a request can be cancelled without racing its
//! completion. The thread sleeps in `poll(2)` on the worker's event fd and
//! its own eventfd (woken by a command), after `ucp_worker_arm`, so an idle
//! job costs no CPU.
//!
//! Memory safety of in-flight transfers: every request carries a keep-alive
//! of the memory it reads or writes ([`Region`]), dropped only when UCX
//! reports the request complete (or cancelled), so nothing is ever written
//! into freed memory. A waiter that gives up (a deadline, an abort, a failed
//! peer) cancels its requests and waits, at most [`CANCEL_GRACE`], for UCX to
//! end them ([`Engine::cancel_and_wait`]) before its call returns: a matched
//! receive may be writing into the caller's buffer until then, and the
//! caller may reuse the buffer as soon as the call has failed. A request UCX
//! does not end within the grace (a rendezvous whose sender died without
//! peer-failure handling) is left to the job's teardown; its memory stays
//! alive until then.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ucx_rs::sys;

use super::region::{Region, Scratch};
use super::result::status_ptr;
use super::worker::{Completion, Event, EventHandler, Worker};
use crate::{CommError, Result};

/// What the progress thread is asked to do.
enum Command {
    Connect { addresses: Vec<Option<Vec<u8>>>, peer_failure: bool, done: std::sync::mpsc::Sender<Result<()>> },
    Send { peer: usize, tag: u64, region: Region, done: Arc<Completion> },
    Recv { tag: u64, mask: u64, region: Region, done: Arc<Completion> },
    Cancel(Arc<Completion>),
    Stop,
}

/// The tag and mask of control messages, which the engine receives itself.
#[derive(Clone, Copy)]
pub(crate) struct ControlTag {
    pub(crate) tag: u64,
    pub(crate) mask: u64,
}

/// How long a failed call waits, at most, for UCX to end its cancelled
/// requests (an unmatched receive ends at the next progress; a matched one
/// when its data or its endpoint's failure arrives).
pub(crate) const CANCEL_GRACE: Duration = Duration::from_secs(5);

/// How long the progress thread polls without progress before it sleeps,
/// while transfers are in flight, unless the job says otherwise
/// ([`UcxConfig::progress_spin`](super::UcxConfig)).
pub(crate) const DEFAULT_SPIN: Duration = Duration::from_micros(200);

/// Largest control message.
pub(crate) const CONTROL_BYTES: usize = 8192;

struct Shared {
    queue: Mutex<VecDeque<Command>>,
    /// The progress thread is (about to be) asleep in poll: a command must wake it.
    sleeping: AtomicBool,
    wake_fd: libc::c_int,
    stopped: AtomicBool,
    /// Tests: how long the progress thread sleeps before each cancel, so
    /// that a caller that does not wait for its cancels is caught.
    #[cfg(test)]
    cancel_delay: Mutex<Duration>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: our own eventfd, closed once, after the progress thread is gone
        // (it holds an Arc of this).
        unsafe { libc::close(self.wake_fd) };
    }
}

/// The handle on a job's progress thread; cloneable, the thread stops when
/// the last handle is dropped.
pub(crate) struct Engine {
    shared: Arc<Shared>,
    address: Vec<u8>,
    _stopper: Arc<Stopper>,
}

impl Clone for Engine {
    fn clone(&self) -> Self {
        Engine { shared: self.shared.clone(), address: self.address.clone(), _stopper: self._stopper.clone() }
    }
}

/// Stops the progress thread when the last engine handle goes, and waits
/// (bounded) until it has released the worker and the context: a process
/// that exits while the thread still tears UCX down runs UCX's global
/// destructors under it (seen as a SIGSEGV at exit of a rank).
struct Stopper {
    shared: Arc<Shared>,
    /// Disconnects when the progress thread ends (it holds the sender).
    finished: Mutex<std::sync::mpsc::Receiver<()>>,
    thread: std::thread::ThreadId,
}

/// How long a drop waits for the progress thread's shutdown (which flushes
/// the endpoints for at most a second).
const STOP_WAIT: Duration = Duration::from_secs(5);

impl Drop for Stopper {
    fn drop(&mut self) {
        push(&self.shared, Command::Stop);
        // The last handle can go on the progress thread itself (an event
        // handler's): it cannot wait for itself.
        if std::thread::current().id() == self.thread {
            return;
        }
        if let Ok(rx) = self.finished.lock() {
            let _ = rx.recv_timeout(STOP_WAIT);
        }
    }
}

fn push(shared: &Shared, cmd: Command) {
    if let Ok(mut q) = shared.queue.lock() {
        q.push_back(cmd);
    }
    if shared.sleeping.swap(false, Ordering::AcqRel) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our eventfd.
        unsafe { libc::write(shared.wake_fd, &one as *const u64 as *const c_void, 8) };
    }
}

impl Engine {
    /// Starts a progress thread with a new UCP context and worker.
    pub(crate) fn start(name: &str, control: ControlTag, on_event: EventHandler, spin: Duration) -> Result<Engine> {
        // SAFETY: plain eventfd creation.
        let wake_fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if wake_fd < 0 {
            return Err(CommError::Backend {
                library: "ucx",
                code: -1,
                message: format!("eventfd: {}", std::io::Error::last_os_error()),
            });
        }
        let shared = Arc::new(Shared {
            queue: Mutex::new(VecDeque::new()),
            sleeping: AtomicBool::new(false),
            wake_fd,
            stopped: AtomicBool::new(false),
            #[cfg(test)]
            cancel_delay: Mutex::new(Duration::ZERO),
        });
        let (tx, rx) = std::sync::mpsc::channel();
        let (finished_tx, finished_rx) = std::sync::mpsc::channel::<()>();
        let thread_shared = shared.clone();
        let handle = std::thread::Builder::new()
            .name(format!("ucx-progress {name}"))
            .spawn(move || {
                // Dropped when the thread ends, after the worker and context are released.
                let _finished = finished_tx;
                match Worker::new() {
                    Ok(worker) => {
                        let _ = tx.send(worker.address());
                        progress_loop(worker, thread_shared, control, on_event, spin);
                    }
                    Err(e) => {
                        thread_shared.stopped.store(true, Ordering::Release);
                        let _ = tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| CommError::Backend { library: "ucx", code: -1, message: format!("spawning: {e}") })?;
        let thread = handle.thread().id();
        let address = rx.recv_timeout(Duration::from_secs(60)).map_err(|_| CommError::Backend {
            library: "ucx",
            code: -1,
            message: "the progress thread did not start".into(),
        })??;
        let stopper = Arc::new(Stopper { shared: shared.clone(), finished: Mutex::new(finished_rx), thread });
        Ok(Engine { shared, address, _stopper: stopper })
    }

    /// This worker's address, for the peers' endpoints.
    pub(crate) fn address(&self) -> &[u8] {
        &self.address
    }

    /// Creates an endpoint to every peer whose address is given (index =
    /// world rank), with UCX's peer-failure handling when `peer_failure`.
    pub(crate) fn connect(&self, addresses: Vec<Option<Vec<u8>>>, peer_failure: bool, timeout: Duration) -> Result<()> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.command(Command::Connect { addresses, peer_failure, done: tx })?;
        rx.recv_timeout(timeout).map_err(|_| CommError::Timeout {
            op: "ucx endpoint creation".into(),
            seq: 0,
            waited: timeout,
            missing: vec![],
        })?
    }

    fn command(&self, cmd: Command) -> Result<()> {
        if self.shared.stopped.load(Ordering::Acquire) {
            return Err(CommError::Aborted { reason: "the UCX progress thread has stopped".into() });
        }
        push(&self.shared, cmd);
        Ok(())
    }

    /// Sends `region` to world rank `peer` with `tag`.
    pub(crate) fn send(&self, peer: usize, tag: u64, region: Region) -> Result<Arc<Completion>> {
        let done = Completion::new();
        self.command(Command::Send { peer, tag, region, done: done.clone() })?;
        Ok(done)
    }

    /// Receives a message matching `tag` under `mask` into `region`.
    pub(crate) fn recv(&self, tag: u64, mask: u64, region: Region) -> Result<Arc<Completion>> {
        let done = Completion::new();
        self.command(Command::Recv { tag, mask, region, done: done.clone() })?;
        Ok(done)
    }

    /// Cancels a request that has not ended (nothing if it has).
    pub(crate) fn cancel(&self, c: &Arc<Completion>) {
        if c.outcome().is_none() {
            let _ = self.command(Command::Cancel(c.clone()));
        }
    }

    /// Cancels `c` and waits, at most `grace`, until UCX has ended it (so
    /// it no longer touches its memory); whether it has.
    pub(crate) fn cancel_and_wait(&self, c: &Arc<Completion>, grace: Duration) -> bool {
        self.cancel(c);
        let deadline = Instant::now() + grace;
        loop {
            if c.outcome().is_some() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline || self.shared.stopped.load(Ordering::Acquire) {
                return c.outcome().is_some();
            }
            c.wait_for((deadline - now).min(Duration::from_millis(10)));
        }
    }

    /// Tests: delays every cancel by `delay` on the progress thread.
    #[cfg(test)]
    pub(crate) fn delay_cancels(&self, delay: Duration) {
        if let Ok(mut d) = self.shared.cancel_delay.lock() {
            *d = delay;
        }
    }
}

/// The control receive the engine keeps posted: its completion and buffer.
struct ControlRecv {
    done: Arc<Completion>,
    buffer: Arc<Scratch>,
}

fn post_control(w: &mut Worker, control: ControlTag) -> ControlRecv {
    let buffer = Scratch::new(CONTROL_BYTES);
    let done = Completion::new();
    let region = Region::whole(&buffer);
    w.recv(control.tag, control.mask, region, done.clone());
    ControlRecv { done, buffer }
}

fn progress_loop(mut w: Worker, shared: Arc<Shared>, control: ControlTag, on_event: EventHandler, spin: Duration) {
    let mut control_recv = post_control(&mut w, control);
    let mut last_progress = Instant::now();
    // Reused from round to round: taking the commands allocates nothing.
    let mut commands: Vec<Command> = Vec::new();
    loop {
        // UCX first, then the commands: a failure a peer reported before
        // these commands were queued is known (the job's abort set) before
        // their receives can match that peer's stale messages.
        let mut progressed = false;
        while w.progress() {
            progressed = true;
        }
        if let Some(outcome) = control_recv.done.outcome() {
            match outcome {
                Ok(len) => {
                    let len = len.min(CONTROL_BYTES);
                    // SAFETY: the receive has completed: nothing writes the buffer.
                    let bytes = unsafe { std::slice::from_raw_parts(control_recv.buffer.ptr(), len) }.to_vec();
                    on_event(Event::Control(bytes));
                }
                Err(st) if st == sys::ucs_status_t_UCS_ERR_CANCELED => {}
                Err(st) => on_event(Event::Control(
                    format!("a control message could not be received: {}", ucx_rs::status_string(st)).into_bytes(),
                )),
            }
            control_recv = post_control(&mut w, control);
            progressed = true;
        }
        if let Ok(mut q) = shared.queue.lock() {
            commands.extend(q.drain(..));
        }
        let mut stop = false;
        let busy = !commands.is_empty();
        for cmd in commands.drain(..) {
            match cmd {
                Command::Connect { addresses, peer_failure, done } => {
                    let _ = done.send(w.connect(&addresses, peer_failure, &on_event));
                }
                Command::Send { peer, tag, region, done } => w.send(peer, tag, region, done),
                Command::Recv { tag, mask, region, done } => w.recv(tag, mask, region, done),
                Command::Cancel(done) => {
                    #[cfg(test)]
                    std::thread::sleep(shared.cancel_delay.lock().map_or(Duration::ZERO, |d| *d));
                    w.cancel(&done)
                }
                Command::Stop => stop = true,
            }
        }
        if stop {
            break;
        }
        if busy || progressed {
            last_progress = Instant::now();
            continue;
        }
        // Poll, yielding the core, for a while after the last progress
        // before sleeping: a wake-up per fragment costs more than the
        // fragment, and the next call of a busy job comes within it (a
        // command to a sleeping thread costs an eventfd write and a
        // wake-up). An idle job sleeps after `spin`.
        if last_progress.elapsed() < spin {
            std::thread::yield_now();
            continue;
        }
        // Sleep until UCX or a command needs us (the timeout bounds a lost wake-up).
        shared.sleeping.store(true, Ordering::Release);
        let queued = shared.queue.lock().map(|q| !q.is_empty()).unwrap_or(false);
        if queued || !w.arm() {
            shared.sleeping.store(false, Ordering::Release);
            continue;
        }
        let mut fds = [
            libc::pollfd { fd: w.efd, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: shared.wake_fd, events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: two valid pollfds.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, 100) };
        shared.sleeping.store(false, Ordering::Release);
        if fds[1].revents != 0 {
            let mut v: u64 = 0;
            // SAFETY: draining our eventfd.
            unsafe { libc::read(shared.wake_fd, &mut v as *mut u64 as *mut c_void, 8) };
        }
    }
    shared.stopped.store(true, Ordering::Release);
    w.cancel(&control_recv.done);
    shutdown(w, &shared, &control_recv.done);
}

/// Cancels what is queued, closes the endpoints (flushing for up to a
/// second, then by force) and releases the worker and context.
fn shutdown(mut w: Worker, shared: &Shared, control: &Completion) {
    let leftover: Vec<Command> = shared.queue.lock().map(|mut q| q.drain(..).collect()).unwrap_or_default();
    for cmd in leftover {
        match cmd {
            Command::Send { done, .. } | Command::Recv { done, .. } => {
                done.complete(Err(sys::ucs_status_t_UCS_ERR_CANCELED))
            }
            Command::Connect { done, .. } => {
                let _ = done.send(Err(CommError::Aborted { reason: "the UCX progress thread stopped".into() }));
            }
            Command::Cancel(_) | Command::Stop => {}
        }
    }
    let deadline = Instant::now() + Duration::from_secs(1);
    // The cancelled control receive completes (and is released) on progress.
    while control.outcome().is_none() && Instant::now() < deadline {
        if !w.progress() {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    w.drain_unexpected(deadline);
    let mut closing = Vec::new();
    for ep in w.endpoints.drain(..).flatten() {
        // SAFETY: a live endpoint, closed once.
        let r = unsafe {
            let mut p: sys::ucp_request_param_t = MaybeUninit::zeroed().assume_init();
            p.op_attr_mask = 0;
            sys::ucp_ep_close_nbx(ep, &p)
        };
        if let Ok(Some(req)) = status_ptr(r) {
            closing.push((ep, req));
        }
    }
    while !closing.is_empty() && Instant::now() < deadline {
        w.progress();
        closing.retain(|(_, req)| {
            // SAFETY: requests returned by ucp_ep_close_nbx, each freed once when done.
            let busy = unsafe { sys::ucp_request_check_status(*req) } == sys::ucs_status_t_UCS_INPROGRESS;
            if !busy {
                unsafe { sys::ucp_request_free(*req) };
            }
            busy
        });
        if !closing.is_empty() {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    for (_, req) in closing {
        // Still flushing: the peer is gone or stuck. Leave the request to the
        // worker's destruction (UCX releases what is pending then).
        let _ = req;
    }
    for _ in 0..16 {
        if !w.progress() {
            break;
        }
    }
    // The peers' notices that they are leaving, come meanwhile (UCX warns
    // of each message left unreceived when the worker goes).
    w.drain_unexpected(Instant::now() + Duration::from_millis(100));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dropping the last handle returns only once the progress thread has
    /// released the worker and the context (it holds the last other `Arc`
    /// of the shared state until it ends): a process may exit right after.
    #[test]
    fn the_last_drop_waits_for_the_progress_thread() {
        let (tag, mask) = crate::ucx::wire::control_match();
        for _ in 0..3 {
            let engine = Engine::start("drop", ControlTag { tag, mask }, Arc::new(|_| {}), DEFAULT_SPIN).unwrap();
            let shared = engine.shared.clone();
            drop(engine);
            assert_eq!(Arc::strong_count(&shared), 1, "the progress thread still runs after the last drop");
        }
    }
}
