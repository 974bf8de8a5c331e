// The compute kernels of chorus's GPU devices, one CUDA C++ source that NVRTC
// (the cuda device) and hipRTC (the hip device) both compile at run time:
// `devices/src/gpu_kernels.rs` includes it as `SOURCE` and holds what the
// Rust side shares with it (kernel names, dtype codes, block sizes, the
// launch arguments' layout); its module documentation gives the rules this
// source keeps (no vendor header or assembly, conversions by integer code,
// no contraction, deterministic reductions).
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define CHORUS_BLOCK 256
#define CHORUS_REDUCE_BLOCK 1024
#define CHORUS_TILE 16
#define CHORUS_BATCH 64

#define T_F32 0
#define T_F64 1
#define T_F16 2
#define T_BF16 3
#define T_I32 4
#define T_I64 5
#define T_I8 6
#define T_U8 7
#define T_F8E4M3 8

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)blockDim.x * gridDim.x)

// ---- conversions: integer code, round to nearest even, NaN quieted (as the half crate) ----

__device__ inline u32 f32_bits(float f) { return __float_as_uint(f); }
__device__ inline float bits_f32(u32 u) { return __uint_as_float(u); }

// f16 -> f32, exact.
__device__ inline float h2f(u16 h) {
    u32 sign = ((u32)h & 0x8000u) << 16;
    u32 exp = ((u32)h >> 10) & 0x1fu;
    u32 man = (u32)h & 0x3ffu;
    if (exp == 0x1fu) return bits_f32(sign | 0x7f800000u | (man != 0u ? 0x400000u | (man << 13) : 0u));
    if (exp == 0u) {
        if (man == 0u) return bits_f32(sign);
        // Subnormal: man * 2^-24, normalized.
        u32 e = 113u;
        while ((man & 0x400u) == 0u) {
            man <<= 1;
            e -= 1u;
        }
        return bits_f32(sign | (e << 23) | ((man & 0x3ffu) << 13));
    }
    return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

// f32 -> f16, round to nearest even.
__device__ inline u16 f2h(float f) {
    u32 x = f32_bits(f);
    u32 sign = (x >> 16) & 0x8000u;
    u32 a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) return (u16)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u | ((a >> 13) & 0x3ffu) : 0u));
    if (a >= 0x477ff000u) return (u16)(sign | 0x7c00u);  // at least 65520: rounds past the largest f16
    if (a >= 0x38800000u) {                             // at least 2^-14: a normal f16
        u32 r = a + 0xfffu + ((a >> 13) & 1u);
        return (u16)(sign | ((r - 0x38000000u) >> 13));
    }
    if (a < 0x33000000u) return (u16)sign;  // below 2^-25: rounds to zero
    // A subnormal f16: the significand in units of 2^-24, rounded.
    u32 m = (a & 0x7fffffu) | 0x800000u;
    u32 shift = 126u - (a >> 23);  // 14..24
    u32 q = m >> shift;
    u32 rem = m & ((1u << shift) - 1u);
    u32 half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u) != 0u)) q += 1u;
    return (u16)(sign | q);
}

// bf16 -> f32, exact.
__device__ inline float b2f(u16 b) {
    u32 u = (u32)b;
    if ((u & 0x7fffu) > 0x7f80u) u |= 0x40u;
    return bits_f32(u << 16);
}

