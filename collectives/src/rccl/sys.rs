//! Raw RCCL symbols, loaded at run time (there is no `rccl-sys`; nothing links against ROCm).
//!
//! RCCL keeps NCCL's C ABI: the same function names and signatures, with
//! `hipStream_t` where NCCL takes a `cudaStream_t`; the values of every enum
//! are in [`crate::nccl_abi`], shared with the NCCL backend, and are passed
//! as plain `c_int`s (a pre-multiplied sum's operator is a run-time value,
//! and a library may return a result this crate does not know).
//!
//! The library is `$CHORUS_RCCL_LIB` (a full path) if set, then
//! `librccl.so`, `librccl.so.1`. It is opened once per process and the
//! outcome kept in a [`OnceLock`]. Calls that not every RCCL has are
//! optional: `ncclCommInitRankConfig`, `ncclCommSplit`, `ncclCommFinalize`
//! (RCCL of ROCm 5.5+ / 6.0+), `ncclRedOpCreatePreMulSum` (NCCL 2.11 ABI),
//! `ncclAllToAll` (RCCL's own; NCCL spells it `ncclAlltoAll` from 2.28, and
//! chorus falls back to grouped send/recv without it) and `ncclGetLastError`.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use chorus_devices::hip::sys::{open_first, optional, required, Loaded};
use chorus_devices::DeviceError;

use crate::nccl_abi::{CommConfig, UniqueId};

/// `ncclComm_t`.
pub type ncclComm_t = *mut c_void;
/// `hipStream_t`.
pub type hipStream_t = *mut c_void;
/// `ncclResult_t`.
pub type ncclResult_t = c_int;

/// `NCCL_SPLIT_NOCOLOR`: the color of a rank that takes no part in a split.
pub const NCCL_SPLIT_NOCOLOR: c_int = -1;

/// The variable that points to RCCL.
pub const RCCL_VARIABLE: &str = "CHORUS_RCCL_LIB";
/// File names tried for RCCL, in order, after the variable.
pub const RCCL_NAMES: [&str; 2] = ["librccl.so", "librccl.so.1"];

