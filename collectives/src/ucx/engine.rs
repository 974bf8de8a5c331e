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
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use chorus_devices::cpu::RawRange;
use ucx_rs::sys;

use super::result::{status_error, status_ptr};
use crate::{CommError, Result};
use chorus_devices::MemCounters;

/// Memory a transfer reads or writes, kept alive until UCX is done with it.
#[derive(Clone)]
pub(crate) struct Region {
    ptr: *mut u8,
    len: usize,
    _keep: Keep,
}

// SAFETY: the pointer is into memory the keep-alive owns; who accesses it
// when is ordered by the completions (see the module doc).
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

#[derive(Clone)]
enum Keep {
    User(#[allow(dead_code)] RawRange),
    Scratch(#[allow(dead_code)] Arc<Scratch>),
    Bytes(#[allow(dead_code)] Arc<Vec<u8>>),
}

impl Region {
    /// `len` bytes from byte `offset` of a user buffer's range.
    pub(crate) fn user(range: &RawRange, offset: usize, len: usize) -> Result<Region> {
        if offset.checked_add(len).is_none_or(|end| end > range.bytes()) {
            return Err(CommError::invalid(
                "ucx",
                format!("{len} bytes at {offset} of a {}-byte range", range.bytes()),
            ));
        }
        // SAFETY: in bounds (checked above).
        let ptr = unsafe { range.ptr().add(offset) };
        Ok(Region { ptr, len, _keep: Keep::User(range.clone()) })
    }
    /// `len` bytes from byte `offset` of a scratch buffer.
    pub(crate) fn scratch(s: &Arc<Scratch>, offset: usize, len: usize) -> Result<Region> {
        if offset.checked_add(len).is_none_or(|end| end > s.bytes) {
            return Err(CommError::invalid("ucx", format!("{len} bytes at {offset} of {} scratch bytes", s.bytes)));
        }
        // SAFETY: in bounds (checked above).
        let ptr = unsafe { s.ptr().add(offset) };
        Ok(Region { ptr, len, _keep: Keep::Scratch(s.clone()) })
    }
    /// Owned bytes (a small message).
    pub(crate) fn bytes(bytes: Vec<u8>) -> Region {
        let keep = Arc::new(bytes);
        Region { ptr: keep.as_ptr() as *mut u8, len: keep.len(), _keep: Keep::Bytes(keep) }
    }
    pub(crate) fn len(&self) -> usize {
        self.len
    }
    /// `len` bytes from byte `offset` of this region, kept alive as it is.
    pub(crate) fn part(&self, offset: usize, len: usize) -> Result<Region> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(CommError::invalid("ucx", format!("{len} bytes at {offset} of a {}-byte region", self.len)));
        }
        // SAFETY: in bounds (checked above).
        let ptr = unsafe { self.ptr.add(offset) };
        Ok(Region { ptr, len, _keep: self._keep.clone() })
    }
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }
}

/// Host memory for partial results and staged messages, 8-byte aligned
/// (enough for every dtype).
pub(crate) struct Scratch {
    words: Box<[std::cell::UnsafeCell<u64>]>,
    bytes: usize,
    /// The communicator's count this buffer is in (see `pool.rs`).
    counters: Option<Arc<MemCounters>>,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(c) = &self.counters {
            c.sub(self.bytes);
        }
    }
}

// SAFETY: accesses are ordered by completions (one writer at a time).
unsafe impl Send for Scratch {}
unsafe impl Sync for Scratch {}

impl Scratch {
    pub(crate) fn new(bytes: usize) -> Arc<Scratch> {
        let words = (0..bytes.div_ceil(8).max(1)).map(|_| std::cell::UnsafeCell::new(0u64)).collect();
        Arc::new(Scratch { words, bytes, counters: None })
    }
    /// A buffer counted in `counters` until it is dropped.
    pub(crate) fn counted(bytes: usize, counters: Arc<MemCounters>) -> Arc<Scratch> {
        let words = (0..bytes.div_ceil(8).max(1)).map(|_| std::cell::UnsafeCell::new(0u64)).collect();
        counters.add(bytes);
        Arc::new(Scratch { words, bytes, counters: Some(counters) })
    }
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.words.as_ptr() as *mut u8
    }
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

/// How a request ended: the bytes transferred, or UCX's status.
pub(crate) type Outcome = std::result::Result<usize, sys::ucs_status_t>;

