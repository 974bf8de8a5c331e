//! Raw HIP runtime and hipRTC symbols, loaded at run time.
//!
//! Nothing here links against ROCm: the libraries are opened with
//! `libloading` on first use and their symbols resolved into plain function
//! pointers held in a [`OnceLock`]. The search order is the variable
//! (`CHORUS_HIP_LIB`, `CHORUS_HIPRTC_LIB`: a full path) first, then the usual
//! file names. A library that is not found is
//! [`DeviceError::LibraryUnavailable`] naming every file tried and the
//! variable; a library that lacks a required symbol is
//! [`DeviceError::Backend`] naming the symbol. The outcome of the first
//! attempt is kept for the life of the process.
//!
//! Only the calls chorus makes are bound; their C signatures are those of
//! `hip_runtime_api.h` and `hiprtc.h` (stable since ROCm 4.2). Handles are
//! opaque pointers and statuses plain `i32`s, so a status this module does
//! not know is still reported with its number.
#![allow(non_camel_case_types, non_upper_case_globals)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

pub use crate::loader::{open_first, Loaded};
use crate::loader::{optional, required};
use crate::DeviceError;

/// `hipError_t`.
pub type hipError_t = c_int;
/// `hipStream_t`.
pub type hipStream_t = *mut c_void;
/// `hipEvent_t`.
pub type hipEvent_t = *mut c_void;
/// `hipModule_t`.
pub type hipModule_t = *mut c_void;
/// `hipFunction_t`.
pub type hipFunction_t = *mut c_void;
/// `hipMemcpyKind`.
pub type hipMemcpyKind = c_int;
/// `hiprtcProgram`.
pub type hiprtcProgram = *mut c_void;
/// `hiprtcResult`.
pub type hiprtcResult = c_int;
/// `hipHostFn_t`: a host function run in stream order (`hipLaunchHostFunc`).
pub type hipHostFn_t = unsafe extern "C" fn(user_data: *mut c_void);
/// `hipStreamCallback_t`: a host function run in stream order with the stream's status (`hipStreamAddCallback`).
pub type hipStreamCallback_t = unsafe extern "C" fn(stream: hipStream_t, status: hipError_t, user_data: *mut c_void);

/// `hipSuccess`.
pub const hipSuccess: hipError_t = 0;
/// `hipErrorOutOfMemory`.
pub const hipErrorOutOfMemory: hipError_t = 2;
/// `hipErrorNoDevice`.
pub const hipErrorNoDevice: hipError_t = 100;
/// `hipErrorInvalidDevice`.
pub const hipErrorInvalidDevice: hipError_t = 101;
/// `hipErrorNotReady`: an event or stream query whose work has not finished.
pub const hipErrorNotReady: hipError_t = 600;
/// `hipMemcpyHostToDevice`.
pub const hipMemcpyHostToDevice: hipMemcpyKind = 1;
/// `hipMemcpyDeviceToHost`.
pub const hipMemcpyDeviceToHost: hipMemcpyKind = 2;
/// `hipMemcpyDeviceToDevice`.
pub const hipMemcpyDeviceToDevice: hipMemcpyKind = 3;
/// `hipStreamNonBlocking`: no implicit synchronization with the null stream.
pub const hipStreamNonBlocking: c_uint = 0x1;
/// `hipEventDisableTiming`.
pub const hipEventDisableTiming: c_uint = 0x2;
/// `HIPRTC_SUCCESS`.
pub const HIPRTC_SUCCESS: hiprtcResult = 0;

/// The variable that points to the HIP runtime.
pub const HIP_VARIABLE: &str = "CHORUS_HIP_LIB";
/// File names tried for the HIP runtime, in order, after the variable.
pub const HIP_NAMES: [&str; 3] = ["libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"];
/// The variable that points to hipRTC.
pub const HIPRTC_VARIABLE: &str = "CHORUS_HIPRTC_LIB";
/// File names tried for hipRTC, in order, after the variable. ROCm 5 ships
/// hipRTC inside `libamdhip64`, which is tried last.
pub const HIPRTC_NAMES: [&str; 4] = ["libhiprtc.so", "libhiprtc.so.7", "libhiprtc.so.6", "libhiprtc.so.5"];

