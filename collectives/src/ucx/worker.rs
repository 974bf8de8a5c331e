//! The UCP objects (context, worker, endpoints) and their requests: each
//! request's [`Completion`], which UCX's callbacks fill in and the issuing
//! thread waits on, and which keeps the request's memory alive until it ends.

use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ucx_rs::sys;

use super::region::{Region, Scratch};
use super::result::{status_error, status_ptr};
use crate::Result;

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
    pub(super) fn new() -> Arc<Completion> {
        Arc::new(Completion {
            state: Mutex::new(None),
            ended: AtomicBool::new(false),
            cv: Condvar::new(),
            waiters: AtomicUsize::new(0),
            request: AtomicPtr::new(std::ptr::null_mut()),
            flight: Mutex::new(None),
        })
    }

    pub(super) fn complete(&self, outcome: Outcome) {
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

/// The UCP objects, used only on the progress thread (or, for the raw
/// round trip of `raw.rs`, on the one thread that made them).
pub(crate) struct Worker {
    context: sys::ucp_context_h,
    worker: sys::ucp_worker_h,
    pub(super) efd: libc::c_int,
    pub(super) endpoints: Vec<Option<sys::ucp_ep_h>>,
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

    pub(super) fn send(&mut self, peer: usize, tag: u64, region: Region, done: Arc<Completion>) {
        let Some(Some(ep)) = self.endpoints.get(peer).copied() else {
            done.complete(Err(sys::ucs_status_t_UCS_ERR_UNREACHABLE));
            return;
        };
        let (ptr, len) = (region.ptr() as *const c_void, region.len());
        let (flight, mut p) = self.start_request(region, done);
        p.cb.send = Some(on_send);
        // SAFETY: the region stays alive in `flight` until the callback (or
        // the immediate outcome below) releases it.
        unsafe {
            let r = sys::ucp_tag_send_nbx(ep, ptr, len, tag, &p);
            settle(r, flight, len);
        }
    }

    pub(super) fn recv(&mut self, tag: u64, mask: u64, region: Region, done: Arc<Completion>) {
        let (ptr, len) = (region.ptr() as *mut c_void, region.len());
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

    pub(super) fn cancel(&mut self, done: &Completion) {
        let req = done.request.load(Ordering::Acquire);
        if done.outcome().is_none() && !req.is_null() {
            // SAFETY: a live request (its callback, which clears the pointer,
            // has not run: both happen on this thread).
            unsafe { sys::ucp_request_cancel(self.worker, req) };
        }
    }

    /// Receives and drops the messages no receive ever matched (a failed
    /// job's leftovers), so the worker goes without complaint.
    pub(super) fn drain_unexpected(&mut self, deadline: Instant) {
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
                let region = Region::whole(&scratch);
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
    pub(super) fn arm(&mut self) -> bool {
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
