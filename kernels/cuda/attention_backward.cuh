// Causal flash attention with grouped-query heads, backward
// (kernels/src/attention.rs has the math, the layouts and the CPU reference).
//
// 1. `dot`: D[b, h, i] = dO_i . O_i per query row (f32), one warp a row.
// 2. The tensor-core kernel (bf16/f16, head_dim 64 or 128): a block owns a
//    tile of keys of one kv head (16 keys a warp), their K and V in shared
//    memory for the whole kernel; it walks every query head of the group
//    and every query tile that sees its keys, recomputing P^T = exp(S^T - lse)
//    from the saved log-sum-exp, and accumulates dV += P^T dO and
//    dK += dS^T Q in registers (no atomics: a block owns its keys), with
//    dS^T = P^T (dP^T - D), dP^T = V dO^T. dQ += dS K goes through shared
//    memory (dS^T written once, read transposed) and is added into an f32
//    buffer with atomics, since every key block adds to every query row.
// 3. `dq`: the f32 dQ rounded into the output.
// The fallback (any dtype, head_dim up to 256): a warp per query row for dQ
// and a warp per key row for dK, dV, both deterministic.
#pragma once
#include "attention_forward.cuh"

#define ATT_LOG2E 1.44269504088896340736f

template <typename E>
static __device__ void attention_backward_dot(const typename E::T* dout, const typename E::T* o, float* dvec, int B,
                                              int T, int H, int D) {
    const int lane = threadIdx.x & 31;
    const u64 row = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= (u64)B * T * H) return;
    const int h = (int)(row % H), i = (int)((row / H) % T), b = (int)(row / ((u64)H * T));
    float part = 0.0f;
    for (int e = lane; e < D; e += 32) part += E::load(dout[row * D + e]) * E::load(o[row * D + e]);
    part = warp_sum(part);
    if (lane == 0) dvec[((u64)b * H + h) * T + i] = part;
}