// f32 -> bf16, round to nearest even.
__device__ inline u16 f2b(float f) {
    u32 u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// f64 -> f32 rounded to odd: rounding that to nearest even in a format at
// least two bits narrower (f16, bf16) rounds the f64 once.
__device__ inline float d2f_odd(double v) {
    float nearest = (float)v;
    if (nearest != nearest || (double)nearest == v) return nearest;
    u32 bits = f32_bits(nearest);
    // Inexact: one step toward zero when `nearest` rounded away from it.
    if (v > 0.0 ? (double)nearest > v : (double)nearest < v) bits -= 1u;
    return bits_f32(bits | 1u);
}

// ---- float8 e4m3fn (no infinities, largest finite 448, NaN 0x7f/0xff) ----

// f32 -> e4m3fn, round to nearest even, saturated at +-448 (infinities
// included); NaN stays NaN. As Float8E4M3::from_f32 on the host.
__device__ inline u8 f2e4m3(float f) {
    u32 x = f32_bits(f);
    u32 sign = (x >> 24) & 0x80u;
    u32 a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return (u8)(sign | 0x7fu);
    if (a >= 0x43e00000u) return (u8)(sign | 0x7eu);  // at least 448
    if (a < 0x3c800000u) {                            // below 2^-6: steps of 2^-9
        float q = bits_f32(a) * 512.0f;                 // exact: a power-of-two scaling
        u32 k = (u32)q;
        float rem = q - (float)k;
        if (rem > 0.5f || (rem == 0.5f && (k & 1u) != 0u)) k += 1u;
        return (u8)(sign | k);                          // 8 steps is 0x08, the smallest normal
    }
    u32 r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;   // keep 3 mantissa bits
    return (u8)(sign | (r - (120u << 3)));             // exponent bias 127 -> 7
}

// e4m3fn -> f32, exact.
__device__ inline float e4m32f(u8 c) {
    u32 m = (u32)c & 0x7fu;
    float a;
    if (m == 0x7fu) a = bits_f32(0x7fc00000u);
    else if ((m >> 3) == 0u) a = (float)m * (1.0f / 512.0f);
    else a = bits_f32((((m >> 3) + 120u) << 23) | ((m & 7u) << 20));
    return ((u32)c & 0x80u) != 0u ? -a : a;
}

// torchao's amax_to_scale: 448 / max(amax, 1e-12) in f64, rounded to f32;
// NaN stays NaN. As Float8E4M3::scale_for on the host.
__device__ inline float f8_scale(float amax) {
    double a = (double)amax;
    if (a < 1e-12) a = 1e-12;
    return (float)(448.0 / a);
}

// The larger magnitude, NaN if either is.
__device__ inline double max_nan(double a, double b) {
    if (a != a) return a;
    if (b != b) return b;
    return b > a ? b : a;
}

// ---- loads and stores by dtype code ----

// Load as the f32 opmath value (f64 sources round to nearest).
__device__ inline float ldf(const void* p, int t, u64 i) {
    switch (t) {
        case T_F32: return ((const float*)p)[i];
        case T_F64: return (float)((const double*)p)[i];
        case T_F16: return h2f(((const u16*)p)[i]);
        default: return b2f(((const u16*)p)[i]);
    }
}
// Load exactly, widened to f64.
__device__ inline double ldd(const void* p, int t, u64 i) {
    switch (t) {
        case T_F32: return (double)((const float*)p)[i];
        case T_F64: return ((const double*)p)[i];
        case T_F16: return (double)h2f(((const u16*)p)[i]);
        default: return (double)b2f(((const u16*)p)[i]);
    }
}
// Store an f32 opmath value, rounding once.
__device__ inline void stf(void* p, int t, u64 i, float v) {
    switch (t) {
        case T_F32: ((float*)p)[i] = v; break;
        case T_F64: ((double*)p)[i] = (double)v; break;
        case T_F16: ((u16*)p)[i] = f2h(v); break;
        default: ((u16*)p)[i] = f2b(v); break;
    }
}
// Store an f64 value, rounding once.
__device__ inline void std64(void* p, int t, u64 i, double v) {
    switch (t) {
        case T_F32: ((float*)p)[i] = (float)v; break;
        case T_F64: ((double*)p)[i] = v; break;
        case T_F16: ((u16*)p)[i] = f2h(d2f_odd(v)); break;
        default: ((u16*)p)[i] = f2b(d2f_odd(v)); break;
    }
}
__device__ inline void copy_elem(void* dst, const void* src, int t, u64 i) {
    switch (t) {
        case T_F32: ((float*)dst)[i] = ((const float*)src)[i]; break;
        case T_F64: ((double*)dst)[i] = ((const double*)src)[i]; break;
        default: ((u16*)dst)[i] = ((const u16*)src)[i]; break;
    }
}
__device__ inline void zero_elem(void* dst, int t, u64 i) {
    switch (t) {
        case T_F32: ((float*)dst)[i] = 0.0f; break;
        case T_F64: ((double*)dst)[i] = 0.0; break;
        default: ((u16*)dst)[i] = 0; break;
    }
}

// ---- elementwise kernels ----

// Fill with a pattern of `width` bytes (1, 2, 4 or 8), little-endian in `pattern`.
extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_fill(void* dst, int width, u64 n, u64 pattern) {
    switch (width) {
        case 1: { GRID_STRIDE(i, n) ((u8*)dst)[i] = (u8)pattern; break; }
        case 2: { GRID_STRIDE(i, n) ((u16*)dst)[i] = (u16)pattern; break; }
        case 4: { GRID_STRIDE(i, n) ((u32*)dst)[i] = (u32)pattern; break; }
        default: { GRID_STRIDE(i, n) ((u64*)dst)[i] = pattern; break; }
    }
}

extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_cast(const void* src, int st, void* dst, int dt, u64 n) {
    GRID_STRIDE(i, n) std64(dst, dt, i, ldd(src, st, i));
}

extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_scale(void* x, int t, u64 n, double alpha) {
    if (t == T_F64) {
        GRID_STRIDE(i, n) ((double*)x)[i] = ((double*)x)[i] * alpha;
    } else {
        float a = (float)alpha;
        GRID_STRIDE(i, n) stf(x, t, i, ldf(x, t, i) * a);
    }
}

// clip_grad_norm_'s scaling with the norm read here, not on the host: every
// thread computes the same coefficient from the two squared-norm parts (in
// f64, as the host did) and leaves x alone unless it is below 1.
extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_clip_scale(void* x, int t, u64 n, const void* sq_a, int at, const void* sq_b, int bt, double max_norm) {
    double coef = max_norm / (sqrt(ldd(sq_a, at, 0) + ldd(sq_b, bt, 0)) + 1e-6);
    if (!(coef < 1.0)) return;
    if (t == T_F64) {
        GRID_STRIDE(i, n) ((double*)x)[i] = ((double*)x)[i] * coef;
    } else {
        float a = (float)coef;
        GRID_STRIDE(i, n) stf(x, t, i, ldf(x, t, i) * a);
    }
}

extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_accumulate(const void* src, int st, void* dst, int dt, u64 n) {
    if (dt == T_F64) {
        GRID_STRIDE(i, n) ((double*)dst)[i] = ((double*)dst)[i] + ldd(src, st, i);
    } else {
        GRID_STRIDE(i, n) stf(dst, dt, i, ldf(dst, dt, i) + ldf(src, st, i));
    }
}

// Integer dtypes wrap, as NCCL and the host do: add as unsigned.
extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_accumulate_int(const void* src, void* dst, int t, u64 n) {
    switch (t) {
        case T_I32: { GRID_STRIDE(i, n) ((u32*)dst)[i] = ((u32*)dst)[i] + ((const u32*)src)[i]; break; }
        case T_I64: { GRID_STRIDE(i, n) ((u64*)dst)[i] = ((u64*)dst)[i] + ((const u64*)src)[i]; break; }
        default: { GRID_STRIDE(i, n) ((u8*)dst)[i] = (u8)(((u8*)dst)[i] + ((const u8*)src)[i]); break; }
    }
}

extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_axpy(double alpha, const void* x, int xt, void* y, int yt, u64 n) {
    if (yt == T_F64) {
        GRID_STRIDE(i, n) ((double*)y)[i] = ((double*)y)[i] + alpha * ldd(x, xt, i);
    } else {
        float a = (float)alpha;
        GRID_STRIDE(i, n) stf(y, yt, i, ldf(y, yt, i) + a * ldf(x, xt, i));
    }
}

extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_bias_add(void* x, int xt, const void* bias, int bt, u64 n, u64 cols) {
    if (xt == T_F64) {
        GRID_STRIDE(i, n) ((double*)x)[i] = ((double*)x)[i] + ldd(bias, bt, i % cols);
    } else {
        GRID_STRIDE(i, n) stf(x, xt, i, ldf(x, xt, i) + ldf(bias, bt, i % cols));
    }
}

// NaN propagates, as in PyTorch: only x <= 0 becomes 0.
extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_relu(const void* x, void* y, int t, u64 n) {
    GRID_STRIDE(i, n) {
        if (ldd(x, t, i) <= 0.0) zero_elem(y, t, i); else copy_elem(y, x, t, i);
    }
}

// The gradient passes where the output is not <= 0 (NaN included).
extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_relu_backward(const void* grad_out, const void* out, void* grad_in, int t, u64 n) {
    GRID_STRIDE(i, n) {
        if (ldd(out, t, i) <= 0.0) zero_elem(grad_in, t, i); else copy_elem(grad_in, grad_out, t, i);
    }
}

extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_mse_grad(const void* p, int pt, const void* q, int qt, void* g, int gt, u64 n, double scale) {
    if (gt == T_F64) {
        double s = 2.0 * scale;
        GRID_STRIDE(i, n) ((double*)g)[i] = s * (ldd(p, pt, i) - ldd(q, qt, i));
    } else {
        float s = (float)(2.0 * scale);
        GRID_STRIDE(i, n) stf(g, gt, i, s * (ldf(p, pt, i) - ldf(q, qt, i)));
    }
}

extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_column_sums(const void* x, int xt, void* out, int ot, u64 rows, u64 cols, int accumulate) {
    GRID_STRIDE(c, cols) {
        if (ot == T_F64) {
            double acc = 0.0;
            for (u64 r = 0; r < rows; r++) acc = acc + ldd(x, xt, r * cols + c);
            ((double*)out)[c] = accumulate ? ((double*)out)[c] + acc : acc;
        } else {
            float acc = 0.0f;
            for (u64 r = 0; r < rows; r++) acc = acc + ldf(x, xt, r * cols + c);
            stf(out, ot, c, accumulate ? ldf(out, ot, c) + acc : acc);
        }
    }
}

// ---- single-block reductions ----

// The sum over one block (blockDim.x a power of two, at most CHORUS_REDUCE_BLOCK): deterministic.
__device__ inline double block_sum(double v) {
    __shared__ double part[CHORUS_REDUCE_BLOCK];
    part[threadIdx.x] = v;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    double total = part[0];
    __syncthreads();
    return total;
}

extern "C" __global__ void __launch_bounds__(CHORUS_REDUCE_BLOCK) chorus_mse_loss(const void* p, int pt, const void* q, int qt, void* loss, int lt, u64 n, double scale) {
    double acc = 0.0;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) {
        double d = ldd(p, pt, i) - ldd(q, qt, i);
        acc += d * d;
    }
    double total = block_sum(acc);
    if (threadIdx.x == 0) std64(loss, lt, 0, total * scale);
}

