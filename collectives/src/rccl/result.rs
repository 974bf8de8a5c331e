//! One function per RCCL call: the `ncclResult_t` becomes a typed error.
//!
//! Success is [`Status::Done`], `ncclInProgress` (a non-blocking
//! communicator still working) is [`Status::InProgress`], and anything else
//! is [`CommError::Backend`] with library `rccl`, the native code, and a
//! message naming the call, the result's name and — where the library has
//! `ncclGetLastError` and a communicator is at hand — RCCL's own last message.
//!
//! Functions that take a communicator or stream are `unsafe`: the handles
//! must be live, and the device of the communicator current.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr;

use super::sys::{self, hipStream_t, ncclComm_t, RcclLib};
use crate::nccl_abi::{CommConfig, ResultCode, ScalarResidence, Status, UniqueId};
use crate::{CommError, Result};

/// The library name in RCCL errors.
pub const LIBRARY: &str = "rccl";

/// The loaded library.
pub fn lib() -> Result<&'static RcclLib> {
    sys::rccl().map_err(CommError::Device)
}

fn check(lib: &RcclLib, code: c_int, call: &str, comm: ncclComm_t) -> Result<Status> {
    let code = ResultCode(code);
    code.check(LIBRARY, call).map_err(|e| match (e, lib.ncclGetLastError) {
        (CommError::Backend { library, code, message }, Some(last)) if !comm.is_null() => {
            // SAFETY: the communicator is live (caller's contract); RCCL returns a NUL-terminated string or null.
            let detail = unsafe { last(comm) };
            let detail = if detail.is_null() {
                String::new()
            } else {
                // SAFETY: checked non-null above.
                unsafe { CStr::from_ptr(detail) }.to_string_lossy().trim().to_string()
            };
            let message = if detail.is_empty() { message } else { format!("{message} ({detail})") };
            CommError::Backend { library, code, message }
        }
        (e, _) => e,
    })
}

/// `ncclGetVersion`: the raw integer (decode with [`crate::nccl_abi::Version::decode`]).
pub fn version() -> Result<i32> {
    let lib = lib()?;
    let mut v: c_int = 0;
    // SAFETY: out-pointer to a local.
    check(lib, unsafe { (lib.ncclGetVersion)(&mut v) }, "ncclGetVersion", ptr::null_mut())?;
    Ok(v)
}

/// `ncclGetUniqueId`.
pub fn unique_id() -> Result<UniqueId> {
    let lib = lib()?;
    let mut id = UniqueId::from_bytes([0; crate::nccl_abi::UNIQUE_ID_BYTES]);
    // SAFETY: out-pointer to a local of the C layout.
    check(lib, unsafe { (lib.ncclGetUniqueId)(&mut id) }, "ncclGetUniqueId", ptr::null_mut())?;
    Ok(id)
}

/// `ncclCommInitRankConfig` when the library has it and `config` is given,
/// else the blocking `ncclCommInitRank`. Returns the (possibly still
/// initializing) communicator and the status.
///
/// # Safety
/// The calling thread's current HIP device is the rank's device.
pub unsafe fn comm_init_rank(
    nranks: usize,
    id: UniqueId,
    rank: usize,
    config: Option<&mut CommConfig>,
) -> Result<(ncclComm_t, Status)> {
    let lib = lib()?;
    let (n, r) = (to_int("ncclCommInitRank", nranks)?, to_int("ncclCommInitRank", rank)?);
    let mut comm: ncclComm_t = ptr::null_mut();
    // SAFETY: out-pointer to a local; the id is passed by value as the C API takes it.
    let (code, call) = unsafe {
        match (lib.ncclCommInitRankConfig, config) {
            (Some(init), Some(cfg)) => (init(&mut comm, n, id, r, cfg), "ncclCommInitRankConfig"),
            _ => ((lib.ncclCommInitRank)(&mut comm, n, id, r), "ncclCommInitRank"),
        }
    };
    let status = check(lib, code, call, comm)?;
    Ok((comm, status))
}

