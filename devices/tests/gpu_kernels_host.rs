//! The shared GPU kernel source (`chorus_devices::gpu_kernels::SOURCE`, what
//! NVRTC and hipRTC compile) compiled by the host's C++ compiler and run on
//! the CPU, so its arithmetic is checked where there is no GPU:
//!
//! - the f16/bf16 conversions against the `half` crate: all 65536 patterns of
//!   each widened, and f32 → f16/bf16 on every tie of either format, its
//!   neighbours, NaNs, infinities, subnormals and a million random patterns;
//! - every kernel against the cpu device (the reference), bit for bit, on
//!   every dtype combination the streams launch.
//!
//! A small prelude defines the CUDA keywords away; a block's threads are OS
//! threads with a real barrier for `__syncthreads`, so the tiled matmul and
//! the tree reductions run as written. What this cannot show: the GPU
//! compilers' code generation, the hardware's own conversions (`(float)` of
//! an f64, NaN payloads) and the launch paths — those need a GPU
//! (`ci/gpu-check.sh`). Without a C++ compiler (`CXX`, `c++`, `g++`,
//! `clang++`) every test prints why it was skipped.
#![cfg(any(feature = "cuda", feature = "rocm"))]

use std::ffi::c_void;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use chorus_devices::cpu::{CpuDevice, CpuStream};
use chorus_devices::gpu_kernels::{self, code, AdamWScalars, SgdScalars, SOURCE};
use chorus_devices::{
    bf16, f16, AdamWParams, Buffer, ComputeStream, DType, Device, Element, MatmulSpec, Priority, Scalar, SgdParams,
    Stream,
};

/// What the kernel source needs from CUDA, for the host compiler.
const PRELUDE: &str = r#"
#include <math.h>
#include <string.h>
#include <condition_variable>
#include <mutex>

struct chorus_dim3 { unsigned x, y, z; };
static chorus_dim3 gridDim = {1, 1, 1};
static chorus_dim3 blockDim = {1, 1, 1};
static thread_local chorus_dim3 blockIdx = {0, 0, 0};
static thread_local chorus_dim3 threadIdx = {0, 0, 0};

static std::mutex chorus_barrier_mutex;
static std::condition_variable chorus_barrier_cv;
static unsigned chorus_barrier_waiting = 0;
static unsigned chorus_barrier_generation = 0;

// Every thread of the block waits for the others.
static void __syncthreads() {
    std::unique_lock<std::mutex> lock(chorus_barrier_mutex);
    unsigned generation = chorus_barrier_generation;
    if (++chorus_barrier_waiting == blockDim.x * blockDim.y) {
        chorus_barrier_waiting = 0;
        chorus_barrier_generation++;
        chorus_barrier_cv.notify_all();
    } else {
        chorus_barrier_cv.wait(lock, [&] { return chorus_barrier_generation != generation; });
    }
}

static unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, sizeof u); return u; }
static float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, sizeof f); return f; }

#define __device__
#define __global__
#define __shared__ static
#define __launch_bounds__(threads)

extern "C" void chorus_host_dims(unsigned gx, unsigned gy, unsigned bx, unsigned by) {
    gridDim = {gx, gy, 1};
    blockDim = {bx, by, 1};
}
extern "C" void chorus_host_enter(unsigned bx, unsigned by, unsigned tx, unsigned ty) {
    blockIdx = {bx, by, 0};
    threadIdx = {tx, ty, 0};
}
"#;

/// The source's conversion helpers, exported as bit patterns (a float
/// passed through a register stays as it is; converting it would quiet a
/// signaling NaN and hide what the helper did).
const EPILOGUE: &str = r#"
extern "C" unsigned chorus_host_h2f(unsigned short h) { return f32_bits(h2f(h)); }
extern "C" unsigned short chorus_host_f2h(unsigned f) { return f2h(bits_f32(f)); }
extern "C" unsigned chorus_host_b2f(unsigned short b) { return f32_bits(b2f(b)); }
extern "C" unsigned short chorus_host_f2b(unsigned f) { return f2b(bits_f32(f)); }
"#;

type Dims = unsafe extern "C" fn(u32, u32, u32, u32);
type Widen = unsafe extern "C" fn(u16) -> u32;
type Narrow = unsafe extern "C" fn(u32) -> u16;

/// The kernel source built as a shared library, and a lock so one launch at a time owns its block state.
struct HostKernels {
    lib: libloading::Library,
    launch_lock: Mutex<()>,
}

/// A grid-stride launch: 3 blocks of 4 threads.
const ELEMENTWISE: ((u32, u32), (u32, u32)) = ((3, 1), (4, 1));
/// A reduction in one thread: the cpu device's left-to-right order.
const SEQUENTIAL: ((u32, u32), (u32, u32)) = ((1, 1), (1, 1));
/// A reduction as a tree over 64 threads.
const TREE: ((u32, u32), (u32, u32)) = ((1, 1), (64, 1));

fn compiler() -> Option<String> {
    let candidates = std::env::var("CXX").into_iter().chain(["c++", "g++", "clang++"].map(String::from));
    candidates.into_iter().find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
}

