//! The cuda device's kernels: the shared source ([`crate::gpu_kernels`])
//! compiled at run time by NVRTC (once per compute capability per process,
//! loaded once per device), with multiply-add contraction off (`--fmad=false`)
//! and NVRTC's default IEEE division and square root, as the cpu device
//! computes. Matmul is cuBLAS's (`blas.rs`), not the source's tiled kernel.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::result as drv;
use cudarc::driver::sys::{CUfunction, CUmodule, CUstream};
use cudarc::nvrtc::result as nvrtc;

use super::result::{self as res, DriverResult};
use crate::gpu_kernels::{blocks_for, BLOCK, NAMES, SOURCE};
pub(crate) use crate::gpu_kernels::{code, Args, REDUCE_BLOCK};
use crate::DeviceError;

/// PTX by compute capability.
type PtxCache = Mutex<HashMap<(i32, i32), Arc<CString>>>;

/// PTX per compute capability, shared by every device of this process.
fn ptx_cache() -> &'static PtxCache {
    static CACHE: OnceLock<PtxCache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

fn compile(arch: &str) -> Result<CString, DeviceError> {
    let src = CString::new(SOURCE).map_err(|_| DeviceError::invalid("nvrtc", "kernel source contains NUL"))?;
    let prog =
        nvrtc::create_program(&src, Some(c"chorus_kernels.cu")).map_err(|e| res::nvrtc("nvrtcCreateProgram", e, ""))?;
    let options = [format!("--gpu-architecture={arch}"), "--fmad=false".to_string(), "--std=c++14".to_string()];
    // SAFETY: `prog` was created above and is destroyed once, below.
    let compiled = unsafe { nvrtc::compile_program(prog, &options) };
    let result = match compiled {
        Ok(()) => {
            // SAFETY: compiled program.
            unsafe { nvrtc::get_ptx(prog) }.map_err(|e| res::nvrtc("nvrtcGetPTX", e, "")).and_then(|ptx| {
                let bytes: Vec<u8> = ptx.iter().map(|c| *c as u8).take_while(|b| *b != 0).collect();
                CString::new(bytes).map_err(|_| DeviceError::invalid("nvrtc", "PTX contains NUL"))
            })
        }
        Err(e) => {
            // SAFETY: the program exists; the log explains the failure.
            let log = unsafe { nvrtc::get_program_log(prog) }
                .map(|l| l.iter().map(|c| *c as u8 as char).take_while(|c| *c != '\0').collect::<String>())
                .unwrap_or_default();
            Err(res::nvrtc("nvrtcCompileProgram", e, &log))
        }
    };
    // SAFETY: destroyed once.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result
}

/// PTX for compute capability `cc`: compiled for that architecture, or for
/// `compute_52` (JIT-compiled by the driver) when this NVRTC predates the GPU.
pub(crate) fn ptx_for(cc: (i32, i32)) -> Result<Arc<CString>, DeviceError> {
    let cache = ptx_cache();
    if let Some(p) = cache.lock().ok().and_then(|c| c.get(&cc).cloned()) {
        return Ok(p);
    }
    super::loader::nvrtc_library()?;
    let ptx = super::loader::guarded("libnvrtc", || {
        compile(&format!("compute_{}{}", cc.0, cc.1)).or_else(|first| compile("compute_52").map_err(|_| first))
    })?;
    let ptx = Arc::new(ptx);
    if let Ok(mut c) = cache.lock() {
        c.insert(cc, ptx.clone());
    }
    Ok(ptx)
}

/// The kernels loaded into one device's context.
#[derive(Debug)]
pub(crate) struct Kernels {
    module: CUmodule,
    functions: HashMap<&'static str, CUfunction>,
}

// SAFETY: module and function handles are plain driver handles, valid from
// any thread while the context lives (the device owns both).
unsafe impl Send for Kernels {}
unsafe impl Sync for Kernels {}

