//! The hip device's kernels: the shared source ([`crate::gpu_kernels`])
//! compiled at run time with hipRTC, once per device, the first time one of
//! its streams launches a kernel.
//!
//! The whole source is one module (`hipModuleLoadData`), and each kernel is
//! looked up by its name in [`NAMES`]; the dtypes are arguments, as on the
//! cuda device. The compiler runs with `-ffp-contract=off`, so no
//! multiply-add is fused that the cpu device computes with two roundings.
//! The architecture is the device's unless [`HipConfig::arch`] names one.
//!
//! Matmul is the source's 16×16 shared-memory tiled kernel (f32 accumulation,
//! f64 for f64), not a call into hipBLAS/rocBLAS: one more run-time library
//! with its own handles and enums was not worth it for the sizes chorus' own
//! models use, and it keeps every kernel in one compiler and one rounding model.
//!
//! [`HipConfig::arch`]: super::HipConfig::arch

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::result;
use super::sys::{hipFunction_t, hipModule_t, hipStream_t};
pub(crate) use crate::gpu_kernels::Args;
pub use crate::gpu_kernels::{NAMES, SOURCE};
use crate::DeviceError;

/// Flags every compile uses, before the architecture.
pub const COMPILE_OPTIONS: [&str; 3] = ["-O3", "-ffp-contract=off", "-std=c++17"];

/// The compiler options for `arch` (`None`: hipRTC picks the current device's).
pub fn compile_options(arch: Option<&str>) -> Vec<String> {
    let mut o: Vec<String> = COMPILE_OPTIONS.iter().map(|s| s.to_string()).collect();
    if let Some(a) = arch {
        o.push(format!("--offload-arch={a}"));
    }
    o
}

/// Compiles the shared source for `arch` (`None`: the current device's) and
/// returns the code object. Needs hipRTC, not a GPU, when `arch` is given.
pub fn compile(arch: Option<&str>) -> Result<Vec<u8>, DeviceError> {
    result::rtc_compile(SOURCE, "chorus_kernels.hip", &compile_options(arch))
}

/// The kernels loaded on one device: the module and its functions by name.
#[derive(Debug)]
pub(crate) struct Kernels {
    module: hipModule_t,
    functions: HashMap<&'static str, hipFunction_t>,
}

// SAFETY: module and function handles are plain identifiers that the HIP
// runtime allows to be used from any thread.
unsafe impl Send for Kernels {}
unsafe impl Sync for Kernels {}

impl Kernels {
    /// Compiles the source and loads it on the current device (the caller
    /// has made the device current).
    fn load(arch: Option<&str>) -> Result<Kernels, DeviceError> {
        let image = compile(arch)?;
        let module = result::module_load(&image)?;
        let mut functions = HashMap::with_capacity(NAMES.len());
        for name in NAMES {
            // SAFETY: the module was just loaded.
            match unsafe { result::module_get_function(module, name) } {
                Ok(f) => {
                    functions.insert(*name, f);
                }
                Err(e) => {
                    // SAFETY: loaded above, nothing launched from it.
                    let _ = unsafe { result::module_unload(module) };
                    return Err(e);
                }
            }
        }
        Ok(Kernels { module, functions })
    }

    fn function(&self, name: &'static str) -> Result<hipFunction_t, DeviceError> {
        self.functions.get(name).copied().ok_or_else(|| DeviceError::invalid("hip kernel", format!("no kernel {name}")))
    }

    pub(crate) fn unload(&self) -> Result<(), DeviceError> {
        // SAFETY: called once, when the device is dropped and no stream of it remains.
        unsafe { result::module_unload(self.module) }
    }
}

/// A device's kernels, compiled and loaded on first use. A failed compile is
/// not kept: the next launch tries again.
#[derive(Debug, Default)]
pub(crate) struct KernelCache {
    loaded: Mutex<Option<Arc<Kernels>>>,
}

impl KernelCache {
    /// The device's kernels, compiling and loading them on first use. The
    /// caller has made the device current.
    pub(crate) fn get(&self, arch: Option<&str>) -> Result<Arc<Kernels>, DeviceError> {
        let mut slot = self.loaded.lock().map_err(|_| DeviceError::invalid("hip kernel", "kernel cache poisoned"))?;
        if let Some(k) = slot.as_ref() {
            return Ok(k.clone());
        }
        let loaded = Arc::new(Kernels::load(arch)?);
        *slot = Some(loaded.clone());
        Ok(loaded)
    }

    /// The loaded kernels, emptying the cache (for unloading).
    pub(crate) fn take(&self) -> Option<Arc<Kernels>> {
        self.loaded.lock().ok().and_then(|mut slot| slot.take())
    }
}

/// Launches kernel `name` of `kernels` on `stream` with a `grid` of `block`s.
///
/// # Safety
/// `args` match the kernel's parameters in [`SOURCE`]; the memory they point
/// to stays valid until the kernel has run in the stream's order; the stream
/// is of the device the kernels were loaded on.
pub(crate) unsafe fn launch(
    kernels: &Kernels,
    name: &'static str,
    stream: hipStream_t,
    grid: (u32, u32),
    block: (u32, u32),
    mut args: Args,
) -> Result<(), DeviceError> {
    let function = kernels.function(name)?;
    let mut params = args.pointers();
    // SAFETY: per the caller's contract; the slots outlive the call (HIP copies the values).
    unsafe { result::launch_kernel(function, grid, block, 0, stream, &mut params) }
}
