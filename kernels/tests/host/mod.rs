//! The CUDA source of `chorus-kernels` compiled by the host's C++ compiler
//! (`prelude.h` defines CUDA away and emulates the warp primitives,
//! `epilogue.h` the tensor-core ones) into a shared library, and a runner
//! that executes a launch as CUDA would: every block in turn, each thread of
//! a block a fiber of the calling thread with its indices set (the prelude's
//! `chorus_host_run_block`).
//!
//! A C++ compiler is a prerequisite (`ci/vendor-cxx.sh` installs g++):
//! without one the tests fail, saying so, rather than pass without running.

use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use chorus_host_cxx::HostLibrary;

pub struct HostKernels {
    lib: HostLibrary,
    launch_lock: Mutex<()>,
}

fn build() -> Result<HostKernels, String> {
    let mut files: Vec<(&str, &str)> = chorus_kernels::CUDA_SOURCES.to_vec();
    files.push(("prelude.h", include_str!("prelude.h")));
    files.push(("epilogue.h", include_str!("epilogue.h")));
    files.push(("host.cpp", "#include \"prelude.h\"\n#include \"chorus_kernels.cu\"\n#include \"epilogue.h\"\n"));
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let lib = chorus_host_cxx::build(&scratch, "chorus_kernels_host", &files, "host.cpp", &[])?;
    Ok(HostKernels { lib, launch_lock: Mutex::new(()) })
}

/// The host build of the kernels (built once per test process).
pub fn kernels() -> &'static HostKernels {
    static BUILT: OnceLock<Result<HostKernels, String>> = OnceLock::new();
    match BUILT.get_or_init(build) {
        Ok(k) => k,
        Err(why) => panic!("the host build of the CUDA kernels failed: {why} (ci/vendor-cxx.sh installs g++)"),
    }
}

type Dims = unsafe extern "C" fn(u32, u32, u32, u32);
type RunBlock = unsafe extern "C" fn(u32, u32, u32, extern "C" fn(*mut c_void), *mut c_void) -> i32;

/// One lane of a block: calls the launch's body (a `&F` behind `body`). A
/// panic must not unwind into the C++ scheduler's frames: it ends the process
/// (after the panic hook has printed it).
extern "C" fn lane<F: Fn()>(body: *mut c_void) {
    // SAFETY: `launch` passes a `&F` that outlives the block it runs.
    let body = unsafe { &*(body as *const F) };
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).is_err() {
        std::process::abort();
    }
}

impl HostKernels {
    /// The symbol `name` as a function of type `F`.
    pub fn get<F: Copy>(&self, name: &str) -> F {
        // SAFETY: the callers name each kernel with its C signature (cuda/*.cuh).
        unsafe { self.lib.get::<F>(name) }
    }

    /// Runs `body` (one kernel call) as every thread of every block of a
    /// launch of `grid` blocks of `block` threads.
    pub fn launch<F: Fn() + Sync>(&self, grid: (u32, u32, u32), block: u32, body: F) {
        assert!(block % 32 == 0 && block <= 1024, "blocks of whole warps");
        // The prelude's block state is one per library: one launch at a time.
        let _one = self.launch_lock.lock().unwrap_or_else(|p| p.into_inner());
        let (dims, run): (Dims, RunBlock) = (self.get("chorus_host_dims"), self.get("chorus_host_run_block"));
        // SAFETY: a plain setter of the prelude's statics.
        unsafe { dims(grid.0, grid.1, grid.2, block) };
        let argument = &body as *const F as *mut c_void;
        for bz in 0..grid.2 {
            for by in 0..grid.1 {
                for bx in 0..grid.0 {
                    // SAFETY: `argument` is `&body`, alive until the block has run; `lane::<F>` reads it as one.
                    let rc = unsafe { run(bx, by, bz, lane::<F>, argument) };
                    assert!(
                        rc == 0,
                        "block ({bx}, {by}, {bz}) of {grid:?}: {}",
                        match rc {
                            -1 => "its threads wait at barriers that not all of them reach (a hang on a GPU)",
                            -3 => "a thread ended with asynchronous copies (cp.async) it never waited for",
                            _ => "no stack could be mapped for its threads",
                        }
                    );
                }
            }
        }
    }
}

/// A small deterministic generator for test inputs.
pub struct Rng(pub u64);

impl Rng {
    pub fn uniform(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    pub fn values(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

/// The storage formats the kernels take, as the host holds them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fmt {
    F32,
    Bf16,
    F16,
}

impl Fmt {
    pub fn suffix(self) -> &'static str {
        match self {
            Fmt::F32 => "f32",
            Fmt::Bf16 => "bf16",
            Fmt::F16 => "f16",
        }
    }

    pub fn round(self, v: f32) -> f32 {
        match self {
            Fmt::F32 => v,
            Fmt::Bf16 => half::bf16::from_f32(v).to_f32(),
            Fmt::F16 => half::f16::from_f32(v).to_f32(),
        }
    }
}

/// Host memory in a format: the bytes a kernel reads and writes.
pub struct Buf {
    pub fmt: Fmt,
    pub bytes: Vec<u8>,
}

impl Buf {
    pub fn from_f32(fmt: Fmt, v: &[f32]) -> Buf {
        let bytes = match fmt {
            Fmt::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Fmt::Bf16 => v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
            Fmt::F16 => v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
        };
        Buf { fmt, bytes }
    }

    /// `n` elements set to NaN, so an element the kernel never writes shows.
    pub fn poisoned(fmt: Fmt, n: usize) -> Buf {
        Buf::from_f32(fmt, &vec![f32::NAN; n])
    }

    pub fn to_f32(&self) -> Vec<f32> {
        match self.fmt {
            Fmt::F32 => self.bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
            Fmt::Bf16 => {
                self.bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect()
            }
            Fmt::F16 => {
                self.bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect()
            }
        }
    }

    /// The address as a kernel argument (a device pointer's 64 bits).
    pub fn ptr(&self) -> u64 {
        self.bytes.as_ptr() as u64
    }

    pub fn ptr_mut(&mut self) -> u64 {
        self.bytes.as_mut_ptr() as u64
    }
}

/// `max |a − b| / max |b|`, failing on any NaN or a length mismatch.
pub fn rel_err(what: &str, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = a.iter().position(|x| !x.is_finite()) {
        panic!("{what}: element {i} is {} (not written, or not finite)", a[i]);
    }
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(f32::MIN_POSITIVE);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}