impl Kernels {
    /// Loads the PTX into the current context (the caller binds the device).
    pub(crate) fn load(ptx: &CString, device: &str) -> Result<Kernels, DeviceError> {
        // SAFETY: a NUL-terminated PTX image; the context is current.
        let module =
            unsafe { drv::module::load_data(ptx.as_ptr() as *const c_void) }.drv("cuModuleLoadData", device)?;
        let mut functions = HashMap::new();
        for name in NAMES {
            let cname = CString::new(*name).map_err(|_| DeviceError::invalid("kernels", "bad kernel name"))?;
            // SAFETY: the module was loaded above.
            match unsafe { drv::module::get_function(module, cname) } {
                Ok(f) => {
                    // Loaded now rather than at its first launch (see
                    // `CudaDevice::with_config`). `cuFuncLoad` is CUDA 12.4+;
                    // an older driver has no lazy loading to undo, so a
                    // missing entry point (cudarc panics) is not an error.
                    // SAFETY: a function of the module just loaded.
                    let loaded =
                        super::loader::guarded("libcuda", || Ok(unsafe { cudarc::driver::sys::cuFuncLoad(f) }));
                    if let Ok(r) = loaded {
                        if let Err(e) = r.result() {
                            // SAFETY: unloaded once, on this failure path.
                            let _ = unsafe { drv::module::unload(module) };
                            return Err(res::driver("cuFuncLoad", e, device, 0));
                        }
                    }
                    functions.insert(*name, f);
                }
                Err(e) => {
                    // SAFETY: unloaded once, on this failure path.
                    let _ = unsafe { drv::module::unload(module) };
                    return Err(res::driver("cuModuleGetFunction", e, device, 0));
                }
            }
        }
        Ok(Kernels { module, functions })
    }

    fn function(&self, name: &'static str) -> Result<CUfunction, DeviceError> {
        self.functions.get(name).copied().ok_or_else(|| DeviceError::invalid("kernels", format!("no kernel {name}")))
    }

    /// Launches `name` over `threads` elements (grid-stride; the grid is capped).
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in [`SOURCE`], and every
    /// device pointer among them must be valid for the launch's accesses in
    /// `stream`'s order.
    pub(crate) unsafe fn launch(
        &self,
        name: &'static str,
        threads: u64,
        stream: CUstream,
        args: Args,
        device: &str,
    ) -> Result<(), DeviceError> {
        let blocks = blocks_for(threads);
        // SAFETY: per the caller's contract.
        unsafe { self.launch_grid(name, blocks, BLOCK, stream, args, device) }
    }

    /// Launches `name` with an explicit grid.
    ///
    /// # Safety
    /// As [`Kernels::launch`].
    pub(crate) unsafe fn launch_grid(
        &self,
        name: &'static str,
        blocks: u32,
        threads: u32,
        stream: CUstream,
        mut args: Args,
        device: &str,
    ) -> Result<(), DeviceError> {
        let f = self.function(name)?;
        let mut params = args.pointers();
        // SAFETY: per the caller's contract; the slots outlive the call (the driver copies the values).
        unsafe { drv::launch_kernel(f, (blocks, 1, 1), (threads, 1, 1), 0, stream, &mut params) }
            .drv("cuLaunchKernel", device)
    }

    /// Launches `name`, whose one parameter is a struct passed by value, with
    /// `block` as that struct's words (the batch kernels; see
    /// [`crate::gpu_batch`]), on a `(grid.0, grid.1)` grid of [`BLOCK`] threads.
    ///
    /// # Safety
    /// `block` must be the kernel's whole parameter as [`SOURCE`] declares
    /// it, and every device range it names valid for the launch's accesses
    /// in `stream`'s order.
    pub(crate) unsafe fn launch_block(
        &self,
        name: &'static str,
        grid: (u32, u32),
        stream: CUstream,
        block: &mut [u64],
        device: &str,
    ) -> Result<(), DeviceError> {
        let f = self.function(name)?;
        let mut params = [block.as_mut_ptr() as *mut c_void];
        // SAFETY: per the caller's contract; the driver copies the parameter at the launch.
        unsafe { drv::launch_kernel(f, (grid.0, grid.1, 1), (BLOCK, 1, 1), 0, stream, &mut params) }
            .drv("cuLaunchKernel", device)
    }

    /// Unloads the module (the context must be current).
    pub(crate) fn unload(&self) -> Result<(), DeviceError> {
        // SAFETY: the module is unloaded once, by the device's drop.
        unsafe { drv::module::unload(self.module) }.drv("cuModuleUnload", "")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC runs without a GPU: where it is installed (CI points
    /// `CHORUS_NVRTC_LIB` at pip's copy), the shared kernel source must
    /// compile for every architecture we target and define every kernel.
    #[test]
    #[ignore = "needs NVRTC (ci/vendor-libs.sh sets CHORUS_NVRTC_LIB); ci/test.sh runs it with --include-ignored"]
    fn the_kernel_source_compiles_with_nvrtc() {
        if let Err(e) = crate::cuda::nvrtc_library() {
            panic!("NVRTC unavailable: {e} (ci/vendor-libs.sh installs it and sets CHORUS_NVRTC_LIB)");
        }
        for arch in ["compute_70", "compute_80", "compute_90"] {
            let ptx = compile(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
            let text = ptx.to_string_lossy();
            for name in NAMES {
                assert!(text.contains(&format!(".entry {name}(")), "{arch}: {name} missing");
            }
        }
    }
}
