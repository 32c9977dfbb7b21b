// Block formats on the GPU: each ggml type dequantizes one "unit" of 8 consecutive elements of
// a block, so that every kernel (matvec, matmul, embedding rows) walks a quantized row in the
// same 8-element steps and never materializes it. The layouts are the ones documented in
// src/quant/ (one table per family); element e of a block is unit e / 8, position e % 8.
//
// For each type: `dq8_<name>(block, unit, out[8])`; FOR_EACH_QTYPE at the end lists the types
// with their block geometry.

// Scalar types are walked as blocks of 8 elements, so that the unit walk is the same.
__device__ __forceinline__ void dq8_f32(const u8* b, int u, float* y) {
    const float* p = (const float*)b + 8 * u;
#pragma unroll
    for (int i = 0; i < 8; i++) y[i] = p[i];
}
__device__ __forceinline__ void dq8_f16(const u8* b, int u, float* y) {
    const u16* p = (const u16*)b + 8 * u;
#pragma unroll
    for (int i = 0; i < 8; i++) y[i] = f16_to_f32(p[i]);
}
__device__ __forceinline__ void dq8_bf16(const u8* b, int u, float* y) {
    const u16* p = (const u16*)b + 8 * u;
#pragma unroll
    for (int i = 0; i < 8; i++) y[i] = bf16_to_f32(p[i]);
}

// Q4_0 (18 bytes / 32): f16 d, u8 qs[16]; element j < 16 is the low nibble of qs[j], element
// j + 16 the high nibble; value = d * (q - 8).
__device__ __forceinline__ void dq8_q4_0(const u8* b, int u, float* y) {
    float d = f16_to_f32(load_u16(b));
    const u8* qs = b + 2 + 8 * (u & 1);
    int shift = (u >> 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; i++) y[i] = d * (float)(((qs[i] >> shift) & 15) - 8);
}

// Q4_1 (20 / 32): f16 d, f16 m, u8 qs[16]; value = d * q + m.
__device__ __forceinline__ void dq8_q4_1(const u8* b, int u, float* y) {
    float d = f16_to_f32(load_u16(b)), m = f16_to_f32(load_u16(b + 2));
    const u8* qs = b + 4 + 8 * (u & 1);
    int shift = (u >> 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; i++) y[i] = d * (float)((qs[i] >> shift) & 15) + m;
}

// Q5_0 (22 / 32): f16 d, u32 qh (bit e is the fifth bit of element e), u8 qs[16] as Q4_0;
// value = d * (q - 16).
__device__ __forceinline__ void dq8_q5_0(const u8* b, int u, float* y) {
    float d = f16_to_f32(load_u16(b));
    u32 qh = load_u32(b + 2);
    const u8* qs = b + 6 + 8 * (u & 1);
    int shift = (u >> 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int e = 8 * u + i;
        int q = ((qs[i] >> shift) & 15) | (((qh >> e) & 1) << 4);
        y[i] = d * (float)(q - 16);
    }
}

// Q5_1 (24 / 32): f16 d, f16 m, u32 qh, u8 qs[16]; value = d * q + m.
__device__ __forceinline__ void dq8_q5_1(const u8* b, int u, float* y) {
    float d = f16_to_f32(load_u16(b)), m = f16_to_f32(load_u16(b + 2));
    u32 qh = load_u32(b + 4);
    const u8* qs = b + 8 + 8 * (u & 1);
    int shift = (u >> 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int e = 8 * u + i;
        int q = ((qs[i] >> shift) & 15) | (((qh >> e) & 1) << 4);
        y[i] = d * (float)q + m;
    }
}

// Q8_0 (34 / 32): f16 d, i8 qs[32]; value = d * q.
__device__ __forceinline__ void dq8_q8_0(const u8* b, int u, float* y) {
    float d = f16_to_f32(load_u16(b));
    const signed char* qs = (const signed char*)(b + 2) + 8 * u;
#pragma unroll
    for (int i = 0; i < 8; i++) y[i] = d * (float)qs[i];
}