// NW warps, 16 keys each; BR query rows per inner tile (BR == 16 * NW: in the dQ step each warp takes 16 rows).
template <typename E, int D, int NW, int BR>
static __device__ void attention_backward_tc(const u16* q, const u16* k, const u16* v, const u16* dout,
                                             const float* lse, const float* dvec, float* dq_acc, u16* dk, u16* dv,
                                             int T, int S, int H, int KVH, float scale) {
    constexpr int BC = 16 * NW, LD = D + 8, LDS = BR + 8;
    __shared__ __align__(16) u16 sK[BC * LD];
    __shared__ __align__(16) u16 sV[BC * LD];
    __shared__ __align__(16) u16 sQ[BR * LD];
    __shared__ __align__(16) u16 sdO[BR * LD];
    __shared__ __align__(16) u16 sdS[BC * LDS];
    __shared__ float sL[BR], sD[BR];
    const bool bf = IsBf16<E>::value;
    const float scale_log2 = scale * ATT_LOG2E;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int kv0 = blockIdx.x * BC, kvh = blockIdx.y, b = blockIdx.z, rep = H / KVH, off = S - T;
    const u64 q_stride = (u64)H * D, kv_stride = (u64)KVH * D;
    const u64 kv_base = (u64)b * S * kv_stride + (u64)kvh * D;

    #pragma unroll
    for (int c = tid; c < BC * (D / 8); c += blockDim.x) {
        int r = c / (D / 8), e = (c % (D / 8)) * 8;
        bool in = kv0 + r < S;
        copy16(&sK[r * LD + e], k + kv_base + (u64)(kv0 + r) * kv_stride + e, in);
        copy16(&sV[r * LD + e], v + kv_base + (u64)(kv0 + r) * kv_stride + e, in);
    }

    float dk_acc[D / 8][4], dv_acc[D / 8][4];
    #pragma unroll
    for (int dn = 0; dn < D / 8; dn++)
        #pragma unroll
        for (int e = 0; e < 4; e++) dk_acc[dn][e] = dv_acc[dn][e] = 0.0f;
    // The first query row that sees key kv0 sits at kv0 - off.
    int i_start = kv0 - off > 0 ? kv0 - off : 0;
    i_start = (i_start / BR) * BR;

    for (int r = 0; r < rep; r++) {
        const int h = kvh * rep + r;
        const u64 q_base = (u64)b * T * q_stride + (u64)h * D, row_base = ((u64)b * H + h) * T;
        for (int i0 = i_start; i0 < T; i0 += BR) {
            __syncthreads();  // the previous tile's reads of sQ, sdO, sdS are done
            #pragma unroll
            for (int c = tid; c < BR * (D / 8); c += blockDim.x) {
                int rr = c / (D / 8), e = (c % (D / 8)) * 8;
                bool in = i0 + rr < T;
                copy16(&sQ[rr * LD + e], q + q_base + (u64)(i0 + rr) * q_stride + e, in);
                copy16(&sdO[rr * LD + e], dout + q_base + (u64)(i0 + rr) * q_stride + e, in);
            }
            for (int rr = tid; rr < BR; rr += blockDim.x) {
                bool in = i0 + rr < T;
                sL[rr] = in ? lse[row_base + i0 + rr] * ATT_LOG2E : INFINITY;  // a missing row gets p = 0
                sD[rr] = in ? dvec[row_base + i0 + rr] : 0.0f;
            }
            __syncthreads();

            // S^T = K Q^T: this warp's 16 keys against the tile's BR queries.
            float st[BR / 8][4], dpt[BR / 8][4];
            #pragma unroll
            for (int nt = 0; nt < BR / 8; nt++)
                #pragma unroll
                for (int e = 0; e < 4; e++) st[nt][e] = dpt[nt][e] = 0.0f;
            #pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                u32 kf[4], vf[4];
                int arow = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, acol = kk * 16 + (lane >> 4) * 8;
                ldmatrix_x4(kf, &sK[arow * LD + acol]);
                ldmatrix_x4(vf, &sV[arow * LD + acol]);
                #pragma unroll
                for (int nt = 0; nt < BR / 8; nt += 2) {
                    u32 qf[4], of[4];
                    int brow = nt * 8 + (lane & 7) + (lane >> 4) * 8, bcol = kk * 16 + ((lane >> 3) & 1) * 8;
                    ldmatrix_x4(qf, &sQ[brow * LD + bcol]);
                    ldmatrix_x4(of, &sdO[brow * LD + bcol]);
                    mma_pair(st[nt], st[nt + 1], kf, qf, bf);
                    mma_pair(dpt[nt], dpt[nt + 1], vf, of, bf);  // dP^T = V dO^T
                }
            }

            // P^T from the saved log-sum-exp; dS^T = P^T (dP^T - D). The mask
            // only on a tile that reaches past the keys or the queries, or
            // holds a key its first query does not see (the diagonal).
            const bool whole = kv0 + BC <= S && i0 + BR <= T && kv0 + BC - 1 <= off + i0;
            #pragma unroll
            for (int nt = 0; nt < BR / 8; nt++) {
                #pragma unroll
                for (int e = 0; e < 4; e++) {
                    int key = kv0 + warp * 16 + g + (e >> 1) * 8, ql = nt * 8 + 2 * t4 + (e & 1), qi = i0 + ql;
                    bool seen = whole || (key < S && qi < T && key <= off + qi);
                    float p = seen ? fast_exp2(st[nt][e] * scale_log2 - sL[ql]) : 0.0f;
                    st[nt][e] = p;
                    dpt[nt][e] = p * (dpt[nt][e] - sD[ql]);
                }
            }

            // dV += P^T dO and dK += dS^T Q, the A operands straight from the accumulators.
            #pragma unroll
            for (int kk = 0; kk < BR / 16; kk++) {
                u32 pa[4], da[4];
                accumulators_as_a<E>(st, kk, pa);
                accumulators_as_a<E>(dpt, kk, da);
                #pragma unroll
                for (int dn = 0; dn < D / 8; dn += 2) {
                    u32 of[4], qf[4];
                    int row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, col = dn * 8 + (lane >> 4) * 8;
                    ldmatrix_x4_trans(of, &sdO[row * LD + col]);
                    ldmatrix_x4_trans(qf, &sQ[row * LD + col]);
                    mma_pair(dv_acc[dn], dv_acc[dn + 1], pa, of, bf);
                    mma_pair(dk_acc[dn], dk_acc[dn + 1], da, qf, bf);
                }
            }

            // dS^T into shared memory, [key][query], for dQ.
            #pragma unroll
            for (int nt = 0; nt < BR / 8; nt++) {
                #pragma unroll
                for (int i = 0; i < 2; i++) {
                    int kl = warp * 16 + g + i * 8, ql = nt * 8 + 2 * t4;
                    *(u32*)&sdS[kl * LDS + ql] = pack2<E>(dpt[nt][2 * i], dpt[nt][2 * i + 1]);
                }
            }
            __syncthreads();

            // dQ += dS K for this warp's 16 query rows of the tile, added into the f32 buffer.
            float dq[D / 8][4];
            #pragma unroll
            for (int dn = 0; dn < D / 8; dn++)
                #pragma unroll
                for (int e = 0; e < 4; e++) dq[dn][e] = 0.0f;
            #pragma unroll
            for (int kk = 0; kk < BC / 16; kk++) {
                u32 sa[4];
                int srow = kk * 16 + (lane & 7) + (lane >> 4) * 8, scol = warp * 16 + ((lane >> 3) & 1) * 8;
                ldmatrix_x4_trans(sa, &sdS[srow * LDS + scol]);
                #pragma unroll
                for (int dn = 0; dn < D / 8; dn += 2) {
                    u32 kf[4];
                    int row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, col = dn * 8 + (lane >> 4) * 8;
                    ldmatrix_x4_trans(kf, &sK[row * LD + col]);
                    mma_pair(dq[dn], dq[dn + 1], sa, kf, bf);
                }
            }
            #pragma unroll
            for (int i = 0; i < 2; i++) {
                int qi = i0 + warp * 16 + g + i * 8;
                if (qi >= T) continue;
                float* dst = dq_acc + q_base + (u64)qi * q_stride;
                #pragma unroll
                for (int dn = 0; dn < D / 8; dn++) {
                    atomicAdd(dst + dn * 8 + 2 * t4, dq[dn][2 * i] * scale);
                    atomicAdd(dst + dn * 8 + 2 * t4 + 1, dq[dn][2 * i + 1] * scale);
                }
            }
        }
    }

    #pragma unroll
    for (int i = 0; i < 2; i++) {
        int key = kv0 + warp * 16 + g + i * 8;
        if (key >= S) continue;
        u64 at = kv_base + (u64)key * kv_stride;
        #pragma unroll
        for (int dn = 0; dn < D / 8; dn++) {
            *(u32*)&dk[at + dn * 8 + 2 * t4] = pack2<E>(dk_acc[dn][2 * i] * scale, dk_acc[dn][2 * i + 1] * scale);
            *(u32*)&dv[at + dn * 8 + 2 * t4] = pack2<E>(dv_acc[dn][2 * i], dv_acc[dn][2 * i + 1]);
        }
    }
}