extern "C" __global__ void __launch_bounds__(CHORUS_REDUCE_BLOCK) chorus_sum_squares(const void* x, int xt, void* out, int ot, u64 n, int accumulate) {
    double acc = 0.0;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) {
        double v = ldd(x, xt, i);
        acc += v * v;
    }
    double total = block_sum(acc);
    if (threadIdx.x == 0) std64(out, ot, 0, accumulate ? ldd(out, ot, 0) + total : total);
}

// sum_squares over many blocks, still deterministic: block b sums its fixed
// chunk x[b*chunk, min((b+1)*chunk, n)) into part[b] (one block cannot keep
// enough loads in flight to read a large tensor at the memory's speed: a
// 1.1B-parameter gradient norm took 0.4 s on an H200), then one block sums
// the parts in a fixed order (sum_squares_split gives chunk and parts).
extern "C" __global__ void __launch_bounds__(CHORUS_REDUCE_BLOCK) chorus_sum_squares_part(const void* x, int xt, double* part, u64 n, u64 chunk) {
    u64 start = (u64)blockIdx.x * chunk;
    u64 end = start + chunk < n ? start + chunk : n;
    double acc = 0.0;
    for (u64 i = start + threadIdx.x; i < end; i += blockDim.x) {
        double v = ldd(x, xt, i);
        acc += v * v;
    }
    double total = block_sum(acc);
    if (threadIdx.x == 0) part[blockIdx.x] = total;
}

