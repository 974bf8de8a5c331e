//! The hip device's compute kernels: HIP C++ compiled at run time with hipRTC.
//!
//! Every kernel is a template in [`PRELUDE`] instantiated for one dtype
//! combination by a small `extern "C"` wrapper whose name says the
//! combination (`chorus_cast_f32_bf16`). A stream compiles a wrapper the
//! first time it needs it ([`Kernel::source`] → hipRTC → code object →
//! `hipModuleLoadData`) and the device caches the loaded function, so a
//! process pays for the instances it uses, once per device.
//!
//! Arithmetic follows the cpu device exactly where it can: f16/bf16 compute
//! in f32 and round once (round-to-nearest-even; f64 sources go through
//! round-to-odd f32 first, so they round once too), f64 in f64, integers
//! wrap. The compiler runs with `-ffp-contract=off` so no multiply-add is
//! fused that the cpu device computes in two roundings. Reductions (the MSE
//! loss, sums of squares) add in f64 in a tree, not left to right, so they
//! can differ from the cpu device in the last bits of an f64.
//!
//! `matmul` is a 16×16 shared-memory tiled kernel accumulating in f32 (f64
//! for f64), not a call into hipBLAS/rocBLAS: one more run-time library with
//! its own handles and enums was not worth it for the sizes chorus' own
//! models use, and it keeps every kernel in one compiler and one rounding model.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use super::result;
use super::sys::{hipFunction_t, hipModule_t, hipStream_t};
use crate::{DType, DeviceError};

/// Threads per block of every 1-D kernel (the reductions rely on it).
pub const BLOCK: u32 = 256;
/// Side of the matmul tile.
pub const TILE: u32 = 16;
/// Most blocks a grid-stride kernel is launched with.
const MAX_BLOCKS: u64 = 65_535;

/// Flags every compile uses, before the architecture.
pub const COMPILE_OPTIONS: [&str; 3] = ["-O3", "-ffp-contract=off", "-std=c++17"];

/// The templates every kernel instance is built from.
pub const PRELUDE: &str = r#"
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define CHORUS_LOOP(i, n) \
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)blockDim.x * gridDim.x)

// f64 -> f32 rounded to odd: rounding that to a narrower format rounds the f64 once.
__device__ inline float chorus_odd_f32(double v) {
  float nearest = (float)v;
  if (nearest != nearest || (double)nearest == v) return nearest;
  u32 bits = __float_as_uint(nearest);
  if (fabs((double)nearest) > fabs(v)) bits -= 1u;
  return __uint_as_float(bits | 1u);
}

__device__ inline u16 chorus_bf16_rne(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (u16)(u >> 16);
}

// S: storage type; M: the type arithmetic is done in ("opmath").
struct F32 {
  typedef float S; typedef float M;
  __device__ static M up(S v) { return v; }
  __device__ static S down(M v) { return v; }
  __device__ static double wide(S v) { return (double)v; }
  __device__ static S narrow(double v) { return (float)v; }
};
struct F64 {
  typedef double S; typedef double M;
  __device__ static M up(S v) { return v; }
  __device__ static S down(M v) { return v; }
  __device__ static double wide(S v) { return v; }
  __device__ static S narrow(double v) { return v; }
};
struct F16 {
  typedef u16 S; typedef float M;
  __device__ static M up(S v) { return (float)__builtin_bit_cast(_Float16, v); }
  __device__ static S down(M v) { return __builtin_bit_cast(u16, (_Float16)v); }
  __device__ static double wide(S v) { return (double)up(v); }
  __device__ static S narrow(double v) { return down(chorus_odd_f32(v)); }
};
struct BF16 {
  typedef u16 S; typedef float M;
  __device__ static M up(S v) { return __uint_as_float(((u32)v) << 16); }
  __device__ static S down(M v) { return chorus_bf16_rne(v); }
  __device__ static double wide(S v) { return (double)up(v); }
  __device__ static S narrow(double v) { return down(chorus_odd_f32(v)); }
};

