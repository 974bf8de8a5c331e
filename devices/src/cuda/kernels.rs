//! The elementwise and reduction kernels of the cuda device, compiled at run
//! time by NVRTC (once per compute capability per process, loaded once per
//! device).
//!
//! One kernel per operation, with the dtypes passed as codes: the switch on
//! a code is uniform across a launch (no divergence) and these kernels are
//! bound by memory bandwidth, so one kernel beats 64 instantiations. The
//! arithmetic mirrors the cpu device bit for bit where IEEE allows: f16/bf16
//! compute in f32 and round once, f64 in f64, no FMA contraction
//! (`--fmad=false`), IEEE division and square root. Narrowing from f64 to
//! f16/bf16 rounds to odd into f32 first, so the final rounding is a single
//! round-to-nearest-even of the exact value, as on the host. The two
//! reductions (`mse_loss`, `sum_squares`) sum in f64 in one block, which is
//! deterministic (the order differs from the host's, so the last bits may).

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::result as drv;
use cudarc::driver::sys::{CUfunction, CUmodule, CUstream};
use cudarc::nvrtc::result as nvrtc;

use super::result::{self as res, DriverResult};
use crate::{DType, DeviceError};

/// Threads per block of the elementwise kernels.
pub(crate) const BLOCK: u32 = 256;
/// Threads of the single-block reductions.
pub(crate) const REDUCE_BLOCK: u32 = 1024;

/// The dtype codes the kernels switch on.
pub(crate) fn code(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        DType::I32 => 4,
        DType::I64 => 5,
        DType::I8 => 6,
        DType::U8 => 7,
    }
}

/// Every kernel the source defines.
pub(crate) const NAMES: &[&str] = &[
    "chorus_fill_u64",
    "chorus_cast",
    "chorus_scale",
    "chorus_accumulate",
    "chorus_accumulate_int",
    "chorus_axpy",
    "chorus_bias_add",
    "chorus_relu",
    "chorus_relu_backward",
    "chorus_mse_grad",
    "chorus_mse_loss",
    "chorus_column_sums",
    "chorus_sum_squares",
    "chorus_sgd",
    "chorus_adamw",
];

pub(crate) const SOURCE: &str = r#"
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define T_F32 0
#define T_F64 1
#define T_F16 2
#define T_BF16 3

#define GRID_STRIDE(i, n) for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)blockDim.x * gridDim.x)

