// What the kernel source needs from CUDA, for the host's C++ compiler: the
// keywords defined away, a block's threads as OS threads (the runner in
// host/mod.rs starts one per thread of a block, one block at a time, and
// sets the indices below), `__syncthreads` as a real barrier of the block,
// and the warp-level primitives as collectives of the warp's 32 threads
// through a per-warp exchange area, each with the semantics the PTX ISA
// gives it (the fragment layouts are written out in common.cuh).
#include <math.h>
#include <string.h>
#include <condition_variable>
#include <mutex>

#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(threads)

struct chorus_dim3 { unsigned x, y, z; };
static chorus_dim3 gridDim = {1, 1, 1};
static chorus_dim3 blockDim = {1, 1, 1};
static thread_local chorus_dim3 blockIdx = {0, 0, 0};
static thread_local chorus_dim3 threadIdx = {0, 0, 0};

// A reusable barrier of `count` threads.
struct chorus_barrier {
    std::mutex m;
    std::condition_variable cv;
    unsigned waiting = 0, generation = 0;
    void wait(unsigned count) {
        std::unique_lock<std::mutex> lock(m);
        unsigned gen = generation;
        if (++waiting == count) {
            waiting = 0;
            generation++;
            cv.notify_all();
        } else {
            cv.wait(lock, [&] { return generation != gen; });
        }
    }
};

static chorus_barrier chorus_block_barrier;
static chorus_barrier chorus_warp_barriers[32];
// Per warp, per lane: the words a lane offers to a warp collective.
static unsigned long long chorus_warp_words[32][32][8];

static void __syncthreads() { chorus_block_barrier.wait(blockDim.x); }

static inline unsigned chorus_lane() { return threadIdx.x & 31; }
static inline unsigned chorus_warp() { return threadIdx.x >> 5; }
static inline void chorus_warp_sync() { chorus_warp_barriers[chorus_warp()].wait(32); }

// __shfl_xor_sync over the full warp.
static float chorus_shfl_xor(float v, int mask) {
    unsigned w = chorus_warp(), l = chorus_lane();
    unsigned bits;
    memcpy(&bits, &v, 4);
    chorus_warp_words[w][l][0] = bits;
    chorus_warp_sync();
    unsigned other = (unsigned)chorus_warp_words[w][l ^ (unsigned)mask][0];
    chorus_warp_sync();
    float out;
    memcpy(&out, &other, 4);
    return out;
}

static std::mutex chorus_atomic_mutex;
static float atomicAdd(float* p, float v) {
    std::lock_guard<std::mutex> lock(chorus_atomic_mutex);
    float old = *p;
    *p = old + v;
    return old;
}

// Defined after the kernel source (they use its conversions).
static void chorus_host_mma(float d[4], const unsigned a[4], const unsigned b[2], bool bf16);
static void chorus_host_ldmatrix(unsigned r[4], const unsigned short* row, bool trans);

extern "C" void chorus_host_dims(unsigned gx, unsigned gy, unsigned gz, unsigned bx) {
    gridDim = {gx, gy, gz};
    blockDim = {bx, 1, 1};
}
extern "C" void chorus_host_enter(unsigned bx, unsigned by, unsigned bz, unsigned tx) {
    blockIdx = {bx, by, bz};
    threadIdx = {tx, 0, 0};
}
