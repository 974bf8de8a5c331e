// What every chorus kernel shares: the element types (f32, bf16, f16 as
// bit patterns, converted by integer code that rounds to nearest even, so
// the CPU build of this source rounds exactly as the GPU does), block and
// warp reductions, and the tensor-core primitives (mma.sync m16n8k16,
// ldmatrix) the attention kernels are written with.
//
// The same source compiles two ways: nvcc makes PTX of it for the GPU
// (__CUDA_ARCH__ defined: inline PTX), and the tests compile it with the
// host's C++ compiler under a prelude that runs a block's threads as OS
// threads and emulates the warp-level primitives (`chorus_warp_*`), so the
// kernels' indexing, masking and online softmax are checked against the
// Rust reference on the CPU (kernels/tests/host_kernels.rs).
#pragma once
#include <math.h>

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// ---- element types -----------------------------------------------------

static __device__ __forceinline__ float bits_f32(u32 u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static __device__ __forceinline__ u32 f32_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    u32 u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

// bf16: the high half of an f32; rounded to nearest even, NaN kept quiet.
static __device__ __forceinline__ float bf16_to_f32(u16 b) { return bits_f32(((u32)b) << 16); }
static __device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);
    return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// f16 (IEEE binary16): subnormals, overflow to infinity, ties to even.
static __device__ __forceinline__ float f16_to_f32(u16 h) {
    u32 sign = ((u32)h & 0x8000u) << 16, exp = ((u32)h >> 10) & 0x1fu, man = (u32)h & 0x3ffu;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0) return bits_f32(sign);
        float v = (float)man * (1.0f / 16777216.0f);  // man * 2^-24
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}
static __device__ __forceinline__ u16 f32_to_f16(float f) {
    u32 u = f32_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (u16)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (u16)(sign | 0x7c00u);  // rounds to infinity
    if (a < 0x38800000u) {                               // subnormal or zero in f16
        if (a < 0x33000000u) return (u16)sign;           // below half the smallest subnormal
        u32 e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, shift = 126u - e;
        u32 q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (u16)(sign | q);
    }
    u32 r = a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u;
    return (u16)(sign | (r >> 13));
}

// The storage types the kernels are instantiated for, each with its loads and stores in f32.
struct F32 {
    typedef float T;
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float store(float v) { return v; }
};
struct BF16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(u16 v) { return bf16_to_f32(v); }
    static __device__ __forceinline__ u16 store(float v) { return f32_to_bf16(v); }
};
struct F16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(u16 v) { return f16_to_f32(v); }
    static __device__ __forceinline__ u16 store(float v) { return f32_to_f16(v); }
};

// Two f32 rounded into one 32-bit register of two 16-bit values, `lo` in the low half
// (the lower-indexed element, as mma's operands want).
template <typename E> static __device__ __forceinline__ u32 pack2(float lo, float hi) {
    return (u32)E::store(lo) | ((u32)E::store(hi) << 16);
}
#ifdef __CUDA_ARCH__
// The same roundings (to nearest even) by the hardware's paired conversions.
template <> __device__ __forceinline__ u32 pack2<BF16>(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
template <> __device__ __forceinline__ u32 pack2<F16>(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
#endif

// ---- warp primitives and fast math --------------------------------------

#ifdef __CUDA_ARCH__
static __device__ __forceinline__ float chorus_shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
// 2^x on the special-function unit (relative error about 2^-22): the softmax's exponent.
static __device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#else
static __device__ __forceinline__ float fast_exp2(float x) { return exp2f(x); }
#endif

// ---- reductions --------------------------------------------------------

static __device__ __forceinline__ float warp_sum(float v) {
    for (int m = 16; m > 0; m >>= 1) v += chorus_shfl_xor(v, m);
    return v;
}

static __device__ __forceinline__ float warp_max(float v) {
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, chorus_shfl_xor(v, m));
    return v;
}

// The sum of `v` over the block (blockDim.x a multiple of 32, at most 1024),
// returned to every thread; `scratch` holds 32 floats.
static __device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < warps; w++) total += scratch[w];
    return total;
}