fn build() -> Result<HostKernels, String> {
    let cxx = compiler().ok_or("no C++ compiler (CXX, c++, g++, clang++)")?;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("gpu_kernels_host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let (src, lib) = (dir.join("kernels.cpp"), dir.join("libchorus_kernels_host.so"));
    std::fs::write(&src, format!("{PRELUDE}\n#line 1 \"gpu_kernels.rs SOURCE\"\n{SOURCE}\n{EPILOGUE}"))
        .map_err(|e| format!("{}: {e}", src.display()))?;
    // As the GPU compilers are told: no contraction into multiply-adds.
    let out = Command::new(&cxx)
        .args(["-std=c++17", "-O2", "-ffp-contract=off", "-fPIC", "-shared", "-pthread", "-Wall", "-o"])
        .arg(&lib)
        .arg(&src)
        .output()
        .map_err(|e| format!("{cxx}: {e}"))?;
    let log = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        panic!("{cxx} rejected the kernel source:\n{log}");
    }
    if !log.trim().is_empty() {
        println!("{cxx} warned about the kernel source:\n{log}");
    }
    // SAFETY: our own library; its initializers only set the statics above.
    let loaded = unsafe { libloading::Library::new(&lib) }.map_err(|e| format!("loading {}: {e}", lib.display()));
    let _ = std::fs::remove_dir_all(&dir);
    Ok(HostKernels { lib: loaded?, launch_lock: Mutex::new(()) })
}

/// The host build of the kernels, or `None` (and a printed reason) when there is no compiler.
fn kernels() -> Option<&'static HostKernels> {
    static BUILT: OnceLock<Result<HostKernels, String>> = OnceLock::new();
    match BUILT.get_or_init(build) {
        Ok(k) => Some(k),
        Err(why) => {
            println!("skipped: {why}");
            None
        }
    }
}

impl HostKernels {
    /// The kernel `name` as a function of type `F`.
    fn get<F: Copy>(&self, name: &str) -> F {
        // SAFETY: `F` is the kernel's signature in SOURCE (each caller names it).
        unsafe { *self.lib.get::<F>(name.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e}")) }
    }

    /// Runs `body` (one kernel call) as every thread of every block of a launch.
    fn launch(&self, (grid, block): ((u32, u32), (u32, u32)), body: impl Fn() + Sync) {
        let _one = self.launch_lock.lock().unwrap_or_else(|p| p.into_inner());
        let dims: Dims = self.get("chorus_host_dims");
        let enter: Dims = self.get("chorus_host_enter");
        // SAFETY: plain setters of the prelude's statics.
        unsafe { dims(grid.0, grid.1, block.0, block.1) };
        for by in 0..grid.1 {
            for bx in 0..grid.0 {
                std::thread::scope(|s| {
                    for ty in 0..block.1 {
                        for tx in 0..block.0 {
                            let body = &body;
                            s.spawn(move || {
                                // SAFETY: sets this thread's indices.
                                unsafe { enter(bx, by, tx, ty) };
                                body();
                            });
                        }
                    }
                });
            }
        }
    }
}

macro_rules! typed {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            DType::F16 => {
                type $t = f16;
                $body
            }
            DType::BF16 => {
                type $t = bf16;
                $body
            }
            DType::I32 => {
                type $t = i32;
                $body
            }
            DType::I64 => {
                type $t = i64;
                $body
            }
            DType::I8 => {
                type $t = i8;
                $body
            }
            DType::U8 => {
                type $t = u8;
                $body
            }
        }
    };
}

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// A host array of any dtype, 8-byte aligned for the kernels.
#[derive(Clone, Debug)]
struct Data {
    dtype: DType,
    len: usize,
    words: Vec<u64>,
}

impl Data {
    fn from_bytes(dtype: DType, bytes: &[u8]) -> Data {
        let len = bytes.len() / dtype.size();
        let mut words = vec![0u64; bytes.len().div_ceil(8).max(1)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        Data { dtype, len, words }
    }
    fn of<T: Element>(values: &[T]) -> Data {
        Data::from_bytes(T::DTYPE, bytemuck::cast_slice(values))
    }
    /// `values` converted to `dtype` as the cpu device converts (ints saturate).
    fn from_f64(dtype: DType, values: &[f64]) -> Data {
        typed!(dtype, T => Data::of(&values.iter().map(|v| T::from_f64(*v)).collect::<Vec<T>>()))
    }
    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len * self.dtype.size()]
    }
    fn ptr(&self) -> usize {
        self.words.as_ptr() as usize
    }
    fn ptr_mut(&mut self) -> usize {
        self.words.as_mut_ptr() as usize
    }
    fn get(&self, i: usize) -> f64 {
        let s = self.dtype.size();
        typed!(self.dtype, T => bytemuck::pod_read_unaligned::<T>(&self.bytes()[i * s..(i + 1) * s]).to_f64())
    }
    fn bits(&self, i: usize) -> u64 {
        let s = self.dtype.size();
        let mut b = [0u8; 8];
        b[..s].copy_from_slice(&self.bytes()[i * s..(i + 1) * s]);
        u64::from_le_bytes(b)
    }
    fn to_cpu(&self, s: &CpuStream) -> chorus_devices::cpu::CpuBuffer {
        let b = s.alloc(self.dtype, self.len).unwrap();
        s.copy_from_host(self.bytes(), b.view()).unwrap();
        b
    }
    fn from_cpu(s: &CpuStream, b: &chorus_devices::cpu::CpuBuffer) -> Data {
        Data::from_bytes(b.dtype(), &s.copy_to_host(b.view()).unwrap().wait().unwrap())
    }
}

/// How two results must agree.
#[derive(Clone, Copy, PartialEq)]
enum Agree {
    /// Every bit, NaN payloads included.
    Bits,
    /// Every bit, except that any NaN equals any NaN (which operand's
    /// payload an addition keeps is the compiler's choice).
    Value,
    /// Within this relative difference (a different summation order).
    Relative(f64),
}