/// The completion of one request, waited on by the thread that issued it.
///
/// It is also what UCX's callback gets (an `Arc` reference as the request's
/// user data) and what keeps the request's memory alive until it ends: one
/// allocation per message.
pub(crate) struct Completion {
    state: Mutex<Option<Outcome>>,
    /// Set with the outcome: a waiter checks it without the lock.
    ended: AtomicBool,
    cv: Condvar,
    /// Threads waiting on `cv` (counted under `state`'s lock): an end that
    /// nobody waits for wakes nobody (no system call).
    waiters: AtomicUsize,
    /// The live UCX request (engine thread only): what a cancel cancels.
    request: AtomicPtr<c_void>,
    /// The memory the request reads or writes and the worker's count of
    /// requests in flight, from the request's start to its end.
    flight: Mutex<Option<(Region, Arc<AtomicUsize>)>>,
}

/// How many times a waiter looks (yielding the core in between) before it
/// sleeps on the condition variable: most small messages end within that.
const WAIT_SPINS: u32 = 32;

impl Completion {
    fn new() -> Arc<Completion> {
        Arc::new(Completion {
            state: Mutex::new(None),
            ended: AtomicBool::new(false),
            cv: Condvar::new(),
            waiters: AtomicUsize::new(0),
            request: AtomicPtr::new(std::ptr::null_mut()),
            flight: Mutex::new(None),
        })
    }

    fn complete(&self, outcome: Outcome) {
        if let Ok(mut s) = self.state.lock() {
            s.get_or_insert(outcome);
            self.ended.store(true, Ordering::Release);
        }
        // A waiter counts itself under the lock before it checks the state,
        // so one that saw no outcome is counted by now.
        if self.waiters.load(Ordering::Acquire) > 0 {
            self.cv.notify_all();
        }
    }

    /// Releases the request's memory and uncounts it (on its end); its length.
    fn end_flight(&self) -> usize {
        let flight = self.flight.lock().ok().and_then(|mut f| f.take());
        flight.map_or(0, |(region, count)| {
            count.fetch_sub(1, Ordering::Relaxed);
            region.len()
        })
    }

    /// The outcome, if the request has ended.
    pub(crate) fn outcome(&self) -> Option<Outcome> {
        if !self.ended.load(Ordering::Acquire) {
            return None;
        }
        self.state.lock().ok().and_then(|s| *s)
    }

    /// Waits at most `slice` for the request to end.
    pub(crate) fn wait_for(&self, slice: Duration) -> Option<Outcome> {
        for _ in 0..WAIT_SPINS {
            if self.ended.load(Ordering::Acquire) {
                return self.outcome();
            }
            std::thread::yield_now();
        }
        let Ok(guard) = self.state.lock() else { return Some(Err(sys::ucs_status_t_UCS_ERR_NO_MESSAGE)) };
        if let Some(o) = *guard {
            return Some(o);
        }
        self.waiters.fetch_add(1, Ordering::AcqRel);
        let r = match self.cv.wait_timeout_while(guard, slice, |s| s.is_none()) {
            Ok((g, _)) => *g,
            Err(_) => Some(Err(sys::ucs_status_t_UCS_ERR_NO_MESSAGE)),
        };
        self.waiters.fetch_sub(1, Ordering::AcqRel);
        r
    }
}

/// What the progress thread is asked to do.
enum Command {
    Connect { addresses: Vec<Option<Vec<u8>>>, peer_failure: bool, done: std::sync::mpsc::Sender<Result<()>> },
    Send { peer: usize, tag: u64, region: Region, done: Arc<Completion> },
    Recv { tag: u64, mask: u64, region: Region, done: Arc<Completion> },
    Cancel(Arc<Completion>),
    Stop,
}

/// Called on the progress thread when a peer's connection fails (its rank
/// and UCX's status) or a control message arrives (its bytes): must not block.
pub(crate) type EventHandler = Arc<dyn Fn(Event) + Send + Sync>;