// ---- tensor cores ------------------------------------------------------
//
// The fragments of mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"),
// for lane L with g = L / 4 and t = L % 4, each 32-bit register holding two
// 16-bit elements (the lower index in the low half):
//   A (16x16, row major): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
//   B (16x8, "col"):      b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
//   C, D (16x8, f32):     c0, c1 = C[g][2t..2t+1], c2, c3 = C[g+8][2t..2t+1]
// ldmatrix.x4 loads four 8x8 matrices of 16-bit elements: lane L gives the
// address of row L % 8 of matrix L / 8; matrix i arrives in register i, lane L
// holding its row L / 4, columns 2(L % 4) and 2(L % 4) + 1 (with .trans: its
// rows 2(L % 4) and 2(L % 4) + 1 of column L / 4).

#ifdef __CUDA_ARCH__
static __device__ __forceinline__ void mma_16816(float d[4], const u32 a[4], const u32 b[2], bool bf16) {
    if (bf16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}

static __device__ __forceinline__ void ldmatrix_x4(u32 r[4], const u16* row) {
    u32 addr = (u32)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

static __device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const u16* row) {
    u32 addr = (u32)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
#else
// The host build: the prelude's warp emulation (`chorus_host_mma`, `chorus_host_ldmatrix`).
static __device__ __forceinline__ void mma_16816(float d[4], const u32 a[4], const u32 b[2], bool bf16) {
    chorus_host_mma(d, a, b, bf16);
}
static __device__ __forceinline__ void ldmatrix_x4(u32 r[4], const u16* row) { chorus_host_ldmatrix(r, row, false); }
static __device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const u16* row) {
    chorus_host_ldmatrix(r, row, true);
}
#endif

// c0 += a·(b[0], b[1]) and c1 += a·(b[2], b[3]): the two n-tiles an
// ldmatrix.x4 of B loads (matrices 0, 1 the first tile's k halves, 2, 3 the second's).
static __device__ __forceinline__ void mma_pair(float c0[4], float c1[4], const u32 a[4], const u32 b[4], bool bf16) {
    u32 b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
    mma_16816(c0, a, b0, bf16);
    mma_16816(c1, a, b1, bf16);
}

template <typename E> struct IsBf16 { static const bool value = false; };
template <> struct IsBf16<BF16> { static const bool value = true; };

// cp.async (sm_80 on): 16 bytes from global to shared memory without passing
// through registers, zeros when !valid (a source size of 0: nothing is read;
// `src` must still be a valid address). The copies a thread issues after its
// last commit form a group at the next commit; cp_async_wait<N> returns when
// at most the newest N of its groups are still in flight, and a barrier after
// it makes every thread's landed copies visible to the block.
static __device__ __forceinline__ void cp_async16(u16* dst, const u16* src, bool valid) {
#ifdef __CUDA_ARCH__
    unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(bytes) : "memory");
#else
    chorus_host_cp_async16(dst, src, valid);
#endif
}
static __device__ __forceinline__ void cp_async_commit() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#else
    chorus_host_cp_async_commit();
#endif
}
template <int N>
static __device__ __forceinline__ void cp_async_wait() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#else
    chorus_host_cp_async_wait(N);
#endif
}

// Copies 16 bytes (eight 16-bit elements) from global to shared memory, or zeros when !valid.
static __device__ __forceinline__ void copy16(u16* dst, const u16* src, bool valid) {
#ifdef __CUDA_ARCH__
    uint4 v = valid ? *(const uint4*)src : make_uint4(0, 0, 0, 0);
    *(uint4*)dst = v;
#else
    if (valid) memcpy(dst, src, 16);
    else memset(dst, 0, 16);
#endif
}
