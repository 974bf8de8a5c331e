//! The shared kernel source compiled by the host's C++ compiler into a
//! shared library (`chorus-host-cxx`): a prelude defines the CUDA keywords
//! away, an epilogue exports the conversion helpers.

use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use chorus_host_cxx::HostLibrary;

use chorus_devices::gpu_kernels::SOURCE;

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

/// The kernel source built as a shared library, and a lock so one launch at a time owns its block state.
pub struct HostKernels {
    lib: HostLibrary,
    pub(crate) launch_lock: Mutex<()>,
}

fn build() -> Result<HostKernels, String> {
    let source = format!("{PRELUDE}\n#line 1 \"gpu_kernels.cu\"\n{SOURCE}\n{EPILOGUE}");
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    // As the GPU compilers are told: no contraction into multiply-adds.
    let flags = ["-ffp-contract=off", "-Wall"];
    let lib = chorus_host_cxx::build(&scratch, "gpu_kernels_host", &[("kernels.cpp", &source)], "kernels.cpp", &flags)?;
    Ok(HostKernels { lib, launch_lock: Mutex::new(()) })
}

/// The host build of the kernels. A C++ compiler is these tests'
/// prerequisite (`ci/vendor-cxx.sh` installs g++): without one they fail,
/// saying so, rather than pass without having run.
pub fn kernels() -> &'static HostKernels {
    static BUILT: OnceLock<Result<HostKernels, String>> = OnceLock::new();
    match BUILT.get_or_init(build) {
        Ok(k) => k,
        Err(why) => panic!("the host build of the kernels failed: {why} (ci/vendor-cxx.sh installs g++)"),
    }
}

impl HostKernels {
    /// The kernel `name` as a function of type `F`.
    pub fn get<F: Copy>(&self, name: &str) -> F {
        // SAFETY: `F` is the kernel's signature in SOURCE (each caller names it).
        unsafe { self.lib.get::<F>(name) }
    }
}
