//! Availability probes for the CUDA libraries, run before cudarc is touched.
//!
//! cudarc loads each library lazily, by a fixed list of file names, and
//! panics when none loads or a symbol is missing. So before any cudarc call
//! this module does what cudarc will do: it tries the same names (from
//! `cudarc::get_lib_name_candidates`) with `libloading`, checks that every
//! symbol chorus uses is there, and keeps the handle open for the life of
//! the process. A missing library becomes
//! [`DeviceError::LibraryUnavailable`] naming the files tried and the
//! variable to set; cudarc's panic can then no longer happen.
//!
//! `CHORUS_CUDA_LIB`, `CHORUS_NVRTC_LIB` and `CHORUS_CUBLAS_LIB` may name a
//! library by full path. It is opened first; its SONAME (`libcuda.so.1`,
//! `libnvrtc.so.12`, `libcublas.so.12`) is one of cudarc's names, so cudarc's
//! later lookup by name finds the already-loaded object.

use std::sync::OnceLock;

use libloading::Library;

use crate::DeviceError;

/// One library chorus loads at run time.
struct Spec {
    /// The common name in errors (`libcuda`).
    library: &'static str,
    /// cudarc's stem (`cuda` → `libcuda.so`, `libcuda.so.1`, ...).
    stem: &'static str,
    /// Our override variable (a full path).
    variable: &'static str,
    /// What the error tells the user to set.
    hint: &'static str,
    /// Every symbol chorus (through cudarc) calls.
    symbols: &'static [&'static str],
}

const DRIVER: Spec = Spec {
    library: "libcuda",
    stem: "cuda",
    variable: "CHORUS_CUDA_LIB",
    hint: "CHORUS_CUDA_LIB (full path to libcuda.so.1) or LD_LIBRARY_PATH",
    symbols: &[
        "cuInit",
        "cuDriverGetVersion",
        "cuDeviceGetCount",
        "cuDeviceGet",
        "cuDeviceGetName",
        "cuDeviceGetAttribute",
        "cuDeviceTotalMem_v2",
        "cuDevicePrimaryCtxRetain",
        "cuDevicePrimaryCtxRelease_v2",
        "cuCtxSetCurrent",
        "cuCtxGetStreamPriorityRange",
        "cuStreamCreateWithPriority",
        "cuStreamDestroy_v2",
        "cuStreamQuery",
        "cuStreamWaitEvent",
        "cuEventCreate",
        "cuEventRecord",
        "cuEventQuery",
        "cuEventDestroy_v2",
        "cuDeviceGetDefaultMemPool",
        "cuMemPoolSetAttribute",
        "cuMemAllocAsync",
        "cuMemFreeAsync",
        "cuMemHostAlloc",
        "cuMemFreeHost",
        "cuMemGetInfo_v2",
        "cuMemcpyHtoDAsync_v2",
        "cuMemcpyDtoHAsync_v2",
        "cuMemcpyDtoDAsync_v2",
        "cuMemcpy2DAsync_v2",
        "cuMemsetD8Async",
        "cuMemsetD16Async",
        "cuMemsetD32Async",
        "cuLaunchHostFunc",
        "cuModuleLoadData",
        "cuModuleGetFunction",
        "cuModuleUnload",
        "cuLaunchKernel",
        "cuGetErrorName",
        "cuGetErrorString",
    ],
};

const NVRTC: Spec = Spec {
    library: "libnvrtc",
    stem: "nvrtc",
    variable: "CHORUS_NVRTC_LIB",
    hint: "CHORUS_NVRTC_LIB (full path to libnvrtc.so.12) or LD_LIBRARY_PATH",
    symbols: &[
        "nvrtcVersion",
        "nvrtcCreateProgram",
        "nvrtcCompileProgram",
        "nvrtcDestroyProgram",
        "nvrtcGetPTXSize",
        "nvrtcGetPTX",
        "nvrtcGetProgramLogSize",
        "nvrtcGetProgramLog",
        "nvrtcGetErrorString",
    ],
};

const CUBLAS: Spec = Spec {
    library: "libcublas",
    stem: "cublas",
    variable: "CHORUS_CUBLAS_LIB",
    hint: "CHORUS_CUBLAS_LIB (full path to libcublas.so.12) or LD_LIBRARY_PATH",
    symbols: &["cublasCreate_v2", "cublasDestroy_v2", "cublasSetStream_v2", "cublasGemmEx", "cublasGetProperty"],
};

/// cuRAND: not chorus's own, but candle's CUDA device (feature
/// `candle-cuda` of chorus-fsdp-candle) makes a generator when it is made.
const CURAND: Spec = Spec {
    library: "libcurand",
    stem: "curand",
    variable: "CHORUS_CURAND_LIB",
    hint: "CHORUS_CURAND_LIB (full path to libcurand.so.10) or LD_LIBRARY_PATH",
    symbols: &[
        "curandCreateGenerator",
        "curandDestroyGenerator",
        "curandSetPseudoRandomGeneratorSeed",
        "curandSetStream",
        "curandGenerateUniform",
        "curandGenerateNormal",
    ],
};

/// Where a library was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LibraryInfo {
    /// The common name (`libcuda`, `libnvrtc`, `libcublas`).
    pub library: &'static str,
    /// The name it was opened by (as cudarc will open it).
    pub name: String,
    /// The file it resolved to, when the platform tells (`/proc/self/maps`).
    pub path: Option<String>,
}

struct Loaded {
    info: LibraryInfo,
    // Kept open for the life of the process, so cudarc's lookup by name finds
    // the same object and the symbols stay valid.
    _preloaded: Option<Library>,
    _library: Library,
}