template <class S, class D>
__device__ void k_cast(const void* src, void* dst, u64 n) {
  const typename S::S* s = (const typename S::S*)src; typename D::S* d = (typename D::S*)dst;
  CHORUS_LOOP(i, n) d[i] = D::narrow(S::wide(s[i]));
}

template <class T>
__device__ void k_scale(void* x, u64 n, double alpha) {
  typename T::S* v = (typename T::S*)x; typename T::M a = (typename T::M)alpha;
  CHORUS_LOOP(i, n) v[i] = T::down(T::up(v[i]) * a);
}

template <class S, class D>
__device__ void k_accumulate(const void* src, void* dst, u64 n) {
  const typename S::S* s = (const typename S::S*)src; typename D::S* d = (typename D::S*)dst;
  CHORUS_LOOP(i, n) d[i] = D::down(D::up(d[i]) + (typename D::M)S::wide(s[i]));
}

// Integers wrap: add as the unsigned type of the same width.
template <class I, class U>
__device__ void k_accumulate_int(const void* src, void* dst, u64 n) {
  const I* s = (const I*)src; I* d = (I*)dst;
  CHORUS_LOOP(i, n) d[i] = (I)((U)d[i] + (U)s[i]);
}

template <class S, class D>
__device__ void k_axpy(double alpha, const void* x, void* y, u64 n) {
  const typename S::S* xs = (const typename S::S*)x; typename D::S* ys = (typename D::S*)y;
  typename D::M a = (typename D::M)alpha;
  CHORUS_LOOP(i, n) ys[i] = D::down(D::up(ys[i]) + a * (typename D::M)S::wide(xs[i]));
}

template <class W>
__device__ void k_fill(void* dst, u64 n, u64 pattern) {
  W* d = (W*)dst; W p = (W)pattern;
  CHORUS_LOOP(i, n) d[i] = p;
}

template <class X, class B>
__device__ void k_bias_add(void* x, const void* bias, u64 n, u64 cols) {
  typename X::S* xs = (typename X::S*)x; const typename B::S* bs = (const typename B::S*)bias;
  CHORUS_LOOP(i, n) xs[i] = X::down(X::up(xs[i]) + (typename X::M)B::wide(bs[i % cols]));
}

template <class T>
__device__ void k_relu(const void* x, void* y, u64 n) {
  const typename T::S* xs = (const typename T::S*)x; typename T::S* ys = (typename T::S*)y;
  typename T::M zero = (typename T::M)0;
  CHORUS_LOOP(i, n) { typename T::S v = xs[i]; ys[i] = T::up(v) <= zero ? T::down(zero) : v; }  /* NaN propagates, as in PyTorch */
}

template <class T>
__device__ void k_relu_backward(const void* grad_out, const void* out, void* grad_in, u64 n) {
  const typename T::S* g = (const typename T::S*)grad_out; const typename T::S* o = (const typename T::S*)out;
  typename T::S* gi = (typename T::S*)grad_in; typename T::M zero = (typename T::M)0;
  CHORUS_LOOP(i, n) { typename T::S v = g[i]; gi[i] = T::up(o[i]) <= zero ? T::down(zero) : v; }
}

template <class P, class T, class G>
__device__ void k_mse_grad(const void* pred, const void* target, void* grad, u64 n, double scale) {
  const typename P::S* p = (const typename P::S*)pred; const typename T::S* t = (const typename T::S*)target;
  typename G::S* g = (typename G::S*)grad; typename G::M s = (typename G::M)(2.0 * scale);
  CHORUS_LOOP(i, n) g[i] = G::down(s * ((typename G::M)P::wide(p[i]) - (typename G::M)T::wide(t[i])));
}

