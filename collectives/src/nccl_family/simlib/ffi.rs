//! The simulated library's symbol table, and its C functions that make,
//! query, split and end communicators (the calls that move data are in
//! `calls.rs`).

use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::time::Duration;

use super::calls::{
    all_gather, all_reduce, all_to_all, broadcast, destroy_op, group_end, group_start, premul_sum, recv, reduce,
    reduce_scatter, send,
};
use super::state::{
    self, enter, handle_of, release, violation, AsyncState, SimComm, INTERNAL, INVALID_ARGUMENT, IN_PROGRESS, OK,
    REMOTE,
};
use crate::nccl_family::abi::{CommConfig, ResultCode, UniqueId, Version, UNIQUE_ID_BYTES};
use crate::nccl_family::sys::{ncclComm_t, ncclResult_t, Api, ApiFns};
use crate::CommError;

/// The symbol table of the library reporting version `code`.
pub(crate) fn table(code: i32) -> Api {
    let fns = match code {
        22803 => fns::<22803>(),
        _ => fns::<23007>(),
    };
    Api::from_fns(&format!("simulated NCCL {}", Version::decode(code)), fns)
}

fn fns<const V: i32>() -> ApiFns {
    ApiFns {
        ncclGetVersion: get_version::<V>,
        ncclGetUniqueId: get_unique_id,
        ncclCommInitRank: init_rank::<V>,
        ncclCommDestroy: destroy,
        ncclCommAbort: abort,
        ncclCommGetAsyncError: get_async_error,
        ncclCommCount: count,
        ncclCommUserRank: user_rank,
        ncclGetErrorString: error_string,
        ncclAllReduce: all_reduce,
        ncclBroadcast: broadcast,
        ncclReduce: reduce,
        ncclAllGather: all_gather,
        ncclReduceScatter: reduce_scatter,
        ncclSend: send,
        ncclRecv: recv,
        ncclGroupStart: group_start,
        ncclGroupEnd: group_end,
        ncclCommInitRankConfig: Some(init_rank_config::<V>),
        ncclCommSplit: Some(split),
        ncclCommFinalize: Some(finalize),
        ncclRedOpCreatePreMulSum: Some(premul_sum),
        ncclRedOpDestroy: Some(destroy_op),
        ncclAllToAll: None,
        ncclAlltoAll: Some(all_to_all),
        ncclGetLastError: Some(last_error),
    }
}

unsafe extern "C" fn get_version<const V: i32>(out: *mut c_int) -> ncclResult_t {
    if out.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: a non-null out-pointer from the caller.
    unsafe { *out = V };
    OK
}