/// `ncclCommSplit`; `Err(Unsupported)` when the library lacks it. `color`
/// `None` is `NCCL_SPLIT_NOCOLOR` (the new communicator is null).
///
/// # Safety
/// `comm` is live.
pub unsafe fn comm_split(
    comm: ncclComm_t,
    color: Option<u32>,
    key: i64,
    config: Option<&mut CommConfig>,
) -> Result<(ncclComm_t, Status)> {
    let lib = lib()?;
    let split = lib.ncclCommSplit.ok_or_else(|| CommError::Unsupported {
        backend: "rccl",
        what: "split: this RCCL lacks ncclCommSplit (it needs the NCCL 2.18 ABI, ROCm 6.0 or newer)".into(),
    })?;
    let color = match color {
        Some(c) => i32::try_from(c).map_err(|_| CommError::invalid("split", format!("color {c} exceeds i32")))?,
        None => sys::NCCL_SPLIT_NOCOLOR,
    };
    let key = i32::try_from(key).map_err(|_| CommError::invalid("split", format!("key {key} does not fit an i32")))?;
    let mut new: ncclComm_t = ptr::null_mut();
    let cfg = config.map_or(ptr::null_mut(), |c| c as *mut CommConfig);
    // SAFETY: per the caller's contract; out-pointer to a local.
    let status = check(lib, unsafe { split(comm, color, key, &mut new, cfg) }, "ncclCommSplit", comm)?;
    Ok((new, status))
}

/// `ncclCommFinalize` where the library has it (`Ok(None)` otherwise).
///
/// # Safety
/// `comm` is live.
pub unsafe fn comm_finalize(comm: ncclComm_t) -> Result<Option<Status>> {
    let lib = lib()?;
    match lib.ncclCommFinalize {
        // SAFETY: per the caller's contract.
        Some(f) => check(lib, unsafe { f(comm) }, "ncclCommFinalize", comm).map(Some),
        None => Ok(None),
    }
}

/// `ncclCommDestroy`.
///
/// # Safety
/// `comm` is live and not used afterwards.
pub unsafe fn comm_destroy(comm: ncclComm_t) -> Result<()> {
    let lib = lib()?;
    // SAFETY: per the caller's contract.
    check(lib, unsafe { (lib.ncclCommDestroy)(comm) }, "ncclCommDestroy", ptr::null_mut()).map(|_| ())
}

/// `ncclCommAbort`: stops the communicator's pending work and frees it.
///
/// # Safety
/// `comm` is live and not used afterwards (another thread blocked inside a
/// call on it is what abort exists to release).
pub unsafe fn comm_abort(comm: ncclComm_t) -> Result<()> {
    let lib = lib()?;
    // SAFETY: per the caller's contract.
    check(lib, unsafe { (lib.ncclCommAbort)(comm) }, "ncclCommAbort", ptr::null_mut()).map(|_| ())
}

/// `ncclCommGetAsyncError`: `Ok(Done)` when healthy and idle, `Ok(InProgress)`
/// while a non-blocking call is still working, the error otherwise.
///
/// # Safety
/// `comm` is live.
pub unsafe fn comm_async_error(comm: ncclComm_t) -> Result<Status> {
    let lib = lib()?;
    let mut state: c_int = 0;
    // SAFETY: per the caller's contract; out-pointer to a local.
    check(lib, unsafe { (lib.ncclCommGetAsyncError)(comm, &mut state) }, "ncclCommGetAsyncError", comm)?;
    check(lib, state, "the communicator (ncclCommGetAsyncError)", comm)
}

/// `ncclCommCount` and `ncclCommUserRank`: `(size, rank)`.
///
/// # Safety
/// `comm` is live and initialized.
pub unsafe fn comm_shape(comm: ncclComm_t) -> Result<(usize, usize)> {
    let lib = lib()?;
    let (mut n, mut r): (c_int, c_int) = (0, 0);
    // SAFETY: per the caller's contract; out-pointers to locals.
    unsafe {
        check(lib, (lib.ncclCommCount)(comm, &mut n), "ncclCommCount", comm)?;
        check(lib, (lib.ncclCommUserRank)(comm, &mut r), "ncclCommUserRank", comm)?;
    }
    Ok((n.max(0) as usize, r.max(0) as usize))
}