fn probe(spec: &Spec) -> Result<Loaded, DeviceError> {
    let mut tried = Vec::new();
    let mut preloaded = None;
    if let Ok(path) = std::env::var(spec.variable) {
        if !path.is_empty() {
            // SAFETY: loading a vendor library runs its initializers; that is
            // what using the library means.
            match unsafe { Library::new(&path) } {
                Ok(lib) => preloaded = Some(lib),
                Err(e) => tried.push(format!("{path} ({}={path}: {e})", spec.variable)),
            }
        }
    }
    let candidates = cudarc::get_lib_name_candidates(spec.stem);
    for name in &candidates {
        // SAFETY: as above.
        let Ok(lib) = (unsafe { Library::new(name) }) else {
            tried.push(name.clone());
            continue;
        };
        let missing: Vec<&str> = spec
            .symbols
            .iter()
            .copied()
            // SAFETY: only the symbol's presence is checked; it is not called.
            .filter(|s| unsafe { lib.get::<*const ()>(s.as_bytes()) }.is_err())
            .collect();
        if !missing.is_empty() {
            // cudarc stops at the first name that opens, so a library without
            // our symbols is a dead end, not a reason to try the next name.
            tried.push(format!("{name} (opened, but lacks {})", missing.join(", ")));
            break;
        }
        let path = spec
            .symbols
            .first()
            // SAFETY: the address is only compared with mapped ranges.
            .and_then(|s| unsafe { lib.get::<*const ()>(s.as_bytes()) }.ok().map(|sym| *sym as usize))
            .and_then(mapped_file);
        return Ok(Loaded {
            info: LibraryInfo { library: spec.library, name: name.clone(), path },
            _preloaded: preloaded,
            _library: lib,
        });
    }
    Err(DeviceError::LibraryUnavailable { library: spec.library, tried: tried.join(", "), variable: spec.hint })
}

/// The file mapped at `addr` in this process (Linux), for reports.
fn mapped_file(addr: usize) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let mut parts = line.split_whitespace();
        let (lo, hi) = parts.next()?.split_once('-')?;
        let (lo, hi) = (usize::from_str_radix(lo, 16).ok()?, usize::from_str_radix(hi, 16).ok()?);
        let path = parts.nth(4)?;
        (lo <= addr && addr < hi && path.starts_with('/')).then(|| path.to_string())
    })
}

fn cached(cell: &'static OnceLock<Result<Loaded, DeviceError>>, spec: &Spec) -> Result<LibraryInfo, DeviceError> {
    match cell.get_or_init(|| probe(spec)) {
        Ok(l) => Ok(l.info.clone()),
        Err(e) => Err(e.clone()),
    }
}

static DRIVER_LIB: OnceLock<Result<Loaded, DeviceError>> = OnceLock::new();
static NVRTC_LIB: OnceLock<Result<Loaded, DeviceError>> = OnceLock::new();
static CUBLAS_LIB: OnceLock<Result<Loaded, DeviceError>> = OnceLock::new();
static CURAND_LIB: OnceLock<Result<Loaded, DeviceError>> = OnceLock::new();

/// Probes the CUDA driver library (`libcuda.so.1`). Cached: the first answer stays.
pub fn driver_library() -> Result<LibraryInfo, DeviceError> {
    cached(&DRIVER_LIB, &DRIVER)
}

/// Probes NVRTC (`libnvrtc.so.12`), which compiles the elementwise kernels.
pub fn nvrtc_library() -> Result<LibraryInfo, DeviceError> {
    cached(&NVRTC_LIB, &NVRTC)
}

/// Probes cuBLAS (`libcublas.so.12`), which runs `matmul`.
pub fn cublas_library() -> Result<LibraryInfo, DeviceError> {
    cached(&CUBLAS_LIB, &CUBLAS)
}

/// Probes cuRAND (`libcurand.so.10`), which candle's CUDA device opens when it is made.
pub fn curand_library() -> Result<LibraryInfo, DeviceError> {
    cached(&CURAND_LIB, &CURAND)
}

/// Runs `f`, which calls into cudarc, turning a panic (cudarc's reaction to
/// a library it cannot load) into a typed error. The probes make this
/// unreachable in practice; it is the second line of defence.
pub(crate) fn guarded<T>(library: &'static str, f: impl FnOnce() -> Result<T, DeviceError>) -> Result<T, DeviceError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "cudarc panicked".into());
        Err(DeviceError::Backend { library, code: -1, message })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_names_what_was_tried_and_the_variable() {
        let spec = Spec {
            library: "libchorus-absent",
            stem: "chorus-absent-library",
            variable: "CHORUS_TEST_ABSENT_LIB",
            hint: "CHORUS_TEST_ABSENT_LIB or LD_LIBRARY_PATH",
            symbols: &["nothing"],
        };
        match probe(&spec) {
            Err(DeviceError::LibraryUnavailable { library, tried, variable }) => {
                assert_eq!(library, "libchorus-absent");
                assert!(tried.contains("libchorus-absent-library.so"), "{tried}");
                assert!(variable.contains("CHORUS_TEST_ABSENT_LIB"));
            }
            other => panic!("expected LibraryUnavailable, got {:?}", other.map(|l| l.info)),
        }
    }

    #[test]
    fn a_library_without_our_symbols_is_refused() {
        // libc opens everywhere and has none of these symbols.
        let spec = Spec {
            library: "libc-as-cuda",
            stem: "c",
            variable: "CHORUS_TEST_LIBC",
            hint: "CHORUS_TEST_LIBC",
            symbols: &["cuInit"],
        };
        if let Err(DeviceError::LibraryUnavailable { tried, .. }) = probe(&spec) {
            assert!(tried.contains("lacks cuInit") || !tried.is_empty(), "{tried}");
        }
    }
}