// Q2_K (84 / 256): u8 scales[16] (low nibble scale, high nibble min, one pair per 16
// elements), u8 qs[64], f16 d, f16 dmin. Element e: half h = e / 128, j = (e % 128) / 32,
// l = e % 32; q = (qs[32h + l] >> 2j) & 3; value = d * sc - dmin * mn with sc, mn from
// scales[e / 16].
__device__ __forceinline__ void dq8_q2_k(const u8* b, int u, float* y) {
    int e0 = 8 * u, h = e0 >> 7, j = (e0 & 127) >> 5, l0 = e0 & 31;
    float d = f16_to_f32(load_u16(b + 80)), dmin = f16_to_f32(load_u16(b + 82));
    u8 sc = b[e0 >> 4];
    float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
    const u8* qs = b + 16 + 32 * h + l0;
#pragma unroll
    for (int i = 0; i < 8; i++) y[i] = dl * (float)((qs[i] >> (2 * j)) & 3) - ml;
}

// Q3_K (110 / 256): u8 hmask[32], u8 qs[64], u8 scales[12] (16 six-bit scales), f16 d.
// Element e (h, j, l as Q2_K): q2 = (qs[32h + l] >> 2j) & 3, minus 4 when bit (4h + j) of
// hmask[l] is clear; value = d * (scale[e / 16] - 32) * q. Scale i: low 4 bits from
// scales[i % 8] (nibble i / 8), high 2 bits from scales[8 + i % 4] >> 2 * (i / 4).
__device__ __forceinline__ void dq8_q3_k(const u8* b, int u, float* y) {
    int e0 = 8 * u, h = e0 >> 7, j = (e0 & 127) >> 5, l0 = e0 & 31, s = e0 >> 4;
    const u8* sc = b + 96;
    int lo = (sc[s & 7] >> (4 * (s >> 3))) & 15;
    int hi = (sc[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
    float dl = f16_to_f32(load_u16(b + 108)) * (float)((lo | (hi << 4)) - 32);
    const u8* hm = b + l0;
    const u8* qs = b + 32 + 32 * h + l0;
    int bit = 4 * h + j;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int q = ((qs[i] >> (2 * j)) & 3) - (((hm[i] >> bit) & 1) ? 0 : 4);
        y[i] = dl * (float)q;
    }
}

// The 6-bit scale and min of sub-block s (0..7) of Q4_K / Q5_K, packed in 12 bytes.
__device__ __forceinline__ void kquant_scale_min(const u8* q, int s, int* sc, int* mn) {
    if (s < 4) {
        *sc = q[s] & 63;
        *mn = q[s + 4] & 63;
    } else {
        *sc = (q[s + 4] & 15) | ((q[s - 4] >> 6) << 4);
        *mn = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
    }
}

// Q4_K (144 / 256): f16 d, f16 dmin, u8 scales[12], u8 qs[128]. Element e: chunk c = e / 64,
// l = e % 32; q = nibble (e % 64) / 32 of qs[32c + l]; sub-block s = e / 32;
// value = d * sc[s] * q - dmin * mn[s].
__device__ __forceinline__ void dq8_q4_k(const u8* b, int u, float* y) {
    int e0 = 8 * u, c = e0 >> 6, s = e0 >> 5, l0 = e0 & 31, shift = 4 * (s & 1);
    int sc, mn;
    kquant_scale_min(b + 4, s, &sc, &mn);
    float dl = f16_to_f32(load_u16(b)) * (float)sc, ml = f16_to_f32(load_u16(b + 2)) * (float)mn;
    const u8* qs = b + 16 + 32 * c + l0;
#pragma unroll
    for (int i = 0; i < 8; i++) y[i] = dl * (float)((qs[i] >> shift) & 15) - ml;
}

// Q5_K (176 / 256): f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128]. As Q4_K, plus a
// fifth bit: bit s of qh[l] (s = e / 32).
__device__ __forceinline__ void dq8_q5_k(const u8* b, int u, float* y) {
    int e0 = 8 * u, c = e0 >> 6, s = e0 >> 5, l0 = e0 & 31, shift = 4 * (s & 1);
    int sc, mn;
    kquant_scale_min(b + 4, s, &sc, &mn);
    float dl = f16_to_f32(load_u16(b)) * (float)sc, ml = f16_to_f32(load_u16(b + 2)) * (float)mn;
    const u8* qh = b + 16 + l0;
    const u8* qs = b + 48 + 32 * c + l0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int q = ((qs[i] >> shift) & 15) | (((qh[i] >> s) & 1) << 4);
        y[i] = dl * (float)q - ml;
    }
}