__device__ __forceinline__ float h2f(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ u16 f2h(float f) { u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float b2f(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ u16 f2b(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}
// f64 -> f32 rounded to odd: a later rounding to a type of at most 22
// significand bits is then the correctly rounded value of the f64.
__device__ __forceinline__ float d2f_odd(double d) {
    float f = __double2float_rz(d);
    if (d == d && (double)f != d) f = __uint_as_float(__float_as_uint(f) | 1u);
    return f;
}

// Load as the f32 opmath value (f64 sources round to nearest).
__device__ __forceinline__ float ldf(const void* p, int t, u64 i) {
    switch (t) {
        case T_F32: return ((const float*)p)[i];
        case T_F64: return (float)((const double*)p)[i];
        case T_F16: return h2f(((const u16*)p)[i]);
        default: return b2f(((const u16*)p)[i]);
    }
}
// Load exactly, widened to f64.
__device__ __forceinline__ double ldd(const void* p, int t, u64 i) {
    switch (t) {
        case T_F32: return (double)((const float*)p)[i];
        case T_F64: return ((const double*)p)[i];
        case T_F16: return (double)h2f(((const u16*)p)[i]);
        default: return (double)b2f(((const u16*)p)[i]);
    }
}
// Store an f32 opmath value, rounding once.
__device__ __forceinline__ void stf(void* p, int t, u64 i, float v) {
    switch (t) {
        case T_F32: ((float*)p)[i] = v; break;
        case T_F64: ((double*)p)[i] = (double)v; break;
        case T_F16: ((u16*)p)[i] = f2h(v); break;
        default: ((u16*)p)[i] = f2b(v); break;
    }
}
// Store an f64 value, rounding once.
__device__ __forceinline__ void std_(void* p, int t, u64 i, double v) {
    switch (t) {
        case T_F32: ((float*)p)[i] = __double2float_rn(v); break;
        case T_F64: ((double*)p)[i] = v; break;
        case T_F16: ((u16*)p)[i] = f2h(d2f_odd(v)); break;
        default: ((u16*)p)[i] = f2b(d2f_odd(v)); break;
    }
}
__device__ __forceinline__ void copy_elem(void* dst, const void* src, int t, u64 i) {
    switch (t) {
        case T_F32: ((float*)dst)[i] = ((const float*)src)[i]; break;
        case T_F64: ((double*)dst)[i] = ((const double*)src)[i]; break;
        default: ((u16*)dst)[i] = ((const u16*)src)[i]; break;
    }
}
__device__ __forceinline__ void zero_elem(void* dst, int t, u64 i) {
    switch (t) {
        case T_F32: ((float*)dst)[i] = 0.0f; break;
        case T_F64: ((double*)dst)[i] = 0.0; break;
        default: ((u16*)dst)[i] = 0; break;
    }
}

extern "C" __global__ void chorus_fill_u64(u64* dst, u64 n, u64 pattern) {
    GRID_STRIDE(i, n) dst[i] = pattern;
}

extern "C" __global__ void chorus_cast(const void* src, int st, void* dst, int dt, u64 n) {
    GRID_STRIDE(i, n) std_(dst, dt, i, ldd(src, st, i));
}

extern "C" __global__ void chorus_scale(void* x, int t, u64 n, double alpha) {
    if (t == T_F64) {
        GRID_STRIDE(i, n) ((double*)x)[i] = ((double*)x)[i] * alpha;
    } else {
        float a = (float)alpha;
        GRID_STRIDE(i, n) stf(x, t, i, ldf(x, t, i) * a);
    }
}

extern "C" __global__ void chorus_accumulate(const void* src, int st, void* dst, int dt, u64 n) {
    if (dt == T_F64) {
        GRID_STRIDE(i, n) ((double*)dst)[i] = ((double*)dst)[i] + ldd(src, st, i);
    } else {
        GRID_STRIDE(i, n) stf(dst, dt, i, ldf(dst, dt, i) + ldf(src, st, i));
    }
}

// Integer dtypes wrap, as NCCL and the host do: add as unsigned.
extern "C" __global__ void chorus_accumulate_int(const void* src, void* dst, int t, u64 n) {
    switch (t) {
        case 4: { GRID_STRIDE(i, n) ((u32*)dst)[i] = ((u32*)dst)[i] + ((const u32*)src)[i]; break; }
        case 5: { GRID_STRIDE(i, n) ((u64*)dst)[i] = ((u64*)dst)[i] + ((const u64*)src)[i]; break; }
        default: { GRID_STRIDE(i, n) ((u8*)dst)[i] = (u8)(((u8*)dst)[i] + ((const u8*)src)[i]); break; }
    }
}

extern "C" __global__ void chorus_axpy(double alpha, const void* x, int xt, void* y, int yt, u64 n) {
    if (yt == T_F64) {
        GRID_STRIDE(i, n) ((double*)y)[i] = ((double*)y)[i] + alpha * ldd(x, xt, i);
    } else {
        float a = (float)alpha;
        GRID_STRIDE(i, n) stf(y, yt, i, ldf(y, yt, i) + a * ldf(x, xt, i));
    }
}

extern "C" __global__ void chorus_bias_add(void* x, int xt, const void* bias, int bt, u64 n, u64 cols) {
    if (xt == T_F64) {
        GRID_STRIDE(i, n) ((double*)x)[i] = ((double*)x)[i] + ldd(bias, bt, i % cols);
    } else {
        GRID_STRIDE(i, n) stf(x, xt, i, ldf(x, xt, i) + ldf(bias, bt, i % cols));
    }
}

extern "C" __global__ void chorus_relu(const void* x, void* y, int t, u64 n) {
    GRID_STRIDE(i, n) {
        if (ldd(x, t, i) <= 0.0) zero_elem(y, t, i); else copy_elem(y, x, t, i);  /* NaN propagates, as in PyTorch */
    }
}

extern "C" __global__ void chorus_relu_backward(const void* grad_out, const void* out, void* grad_in, int t, u64 n) {
    GRID_STRIDE(i, n) {
        if (ldd(out, t, i) <= 0.0) zero_elem(grad_in, t, i); else copy_elem(grad_in, grad_out, t, i);
    }
}

extern "C" __global__ void chorus_mse_grad(const void* p, int pt, const void* q, int qt, void* g, int gt, u64 n, double scale) {
    if (gt == T_F64) {
        double s = 2.0 * scale;
        GRID_STRIDE(i, n) ((double*)g)[i] = s * (ldd(p, pt, i) - ldd(q, qt, i));
    } else {
        float s = (float)(2.0 * scale);
        GRID_STRIDE(i, n) stf(g, gt, i, s * (ldf(p, pt, i) - ldf(q, qt, i)));
    }
}

// One block: a deterministic f64 sum.
__device__ double block_sum(double v) {
    __shared__ double part[1024];
    part[threadIdx.x] = v;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    return part[0];
}

extern "C" __global__ void chorus_mse_loss(const void* p, int pt, const void* q, int qt, void* loss, int lt, u64 n, double scale) {
    double acc = 0.0;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) {
        double d = ldd(p, pt, i) - ldd(q, qt, i);
        acc += d * d;
    }
    double total = block_sum(acc);
    if (threadIdx.x == 0) std_(loss, lt, 0, total * scale);
}

extern "C" __global__ void chorus_sum_squares(const void* x, int xt, void* out, int ot, u64 n, int accumulate) {
    double acc = 0.0;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) {
        double v = ldd(x, xt, i);
        acc += v * v;
    }
    double total = block_sum(acc);
    if (threadIdx.x == 0) std_(out, ot, 0, accumulate ? ldd(out, ot, 0) + total : total);
}

extern "C" __global__ void chorus_column_sums(const void* x, int xt, void* out, int ot, u64 rows, u64 cols, int accumulate) {
    GRID_STRIDE(c, cols) {
        if (ot == T_F64) {
            double acc = 0.0;
            for (u64 r = 0; r < rows; r++) acc = acc + ldd(x, xt, r * cols + c);
            ((double*)out)[c] = accumulate ? ((double*)out)[c] + acc : acc;
        } else {
            float acc = 0.0f;
            for (u64 r = 0; r < rows; r++) acc = acc + ldf(x, xt, r * cols + c);
            stf(out, ot, c, accumulate ? ldf(out, ot, c) + acc : acc);
        }
    }
}

// torch.optim.SGD's single-tensor update in f32.
extern "C" __global__ void chorus_sgd(float* w, const float* g, float* buf, u64 n, float lr, float wd, float mom,
                                      float damp, int has_wd, int use_momentum, int first_step, int nesterov) {
    GRID_STRIDE(i, n) {
        float d = has_wd ? g[i] + wd * w[i] : g[i];
        if (use_momentum) {
            float b = first_step ? d : buf[i] * mom + damp * d;
            buf[i] = b;
            float step = nesterov ? d + mom * b : b;
            w[i] = w[i] + -lr * step;
        } else {
            w[i] = w[i] + -lr * d;
        }
    }
}

// torch.optim.AdamW's single-tensor update in f32 (scalars from the host in f64, as Python computes them).
extern "C" __global__ void chorus_adamw(float* w, const float* g, float* m, float* v, u64 n, float decay,
                                        float one_minus_b1, float b2, float one_minus_b2, float bc2_sqrt,
                                        float step_size, float eps) {
    GRID_STRIDE(i, n) {
        float wi = w[i] * decay;
        float gi = g[i];
        float mi = m[i] + one_minus_b1 * (gi - m[i]);
        float vi = v[i] * b2 + one_minus_b2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        w[i] = wi + -step_size * (mi / denom);
    }
}
"#;

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
    /// `args` must point to values of exactly the kernel's parameter types,
    /// and every device pointer among them must be valid for the launch's
    /// accesses in `stream`'s order.
    pub(crate) unsafe fn launch(
        &self,
        name: &'static str,
        threads: u64,
        stream: CUstream,
        args: &mut [*mut c_void],
        device: &str,
    ) -> Result<(), DeviceError> {
        let blocks = threads.div_ceil(BLOCK as u64).clamp(1, 65_535) as u32;
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
        args: &mut [*mut c_void],
        device: &str,
    ) -> Result<(), DeviceError> {
        let f = self.function(name)?;
        // SAFETY: per the caller's contract.
        unsafe { drv::launch_kernel(f, (blocks, 1, 1), (threads, 1, 1), 0, stream, args) }.drv("cuLaunchKernel", device)
    }

    /// Unloads the module (the context must be current).
    pub(crate) fn unload(&self) -> Result<(), DeviceError> {
        // SAFETY: the module is unloaded once, by the device's drop.
        unsafe { drv::module::unload(self.module) }.drv("cuModuleUnload", "")
    }
}

/// Raw pointer to a kernel argument.
pub(crate) fn arg<T>(v: &mut T) -> *mut c_void {
    v as *mut T as *mut c_void
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC runs without a GPU: where it is installed (CI points
    /// `CHORUS_NVRTC_LIB` at pip's copy), the kernel source must compile for
    /// every architecture we target and define every kernel.
    #[test]
    fn the_kernel_source_compiles_with_nvrtc() {
        if let Err(e) = crate::cuda::nvrtc_library() {
            eprintln!("skipped: NVRTC unavailable: {e}");
            return;
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
