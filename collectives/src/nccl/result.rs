//! One function per NCCL call, its status turned into a typed error.
//!
//! Every function loads the library on first use (a missing library is
//! `CommError::Device(DeviceError::LibraryUnavailable { .. })`), returns
//! [`Status::InProgress`] where a non-blocking communicator may answer it,
//! and names the call and NCCL's last error in the message of a failure.

use std::ffi::{c_int, c_void, CStr};
use std::mem::MaybeUninit;

use super::sys::{self, Comm, Nccl, Stream};
use crate::nccl_abi::{CommConfig, ResultCode, Status, UniqueId, Version};
use crate::{CommError, Result};

/// The library name in errors.
pub const LIBRARY: &str = "nccl";

fn lib() -> Result<&'static Nccl> {
    sys::nccl().map_err(CommError::Device)
}

/// Checks `code` from `call`; on failure appends NCCL's last error for `comm`.
fn check(nccl: &Nccl, code: c_int, call: &str, comm: Comm) -> Result<Status> {
    ResultCode(code).check(LIBRARY, call).map_err(|e| match (e, nccl.get_last_error) {
        (CommError::Backend { library, code, message }, Some(last)) => {
            // SAFETY: NCCL returns a static or per-thread NUL-terminated string (or null).
            let detail = unsafe {
                let p = last(comm);
                if p.is_null() {
                    String::new()
                } else {
                    CStr::from_ptr(p).to_string_lossy().into_owned()
                }
            };
            let message = if detail.is_empty() { message } else { format!("{message} ({detail})") };
            CommError::Backend { library, code, message }
        }
        (e, _) => e,
    })
}

/// Where the library was found (the name or path it was opened by).
pub fn library_path() -> Result<String> {
    Ok(lib()?.found.clone())
}

/// `ncclGetVersion`.
pub fn get_version() -> Result<Version> {
    let nccl = lib()?;
    let mut v = 0;
    // SAFETY: an out-pointer to a local.
    check(nccl, unsafe { (nccl.get_version)(&mut v) }, "ncclGetVersion", std::ptr::null_mut())?;
    Ok(Version::decode(v))
}

/// `ncclGetUniqueId`.
pub fn get_unique_id() -> Result<UniqueId> {
    let nccl = lib()?;
    let mut id = UniqueId::from_bytes([0; crate::nccl_abi::UNIQUE_ID_BYTES]);
    // SAFETY: an out-pointer to a 128-byte id.
    check(nccl, unsafe { (nccl.get_unique_id)(&mut id) }, "ncclGetUniqueId", std::ptr::null_mut())?;
    Ok(id)
}

/// `ncclCommInitRankConfig`. With a non-blocking config the handle is
/// returned at once and may be `InProgress`.
///
/// # Safety
/// The calling thread's current CUDA device must be the rank's device.
pub unsafe fn comm_init_rank_config(
    nranks: usize,
    id: UniqueId,
    rank: usize,
    config: &mut CommConfig,
) -> Result<(Comm, Status)> {
    let nccl = lib()?;
    let int = |v: usize| c_int::try_from(v).map_err(|_| CommError::invalid("ncclCommInitRankConfig", "rank too large"));
    let mut comm = MaybeUninit::<Comm>::zeroed();
    // SAFETY: out-pointer and config are valid for the call.
    let code = unsafe { (nccl.comm_init_rank_config)(comm.as_mut_ptr(), int(nranks)?, id, int(rank)?, config) };
    // SAFETY: zero-initialized, written by NCCL on success.
    let comm = unsafe { comm.assume_init() };
    let status = check(nccl, code, "ncclCommInitRankConfig", comm)?;
    Ok((comm, status))
}

/// `ncclCommSplit` (`color` `None` is `NCCL_SPLIT_NOCOLOR`); the child
/// inherits the parent's config. The child is null for `None`.
///
/// # Safety
/// `comm` must be a live communicator; the device must be current.
pub unsafe fn comm_split(comm: Comm, color: Option<u32>, key: i64) -> Result<(Comm, Status)> {
    let nccl = lib()?;
    let color = match color {
        None => -1,
        Some(c) => c_int::try_from(c).map_err(|_| CommError::invalid("split", format!("color {c} exceeds i32")))?,
    };
    let key = c_int::try_from(key).map_err(|_| CommError::invalid("split", format!("key {key} exceeds i32")))?;
    let mut child = MaybeUninit::<Comm>::zeroed();
    // SAFETY: per the caller's contract; a null config inherits the parent's.
    let code = unsafe { (nccl.comm_split)(comm, color, key, child.as_mut_ptr(), std::ptr::null_mut()) };
    // SAFETY: zero-initialized, written by NCCL.
    let child = unsafe { child.assume_init() };
    let status = check(nccl, code, "ncclCommSplit", comm)?;
    Ok((child, status))
}

