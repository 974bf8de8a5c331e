//! One function per call of an NCCL-ABI library, its status turned into a
//! typed error naming the library, the call and the library's last error.
//!
//! [`Lib`] pairs a loaded [`Api`] table with the library's name (`nccl`,
//! `rccl`, `simnccl`), so every error says which library failed. Calls that
//! take a communicator are `unsafe`: the handle must be live and not in use
//! by another thread (the communicator's lock guarantees both).

use std::ffi::{c_int, c_void, CStr};

use super::abi::{CommConfig, DataType, ResultCode, ScalarResidence, Status, UniqueId, Version, UNIQUE_ID_BYTES};
use super::sys::{ncclComm_t, AllToAllFn, Api, Stream, NCCL_SPLIT_NOCOLOR};
use crate::{CommError, Result};

/// A loaded library and its name.
#[derive(Clone, Copy, Debug)]
pub struct Lib {
    /// The symbols.
    pub api: &'static Api,
    /// The library's name in errors.
    pub name: &'static str,
}

fn int(op: &'static str, what: &str, v: usize) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| CommError::invalid(op, format!("{what} {v} exceeds the library's int")))
}

impl Lib {
    /// Checks `code` of `call`; on failure appends the library's last error for `comm`.
    fn check(&self, code: c_int, call: &str, comm: ncclComm_t) -> Result<Status> {
        ResultCode(code).check(self.name, call).map_err(|e| match (e, self.api.ncclGetLastError) {
            (CommError::Backend { library, code, message }, Some(last)) if !comm.is_null() => {
                // SAFETY: the library returns a NUL-terminated string it owns (or null).
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

    /// `ncclGetVersion`.
    pub fn version(&self) -> Result<Version> {
        let mut v = 0;
        // SAFETY: an out-pointer to a local.
        self.check(unsafe { (self.api.ncclGetVersion)(&mut v) }, "ncclGetVersion", std::ptr::null_mut())?;
        Ok(Version::decode(v))
    }

    /// `ncclGetUniqueId`.
    pub fn unique_id(&self) -> Result<UniqueId> {
        let mut id = UniqueId::from_bytes([0; UNIQUE_ID_BYTES]);
        // SAFETY: an out-pointer to a 128-byte id.
        self.check(unsafe { (self.api.ncclGetUniqueId)(&mut id) }, "ncclGetUniqueId", std::ptr::null_mut())?;
        Ok(id)
    }

    /// `ncclCommInitRankConfig` (or the blocking `ncclCommInitRank` when
    /// `config` is `None`), writing the handle to `slot`.
    ///
    /// # Safety
    /// The rank's device is current on this thread; `slot` stays valid until
    /// the initialization has completed (a library may write it late).
    pub unsafe fn comm_init_rank(
        &self,
        slot: *mut ncclComm_t,
        nranks: usize,
        id: UniqueId,
        rank: usize,
        config: Option<&mut CommConfig>,
    ) -> Result<Status> {
        let op = "ncclCommInitRank";
        let (n, r) = (int(op, "world size", nranks)?, int(op, "rank", rank)?);
        match (config, self.api.ncclCommInitRankConfig) {
            // SAFETY: per the caller's contract; the config lives for the call.
            (Some(cfg), Some(f)) => {
                self.check(unsafe { f(slot, n, id, r, cfg) }, "ncclCommInitRankConfig", std::ptr::null_mut())
            }
            // SAFETY: as above.
            _ => self.check(unsafe { (self.api.ncclCommInitRank)(slot, n, id, r) }, op, std::ptr::null_mut()),
        }
    }

    /// `ncclCommSplit` (`color` `None` is `NCCL_SPLIT_NOCOLOR`); the child
    /// inherits the parent's config. NCCL writes the child to `slot` when the
    /// split completes, which on a non-blocking communicator is after this
    /// returns `InProgress`.
    ///
    /// # Safety
    /// `comm` is live and used by no other thread; `slot` stays valid until
    /// the split has completed (or the parent has been aborted).
    pub unsafe fn comm_split(
        &self,
        comm: ncclComm_t,
        color: Option<u32>,
        key: i64,
        slot: *mut ncclComm_t,
    ) -> Result<Status> {
        let split = self.api.ncclCommSplit.ok_or_else(|| CommError::Unsupported {
            backend: self.name,
            what: "ncclCommSplit (NCCL 2.18 ABI)".into(),
        })?;
        let color = match color {
            None => NCCL_SPLIT_NOCOLOR,
            Some(c) => c_int::try_from(c).map_err(|_| CommError::invalid("split", format!("color {c} exceeds i32")))?,
        };
        let key = c_int::try_from(key).map_err(|_| CommError::invalid("split", format!("key {key} exceeds i32")))?;
        // SAFETY: per the caller's contract; a null config inherits the parent's.
        self.check(unsafe { split(comm, color, key, slot, std::ptr::null_mut()) }, "ncclCommSplit", comm)
    }

    /// `ncclCommGetAsyncError`: the communicator's state (`InProgress` while
    /// a non-blocking call is still working), or its asynchronous error.
    ///
    /// # Safety
    /// `comm` is live and used by no other thread.
    pub unsafe fn async_error(&self, comm: ncclComm_t) -> Result<Status> {
        let mut state = 0;
        // SAFETY: per the caller's contract.
        self.check(unsafe { (self.api.ncclCommGetAsyncError)(comm, &mut state) }, "ncclCommGetAsyncError", comm)?;
        self.check(state, "the communicator (ncclCommGetAsyncError)", comm)
    }

    /// `ncclCommCount` and `ncclCommUserRank`: `(rank, size)`.
    ///
    /// # Safety
    /// `comm` is live, initialized and used by no other thread.
    pub unsafe fn rank_and_size(&self, comm: ncclComm_t) -> Result<(usize, usize)> {
        let (mut rank, mut size) = (0, 0);
        // SAFETY: per the caller's contract.
        self.check(unsafe { (self.api.ncclCommUserRank)(comm, &mut rank) }, "ncclCommUserRank", comm)?;
        // SAFETY: per the caller's contract.
        self.check(unsafe { (self.api.ncclCommCount)(comm, &mut size) }, "ncclCommCount", comm)?;
        Ok((rank.max(0) as usize, size.max(0) as usize))
    }

    /// `ncclCommFinalize`, where the library has it (else `Done`: destroy alone finalizes).
    ///
    /// # Safety
    /// `comm` is live and used by no other thread.
    pub unsafe fn finalize(&self, comm: ncclComm_t) -> Result<Status> {
        match self.api.ncclCommFinalize {
            // SAFETY: per the caller's contract.
            Some(f) => self.check(unsafe { f(comm) }, "ncclCommFinalize", comm),
            None => Ok(Status::Done),
        }
    }

    /// `ncclCommDestroy`: the handle is gone afterwards.
    ///
    /// # Safety
    /// `comm` is live, used by no other thread, and never used again.
    pub unsafe fn destroy(&self, comm: ncclComm_t) -> Result<()> {
        // SAFETY: per the caller's contract.
        self.check(unsafe { (self.api.ncclCommDestroy)(comm) }, "ncclCommDestroy", std::ptr::null_mut()).map(|_| ())
    }

    /// `ncclCommAbort`: the handle is gone afterwards; its queued kernels return.
    ///
    /// # Safety
    /// `comm` is live, used by no other thread, and never used again.
    pub unsafe fn abort(&self, comm: ncclComm_t) -> Result<()> {
        // SAFETY: per the caller's contract.
        self.check(unsafe { (self.api.ncclCommAbort)(comm) }, "ncclCommAbort", std::ptr::null_mut()).map(|_| ())
    }

    /// `ncclRedOpCreatePreMulSum` with a host-immediate scalar (`scalar`
    /// holds one element of `dtype`, little-endian).
    ///
    /// # Safety
    /// `comm` is live and used by no other thread.
    pub unsafe fn premul_sum(&self, scalar: &mut [u8; 8], dtype: DataType, comm: ncclComm_t) -> Result<c_int> {
        let create = self.api.ncclRedOpCreatePreMulSum.ok_or_else(|| CommError::Unsupported {
            backend: self.name,
            what: "ReduceOp::PreMulSum (ncclRedOpCreatePreMulSum, NCCL 2.11 ABI)".into(),
        })?;
        let mut op = 0;
        let residence = ScalarResidence::HostImmediate as c_int;
        // SAFETY: per the caller's contract; the scalar is read during the call.
        let code = unsafe { create(&mut op, scalar.as_mut_ptr() as *mut c_void, dtype.raw(), residence, comm) };
        self.check(code, "ncclRedOpCreatePreMulSum", comm)?;
        Ok(op)
    }

    /// `ncclRedOpDestroy`.
    ///
    /// # Safety
    /// `comm` is live and used by no other thread; `op` was created on it.
    pub unsafe fn destroy_op(&self, op: c_int, comm: ncclComm_t) -> Result<()> {
        match self.api.ncclRedOpDestroy {
            // SAFETY: per the caller's contract.
            Some(f) => self.check(unsafe { f(op, comm) }, "ncclRedOpDestroy", comm).map(|_| ()),
            None => Ok(()),
        }
    }

    /// `ncclGroupStart`.
    pub fn group_start(&self) -> Result<()> {
        // SAFETY: no arguments.
        self.check(unsafe { (self.api.ncclGroupStart)() }, "ncclGroupStart", std::ptr::null_mut()).map(|_| ())
    }

    /// `ncclGroupEnd`: `InProgress` on a non-blocking communicator whose
    /// calls are still being enqueued by the library.
    pub fn group_end(&self, comm: ncclComm_t) -> Result<Status> {
        // SAFETY: no arguments.
        self.check(unsafe { (self.api.ncclGroupEnd)() }, "ncclGroupEnd", comm)
    }

    /// The native all-to-all, if this library has one.
    pub fn all_to_all_fn(&self) -> Option<AllToAllFn> {
        self.api.ncclAlltoAll.or(self.api.ncclAllToAll)
    }
}

/// One call's raw arguments, named as in the C declarations: device
/// addresses (`send`, `recv`, `buf`), the element `count` the call takes, the
/// `dtype`, the reduce operator `op` (a built-in value or a pre-multiplied
/// sum's run-time one), and the `root` or `peer` rank.
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug)]
pub enum RawCall {
    /// `ncclAllReduce`.
    AllReduce { send: u64, recv: u64, count: usize, dtype: DataType, op: c_int },
    /// `ncclAllGather` (`count` per rank).
    AllGather { send: u64, recv: u64, count: usize, dtype: DataType },
    /// `ncclReduceScatter` (`count` received).
    ReduceScatter { send: u64, recv: u64, count: usize, dtype: DataType, op: c_int },
    /// `ncclBroadcast`.
    Broadcast { send: u64, recv: u64, count: usize, dtype: DataType, root: usize },
    /// `ncclReduce`.
    Reduce { send: u64, recv: u64, count: usize, dtype: DataType, op: c_int, root: usize },
    /// A native all-to-all (`count` per peer).
    AllToAll { send: u64, recv: u64, count: usize, dtype: DataType, f: AllToAllFn },
    /// `ncclSend`.
    Send { buf: u64, count: usize, dtype: DataType, peer: usize },
    /// `ncclRecv`.
    Recv { buf: u64, count: usize, dtype: DataType, peer: usize },
}

impl RawCall {
    /// This call with another reduce operator (a pre-multiplied sum's
    /// run-time operator); calls without one are unchanged.
    pub fn with_op(self, new: c_int) -> RawCall {
        match self {
            RawCall::AllReduce { send, recv, count, dtype, .. } => {
                RawCall::AllReduce { send, recv, count, dtype, op: new }
            }
            RawCall::ReduceScatter { send, recv, count, dtype, .. } => {
                RawCall::ReduceScatter { send, recv, count, dtype, op: new }
            }
            RawCall::Reduce { send, recv, count, dtype, root, .. } => {
                RawCall::Reduce { send, recv, count, dtype, op: new, root }
            }
            other => other,
        }
    }
}

impl Lib {
    /// Issues one call on `stream`.
    ///
    /// # Safety
    /// `comm` is live and used by no other thread; every address is valid for
    /// its count in `stream`'s order and on the communicator's device.
    pub unsafe fn issue(&self, call: RawCall, comm: ncclComm_t, stream: Stream) -> Result<()> {
        let a = &self.api;
        let p = |x: u64| x as *mut c_void;
        // SAFETY (every call): per the caller's contract.
        let (code, name) = unsafe {
            match call {
                RawCall::AllReduce { send, recv, count, dtype, op } => {
                    ((a.ncclAllReduce)(p(send), p(recv), count, dtype.raw(), op, comm, stream), "ncclAllReduce")
                }
                RawCall::AllGather { send, recv, count, dtype } => {
                    ((a.ncclAllGather)(p(send), p(recv), count, dtype.raw(), comm, stream), "ncclAllGather")
                }
                RawCall::ReduceScatter { send, recv, count, dtype, op } => {
                    ((a.ncclReduceScatter)(p(send), p(recv), count, dtype.raw(), op, comm, stream), "ncclReduceScatter")
                }
                RawCall::Broadcast { send, recv, count, dtype, root } => {
                    let root = int("broadcast", "root", root)?;
                    ((a.ncclBroadcast)(p(send), p(recv), count, dtype.raw(), root, comm, stream), "ncclBroadcast")
                }
                RawCall::Reduce { send, recv, count, dtype, op, root } => {
                    let root = int("reduce", "root", root)?;
                    ((a.ncclReduce)(p(send), p(recv), count, dtype.raw(), op, root, comm, stream), "ncclReduce")
                }
                RawCall::AllToAll { send, recv, count, dtype, f } => {
                    (f(p(send), p(recv), count, dtype.raw(), comm, stream), "ncclAlltoAll")
                }
                RawCall::Send { buf, count, dtype, peer } => {
                    let peer = int("send", "peer", peer)?;
                    ((a.ncclSend)(p(buf), count, dtype.raw(), peer, comm, stream), "ncclSend")
                }
                RawCall::Recv { buf, count, dtype, peer } => {
                    let peer = int("recv", "peer", peer)?;
                    ((a.ncclRecv)(p(buf), count, dtype.raw(), peer, comm, stream), "ncclRecv")
                }
            }
        };
        self.check(code, name, comm).map(|_| ())
    }
}