macro_rules! api {
    ($(#[$meta:meta])* $lib:ident, $name:literal { $($(#[$fmeta:meta])* $f:ident: fn($($arg:ty),*) -> $ret:ty;)* }
     optional { $($(#[$ometa:meta])* $o:ident: fn($($oarg:ty),*) -> $oret:ty;)* }) => {
        $(#[$meta])*
        #[allow(non_snake_case)]
        pub struct $lib {
            /// Where the library was loaded from.
            pub path: String,
            $($(#[$fmeta])* pub $f: unsafe extern "C" fn($($arg),*) -> $ret,)*
            $($(#[$ometa])* pub $o: Option<unsafe extern "C" fn($($oarg),*) -> $oret>,)*
            _library: libloading::Library,
        }

        impl $lib {
            fn resolve(lib: Loaded) -> Result<$lib, DeviceError> {
                // SAFETY: each signature is the C declaration of the symbol of the same name.
                unsafe {
                    Ok($lib {
                        path: lib.path.clone(),
                        $($f: required(&lib, $name, stringify!($f), "a ROCm 5.1 or newer runtime")?,)*
                        $($o: optional(&lib, stringify!($o)),)*
                        _library: lib.library,
                    })
                }
            }
        }

        impl std::fmt::Debug for $lib {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}({})", stringify!($lib), self.path)
            }
        }
    };
}

api! {
    /// The HIP runtime (`libamdhip64`).
    HipLib, "libamdhip64" {
        /// `hipInit(flags)`.
        hipInit: fn(c_uint) -> hipError_t;
        /// `hipGetDeviceCount(&count)`.
        hipGetDeviceCount: fn(*mut c_int) -> hipError_t;
        /// `hipSetDevice(ordinal)`.
        hipSetDevice: fn(c_int) -> hipError_t;
        /// `hipDeviceSynchronize()`: blocks until the current device is idle.
        hipDeviceSynchronize: fn() -> hipError_t;
        /// `hipDeviceGetName(name, len, device)`.
        hipDeviceGetName: fn(*mut c_char, c_int, c_int) -> hipError_t;
        /// `hipDeviceTotalMem(&bytes, device)`.
        hipDeviceTotalMem: fn(*mut usize, c_int) -> hipError_t;
        /// `hipRuntimeGetVersion(&version)`.
        hipRuntimeGetVersion: fn(*mut c_int) -> hipError_t;
        /// `hipDriverGetVersion(&version)`.
        hipDriverGetVersion: fn(*mut c_int) -> hipError_t;
        /// `hipGetErrorName(status)`.
        hipGetErrorName: fn(hipError_t) -> *const c_char;
        /// `hipGetErrorString(status)`.
        hipGetErrorString: fn(hipError_t) -> *const c_char;
        /// `hipDeviceGetStreamPriorityRange(&least, &greatest)`.
        hipDeviceGetStreamPriorityRange: fn(*mut c_int, *mut c_int) -> hipError_t;
        /// `hipStreamCreateWithPriority(&stream, flags, priority)`.
        hipStreamCreateWithPriority: fn(*mut hipStream_t, c_uint, c_int) -> hipError_t;
        /// `hipStreamDestroy(stream)`.
        hipStreamDestroy: fn(hipStream_t) -> hipError_t;
        /// `hipStreamWaitEvent(stream, event, flags)`.
        hipStreamWaitEvent: fn(hipStream_t, hipEvent_t, c_uint) -> hipError_t;
        /// `hipStreamAddCallback(stream, callback, user_data, flags)`.
        hipStreamAddCallback: fn(hipStream_t, hipStreamCallback_t, *mut c_void, c_uint) -> hipError_t;
        /// `hipEventCreateWithFlags(&event, flags)`.
        hipEventCreateWithFlags: fn(*mut hipEvent_t, c_uint) -> hipError_t;
        /// `hipEventRecord(event, stream)`.
        hipEventRecord: fn(hipEvent_t, hipStream_t) -> hipError_t;
        /// `hipEventQuery(event)`: `hipSuccess` when done, `hipErrorNotReady` while pending.
        hipEventQuery: fn(hipEvent_t) -> hipError_t;
        /// `hipEventDestroy(event)`.
        hipEventDestroy: fn(hipEvent_t) -> hipError_t;
        /// `hipMallocAsync(&ptr, bytes, stream)` (ROCm 5.1+).
        hipMallocAsync: fn(*mut *mut c_void, usize, hipStream_t) -> hipError_t;
        /// `hipFreeAsync(ptr, stream)` (ROCm 5.1+).
        hipFreeAsync: fn(*mut c_void, hipStream_t) -> hipError_t;
        /// `hipMemcpyAsync(dst, src, bytes, kind, stream)`.
        hipMemcpyAsync: fn(*mut c_void, *const c_void, usize, hipMemcpyKind, hipStream_t) -> hipError_t;
        /// `hipMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream)`.
        hipMemcpy2DAsync:
            fn(*mut c_void, usize, *const c_void, usize, usize, usize, hipMemcpyKind, hipStream_t) -> hipError_t;
        /// `hipHostMalloc(&ptr, bytes, flags)`: page-locked host memory.
        hipHostMalloc: fn(*mut *mut c_void, usize, c_uint) -> hipError_t;
        /// `hipHostFree(ptr)`.
        hipHostFree: fn(*mut c_void) -> hipError_t;
        /// `hipMemsetAsync(dst, value, bytes, stream)`.
        hipMemsetAsync: fn(*mut c_void, c_int, usize, hipStream_t) -> hipError_t;
        /// `hipModuleLoadData(&module, image)`.
        hipModuleLoadData: fn(*mut hipModule_t, *const c_void) -> hipError_t;
        /// `hipModuleGetFunction(&function, module, name)`.
        hipModuleGetFunction: fn(*mut hipFunction_t, hipModule_t, *const c_char) -> hipError_t;
        /// `hipModuleUnload(module)`.
        hipModuleUnload: fn(hipModule_t) -> hipError_t;
        /// `hipModuleLaunchKernel(f, gx, gy, gz, bx, by, bz, shared_bytes, stream, params, extra)`.
        hipModuleLaunchKernel: fn(
            hipFunction_t, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, hipStream_t,
            *mut *mut c_void, *mut *mut c_void
        ) -> hipError_t;
    }
    optional {
        /// `hipLaunchHostFunc(stream, fn, user_data)` (absent from some ROCm 5 runtimes).
        hipLaunchHostFunc: fn(hipStream_t, hipHostFn_t, *mut c_void) -> hipError_t;
    }
}

api! {
    /// hipRTC, the run-time compiler (`libhiprtc`, or `libamdhip64` on ROCm 5).
    RtcLib, "hiprtc" {
        /// `hiprtcCreateProgram(&prog, source, name, num_headers, headers, include_names)`.
        hiprtcCreateProgram: fn(
            *mut hiprtcProgram, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char
        ) -> hiprtcResult;
        /// `hiprtcCompileProgram(prog, num_options, options)`.
        hiprtcCompileProgram: fn(hiprtcProgram, c_int, *const *const c_char) -> hiprtcResult;
        /// `hiprtcGetProgramLogSize(prog, &size)`.
        hiprtcGetProgramLogSize: fn(hiprtcProgram, *mut usize) -> hiprtcResult;
        /// `hiprtcGetProgramLog(prog, log)`.
        hiprtcGetProgramLog: fn(hiprtcProgram, *mut c_char) -> hiprtcResult;
        /// `hiprtcGetCodeSize(prog, &size)`.
        hiprtcGetCodeSize: fn(hiprtcProgram, *mut usize) -> hiprtcResult;
        /// `hiprtcGetCode(prog, code)`.
        hiprtcGetCode: fn(hiprtcProgram, *mut c_char) -> hiprtcResult;
        /// `hiprtcDestroyProgram(&prog)`.
        hiprtcDestroyProgram: fn(*mut hiprtcProgram) -> hiprtcResult;
        /// `hiprtcGetErrorString(result)`.
        hiprtcGetErrorString: fn(hiprtcResult) -> *const c_char;
        /// `hiprtcVersion(&major, &minor)`.
        hiprtcVersion: fn(*mut c_int, *mut c_int) -> hiprtcResult;
    }
    optional {}
}

/// The HIP runtime, loaded on first use.
pub fn hip() -> Result<&'static HipLib, DeviceError> {
    static LIB: OnceLock<Result<HipLib, DeviceError>> = OnceLock::new();
    LIB.get_or_init(|| HipLib::resolve(open_first("libamdhip64", HIP_VARIABLE, &HIP_NAMES)?))
        .as_ref()
        .map_err(Clone::clone)
}

/// hipRTC, loaded on first use: `CHORUS_HIPRTC_LIB`, then `libhiprtc.so*`,
/// then the HIP runtime itself (where ROCm 5 keeps hipRTC).
pub fn hiprtc() -> Result<&'static RtcLib, DeviceError> {
    static LIB: OnceLock<Result<RtcLib, DeviceError>> = OnceLock::new();
    LIB.get_or_init(|| {
        let own = open_first("hiprtc", HIPRTC_VARIABLE, &HIPRTC_NAMES);
        let lib = match own {
            Ok(lib) => lib,
            Err(DeviceError::LibraryUnavailable { tried, .. }) => {
                // ROCm 5: hipRTC is part of libamdhip64; reuse the runtime's file.
                let hip = hip().map_err(|e| match e {
                    DeviceError::LibraryUnavailable { tried: hip_tried, .. } => DeviceError::LibraryUnavailable {
                        library: "hiprtc",
                        tried: format!("{tried}, {hip_tried}"),
                        variable: HIPRTC_VARIABLE,
                    },
                    other => other,
                })?;
                open_first("hiprtc", HIPRTC_VARIABLE, &[hip.path.as_str()])?
            }
            Err(other) => return Err(other),
        };
        RtcLib::resolve(lib)
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Whether the HIP runtime can be loaded (the availability probe; loads it if not yet loaded).
pub fn is_hip_available() -> bool {
    hip().is_ok()
}
