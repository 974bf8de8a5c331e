// What the kernel source needs from CUDA, for the host's C++ compiler: the
// keywords defined away, a block's threads as fibers of the calling thread
// (`chorus_host_run_block` below runs one block; the runner in host/mod.rs
// calls it for every block in turn), `__syncthreads` as a barrier of the
// block, and the warp-level primitives as collectives of the warp's 32
// threads through a per-warp exchange area, each with the semantics the PTX
// ISA gives it (the fragment layouts are written out in common.cuh).
//
// Fibers, not OS threads: a lane runs until it reaches a barrier and then
// hands over to the next, so a barrier costs a context switch in user space
// per lane instead of a wake-up through the kernel for each of 32 or 128
// threads competing for two cores (the attention tests spent 90 s there).
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <mutex>
#include <vector>

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

// The fibers of the running block: each lane's context and where it waits.
enum chorus_lane_state : unsigned char { CHORUS_RUNNABLE, CHORUS_AT_BLOCK, CHORUS_AT_WARP, CHORUS_EXITED };
struct chorus_lane_fiber {
    ucontext_t context;
    unsigned char state;
};
static ucontext_t chorus_scheduler;
static std::vector<chorus_lane_fiber> chorus_lanes;
static std::vector<char*> chorus_stacks;
static unsigned chorus_running;
static void (*chorus_lane_body)(void*);
static void* chorus_lane_argument;
// As the OS threads had: 256 KiB a lane, below a guard page.
static const size_t chorus_stack_bytes = 256 * 1024, chorus_guard_bytes = 4096;

// The running lane stops at a barrier until the scheduler releases it.
static void chorus_wait_at(chorus_lane_state barrier) {
    chorus_lane_fiber& lane = chorus_lanes[chorus_running];
    lane.state = barrier;
    swapcontext(&lane.context, &chorus_scheduler);
}

static void chorus_lane_main() {
    chorus_lane_body(chorus_lane_argument);
    chorus_lanes[chorus_running].state = CHORUS_EXITED;
    // Returning resumes the scheduler (uc_link).
}

// Per warp, per lane: the words a lane offers to a warp collective.
static unsigned long long chorus_warp_words[32][32][8];

static void __syncthreads() { chorus_wait_at(CHORUS_AT_BLOCK); }

static inline unsigned chorus_lane() { return threadIdx.x & 31; }
static inline unsigned chorus_warp() { return threadIdx.x >> 5; }
static inline void chorus_warp_sync() { chorus_wait_at(CHORUS_AT_WARP); }

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

// cp.async: a copy lands at one of the two ends of the time the hardware
// allows. In even blocks it lands when its lane waits for its group
// (cp.async.wait_group), so a read before the wait, or without the barrier
// after it, sees the old bytes; in odd blocks it lands when issued, so a copy
// into a buffer that other warps have not finished reading (a missing
// barrier before the copy) shows. A lane that ends with copies it never
// waited for fails the launch (-3).
struct chorus_async_copy {
    void* dst;
    const void* src;
    bool valid;
};
struct chorus_async_lane {
    std::vector<chorus_async_copy> issued;  // in issue order, not yet landed
    std::vector<size_t> groups;             // committed groups: the end of each in `issued`
};
static std::vector<chorus_async_lane> chorus_async;
static bool chorus_async_eager;  // this block's copies land when issued

static void chorus_host_cp_async16(void* dst, const void* src, bool valid) {
    if (chorus_async_eager) {
        if (valid) memcpy(dst, src, 16);
        else memset(dst, 0, 16);
        return;
    }
    chorus_async[chorus_running].issued.push_back({dst, src, valid});
}
static void chorus_host_cp_async_commit() {
    chorus_async_lane& a = chorus_async[chorus_running];
    a.groups.push_back(a.issued.size());
}
// Lands every committed group but the newest `newest` ones.
static void chorus_host_cp_async_wait(int newest) {
    chorus_async_lane& a = chorus_async[chorus_running];
    if ((int)a.groups.size() <= newest) return;
    size_t upto = a.groups[a.groups.size() - 1 - newest];
    for (size_t i = 0; i < upto; i++) {
        if (a.issued[i].valid) memcpy(a.issued[i].dst, a.issued[i].src, 16);
        else memset(a.issued[i].dst, 0, 16);
    }
    a.issued.erase(a.issued.begin(), a.issued.begin() + upto);
    a.groups.erase(a.groups.begin(), a.groups.end() - newest);
    for (size_t& g : a.groups) g -= upto;
}

