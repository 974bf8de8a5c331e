// The warp-level tensor-core primitives for the host build, after the kernel
// source (they use its 16-bit conversions): each lane offers its registers,
// the warp's 32 offers are reassembled into whole matrices by the fragment
// layouts of mma.m16n8k16 and ldmatrix (common.cuh), and each lane takes
// its own part of the result.

static float chorus_host_load16(unsigned short v, bool bf16) { return bf16 ? bf16_to_f32(v) : f16_to_f32(v); }

static void chorus_host_mma(float d[4], const unsigned a[4], const unsigned b[2], bool bf16) {
    unsigned w = chorus_warp(), l = chorus_lane();
    for (int i = 0; i < 4; i++) chorus_warp_words[w][l][i] = a[i];
    for (int i = 0; i < 2; i++) chorus_warp_words[w][l][4 + i] = b[i];
    chorus_warp_sync();
    float A[16][16], B[16][8];
    for (unsigned L = 0; L < 32; L++) {
        unsigned g = L >> 2, t = L & 3;
        unsigned long long* r = chorus_warp_words[w][L];
        auto lo = [&](int i) { return chorus_host_load16((unsigned short)(r[i] & 0xffff), bf16); };
        auto hi = [&](int i) { return chorus_host_load16((unsigned short)((r[i] >> 16) & 0xffff), bf16); };
        A[g][2 * t] = lo(0), A[g][2 * t + 1] = hi(0);
        A[g + 8][2 * t] = lo(1), A[g + 8][2 * t + 1] = hi(1);
        A[g][2 * t + 8] = lo(2), A[g][2 * t + 9] = hi(2);
        A[g + 8][2 * t + 8] = lo(3), A[g + 8][2 * t + 9] = hi(3);
        B[2 * t][g] = lo(4), B[2 * t + 1][g] = hi(4);
        B[2 * t + 8][g] = lo(5), B[2 * t + 9][g] = hi(5);
    }
    chorus_warp_sync();
    unsigned g = l >> 2, t = l & 3;
    for (int i = 0; i < 4; i++) {
        unsigned row = g + (i >> 1) * 8, col = 2 * t + (i & 1);
        float acc = 0.0f;
        for (int k = 0; k < 16; k++) acc += A[row][k] * B[k][col];
        d[i] += acc;
    }
}

static void chorus_host_ldmatrix(unsigned r[4], const unsigned short* row, bool trans) {
    unsigned w = chorus_warp(), l = chorus_lane();
    chorus_warp_words[w][l][0] = (unsigned long long)(size_t)row;
    chorus_warp_sync();
    for (int i = 0; i < 4; i++) {
        unsigned short lo, hi;
        if (!trans) {
            const unsigned short* p = (const unsigned short*)(size_t)chorus_warp_words[w][8 * i + l / 4][0];
            lo = p[2 * (l % 4)];
            hi = p[2 * (l % 4) + 1];
        } else {
            const unsigned short* p0 = (const unsigned short*)(size_t)chorus_warp_words[w][8 * i + 2 * (l % 4)][0];
            const unsigned short* p1 = (const unsigned short*)(size_t)chorus_warp_words[w][8 * i + 2 * (l % 4) + 1][0];
            lo = p0[l / 4];
            hi = p1[l / 4];
        }
        r[i] = (unsigned)lo | ((unsigned)hi << 16);
    }
    chorus_warp_sync();
}