// Sum over one block of exactly 256 threads.
__device__ inline double chorus_block_sum(double v) {
  __shared__ double partial[256];
  partial[threadIdx.x] = v;
  __syncthreads();
  for (u32 s = 128; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  return partial[0];
}

template <class P, class T, class L>
__device__ void k_mse_loss(const void* pred, const void* target, void* loss, u64 n, double scale) {
  const typename P::S* p = (const typename P::S*)pred; const typename T::S* t = (const typename T::S*)target;
  double acc = 0.0;
  for (u64 i = threadIdx.x; i < n; i += blockDim.x) { double d = P::wide(p[i]) - T::wide(t[i]); acc += d * d; }
  double s = chorus_block_sum(acc);
  if (threadIdx.x == 0) ((typename L::S*)loss)[0] = L::narrow(s * scale);
}

template <class X, class O>
__device__ void k_sum_squares(const void* x, void* out, u64 n, int accumulate) {
  const typename X::S* xs = (const typename X::S*)x;
  double acc = 0.0;
  for (u64 i = threadIdx.x; i < n; i += blockDim.x) { double v = X::wide(xs[i]); acc += v * v; }
  double s = chorus_block_sum(acc);
  if (threadIdx.x == 0) {
    typename O::S* o = (typename O::S*)out;
    o[0] = O::narrow(accumulate ? O::wide(o[0]) + s : s);
  }
}

template <class X, class O>
__device__ void k_column_sums(const void* x, void* out, u64 rows, u64 cols, int accumulate) {
  const typename X::S* xs = (const typename X::S*)x; typename O::S* o = (typename O::S*)out;
  CHORUS_LOOP(c, cols) {
    typename O::M acc = (typename O::M)0;
    for (u64 r = 0; r < rows; ++r) acc = acc + (typename O::M)X::wide(xs[r * cols + c]);
    o[c] = O::down(accumulate ? O::up(o[c]) + acc : acc);
  }
}

// flags: 1 weight decay, 2 momentum buffer, 4 first step, 8 nesterov.
__device__ void k_sgd(float* w, const float* g, float* buf, u64 n, float lr, float wd, float mom, float damp, int flags) {
  CHORUS_LOOP(i, n) {
    float wi = w[i]; float gi = g[i];
    float d = (flags & 1) ? gi + wd * wi : gi;
    if (flags & 2) {
      float b = (flags & 4) ? d : buf[i] * mom + damp * d;
      buf[i] = b;
      float step = (flags & 8) ? d + mom * b : b;
      wi += -lr * step;
    } else {
      wi += -lr * d;
    }
    w[i] = wi;
  }
}

__device__ void k_adamw(float* w, const float* g, float* m, float* v, u64 n, float decay, float one_minus_b1,
                        float b2, float one_minus_b2, float bc2_sqrt, float step_size, float eps) {
  CHORUS_LOOP(i, n) {
    float wi = w[i] * decay; float gi = g[i]; float mi = m[i];
    mi += one_minus_b1 * (gi - mi);
    float vi = v[i] * b2 + one_minus_b2 * gi * gi;
    float denom = sqrtf(vi) / bc2_sqrt + eps;
    wi += -step_size * (mi / denom);
    w[i] = wi; m[i] = mi; v[i] = vi;
  }
}

// C[m x n] (+)= op(A)[m x k] op(B)[k x n], row-major, 16x16 tiles, accumulating in T's opmath.
template <class T, class C>
__device__ void k_matmul(const void* a, const void* b, void* c, u64 m, u64 n, u64 k, int trans_a, int trans_b,
                         int accumulate) {
  typedef typename T::M A;
  const typename T::S* as = (const typename T::S*)a; const typename T::S* bs = (const typename T::S*)b;
  typename C::S* cs = (typename C::S*)c;
  __shared__ A ta[16][17];
  __shared__ A tb[16][17];
  u64 col = (u64)blockIdx.x * 16 + threadIdx.x;
  for (u64 row_tile = blockIdx.y; row_tile * 16 < m; row_tile += gridDim.y) {
    u64 row = row_tile * 16 + threadIdx.y;
    A acc = (A)0;
    for (u64 k0 = 0; k0 < k; k0 += 16) {
      u64 ka = k0 + threadIdx.x;
      ta[threadIdx.y][threadIdx.x] = (row < m && ka < k) ? T::up(as[trans_a ? ka * m + row : row * k + ka]) : (A)0;
      u64 kb = k0 + threadIdx.y;
      tb[threadIdx.y][threadIdx.x] = (kb < k && col < n) ? T::up(bs[trans_b ? col * k + kb : kb * n + col]) : (A)0;
      __syncthreads();
      for (int j = 0; j < 16; ++j) acc = acc + ta[threadIdx.y][j] * tb[j][threadIdx.x];
      __syncthreads();
    }
    if (row < m && col < n) {
      typename C::M o = (typename C::M)acc;
      u64 at = row * n + col;
      cs[at] = C::down(accumulate ? C::up(cs[at]) + o : o);
    }
  }
}
"#;

/// The template tag of a float dtype.
fn float_tag(d: DType) -> Result<&'static str, DeviceError> {
    Ok(match d {
        DType::F32 => "F32",
        DType::F64 => "F64",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        other => return Err(DeviceError::invalid("hip kernel", format!("{other} is not a float dtype"))),
    })
}

