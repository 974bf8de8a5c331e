//! Test support: C++ source (GPU kernels behind a prelude that defines
//! their keywords away) built by the host's C++ compiler into a shared
//! library and loaded, for the host-emulation tests of `chorus-devices`
//! and `chorus-kernels`.
//!
//! A C++ compiler is those tests' prerequisite (`ci/vendor-cxx.sh` installs
//! g++): [`build`] without one is an error, which the tests turn into a
//! failure rather than a pass without having run.

use std::path::Path;
use std::process::Command;

/// A loaded build; its symbols are looked up by name.
pub struct HostLibrary {
    lib: libloading::Library,
}

/// The first C++ compiler that answers `--version`: `$CXX`, `c++`, `g++`, `clang++`.
fn compiler() -> Option<String> {
    let candidates = std::env::var("CXX").into_iter().chain(["c++", "g++", "clang++"].map(String::from));
    candidates.into_iter().find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
}

/// Writes `files` (name, text) into a fresh directory `{name}-{pid}` under
/// `scratch`, compiles `main` (one of them, which includes the others) as
/// C++17 with `-O2 -fPIC -shared -pthread` and `flags` into a shared
/// library, loads it and removes the directory. The compiler's warnings
/// are printed; its rejection is the error, with its log.
pub fn build(
    scratch: &Path,
    name: &str,
    files: &[(&str, &str)],
    main: &str,
    flags: &[&str],
) -> Result<HostLibrary, String> {
    let cxx = compiler().ok_or("no C++ compiler (CXX, c++, g++, clang++)")?;
    let dir = scratch.join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for (file, text) in files {
        std::fs::write(dir.join(file), text).map_err(|e| format!("{file}: {e}"))?;
    }
    let lib = dir.join(format!("lib{name}.so"));
    let out = Command::new(&cxx)
        .args(["-std=c++17", "-O2", "-fPIC", "-shared", "-pthread"])
        .args(flags)
        .arg("-o")
        .arg(&lib)
        .arg(dir.join(main))
        .output()
        .map_err(|e| format!("{cxx}: {e}"))?;
    let log = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("{cxx} rejected the kernel source:\n{log}"));
    }
    if !log.trim().is_empty() {
        println!("{cxx} warned about the kernel source:\n{log}");
    }
    // SAFETY: a library built just now from the caller's source, whose
    // initializers only set that source's statics.
    let loaded = unsafe { libloading::Library::new(&lib) }.map_err(|e| format!("loading {}: {e}", lib.display()));
    let _ = std::fs::remove_dir_all(&dir);
    Ok(HostLibrary { lib: loaded? })
}

impl HostLibrary {
    /// The symbol `name` as a value of type `F` (a function pointer);
    /// panics, naming it, when the library has no such symbol.
    ///
    /// # Safety
    /// `F` must be the symbol's type in the source (an `extern "C"`
    /// function's signature).
    pub unsafe fn get<F: Copy>(&self, name: &str) -> F {
        // SAFETY: the caller's contract.
        unsafe { *self.lib.get::<F>(name.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e}")) }
    }
}
