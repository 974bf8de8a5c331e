// Rotary embedding (rotate-half) on [batch, seq, heads, head_dim], forward
// and (with sign = -1) backward; one thread per rotated pair
// (kernels/src/rope.rs has the math and the CPU reference).
#pragma once
#include "common.cuh"

#define ROPE_BLOCK 256

template <typename E>
static __device__ void rope(const typename E::T* x, const float* cos_t, const float* sin_t, typename E::T* y,
                            u64 pairs, int t, int heads, int d, float sign) {
    int half = d / 2;
    for (u64 p = (u64)blockIdx.x * blockDim.x + threadIdx.x; p < pairs; p += (u64)gridDim.x * blockDim.x) {
        u64 row = p / half;
        int j = (int)(p - row * half);
        int pos = (int)((row / heads) % t);
        float c = cos_t[pos * half + j], s = sign * sin_t[pos * half + j];
        u64 at = row * d + j;
        float x1 = E::load(x[at]), x2 = E::load(x[at + half]);
        y[at] = E::store(x1 * c - x2 * s);
        y[at + half] = E::store(x2 * c + x1 * s);
    }
}

#define CHORUS_ROPE(E, S)                                                                                          \
    extern "C" __global__ void __launch_bounds__(ROPE_BLOCK)                                                       \
        chorus_rope_##S(const E::T* x, const float* c, const float* s, E::T* y, u64 pairs, int t, int heads, int d, \
                        float sign) {                                                                              \
        rope<E>(x, c, s, y, pairs, t, heads, d, sign);                                                             \
    }

CHORUS_ROPE(F32, f32)
CHORUS_ROPE(BF16, bf16)
CHORUS_ROPE(F16, f16)
