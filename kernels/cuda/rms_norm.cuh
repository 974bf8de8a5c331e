// RMSNorm forward and backward (kernels/src/rms_norm.rs has the math and
// the CPU reference). One block per row for the row-wise passes; the
// weight's gradient is summed over rows in two passes (per-block partial
// sums of a column slice, then a sum of the partials), so no atomics and
// the same result every run.
#pragma once
#include "common.cuh"

#define RMS_BLOCK 256

// y = w * round(x * r), r = 1 / sqrt(mean(x^2) + eps); one block per row.
template <typename E>
static __device__ void rms_norm_forward(const typename E::T* x, const typename E::T* w, typename E::T* y, int d,
                                        float eps) {
    __shared__ float scratch[32];
    const typename E::T* xr = x + (u64)blockIdx.x * d;
    typename E::T* yr = y + (u64)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = E::load(xr[i]);
        ss += v * v;
    }
    float r = 1.0f / sqrtf(block_sum(ss, scratch) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float normed = E::load(E::store(E::load(xr[i]) * r));
        yr[i] = E::store(E::load(w[i]) * normed);
    }
}

// dx = r * (w*dy - x*r * mean(w*dy*x*r)); one block per row.
template <typename E>
static __device__ void rms_norm_backward_x(const typename E::T* x, const typename E::T* w, const typename E::T* dy,
                                           typename E::T* dx, int d, float eps) {
    __shared__ float scratch[32];
    u64 row = (u64)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = E::load(x[row + i]);
        ss += v * v;
    }
    float r = 1.0f / sqrtf(block_sum(ss, scratch) / (float)d + eps);
    float dot = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        dot += E::load(w[i]) * E::load(dy[row + i]) * E::load(x[row + i]) * r;
    }
    dot = block_sum(dot, scratch) / (float)d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = E::load(x[row + i]);
        dx[row + i] = E::store(r * (E::load(w[i]) * E::load(dy[row + i]) - v * r * dot));
    }
}

// rstd[row] = 1 / sqrt(mean(x^2) + eps); one block per row.
template <typename E>
static __device__ void rms_norm_rstd(const typename E::T* x, float* rstd, int d, float eps) {
    __shared__ float scratch[32];
    const typename E::T* xr = x + (u64)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = E::load(xr[i]);
        ss += v * v;
    }
    float total = block_sum(ss, scratch);
    if (threadIdx.x == 0) rstd[blockIdx.x] = 1.0f / sqrtf(total / (float)d + eps);
}

// partial[p][c] = sum over rows r = p, p + P, ... of dy[r][c] * x[r][c] * rstd[r],
// for column c = blockIdx.x * blockDim.x + threadIdx.x and p = blockIdx.y (P = gridDim.y).
template <typename E>
static __device__ void rms_norm_backward_w_partial(const typename E::T* x, const typename E::T* dy,
                                                   const float* rstd, float* partial, int rows, int d) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= d) return;
    float acc = 0.0f;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        u64 at = (u64)r * d + c;
        acc += E::load(dy[at]) * E::load(x[at]) * rstd[r];
    }
    partial[(u64)blockIdx.y * d + c] = acc;
}

// dw[c] = sum over p of partial[p][c], for `parts` partials.
template <typename E>
static __device__ void rms_norm_backward_w_sum(const float* partial, typename E::T* dw, int parts, int d) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= d) return;
    float acc = 0.0f;
    for (int p = 0; p < parts; p++) acc += partial[(u64)p * d + c];
    dw[c] = E::store(acc);
}

#define CHORUS_RMS_NORM(E, S)                                                                                       \
    extern "C" __global__ void __launch_bounds__(RMS_BLOCK)                                                         \
        chorus_rms_norm_forward_##S(const E::T* x, const E::T* w, E::T* y, int d, float eps) {                      \
        rms_norm_forward<E>(x, w, y, d, eps);                                                                       \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(RMS_BLOCK) chorus_rms_norm_backward_x_##S(                        \
        const E::T* x, const E::T* w, const E::T* dy, E::T* dx, int d, float eps) {                                 \
        rms_norm_backward_x<E>(x, w, dy, dx, d, eps);                                                               \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(RMS_BLOCK)                                                         \
        chorus_rms_norm_rstd_##S(const E::T* x, float* rstd, int d, float eps) {                                    \
        rms_norm_rstd<E>(x, rstd, d, eps);                                                                          \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(RMS_BLOCK) chorus_rms_norm_backward_w_partial_##S(                \
        const E::T* x, const E::T* dy, const float* rstd, float* partial, int rows, int d) {                        \
        rms_norm_backward_w_partial<E>(x, dy, rstd, partial, rows, d);                                              \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(RMS_BLOCK)                                                         \
        chorus_rms_norm_backward_w_sum_##S(const float* partial, E::T* dw, int parts, int d) {                      \
        rms_norm_backward_w_sum<E>(partial, dw, parts, d);                                                          \
    }

CHORUS_RMS_NORM(F32, f32)
CHORUS_RMS_NORM(BF16, bf16)
CHORUS_RMS_NORM(F16, f16)