// The f32 dQ rounded into the output's dtype.
template <typename E>
static __device__ void attention_backward_dq(const float* dq_acc, typename E::T* dq, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        dq[i] = E::store(dq_acc[i]);
    }
}

// Fallback dQ: one warp per query row (b, i, h).
template <typename E>
static __device__ void attention_backward_simple_dq(const typename E::T* q, const typename E::T* k,
                                                    const typename E::T* v, const typename E::T* dout,
                                                    const float* lse, const float* dvec, typename E::T* dq, int B,
                                                    int T, int S, int H, int KVH, int D, float scale) {
    const int lane = threadIdx.x & 31;
    const u64 row = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= (u64)B * T * H) return;
    const int h = (int)(row % H), i = (int)((row / H) % T), b = (int)(row / ((u64)H * T));
    const int kvh = h / (H / KVH), off = S - T;
    const u64 kv_stride = (u64)KVH * D, at = ((u64)b * H + h) * T + i;
    const float l = lse[at], big_d = dvec[at];
    float qc[ATT_SIMPLE_CHUNKS], doc[ATT_SIMPLE_CHUNKS], acc[ATT_SIMPLE_CHUNKS];
    #pragma unroll
    for (int c = 0; c < ATT_SIMPLE_CHUNKS; c++) {
        int e = c * 32 + lane;
        qc[c] = e < D ? E::load(q[row * D + e]) : 0.0f;
        doc[c] = e < D ? E::load(dout[row * D + e]) : 0.0f;
        acc[c] = 0.0f;
    }
    const typename E::T* kb = k + (u64)b * S * kv_stride + (u64)kvh * D;
    const typename E::T* vb = v + (u64)b * S * kv_stride + (u64)kvh * D;
    for (int j = 0; j <= off + i && j < S; j++) {
        float sp = 0.0f, dp = 0.0f;
        #pragma unroll
        for (int c = 0; c < ATT_SIMPLE_CHUNKS; c++) {
            int e = c * 32 + lane;
            if (e < D) {
                sp += qc[c] * E::load(kb[(u64)j * kv_stride + e]);
                dp += doc[c] * E::load(vb[(u64)j * kv_stride + e]);
            }
        }
        float p = expf(warp_sum(sp) * scale - l), ds = p * (warp_sum(dp) - big_d);
        #pragma unroll
        for (int c = 0; c < ATT_SIMPLE_CHUNKS; c++) {
            int e = c * 32 + lane;
            if (e < D) acc[c] += ds * E::load(kb[(u64)j * kv_stride + e]);
        }
    }
    #pragma unroll
    for (int c = 0; c < ATT_SIMPLE_CHUNKS; c++) {
        int e = c * 32 + lane;
        if (e < D) dq[row * D + e] = E::store(acc[c] * scale);
    }
}