/// `ncclCommGetAsyncError`: the communicator's state (`InProgress` while a
/// non-blocking call is still working).
///
/// # Safety
/// `comm` must be a live communicator.
pub unsafe fn comm_get_async_error(comm: Comm) -> Result<Status> {
    let nccl = lib()?;
    let mut state = 0;
    // SAFETY: per the caller's contract.
    check(nccl, unsafe { (nccl.comm_get_async_error)(comm, &mut state) }, "ncclCommGetAsyncError", comm)?;
    check(nccl, state, "the communicator (ncclCommGetAsyncError)", comm)
}

/// `ncclCommCount` and `ncclCommUserRank`: (rank, size).
///
/// # Safety
/// `comm` must be a live, initialized communicator.
pub unsafe fn comm_rank_and_size(comm: Comm) -> Result<(usize, usize)> {
    let nccl = lib()?;
    let (mut rank, mut size) = (0, 0);
    // SAFETY: per the caller's contract.
    unsafe {
        check(nccl, (nccl.comm_user_rank)(comm, &mut rank), "ncclCommUserRank", comm)?;
        check(nccl, (nccl.comm_count)(comm, &mut size), "ncclCommCount", comm)?;
    }
    Ok((rank.max(0) as usize, size.max(0) as usize))
}

/// `ncclCommFinalize`.
///
/// # Safety
/// `comm` must be a live communicator; the device must be current.
pub unsafe fn comm_finalize(comm: Comm) -> Result<Status> {
    let nccl = lib()?;
    // SAFETY: per the caller's contract.
    check(nccl, unsafe { (nccl.comm_finalize)(comm) }, "ncclCommFinalize", comm)
}

/// `ncclCommDestroy`; the handle is invalid afterwards.
///
/// # Safety
/// `comm` must be a live communicator, not used again.
pub unsafe fn comm_destroy(comm: Comm) -> Result<Status> {
    let nccl = lib()?;
    // SAFETY: per the caller's contract.
    check(nccl, unsafe { (nccl.comm_destroy)(comm) }, "ncclCommDestroy", std::ptr::null_mut())
}

/// `ncclCommAbort`; the handle is invalid afterwards.
///
/// # Safety
/// `comm` must be a live communicator, not used again.
pub unsafe fn comm_abort(comm: Comm) -> Result<Status> {
    let nccl = lib()?;
    // SAFETY: per the caller's contract.
    check(nccl, unsafe { (nccl.comm_abort)(comm) }, "ncclCommAbort", std::ptr::null_mut())
}

/// `ncclRedOpCreatePreMulSum` with a host-immediate scalar encoded in `dtype`.
///
/// # Safety
/// `comm` must be live; `scalar` must hold one element of `dtype`.
pub unsafe fn red_op_create_pre_mul_sum(scalar: &mut [u8; 8], dtype: c_int, comm: Comm) -> Result<c_int> {
    let nccl = lib()?;
    let mut op = 0;
    let residence = crate::nccl_abi::ScalarResidence::HostImmediate as c_int;
    // SAFETY: per the caller's contract; a host-immediate scalar is read during the call.
    let code = unsafe {
        (nccl.red_op_create_pre_mul_sum)(&mut op, scalar.as_mut_ptr() as *mut c_void, dtype, residence, comm)
    };
    check(nccl, code, "ncclRedOpCreatePreMulSum", comm)?;
    Ok(op)
}

/// `ncclRedOpDestroy`.
///
/// # Safety
/// `op` must have been created on `comm` and be destroyed once, after the
/// calls that use it were enqueued.
pub unsafe fn red_op_destroy(op: c_int, comm: Comm) -> Result<Status> {
    let nccl = lib()?;
    // SAFETY: per the caller's contract.
    check(nccl, unsafe { (nccl.red_op_destroy)(op, comm) }, "ncclRedOpDestroy", comm)
}