/// An event the progress thread reports to the job.
pub(crate) enum Event {
    /// The endpoint to this rank failed.
    PeerFailed(usize, sys::ucs_status_t),
    /// A control message arrived.
    Control(Vec<u8>),
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

/// The UCP objects, used only on the progress thread (or, for the raw
/// round trip of `raw.rs`, on the one thread that made them).
pub(crate) struct Worker {
    context: sys::ucp_context_h,
    worker: sys::ucp_worker_h,
    efd: libc::c_int,
    endpoints: Vec<Option<sys::ucp_ep_h>>,
    /// The error-handler arguments of the endpoints, freed after they close.
    handler_args: Vec<*mut ErrArg>,
    /// Requests posted and not yet ended.
    in_flight: Arc<AtomicUsize>,
}

struct ErrArg {
    rank: usize,
    on_event: EventHandler,
}

impl Worker {
    pub(crate) fn new() -> Result<Worker> {
        // SAFETY: zeroed parameter structs are valid "no field set" values;
        // every handle is checked before use and released in Drop.
        unsafe {
            let mut params: sys::ucp_params_t = MaybeUninit::zeroed().assume_init();
            params.field_mask = sys::ucp_params_field_UCP_PARAM_FIELD_FEATURES as u64;
            params.features = (sys::ucp_feature_UCP_FEATURE_TAG | sys::ucp_feature_UCP_FEATURE_WAKEUP) as u64;
            let mut context: sys::ucp_context_h = std::ptr::null_mut();
            let st =
                sys::ucp_init_version(sys::UCP_API_MAJOR, sys::UCP_API_MINOR, &params, std::ptr::null(), &mut context);
            status_error(st, "ucp_init")?;
            let mut wparams: sys::ucp_worker_params_t = MaybeUninit::zeroed().assume_init();
            wparams.field_mask = sys::ucp_worker_params_field_UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64;
            wparams.thread_mode = sys::ucs_thread_mode_t_UCS_THREAD_MODE_SINGLE;
            let mut worker: sys::ucp_worker_h = std::ptr::null_mut();
            let st = sys::ucp_worker_create(context, &wparams, &mut worker);
            if let Err(e) = status_error(st, "ucp_worker_create") {
                sys::ucp_cleanup(context);
                return Err(e);
            }
            let mut efd: libc::c_int = -1;
            let st = sys::ucp_worker_get_efd(worker, &mut efd);
            if let Err(e) = status_error(st, "ucp_worker_get_efd") {
                sys::ucp_worker_destroy(worker);
                sys::ucp_cleanup(context);
                return Err(e);
            }
            Ok(Worker {
                context,
                worker,
                efd,
                endpoints: Vec::new(),
                handler_args: Vec::new(),
                in_flight: Arc::new(AtomicUsize::new(0)),
            })
        }
    }

    pub(crate) fn address(&self) -> Result<Vec<u8>> {
        let mut addr: *mut sys::ucp_address_t = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live worker; the address is copied, then released.
        unsafe {
            status_error(sys::ucp_worker_get_address(self.worker, &mut addr, &mut len), "ucp_worker_get_address")?;
            let bytes = std::slice::from_raw_parts(addr as *const u8, len).to_vec();
            sys::ucp_worker_release_address(self.worker, addr);
            Ok(bytes)
        }
    }

    pub(crate) fn connect(
        &mut self,
        addresses: &[Option<Vec<u8>>],
        peer_failure: bool,
        on_event: &EventHandler,
    ) -> Result<()> {
        self.endpoints.resize(addresses.len().max(self.endpoints.len()), None);
        for (rank, addr) in addresses.iter().enumerate() {
            let Some(addr) = addr else { continue };
            if self.endpoints[rank].is_some() {
                continue;
            }
            let arg = Box::into_raw(Box::new(ErrArg { rank, on_event: on_event.clone() }));
            self.handler_args.push(arg);
            // SAFETY: the address bytes came from a peer's ucp_worker_get_address
            // (through the store); the handler argument lives until the
            // endpoints are closed (Drop).
            unsafe {
                let mut p: sys::ucp_ep_params_t = MaybeUninit::zeroed().assume_init();
                p.field_mask = (sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                    | sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                    | sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64;
                p.address = addr.as_ptr() as *const sys::ucp_address_t;
                p.err_mode = if peer_failure {
                    sys::ucp_err_handling_mode_t_UCP_ERR_HANDLING_MODE_PEER
                } else {
                    sys::ucp_err_handling_mode_t_UCP_ERR_HANDLING_MODE_NONE
                };
                p.err_handler = sys::ucp_err_handler { cb: Some(on_ep_error), arg: arg as *mut c_void };
                let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
                status_error(sys::ucp_ep_create(self.worker, &p, &mut ep), &format!("ucp_ep_create (rank {rank})"))?;
                self.endpoints[rank] = Some(ep);
            }
        }
        Ok(())
    }

    /// Counts a request in flight and makes what its callback gets as user
    /// data: a reference to the completion, which keeps `region` alive until
    /// the request ends. The parameters name it; the caller sets the
    /// callback, makes the `*_nbx` call and hands its outcome and the
    /// reference to `settle`.
    fn start_request(&self, region: Region, done: Arc<Completion>) -> (*const Completion, sys::ucp_request_param_t) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut f) = done.flight.lock() {
            *f = Some((region, self.in_flight.clone()));
        }
        let flight = Arc::into_raw(done);
        // SAFETY: a zeroed parameter struct is a valid "no field set" value.
        let mut p: sys::ucp_request_param_t = unsafe { MaybeUninit::zeroed().assume_init() };
        p.op_attr_mask = sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_CALLBACK | sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_USER_DATA;
        p.user_data = flight as *mut c_void;
        (flight, p)
    }