#[track_caller]
fn assert_agree(what: &str, kernel: &Data, cpu: &Data, how: Agree) {
    assert_eq!((kernel.dtype, kernel.len), (cpu.dtype, cpu.len), "{what}");
    for i in 0..kernel.len {
        let (k, c) = (kernel.get(i), cpu.get(i));
        let ok = match how {
            Agree::Bits => kernel.bits(i) == cpu.bits(i),
            Agree::Value => kernel.bits(i) == cpu.bits(i) || (k.is_nan() && c.is_nan()),
            Agree::Relative(r) => (k - c).abs() <= r * c.abs().max(f64::MIN_POSITIVE) || (k.is_nan() && c.is_nan()),
        };
        assert!(ok, "{what}: element {i}: kernel {k:e} ({:#x}), cpu device {c:e} ({:#x})", kernel.bits(i), cpu.bits(i));
    }
}

/// A deterministic generator (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Values spread over many binades, both signs, with exact zeros.
    fn values(&mut self, n: usize) -> Vec<f64> {
        (0..n)
            .map(|i| match i % 17 {
                0 => 0.0,
                1 => -0.0,
                _ => {
                    let sign = if self.next() & 1 == 0 { 1.0 } else { -1.0 };
                    sign * (1.0 + self.unit()) * 2f64.powi((self.next() % 24) as i32 - 12)
                }
            })
            .collect()
    }
}

/// Values whose every product and sum is exact in f32 (multiples of 1/8, |v| ≤ 1).
fn dyadic(rng: &mut Rng, n: usize) -> Vec<f64> {
    (0..n).map(|_| (rng.next() % 17) as f64 / 8.0 - 1.0).collect()
}

/// NaN (two payloads), infinities, zeros, the f32/f16 subnormal ranges, huge values.
fn specials() -> Vec<f64> {
    vec![
        f64::NAN,
        f64::from_bits(0x7ff0_0000_0000_0001),
        -f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        0.0,
        -0.0,
        1e-40,
        -3e-42,
        6e-8,
        -3e-8,
        65504.0,
        65520.0,
        -1e300,
        3.5e38,
        1.0 + 1.0 / 2048.0,
        1.0 + 1.0 / 256.0 + 1e-12,
    ]
}

fn cpu() -> (CpuDevice, CpuStream) {
    let d = CpuDevice::with_ordinal(0);
    let s = d.create_stream(Priority::Normal).unwrap();
    (d, s)
}

// ---- the source itself (no compiler needed) -------------------------------------------

#[test]
fn the_source_defines_every_named_kernel_once_with_the_shared_sizes() {
    for name in gpu_kernels::NAMES {
        assert_eq!(SOURCE.matches(&format!(" {name}(")).count(), 1, "{name}");
    }
    assert_eq!(SOURCE.matches("extern \"C\" __global__").count(), gpu_kernels::NAMES.len());
    for (define, value) in [
        ("CHORUS_BLOCK", gpu_kernels::BLOCK),
        ("CHORUS_REDUCE_BLOCK", gpu_kernels::REDUCE_BLOCK),
        ("CHORUS_TILE", gpu_kernels::TILE),
    ] {
        assert!(SOURCE.contains(&format!("#define {define} {value}\n")), "{define}");
    }
    assert!(gpu_kernels::REDUCE_BLOCK.is_power_of_two() && gpu_kernels::REDUCE_BLOCK <= 1024);
    assert!(!SOURCE.contains("asm"), "no vendor assembly in the shared source");
}

#[test]
fn dtype_codes_are_distinct_and_match_the_source() {
    let all = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::I8, DType::U8];
    for (i, d) in all.iter().enumerate() {
        assert_eq!(code(*d), i as i32);
        let tag = format!("#define T_{} {i}\n", d.name().to_uppercase());
        assert!(SOURCE.contains(&tag), "{tag}");
    }
}

// ---- the conversions against `half` -------------------------------------------------

/// `chorus_cast` of `src` into `dt`, on the host build.
fn cast(k: &HostKernels, src: &Data, dt: DType) -> Data {
    type Cast = unsafe extern "C" fn(*const c_void, i32, *mut c_void, i32, u64);
    let f: Cast = k.get("chorus_cast");
    let mut dst = Data::from_bytes(dt, &vec![0u8; src.len * dt.size()]);
    let (s, d, n, st) = (src.ptr(), dst.ptr_mut(), src.len as u64, code(src.dtype));
    // SAFETY: `s` holds n elements of st, `d` n of dt.
    k.launch(ELEMENTWISE, || unsafe { f(s as *const c_void, st, d as *mut c_void, code(dt), n) });
    dst
}

#[track_caller]
fn assert_bits<T: Element + std::fmt::Debug>(what: &str, input: &[u64], got: &Data, expected: &[T]) {
    let expected = Data::of(expected);
    assert_eq!(got.len, input.len(), "{what}");
    for (i, pattern) in input.iter().enumerate() {
        assert_eq!(got.bits(i), expected.bits(i), "{what} of {pattern:#x}");
    }
}