extern "C" __global__ void __launch_bounds__(CHORUS_REDUCE_BLOCK) chorus_sum_squares_finish(const double* part, u64 parts, void* out, int ot, int accumulate) {
    double acc = 0.0;
    for (u64 i = threadIdx.x; i < parts; i += blockDim.x) acc += part[i];
    double total = block_sum(acc);
    if (threadIdx.x == 0) std64(out, ot, 0, accumulate ? ldd(out, ot, 0) + total : total);
}

// The NaN-propagating max over one block (as block_sum): deterministic.
__device__ inline double block_max(double v) {
    __shared__ double part[CHORUS_REDUCE_BLOCK];
    part[threadIdx.x] = v;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] = max_nan(part[threadIdx.x], part[threadIdx.x + s]);
        __syncthreads();
    }
    double total = part[0];
    __syncthreads();
    return total;
}

// out[0] (max)= max |x|: the amax of float8 scaling.
extern "C" __global__ void __launch_bounds__(CHORUS_REDUCE_BLOCK) chorus_abs_max(const void* x, int xt, float* out, u64 n, int accumulate) {
    double m = 0.0;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) {
        double v = ldd(x, xt, i);
        m = max_nan(m, v < 0.0 ? -v : v);
    }
    double total = block_max(m);
    if (threadIdx.x == 0) out[0] = (float)(accumulate ? max_nan((double)out[0], total) : total);
}