    fn send(&mut self, peer: usize, tag: u64, region: Region, done: Arc<Completion>) {
        let Some(Some(ep)) = self.endpoints.get(peer).copied() else {
            done.complete(Err(sys::ucs_status_t_UCS_ERR_UNREACHABLE));
            return;
        };
        let (ptr, len) = (region.ptr as *const c_void, region.len);
        let (flight, mut p) = self.start_request(region, done);
        p.cb.send = Some(on_send);
        // SAFETY: the region stays alive in `flight` until the callback (or
        // the immediate outcome below) releases it.
        unsafe {
            let r = sys::ucp_tag_send_nbx(ep, ptr, len, tag, &p);
            settle(r, flight, len);
        }
    }

    fn recv(&mut self, tag: u64, mask: u64, region: Region, done: Arc<Completion>) {
        let (ptr, len) = (region.ptr as *mut c_void, region.len);
        let (flight, mut p) = self.start_request(region, done);
        p.cb.recv = Some(on_recv);
        // SAFETY: as in `send`.
        unsafe {
            // A receive that completes in place reports its length here.
            let mut info: sys::ucp_tag_recv_info_t = MaybeUninit::zeroed().assume_init();
            p.op_attr_mask |= sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_RECV_INFO;
            p.recv_info.tag_info = &mut info;
            let r = sys::ucp_tag_recv_nbx(self.worker, ptr, len, tag, mask, &p);
            settle(r, flight, info.length.min(len));
        }
    }

    fn cancel(&mut self, done: &Completion) {
        let req = done.request.load(Ordering::Acquire);
        if done.outcome().is_none() && !req.is_null() {
            // SAFETY: a live request (its callback, which clears the pointer,
            // has not run: both happen on this thread).
            unsafe { sys::ucp_request_cancel(self.worker, req) };
        }
    }

    /// Receives and drops the messages no receive ever matched (a failed
    /// job's leftovers), so the worker goes without complaint.
    fn drain_unexpected(&mut self, deadline: Instant) {
        for _ in 0..4096 {
            if Instant::now() >= deadline {
                return;
            }
            // SAFETY: zeroed info is a valid out-parameter; a message handle
            // removed from the queue is received exactly once below.
            unsafe {
                let mut info: sys::ucp_tag_recv_info_t = MaybeUninit::zeroed().assume_init();
                let msg = sys::ucp_tag_probe_nb(self.worker, 0, 0, 1, &mut info);
                if msg.is_null() {
                    return;
                }
                let scratch = Scratch::new(info.length);
                let done = Completion::new();
                let region = Region { ptr: scratch.ptr(), len: info.length, _keep: Keep::Scratch(scratch.clone()) };
                let (flight, mut p) = self.start_request(region, done.clone());
                p.cb.recv = Some(on_recv);
                let r = sys::ucp_tag_msg_recv_nbx(self.worker, scratch.ptr() as *mut c_void, info.length, msg, &p);
                settle(r, flight, info.length);
                while done.outcome().is_none() && Instant::now() < deadline {
                    if !self.progress() {
                        std::thread::sleep(Duration::from_micros(50));
                    }
                }
            }
        }
    }

    pub(crate) fn progress(&mut self) -> bool {
        // SAFETY: live worker, on its owner thread.
        unsafe { sys::ucp_worker_progress(self.worker) != 0 }
    }

