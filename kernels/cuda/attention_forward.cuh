// Causal flash attention with grouped-query heads, forward
// (kernels/src/attention.rs has the math, the layouts and the CPU reference).
//
// The tensor-core kernel (bf16/f16, head_dim 64 or 128): a block of four
// warps owns 64 query rows of one head (16 rows a warp, their Q fragments in
// registers); it walks the key/value tiles of its kv head up to the last
// visible key, each tile copied once into shared memory (head_dim 64: into
// one of two buffers by cp.async while the other is computed on), computing
// S = Q·K^T on the tensor cores, the online softmax in the log2 domain
// (row max and sum kept per thread, the four lanes of a row combined by
// shuffles), and O += P·V with P taken straight from S's accumulators as
// the A operand. No T x T buffer exists anywhere. The log-sum-exp of each
// row (natural log) is kept for the backward.
//
// The fallback (any dtype, head_dim up to 256): one warp per query row,
// the head's dims spread over the lanes, the same online softmax key by key.
#pragma once
#include "common.cuh"

// The A operand (16 rows x 16 k) of k-step kk from the f32 accumulators of
// two n-tiles (2kk, 2kk + 1) of a 16 x 8n product: C's fragment layout
// pairs with A's, so the scores (or their gradients) feed the next product
// from registers, rounded to E.
template <typename E>
static __device__ __forceinline__ void accumulators_as_a(const float acc[][4], int kk, u32 a[4]) {
    a[0] = pack2<E>(acc[2 * kk][0], acc[2 * kk][1]);
    a[1] = pack2<E>(acc[2 * kk][2], acc[2 * kk][3]);
    a[2] = pack2<E>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
    a[3] = pack2<E>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

#define ATT_WARPS 4
#define ATT_ROWS 64  // query rows of a forward block: 16 per warp
#define ATT_LN2 0.69314718055994530942f

template <typename E, int D, int BC>
static __device__ void attention_forward_tc(const u16* q, const u16* k, const u16* v, u16* o, float* lse, int T,
                                            int S, int H, int KVH, float scale_log2) {
    constexpr int LD = D + 8;  // a row of a tile in shared memory, padded 16 bytes against bank conflicts
    // Two K/V buffers where the static shared memory (48 KiB) holds them: the
    // next tile's copy (cp.async) runs while this one is computed on.
    constexpr int NBUF = (ATT_ROWS + 4 * BC) * LD * 2 <= 48 * 1024 ? 2 : 1;
    __shared__ __align__(16) u16 sQ[ATT_ROWS * LD];
    __shared__ __align__(16) u16 sK[NBUF][BC * LD];
    __shared__ __align__(16) u16 sV[NBUF][BC * LD];
    const bool bf = IsBf16<E>::value;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int qtile = gridDim.x - 1 - blockIdx.x;  // the tiles with the most keys start first
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KVH);
    const int q0 = qtile * ATT_ROWS, off = S - T;
    const u64 q_stride = (u64)H * D, kv_stride = (u64)KVH * D;
    const u16* qb = q + (u64)b * T * q_stride + (u64)h * D;
    const u16* kb = k + (u64)b * S * kv_stride + (u64)kvh * D;
    const u16* vb = v + (u64)b * S * kv_stride + (u64)kvh * D;

    #pragma unroll
    for (int c = tid; c < ATT_ROWS * (D / 8); c += blockDim.x) {
        int r = c / (D / 8), e = (c % (D / 8)) * 8;
        copy16(&sQ[r * LD + e], qb + (u64)(q0 + r) * q_stride + e, q0 + r < T);
    }
    __syncthreads();
    u32 qf[D / 16][4];
    #pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        int row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, col = kk * 16 + (lane >> 4) * 8;
        ldmatrix_x4(qf[kk], &sQ[row * LD + col]);
    }

    float acc[D / 8][4];
    #pragma unroll
    for (int dn = 0; dn < D / 8; dn++)
        #pragma unroll
        for (int e = 0; e < 4; e++) acc[dn][e] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
    const int last_row = (q0 + ATT_ROWS < T ? q0 + ATT_ROWS : T) - 1;
    const int kv_end = off + last_row + 1 < S ? off + last_row + 1 : S;

    // Tile j0's keys and values into buffer `buf`: asynchronous (one group)
    // with two buffers, else plain copies. A key past S reads as zeros.
    auto load_tile = [&](int j0, int buf) {
        #pragma unroll
        for (int c = tid; c < BC * (D / 8); c += blockDim.x) {
            int r = c / (D / 8), e = (c % (D / 8)) * 8;
            bool in = j0 + r < S;
            u64 at = in ? (u64)(j0 + r) * kv_stride + e : 0;  // an address in range either way
            if (NBUF == 2) {
                cp_async16(&sK[buf][r * LD + e], kb + at, in);
                cp_async16(&sV[buf][r * LD + e], vb + at, in);
            } else {
                copy16(&sK[buf][r * LD + e], kb + at, in);
                copy16(&sV[buf][r * LD + e], vb + at, in);
            }
        }
        if (NBUF == 2) cp_async_commit();
    };
    if (NBUF == 2 && kv_end > 0) load_tile(0, 0);

    for (int j0 = 0, it = 0; j0 < kv_end; j0 += BC, it++) {
        const int buf = NBUF == 2 ? (it & 1) : 0;
        if (NBUF == 2) {
            // The next tile into the other buffer, which every warp finished
            // reading before the barrier that ended the last iteration; then
            // this tile's group has landed, and the barrier shows it to all.
            if (j0 + BC < kv_end) {
                load_tile(j0 + BC, buf ^ 1);
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
        } else {
            __syncthreads();  // every warp is done with the previous tile
            load_tile(j0, 0);
            __syncthreads();
        }

        // S = Q K^T for this warp's 16 rows and the tile's BC keys.
        float s[BC / 8][4];
        #pragma unroll
        for (int nt = 0; nt < BC / 8; nt++)
            #pragma unroll
            for (int e = 0; e < 4; e++) s[nt][e] = 0.0f;
        #pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            #pragma unroll
            for (int nt = 0; nt < BC / 8; nt += 2) {
                u32 kf[4];
                int row = nt * 8 + (lane & 7) + (lane >> 4) * 8, col = kk * 16 + ((lane >> 3) & 1) * 8;
                ldmatrix_x4(kf, &sK[buf][row * LD + col]);
                mma_pair(s[nt], s[nt + 1], qf[kk], kf, bf);
            }
        }

        // Scale into the log2 domain and hide the keys a row may not see:
        // only on a tile that reaches past the keys or past what the block's
        // first row sees (the diagonal); every row sees the others whole.
        const bool whole = j0 + BC <= S && j0 + BC - 1 <= off + q0;
        float mx[2] = {m_run[0], m_run[1]};
        #pragma unroll
        for (int nt = 0; nt < BC / 8; nt++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                int row = q0 + warp * 16 + g + (e >> 1) * 8, key = j0 + nt * 8 + 2 * t4 + (e & 1);
                float x = s[nt][e] * scale_log2;
                if (!whole && (key >= S || key > off + row)) x = -INFINITY;
                s[nt][e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        }
        float base[2];
        #pragma unroll
        for (int i = 0; i < 2; i++) {
            mx[i] = fmaxf(mx[i], chorus_shfl_xor(mx[i], 1));
            mx[i] = fmaxf(mx[i], chorus_shfl_xor(mx[i], 2));
            base[i] = mx[i] == -INFINITY ? 0.0f : mx[i];  // a row that sees nothing yet stays at zero
            float corr = fast_exp2(m_run[i] - base[i]);
            m_run[i] = mx[i];
            l_run[i] *= corr;
            #pragma unroll
            for (int dn = 0; dn < D / 8; dn++) {
                acc[dn][2 * i] *= corr;
                acc[dn][2 * i + 1] *= corr;
            }
        }
        #pragma unroll
        for (int nt = 0; nt < BC / 8; nt++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = fast_exp2(s[nt][e] - base[e >> 1]);
                s[nt][e] = p;
                l_run[e >> 1] += p;
            }
        }

        // O += P V, P's A fragments straight from S's accumulators.
        #pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {
            u32 pa[4];
            accumulators_as_a<E>(s, kk, pa);
            #pragma unroll
            for (int dn = 0; dn < D / 8; dn += 2) {
                u32 vf[4];
                int row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, col = dn * 8 + (lane >> 4) * 8;
                ldmatrix_x4_trans(vf, &sV[buf][row * LD + col]);
                mma_pair(acc[dn], acc[dn + 1], pa, vf, bf);
            }
        }
        // Every warp is done with this buffer before the next iteration's copy into it.
        if (NBUF == 2) __syncthreads();
    }

    #pragma unroll
    for (int i = 0; i < 2; i++) {
        l_run[i] += chorus_shfl_xor(l_run[i], 1);
        l_run[i] += chorus_shfl_xor(l_run[i], 2);
        int row = q0 + warp * 16 + g + i * 8;
        if (row < T) {
            float inv = 1.0f / l_run[i];
            u16* orow = o + ((u64)b * T + row) * q_stride + (u64)h * D;
            #pragma unroll
            for (int dn = 0; dn < D / 8; dn++) {
                *(u32*)&orow[dn * 8 + 2 * t4] = pack2<E>(acc[dn][2 * i] * inv, acc[dn][2 * i + 1] * inv);
            }
            if (t4 == 0) lse[((u64)b * H + h) * T + row] = (m_run[i] + log2f(l_run[i])) * ATT_LN2;
        }
    }
}