macro_rules! rccl_api {
    (required { $($(#[$m:meta])* $f:ident: fn($($a:ty),*) -> $r:ty;)* }
     optional { $($(#[$om:meta])* $o:ident: fn($($oa:ty),*) -> $or:ty;)* }) => {
        /// The RCCL functions chorus calls.
        #[allow(non_snake_case)]
        pub struct RcclLib {
            /// Where the library was loaded from.
            pub path: String,
            $($(#[$m])* pub $f: unsafe extern "C" fn($($a),*) -> $r,)*
            $($(#[$om])* pub $o: Option<unsafe extern "C" fn($($oa),*) -> $or>,)*
            _library: libloading::Library,
        }

        impl RcclLib {
            fn resolve(lib: Loaded) -> Result<RcclLib, DeviceError> {
                // SAFETY: each signature is the declaration in rccl.h of the symbol of the same name.
                unsafe {
                    Ok(RcclLib {
                        path: lib.path.clone(),
                        $($f: required(&lib, "librccl", stringify!($f))?,)*
                        $($o: optional(&lib, stringify!($o)),)*
                        _library: lib.library,
                    })
                }
            }
        }

        impl std::fmt::Debug for RcclLib {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "RcclLib({})", self.path)
            }
        }
    };
}

rccl_api! {
    required {
        /// `ncclGetVersion(&version)`.
        ncclGetVersion: fn(*mut c_int) -> ncclResult_t;
        /// `ncclGetUniqueId(&id)`.
        ncclGetUniqueId: fn(*mut UniqueId) -> ncclResult_t;
        /// `ncclCommInitRank(&comm, nranks, id, rank)` (blocking).
        ncclCommInitRank: fn(*mut ncclComm_t, c_int, UniqueId, c_int) -> ncclResult_t;
        /// `ncclCommDestroy(comm)`.
        ncclCommDestroy: fn(ncclComm_t) -> ncclResult_t;
        /// `ncclCommAbort(comm)`.
        ncclCommAbort: fn(ncclComm_t) -> ncclResult_t;
        /// `ncclCommGetAsyncError(comm, &result)`.
        ncclCommGetAsyncError: fn(ncclComm_t, *mut ncclResult_t) -> ncclResult_t;
        /// `ncclCommCount(comm, &count)`.
        ncclCommCount: fn(ncclComm_t, *mut c_int) -> ncclResult_t;
        /// `ncclCommUserRank(comm, &rank)`.
        ncclCommUserRank: fn(ncclComm_t, *mut c_int) -> ncclResult_t;
        /// `ncclGetErrorString(result)`.
        ncclGetErrorString: fn(ncclResult_t) -> *const c_char;
        /// `ncclAllReduce(send, recv, count, datatype, op, comm, stream)`.
        ncclAllReduce: fn(*const c_void, *mut c_void, usize, c_int, c_int, ncclComm_t, hipStream_t) -> ncclResult_t;
        /// `ncclBroadcast(send, recv, count, datatype, root, comm, stream)`.
        ncclBroadcast: fn(*const c_void, *mut c_void, usize, c_int, c_int, ncclComm_t, hipStream_t) -> ncclResult_t;
        /// `ncclReduce(send, recv, count, datatype, op, root, comm, stream)`.
        ncclReduce:
            fn(*const c_void, *mut c_void, usize, c_int, c_int, c_int, ncclComm_t, hipStream_t) -> ncclResult_t;
        /// `ncclAllGather(send, recv, send_count, datatype, comm, stream)`.
        ncclAllGather: fn(*const c_void, *mut c_void, usize, c_int, ncclComm_t, hipStream_t) -> ncclResult_t;
        /// `ncclReduceScatter(send, recv, recv_count, datatype, op, comm, stream)`.
        ncclReduceScatter:
            fn(*const c_void, *mut c_void, usize, c_int, c_int, ncclComm_t, hipStream_t) -> ncclResult_t;
        /// `ncclSend(buf, count, datatype, peer, comm, stream)`.
        ncclSend: fn(*const c_void, usize, c_int, c_int, ncclComm_t, hipStream_t) -> ncclResult_t;
        /// `ncclRecv(buf, count, datatype, peer, comm, stream)`.
        ncclRecv: fn(*mut c_void, usize, c_int, c_int, ncclComm_t, hipStream_t) -> ncclResult_t;
        /// `ncclGroupStart()`.
        ncclGroupStart: fn() -> ncclResult_t;
        /// `ncclGroupEnd()`.
        ncclGroupEnd: fn() -> ncclResult_t;
    }
    optional {
        /// `ncclCommInitRankConfig(&comm, nranks, id, rank, &config)` (NCCL 2.14 ABI).
        ncclCommInitRankConfig: fn(*mut ncclComm_t, c_int, UniqueId, c_int, *mut CommConfig) -> ncclResult_t;
        /// `ncclCommSplit(comm, color, key, &new_comm, &config)` (NCCL 2.18 ABI).
        ncclCommSplit: fn(ncclComm_t, c_int, c_int, *mut ncclComm_t, *mut CommConfig) -> ncclResult_t;
        /// `ncclCommFinalize(comm)` (NCCL 2.14 ABI).
        ncclCommFinalize: fn(ncclComm_t) -> ncclResult_t;
        /// `ncclRedOpCreatePreMulSum(&op, scalar, datatype, residence, comm)` (NCCL 2.11 ABI).
        ncclRedOpCreatePreMulSum: fn(*mut c_int, *mut c_void, c_int, c_int, ncclComm_t) -> ncclResult_t;
        /// `ncclRedOpDestroy(op, comm)` (NCCL 2.11 ABI).
        ncclRedOpDestroy: fn(c_int, ncclComm_t) -> ncclResult_t;
        /// `ncclAllToAll(send, recv, count, datatype, comm, stream)` (RCCL only).
        ncclAllToAll: fn(*const c_void, *mut c_void, usize, c_int, ncclComm_t, hipStream_t) -> ncclResult_t;
        /// `ncclGetLastError(comm)` (NCCL 2.13 ABI).
        ncclGetLastError: fn(ncclComm_t) -> *const c_char;
    }
}

/// RCCL, loaded on first use.
pub fn rccl() -> Result<&'static RcclLib, DeviceError> {
    static LIB: OnceLock<Result<RcclLib, DeviceError>> = OnceLock::new();
    LIB.get_or_init(|| RcclLib::resolve(open_first("librccl", RCCL_VARIABLE, &RCCL_NAMES)?))
        .as_ref()
        .map_err(Clone::clone)
}

/// Whether RCCL can be loaded (the availability probe; loads it if not yet loaded).
pub fn is_rccl_available() -> bool {
    rccl().is_ok()
}
