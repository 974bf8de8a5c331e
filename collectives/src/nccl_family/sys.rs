//! The raw symbols of an NCCL-ABI library, in one table for every library of
//! the family.
//!
//! NCCL and RCCL export the same C functions with the same signatures (RCCL
//! takes a `hipStream_t` where NCCL takes a `cudaStream_t`; both are an
//! opaque pointer here). Every enum crosses the boundary as a plain `c_int`
//! with its values in [`super::abi`] (a pre-multiplied sum's operator is a
//! run-time value, and a library may return a code this crate does not
//! know). Calls that not every release has are optional: the config-based
//! init, split and finalize (NCCL 2.14/2.18 ABI), pre-multiplied sums (2.11),
//! all-to-all (RCCL's `ncclAllToAll`; NCCL's `ncclAlltoAll` from 2.28) and
//! `ncclGetLastError` (2.13).
//!
//! A table is loaded at run time with the shared loader
//! ([`chorus_devices::loader`]) by `nccl` and `rccl`, or built in-process by
//! the simulated library ([`super::simlib`]); both hand out `&'static Api`.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};

use super::abi::{CommConfig, UniqueId};

/// `ncclComm_t`.
pub type ncclComm_t = *mut c_void;
/// `cudaStream_t` / `hipStream_t`.
pub type Stream = *mut c_void;
/// `ncclResult_t`.
pub type ncclResult_t = c_int;

/// `NCCL_SPLIT_NOCOLOR`: the color of a rank that takes no part in a split.
pub const NCCL_SPLIT_NOCOLOR: c_int = -1;

/// `ncclAllToAll`/`ncclAlltoAll(send, recv, count per peer, datatype, comm, stream)`.
pub type AllToAllFn =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, ncclComm_t, Stream) -> ncclResult_t;

macro_rules! nccl_api {
    (required { $($(#[$m:meta])* $f:ident: fn($($a:ty),*) -> $r:ty;)* }
     optional { $($(#[$om:meta])* $o:ident: fn($($oa:ty),*) -> $or:ty;)* }) => {
        /// The functions of an NCCL-ABI library that chorus calls.
        #[allow(non_snake_case)]
        pub struct Api {
            /// Where the library was loaded from (or `simulated`).
            pub path: String,
            $($(#[$m])* pub $f: unsafe extern "C" fn($($a),*) -> $r,)*
            $($(#[$om])* pub $o: Option<unsafe extern "C" fn($($oa),*) -> $or>,)*
            /// Keeps a loaded library open as long as the table exists.
            _library: Option<Box<dyn std::any::Any + Send + Sync>>,
        }

        /// The same table as plain function pointers, for a library built in
        /// this process (the simulated one).
        #[allow(non_snake_case, missing_docs)]
        pub struct ApiFns {
            $(pub $f: unsafe extern "C" fn($($a),*) -> $r,)*
            $(pub $o: Option<unsafe extern "C" fn($($oa),*) -> $or>,)*
        }

        impl Api {
            /// A table of functions of this process.
            pub fn from_fns(path: &str, fns: ApiFns) -> Api {
                Api { path: path.to_string(), $($f: fns.$f,)* $($o: fns.$o,)* _library: None }
            }

            /// Resolves the table from a loaded library (`library` names it in errors).
            #[cfg(any(feature = "nccl", feature = "rccl"))]
            pub fn resolve(
                lib: chorus_devices::loader::Loaded,
                library: &'static str,
                needed: &str,
            ) -> Result<Api, chorus_devices::DeviceError> {
                use chorus_devices::loader::{optional, required};
                // SAFETY: each signature is the declaration in nccl.h / rccl.h
                // of the symbol of the same name; the library stays open as
                // long as the table (it owns it).
                unsafe {
                    Ok(Api {
                        path: lib.path.clone(),
                        $($f: required(&lib, library, stringify!($f), needed)?,)*
                        $($o: optional(&lib, stringify!($o)),)*
                        _library: Some(Box::new(lib.library)),
                    })
                }
            }
        }

        impl std::fmt::Debug for Api {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "Api({})", self.path)
            }
        }
    };
}

nccl_api! {
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
        ncclAllReduce: fn(*const c_void, *mut c_void, usize, c_int, c_int, ncclComm_t, Stream) -> ncclResult_t;
        /// `ncclBroadcast(send, recv, count, datatype, root, comm, stream)`.
        ncclBroadcast: fn(*const c_void, *mut c_void, usize, c_int, c_int, ncclComm_t, Stream) -> ncclResult_t;
        /// `ncclReduce(send, recv, count, datatype, op, root, comm, stream)`.
        ncclReduce: fn(*const c_void, *mut c_void, usize, c_int, c_int, c_int, ncclComm_t, Stream) -> ncclResult_t;
        /// `ncclAllGather(send, recv, send_count, datatype, comm, stream)`.
        ncclAllGather: fn(*const c_void, *mut c_void, usize, c_int, ncclComm_t, Stream) -> ncclResult_t;
        /// `ncclReduceScatter(send, recv, recv_count, datatype, op, comm, stream)`.
        ncclReduceScatter: fn(*const c_void, *mut c_void, usize, c_int, c_int, ncclComm_t, Stream) -> ncclResult_t;
        /// `ncclSend(buf, count, datatype, peer, comm, stream)`.
        ncclSend: fn(*const c_void, usize, c_int, c_int, ncclComm_t, Stream) -> ncclResult_t;
        /// `ncclRecv(buf, count, datatype, peer, comm, stream)`.
        ncclRecv: fn(*mut c_void, usize, c_int, c_int, ncclComm_t, Stream) -> ncclResult_t;
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
        /// `ncclAllToAll(send, recv, count, datatype, comm, stream)` (RCCL's spelling).
        ncclAllToAll: fn(*const c_void, *mut c_void, usize, c_int, ncclComm_t, Stream) -> ncclResult_t;
        /// `ncclAlltoAll(send, recv, count, datatype, comm, stream)` (NCCL 2.28+).
        ncclAlltoAll: fn(*const c_void, *mut c_void, usize, c_int, ncclComm_t, Stream) -> ncclResult_t;
        /// `ncclGetLastError(comm)` (NCCL 2.13 ABI).
        ncclGetLastError: fn(ncclComm_t) -> *const c_char;
    }
}