// Defined after the kernel source (they use its conversions).
static void chorus_host_mma(float d[4], const unsigned a[4], const unsigned b[2], bool bf16);
static void chorus_host_ldmatrix(unsigned r[4], const unsigned short* row, bool trans);

extern "C" void chorus_host_dims(unsigned gx, unsigned gy, unsigned gz, unsigned bx) {
    gridDim = {gx, gy, gz};
    blockDim = {bx, 1, 1};
}
// Runs block (bx, by, bz) of the launch `chorus_host_dims` set: every lane
// calls `body(argument)` as thread `threadIdx.x` of the block. A warp goes on
// from a warp collective when its 32 lanes have reached it, the block from
// __syncthreads when every lane that has not exited has. Returns 0, or -1
// when lanes wait at a barrier that not all of them reach (a hang on a
// GPU), -2 when no stack could be mapped, or -3 when a lane ended with
// asynchronous copies it never waited for.
extern "C" int chorus_host_run_block(unsigned bx, unsigned by, unsigned bz, void (*body)(void*), void* argument) {
    unsigned n = blockDim.x;
    while (chorus_stacks.size() < n) {
        void* p = mmap(nullptr, chorus_stack_bytes + chorus_guard_bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
        if (p == MAP_FAILED) return -2;
        // The stack grows down, towards the guard page at the low end.
        if (mprotect(p, chorus_guard_bytes, PROT_NONE) != 0) return -2;
        chorus_stacks.push_back((char*)p);
    }
    // Resized between blocks only, when no lane's context is live.
    if (chorus_lanes.size() < n) chorus_lanes.resize(n);
    chorus_async.assign(n, chorus_async_lane{});
    chorus_async_eager = (bx + by + bz) % 2 == 1;
    blockIdx = {bx, by, bz};
    chorus_lane_body = body;
    chorus_lane_argument = argument;
    for (unsigned t = 0; t < n; t++) {
        chorus_lane_fiber& lane = chorus_lanes[t];
        getcontext(&lane.context);
        lane.context.uc_stack.ss_sp = chorus_stacks[t] + chorus_guard_bytes;
        lane.context.uc_stack.ss_size = chorus_stack_bytes;
        lane.context.uc_link = &chorus_scheduler;
        makecontext(&lane.context, chorus_lane_main, 0);
        lane.state = CHORUS_RUNNABLE;
    }
    // Each warp runs as far as it can alone (through its warp collectives,
    // up to __syncthreads or its end) before the next starts: warps in index
    // order in even blocks and in reverse in odd ones, and so the lanes of a
    // warp. A read of shared memory that lacks the barrier after another
    // warp's or lane's write thus sees the stale value in one of the two
    // orders, whichever is written first.
    const bool reverse = (bx + by + bz) % 2 == 1;
    const unsigned warps = n / 32;
    for (;;) {
        for (unsigned i = 0; i < warps; i++) {
            unsigned w = reverse ? warps - 1 - i : i;
            for (;;) {
                for (unsigned j = 0; j < 32; j++) {
                    unsigned t = 32 * w + (reverse ? 31 - j : j);
                    if (chorus_lanes[t].state != CHORUS_RUNNABLE) continue;
                    chorus_running = t;
                    threadIdx = {t, 0, 0};
                    swapcontext(&chorus_scheduler, &chorus_lanes[t].context);
                }
                unsigned at_warp = 0;
                for (unsigned l = 0; l < 32; l++) at_warp += chorus_lanes[32 * w + l].state == CHORUS_AT_WARP;
                if (at_warp != 32) break;
                for (unsigned l = 0; l < 32; l++) chorus_lanes[32 * w + l].state = CHORUS_RUNNABLE;
            }
        }
        // Every lane has exited or waits at __syncthreads, or a warp is stuck.
        unsigned at_block = 0, exited = 0;
        for (unsigned t = 0; t < n; t++) {
            at_block += chorus_lanes[t].state == CHORUS_AT_BLOCK;
            exited += chorus_lanes[t].state == CHORUS_EXITED;
        }
        if (exited == n) {
            for (unsigned t = 0; t < n; t++) {
                if (!chorus_async[t].issued.empty()) return -3;
            }
            return 0;
        }
        if (at_block + exited != n) return -1;
        for (unsigned t = 0; t < n; t++) {
            if (chorus_lanes[t].state == CHORUS_AT_BLOCK) chorus_lanes[t].state = CHORUS_RUNNABLE;
        }
    }
}