// Fallback dK, dV: one warp per key row (b, j, kvh), over the group's query heads.
template <typename E>
static __device__ void attention_backward_simple_dkv(const typename E::T* q, const typename E::T* k,
                                                     const typename E::T* v, const typename E::T* dout,
                                                     const float* lse, const float* dvec, typename E::T* dk,
                                                     typename E::T* dv, int B, int T, int S, int H, int KVH, int D,
                                                     float scale) {
    const int lane = threadIdx.x & 31;
    const u64 row = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= (u64)B * S * KVH) return;
    const int kvh = (int)(row % KVH), j = (int)((row / KVH) % S), b = (int)(row / ((u64)KVH * S));
    const int rep = H / KVH, off = S - T;
    float kc[ATT_SIMPLE_CHUNKS], vc[ATT_SIMPLE_CHUNKS], dkc[ATT_SIMPLE_CHUNKS], dvc[ATT_SIMPLE_CHUNKS];
    #pragma unroll
    for (int c = 0; c < ATT_SIMPLE_CHUNKS; c++) {
        int e = c * 32 + lane;
        kc[c] = e < D ? E::load(k[row * D + e]) : 0.0f;
        vc[c] = e < D ? E::load(v[row * D + e]) : 0.0f;
        dkc[c] = dvc[c] = 0.0f;
    }
    for (int r = 0; r < rep; r++) {
        const int h = kvh * rep + r;
        for (int i = j - off > 0 ? j - off : 0; i < T; i++) {
            const u64 qrow = ((u64)b * T + i) * H + h, at = ((u64)b * H + h) * T + i;
            float sp = 0.0f, dp = 0.0f;
            #pragma unroll
            for (int c = 0; c < ATT_SIMPLE_CHUNKS; c++) {
                int e = c * 32 + lane;
                if (e < D) {
                    sp += E::load(q[qrow * D + e]) * kc[c];
                    dp += E::load(dout[qrow * D + e]) * vc[c];
                }
            }
            float p = expf(warp_sum(sp) * scale - lse[at]), ds = p * (warp_sum(dp) - dvec[at]);
            #pragma unroll
            for (int c = 0; c < ATT_SIMPLE_CHUNKS; c++) {
                int e = c * 32 + lane;
                if (e < D) {
                    dkc[c] += ds * E::load(q[qrow * D + e]);
                    dvc[c] += p * E::load(dout[qrow * D + e]);
                }
            }
        }
    }
    #pragma unroll
    for (int c = 0; c < ATT_SIMPLE_CHUNKS; c++) {
        int e = c * 32 + lane;
        if (e < D) {
            dk[row * D + e] = E::store(dkc[c] * scale);
            dv[row * D + e] = E::store(dvc[c]);
        }
    }
}