// ---- float8 scaled casts ----

extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_quantize_f8(const void* src, int st, const float* amax, u8* dst, u64 n) {
    float scale = f8_scale(amax[0]);
    GRID_STRIDE(i, n) dst[i] = f2e4m3(ldf(src, st, i) * scale);
}

extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_dequantize_f8(const u8* src, const float* amax, void* dst, int dt, u64 n) {
    float scale = f8_scale(amax[0]);
    GRID_STRIDE(i, n) stf(dst, dt, i, e4m32f(src[i]) / scale);
}

// ---- optimizers (f32) ----

// torch.optim.SGD's single-tensor update.
extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_sgd(float* w, const float* g, float* buf, u64 n, float lr, float wd, float mom,
                                      float damp, int has_wd, int use_momentum, int first_step, int nesterov) {
    GRID_STRIDE(i, n) {
        float d = has_wd ? g[i] + wd * w[i] : g[i];
        if (use_momentum) {
            float b = first_step ? d : buf[i] * mom + damp * d;
            buf[i] = b;
            float step = nesterov ? d + mom * b : b;
            w[i] = w[i] + -lr * step;
        } else {
            w[i] = w[i] + -lr * d;
        }
    }
}

// torch.optim.AdamW's single-tensor update (the scalars computed on the host in f64).
extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_adamw(float* w, const float* g, float* m, float* v, u64 n, float decay,
                                        float one_minus_b1, float b2, float one_minus_b2, float bc2_sqrt,
                                        float step_size, float eps) {
    GRID_STRIDE(i, n) {
        float wi = w[i] * decay;
        float gi = g[i];
        float mi = m[i] + one_minus_b1 * (gi - m[i]);
        float vi = v[i] * b2 + one_minus_b2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        w[i] = wi + -step_size * (mi / denom);
    }
}

// ---- batched copies and fills: many pieces, one launch ----

// One strided copy of `rows` blocks of `row_units` units of `unit` bytes (1,
// 2, 4, 8 or 16, dividing both addresses and both pitches); pitches in bytes.
struct chorus_copy_piece_t {
    u64 src, dst, rows, row_units, src_pitch, dst_pitch, unit;
};
// The launch's pieces, passed by value as its one parameter (under the 4 KiB
// both launch APIs allow); block row `blockIdx.y` copies piece `blockIdx.y`.
struct chorus_copy_batch_t {
    u64 count;
    chorus_copy_piece_t piece[CHORUS_BATCH];
};
struct alignas(16) chorus_u128 {
    u64 lo, hi;
};

__device__ inline void copy_unit(u8* d, const u8* s, u64 unit) {
    switch (unit) {
        case 16: *(chorus_u128*)d = *(const chorus_u128*)s; break;
        case 8: *(u64*)d = *(const u64*)s; break;
        case 4: *(u32*)d = *(const u32*)s; break;
        case 2: *(u16*)d = *(const u16*)s; break;
        default: *d = *s; break;
    }
}

extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_copy_batch(chorus_copy_batch_t batch) {
    if ((u64)blockIdx.y >= batch.count) return;
    const chorus_copy_piece_t p = batch.piece[blockIdx.y];
    const u8* src = (const u8*)p.src;
    u8* dst = (u8*)p.dst;
    if (p.rows == 1) {
        GRID_STRIDE(i, p.row_units) copy_unit(dst + i * p.unit, src + i * p.unit, p.unit);
    } else {
        u64 n = p.rows * p.row_units;
        GRID_STRIDE(i, n) {
            u64 r = i / p.row_units;
            u64 c = (i - r * p.row_units) * p.unit;
            copy_unit(dst + r * p.dst_pitch + c, src + r * p.src_pitch + c, p.unit);
        }
    }
}

// One fill of `n` elements of `width` bytes (1, 2, 4 or 8) with `pattern` (little-endian).
struct chorus_fill_piece_t {
    u64 dst, n, width, pattern;
};
struct chorus_fill_batch_t {
    u64 count;
    chorus_fill_piece_t piece[CHORUS_BATCH];
};

extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_fill_batch(chorus_fill_batch_t batch) {
    if ((u64)blockIdx.y >= batch.count) return;
    const chorus_fill_piece_t p = batch.piece[blockIdx.y];
    switch (p.width) {
        case 1: { GRID_STRIDE(i, p.n) ((u8*)p.dst)[i] = (u8)p.pattern; break; }
        case 2: { GRID_STRIDE(i, p.n) ((u16*)p.dst)[i] = (u16)p.pattern; break; }
        case 4: { GRID_STRIDE(i, p.n) ((u32*)p.dst)[i] = (u32)p.pattern; break; }
        default: { GRID_STRIDE(i, p.n) ((u64*)p.dst)[i] = p.pattern; break; }
    }
}

// ---- matmul (the hip device's; the cuda device calls cuBLAS) ----

__device__ inline float ld_as(const void* p, int t, u64 i, float) { return ldf(p, t, i); }
__device__ inline double ld_as(const void* p, int t, u64 i, double) { return ldd(p, t, i); }

// C[m x n] (+)= op(A)[m x k] op(B)[k x n], row-major, in tiles of CHORUS_TILE^2
// threads, accumulating in A (f32, or f64 for f64 inputs); the old C is added
// in f64 and the sum rounded into C once, as on the cpu device.
template <class A>
__device__ inline void matmul_tiles(const void* a, const void* b, int t, void* c, int ct, u64 m, u64 n, u64 k,
                                    int trans_a, int trans_b, int accumulate) {
    __shared__ A ta[CHORUS_TILE][CHORUS_TILE + 1];
    __shared__ A tb[CHORUS_TILE][CHORUS_TILE + 1];
    u64 col = (u64)blockIdx.x * CHORUS_TILE + threadIdx.x;
    for (u64 row_tile = blockIdx.y; row_tile * CHORUS_TILE < m; row_tile += gridDim.y) {
        u64 row = row_tile * CHORUS_TILE + threadIdx.y;
        A acc = (A)0;
        for (u64 k0 = 0; k0 < k; k0 += CHORUS_TILE) {
            u64 ka = k0 + threadIdx.x;
            ta[threadIdx.y][threadIdx.x] = (row < m && ka < k) ? ld_as(a, t, trans_a ? ka * m + row : row * k + ka, acc) : (A)0;
            u64 kb = k0 + threadIdx.y;
            tb[threadIdx.y][threadIdx.x] = (kb < k && col < n) ? ld_as(b, t, trans_b ? col * k + kb : kb * n + col, acc) : (A)0;
            __syncthreads();
            for (int j = 0; j < CHORUS_TILE; ++j) acc = acc + ta[threadIdx.y][j] * tb[j][threadIdx.x];
            __syncthreads();
        }
        if (row < m && col < n) {
            u64 at = row * n + col;
            double o = (double)acc;
            std64(c, ct, at, accumulate ? ldd(c, ct, at) + o : o);
        }
    }
}

extern "C" __global__ void __launch_bounds__(CHORUS_TILE * CHORUS_TILE) chorus_matmul(const void* a, const void* b, int t, void* c, int ct, u64 m, u64 n, u64 k,
                                                                  int trans_a, int trans_b, int accumulate) {
    if (t == T_F64) {
        matmul_tiles<double>(a, b, t, c, ct, m, n, k, trans_a, trans_b, accumulate);
    } else {
        matmul_tiles<float>(a, b, t, c, ct, m, n, k, trans_a, trans_b, accumulate);
    }
}
