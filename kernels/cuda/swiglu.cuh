// SwiGLU's gate silu(g) * u, forward and backward, elementwise
// (kernels/src/swiglu.rs has the math and the CPU reference). The backward
// writes dg at [0, n) and du at [n, 2n) of one output.
#pragma once
#include "common.cuh"

#define SWIGLU_BLOCK 256

static __device__ __forceinline__ float sigmoid_f32(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename E>
static __device__ void swiglu_forward(const typename E::T* g, const typename E::T* u, typename E::T* y, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float gv = E::load(g[i]);
        y[i] = E::store(gv * sigmoid_f32(gv) * E::load(u[i]));
    }
}

template <typename E>
static __device__ void swiglu_backward(const typename E::T* g, const typename E::T* u, const typename E::T* dy,
                                       typename E::T* out, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float gv = E::load(g[i]), uv = E::load(u[i]), d = E::load(dy[i]), s = sigmoid_f32(gv);
        out[i] = E::store(d * uv * s * (1.0f + gv * (1.0f - s)));
        out[n + i] = E::store(d * gv * s);
    }
}

#define CHORUS_SWIGLU(E, S)                                                                                         \
    extern "C" __global__ void __launch_bounds__(SWIGLU_BLOCK)                                                      \
        chorus_swiglu_forward_##S(const E::T* g, const E::T* u, E::T* y, u64 n) {                                   \
        swiglu_forward<E>(g, u, y, n);                                                                              \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(SWIGLU_BLOCK)                                                      \
        chorus_swiglu_backward_##S(const E::T* g, const E::T* u, const E::T* dy, E::T* out, u64 n) {                \
        swiglu_backward<E>(g, u, dy, out, n);                                                                       \
    }

CHORUS_SWIGLU(F32, f32)
CHORUS_SWIGLU(BF16, bf16)
CHORUS_SWIGLU(F16, f16)