#[test]
fn f16_and_bf16_widen_exactly_for_all_65536_patterns() {
    let Some(k) = kernels() else { return };
    let (h2f, b2f): (Widen, Widen) = (k.get("chorus_host_h2f"), k.get("chorus_host_b2f"));
    for bits in 0..=u16::MAX {
        // SAFETY: pure functions of their argument.
        let (h, b) = unsafe { (h2f(bits), b2f(bits)) };
        assert_eq!(h, f16::from_bits(bits).to_f32().to_bits(), "h2f({bits:#06x})");
        assert_eq!(b, bf16::from_bits(bits).to_f32().to_bits(), "b2f({bits:#06x})");
    }
    // And through chorus_cast (widened to f64 on the way).
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let pats: Vec<u64> = all.iter().map(|b| *b as u64).collect();
    let halves: Vec<f16> = all.iter().map(|b| f16::from_bits(*b)).collect();
    let brains: Vec<bf16> = all.iter().map(|b| bf16::from_bits(*b)).collect();
    let (h, b) = (Data::of(&halves), Data::of(&brains));
    assert_bits("f16 -> f32", &pats, &cast(k, &h, DType::F32), &halves.iter().map(|v| v.to_f32()).collect::<Vec<_>>());
    assert_bits("f16 -> f64", &pats, &cast(k, &h, DType::F64), &halves.iter().map(|v| v.to_f64()).collect::<Vec<_>>());
    assert_bits("bf16 -> f32", &pats, &cast(k, &b, DType::F32), &brains.iter().map(|v| v.to_f32()).collect::<Vec<_>>());
    assert_bits("bf16 -> f64", &pats, &cast(k, &b, DType::F64), &brains.iter().map(|v| v.to_f64()).collect::<Vec<_>>());
    // Through f64 and back: every value returns, every NaN comes back quieted.
    let h_back: Vec<f16> = halves.iter().map(|v| f16::from_f32(v.to_f32())).collect();
    assert_bits("f16 -> f16", &pats, &cast(k, &h, DType::F16), &h_back);
    let b_back: Vec<bf16> = brains.iter().map(|v| bf16::from_f32(v.to_f32())).collect();
    assert_bits("bf16 -> bf16", &pats, &cast(k, &b, DType::BF16), &b_back);
}

/// f32 patterns where rounding to f16 and bf16 is decided: every value of
/// each format, the midpoint to the next and their neighbours, NaNs with
/// every payload shape, and random patterns.
fn f32_patterns() -> Vec<u32> {
    let mut p = Vec::new();
    for h in 0..=u16::MAX {
        let v = f16::from_bits(h);
        if v.is_finite() && h & 0x7fff != 0x7bff {
            let (lo, hi) = (v.to_f32() as f64, f16::from_bits(h + 1).to_f32() as f64);
            let mid = ((lo + hi) / 2.0) as f32; // exact: f16 midpoints fit in f32
            let m = mid.to_bits();
            p.extend([v.to_f32().to_bits(), m.wrapping_sub(1), m, m.wrapping_add(1)]);
        }
        let hi = (h as u32) << 16;
        p.extend([hi, hi | 1, hi | 0x7fff, hi | 0x8000, hi | 0x8001, hi | 0xffff]);
    }
    p.extend([0x7f80_0000, 0xff80_0000, 0x7f80_0001, 0x7fc0_0000, 0xffff_ffff, 0x7f80_2000, 0x7fbf_ffff]);
    p.extend([
        0x477f_efff,
        0x477f_f000,
        0x477f_f001,
        0x7f7f_ffff,
        0x3300_0000,
        0x3300_0001,
        0x32ff_ffff,
        1,
        0x8000_0001,
    ]);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    p.extend((0..1_000_000).map(|_| rng.next() as u32));
    p
}

#[test]
fn f32_narrows_to_f16_and_bf16_as_half_does_on_ties_nans_and_subnormals() {
    let Some(k) = kernels() else { return };
    let pats = f32_patterns();
    let (f2h, f2b): (Narrow, Narrow) = (k.get("chorus_host_f2h"), k.get("chorus_host_f2b"));
    for bits in &pats {
        let v = f32::from_bits(*bits);
        // SAFETY: pure functions of their argument.
        let (h, b) = unsafe { (f2h(*bits), f2b(*bits)) };
        assert_eq!(h, f16::from_f32(v).to_bits(), "f2h({bits:#010x})");
        assert_eq!(b, bf16::from_f32(v).to_bits(), "f2b({bits:#010x})");
    }
    // And through chorus_cast (widened to f64 and rounded to odd on the way).
    let input: Vec<u64> = pats.iter().map(|b| *b as u64).collect();
    let values: Vec<f32> = pats.iter().map(|b| f32::from_bits(*b)).collect();
    let src = Data::of(&values);
    let halves: Vec<f16> = values.iter().map(|v| f16::from_f32(*v)).collect();
    assert_bits("f32 -> f16", &input, &cast(k, &src, DType::F16), &halves);
    let brains: Vec<bf16> = values.iter().map(|v| bf16::from_f32(*v)).collect();
    assert_bits("f32 -> bf16", &input, &cast(k, &src, DType::BF16), &brains);
    // The f32 store path (`stf`, what arithmetic results take): scaling by one.
    for dt in [DType::F16, DType::BF16] {
        type Scale = unsafe extern "C" fn(*mut c_void, i32, u64, f64);
        let f: Scale = k.get("chorus_scale");
        let mut x = cast(k, &src, dt);
        let expected = x.clone();
        let (p, n) = (x.ptr_mut(), x.len as u64);
        // SAFETY: n elements of dt.
        k.launch(ELEMENTWISE, || unsafe { f(p as *mut c_void, code(dt), n, 1.0) });
        assert_agree(&format!("{dt} scaled by 1"), &x, &expected, Agree::Bits);
    }
}