/// One kernel instance: an operation and the dtypes it is instantiated for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `dst = src` converted.
    Cast(DType, DType),
    /// `x *= alpha`.
    Scale(DType),
    /// `dst += src` for floats (source, destination).
    Accumulate(DType, DType),
    /// `dst += src` for integers (wrapping).
    AccumulateInt(DType),
    /// `y += alpha x` (x, y).
    Axpy(DType, DType),
    /// Fill with a pattern of this many bytes.
    Fill(usize),
    /// `x[r, c] += bias[c]` (x, bias).
    BiasAdd(DType, DType),
    /// `y = max(x, 0)`.
    Relu(DType),
    /// ReLU's gradient.
    ReluBackward(DType),
    /// Σ (pred − target)² into one element (pred, target, loss).
    MseLoss(DType, DType, DType),
    /// `2 · scale · (pred − target)` (pred, target, grad).
    MseGrad(DType, DType, DType),
    /// Column sums (x, out).
    ColumnSums(DType, DType),
    /// Σ x² into one element (x, out).
    SumSquares(DType, DType),
    /// One SGD step (f32).
    Sgd,
    /// One AdamW step (f32).
    AdamW,
    /// Tiled matrix product (inputs, output).
    Matmul(DType, DType),
}

impl Kernel {
    /// The `extern "C"` name of this instance.
    pub fn name(&self) -> String {
        let n = |d: &DType| d.name();
        match self {
            Kernel::Cast(s, d) => format!("chorus_cast_{}_{}", n(s), n(d)),
            Kernel::Scale(t) => format!("chorus_scale_{}", n(t)),
            Kernel::Accumulate(s, d) => format!("chorus_accumulate_{}_{}", n(s), n(d)),
            Kernel::AccumulateInt(t) => format!("chorus_accumulate_{}", n(t)),
            Kernel::Axpy(x, y) => format!("chorus_axpy_{}_{}", n(x), n(y)),
            Kernel::Fill(bytes) => format!("chorus_fill_{}", bytes * 8),
            Kernel::BiasAdd(x, b) => format!("chorus_bias_add_{}_{}", n(x), n(b)),
            Kernel::Relu(t) => format!("chorus_relu_{}", n(t)),
            Kernel::ReluBackward(t) => format!("chorus_relu_backward_{}", n(t)),
            Kernel::MseLoss(p, t, l) => format!("chorus_mse_loss_{}_{}_{}", n(p), n(t), n(l)),
            Kernel::MseGrad(p, t, g) => format!("chorus_mse_grad_{}_{}_{}", n(p), n(t), n(g)),
            Kernel::ColumnSums(x, o) => format!("chorus_column_sums_{}_{}", n(x), n(o)),
            Kernel::SumSquares(x, o) => format!("chorus_sum_squares_{}_{}", n(x), n(o)),
            Kernel::Sgd => "chorus_sgd".to_string(),
            Kernel::AdamW => "chorus_adamw".to_string(),
            Kernel::Matmul(t, c) => format!("chorus_matmul_{}_{}", n(t), n(c)),
        }
    }