/// `ncclRedOpCreatePreMulSum` with a host-immediate scalar of the buffer's
/// type (`scalar` holds its bytes); `Err(Unsupported)` when the library lacks it.
///
/// # Safety
/// `comm` is live.
pub unsafe fn red_op_create_pre_mul_sum(scalar: &mut [u8; 8], datatype: c_int, comm: ncclComm_t) -> Result<c_int> {
    let lib = lib()?;
    let create = lib.ncclRedOpCreatePreMulSum.ok_or_else(|| CommError::Unsupported {
        backend: "rccl",
        what: "ReduceOp::PreMulSum: this RCCL lacks ncclRedOpCreatePreMulSum (NCCL 2.11 ABI)".into(),
    })?;
    let mut op: c_int = 0;
    // SAFETY: per the caller's contract; the scalar is read during the call (host-immediate).
    check(
        lib,
        unsafe { create(&mut op, scalar.as_mut_ptr().cast(), datatype, ScalarResidence::HostImmediate as c_int, comm) },
        "ncclRedOpCreatePreMulSum",
        comm,
    )?;
    Ok(op)
}

/// `ncclRedOpDestroy` (a no-op `Ok` where the library lacks it: then no op was created).
///
/// # Safety
/// `comm` is live; `op` came from [`red_op_create_pre_mul_sum`] on it and
/// every call using it has been enqueued.
pub unsafe fn red_op_destroy(op: c_int, comm: ncclComm_t) -> Result<()> {
    let lib = lib()?;
    match lib.ncclRedOpDestroy {
        // SAFETY: per the caller's contract.
        Some(f) => check(lib, unsafe { f(op, comm) }, "ncclRedOpDestroy", comm).map(|_| ()),
        None => Ok(()),
    }
}

/// `ncclGroupStart`.
pub fn group_start() -> Result<()> {
    let lib = lib()?;
    // SAFETY: no arguments.
    check(lib, unsafe { (lib.ncclGroupStart)() }, "ncclGroupStart", ptr::null_mut()).map(|_| ())
}

/// `ncclGroupEnd`: launches the group (may be `InProgress` on a non-blocking communicator).
///
/// # Safety
/// `comm` is the communicator the group's calls used (for the error message), or null.
pub unsafe fn group_end(comm: ncclComm_t) -> Result<Status> {
    let lib = lib()?;
    // SAFETY: no arguments.
    check(lib, unsafe { (lib.ncclGroupEnd)() }, "ncclGroupEnd", comm)
}

/// The buffers and stream of one call: device addresses of this rank's device.
#[derive(Clone, Copy, Debug)]
pub struct Args {
    /// The communicator.
    pub comm: ncclComm_t,
    /// The stream.
    pub stream: hipStream_t,
    /// `ncclDataType_t`.
    pub datatype: c_int,
}

fn to_int(call: &'static str, v: usize) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| CommError::invalid(call, format!("{v} does not fit a C int")))
}

fn cptr(p: u64) -> *const c_void {
    p as usize as *const c_void
}

fn mptr(p: u64) -> *mut c_void {
    p as usize as *mut c_void
}

/// `ncclAllReduce`.
///
/// # Safety
/// Handles live; the ranges hold `count` elements and stay valid until the call has run in stream order.
pub unsafe fn all_reduce(a: Args, send: u64, recv: u64, count: usize, op: c_int) -> Result<Status> {
    let lib = lib()?;
    // SAFETY: per the caller's contract.
    let code = unsafe { (lib.ncclAllReduce)(cptr(send), mptr(recv), count, a.datatype, op, a.comm, a.stream) };
    check(lib, code, "ncclAllReduce", a.comm)
}