#[test]
fn f64_narrows_once_like_the_cpu_device() {
    let Some(k) = kernels() else { return };
    // Just above and below every f16 and bf16 tie (where rounding through f32
    // to nearest would round twice), random values and the specials.
    let mut values: Vec<f64> = Vec::new();
    for h in 0..0x7bffu16 {
        let (lo, hi) = (f16::from_bits(h).to_f64(), f16::from_bits(h + 1).to_f64());
        let mid = (lo + hi) / 2.0;
        values.extend([mid, f64::from_bits(mid.to_bits() + 1), f64::from_bits(mid.to_bits() - 1), -mid]);
        let (blo, bhi) = (bf16::from_bits(h).to_f64(), bf16::from_bits(h + 1).to_f64());
        let bmid = (blo + bhi) / 2.0;
        values.extend([bmid, f64::from_bits(bmid.to_bits() + 1), f64::from_bits(bmid.to_bits() - 1)]);
    }
    let mut rng = Rng(7);
    values.extend((0..200_000).map(|_| f64::from_bits(rng.next())));
    values.extend(specials());
    let src = Data::of(&values);
    let (_d, s) = cpu();
    let b = src.to_cpu(&s);
    for dt in FLOATS {
        let out = s.alloc(dt, values.len()).unwrap();
        s.cast(b.view(), out.view()).unwrap();
        assert_agree(&format!("f64 -> {dt}"), &cast(k, &src, dt), &Data::from_cpu(&s, &out), Agree::Bits);
    }
}

// ---- every kernel against the cpu device ---------------------------------------------

#[test]
fn cast_scale_accumulate_and_axpy_match_the_cpu_device() {
    let Some(k) = kernels() else { return };
    let (_d, s) = cpu();
    let mut rng = Rng(11);
    let n = 300;
    type Scale = unsafe extern "C" fn(*mut c_void, i32, u64, f64);
    type Acc = unsafe extern "C" fn(*const c_void, i32, *mut c_void, i32, u64);
    type Axpy = unsafe extern "C" fn(f64, *const c_void, i32, *mut c_void, i32, u64);
    let (scale, acc, axpy): (Scale, Acc, Axpy) =
        (k.get("chorus_scale"), k.get("chorus_accumulate"), k.get("chorus_axpy"));
    for xt in FLOATS {
        let mut vals = rng.values(n);
        vals.extend(specials());
        let x = Data::from_f64(xt, &vals);
        // scale
        for alpha in [0.3, -1.7, 1e-3] {
            let mut kx = x.clone();
            let (p, len) = (kx.ptr_mut(), kx.len as u64);
            // SAFETY: len elements of xt.
            k.launch(ELEMENTWISE, || unsafe { scale(p as *mut c_void, code(xt), len, alpha) });
            let cx = x.to_cpu(&s);
            s.scale(cx.view(), alpha).unwrap();
            assert_agree(&format!("scale {xt} by {alpha}"), &kx, &Data::from_cpu(&s, &cx), Agree::Value);
        }
        for yt in FLOATS {
            let y = Data::from_f64(yt, &rng.values(x.len));
            // cast
            let cy = s.alloc(yt, x.len).unwrap();
            s.cast(x.to_cpu(&s).view(), cy.view()).unwrap();
            assert_agree(&format!("cast {xt} -> {yt}"), &cast(k, &x, yt), &Data::from_cpu(&s, &cy), Agree::Bits);
            // accumulate
            let mut ky = y.clone();
            let (src, dst, len) = (x.ptr(), ky.ptr_mut(), x.len as u64);
            // SAFETY: len elements each.
            k.launch(ELEMENTWISE, || unsafe { acc(src as *const c_void, code(xt), dst as *mut c_void, code(yt), len) });
            let cy = y.to_cpu(&s);
            s.accumulate(x.to_cpu(&s).view(), cy.view()).unwrap();
            assert_agree(&format!("accumulate {xt} into {yt}"), &ky, &Data::from_cpu(&s, &cy), Agree::Value);
            // axpy
            let alpha = -0.7;
            let mut ky = y.clone();
            let (src, dst) = (x.ptr(), ky.ptr_mut());
            // SAFETY: len elements each.
            k.launch(ELEMENTWISE, || unsafe {
                axpy(alpha, src as *const c_void, code(xt), dst as *mut c_void, code(yt), len)
            });
            let cy = y.to_cpu(&s);
            s.axpy(alpha, x.to_cpu(&s).view(), cy.view()).unwrap();
            assert_agree(&format!("axpy {xt} into {yt}"), &ky, &Data::from_cpu(&s, &cy), Agree::Value);
        }
    }
}