    /// The `extern "C"` wrapper that instantiates this kernel (without the prelude).
    pub fn wrapper(&self) -> Result<String, DeviceError> {
        let name = self.name();
        let f = float_tag;
        let (params, body) = match *self {
            Kernel::Cast(s, d) => {
                ("const void* src, void* dst, u64 n", format!("k_cast<{}, {}>(src, dst, n)", f(s)?, f(d)?))
            }
            Kernel::Scale(t) => ("void* x, u64 n, double alpha", format!("k_scale<{}>(x, n, alpha)", f(t)?)),
            Kernel::Accumulate(s, d) => {
                ("const void* src, void* dst, u64 n", format!("k_accumulate<{}, {}>(src, dst, n)", f(s)?, f(d)?))
            }
            Kernel::AccumulateInt(t) => {
                let (i, u) = match t {
                    DType::I32 => ("int", "unsigned int"),
                    DType::I64 => ("long long", "unsigned long long"),
                    DType::I8 => ("signed char", "unsigned char"),
                    DType::U8 => ("unsigned char", "unsigned char"),
                    other => {
                        return Err(DeviceError::invalid("hip kernel", format!("{other} is not an integer dtype")))
                    }
                };
                ("const void* src, void* dst, u64 n", format!("k_accumulate_int<{i}, {u}>(src, dst, n)"))
            }
            Kernel::Axpy(x, y) => {
                ("double alpha, const void* x, void* y, u64 n", format!("k_axpy<{}, {}>(alpha, x, y, n)", f(x)?, f(y)?))
            }
            Kernel::Fill(bytes) => {
                let w = match bytes {
                    1 => "u8",
                    2 => "u16",
                    4 => "u32",
                    8 => "u64",
                    other => return Err(DeviceError::invalid("hip kernel", format!("no {other}-byte fill"))),
                };
                ("void* dst, u64 n, u64 pattern", format!("k_fill<{w}>(dst, n, pattern)"))
            }
            Kernel::BiasAdd(x, b) => (
                "void* x, const void* bias, u64 n, u64 cols",
                format!("k_bias_add<{}, {}>(x, bias, n, cols)", f(x)?, f(b)?),
            ),
            Kernel::Relu(t) => ("const void* x, void* y, u64 n", format!("k_relu<{}>(x, y, n)", f(t)?)),
            Kernel::ReluBackward(t) => (
                "const void* grad_out, const void* out, void* grad_in, u64 n",
                format!("k_relu_backward<{}>(grad_out, out, grad_in, n)", f(t)?),
            ),
            Kernel::MseLoss(p, t, l) => (
                "const void* pred, const void* target, void* loss, u64 n, double scale",
                format!("k_mse_loss<{}, {}, {}>(pred, target, loss, n, scale)", f(p)?, f(t)?, f(l)?),
            ),
            Kernel::MseGrad(p, t, g) => (
                "const void* pred, const void* target, void* grad, u64 n, double scale",
                format!("k_mse_grad<{}, {}, {}>(pred, target, grad, n, scale)", f(p)?, f(t)?, f(g)?),
            ),
            Kernel::ColumnSums(x, o) => (
                "const void* x, void* out, u64 rows, u64 cols, int accumulate",
                format!("k_column_sums<{}, {}>(x, out, rows, cols, accumulate)", f(x)?, f(o)?),
            ),
            Kernel::SumSquares(x, o) => (
                "const void* x, void* out, u64 n, int accumulate",
                format!("k_sum_squares<{}, {}>(x, out, n, accumulate)", f(x)?, f(o)?),
            ),
            Kernel::Sgd => (
                "float* w, const float* g, float* buf, u64 n, float lr, float wd, float mom, float damp, int flags",
                "k_sgd(w, g, buf, n, lr, wd, mom, damp, flags)".to_string(),
            ),
            Kernel::AdamW => (
                "float* w, const float* g, float* m, float* v, u64 n, float decay, float one_minus_b1, float b2, \
                 float one_minus_b2, float bc2_sqrt, float step_size, float eps",
                "k_adamw(w, g, m, v, n, decay, one_minus_b1, b2, one_minus_b2, bc2_sqrt, step_size, eps)".to_string(),
            ),
            Kernel::Matmul(t, c) => (
                "const void* a, const void* b, void* c, u64 m, u64 n, u64 k, int trans_a, int trans_b, int accumulate",
                format!("k_matmul<{}, {}>(a, b, c, m, n, k, trans_a, trans_b, accumulate)", f(t)?, f(c)?),
            ),
        };
        let bounds = if matches!(self, Kernel::Matmul(..)) { TILE * TILE } else { BLOCK };
        Ok(format!("extern \"C\" __global__ void __launch_bounds__({bounds}) {name}({params}) {{ {body}; }}\n"))
    }