/// `ncclBroadcast`.
///
/// # Safety
/// As [`all_reduce`].
pub unsafe fn broadcast(a: Args, send: u64, recv: u64, count: usize, root: usize) -> Result<Status> {
    let lib = lib()?;
    let root = to_int("ncclBroadcast", root)?;
    // SAFETY: per the caller's contract.
    let code = unsafe { (lib.ncclBroadcast)(cptr(send), mptr(recv), count, a.datatype, root, a.comm, a.stream) };
    check(lib, code, "ncclBroadcast", a.comm)
}

/// `ncclReduce`.
///
/// # Safety
/// As [`all_reduce`].
pub unsafe fn reduce(a: Args, send: u64, recv: u64, count: usize, op: c_int, root: usize) -> Result<Status> {
    let lib = lib()?;
    let root = to_int("ncclReduce", root)?;
    // SAFETY: per the caller's contract.
    let code = unsafe { (lib.ncclReduce)(cptr(send), mptr(recv), count, a.datatype, op, root, a.comm, a.stream) };
    check(lib, code, "ncclReduce", a.comm)
}

/// `ncclAllGather` (`send_count` elements per rank).
///
/// # Safety
/// As [`all_reduce`].
pub unsafe fn all_gather(a: Args, send: u64, recv: u64, send_count: usize) -> Result<Status> {
    let lib = lib()?;
    // SAFETY: per the caller's contract.
    let code = unsafe { (lib.ncclAllGather)(cptr(send), mptr(recv), send_count, a.datatype, a.comm, a.stream) };
    check(lib, code, "ncclAllGather", a.comm)
}

/// `ncclReduceScatter` (`recv_count` elements per rank).
///
/// # Safety
/// As [`all_reduce`].
pub unsafe fn reduce_scatter(a: Args, send: u64, recv: u64, recv_count: usize, op: c_int) -> Result<Status> {
    let lib = lib()?;
    // SAFETY: per the caller's contract.
    let code = unsafe { (lib.ncclReduceScatter)(cptr(send), mptr(recv), recv_count, a.datatype, op, a.comm, a.stream) };
    check(lib, code, "ncclReduceScatter", a.comm)
}

/// `ncclSend`.
///
/// # Safety
/// As [`all_reduce`].
pub unsafe fn send(a: Args, buf: u64, count: usize, peer: usize) -> Result<Status> {
    let lib = lib()?;
    let peer = to_int("ncclSend", peer)?;
    // SAFETY: per the caller's contract.
    let code = unsafe { (lib.ncclSend)(cptr(buf), count, a.datatype, peer, a.comm, a.stream) };
    check(lib, code, "ncclSend", a.comm)
}

/// `ncclRecv`.
///
/// # Safety
/// As [`all_reduce`].
pub unsafe fn recv(a: Args, buf: u64, count: usize, peer: usize) -> Result<Status> {
    let lib = lib()?;
    let peer = to_int("ncclRecv", peer)?;
    // SAFETY: per the caller's contract.
    let code = unsafe { (lib.ncclRecv)(mptr(buf), count, a.datatype, peer, a.comm, a.stream) };
    check(lib, code, "ncclRecv", a.comm)
}

/// RCCL's `ncclAllToAll` (`count` elements per peer), or `None` if the library lacks it.
///
/// # Safety
/// As [`all_reduce`].
pub unsafe fn all_to_all(a: Args, send: u64, recv: u64, count: usize) -> Option<Result<Status>> {
    let lib = match lib() {
        Ok(l) => l,
        Err(e) => return Some(Err(e)),
    };
    let f = lib.ncclAllToAll?;
    // SAFETY: per the caller's contract.
    let code = unsafe { f(cptr(send), mptr(recv), count, a.datatype, a.comm, a.stream) };
    Some(check(lib, code, "ncclAllToAll", a.comm))
}

/// The text RCCL gives for a result code (`ncclGetErrorString`).
pub fn error_string(code: c_int) -> String {
    match lib() {
        Ok(lib) => {
            // SAFETY: accepts any value; returns a static string.
            let p: *const c_char = unsafe { (lib.ncclGetErrorString)(code) };
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: non-null, NUL-terminated.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        }
        Err(_) => ResultCode(code).message().to_string(),
    }
}