#define CHORUS_ATTENTION_BACKWARD_TC(E, S, D, NW, BR)                                                              \
    extern "C" __global__ void __launch_bounds__(NW * 32) chorus_attention_backward_##S##_d##D(                    \
        const u16* q, const u16* k, const u16* v, const u16* dout, const float* lse, const float* dvec,            \
        float* dq_acc, u16* dk, u16* dv, int T, int Skv, int H, int KVH, float scale) {                            \
        attention_backward_tc<E, D, NW, BR>(q, k, v, dout, lse, dvec, dq_acc, dk, dv, T, Skv, H, KVH, scale);      \
    }
#define CHORUS_ATTENTION_BACKWARD(E, S)                                                                            \
    extern "C" __global__ void __launch_bounds__(128) chorus_attention_backward_dot_##S(                          \
        const E::T* dout, const E::T* o, float* dvec, int B, int T, int H, int D) {                                \
        attention_backward_dot<E>(dout, o, dvec, B, T, H, D);                                                      \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                                              \
        chorus_attention_backward_dq_##S(const float* dq_acc, E::T* dq, u64 n) {                                   \
        attention_backward_dq<E>(dq_acc, dq, n);                                                                   \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(128) chorus_attention_backward_simple_dq_##S(                     \
        const E::T* q, const E::T* k, const E::T* v, const E::T* dout, const float* lse, const float* dvec,        \
        E::T* dq, int B, int T, int Skv, int H, int KVH, int D, float scale) {                                     \
        attention_backward_simple_dq<E>(q, k, v, dout, lse, dvec, dq, B, T, Skv, H, KVH, D, scale);                \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(128) chorus_attention_backward_simple_dkv_##S(                    \
        const E::T* q, const E::T* k, const E::T* v, const E::T* dout, const float* lse, const float* dvec,        \
        E::T* dk, E::T* dv, int B, int T, int Skv, int H, int KVH, int D, float scale) {                           \
        attention_backward_simple_dkv<E>(q, k, v, dout, lse, dvec, dk, dv, B, T, Skv, H, KVH, D, scale);           \
    }

CHORUS_ATTENTION_BACKWARD_TC(BF16, bf16, 64, 4, 64)
CHORUS_ATTENTION_BACKWARD_TC(BF16, bf16, 128, 2, 32)
CHORUS_ATTENTION_BACKWARD_TC(F16, f16, 64, 4, 64)
CHORUS_ATTENTION_BACKWARD_TC(F16, f16, 128, 2, 32)
CHORUS_ATTENTION_BACKWARD(F32, f32)
CHORUS_ATTENTION_BACKWARD(BF16, bf16)
CHORUS_ATTENTION_BACKWARD(F16, f16)