    /// The complete source of this instance: the prelude and its wrapper.
    pub fn source(&self) -> Result<String, DeviceError> {
        Ok(format!("{PRELUDE}\n{}", self.wrapper()?))
    }

    /// Every instance the hip stream can launch.
    pub fn all() -> Vec<Kernel> {
        let floats = [DType::F32, DType::F64, DType::F16, DType::BF16];
        let mut all = Vec::new();
        for a in floats {
            all.extend([Kernel::Scale(a), Kernel::Relu(a), Kernel::ReluBackward(a)]);
            for b in floats {
                all.extend([
                    Kernel::Cast(a, b),
                    Kernel::Accumulate(a, b),
                    Kernel::Axpy(a, b),
                    Kernel::BiasAdd(a, b),
                    Kernel::ColumnSums(a, b),
                ]);
                for c in floats {
                    all.push(Kernel::MseGrad(a, b, c));
                }
                for l in [DType::F32, DType::F64] {
                    all.push(Kernel::MseLoss(a, b, l));
                }
            }
            for o in [DType::F32, DType::F64] {
                all.push(Kernel::SumSquares(a, o));
            }
            all.push(Kernel::Matmul(a, a));
            if a != DType::F32 {
                all.push(Kernel::Matmul(a, DType::F32));
            }
        }
        for i in [DType::I32, DType::I64, DType::I8, DType::U8] {
            all.push(Kernel::AccumulateInt(i));
        }
        all.extend([Kernel::Fill(1), Kernel::Fill(2), Kernel::Fill(4), Kernel::Fill(8), Kernel::Sgd, Kernel::AdamW]);
        all
    }
}

/// One module holding every instance (what the load test compiles for a
/// fixed architecture to check the sources without a GPU).
pub fn full_source() -> Result<String, DeviceError> {
    let mut s = PRELUDE.to_string();
    for k in Kernel::all() {
        s.push_str(&k.wrapper()?);
    }
    Ok(s)
}

/// The compiler options for `arch` (`None`: hipRTC picks the current device's).
pub fn compile_options(arch: Option<&str>) -> Vec<String> {
    let mut o: Vec<String> = COMPILE_OPTIONS.iter().map(|s| s.to_string()).collect();
    if let Some(a) = arch {
        o.push(format!("--offload-arch={a}"));
    }
    o
}

/// A compiled kernel loaded on one device.
#[derive(Debug)]
pub(crate) struct Loaded {
    module: hipModule_t,
    function: hipFunction_t,
}