    /// The UCP worker and the endpoint to world rank `peer` (for `raw.rs`).
    pub(crate) fn raw(&self, peer: usize) -> (sys::ucp_worker_h, Option<sys::ucp_ep_h>) {
        (self.worker, self.endpoints.get(peer).copied().flatten())
    }

    /// Arms the worker's event fd; false when there are events to progress first.
    fn arm(&mut self) -> bool {
        // SAFETY: live worker.
        unsafe { sys::ucp_worker_arm(self.worker) == sys::ucs_status_t_UCS_OK }
    }
}

/// Records the immediate outcome of a `*_nbx` call, or the request to wait for.
///
/// # Safety
/// `flight` is the reference made by `start_request` for the call.
unsafe fn settle(r: sys::ucs_status_ptr_t, flight: *const Completion, len: usize) {
    match status_ptr(r) {
        Ok(None) => {
            // SAFETY: completed in place: the callback will not run; the reference is ours.
            let c = unsafe { Arc::from_raw(flight) };
            c.end_flight();
            c.complete(Ok(len));
        }
        Ok(Some(req)) => {
            // SAFETY: the reference lives until the callback.
            let c = unsafe { &*flight };
            c.request.store(req, Ordering::Release);
        }
        Err(st) => {
            // SAFETY: failed in place: no callback; the reference is ours.
            let c = unsafe { Arc::from_raw(flight) };
            c.end_flight();
            c.complete(Err(st));
        }
    }
}

unsafe extern "C" fn on_send(request: *mut c_void, status: sys::ucs_status_t, user_data: *mut c_void) {
    // SAFETY: user_data is the completion reference of this request; the callback runs once.
    let c = unsafe { Arc::from_raw(user_data as *const Completion) };
    c.request.store(std::ptr::null_mut(), Ordering::Release);
    // The memory is let go before the waiter wakes, so it can reuse it.
    let len = c.end_flight();
    c.complete(if status == sys::ucs_status_t_UCS_OK { Ok(len) } else { Err(status) });
    // SAFETY: the request has completed and is released exactly once.
    unsafe { sys::ucp_request_free(request) };
}

unsafe extern "C" fn on_recv(
    request: *mut c_void,
    status: sys::ucs_status_t,
    info: *const sys::ucp_tag_recv_info_t,
    user_data: *mut c_void,
) {
    // SAFETY: as in `on_send`; `info` is valid during the callback when the status is OK.
    let c = unsafe { Arc::from_raw(user_data as *const Completion) };
    c.request.store(std::ptr::null_mut(), Ordering::Release);
    c.end_flight();
    let outcome = if status == sys::ucs_status_t_UCS_OK && !info.is_null() {
        Ok(unsafe { (*info).length })
    } else if status == sys::ucs_status_t_UCS_OK {
        Ok(0)
    } else {
        Err(status)
    };
    c.complete(outcome);
    // SAFETY: released exactly once.
    unsafe { sys::ucp_request_free(request) };
}

unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: arg is an ErrArg that lives until the endpoints are closed.
    let a = unsafe { &*(arg as *const ErrArg) };
    (a.on_event)(Event::PeerFailed(a.rank, status));
}

/// The control receive the engine keeps posted: its completion and buffer.
struct ControlRecv {
    done: Arc<Completion>,
    buffer: Arc<Scratch>,
}

fn post_control(w: &mut Worker, control: ControlTag) -> ControlRecv {
    let buffer = Scratch::new(CONTROL_BYTES);
    let done = Completion::new();
    let region = Region { ptr: buffer.ptr(), len: CONTROL_BYTES, _keep: Keep::Scratch(buffer.clone()) };
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

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: handles created in `new`, released once; endpoints were
        // closed in `shutdown` (or never made). Handler arguments go after
        // the worker, which is what could still call them.
        unsafe {
            for ep in self.endpoints.drain(..).flatten() {
                let mut p: sys::ucp_request_param_t = MaybeUninit::zeroed().assume_init();
                p.op_attr_mask = sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS;
                p.flags = sys::ucp_ep_close_flags_t_UCP_EP_CLOSE_FLAG_FORCE;
                let _ = sys::ucp_ep_close_nbx(ep, &p);
            }
            sys::ucp_worker_destroy(self.worker);
            sys::ucp_cleanup(self.context);
            for arg in self.handler_args.drain(..) {
                drop(Box::from_raw(arg));
            }
        }
    }
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
