//! The one dynamic-library loader of chorus's vendor bindings (HIP, hipRTC,
//! NCCL, RCCL): nothing links against a vendor SDK, so every feature builds
//! anywhere, and a missing library is a typed error, never a panic.
//!
//! The search order is the variable (`CHORUS_*_LIB`, a full path) first,
//! then the usual file names. A library that is not found is
//! [`DeviceError::LibraryUnavailable`] naming every file tried and the
//! variable; a library that lacks a required symbol is
//! [`DeviceError::Backend`] naming the symbol. Callers keep the outcome of
//! the first attempt in a `OnceLock` for the life of the process. (The CUDA
//! libraries are loaded by cudarc; `cuda::loader` probes them the way
//! cudarc will.)

use crate::DeviceError;

/// A library that was found: the handle and where it was loaded from.
#[derive(Debug)]
pub struct Loaded {
    /// The open library (kept open for the life of the process once stored).
    pub library: libloading::Library,
    /// The file it was loaded from: the resolved path where the process maps
    /// show it, else the name that loaded.
    pub path: String,
}

/// Opens the first library that loads: `$variable` (a full path) if set,
/// then each of `names`. The error names every file tried and the variable.
pub fn open_first(library: &'static str, variable: &'static str, names: &[&str]) -> Result<Loaded, DeviceError> {
    let mut tried = Vec::new();
    let from_env = std::env::var(variable).ok().filter(|v| !v.is_empty());
    let candidates = from_env.iter().map(String::as_str).chain(names.iter().copied());
    for name in candidates {
        // SAFETY: loading a vendor library runs its initializers; these are
        // the libraries the variable or the system designates for this purpose.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => return Ok(Loaded { library: lib, path: resolved_path(name) }),
            Err(e) => {
                if from_env.as_deref() == Some(name) {
                    tried.push(format!("{variable}={name} ({e})"));
                } else {
                    tried.push(name.to_string());
                }
            }
        }
    }
    Err(DeviceError::LibraryUnavailable { library, tried: tried.join(", "), variable })
}

/// The path the dynamic loader mapped for `name` (from `/proc/self/maps`), or `name`.
fn resolved_path(name: &str) -> String {
    if name.starts_with('/') {
        return name.to_string();
    }
    let stem = name.split(".so").next().unwrap_or(name);
    std::fs::read_to_string("/proc/self/maps")
        .ok()
        .and_then(|maps| {
            maps.lines()
                .filter_map(|l| l.split_whitespace().nth(5))
                .find(|p| {
                    p.rsplit('/').next().is_some_and(|f| f.starts_with(stem) && f[stem.len()..].starts_with(".so"))
                })
                .map(str::to_string)
        })
        .unwrap_or_else(|| name.to_string())
}

/// Resolves a required symbol, or names it (and `needed`, the oldest
/// release that has it) in the error.
///
/// # Safety
/// `T` must be the symbol's true C signature.
pub unsafe fn required<T: Copy>(
    lib: &Loaded,
    library: &'static str,
    name: &str,
    needed: &str,
) -> Result<T, DeviceError> {
    // SAFETY: per the caller's contract on `T`.
    match unsafe { lib.library.get::<T>(name) } {
        Ok(sym) => Ok(*sym),
        Err(e) => Err(DeviceError::Backend {
            library,
            code: -1,
            message: format!("{} lacks the symbol {name} ({e}); {needed} is needed", lib.path),
        }),
    }
}

/// Resolves an optional symbol.
///
/// # Safety
/// `T` must be the symbol's true C signature.
pub unsafe fn optional<T: Copy>(lib: &Loaded, name: &str) -> Option<T> {
    // SAFETY: per the caller's contract on `T`.
    unsafe { lib.library.get::<T>(name) }.ok().map(|s| *s)
}