#[test]
fn integer_accumulate_wraps_and_fill_writes_every_width_like_the_cpu_device() {
    let Some(k) = kernels() else { return };
    let (_d, s) = cpu();
    let mut rng = Rng(5);
    type AccInt = unsafe extern "C" fn(*const c_void, *mut c_void, i32, u64);
    type Fill = unsafe extern "C" fn(*mut c_void, i32, u64, u64);
    let (acc, fill): (AccInt, Fill) = (k.get("chorus_accumulate_int"), k.get("chorus_fill"));
    for t in [DType::I32, DType::I64, DType::I8, DType::U8] {
        let words = |rng: &mut Rng| (0..257).flat_map(|_| rng.next().to_le_bytes()).collect::<Vec<u8>>();
        let a = Data::from_bytes(t, &words(&mut rng)[..257 * t.size()]);
        let b = Data::from_bytes(t, &words(&mut rng)[..257 * t.size()]);
        let mut kb = b.clone();
        let (src, dst, n) = (a.ptr(), kb.ptr_mut(), a.len as u64);
        // SAFETY: n elements of t each.
        k.launch(ELEMENTWISE, || unsafe { acc(src as *const c_void, dst as *mut c_void, code(t), n) });
        let cb = b.to_cpu(&s);
        s.accumulate(a.to_cpu(&s).view(), cb.view()).unwrap();
        assert_agree(&format!("accumulate {t}"), &kb, &Data::from_cpu(&s, &cb), Agree::Bits);
    }
    for (t, value) in [
        (DType::U8, Scalar::Int(0xa5)),
        (DType::F16, Scalar::Float(-1.5)),
        (DType::BF16, Scalar::Float(3.0)),
        (DType::F32, Scalar::Float(0.1)),
        (DType::I32, Scalar::Int(-7)),
        (DType::F64, Scalar::Float(-0.1)),
        (DType::I64, Scalar::Int(i64::MIN + 3)),
    ] {
        let pattern = value.encode(t).unwrap();
        let mut word = [0u8; 8];
        word[..pattern.len()].copy_from_slice(&pattern);
        let mut kx = Data::from_bytes(t, &vec![0u8; 101 * t.size()]);
        let (p, n) = (kx.ptr_mut(), kx.len as u64);
        // SAFETY: n elements of the pattern's width.
        k.launch(ELEMENTWISE, || unsafe { fill(p as *mut c_void, t.size() as i32, n, u64::from_le_bytes(word)) });
        let cx = s.alloc(t, 101).unwrap();
        s.fill(cx.view(), value).unwrap();
        assert_agree(&format!("fill {t}"), &kx, &Data::from_cpu(&s, &cx), Agree::Bits);
    }
}

#[test]
fn bias_add_relu_and_its_backward_match_the_cpu_device_nan_included() {
    let Some(k) = kernels() else { return };
    let (_d, s) = cpu();
    let mut rng = Rng(3);
    type Bias = unsafe extern "C" fn(*mut c_void, i32, *const c_void, i32, u64, u64);
    type Relu = unsafe extern "C" fn(*const c_void, *mut c_void, i32, u64);
    type ReluBack = unsafe extern "C" fn(*const c_void, *const c_void, *mut c_void, i32, u64);
    let (bias_add, relu, relu_back): (Bias, Relu, ReluBack) =
        (k.get("chorus_bias_add"), k.get("chorus_relu"), k.get("chorus_relu_backward"));
    let cols = 17;
    for xt in FLOATS {
        for bt in FLOATS {
            let x = Data::from_f64(xt, &rng.values(cols * 9));
            let b = Data::from_f64(bt, &rng.values(cols));
            let mut kx = x.clone();
            let (px, pb, n) = (kx.ptr_mut(), b.ptr(), x.len as u64);
            // SAFETY: n elements of xt, cols of bt.
            k.launch(ELEMENTWISE, || unsafe {
                bias_add(px as *mut c_void, code(xt), pb as *const c_void, code(bt), n, cols as u64)
            });
            let cx = x.to_cpu(&s);
            s.bias_add(cx.view(), b.to_cpu(&s).view()).unwrap();
            assert_agree(&format!("bias_add {bt} to {xt}"), &kx, &Data::from_cpu(&s, &cx), Agree::Value);
        }
        let mut vals = rng.values(200);
        vals.extend(specials());
        let x = Data::from_f64(xt, &vals);
        let mut ky = Data::from_f64(xt, &vec![9.0; x.len]);
        let (px, py, n) = (x.ptr(), ky.ptr_mut(), x.len as u64);
        // SAFETY: n elements of xt each.
        k.launch(ELEMENTWISE, || unsafe { relu(px as *const c_void, py as *mut c_void, code(xt), n) });
        let cy = s.alloc(xt, x.len).unwrap();
        s.relu(x.to_cpu(&s).view(), cy.view()).unwrap();
        assert_agree(&format!("relu {xt}"), &ky, &Data::from_cpu(&s, &cy), Agree::Bits);
        // NaN stays NaN, -0 and negatives become +0.
        for (i, v) in vals.iter().enumerate() {
            let y = ky.get(i);
            if v.is_nan() {
                assert!(y.is_nan(), "relu({v}) = {y}");
            } else if *v <= 0.0 {
                assert!(y == 0.0 && y.is_sign_positive(), "relu({v}) = {y}");
            }
        }
        let grad = Data::from_f64(xt, &rng.values(x.len));
        let mut kg = Data::from_f64(xt, &vec![9.0; x.len]);
        let (pg, po, pi) = (grad.ptr(), x.ptr(), kg.ptr_mut());
        // SAFETY: n elements of xt each.
        k.launch(ELEMENTWISE, || unsafe {
            relu_back(pg as *const c_void, po as *const c_void, pi as *mut c_void, code(xt), n)
        });
        let cg = s.alloc(xt, x.len).unwrap();
        s.relu_backward(grad.to_cpu(&s).view(), x.to_cpu(&s).view(), cg.view()).unwrap();
        assert_agree(&format!("relu_backward {xt}"), &kg, &Data::from_cpu(&s, &cg), Agree::Bits);
    }
}