/// `ncclAllReduce`.
///
/// # Safety
/// Device pointers valid for `count` elements of `dtype` in `stream`'s order.
#[allow(clippy::too_many_arguments)]
pub unsafe fn all_reduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: Comm,
    stream: Stream,
) -> Result<Status> {
    let nccl = lib()?;
    // SAFETY: per the caller's contract.
    check(nccl, unsafe { (nccl.all_reduce)(send, recv, count, dtype, op, comm, stream) }, "ncclAllReduce", comm)
}

/// `ncclBroadcast`.
///
/// # Safety
/// As [`all_reduce`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn broadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    comm: Comm,
    stream: Stream,
) -> Result<Status> {
    let nccl = lib()?;
    // SAFETY: per the caller's contract.
    check(nccl, unsafe { (nccl.broadcast)(send, recv, count, dtype, root, comm, stream) }, "ncclBroadcast", comm)
}

/// `ncclReduce`.
///
/// # Safety
/// As [`all_reduce`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn reduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    root: c_int,
    comm: Comm,
    stream: Stream,
) -> Result<Status> {
    let nccl = lib()?;
    // SAFETY: per the caller's contract.
    check(nccl, unsafe { (nccl.reduce)(send, recv, count, dtype, op, root, comm, stream) }, "ncclReduce", comm)
}

/// `ncclAllGather` (`count` per rank).
///
/// # Safety
/// As [`all_reduce`], `recv` holding `count × size` elements.
pub unsafe fn all_gather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    comm: Comm,
    stream: Stream,
) -> Result<Status> {
    let nccl = lib()?;
    // SAFETY: per the caller's contract.
    check(nccl, unsafe { (nccl.all_gather)(send, recv, count, dtype, comm, stream) }, "ncclAllGather", comm)
}

/// `ncclReduceScatter` (`count` received per rank).
///
/// # Safety
/// As [`all_reduce`], `send` holding `count × size` elements.
#[allow(clippy::too_many_arguments)]
pub unsafe fn reduce_scatter(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: Comm,
    stream: Stream,
) -> Result<Status> {
    let nccl = lib()?;
    // SAFETY: per the caller's contract.
    check(nccl, unsafe { (nccl.reduce_scatter)(send, recv, count, dtype, op, comm, stream) }, "ncclReduceScatter", comm)
}

/// `ncclSend`.
///
/// # Safety
/// As [`all_reduce`].
pub unsafe fn send(
    buf: *const c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    comm: Comm,
    stream: Stream,
) -> Result<Status> {
    let nccl = lib()?;
    // SAFETY: per the caller's contract.
    check(nccl, unsafe { (nccl.send)(buf, count, dtype, peer, comm, stream) }, "ncclSend", comm)
}

/// `ncclRecv`.
///
/// # Safety
/// As [`all_reduce`].
pub unsafe fn recv(
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    comm: Comm,
    stream: Stream,
) -> Result<Status> {
    let nccl = lib()?;
    // SAFETY: per the caller's contract.
    check(nccl, unsafe { (nccl.recv)(buf, count, dtype, peer, comm, stream) }, "ncclRecv", comm)
}

/// `ncclGroupStart`.
pub fn group_start() -> Result<Status> {
    let nccl = lib()?;
    // SAFETY: no arguments; balanced by `group_end`.
    check(nccl, unsafe { (nccl.group_start)() }, "ncclGroupStart", std::ptr::null_mut())
}

/// `ncclGroupEnd`; `InProgress` on a non-blocking communicator.
pub fn group_end() -> Result<Status> {
    let nccl = lib()?;
    // SAFETY: no arguments; after `group_start`.
    check(nccl, unsafe { (nccl.group_end)() }, "ncclGroupEnd", std::ptr::null_mut())
}

/// `ncclGetErrorString` for a code (the library's own text).
pub fn error_string(code: ResultCode) -> Result<String> {
    let nccl = lib()?;
    // SAFETY: NCCL returns a static NUL-terminated string.
    let p = unsafe { (nccl.get_error_string)(code.0) };
    if p.is_null() {
        return Ok(code.message().to_string());
    }
    // SAFETY: non-null, NUL-terminated.
    Ok(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}
