//! The raw NCCL symbols, loaded once at run time into a table.
//!
//! The declarations follow cudarc's `nccl::sys` (its handle types are used
//! as is), but the loading is ours, for three reasons:
//! - cudarc's loader tries a fixed list of names that lacks `libnccl.so.2`,
//!   the only name pip's `nvidia-nccl-cu12` ships, and cannot be pointed at a
//!   full path;
//! - it panics when the library or a symbol is missing; here that is
//!   [`DeviceError::LibraryUnavailable`] naming the files tried and
//!   `CHORUS_NCCL_LIB`;
//! - its functions take and return Rust enums, but NCCL's reduce-op handle
//!   of a pre-multiplied sum is a run-time value outside `ncclRedOp_t`'s
//!   enumerators, and a library may return a result code the bindings do not
//!   know; both would be undefined behaviour in an enum. Here every enum is a
//!   plain `c_int` with its values in [`crate::nccl_abi`].

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use chorus_devices::DeviceError;
use libloading::Library;

use crate::nccl_abi::{CommConfig, UniqueId};

/// `ncclComm_t` (cudarc's declaration).
pub type Comm = cudarc::nccl::sys::ncclComm_t;
/// `cudaStream_t` as NCCL takes it (cudarc's declaration).
pub type Stream = cudarc::nccl::sys::cudaStream_t;

/// The variable that may name the library by full path.
pub const LIBRARY_VARIABLE: &str = "CHORUS_NCCL_LIB";

macro_rules! nccl_table {
    ($( $field:ident = $symbol:literal : fn($($arg:ty),*) -> $ret:ty; )*) => {
        /// Every NCCL function chorus calls.
        #[allow(non_snake_case, missing_docs)]
        pub struct Nccl {
            $( pub $field: unsafe extern "C" fn($($arg),*) -> $ret, )*
            /// `ncclGetLastError` (NCCL 2.13+), when the library has it.
            pub get_last_error: Option<unsafe extern "C" fn(Comm) -> *const c_char>,
            /// Where the library was found.
            pub found: String,
            _library: Library,
        }

        const SYMBOLS: &[&str] = &[$($symbol),*];

        impl Nccl {
            fn from_library(library: Library, found: String) -> Result<Nccl, Vec<&'static str>> {
                let missing: Vec<&'static str> = SYMBOLS
                    .iter()
                    .copied()
                    // SAFETY: only presence is checked here.
                    .filter(|s| unsafe { library.get::<*const ()>(s.as_bytes()) }.is_err())
                    .collect();
                if !missing.is_empty() {
                    return Err(missing);
                }
                // SAFETY: each symbol exists (checked above) and has the C
                // signature of nccl.h declared in the table; the library stays
                // loaded as long as the table (it owns it).
                unsafe {
                    Ok(Nccl {
                        $( $field: *library
                            .get::<unsafe extern "C" fn($($arg),*) -> $ret>($symbol.as_bytes())
                            .map_err(|_| vec![$symbol])?, )*
                        get_last_error: library
                            .get::<unsafe extern "C" fn(Comm) -> *const c_char>(b"ncclGetLastError")
                            .ok()
                            .map(|f| *f),
                        found,
                        _library: library,
                    })
                }
            }
        }
    };
}

nccl_table! {
    get_version = "ncclGetVersion": fn(*mut c_int) -> c_int;
    get_unique_id = "ncclGetUniqueId": fn(*mut UniqueId) -> c_int;
    comm_init_rank_config = "ncclCommInitRankConfig": fn(*mut Comm, c_int, UniqueId, c_int, *mut CommConfig) -> c_int;
    comm_split = "ncclCommSplit": fn(Comm, c_int, c_int, *mut Comm, *mut CommConfig) -> c_int;
    comm_finalize = "ncclCommFinalize": fn(Comm) -> c_int;
    comm_destroy = "ncclCommDestroy": fn(Comm) -> c_int;
    comm_abort = "ncclCommAbort": fn(Comm) -> c_int;
    comm_get_async_error = "ncclCommGetAsyncError": fn(Comm, *mut c_int) -> c_int;
    comm_count = "ncclCommCount": fn(Comm, *mut c_int) -> c_int;
    comm_user_rank = "ncclCommUserRank": fn(Comm, *mut c_int) -> c_int;
    get_error_string = "ncclGetErrorString": fn(c_int) -> *const c_char;
    red_op_create_pre_mul_sum = "ncclRedOpCreatePreMulSum": fn(*mut c_int, *mut c_void, c_int, c_int, Comm) -> c_int;
    red_op_destroy = "ncclRedOpDestroy": fn(c_int, Comm) -> c_int;
    all_reduce = "ncclAllReduce": fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int;
    broadcast = "ncclBroadcast": fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int;
    reduce = "ncclReduce": fn(*const c_void, *mut c_void, usize, c_int, c_int, c_int, Comm, Stream) -> c_int;
    all_gather = "ncclAllGather": fn(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> c_int;
    reduce_scatter = "ncclReduceScatter": fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int;
    send = "ncclSend": fn(*const c_void, usize, c_int, c_int, Comm, Stream) -> c_int;
    recv = "ncclRecv": fn(*mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int;
    group_start = "ncclGroupStart": fn() -> c_int;
    group_end = "ncclGroupEnd": fn() -> c_int;
}

/// The names tried, in order: `$CHORUS_NCCL_LIB`, pip's `libnccl.so.2`,
/// `libnccl.so`, then cudarc's candidates.
pub fn candidates() -> Vec<String> {
    let mut names = Vec::new();
    if let Ok(path) = std::env::var(LIBRARY_VARIABLE) {
        if !path.is_empty() {
            names.push(path);
        }
    }
    for n in ["libnccl.so.2".to_string(), "libnccl.so".to_string()]
        .into_iter()
        .chain(cudarc::get_lib_name_candidates("nccl"))
    {
        if !names.contains(&n) {
            names.push(n);
        }
    }
    names
}

fn load() -> Result<Nccl, DeviceError> {
    let mut tried = Vec::new();
    for name in candidates() {
        // SAFETY: loading NCCL runs its initializers; that is what using it means.
        match unsafe { Library::new(&name) } {
            Ok(lib) => match Nccl::from_library(lib, name.clone()) {
                Ok(table) => return Ok(table),
                Err(missing) => tried.push(format!("{name} (opened, but lacks {})", missing.join(", "))),
            },
            Err(_) => tried.push(name),
        }
    }
    Err(DeviceError::LibraryUnavailable {
        library: "libnccl",
        tried: tried.join(", "),
        variable: "CHORUS_NCCL_LIB (full path to libnccl.so.2) or LD_LIBRARY_PATH",
    })
}

/// The loaded library, or why it cannot be loaded. Loaded once per process.
pub fn nccl() -> Result<&'static Nccl, DeviceError> {
    static NCCL: OnceLock<Result<Nccl, DeviceError>> = OnceLock::new();
    NCCL.get_or_init(load).as_ref().map_err(Clone::clone)
}