// SAFETY: module and function handles are plain identifiers that the HIP
// runtime allows to be used from any thread.
unsafe impl Send for Loaded {}
unsafe impl Sync for Loaded {}

impl Loaded {
    pub(crate) fn unload(&self) -> Result<(), DeviceError> {
        // SAFETY: called once, when the device is dropped and no stream of it remains.
        unsafe { result::module_unload(self.module) }
    }
}

/// The per-device cache of loaded kernels.
#[derive(Debug, Default)]
pub(crate) struct KernelCache {
    loaded: Mutex<HashMap<Kernel, Arc<Loaded>>>,
}

impl KernelCache {
    /// The loaded function of `kernel`, compiling and loading it on first
    /// use. The caller has made the device current.
    pub(crate) fn get(&self, kernel: Kernel, arch: Option<&str>) -> Result<Arc<Loaded>, DeviceError> {
        let mut map = self.loaded.lock().map_err(|_| DeviceError::invalid("hip kernel", "kernel cache poisoned"))?;
        if let Some(k) = map.get(&kernel) {
            return Ok(k.clone());
        }
        let name = kernel.name();
        let image = result::rtc_compile(&kernel.source()?, &format!("{name}.hip"), &compile_options(arch))?;
        let module = result::module_load(&image)?;
        // SAFETY: the module was just loaded.
        let function = match unsafe { result::module_get_function(module, &name) } {
            Ok(f) => f,
            Err(e) => {
                // SAFETY: loaded above, nothing launched from it.
                let _ = unsafe { result::module_unload(module) };
                return Err(e);
            }
        };
        let loaded = Arc::new(Loaded { module, function });
        map.insert(kernel, loaded.clone());
        Ok(loaded)
    }

    /// Every loaded kernel, emptying the cache (for unloading).
    pub(crate) fn drain(&self) -> Vec<Arc<Loaded>> {
        match self.loaded.lock() {
            Ok(mut m) => m.drain().map(|(_, v)| v).collect(),
            Err(_) => Vec::new(),
        }
    }
}

/// Kernel arguments, each stored in an 8-byte slot (a 4-byte argument is
/// read from the slot's low half, which little-endian puts first).
#[derive(Default)]
pub(crate) struct Args {
    slots: Vec<u64>,
}

impl Args {
    pub(crate) fn ptr(mut self, p: u64) -> Self {
        self.slots.push(p);
        self
    }
    pub(crate) fn u64(mut self, v: u64) -> Self {
        self.slots.push(v);
        self
    }
    pub(crate) fn f64(mut self, v: f64) -> Self {
        self.slots.push(v.to_bits());
        self
    }
    pub(crate) fn f32(mut self, v: f32) -> Self {
        self.slots.push(v.to_bits() as u64);
        self
    }
    pub(crate) fn i32(mut self, v: i32) -> Self {
        self.slots.push(v as u32 as u64);
        self
    }
}

/// Blocks of a grid-stride 1-D launch over `n` elements.
pub(crate) fn blocks_for(n: u64) -> u32 {
    n.div_ceil(BLOCK as u64).clamp(1, MAX_BLOCKS) as u32
}

/// Launches `kernel` on `stream` with a `grid` of `block`s.
///
/// # Safety
/// `args` match the kernel's parameters; the memory they point to stays
/// valid until the kernel has run in the stream's order; the stream is of
/// the device the kernel was loaded on.
pub(crate) unsafe fn launch(
    kernel: &Loaded,
    stream: hipStream_t,
    grid: (u32, u32),
    block: (u32, u32),
    mut args: Args,
) -> Result<(), DeviceError> {
    let mut params: Vec<*mut c_void> = args.slots.iter_mut().map(|s| s as *mut u64 as *mut c_void).collect();
    // SAFETY: per the caller's contract; the slots outlive the call (HIP copies the values).
    unsafe { result::launch_kernel(kernel.function, grid, block, 0, stream, &mut params) }
}