#[test]
fn the_mse_loss_gradient_and_sums_match_the_cpu_device() {
    let Some(k) = kernels() else { return };
    let (_d, s) = cpu();
    let mut rng = Rng(17);
    type Grad = unsafe extern "C" fn(*const c_void, i32, *const c_void, i32, *mut c_void, i32, u64, f64);
    type Loss = Grad;
    type SumSq = unsafe extern "C" fn(*const c_void, i32, *mut c_void, i32, u64, i32);
    type ColSums = unsafe extern "C" fn(*const c_void, i32, *mut c_void, i32, u64, u64, i32);
    let (mse_grad, mse_loss, sum_sq, col_sums): (Grad, Loss, SumSq, ColSums) =
        (k.get("chorus_mse_grad"), k.get("chorus_mse_loss"), k.get("chorus_sum_squares"), k.get("chorus_column_sums"));
    let n = 333;
    let scale = 1.0 / n as f64;
    for pt in FLOATS {
        for tt in FLOATS {
            let p = Data::from_f64(pt, &rng.values(n));
            let t = Data::from_f64(tt, &rng.values(n));
            let (pp, tp) = (p.ptr(), t.ptr());
            for gt in FLOATS {
                let mut kg = Data::from_f64(gt, &vec![0.0; n]);
                let g = kg.ptr_mut();
                // SAFETY: n elements of each dtype.
                k.launch(ELEMENTWISE, || unsafe {
                    mse_grad(pp as _, code(pt), tp as _, code(tt), g as *mut c_void, code(gt), n as u64, scale)
                });
                let cg = s.alloc(gt, n).unwrap();
                s.mse_grad(p.to_cpu(&s).view(), t.to_cpu(&s).view(), cg.view(), scale).unwrap();
                assert_agree(&format!("mse_grad {pt} {tt} -> {gt}"), &kg, &Data::from_cpu(&s, &cg), Agree::Value);
            }
            for lt in [DType::F32, DType::F64] {
                let cl = s.alloc(lt, 1).unwrap();
                s.mse_loss(p.to_cpu(&s).view(), t.to_cpu(&s).view(), cl.view(), scale).unwrap();
                let expected = Data::from_cpu(&s, &cl);
                for (launch, how) in [(SEQUENTIAL, Agree::Bits), (TREE, Agree::Relative(1e-6))] {
                    let mut kl = Data::from_f64(lt, &[0.0]);
                    let l = kl.ptr_mut();
                    // SAFETY: n elements of pt and tt, one of lt.
                    k.launch(launch, || unsafe {
                        mse_loss(pp as _, code(pt), tp as _, code(tt), l as *mut c_void, code(lt), n as u64, scale)
                    });
                    assert_agree(&format!("mse_loss {pt} {tt} -> {lt}"), &kl, &expected, how);
                }
            }
        }
    }
    for xt in FLOATS {
        let x = Data::from_f64(xt, &rng.values(n));
        let px = x.ptr();
        for ot in [DType::F32, DType::F64] {
            for accumulate in [false, true] {
                let old = Data::from_f64(ot, &[2.5]);
                let co = old.to_cpu(&s);
                s.sum_squares(x.to_cpu(&s).view(), co.view(), accumulate).unwrap();
                let expected = Data::from_cpu(&s, &co);
                for (launch, how) in [(SEQUENTIAL, Agree::Bits), (TREE, Agree::Relative(1e-6))] {
                    let mut ko = old.clone();
                    let o = ko.ptr_mut();
                    // SAFETY: n elements of xt, one of ot.
                    k.launch(launch, || unsafe {
                        sum_sq(px as _, code(xt), o as *mut c_void, code(ot), n as u64, accumulate as i32)
                    });
                    assert_agree(&format!("sum_squares {xt} -> {ot} ({accumulate})"), &ko, &expected, how);
                }
            }
        }
        let cols = 37;
        let x = Data::from_f64(xt, &rng.values(cols * 9));
        let px = x.ptr();
        for ot in FLOATS {
            for accumulate in [false, true] {
                let old = Data::from_f64(ot, &rng.values(cols));
                let mut ko = old.clone();
                let o = ko.ptr_mut();
                // SAFETY: 9 rows of `cols` elements of xt, `cols` of ot.
                k.launch(ELEMENTWISE, || unsafe {
                    col_sums(px as _, code(xt), o as *mut c_void, code(ot), 9, cols as u64, accumulate as i32)
                });
                let co = old.to_cpu(&s);
                s.column_sums(x.to_cpu(&s).view(), co.view(), accumulate).unwrap();
                let what = format!("column_sums {xt} -> {ot} ({accumulate})");
                assert_agree(&what, &ko, &Data::from_cpu(&s, &co), Agree::Value);
            }
        }
    }
}