#define ATT_SIMPLE_CHUNKS 8  // head_dim up to 32 * 8 = 256 in the fallback

// One warp per query row (b, i, h): lane l holds dims l, l + 32, ...
template <typename E>
static __device__ void attention_forward_simple(const typename E::T* q, const typename E::T* k,
                                                const typename E::T* v, typename E::T* o, float* lse, int B, int T,
                                                int S, int H, int KVH, int D, float scale) {
    const int lane = threadIdx.x & 31;
    const u64 row = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= (u64)B * T * H) return;  // the whole warp leaves together
    const int h = (int)(row % H), i = (int)((row / H) % T), b = (int)(row / ((u64)H * T));
    const int kvh = h / (H / KVH), off = S - T;
    const u64 kv_stride = (u64)KVH * D;
    float qc[ATT_SIMPLE_CHUNKS], oc[ATT_SIMPLE_CHUNKS];
    #pragma unroll
    for (int c = 0; c < ATT_SIMPLE_CHUNKS; c++) {
        int e = c * 32 + lane;
        qc[c] = e < D ? E::load(q[row * D + e]) : 0.0f;
        oc[c] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    const typename E::T* kb = k + (u64)b * S * kv_stride + (u64)kvh * D;
    const typename E::T* vb = v + (u64)b * S * kv_stride + (u64)kvh * D;
    for (int j = 0; j <= off + i && j < S; j++) {
        float part = 0.0f;
        #pragma unroll
        for (int c = 0; c < ATT_SIMPLE_CHUNKS; c++) {
            int e = c * 32 + lane;
            if (e < D) part += qc[c] * E::load(kb[(u64)j * kv_stride + e]);
        }
        float s = warp_sum(part) * scale, mn = fmaxf(m, s), corr = expf(m - mn), p = expf(s - mn);
        l = l * corr + p;
        #pragma unroll
        for (int c = 0; c < ATT_SIMPLE_CHUNKS; c++) {
            int e = c * 32 + lane;
            if (e < D) oc[c] = oc[c] * corr + p * E::load(vb[(u64)j * kv_stride + e]);
        }
        m = mn;
    }
    #pragma unroll
    for (int c = 0; c < ATT_SIMPLE_CHUNKS; c++) {
        int e = c * 32 + lane;
        if (e < D) o[row * D + e] = E::store(oc[c] / l);
    }
    if (lane == 0) lse[((u64)b * H + h) * T + i] = m + logf(l);
}

