// Cross-entropy per row of the logits against u32 targets, forward (loss
// and log-sum-exp per row, f32) and backward (the logits' gradient in
// their dtype); one block per row, never a probability tensor
// (kernels/src/cross_entropy.rs has the math and the CPU reference). A
// target outside the vocabulary makes its row's loss and gradient NaN.
#pragma once
#include "common.cuh"

#define CE_BLOCK 256

// The online (max, sum of exp(x - max)) of a row, combined over the block.
template <typename E>
static __device__ float row_lse(const typename E::T* row, int vocab) {
    __shared__ float maxes[32], sums[32];
    float m = -INFINITY, s = 0.0f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        float v = E::load(row[j]);
        if (v > m) {
            s = s * expf(m - v) + 1.0f;
            m = v;
        } else if (v != -INFINITY) {
            s += expf(v - m);
        }
    }
    // Combine the lanes' pairs, then the warps'.
    for (int off = 16; off > 0; off >>= 1) {
        float om = chorus_shfl_xor(m, off), os = chorus_shfl_xor(s, off);
        float nm = fmaxf(m, om);
        s = (m == -INFINITY ? 0.0f : s * expf(m - nm)) + (om == -INFINITY ? 0.0f : os * expf(om - nm));
        m = nm;
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        maxes[warp] = m;
        sums[warp] = s;
    }
    __syncthreads();
    float bm = -INFINITY;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) bm = fmaxf(bm, maxes[w]);
    float bs = 0.0f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
        if (maxes[w] != -INFINITY) bs += sums[w] * expf(maxes[w] - bm);
    }
    return bm + logf(bs);
}

template <typename E>
static __device__ void cross_entropy_forward(const typename E::T* logits, const u32* targets, float* loss, float* lse,
                                             int vocab) {
    const typename E::T* row = logits + (u64)blockIdx.x * vocab;
    float l = row_lse<E>(row, vocab);
    if (threadIdx.x == 0) {
        u32 t = targets[blockIdx.x];
        lse[blockIdx.x] = l;
        loss[blockIdx.x] = t < (u32)vocab ? l - E::load(row[t]) : NAN;
    }
}

template <typename E>
static __device__ void cross_entropy_backward(const typename E::T* logits, const u32* targets, const float* g,
                                              const float* lse, typename E::T* dx, int vocab) {
    u64 at = (u64)blockIdx.x * vocab;
    u32 t = targets[blockIdx.x];
    float l = lse[blockIdx.x], gr = t < (u32)vocab ? g[blockIdx.x] : NAN;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        float p = expf(E::load(logits[at + j]) - l);
        dx[at + j] = E::store(gr * (p - ((u32)j == t ? 1.0f : 0.0f)));
    }
}

#define CHORUS_CROSS_ENTROPY(E, S)                                                                                  \
    extern "C" __global__ void __launch_bounds__(CE_BLOCK) chorus_cross_entropy_forward_##S(                       \
        const E::T* logits, const u32* targets, float* loss, float* lse, int vocab) {                               \
        cross_entropy_forward<E>(logits, targets, loss, lse, vocab);                                                \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(CE_BLOCK) chorus_cross_entropy_backward_##S(                      \
        const E::T* logits, const u32* targets, const float* g, const float* lse, E::T* dx, int vocab) {            \
        cross_entropy_backward<E>(logits, targets, g, lse, dx, vocab);                                              \
    }

CHORUS_CROSS_ENTROPY(F32, f32)
CHORUS_CROSS_ENTROPY(BF16, bf16)
CHORUS_CROSS_ENTROPY(F16, f16)