// Q6_K (210 / 256): u8 ql[128], u8 qh[64], i8 scales[16], f16 d (last). Element e: half
// h = e / 128, r = e % 128, quarter j = r / 32, l = r % 32; low 4 bits are nibble (j / 2) of
// ql[64h + 32(j % 2) + l], high 2 bits are (qh[32h + l] >> 2j) & 3; value =
// d * scales[8h + 2j + l / 16] * (q - 32).
__device__ __forceinline__ void dq8_q6_k(const u8* b, int u, float* y) {
    int e0 = 8 * u, h = e0 >> 7, j = (e0 & 127) >> 5, l0 = e0 & 31;
    const signed char* scales = (const signed char*)(b + 192);
    float dl = f16_to_f32(load_u16(b + 208)) * (float)scales[8 * h + 2 * j + (l0 >> 4)];
    const u8* ql = b + 64 * h + 32 * (j & 1) + l0;
    const u8* qh = b + 128 + 32 * h + l0;
    int lshift = 4 * (j >> 1);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int q = ((ql[i] >> lshift) & 15) | (((qh[i] >> (2 * j)) & 3) << 4);
        y[i] = dl * (float)(q - 32);
    }
}

// The IQ4 non-linear code book: 4-bit index -> value.
__constant__ signed char IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                            1,    13,   25,  38,  53,  69,  89,  113};

// IQ4_NL (18 / 32): f16 d, u8 qs[16] nibbles as Q4_0; value = d * IQ4_VALUES[q].
__device__ __forceinline__ void dq8_iq4_nl(const u8* b, int u, float* y) {
    float d = f16_to_f32(load_u16(b));
    const u8* qs = b + 2 + 8 * (u & 1);
    int shift = (u >> 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; i++) y[i] = d * (float)IQ4_VALUES[(qs[i] >> shift) & 15];
}

// IQ4_XS (136 / 256): f16 d, u16 scales_h, u8 scales_l[4], u8 qs[128]. Sub-block s = e / 32
// has the 6-bit scale ls = nibble (s % 2) of scales_l[s / 2] | ((scales_h >> 2s) & 3) << 4,
// and 16 bytes qs[16s..] with nibbles as IQ4_NL; value = d * (ls - 32) * IQ4_VALUES[q].
__device__ __forceinline__ void dq8_iq4_xs(const u8* b, int u, float* y) {
    int e0 = 8 * u, s = e0 >> 5, r = e0 & 31;
    int ls = ((b[4 + (s >> 1)] >> (4 * (s & 1))) & 15) | (((load_u16(b + 2) >> (2 * s)) & 3) << 4);
    float dl = f16_to_f32(load_u16(b)) * (float)(ls - 32);
    const u8* qs = b + 8 + 16 * s + (r & 15);
    int shift = (r >> 4) * 4;
#pragma unroll
    for (int i = 0; i < 8; i++) y[i] = dl * (float)IQ4_VALUES[(qs[i] >> shift) & 15];
}

// Every supported type as X(name, elements per block, bytes per block). Scalar types count as
// blocks of 8 elements.
#define FOR_EACH_QTYPE(X) \
    X(f32, 8, 32)         \
    X(f16, 8, 16)         \
    X(bf16, 8, 16)        \
    X(q4_0, 32, 18)       \
    X(q4_1, 32, 20)       \
    X(q5_0, 32, 22)       \
    X(q5_1, 32, 24)       \
    X(q8_0, 32, 34)       \
    X(q2_k, 256, 84)      \
    X(q3_k, 256, 110)     \
    X(q4_k, 256, 144)     \
    X(q5_k, 256, 176)     \
    X(q6_k, 256, 210)     \
    X(iq4_nl, 32, 18)     \
    X(iq4_xs, 256, 136)