#[test]
fn sgd_and_adamw_steps_match_the_cpu_device() {
    let Some(k) = kernels() else { return };
    let (_d, s) = cpu();
    let mut rng = Rng(23);
    let n = 300;
    type Sgd = unsafe extern "C" fn(*mut f32, *const f32, *mut f32, u64, f32, f32, f32, f32, i32, i32, i32, i32);
    type AdamW = unsafe extern "C" fn(*mut f32, *const f32, *mut f32, *mut f32, u64, f32, f32, f32, f32, f32, f32, f32);
    let (sgd, adamw): (Sgd, AdamW) = (k.get("chorus_sgd"), k.get("chorus_adamw"));
    let f32s = |rng: &mut Rng| Data::from_f64(DType::F32, &rng.values(n));
    for (momentum, nesterov, weight_decay, first_step) in
        [(0.0, false, 0.0, false), (0.9, false, 0.01, true), (0.9, true, 0.01, false), (0.5, false, 0.0, false)]
    {
        let params = SgdParams { lr: 0.05, momentum, dampening: 0.1, weight_decay, nesterov, first_step };
        let (w, g, buf) = (f32s(&mut rng), f32s(&mut rng), f32s(&mut rng));
        let sc = SgdScalars::new(&params, momentum != 0.0);
        let (mut kw, mut kb) = (w.clone(), buf.clone());
        let (pw, pg, pb) = (kw.ptr_mut(), g.ptr(), kb.ptr_mut());
        // SAFETY: n f32 each, disjoint.
        k.launch(ELEMENTWISE, || unsafe {
            sgd(
                pw as _,
                pg as _,
                pb as _,
                n as u64,
                sc.lr,
                sc.weight_decay,
                sc.momentum,
                sc.one_minus_dampening,
                sc.has_weight_decay,
                sc.use_momentum,
                sc.first_step,
                sc.nesterov,
            )
        });
        let (cw, cb) = (w.to_cpu(&s), buf.to_cpu(&s));
        let cbuf = (momentum != 0.0).then(|| cb.view());
        s.sgd_step(params, cw.view(), g.to_cpu(&s).view(), cbuf).unwrap();
        assert_agree(&format!("sgd {params:?}"), &kw, &Data::from_cpu(&s, &cw), Agree::Bits);
        assert_agree(&format!("sgd buffer {params:?}"), &kb, &Data::from_cpu(&s, &cb), Agree::Bits);
    }
    for step in [1, 2, 10] {
        let params = AdamWParams { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, step };
        let (w, g, m) = (f32s(&mut rng), f32s(&mut rng), f32s(&mut rng));
        let v = Data::from_f64(DType::F32, &rng.values(n).iter().map(|x| x * x).collect::<Vec<_>>());
        let sc = AdamWScalars::new(&params);
        let (mut kw, mut km, mut kv) = (w.clone(), m.clone(), v.clone());
        let (pw, pg, pm, pv) = (kw.ptr_mut(), g.ptr(), km.ptr_mut(), kv.ptr_mut());
        // SAFETY: n f32 each, disjoint.
        k.launch(ELEMENTWISE, || unsafe {
            adamw(
                pw as _,
                pg as _,
                pm as _,
                pv as _,
                n as u64,
                sc.decay,
                sc.one_minus_beta1,
                sc.beta2,
                sc.one_minus_beta2,
                sc.bias_correction2_sqrt,
                sc.step_size,
                sc.eps,
            )
        });
        let (cw, cm, cv) = (w.to_cpu(&s), m.to_cpu(&s), v.to_cpu(&s));
        s.adamw_step(params, cw.view(), g.to_cpu(&s).view(), cm.view(), cv.view()).unwrap();
        assert_agree(&format!("adamw step {step}"), &kw, &Data::from_cpu(&s, &cw), Agree::Bits);
        assert_agree(&format!("adamw m step {step}"), &km, &Data::from_cpu(&s, &cm), Agree::Bits);
        assert_agree(&format!("adamw v step {step}"), &kv, &Data::from_cpu(&s, &cv), Agree::Bits);
    }
}

/// The tiled matmul with 16×16 threads per block, on shapes that are not
/// multiples of the tile and a grid too short for the rows (so blocks stride
/// over row tiles). Inputs are multiples of 1/8 so every product and sum is
/// exact and the order of summation cannot matter: the results must be the
/// cpu device's bit for bit, including the final rounding into C.
#[test]
fn the_tiled_matmul_matches_the_cpu_device() {
    let Some(k) = kernels() else { return };
    let (_d, s) = cpu();
    let mut rng = Rng(29);
    type Matmul =
        unsafe extern "C" fn(*const c_void, *const c_void, i32, *mut c_void, i32, u64, u64, u64, i32, i32, i32);
    let matmul: Matmul = k.get("chorus_matmul");
    let (m, n, kk) = (35usize, 21usize, 19usize);
    let tile = gpu_kernels::TILE;
    let grid = ((n as u32).div_ceil(tile), 2);
    let mut pairs: Vec<(DType, DType)> = FLOATS.iter().map(|t| (*t, *t)).collect();
    pairs.extend([(DType::F64, DType::F32), (DType::F16, DType::F32), (DType::BF16, DType::F32)]);
    for (t, ct) in pairs {
        for (trans_a, trans_b, accumulate) in
            [(false, false, false), (true, false, true), (false, true, true), (true, true, false)]
        {
            let spec = MatmulSpec { m, n, k: kk, trans_a, trans_b, accumulate };
            let a = Data::from_f64(t, &dyadic(&mut rng, m * kk));
            let b = Data::from_f64(t, &dyadic(&mut rng, kk * n));
            let c = Data::from_f64(ct, &rng.values(m * n));
            let mut kc = c.clone();
            let (pa, pb, pc) = (a.ptr(), b.ptr(), kc.ptr_mut());
            // SAFETY: shapes as the spec says.
            k.launch((grid, (tile, tile)), || unsafe {
                matmul(
                    pa as _,
                    pb as _,
                    code(t),
                    pc as *mut c_void,
                    code(ct),
                    m as u64,
                    n as u64,
                    kk as u64,
                    trans_a as i32,
                    trans_b as i32,
                    accumulate as i32,
                )
            });
            let cc = c.to_cpu(&s);
            s.matmul(spec, a.to_cpu(&s).view(), b.to_cpu(&s).view(), cc.view()).unwrap();
            assert_agree(&format!("matmul {t} -> {ct} {spec:?}"), &kc, &Data::from_cpu(&s, &cc), Agree::Bits);
        }
    }
}