unsafe extern "C" fn get_unique_id(out: *mut UniqueId) -> ncclResult_t {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    if out.is_null() {
        return INVALID_ARGUMENT;
    }
    let mut bytes = [0u8; UNIQUE_ID_BYTES];
    bytes[..8].copy_from_slice(&NEXT.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    bytes[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    bytes[12..16].copy_from_slice(b"SIM!");
    // SAFETY: a non-null out-pointer to a 128-byte id.
    unsafe { *out = UniqueId::from_bytes(bytes) };
    OK
}

unsafe fn init(
    out: *mut ncclComm_t,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
    blocking: bool,
    version: i32,
) -> ncclResult_t {
    if out.is_null() || nranks < 1 || rank < 0 || rank >= nranks {
        return INVALID_ARGUMENT;
    }
    let rendezvous = match state::join(*id.as_bytes(), nranks as usize) {
        Ok(r) => r,
        Err(what) => return violation(format!("ncclCommInitRank: {what}")),
    };
    let comm = SimComm::new(rank as usize, version, blocking, rendezvous.world.clone(), Some(rendezvous.clone()));
    // As NCCL: the handle is written before the call returns; the rest of the
    // initialization completes when every rank has joined.
    // SAFETY: a non-null out-pointer from the caller.
    unsafe { *out = comm.handle as ncclComm_t };
    if blocking {
        if !rendezvous.wait_all() {
            return REMOTE;
        }
        return OK;
    }
    if rendezvous.complete() {
        OK
    } else {
        IN_PROGRESS
    }
}

unsafe extern "C" fn init_rank<const V: i32>(
    out: *mut ncclComm_t,
    n: c_int,
    id: UniqueId,
    rank: c_int,
) -> ncclResult_t {
    // SAFETY: the caller's pointers, passed on.
    unsafe { init(out, n, id, rank, true, V) }
}

unsafe extern "C" fn init_rank_config<const V: i32>(
    out: *mut ncclComm_t,
    n: c_int,
    id: UniqueId,
    rank: c_int,
    config: *mut CommConfig,
) -> ncclResult_t {
    // SAFETY: a config from the caller, or null for the defaults (blocking).
    let blocking = unsafe { config.as_ref() }.is_none_or(|c| c.blocking != 0);
    // SAFETY: as above.
    unsafe { init(out, n, id, rank, blocking, V) }
}

unsafe extern "C" fn get_async_error(comm: ncclComm_t, out: *mut ncclResult_t) -> ncclResult_t {
    let e = match enter(handle_of(comm), "ncclCommGetAsyncError", true) {
        Ok(e) => e,
        Err(code) => return code,
    };
    if out.is_null() {
        return INVALID_ARGUMENT;
    }
    let code = match e.comm.state() {
        AsyncState::Ready => OK,
        AsyncState::InProgress => IN_PROGRESS,
        AsyncState::Failed(c) => c,
    };
    // SAFETY: a non-null out-pointer from the caller.
    unsafe { *out = code };
    OK
}

unsafe extern "C" fn count(comm: ncclComm_t, out: *mut c_int) -> ncclResult_t {
    match enter(handle_of(comm), "ncclCommCount", false) {
        Ok(e) if !out.is_null() => {
            // SAFETY: a non-null out-pointer from the caller.
            unsafe { *out = e.comm.size() as c_int };
            OK
        }
        Ok(_) => INVALID_ARGUMENT,
        Err(code) => code,
    }
}

unsafe extern "C" fn user_rank(comm: ncclComm_t, out: *mut c_int) -> ncclResult_t {
    match enter(handle_of(comm), "ncclCommUserRank", false) {
        Ok(e) if !out.is_null() => {
            // SAFETY: a non-null out-pointer from the caller.
            unsafe { *out = e.comm.rank as c_int };
            OK
        }
        Ok(_) => INVALID_ARGUMENT,
        Err(code) => code,
    }
}

/// NCCL's finalize waits and its destroy blocks (joins the library's
/// threads, frees device memory — which waits for the whole device): on the
/// watchdog's thread they would leave every other communicator unwatched.
fn refuse_on_watchdog(op: &str) -> Option<ncclResult_t> {
    crate::nccl_family::watchdog::on_watchdog_thread()
        .then(|| violation(format!("{op} on the watchdog thread, which must never block in a teardown")))
}

unsafe extern "C" fn finalize(comm: ncclComm_t) -> ncclResult_t {
    if let Some(code) = refuse_on_watchdog("ncclCommFinalize") {
        return code;
    }
    match enter(handle_of(comm), "ncclCommFinalize", false) {
        Ok(_) => OK,
        Err(code) => code,
    }
}

unsafe extern "C" fn destroy(comm: ncclComm_t) -> ncclResult_t {
    if let Some(code) = refuse_on_watchdog("ncclCommDestroy") {
        return code;
    }
    let entered = match enter(handle_of(comm), "ncclCommDestroy", false) {
        Ok(e) => e,
        Err(code) => return code,
    };
    // NCCL 2.28's destroy returns early from a communicator that is not
    // ready, inside the group it opened: every later split, finalize, destroy
    // or abort on the calling thread is queued and never runs.
    if let AsyncState::Failed(code) = entered.comm.state() {
        return violation(format!(
            "ncclCommDestroy on communicator {:#x}, which failed ({code}): finalize to completion first, or abort",
            entered.comm.handle
        ));
    }
    release(entered.comm.handle);
    entered.comm.join_jobs();
    // NCCL frees the communicator's device memory, and a free waits for all
    // of the device's work: destroy does not return while any stream of the
    // device has work left (here within the device's own deadline).
    let device = entered.comm.device.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(device) = device {
        device.wait_idle();
    }
    OK
}

unsafe extern "C" fn abort(comm: ncclComm_t) -> ncclResult_t {
    let entered = match enter(handle_of(comm), "ncclCommAbort", true) {
        Ok(e) => e,
        Err(code) => return code,
    };
    release(entered.comm.handle);
    // Queued work of this communicator returns with the error, and the peers'
    // see the connection go as NCCL's do: a remote error. The library's
    // threads end before abort does, as NCCL joins its group jobs.
    entered.comm.world.abort.abort(CommError::Backend {
        library: "simnccl",
        code: ResultCode::REMOTE_ERROR.0 as i64,
        message: format!("rank {} aborted its communicator (ncclRemoteError)", entered.comm.rank),
    });
    entered.comm.join_jobs();
    OK
}

unsafe extern "C" fn error_string(code: ncclResult_t) -> *const c_char {
    let s: &'static std::ffi::CStr = match code {
        0 => c"no error",
        5 => c"invalid usage",
        7 => c"operation in progress",
        _ => c"simulated NCCL error",
    };
    s.as_ptr()
}

unsafe extern "C" fn last_error(_comm: ncclComm_t) -> *const c_char {
    c"".as_ptr()
}

/// How long a simulated non-blocking split takes.
const SPLIT_LATENCY: Duration = Duration::from_millis(5);

unsafe extern "C" fn split(
    comm: ncclComm_t,
    color: c_int,
    key: c_int,
    out: *mut ncclComm_t,
    _config: *mut CommConfig,
) -> ncclResult_t {
    let entered = match enter(handle_of(comm), "ncclCommSplit", false) {
        Ok(e) => e,
        Err(code) => return code,
    };
    if out.is_null() {
        return INVALID_ARGUMENT;
    }
    let parent = entered.comm.clone();
    // As NCCL: the child is null until the split has completed.
    // SAFETY: a non-null out-pointer from the caller.
    unsafe { *out = std::ptr::null_mut() };
    let slot = out as usize;
    let seq = parent.next_split.fetch_add(1, Ordering::Relaxed);
    let color = (color >= 0).then_some(color as u32);
    let work = {
        let parent = parent.clone();
        move || -> ncclResult_t {
            match parent.world.split(seq, parent.rank, color, key as i64, true) {
                Ok(found) => {
                    let child = found.map(|(world, rank)| {
                        SimComm::new(rank, parent.version, parent.blocking, world, None).handle as *mut c_void
                    });
                    // SAFETY: the caller keeps the slot valid until the split
                    // completes (NCCL writes it from its own thread then).
                    unsafe {
                        (*(slot as *const AtomicPtr<c_void>))
                            .store(child.unwrap_or(std::ptr::null_mut()), Ordering::Release)
                    };
                    OK
                }
                Err(_) => REMOTE,
            }
        }
    };
    if parent.blocking {
        return work();
    }
    parent.set_state(AsyncState::InProgress);
    let worker = parent.clone();
    match std::thread::Builder::new().name("simnccl-split".into()).spawn(move || {
        // A split takes NCCL milliseconds (a bootstrap round); the delay
        // makes a caller that reads or frees the slot early fail every time.
        std::thread::sleep(SPLIT_LATENCY);
        let code = work();
        worker.set_state(if code == OK { AsyncState::Ready } else { AsyncState::Failed(code) });
    }) {
        Ok(j) => {
            parent.jobs.lock().unwrap_or_else(|p| p.into_inner()).push(j);
            // As NCCL (2.18 to 2.28 at least): `ncclCommSplit` returns the
            // child's setup result, ncclSuccess, while the split goes on; only
            // the parent's async error says when it is done.
            OK
        }
        Err(_) => {
            parent.set_state(AsyncState::Failed(INTERNAL));
            INTERNAL
        }
    }
}