#define CHORUS_ATTENTION_FORWARD_TC(E, S, D, BC)                                                                   \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) chorus_attention_forward_##S##_d##D(              \
        const u16* q, const u16* k, const u16* v, u16* o, float* lse, int T, int Skv, int H, int KVH,              \
        float scale_log2) {                                                                                        \
        attention_forward_tc<E, D, BC>(q, k, v, o, lse, T, Skv, H, KVH, scale_log2);                               \
    }
#define CHORUS_ATTENTION_FORWARD_SIMPLE(E, S)                                                                      \
    extern "C" __global__ void __launch_bounds__(128) chorus_attention_forward_simple_##S(                         \
        const E::T* q, const E::T* k, const E::T* v, E::T* o, float* lse, int B, int T, int Skv, int H, int KVH,   \
        int D, float scale) {                                                                                      \
        attention_forward_simple<E>(q, k, v, o, lse, B, T, Skv, H, KVH, D, scale);                                 \
    }

CHORUS_ATTENTION_FORWARD_TC(BF16, bf16, 64, 64)
CHORUS_ATTENTION_FORWARD_TC(BF16, bf16, 128, 32)
CHORUS_ATTENTION_FORWARD_TC(F16, f16, 64, 64)
CHORUS_ATTENTION_FORWARD_TC(F16, f16, 128, 32)
CHORUS_ATTENTION_FORWARD_SIMPLE(F32, f32)
CHORUS_ATTENTION_FORWARD_SIMPLE(BF16, bf16)
CHORUS_ATTENTION_FORWARD_SIMPLE(F16, f16)
