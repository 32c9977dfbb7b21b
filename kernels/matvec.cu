// Quantized matrix-vector products (decode) and embedding rows. Needs quant.cuh.
//
// matvec_<type>: for each batch item b (grid.y), y_b[r] = sum_k W_b[r, k] * x_b[k], where
//   W_b = w + m * mat_stride bytes, m = ids ? ids[b] : b   (the expert, head or 0; an id of
//   -1 skips the item and leaves y_b unwritten)
//   x_b = x + (b / x_group) * x_stride                    (shared or per-item input)
//   y_b = y + b * y_stride
// W rows are `row_bytes` apart and `k` elements long (a whole number of blocks).
// A parts launch (w1 not null, grid.y 2 or 3, no ids): item 1 is instead y1 = W1 x (rows1
// rows), item 2 y2 = W2 x, the same type, k and x as item 0: the projections of one activation
// in one launch (Gpu::matvec_parts; from sm_90 on, the bulk-copy tile types' rows of 2048 and
// more values take matvec_tma_parts_<type> instead).

// Launch geometry (Gpu::matvec): blocks of MATVEC_WARPS warps (f32: up to MATVEC_WIDE_WARPS),
// grid (ceil(groups / G), batch) where a group is MATVEC_ROWS consecutive rows and G (1, 2 or
// 4) groups share a block. The block's warps / G warps of a group split the rows' k range and
// meet in shared memory; more warps per group give short matrices (kv_a's 576 rows, the
// router's 256) enough warps to keep every SM's loads in flight. The kernel reads G back from
// the grid and block sizes (matvec_body).
//
// Speed comes from bytes per instruction: decode reads each weight byte once, so the SMs must
// turn ~16 bytes per clock each into products. Each thread owns one "piece" of a quant block
// (usually 16 bytes of packed values, read with one 16-byte load, or a few 4-byte ones where
// the block size leaves them unaligned), its x values are shared by the MATVEC_ROWS rows, and
// small integers become floats through the mantissa (byte_f) rather than the quarter-rate I2F.
// Types without such a piece walk 8-element units through dq8_<type> (generic_piece).

#define MATVEC_WARPS 4
// Scalar (f32) matrices take blocks of up to 16 warps per row group (MatvecWarps below): short
// ones like MoE routers, 256 rows of 24-28 KiB, whose 64 groups on 4-warp blocks left half of
// an H200's SMs idle and the rest with few loads in flight (decode now runs an f32 router's
// product inside moe_route_f32, kernels/moe.cu).
#define MATVEC_WIDE_WARPS 16
// Four rows share each x load (x comes from L1). Rows per thread and how lanes share x loads
// were measured not to matter (2, 4 or 8 rows; 1-8 row sets per warp): the kernel is issue-bound
// at ~6 instructions per weight and row (ncu), which is what matvec_tc_q4_k below avoids.
#define MATVEC_ROWS 4

// Items 1 and 2 of a parts launch (see the top), or w1 null. With `done` (3 counters, zero
// before the launch and after it: matvec_latent_<type> and matvec_tma_parts_<type>) the parts
// are MLA's q_a, kv_a and indexer key of one token, and `latent` norms them (its qx, kv and kx
// are y, y1 and y2): the last block of item 0 to finish norms the query, of item 1 the latent,
// of item 2 the key (parts_tail, tma_parts_tail below), so that the token needs no
// latent_norm_rope launch.
struct MatvecParts {
    const u8 *w1, *w2;
    int rows1, rows2;
    float *y1, *y2;
    int* done;
    float* qsq;
    LatentNorm latent;
};

// q_b's product of a token's query latent that matvec_tma_parts_<type> left unnormed (its qsq
// mode): x is latent.qx, the latent times its norm's weights, and sq the sums of its squares
// over each of `tiles` tiles of 16 values; matvec_tma_query_<type> scales its rows by the
// norm's factor, and its last block's producer warp writes the normed latent (latent.qy) and
// the latent's and the key's cache rows (tma_query_tail), which the parts launch then leaves
// to it.
struct QueryRows {
    const float* sq;
    int tiles;
    LatentNorm latent;
};

// A piece function: acc[r] += (piece p of block blk[r]) . (the x values of that piece), for
// the MATVEC_ROWS rows; xb points at x for the block's first element.
typedef void (*PieceFn)(const u8* const* blk, int p, const float* xb, float* acc);

// Weights are read once: 16-byte loads that bypass L1 so that x stays there.
__device__ __forceinline__ uint4 ld_stream16(const u8* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}
__device__ __forceinline__ u16 ld_nc16(const u8* p) { return __ldg((const unsigned short*)p); }

// Byte k of w minus `bias`, as a float: the byte goes into the mantissa of 2^23 (exact) and
// one FADD removes 2^23 + bias. Full FP32 rate, where an int-to-float conversion is 1/4.
__device__ __forceinline__ float byte_f(u32 w, int k, float bias) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440 + k)) - (8388608.0f + bias);
}

// s += sum_j (byte j of q - bias) * x_j over the four bytes of q.
__device__ __forceinline__ float dot4(u32 q, float4 x, float bias, float s) {
    s = fmaf(byte_f(q, 0, bias), x.x, s);
    s = fmaf(byte_f(q, 1, bias), x.y, s);
    s = fmaf(byte_f(q, 2, bias), x.z, s);
    return fmaf(byte_f(q, 3, bias), x.w, s);
}

__device__ __forceinline__ float sum4(float4 x) { return (x.x + x.y) + (x.z + x.w); }

// The 6-bit scales (low byte: sub-block 2c, high byte: 2c + 1) and mins of Q4_K / Q5_K chunk c
// from the header words h1..h3 (scale bytes 0-3, 4-7, 8-11); kquant_scale_min, two at a time.
__device__ __forceinline__ void kquant_pair(uint4 hd, int c, float* dl, float* ml) {
    int sh = 16 * (c & 1);
    u32 a = hd.y >> sh, b = hd.z >> sh, e = hd.w >> sh;
    u32 sc = c < 2 ? a & 0x3F3F : (e & 0x0F0F) | ((a >> 2) & 0x3030);
    u32 mn = c < 2 ? b & 0x3F3F : ((e >> 4) & 0x0F0F) | ((b >> 2) & 0x3030);
    float d = f16_to_f32((u16)hd.x), dmin = f16_to_f32((u16)(hd.x >> 16));
    dl[0] = d * (float)(sc & 0xFF);
    dl[1] = d * (float)((sc >> 8) & 0xFF);
    ml[0] = dmin * (float)(mn & 0xFF);
    ml[1] = dmin * (float)((mn >> 8) & 0xFF);
}

// Q4_K / Q5_K piece p (8 per block; blocks 16-byte aligned): chunk c = p / 2, bytes
// l = 16 (p % 2) + [0, 16) of the chunk's 32 qs bytes, i.e. 16 elements of sub-block 2c (low
// nibbles) and 16 of 2c + 1 (high nibbles). value = dl * q - ml, summed as
// dl * sum(q x) - ml * sum(x) per sub-block, sum(x) shared by the rows. Q5_K adds bit s of
// qh[l] as the fifth bit.
template <bool Q5>
__device__ __forceinline__ void kquant45_piece(const u8* const* blk, int p, const float* xb,
                                               float* acc) {
    int c = p >> 1, l = 16 * (p & 1);
    uint4 hd[MATVEC_ROWS], qs[MATVEC_ROWS], qh[MATVEC_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        hd[r] = ld_stream16(blk[r]);
        qs[r] = ld_stream16(blk[r] + (Q5 ? 48 : 16) + 32 * c + l);
        if (Q5) qh[r] = ld_stream16(blk[r] + 16 + l);
    }
    const float* xlo = xb + 64 * c + l;
    float sx0 = 0.0f, sx1 = 0.0f, sq0[MATVEC_ROWS], sq1[MATVEC_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) sq0[r] = sq1[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float4 x0 = *(const float4*)(xlo + 4 * i), x1 = *(const float4*)(xlo + 32 + 4 * i);
        sx0 += sum4(x0);
        sx1 += sum4(x1);
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; r++) {
            u32 w = (&qs[r].x)[i];
            u32 q0 = w & 0x0F0F0F0F, q1 = (w >> 4) & 0x0F0F0F0F;
            if (Q5) {
                u32 h = (&qh[r].x)[i];
                q0 |= ((h >> (2 * c)) & 0x01010101) << 4;
                q1 |= ((h >> (2 * c + 1)) & 0x01010101) << 4;
            }
            sq0[r] = dot4(q0, x0, 0.0f, sq0[r]);
            sq1[r] = dot4(q1, x1, 0.0f, sq1[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        float dl[2], ml[2];
        kquant_pair(hd[r], c, dl, ml);
        acc[r] += (dl[0] * sq0[r] - ml[0] * sx0) + (dl[1] * sq1[r] - ml[1] * sx1);
    }
}
__device__ __forceinline__ void piece_q4_k(const u8* const* blk, int p, const float* xb,
                                           float* acc) {
    kquant45_piece<false>(blk, p, xb, acc);
}
__device__ __forceinline__ void piece_q5_k(const u8* const* blk, int p, const float* xb,
                                           float* acc) {
    kquant45_piece<true>(blk, p, xb, acc);
}

// Q6_K piece p (8 per block; blocks only 2-byte aligned): half h = p / 4, j = (p / 2) % 2,
// 16 ql bytes at 64h + 32j + 16 (p % 2): their low nibbles are quarter j, their high nibbles
// quarter j + 2 of half h; the matching 16 qh bytes at 128 + 32h + 16 (p % 2) hold the high
// bits (2j and 2j + 4). value = d * scale * (q - 32).
__device__ __forceinline__ void piece_q6_k(const u8* const* blk, int p, const float* xb,
                                           float* acc) {
    int h = p >> 2, j = (p >> 1) & 1, l = 16 * (p & 1);
    u32 ql[MATVEC_ROWS][4], qh[MATVEC_ROWS][4];
    float d0[MATVEC_ROWS], d1[MATVEC_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        const u8* b = blk[r];
        ld_words<4>(b + 64 * h + 32 * j + l, ql[r]);
        ld_words<4>(b + 128 + 32 * h + l, qh[r]);
        const signed char* sc = (const signed char*)(b + 192 + 8 * h + 2 * j + (l >> 4));
        float d = f16_to_f32(ld_nc16(b + 208));
        d0[r] = d * (float)sc[0];
        d1[r] = d * (float)sc[4];
    }
    const float* xlo = xb + 128 * h + 32 * j + l;
    float s0[MATVEC_ROWS], s1[MATVEC_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) s0[r] = s1[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float4 x0 = *(const float4*)(xlo + 4 * i), x1 = *(const float4*)(xlo + 64 + 4 * i);
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; r++) {
            u32 w = ql[r][i], hb = qh[r][i];
            u32 q0 = (w & 0x0F0F0F0F) | (((hb >> (2 * j)) & 0x03030303) << 4);
            u32 q1 = ((w >> 4) & 0x0F0F0F0F) | (((hb >> (2 * j + 4)) & 0x03030303) << 4);
            s0[r] = dot4(q0, x0, 32.0f, s0[r]);
            s1[r] = dot4(q1, x1, 32.0f, s1[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) acc[r] += d0[r] * s0[r] + d1[r] * s1[r];
}

// Q2_K and Q3_K piece p (4 per block): half h = p / 2 and lh = p % 2, the 16 qs bytes l = 16 lh
// .. 16 lh + 15 of the half, whose 2-bit fields j = 0..3 are elements 128h + 32j + 16lh + i,
// sub-block s = 8h + 2j + lh (16 values of one scale). Each row's 16 bytes serve its four
// sums of 16 values (shifted down 2j and masked per field), x's four 16-value runs are shared
// by the rows. The unit walk (generic_piece) read these blocks a byte at a time.
//
// Q2_K (84 bytes, 4-byte aligned): scales[16] (low nibble scale, high nibble min), qs[64] at
// 16, f16 d at 80, f16 dmin at 82; value = d sc q - dmin mn, summed as d sc sum(q x) - dmin mn
// sum(x).
__device__ __forceinline__ void piece_q2_k(const u8* const* blk, int p, const float* xb,
                                           float* acc) {
    const int h = p >> 1, lh = p & 1;
    u32 qs[MATVEC_ROWS][4], sc[MATVEC_ROWS][2], dd[MATVEC_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        ld_words<4>(blk[r] + 16 + 32 * h + 16 * lh, qs[r]);
        ld_words<2>(blk[r] + 8 * h, sc[r]);  // sub-blocks 8h .. 8h + 7
        ld_words<1>(blk[r] + 80, &dd[r]);
    }
    const float* x0 = xb + 128 * h + 16 * lh;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float sx = 0.0f, sq[MATVEC_ROWS];
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; r++) sq[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float4 x = *(const float4*)(x0 + 32 * j + 4 * i);
            sx += sum4(x);
#pragma unroll
            for (int r = 0; r < MATVEC_ROWS; r++)
                sq[r] = dot4((qs[r][i] >> (2 * j)) & 0x03030303u, x, 0.0f, sq[r]);
        }
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; r++) {
            // Sub-block 8h + 2j + lh: byte 2j + lh of the 8 loaded.
            u32 b = (sc[r][j >> 1] >> (8 * (2 * (j & 1) + lh))) & 0xFF;
            float d = f16_to_f32((u16)dd[r]), dmin = f16_to_f32((u16)(dd[r] >> 16));
            acc[r] += d * (float)(b & 15) * sq[r] - dmin * (float)(b >> 4) * sx;
        }
    }
}

// Q3_K (110 bytes, 2-byte aligned): hmask[32], qs[64] at 32, scales[12] at 96 (16 six-bit
// scales: low 4 bits of scale s in nibble s / 8 of byte s % 8, high 2 bits at bits 2 (s / 4)
// of byte 8 + s % 4), f16 d at 108. The field's q2 is lowered by 4 where bit 4h + j of
// hmask[l] is clear: q2 | hbit << 2 is q + 4, so the bytes enter with a bias of 4; value =
// d (scale - 32) q.
__device__ __forceinline__ void piece_q3_k(const u8* const* blk, int p, const float* xb,
                                           float* acc) {
    const int h = p >> 1, lh = p & 1;
    u32 qs[MATVEC_ROWS][4], hm[MATVEC_ROWS][4], sc[MATVEC_ROWS][3];
    float d[MATVEC_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        ld_words<4>(blk[r] + 32 + 32 * h + 16 * lh, qs[r]);
        ld_words<4>(blk[r] + 16 * lh, hm[r]);
        ld_words<3>(blk[r] + 96, sc[r]);
        d[r] = f16_to_f32(ld_nc16(blk[r] + 108));
    }
    const float* x0 = xb + 128 * h + 16 * lh;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float sq[MATVEC_ROWS];
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; r++) sq[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float4 x = *(const float4*)(x0 + 32 * j + 4 * i);
#pragma unroll
            for (int r = 0; r < MATVEC_ROWS; r++) {
                u32 q = ((qs[r][i] >> (2 * j)) & 0x03030303u) |
                        (((hm[r][i] >> (4 * h + j)) & 0x01010101u) << 2);
                sq[r] = dot4(q, x, 4.0f, sq[r]);
            }
        }
        // Scale s = 8h + 2j + lh: low bits in byte 2j + lh (nibble h), high bits in byte
        // 8 + 2 (j % 2) + lh at bits 2 (2h + j / 2).
        const int lo_byte = 2 * j + lh, hi_byte = 8 + 2 * (j & 1) + lh;
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; r++) {
            u32 lo = (sc[r][lo_byte >> 2] >> (8 * (lo_byte & 3) + 4 * h)) & 15;
            u32 hi = (sc[r][hi_byte >> 2] >> (8 * (hi_byte & 3) + 2 * (2 * h + (j >> 1)))) & 3;
            acc[r] += d[r] * (float)((int)(lo | (hi << 4)) - 32) * sq[r];
        }
    }
}

// Q8_0 piece p (2 per block; blocks 2-byte aligned): the 16 values qs[16p..]. The bytes are
// signed: flipping their top bit gives q + 128.
__device__ __forceinline__ void piece_q8_0(const u8* const* blk, int p, const float* xb,
                                           float* acc) {
    u32 qs[MATVEC_ROWS][4];
    float d[MATVEC_ROWS], s[MATVEC_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        ld_words<4>(blk[r] + 2 + 16 * p, qs[r]);
        d[r] = f16_to_f32(ld_nc16(blk[r]));
        s[r] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float4 x = *(const float4*)(xb + 16 * p + 4 * i);
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; r++)
            s[r] = dot4(qs[r][i] ^ 0x80808080u, x, 128.0f, s[r]);
    }
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) acc[r] += d[r] * s[r];
}

// The 4 bits of h (bits 0-3) as bit 4 of four bytes: the shifted copies of h do not overlap,
// so the product carries nothing.
__device__ __forceinline__ u32 bits_to_byte4(u32 h) { return ((h * 0x00204081u) & 0x01010101u) << 4; }

// Q5_0 piece p (4 per block; blocks 2-byte aligned): f16 d, u32 qh, 16 qs bytes; the piece
// is qs word p: elements 4p .. 4p + 3 in its low nibbles, 16 + 4p .. in its high ones, their
// fifth bits at the same positions of qh; value = d * (q - 16). (The unit walk read each block
// byte by byte, 14 loads per 8 values and row; one piece per block left 26 of 32 lanes idle
// on MLA's k_b, whose rows are 6 blocks long.) Every row's loads go out before any is used:
// ptxas put each row's loads after the row before's math, four round trips a piece where
// MLA's k_b has one piece a lane (SASS, sm_90), whatever the order in the source; it moves no
// load past a fence, and the math after it needs the loads anyway.
__device__ __forceinline__ void piece_q5_0(const u8* const* blk, int p, const float* xb,
                                           float* acc) {
    float4 x0 = *(const float4*)(xb + 4 * p), x1 = *(const float4*)(xb + 16 + 4 * p);
    u32 qs[MATVEC_ROWS];
    u16 d[MATVEC_ROWS], qh_lo[MATVEC_ROWS], qh_hi[MATVEC_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        ld_words<1>(blk[r] + 6 + 4 * p, &qs[r]);
        d[r] = ld_nc16(blk[r]);
        qh_lo[r] = ld_nc16(blk[r] + 2);
        qh_hi[r] = ld_nc16(blk[r] + 4);
    }
    __threadfence_block();
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        u32 qh = (u32)qh_lo[r] | ((u32)qh_hi[r] << 16);
        u32 lo = (qs[r] & 0x0F0F0F0Fu) | bits_to_byte4((qh >> (4 * p)) & 15u);
        u32 hi = ((qs[r] >> 4) & 0x0F0F0F0Fu) | bits_to_byte4((qh >> (16 + 4 * p)) & 15u);
        acc[r] += f16_to_f32(d[r]) * dot4(hi, x1, 16.0f, dot4(lo, x0, 16.0f, 0.0f));
    }
}

// The IQ4 code book (IQ4_VALUES) plus 128, so that it fits unsigned bytes; entry i is byte
// i % 4 of word i / 4.
#define IQ4_B0 0x3F2D1801u // -127 -104  -83  -65
#define IQ4_B1 0x766A5D4Fu //  -49  -35  -22  -10
#define IQ4_B2 0xA6998D81u //    1   13   25   38
#define IQ4_B3 0xF1D9C5B5u //   53   69   89  113

// The biased code book entries of the four nibbles of `sel` (bits 0-15), as four bytes: two
// byte permutes look up entries 0-7 and 8-15 by the nibbles' low three bits, a third picks
// one of the two by the nibble's top bit. No table in memory, so no serialized lookups.
__device__ __forceinline__ u32 iq4_lookup(u32 sel) {
    u32 idx = sel & 0x7777, top = (sel >> 1) & 0x4444;
    u32 lo = __byte_perm(IQ4_B0, IQ4_B1, idx), hi = __byte_perm(IQ4_B2, IQ4_B3, idx);
    return __byte_perm(lo, hi, 0x3210 | top);
}

// s += the 32 IQ4 values packed in qs[0..3] (element i < 16: low nibble of byte i, i + 16:
// its high nibble) . x[0..32). Word i's two lookups give bytes in the order low, high, low,
// high nibble.
__device__ __forceinline__ float iq4_dot32(const u32* qs, const float* x, float s) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 a = iq4_lookup(qs[i]), b = iq4_lookup(qs[i] >> 16);
        float4 x0 = *(const float4*)(x + 4 * i), x1 = *(const float4*)(x + 16 + 4 * i);
        s = fmaf(byte_f(a, 0, 128.0f), x0.x, s);
        s = fmaf(byte_f(a, 2, 128.0f), x0.y, s);
        s = fmaf(byte_f(b, 0, 128.0f), x0.z, s);
        s = fmaf(byte_f(b, 2, 128.0f), x0.w, s);
        s = fmaf(byte_f(a, 1, 128.0f), x1.x, s);
        s = fmaf(byte_f(a, 3, 128.0f), x1.y, s);
        s = fmaf(byte_f(b, 1, 128.0f), x1.z, s);
        s = fmaf(byte_f(b, 3, 128.0f), x1.w, s);
    }
    return s;
}

// IQ4_XS piece p (8 per block; blocks 8-byte aligned at best): sub-block p, 16 qs bytes at
// 8 + 16p; scale d * (ls - 32) from the header (see dq8_iq4_xs).
__device__ __forceinline__ void piece_iq4_xs(const u8* const* blk, int p, const float* xb,
                                             float* acc) {
    u32 hd[MATVEC_ROWS][2], qs[MATVEC_ROWS][4];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        ld_words<2>(blk[r], hd[r]);
        ld_words<4>(blk[r] + 8 + 16 * p, qs[r]);
    }
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        int ls = ((hd[r][1] >> (4 * p)) & 15) | (((hd[r][0] >> (16 + 2 * p)) & 3) << 4);
        float dl = f16_to_f32((u16)hd[r][0]) * (float)(ls - 32);
        acc[r] += dl * iq4_dot32(qs[r], xb + 32 * p, 0.0f);
    }
}

// IQ4_NL piece (1 per block, 2-byte aligned): f16 d, then 16 qs bytes as one IQ4_XS sub-block.
__device__ __forceinline__ void piece_iq4_nl(const u8* const* blk, int p, const float* xb,
                                             float* acc) {
    u32 qs[MATVEC_ROWS][4];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) ld_words<4>(blk[r] + 2, qs[r]);
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++)
        acc[r] += f16_to_f32(ld_nc16(blk[r])) * iq4_dot32(qs[r], xb, 0.0f);
}

// Scalar types, 16-byte aligned rows: a "block" is 8 elements, a piece 16 bytes of it.
__device__ __forceinline__ void piece_f32(const u8* const* blk, int p, const float* xb,
                                          float* acc) {
    float4 x = *(const float4*)(xb + 4 * p);
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        uint4 w = ld_stream16(blk[r] + 16 * p);
        acc[r] += __uint_as_float(w.x) * x.x + __uint_as_float(w.y) * x.y +
                  __uint_as_float(w.z) * x.z + __uint_as_float(w.w) * x.w;
    }
}
template <bool BF16>
__device__ __forceinline__ void half_piece(const u8* const* blk, const float* xb, float* acc) {
    float4 x0 = *(const float4*)xb, x1 = *(const float4*)(xb + 4);
    float xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        uint4 w = ld_stream16(blk[r]);
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u16 v = (u16)((&w.x)[i / 2] >> (16 * (i % 2)));
            s = fmaf(BF16 ? bf16_to_f32(v) : f16_to_f32(v), xs[i], s);
        }
        acc[r] += s;
    }
}
__device__ __forceinline__ void piece_f16(const u8* const* blk, int p, const float* xb,
                                          float* acc) {
    half_piece<false>(blk, xb, acc);
}
__device__ __forceinline__ void piece_bf16(const u8* const* blk, int p, const float* xb,
                                           float* acc) {
    half_piece<true>(blk, xb, acc);
}

// Any type, any alignment: piece p is the 8-element unit p of the block, through dq8_<type>.
template <void (*DQ8)(const u8*, int, float*)>
__device__ __forceinline__ void generic_piece(const u8* const* blk, int p, const float* xb,
                                              float* acc) {
    const float4* xp = (const float4*)(xb + 8 * p);
    float4 x0 = xp[0], x1 = xp[1];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        float v[8];
        DQ8(blk[r], p, v);
        acc[r] += v[0] * x0.x + v[1] * x0.y + v[2] * x0.z + v[3] * x0.w;
        acc[r] += v[4] * x1.x + v[5] * x1.y + v[6] * x1.z + v[7] * x1.w;
    }
}

// The values a thread of a parts launch's tail holds of each row (ops.rs checks the widths
// against the block: GLM-5's 2048-value query, 512-value latent and 128-value key on 128
// threads), few where the rows are short, so that the tail adds no registers to the kernel.
#define TAIL_QUERY_VALS 16
#define TAIL_LATENT_VALS 4
#define TAIL_KEY_VALS 2

// The weights of the norm that item `item`'s tail runs into L2 from block 0 of the item, as
// the launch starts (a token's other bytes have taken them out since the last one).
__device__ __forceinline__ void parts_tail_prefetch(const LatentNorm& a, int item) {
    if (blockIdx.x != 0) return;
    const int i = 32 * threadIdx.x;  // a 128-byte line a thread
    if (item == 0 && a.qx && i < a.dq) prefetch_l2(a.qw + i);
    if (item == 1 && i < a.dl) prefetch_l2(a.w + i);
    if (item == 1 && i < a.dr / 2) prefetch_l2(a.inv_freq + i);
    if (item == 2 && i < a.dk) prefetch_l2(a.kw + i), prefetch_l2(a.kb + i);
}

// The end of every block of a parts launch with a latent (MatvecParts): the block's rows
// counted in behind a fence, and the last block of its item norms that item's row (its other
// blocks' rows read through L2).
__device__ __forceinline__ void parts_tail(const MatvecParts& parts) {
    __shared__ float scratch[32];
    __shared__ bool last;
    // The block's rows stored, then one fence for them from the thread that counts (with a
    // fence in every thread of its ~1,500 blocks this launch took 16.7 us a GLM-5 layer on an
    // H100's chain clock, against 13.5 for it and latent_norm_rope apart: docs/performance.md).
    __syncthreads();
    const int item = blockIdx.y;
    if (threadIdx.x == 0) last = count_in(parts.done + item, 1, gridDim.x);
    __syncthreads();
    if (!last || (item == 0 && !parts.latent.qx)) return;
    if (item == 0)
        query_row<TAIL_QUERY_VALS, true>(parts.latent, 0, scratch);
    else if (item == 1)
        latent_row<TAIL_LATENT_VALS, true>(parts.latent, 0, scratch);
    else
        key_row<TAIL_KEY_VALS, true>(parts.latent, 0, scratch);
}

// The values a thread of matvec_tma_parts_<type>'s tail holds (288 threads, the producer
// warp's too): GLM-5's and DeepSeek-V3's widths (a query of 2048 or 1536, a latent of 512, a
// key of 128), as ops.rs's LatentNorm::fits checks.
#define TMA_TAIL_QUERY_VALS 8
#define TMA_TAIL_LATENT_VALS 2
#define TMA_TAIL_KEY_VALS 1

// The end of every block of matvec_tma_parts_<type> with a latent (all its threads): the
// block counts the tiles it stored of each of the three matrices (`tiles` of each, taken by
// the blocks in turn) behind one fence, and the block that stores a matrix's last tile norms
// its row as parts_tail does. scratch: 36 floats of shared memory the block no longer reads
// (a static array of the tail's own would take Q5_K's 7168-value rows past SM120's 99 KiB).
__device__ __forceinline__ void tma_parts_tail(const MatvecParts& pt, const int tiles[3],
                                               float* scratch) {
    float* last = scratch + 32;
    __syncthreads();  // the block's rows stored, its scratch read
    if (threadIdx.x == 0) {
        // count_in's steps for three counts, behind one release fence for the block's rows.
        fence_acq_rel();
        const int b = blockIdx.x, n = gridDim.x;
        // The block's groups before group g: b, b + n, ... below g.
        auto before = [&](int g) { return g > b ? (g - b + n - 1) / n : 0; };
        for (int item = 0, g0 = 0; item < 3; g0 += tiles[item++]) {
            const int mine = before(g0 + tiles[item]) - before(g0);
            const bool ends = mine > 0 && atomicAdd(pt.done + item, mine) + mine == tiles[item];
            if (ends) pt.done[item] = 0;  // for the next launch (stream order)
            last[item] = ends ? 1.0f : 0.0f;
        }
        if (last[0] != 0.0f || last[1] != 0.0f || last[2] != 0.0f) fence_acq_rel();
    }
    __syncthreads();
    const bool q = last[0] != 0.0f, l = last[1] != 0.0f, k = last[2] != 0.0f;
    if (q && pt.latent.qx) query_row<TMA_TAIL_QUERY_VALS, true>(pt.latent, 0, scratch);
    if (l) latent_row<TMA_TAIL_LATENT_VALS, true>(pt.latent, 0, scratch);
    if (k) key_row<TMA_TAIL_KEY_VALS, true>(pt.latent, 0, scratch);
}

// The factor of a query latent's RMS norm from its tiles' sums of squares, added in one order
// by every warp (the same bits in every thread).
__device__ __forceinline__ float query_norm_factor(const QueryRows& qr) {
    float s = 0.0f;
#pragma unroll 4
    for (int i = threadIdx.x & 31; i < qr.tiles; i += 32) s += __ldcg(qr.sq + i);
    return rsqrtf(warp_sum(s) / (float)qr.latent.dq + qr.latent.eps);
}

// The values a lane of matvec_tma_query_<type>'s tail holds (one warp): a latent of 512 and
// a key of 128 (ops.rs's query_takes checks).
#define QUERY_TAIL_LATENT_VALS 16
#define QUERY_TAIL_KEY_VALS 4

// What the parts launch in its qsq mode left of the latent's and the key's rows, into their
// caches as tma_parts_tail would have written them at the end of the parts launch (whose grid
// q_b's wait then waited for): by the producer warp of matvec_tma_query_<type>'s last block
// once it has issued its copies (that block has the fewest tiles, and its other warps still
// compute them). The blocks' consumers write the normed query latent, a share each. H100,
// chain clock, a GLM-5 layer: 9.4-9.7 us as here, against q_b's 9.2 alone; 11.8 with the tail
// after the block's products (all its threads), 17.9 with the query latent in this one warp
// too (its 64 loads a lane one after another).
__device__ __forceinline__ void tma_query_tail(const LatentNorm& a) {
    pdl_wait(false);  // the parts launch's rows
    latent_row<QUERY_TAIL_LATENT_VALS, true, WarpTeam>(a, 0, nullptr);
    if (a.kx) key_row<QUERY_TAIL_KEY_VALS, true, WarpTeam>(a, 0, nullptr);
}

// The rows of one block of threads (see the launch geometry above) with PIECES pieces per
// quant block of ELEMS elements / BYTES bytes. Every thread reaches the barrier: rows past the
// end are computed on the last row and not stored. HALF: up to two row groups per warp (half
// a warp each), for short rows (matvec_half_<type>); a kernel of its own, because the
// whole-warp kernels lost up to 8% wherever they also held the half-warp form (H200, ncu:
// GLM-5's 6144 x 16384 attn_output 32 -> 34.5 us with the form chosen at run time in one
// body, 33 -> 42 us with both forms instantiated in one kernel).
template <int ELEMS, int BYTES, int PIECES, PieceFn PIECE, bool HALF>
__device__ void matvec_body(const u8* w, i64 mat_stride, const int* ids, int rows, int k,
                            i64 row_bytes, const float* x, int x_group, i64 x_stride, float* y,
                            i64 y_stride, const MatvecParts& parts) {
    __shared__ float partial[(HALF ? 2 : 1) * MATVEC_WIDE_WARPS][MATVEC_ROWS];
    int b = blockIdx.y;
    if (parts.w1) {
        if (b > 0) {
            w = b == 1 ? parts.w1 : parts.w2;
            rows = b == 1 ? parts.rows1 : parts.rows2;
            y = b == 1 ? parts.y1 : parts.y2;
        }
        b = 0;
    }
    // Groups per block: the fewest (so the most warps per group) that still cover every row.
    int groups = (rows + MATVEC_ROWS - 1) / MATVEC_ROWS, per_block = 1, warps = blockDim.x >> 5;
    while (per_block < (HALF ? 2 : 1) * warps && (int)gridDim.x * per_block < groups)
        per_block *= 2;
    int lanes = blockDim.x / per_block;  // threads per group, a multiple of 16 (HALF) or 32
    int t = threadIdx.x % lanes, group = threadIdx.x / lanes;
    int r0 = (blockIdx.x * per_block + group) * MATVEC_ROWS;
    if (ids) pdl_wait();  // the MoE choice comes from the router kernel
    i64 m = ids ? ids[b] : b;
    if (m < 0) return;  // a MoE choice held by another rank: no output (uniform per block)
    const float* xb = x + (i64)(b / x_group) * x_stride;
    const u8* row[MATVEC_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++)
        row[r] = w + m * mat_stride + (i64)min(r0 + r, rows - 1) * row_bytes;
    // The first weights into L2 while the previous kernel finishes (x may not be read yet).
    int pieces = k / ELEMS * PIECES, p = t % PIECES;
    if (r0 < rows && t < pieces) {
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; r++)
            prefetch_l2(row[r] + (i64)(t / PIECES) * BYTES + p * (BYTES / PIECES));
    }
    pdl_enter();
    float acc[MATVEC_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) acc[r] = 0.0f;
    // PIECES divides a group's lanes (the host puts no 32-piece type on half warps), so each
    // thread keeps one piece index p and walks the blocks.
    if (r0 < rows) {
#pragma unroll 4
        for (int q = t; q < pieces; q += lanes) {
            i64 blk_off = (i64)(q / PIECES) * BYTES;
            const u8* blk[MATVEC_ROWS];
#pragma unroll
            for (int r = 0; r < MATVEC_ROWS; r++) blk[r] = row[r] + blk_off;
            PIECE(blk, p, xb + (i64)(q / PIECES) * ELEMS, acc);
        }
    }
    // A group's lanes within one warp: all 32, or 16 when a half warp is a whole group.
    const int span = HALF && lanes == 16 ? 16 : 32;
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        float s = span == 32 ? warp_sum(acc[r]) : half_warp_sum(acc[r]);
        if ((threadIdx.x & (span - 1)) == 0) partial[threadIdx.x / span][r] = s;
    }
    __syncthreads();
    if (t < MATVEC_ROWS && r0 + t < rows) {
        int per = lanes / span, first = group * per;
        float s = 0.0f;
        for (int i = 0; i < per; i++) s += partial[first + i][t];
        y[b * y_stride + r0 + t] = s;
    }
}

// ---- Q4_K on the integer tensor cores (matvec_tc_q4_k) ----
//
// On the CUDA cores above, each weight costs about three instructions per row (the byte into
// a float, the bias subtraction, the FMA): measured with ncu on an H200, a Q4_K matvec issues
// ~5.8 instructions per weight-row and runs out of issue slots near half the memory bandwidth.
// Here the weights stay small integers: 16 rows x 32 weights of one sub-block are one
// mma.sync m16n8k32 with 8-bit operands, their nibbles masked out four at a time.
//
// x becomes integers exactly enough: per 256-element block, N = rint(x / s) with
// s = max|x| / (127 * 2^21) is split into base-128 digits (N = d0 2^21 + d1 2^14 + d2 2^7 + d3,
// |d0| <= 127, |d1..3| <= 64), i.e. x to 28 bits of the block's largest value, finer than its
// f32 rounding. The four digit planes of a sub-block are four of the mma's B columns (TcQ4k:
// columns 0-3 for one sub-block, 4-7 for the next), so one mma gives the sums q . d_p of all
// planes at once, exactly, in int32; the row's 6-bit sub-block scales multiply them as
// integers, and once per 256-element block they become floats (times d, s and 2^(21 - 7p)).
// The minimums use the f32 sums of x per sub-block. Result: the f32 product of the
// dequantized row and x up to f32 rounding (nmse ~1e-14 against f64, like the CUDA-core kernel).
//
// Each thread block turns its x into planes in shared memory first (tc_prepare_x) while the
// first weight loads are in flight; that costs a pass over x, which is why Gpu::matvec uses
// this kernel only for matrices with many rows (ops.rs, uses_tensor_cores).
//
// A tile = 16 rows; a group = T tiles of one item, computed by one thread block of W = 4
// (matvec_tc_q4_k) or 8 (matvec_tc8_q4_k) warps, W / T per tile, which take its 256-blocks in
// turn and meet in shared memory. Grid (blocks, 1), the items' groups one after the other:
// where every item reads one x, block b takes groups b, b + blocks, ...; else the b-th of
// `blocks` equal runs of consecutive groups. The host gives every group its own block, or
// launches one wave of blocks that walk their groups, the weight loads running on across
// group boundaries (lab, H200: DS3's gate and up of 9 choices 62.1 -> 53.9 us; as one block
// per group, the last of three waves was mostly idle). A block prepares x again when its next
// group's item reads another one: rarely within a run. Dynamic shared memory tc_smem_bytes(k)
// (ops.rs): 4 planes of k + 32 bytes (the padding puts the 16 lanes reading one sub-block on
// distinct banks), k / 256 scales (rounded up to even), k / 32 sums, to a 128-byte boundary,
// then 256 bytes of zeros (TcBPair).


__device__ __forceinline__ void mma_s8_16832(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                             u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
}
// c += the products (A signed, or unsigned 0..255: the _u8s8 form).
__device__ __forceinline__ void mma_s8_16832_acc(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                                 u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_u8s8_16832_acc(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                                   u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Weights through L1 here (unlike ld_stream16): a lane's 8 bytes of a chunk share a 32-byte
// sector with its neighbour's in every other block, and the second load then hits L1 instead
// of asking L2 again (measured: L2 traffic twice the DRAM traffic without it).
__device__ __forceinline__ uint2 ld_cached8(const u8* p) {
    uint2 v;
    asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ld_cached16(const u8* p) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ int tc_plane_stride(int k) { return k + 32; }
// The sums of x follow the k / 256 scales, from an 8-byte boundary (lanes read them in pairs).
__device__ __forceinline__ int tc_scales_len(int k) { return (k / 256 + 1) & ~1; }
// Bytes of x's planes, scales and sums to a 128-byte boundary: where 256 bytes of zeros follow,
// the B of lanes whose columns a product must not add to (TcBPair, TcQ6k::b_block).
__device__ __forceinline__ int tc_zeros_at(int k) {
    return (4 * tc_plane_stride(k) + 4 * tc_scales_len(k) + 4 * (k / 32) + 127) & ~127;
}
// All that tc_prepare_x writes: where the bulk-copy kernels' stages begin (ops.rs: tc_smem_bytes).
__device__ __forceinline__ int tc_x_bytes(int k) { return tc_zeros_at(k) + 256; }

// One warp's share of x's 256-element block blk as digit planes (lane l owns elements
// 8l .. 8l + 7): the block's scale s (0 for a zero block), the sum of the lane's 4-lane group
// (32 values), and the lane's 8 digits of each plane p as bytes (words[p]) with their sum.
// HALVES (IQ4_XS, TcIq4xs): lane l = 4 j + i of sub-block j owns its elements 4i .. 4i + 3 and
// 16 + 4i .. 16 + 4i + 3 instead, in the order 4i, 16 + 4i, 4i + 1, 16 + 4i + 1, ..., as an
// IQ4_XS byte's two nibbles come (the block's sums per 32 values are the same).
struct XDigits {
    float s, sum;
    uint2 words[4];
    int dsum[4];
};
template <bool HALVES = false>
__device__ __forceinline__ XDigits x_block_digits(const float* x, int blk, int lane) {
    XDigits r;
    const float* xl = x + 256 * blk + (HALVES ? 32 * (lane >> 2) + 4 * (lane & 3) : 8 * lane);
    float4 u = *(const float4*)xl, v = *(const float4*)(xl + (HALVES ? 16 : 4));
    float e[8] = {u.x, u.y, u.z, u.w, v.x, v.y, v.z, v.w};
    if (HALVES) {
        const float paired[8] = {u.x, v.x, u.y, v.y, u.z, v.z, u.w, v.w};
#pragma unroll
        for (int i = 0; i < 8; i++) e[i] = paired[i];
    }
    float mx = 0.0f, sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        mx = fmaxf(mx, fabsf(e[i]));
        sum += e[i];
    }
    mx = warp_max(mx);
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    r.sum = sum + __shfl_xor_sync(0xffffffffu, sum, 2);
    float inv = mx > 0.0f ? (127.0f * 2097152.0f) / mx : 0.0f;
    r.s = mx > 0.0f ? 1.0f / inv : 0.0f;
    u32 digit[4][8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int n = __float2int_rn(e[i] * inv);
#pragma unroll
        for (int p = 3; p > 0; p--) {
            int d = ((n + 64) & 127) - 64;
            digit[p][i] = (u32)d;
            n = (n - d) >> 7;
        }
        digit[0][i] = (u32)n;
    }
#pragma unroll
    for (int p = 0; p < 4; p++) {
        u32 lo = __byte_perm(__byte_perm(digit[p][0], digit[p][1], 0x0040),
                             __byte_perm(digit[p][2], digit[p][3], 0x0040), 0x5410);
        u32 hi = __byte_perm(__byte_perm(digit[p][4], digit[p][5], 0x0040),
                             __byte_perm(digit[p][6], digit[p][7], 0x0040), 0x5410);
        r.words[p] = make_uint2(lo, hi);
        r.dsum[p] = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) r.dsum[p] += (int)digit[p][i];
    }
    return r;
}

// Planes, scales and sums of x[0, k) and the zeros after them into shared memory by the block's
// first nwarps warps, one warp per 256-element block at a time (HALVES: x_block_digits').
template <bool HALVES = false>
__device__ void tc_prepare_x(const float* x, int k, u8* sm, int nwarps) {
    int stride = tc_plane_stride(k);
    float* scales = (float*)(sm + 4 * stride);
    float* sums = scales + tc_scales_len(k);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x < 32) ((uint2*)(sm + tc_zeros_at(k)))[threadIdx.x] = make_uint2(0u, 0u);
    for (int blk = warp; blk < k / 256; blk += nwarps) {
        XDigits xd = x_block_digits<HALVES>(x, blk, lane);
        if (lane == 0) scales[blk] = xd.s;
        if ((lane & 3) == 0) sums[8 * blk + lane / 4] = xd.sum;
#pragma unroll
        for (int p = 0; p < 4; p++) *(uint2*)(sm + p * stride + 256 * blk + 8 * lane) = xd.words[p];
    }
}

// The 6-bit scales (sc) and minimums (m) of Q4_K sub-blocks 0-3 ([0]) and 4-7 ([1]), one per
// byte, from the header's scale words w0 (bytes 0-3), w1 (4-7), w2 (8-11).
__device__ __forceinline__ void q4k_packed(u32 w0, u32 w1, u32 w2, u32* sc, u32* m) {
    sc[0] = w0 & 0x3F3F3F3Fu;
    m[0] = w1 & 0x3F3F3F3Fu;
    sc[1] = (w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u);
    m[1] = ((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u);
}

// Lane (g, t)'s B bytes of x's 256-block kb: at + step kb (step 0: the zeros after x's planes).
struct TcBCol {
    const u8* at;
    int step;
    __device__ __forceinline__ const u8* of(int kb) const { return at + step * kb; }
};
// The B of a chunk's two m16n8k32 products (TcKquant), the first's columns 0-3 x's
// planes 0-3 of sub-block 2c and the second's columns 4-7 those of sub-block 2c + 1 (plane
// g % 4, bytes 8t .. of the first or second 32 of each 64), their other columns zeros. Both
// products add into one C, whose columns 0-3 (lanes t < 2) then hold the first's sums and 4-7
// (t >= 2) the second's, each lane's own with no select (forty-fifth look: 16 selects a
// block fewer, 4 more shared loads).
struct TcBPair {
    TcBCol first, second;
    __device__ static __forceinline__ TcBPair of_lane(const u8* planes, int k, int g, int t) {
        const TcBCol x = {planes + (g & 3) * tc_plane_stride(k) + 32 * (g >> 2) + 8 * t, 256};
        const TcBCol z = {planes + tc_zeros_at(k) + 8 * t, 0};
        return g < 4 ? TcBPair{x, z} : TcBPair{z, x};
    }
};

// PTX lop3 with the function fixed: (a & mask) | (b & ~mask), and (a & mask) ^ flip, one
// instruction each. (Written in C, ptxas re-derives masks it can fold into the shifts around
// them and spends an instruction more on each: matvec_tma_groups_q6_k's stage loop 351 -> 397
// instructions.) TcQ5k and TcQ6k build their A words with them, TcIq4xs its scales.
__device__ __forceinline__ u32 bit_select(u32 a, u32 b, u32 mask) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(r) : "r"(a), "r"(b), "r"(mask));
    return r;
}
__device__ __forceinline__ u32 and_xor(u32 a, u32 mask, u32 flip) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(r) : "r"(a), "r"(mask), "r"(flip));
    return r;
}
// A lane's registers for one Q4_K block (144 bytes: f16 d, f16 dmin, 12 scale bytes, 128 qs
// bytes) of its two rows (g and g + 8 of the tile): the 16-byte headers and its 8 qs bytes
// (8t ..) of each 32-byte chunk. Chunk c holds sub-block 2c in its low nibbles and 2c + 1 in
// its high ones: the low nibbles' product takes TcBPair's first B, the high nibbles' (as bytes
// & 0xF0: 16 times the nibble, unsigned) its second (two nibble masks a word, no shift).
//
// Q5 (TcQ5k, the bulk-copy kernels only): Q5_K's 176-byte block has the same header, then 32
// qh bytes, then the qs bytes as Q4_K's; bit 2c of qh byte l is the fifth bit of qs byte l's
// low nibble in chunk c, bit 2c + 1 of its high nibble. The lane's 8 qh bytes (8t ..) serve
// every chunk; both nibbles become signed bytes of 0..31 (the high ones shifted down: the
// fifth bit leaves no room for 16 times the value).
template <bool Q5>
struct TcKquant {
    static const int BYTES = Q5 ? 176 : 144;
    static const int ROW = Q5 ? 1440 : 1184;  // a bulk-copy stage's row (matvec_tma_body)
    static const int STAGES = 3;               // bulk-copy stages
    static const bool ANY_ROW_START = false;   // stage rows start 16-byte aligned
    static const int QS = Q5 ? 48 : 16;        // where the qs bytes start
    static const bool HALVES = false;          // x's planes in x_block_digits' plain order
    uint4 h_lo, h_hi;
    uint2 q_lo[4], q_hi[4];
    uint2 f_lo[4], f_hi[4];  // Q5: qh's bits m and m + 4 of each byte (f[m])

    __device__ __forceinline__ void load(const u8* blo, const u8* bhi, int t) {
        static_assert(!Q5, "the matvec_tc kernels take Q4_K only");
        h_lo = ld_cached16(blo);
        h_hi = ld_cached16(bhi);
#pragma unroll
        for (int c = 0; c < 4; c++) {
            q_lo[c] = ld_cached8(blo + 16 + 32 * c + 8 * t);
            q_hi[c] = ld_cached8(bhi + 16 + 32 * c + 8 * t);
        }
    }
    // The same from a stage in shared memory (the bulk-copy kernels).
    __device__ __forceinline__ void load_stage(const u8* blo, const u8* bhi, int t) {
        h_lo = *(const uint4*)blo;
        h_hi = *(const uint4*)bhi;
        if (Q5) {
            // Split once a block (by lop3: with a plain & ptxas masks again after each shift,
            // matvec_tma_items_q5_k's stage loop 209 -> 226 instructions).
            const uint2 l = *(const uint2*)(blo + 16 + 8 * t);
            const uint2 h = *(const uint2*)(bhi + 16 + 8 * t);
#pragma unroll
            for (int m = 0; m < 4; m++) {
                const u32 bits = 0x11111111u << m;
                f_lo[m] = make_uint2(and_xor(l.x, bits, 0u), and_xor(l.y, bits, 0u));
                f_hi[m] = make_uint2(and_xor(h.x, bits, 0u), and_xor(h.y, bits, 0u));
            }
        }
#pragma unroll
        for (int c = 0; c < 4; c++) {
            q_lo[c] = *(const uint2*)(blo + QS + 32 * c + 8 * t);
            q_hi[c] = *(const uint2*)(bhi + QS + 32 * c + 8 * t);
        }
    }

    // Lane (g, t)'s B of x's planes of k elements (tc_prepare_x), as every tile type has it.
    typedef TcBPair B;
    __device__ static __forceinline__ B b_cols(const u8* planes, int k, int g, int t) {
        return TcBPair::of_lane(planes, k, g, t);
    }
    // The weights of lane t's output columns 2t, 2t + 1: planes 0, 1 (2^21, 2^14) or 2, 3
    // (2^7, 1).
    __device__ static __forceinline__ float2 plane_factors(int t) {
        return t & 1 ? make_float2(128.0f, 1.0f) : make_float2(2097152.0f, 16384.0f);
    }

    // Q5: the low nibbles of q with bit b of each byte of qh as their fifth bit, given f, qh's
    // bits b % 4 and b % 4 + 4 (f_lo, f_hi): shifted, f has that bit at bit 4 and zeros at
    // bits 5-7, so one select makes the byte.
    __device__ static __forceinline__ u32 five(u32 q, u32 f, int b) {
        return bit_select(q, b < 4 ? f << (4 - b) : f >> (b - 4), 0x0F0F0F0Fu);
    }

    // b: the lane's B (b_cols), kb the block; sums: the block's 8 sub-block sums of x; s: its
    // scale; pf: plane_factors(t).
    __device__ __forceinline__ void dot(const B& b, int kb, const float* sums, float s, int t,
                                        float2 pf, float& acc_lo, float& acc_hi) const {
        u32 sc_lo[2], m_lo[2], sc_hi[2], m_hi[2];
        q4k_packed(h_lo.y, h_lo.z, h_lo.w, sc_lo, m_lo);
        q4k_packed(h_hi.y, h_hi.z, h_hi.w, sc_hi, m_hi);
        const int odd = t >> 1;  // this lane's columns: sub-blocks 2c + odd, high nibbles if 1
        const u8 *b1 = b.first.of(kb), *b2 = b.second.of(kb);
        int ci[4] = {0, 0, 0, 0};
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const uint2 x1 = *(const uint2*)(b1 + 64 * c), x2 = *(const uint2*)(b2 + 64 * c);
            int cc[4];
            if (Q5) {
                const int b = 2 * c, e = b & 3, o = (b + 1) & 3;
                mma_s8_16832(cc, five(q_lo[c].x, f_lo[e].x, b), five(q_hi[c].x, f_hi[e].x, b),
                             five(q_lo[c].y, f_lo[e].y, b), five(q_hi[c].y, f_hi[e].y, b), x1.x,
                             x1.y);
                mma_s8_16832_acc(cc, five(q_lo[c].x >> 4, f_lo[o].x, b + 1),
                                 five(q_hi[c].x >> 4, f_hi[o].x, b + 1),
                                 five(q_lo[c].y >> 4, f_lo[o].y, b + 1),
                                 five(q_hi[c].y >> 4, f_hi[o].y, b + 1), x2.x, x2.y);
            } else {
                mma_s8_16832(cc, q_lo[c].x & 0x0F0F0F0Fu, q_hi[c].x & 0x0F0F0F0Fu,
                             q_lo[c].y & 0x0F0F0F0Fu, q_hi[c].y & 0x0F0F0F0Fu, x1.x, x1.y);
                mma_u8s8_16832_acc(cc, q_lo[c].x & 0xF0F0F0F0u, q_hi[c].x & 0xF0F0F0F0u,
                                   q_lo[c].y & 0xF0F0F0F0u, q_hi[c].y & 0xF0F0F0F0u, x2.x, x2.y);
            }
            // Sub-block 2c + odd's scales: byte 2 (c % 2) + odd of word c / 2.
            const u32 sel = 0x4440 + 2 * (c & 1) + odd;
            int sl = (int)__byte_perm(sc_lo[c >> 1], 0u, sel);
            int sh = (int)__byte_perm(sc_hi[c >> 1], 0u, sel);
            ci[0] += sl * cc[0];
            ci[1] += sl * cc[1];
            ci[2] += sh * cc[2];
            ci[3] += sh * cc[3];
        }
        // Q4: the high nibbles' sums are 16 times theirs: exact multiples of 16 (|sum| < 2^28),
        // so exact as floats, and a sixteenth of s takes them back. (Q5's reach 2^26: f32
        // rounding.)
        if (!Q5 && odd) s *= 0.0625f;
        float dlo = f16_to_f32((u16)h_lo.x) * s, dhi = f16_to_f32((u16)h_hi.x) * s;
        acc_lo += dlo * (pf.x * (float)ci[0] + pf.y * (float)ci[1]);
        acc_hi += dhi * (pf.x * (float)ci[2] + pf.y * (float)ci[3]);
        // Lane t subtracts the minimums of sub-blocks 2t and 2t + 1.
        float2 sx = *(const float2*)(sums + 2 * t);
        u32 wl = t >= 2 ? m_lo[1] : m_lo[0], wh = t >= 2 ? m_hi[1] : m_hi[0];
        int j = 2 * (t & 1);
        acc_lo -= f16_to_f32((u16)(h_lo.x >> 16)) *
                  (byte_f(wl, j, 0.0f) * sx.x + byte_f(wl, j + 1, 0.0f) * sx.y);
        acc_hi -= f16_to_f32((u16)(h_hi.x >> 16)) *
                  (byte_f(wh, j, 0.0f) * sx.x + byte_f(wh, j + 1, 0.0f) * sx.y);
    }
};
typedef TcKquant<false> TcQ4k;
typedef TcKquant<true> TcQ5k;

// IQ4_XS on the same tiles (TcIq4xs, the bulk-copy kernels only). A 136-byte block: f16 d,
// 16 bits of the scales' high parts, 4 bytes of their low nibbles, then 16 qs bytes a
// sub-block, byte i holding element i (low nibble) and 16 + i (high nibble); value = d (ls -
// 32) IQ4_VALUES[nibble]. Qs word w of a sub-block holds elements 4w .. 4w + 3 and 16 + 4w ..
// 16 + 4w + 3, looked up four at a time by byte permutes into signed bytes in the nibbles'
// order (4w, 16 + 4w, 4w + 1, ...), each entry as the sum of two (TcIq4xs::lookup); x's
// planes come in that order (x_block_digits' HALVES). Lane t loads qs bytes 8t .. 8t + 7 of
// each pair p of sub-blocks, words 2 (t & 1) and 2 (t & 1) + 1 of sub-block 2p + (t >> 1), in
// one load where a word of each sub-block took two: the first word's entries go into two
// m16n8k32 products, the second's into two more, all into one C, whose columns 0-3 (lanes
// t < 2) then hold sub-block 2p's sums and 4-7 sub-block 2p + 1's, as TcBPair's do (b_cols).
// No minimums; the sums, four times theirs (TcIq4xs::scales), reach 2^28 (f32 rounding).
// The code book as signed bytes: entries 0-7 (the biased one's with each byte's top bit
// flipped: all negative), and entries 8-15 plus one (1 .. 114: all positive).
#define IQ4_S0 (IQ4_B0 ^ 0x80808080u)
#define IQ4_S1 (IQ4_B1 ^ 0x80808080u)
#define IQ4_S2_PLUS1 ((IQ4_B2 ^ 0x80808080u) + 0x01010101u)
#define IQ4_S3_PLUS1 ((IQ4_B3 ^ 0x80808080u) + 0x01010101u)
// PTX prmt: byte sel_i & 7 of the pair (a: 0-3, b: 4-7) for each result byte i, from the
// selector's low 16 bits; where sel_i & 8, that byte's sign in all 8 bits instead.
// (__byte_perm lets the compiler mask the selectors again each time.)
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}
struct TcIq4xs {
    static const int BYTES = 136;
    static const int ROW = 1120;  // a bulk-copy stage's row (matvec_tma_body): 32 x an odd number
    static const int STAGES = 3;
    static const bool ANY_ROW_START = false;
    static const bool HALVES = true;
    uint2 h_lo, h_hi;        // d | scales_h << 16, scales_l
    uint2 q_lo[4], q_hi[4];  // qs bytes 8t .. 8t + 7 of sub-blocks 2p and 2p + 1

    __device__ __forceinline__ void load_stage(const u8* blo, const u8* bhi, int t) {
        h_lo = *(const uint2*)blo;
        h_hi = *(const uint2*)bhi;
#pragma unroll
        for (int p = 0; p < 4; p++) {
            q_lo[p] = *(const uint2*)(blo + 8 + 32 * p + 8 * t);
            q_hi[p] = *(const uint2*)(bhi + 8 + 32 * p + 8 * t);
        }
    }
    // Lane (g, t)'s B of pair 0 (64 bytes a pair on): the x bytes of the lane's two words of
    // sub-block t >> 1 (plane g % 4) where its columns are that sub-block's (g >> 2 == t >> 1),
    // else zeros. In a shared load's half-warp the 8 lanes on x and the 8 on the zeros take
    // alternate pairs of banks (the zeros from 8 bytes in): no conflicts.
    typedef TcBCol B;
    __device__ static __forceinline__ B b_cols(const u8* planes, int k, int g, int t) {
        const int half = 16 * (t & 1);
        return (g >> 2) == (t >> 1)
                   ? TcBCol{planes + (g & 3) * tc_plane_stride(k) + 32 * (t >> 1) + half, 256}
                   : TcBCol{planes + tc_zeros_at(k) + 8 + half, 0};
    }
    // The code book entries of q's eight nibbles, those of bytes 0-1 in .x and of bytes 2-3 in
    // .y, each in the nibbles' order, as the sum low + high of two words of signed bytes (the
    // products are linear in A): a nibble n < 8 is entry n in low (the permute's selector n)
    // and 0 in high; n >= 8 is -1 in low (selector n: the sign of entry n - 8, negative) and
    // entry n plus one in high (selector n ^ 8). Seven instructions a word for one more mma,
    // where picking by the top bit took eleven (H100: IQ4_XS's rows up to 19% faster,
    // forty-sixth look).
    struct Entries {
        uint2 low, high;
    };
    __device__ static __forceinline__ Entries lookup(u32 q) {
        const u32 f = q ^ 0x88888888u;
        return {make_uint2(prmt(IQ4_S0, IQ4_S1, q), prmt(IQ4_S0, IQ4_S1, q >> 16)),
                make_uint2(prmt(IQ4_S2_PLUS1, IQ4_S3_PLUS1, f),
                           prmt(IQ4_S2_PLUS1, IQ4_S3_PLUS1, f >> 16))};
    }
    // A row's scales of the lane's sub-blocks 2p + odd (p = 0-3) from its header h, four times
    // scale - 32 as signed byte p, all four at once: shifted by 2 odd, scales_h has field p at
    // bit 4p, so its bytes [2, 2, 3, 3] hold field p at bits 0-1 (p even) or 4-5 (p odd) of
    // byte p; the even ones shifted by 4 join them at bits 4-5, under scales_l's nibbles;
    // scale - 32 is the 6-bit field with its top bit flipped, moved to the byte's top (its
    // bits 0-1 zeros). Eight instructions a row, and one `prmt` a scale (scale_of), where
    // each scale on its own took about six.
    __device__ static __forceinline__ u32 scales(uint2 h, int odd) {
        const u32 f = prmt(h.x >> (2 * odd), 0u, 0x3322u);
        const u32 s = bit_select(h.y >> (4 * odd), bit_select(f << 4, f, 0x00FF00FFu), 0x0F0F0F0Fu);
        return and_xor(s, 0x3F3F3F3Fu, 0x20202020u) << 2;
    }
    // Byte p of w as a signed int: the byte, then its sign in the three above.
    __device__ static __forceinline__ int scale_of(u32 w, int p) {
        return (int)prmt(w, 0u, 0x8880u + 0x1111u * p);
    }

    __device__ __forceinline__ void dot(const B& b, int kb, const float* sums, float s, int t,
                                        float2 pf, float& acc_lo, float& acc_hi) const {
        const int odd = t >> 1;  // this lane's columns: sub-blocks 2p + odd
        const u32 sc_lo = scales(h_lo, odd), sc_hi = scales(h_hi, odd);
        const u8* bk = b.of(kb);
        int ci[4] = {0, 0, 0, 0};
#pragma unroll
        for (int p = 0; p < 4; p++) {
            const uint2 x1 = *(const uint2*)(bk + 64 * p), x2 = *(const uint2*)(bk + 64 * p + 8);
            int cc[4];
            Entries lo = lookup(q_lo[p].x), hi = lookup(q_hi[p].x);
            mma_s8_16832(cc, lo.low.x, hi.low.x, lo.low.y, hi.low.y, x1.x, x1.y);
            mma_s8_16832_acc(cc, lo.high.x, hi.high.x, lo.high.y, hi.high.y, x1.x, x1.y);
            lo = lookup(q_lo[p].y), hi = lookup(q_hi[p].y);
            mma_s8_16832_acc(cc, lo.low.x, hi.low.x, lo.low.y, hi.low.y, x2.x, x2.y);
            mma_s8_16832_acc(cc, lo.high.x, hi.high.x, lo.high.y, hi.high.y, x2.x, x2.y);
            int sl = scale_of(sc_lo, p), sh = scale_of(sc_hi, p);
            ci[0] += sl * cc[0];
            ci[1] += sl * cc[1];
            ci[2] += sh * cc[2];
            ci[3] += sh * cc[3];
        }
        s *= 0.25f;  // the scales were four times theirs
        float dlo = f16_to_f32((u16)h_lo.x) * s, dhi = f16_to_f32((u16)h_hi.x) * s;
        acc_lo += dlo * (pf.x * (float)ci[0] + pf.y * (float)ci[1]);
        acc_hi += dhi * (pf.x * (float)ci[2] + pf.y * (float)ci[3]);
    }
};

// Q8_0 on the same tiles (TcQ80, the bulk-copy kernels only). A 256-block here is 8 Q8_0
// blocks of 34 bytes (f16 d, then 32 signed qs bytes), 272 bytes, so rows of whole 256-blocks
// are a multiple of 16 bytes. Block j's qs bytes are already the mma's signed bytes: block j
// takes sub-block j's place in TcBPair's products (blocks 2p and 2p + 1 into one C), and each
// lane's two columns of C are its block's (2p + (t >> 1)), whose d of each row weighs them as
// floats. Lane t loads qs bytes 8t .. 8t + 7 of each block (34 j + 2 + 8t from the 16-byte
// aligned 256-block): their place modulo 8 is known when compiled (lds8_at), so an 8-byte
// piece takes one shared load where it is 8-byte aligned, two where it is 4-byte aligned, and
// two and two shifts where it is 2 bytes off.
template <int MIS8>
__device__ __forceinline__ uint2 lds8_at(const u8* p) {
    static_assert(MIS8 % 2 == 0, "qs pieces start 2-byte aligned");
    if constexpr (MIS8 == 0) {
        return *(const uint2*)p;
    } else if constexpr (MIS8 == 4) {
        return make_uint2(*(const u32*)p, *(const u32*)(p + 4));
    } else if constexpr (MIS8 == 2) {
        const uint2 a = *(const uint2*)(p - 2);
        const u32 c = *(const u32*)(p + 6);
        return make_uint2(__funnelshift_r(a.x, a.y, 16), __funnelshift_r(a.y, c, 16));
    } else {
        const u32 a = *(const u32*)(p - 2);
        const uint2 c = *(const uint2*)(p + 2);
        return make_uint2(__funnelshift_r(a, c.x, 16), __funnelshift_r(c.x, c.y, 16));
    }
}
struct TcQ80 {
    static const int BYTES = 272;
    static const int ROW = 2208;  // a bulk-copy stage's row: 8 x 272 + 32, 32 x an odd number
    static const int STAGES = 2;  // 3 would leave x no room in SM120's 99 KiB
    static const bool ANY_ROW_START = false;
    static const bool HALVES = false;
    uint2 q_lo[8], q_hi[8];  // qs bytes 8t .. 8t + 7 of blocks 0-7
    float d_lo[4], d_hi[4];  // d of blocks 2p + (t >> 1)

    template <int J>
    __device__ __forceinline__ void load_block(const u8* blo, const u8* bhi, int t) {
        q_lo[J] = lds8_at<(34 * J + 2) % 8>(blo + 34 * J + 2 + 8 * t);
        q_hi[J] = lds8_at<(34 * J + 2) % 8>(bhi + 34 * J + 2 + 8 * t);
        if constexpr (J < 4) {
            const int at = 68 * J + 34 * (t >> 1);
            d_lo[J] = f16_to_f32(*(const u16*)(blo + at));
            d_hi[J] = f16_to_f32(*(const u16*)(bhi + at));
        }
    }
    __device__ __forceinline__ void load_stage(const u8* blo, const u8* bhi, int t) {
        load_block<0>(blo, bhi, t);
        load_block<1>(blo, bhi, t);
        load_block<2>(blo, bhi, t);
        load_block<3>(blo, bhi, t);
        load_block<4>(blo, bhi, t);
        load_block<5>(blo, bhi, t);
        load_block<6>(blo, bhi, t);
        load_block<7>(blo, bhi, t);
    }
    typedef TcBPair B;
    __device__ static __forceinline__ B b_cols(const u8* planes, int k, int g, int t) {
        return TcBPair::of_lane(planes, k, g, t);
    }
    __device__ __forceinline__ void dot(const B& b, int kb, const float* sums, float s, int t,
                                        float2 pf, float& acc_lo, float& acc_hi) const {
        const u8 *b1 = b.first.of(kb), *b2 = b.second.of(kb);
        float f_lo = 0.0f, f_hi = 0.0f;
#pragma unroll
        for (int p = 0; p < 4; p++) {
            const uint2 x1 = *(const uint2*)(b1 + 64 * p), x2 = *(const uint2*)(b2 + 64 * p);
            const uint2 e_lo = q_lo[2 * p], e_hi = q_hi[2 * p];
            const uint2 o_lo = q_lo[2 * p + 1], o_hi = q_hi[2 * p + 1];
            int cc[4];
            mma_s8_16832(cc, e_lo.x, e_hi.x, e_lo.y, e_hi.y, x1.x, x1.y);
            mma_s8_16832_acc(cc, o_lo.x, o_hi.x, o_lo.y, o_hi.y, x2.x, x2.y);
            // |sums| <= 32 x 128 x 127 < 2^24: exact as floats.
            f_lo += d_lo[p] * (pf.x * (float)cc[0] + pf.y * (float)cc[1]);
            f_hi += d_hi[p] * (pf.x * (float)cc[2] + pf.y * (float)cc[3]);
        }
        acc_lo += s * f_lo;
        acc_hi += s * f_hi;
    }
};

// Rows g and g + 8 of a tile: the sums spread over the lanes of a quad (the plane columns and
// the minimums' shares of matvec_tc_q4_k's layout), summed on every lane of it.
__device__ __forceinline__ void quad_sums(float& lo, float& hi) {
    lo += __shfl_xor_sync(0xffffffffu, lo, 1);
    lo += __shfl_xor_sync(0xffffffffu, lo, 2);
    hi += __shfl_xor_sync(0xffffffffu, hi, 1);
    hi += __shfl_xor_sync(0xffffffffu, hi, 2);
}

// One item of the tensor-core product: its matrix, its x (index into x's rows) and whether
// this rank holds it. Items items / 2 .. of a pair (w2 non-null) take their matrices from w2
// (the shared one from sw2), with ids and x counted from items / 2 again (the MoE gate and up
// products of the same choices in one launch); an id MOE_SHARED reads the matrix at sw (the
// shared expert as one more choice), a negative one is held by another rank.
struct TcItem {
    const u8* mat;
    int xi;
    bool held;
};
__device__ __forceinline__ TcItem tc_item(int b, int items, const u8* w, const u8* w2,
                                          const u8* sw, const u8* sw2, i64 mat_stride,
                                          const int* ids, int x_group) {
    int bi = b;
    if (w2 && b >= items / 2) {
        w = w2;
        sw = sw2;
        bi = b - items / 2;
    }
    i64 id = ids ? __ldcg(ids + bi) : bi;  // through L2: see matvec_tma_items_body
    TcItem it;
    it.mat = id == MOE_SHARED ? sw : w + id * mat_stride;
    it.xi = bi / x_group;
    it.held = id >= 0 || id == MOE_SHARED;
    return it;
}

// n / d and n % d for a divisor the kernel fixes (a matrix's tiles) by one wide multiply, where
// the compiler's signed division takes ~35 instructions (twice a group in matvec_tma_body's
// consumers and again in its producer, once a tile in the items kernel's). m = ceil(2^32 / d):
// the high word of n m is n / d while n d < 2^32 (its excess n (m - 2^32 / d) / 2^32 then
// stays below 1 / d); ops.rs keeps groups x tiles under 2^32 (tma_div_fits).
struct DivBy {
    u32 d;
    u64 m;
    __device__ explicit DivBy(int divisor)
        : d((u32)divisor), m(((1ull << 32) + (u32)divisor - 1) / (u32)divisor) {}
    __device__ __forceinline__ int quot(int n) const { return (int)(((u64)(u32)n * m) >> 32); }
    __device__ __forceinline__ int rem(int n) const { return n - quot(n) * (int)d; }
};

// The MoE combine in the down product's launch: out [T, rows] row t = sum over the choices j
// of token t of weights[t, j] * (item t * choices + j's output), in choice order and skipping
// zero weights, as moe_combine sums them. The block that finishes the last of a token's items
// for a group's rows sums those rows (its counter in `done` [T, groups per item], put back to
// zero by that block; every item held). Null `out`: no combine.
struct TcCombine {
    const float* weights;
    float* out;
    int* done;
    int choices;
};

// Same addressing as matvec_q4_k for `items` items (outputs at y + b y_stride); rows 16-byte
// aligned, k a multiple of 256; `per_block` tiles per group (a power of two up to TC_WARPS).
// glu (with w2): a gated FFN's gate and up products, item b and b + items / 2 of one choice,
// as one output silu(gate) * up at y + b y_stride (b < items / 2): a group then takes
// per_block / 2 tiles of rows in both matrices, its warps of the first half on the gate's and
// of the second on the up's, and the gate's warps write the rows (no silu_mul launch, and the
// silu once per value).
template <int TC_WARPS>
__device__ __forceinline__ void matvec_tc_q4_k_body(const u8* w, const u8* w2, const u8* sw,
                                                    const u8* sw2, i64 mat_stride,
                                                    const int* ids, int items, int rows, int k,
                                                    i64 row_bytes, const float* x, int x_group,
                                                    i64 x_stride, float* y, i64 y_stride,
                                                    int per_block, int glu, TcCombine comb) {
    extern __shared__ __align__(16) u8 tc_sm[];
    __shared__ float partial[TC_WARPS][16];
    __shared__ bool last;  // this block finished the group's rows of the token's last item
    int stride = tc_plane_stride(k), nb = k / 256;
    const float* scales = (const float*)(tc_sm + 4 * stride);
    const float* sums = scales + tc_scales_len(k);
    const int mats = glu ? 2 : 1, span = per_block / mats;  // a group's matrices, row tiles
    int tiles = (rows + 15) / 16, per_item = (tiles + span - 1) / span;
    int groups = items / mats * per_item;
    int ks = TC_WARPS / per_block;  // warps per tile
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int part = warp % ks, steps = (nb - part + ks - 1) / ks;  // the warp's 256-blocks per tile
    int slot = warp / ks, half = slot / span;  // the warp's tile in its group; glu: 1 = up
    auto item_of = [&](int grp) {
        return tc_item(grp / per_item + half * (items / 2), items, w, w2, sw, sw2, mat_stride,
                       ids, x_group);
    };
    // The block's groups, where the grid is one wave of blocks: with one x for every item,
    // every gridDim.x-th (the blocks read neighbouring rows at a time: H200, DS3's gate-up
    // pair 56 us, 60 as runs); else a run of consecutive groups, which mostly share their item
    // and so their x (DS3's down products 35 -> 33-34 us). One group where the grid has a block
    // per group.
    const bool one_x = x_group >= (w2 ? items / 2 : items);
    const int g_step = one_x ? gridDim.x : 1;
    const int g_end = one_x ? groups : (int)((i64)(blockIdx.x + 1) * groups / gridDim.x);
    // The block's next group from grp on whose item this rank holds (the same for all warps).
    auto next_group = [&](int grp) {
        while (grp < g_end && !item_of(grp).held) grp += g_step;
        return grp;
    };
    auto tile_of = [&](int grp) { return (grp % per_item) * span + slot % span; };
    // The loads run two steps (256-blocks) ahead of the products, across group boundaries:
    // (lgrp, ls) is the next step to load.
    int lgrp, ls = 0;
    const u8 *lrow_lo, *lrow_hi;
    auto seek = [&](int grp) {
        lgrp = grp;
        const u8* m = grp < g_end ? item_of(grp).mat : w;
        int r = min(tile_of(grp) * 16 + g, rows - 1);
        lrow_lo = m + (i64)r * row_bytes;
        lrow_hi = m + (i64)min(r + 8, rows - 1) * row_bytes;
    };
    auto load_next = [&](TcQ4k& q) {
        if (lgrp >= g_end || steps == 0) return;
        i64 off = (i64)(part + ls * ks) * TcQ4k::BYTES;
        q.load(lrow_lo + off, lrow_hi + off, t);
        if (++ls == steps) {
            ls = 0;
            seek(next_group(lgrp + g_step));
        }
    };
    if (ids) pdl_wait();  // the MoE choices come from the router kernel
    int grp = next_group(one_x ? blockIdx.x : (int)((i64)blockIdx.x * groups / gridDim.x));
    seek(grp);
    TcQ4k cur, nxt;
    load_next(cur);
    load_next(nxt);
    pdl_enter();  // the weight loads above may overlap the previous kernel, x may not

    const TcQ4k::B b = TcQ4k::b_cols(tc_sm, k, g, t);
    const float2 pf = TcQ4k::plane_factors(t);
    int prepared = -1;  // the x in shared memory
    for (; grp < g_end; grp = next_group(grp + g_step)) {
        int xi = item_of(grp).xi, tile = tile_of(grp);
        if (xi != prepared) {
            tc_prepare_x(x + (i64)xi * x_stride, k, tc_sm, TC_WARPS);
            __syncthreads();
            prepared = xi;
        }
        float acc_lo = 0.0f, acc_hi = 0.0f;
        for (int s = 0; s < steps; s++) {
            TcQ4k nn;
            load_next(nn);
            int kb = part + s * ks;
            if (tile * 16 < rows)
                cur.dot(b, kb, sums + 8 * kb, scales[kb], t, pf, acc_lo, acc_hi);
            cur = nxt;
            nxt = nn;
        }
        // Row g's sum is spread over its quad (plane columns, minimum shares), then over the
        // warps of the tile.
        quad_sums(acc_lo, acc_hi);
        if (t == 0) {
            partial[warp][g] = acc_lo;
            partial[warp][g + 8] = acc_hi;
        }
        __syncthreads();
        if (part == 0 && half == 0 && lane < 16 && tile * 16 + lane < rows) {
            float sum = 0.0f;
            for (int i = 0; i < ks; i++) sum += partial[warp + i][lane];
            if (glu) {
                float up = 0.0f;
                for (int i = 0; i < ks; i++) up += partial[warp + span * ks + i][lane];
                sum = silu(sum) * up;
            }
            y[(grp / per_item) * y_stride + tile * 16 + lane] = sum;
        }
        __syncthreads();  // partial and the x planes are free again
        if (comb.out) {
            const int tok = grp / per_item / comb.choices, gi = grp % per_item;
            int* done = comb.done + (i64)tok * per_item + gi;
            if (threadIdx.x == 0) {
                // count_in's steps, written out: through the helper ptxas spilled registers
                // in this kernel's main loop (sm_90, 128 registers).
                fence_acq_rel();
                last = atomicAdd(done, 1) == comb.choices - 1;
                if (last) {
                    *done = 0;  // for the next launch (stream order)
                    fence_acq_rel();
                }
            }
            __syncthreads();
            if (last) {
                const float* wt = comb.weights + (i64)tok * comb.choices;
                const float* yt = y + (i64)tok * comb.choices * y_stride;
                for (int r = gi * span * 16 + threadIdx.x; r < min((gi + 1) * span * 16, rows);
                     r += blockDim.x) {
                    // Eight choices' loads at a time, then their sum in order (one L2 round
                    // trip for a token of up to 8 choices instead of one per choice).
                    float sum = 0.0f;
                    for (int j0 = 0; j0 < comb.choices; j0 += 8) {
                        float wv[8], yv[8];
#pragma unroll
                        for (int i = 0; i < 8; i++) {
                            bool in = j0 + i < comb.choices;
                            wv[i] = in ? wt[j0 + i] : 0.0f;
                            yv[i] = in ? __ldcg(yt + (j0 + i) * y_stride + r) : 0.0f;
                        }
#pragma unroll
                        for (int i = 0; i < 8; i++)
                            if (wv[i] != 0.0f) sum += wv[i] * yv[i];
                    }
                    comb.out[(i64)tok * rows + r] = sum;
                }
            }
        }
    }
}


#define DEFINE_MATVEC_TC(kname, warps, min_blocks)                                             \
    extern "C" __global__ void __launch_bounds__(32 * warps, min_blocks) kname(                \
        const u8* w, const u8* w2, const u8* sw, const u8* sw2, i64 mat_stride,                \
        const int* ids, int items, int rows, int k, i64 row_bytes, const float* x,             \
        int x_group, i64 x_stride, float* y, i64 y_stride, int per_block, int glu,             \
        TcCombine comb) {                                                                      \
        matvec_tc_q4_k_body<warps>(w, w2, sw, sw2, mat_stride, ids, items, rows, k, row_bytes, \
                                   x, x_group, x_stride, y, y_stride, per_block, glu, comb);   \
    }
// At most 128 registers, whatever the compiler: two 8-warp blocks (or four of 4 warps) an SM.
// Without the bound the device's NVRTC once took the 8-warp kernel past 128 (H200: one block
// an SM, DS3 decode 955 -> 832-861 tokens/s), and nvcc takes the 4-warp one to 166 with the
// combine's batched loads.
DEFINE_MATVEC_TC(matvec_tc_q4_k, 4, 4)
DEFINE_MATVEC_TC(matvec_tc8_q4_k, 8, 2)

// N words from 2-byte aligned shared memory at p, where p & 3 is mis, each shifted right by
// `extra` more bits (< 8) with the bits of the word above. The pieces of a Q6_K block lie a
// multiple of 4 bytes apart: given the block's mis, ptxas finds one base for them all.
template <int N>
__device__ __forceinline__ void lds_words_mis(const u8* p, u32 mis, u32* out, u32 extra = 0) {
    // By pointer arithmetic on p, not an integer mask: the compiler then still knows the
    // address is shared memory (LDS; a cast from an integer made generic loads).
    const u32* base = (const u32*)(p - mis);
    u32 sh = 8 * mis + extra;
    u32 a[N + 1];
#pragma unroll
    for (int i = 0; i <= N; i++) a[i] = base[i];
#pragma unroll
    for (int i = 0; i < N; i++) out[i] = __funnelshift_r(a[i], a[i + 1], sh);
}

// A lane's bytes of one Q6_K block of one row (lane t of its 4): ql bytes 8t .. 8t + 7 of
// each 32 (ql[h][j & 1]), qh bytes 8t .. of each half with the top bit of each 2-bit field
// flipped, split into its even fields (qe[h]: quarters 0 and 2) and odd ones (qo[h]: 1 and
// 3), and from the scales at s = t >> 1 on (sc: byte 2i is sub-block 2i + s's), d.
struct TcQ6k {
    u32 ql[2][2][2], qe[2][2], qo[2][2];
    u32 sc[4], d;

    // b is 2-byte aligned; MIS: b & 3 where known when compiled (0 or 2), else -1. Known, the
    // shifts are constants, and none where b is 4-byte aligned.
    template <int MIS = -1>
    __device__ __forceinline__ void load(const u8* b, int t) {
        const u32 mis = MIS >= 0 ? (u32)MIS : (u32)((unsigned long long)b & 3);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            lds_words_mis<2>(b + 64 * h + 8 * t, mis, ql[h][0]);
            lds_words_mis<2>(b + 64 * h + 32 + 8 * t, mis, ql[h][1]);
            u32 q[2];
            lds_words_mis<2>(b + 128 + 32 * h + 8 * t, mis, q);
#pragma unroll
            for (int i = 0; i < 2; i++) {
                qe[h][i] = and_xor(q[i], 0x33333333u, 0x22222222u);
                qo[h][i] = and_xor(q[i], 0xCCCCCCCCu, 0x88888888u);
            }
        }
        // Up to 2 bytes past the block (in the stage).
        lds_words_mis<4>(b + 192 + (t >> 1), mis + (t >> 1), sc);
        d = *(const u16*)(b + 208);
    }

    // Lane (g, t)'s B bytes of x's block blk: plane g % 4 from byte 8t where its k values
    // (t < 2: a quarter's first sub-block, t >= 2 its second) are its columns' sub-block (g < 4:
    // the first), else the zeros after x's planes of k elements.
    __device__ static __forceinline__ const u8* b_block(const u8* planes, int k, int g, int t,
                                                        int blk) {
        return (g >> 2) == (t >> 1) ? planes + (g & 3) * tc_plane_stride(k) + 256 * blk + 8 * t
                                    : planes + tc_zeros_at(k) + 8 * t;
    }

    // Quarter j of half h, word i (values 8t + 4i ..) as 4 signed bytes 4 (q - 32): q's low
    // 4 bits at bits 2-5, its high 2 bits at bits 6-7 with the top one flipped (q - 32 in
    // 6-bit two's complement, times 4 as a byte). One select a word: the nibble shifted to
    // bits 2-5 gives those, the field shifted to bits 6-7 the rest, whose bits 0-1 are zero
    // since the split cleared the field that would land there.
    __device__ __forceinline__ u32 quarter(int h, int j, int i) const {
        u32 l = ql[h][j & 1][i];
        u32 e = qe[h][i], o = qo[h][i];
        u32 hi = j == 0 ? e << 6 : j == 1 ? o << 4 : j == 2 ? e << 2 : o;
        return bit_select(j < 2 ? l << 2 : l >> 2, hi, 0x3C3C3C3Cu);
    }
    // The scale of the lane's sub-block in quarter j of half h.
    __device__ __forceinline__ int scale(int h, int j) const {
        return (int)(signed char)(sc[2 * h + (j >> 1)] >> (16 * (j & 1)));
    }
};

// acc_lo / acc_hi += rows g and g + 8's block (lo, hi) . x's block: bk the lane's B bytes of it
// (TcQ6k::b_block), s x's block scale, pf the weights of its output planes
// (TcQ4k::plane_factors: the same columns).
__device__ __forceinline__ void q6_dot(const TcQ6k& lo, const TcQ6k& hi, const u8* bk, float s,
                                       float2 pf, float& acc_lo, float& acc_hi) {
    int ci[4] = {0, 0, 0, 0};
#pragma unroll
    for (int h = 0; h < 2; h++) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            uint2 bb = *(const uint2*)(bk + 128 * h + 32 * j);
            int cc[4];
            mma_s8_16832(cc, lo.quarter(h, j, 0), hi.quarter(h, j, 0), lo.quarter(h, j, 1),
                         hi.quarter(h, j, 1), bb.x, bb.y);
            int sl = lo.scale(h, j), sh = hi.scale(h, j);
            ci[0] += sl * cc[0];
            ci[1] += sl * cc[1];
            ci[2] += sh * cc[2];
            ci[3] += sh * cc[3];
        }
    }
    // Four times the sums of q - 32 (|.| < 2^29): a quarter of s takes them back.
    s *= 0.25f;
    acc_lo += f16_to_f32((u16)lo.d) * s * (pf.x * (float)ci[0] + pf.y * (float)ci[1]);
    acc_hi += f16_to_f32((u16)hi.d) * s * (pf.x * (float)ci[2] + pf.y * (float)ci[3]);
}

// Q6_K on the same tiles (TcQ6kTile, the bulk-copy kernels only): TcQ6k for rows g and g + 8
// and q6_dot (matvec_tma_q6_k's, below), whose B is zeros where a lane's columns are not its k
// values' sub-block (TcQ6k::b_block). A row of 210-byte blocks starts anywhere (even) modulo
// 16 (DeepSeek-V3's 7168 values: 5880 bytes, every other row 8 off), so
// a stage row is copied from the 16-byte boundary below it (ANY_ROW_START, bulk_copy_from_any)
// and TcQ6k::load reads it 2-byte aligned: its stage row keeps up to 14 bytes before the
// segment, 8 blocks rounded up to 16, and the bytes TcQ6k::load reads past the last block.
// Two stages beside x's planes (k parts up to 10240) fit SM120's 99 KiB.
struct TcQ6kTile {
    static const int BYTES = 210;
    static const int ROW = 1712;  // 14 + 8 x 210 rounded up, slack; an odd multiple of 16
    static const int STAGES = 2;
    static const bool ANY_ROW_START = true;
    static const bool HALVES = false;
    TcQ6k lo, hi;

    // Rows of an even number of blocks (every real k) have every other block 4-byte aligned,
    // and there a lane's loads take 40% fewer instructions (sm_90: matvec_tma_groups_q6_k's two
    // rows 131 -> 81, the test included), so such blocks take a code path of their own.
    __device__ __forceinline__ void load_stage(const u8* blo, const u8* bhi, int t) {
        if ((((unsigned long long)blo | (unsigned long long)bhi) & 3) == 0)
            load_stage_at<0>(blo, bhi, t);
        else
            load_stage_at<-1>(blo, bhi, t);
    }
    // Both rows' blocks MIS bytes past a 4-byte boundary (TcQ6k::load).
    template <int MIS>
    __device__ __forceinline__ void load_stage_at(const u8* blo, const u8* bhi, int t) {
        lo.load<MIS>(blo, t);
        hi.load<MIS>(bhi, t);
    }
    // Lane (g, t)'s B: TcQ6k::b_block's.
    typedef TcBCol B;
    __device__ static __forceinline__ B b_cols(const u8* planes, int k, int g, int t) {
        return TcBCol{TcQ6k::b_block(planes, k, g, t, 0), (g >> 2) == (t >> 1) ? 256 : 0};
    }
    __device__ __forceinline__ void dot(const B& b, int kb, const float* sums, float s, int t,
                                        float2 pf, float& acc_lo, float& acc_hi) const {
        q6_dot(lo, hi, b.of(kb), s, pf, acc_lo, acc_hi);
    }
};

// ---- Q4_K on the tensor cores, the weights by bulk copies (sm_90 and later) ----
//
// matvec_tc_q4_k's lanes load their weights themselves, 32 bytes of each of 8 rows per
// instruction, and reach ~70% of the copy bandwidth on the addresses alone (eighth look).
// Here one producer warp has the copy engine (cp.async.bulk, completion counted on an
// mbarrier) move each tile's rows into shared memory as 1152-byte segments (8 256-blocks of
// one row), 3 stages ahead, and 8 consumer warps take a 256-block each of every stage
// into the registers TcQ4k::dot multiplies with x's planes (lab, H200, 36864 x 6144 as one
// matrix: 60.7 -> 39.3 us, 76% of copy; segments of 4 blocks 47.6 us, of 1 block 194 us).
//
// Products whose items all read one x (a single matrix, a token's MoE gate and up), with the
// arguments and items of matvec_tc_q4_k but per_block, x_group and x_stride, and no combine:
// a group is one tile of 16 rows of one item (glu: of the gate's item, then of the up's), and
// block b takes groups b, b + gridDim.x, ... of one wave of blocks. (The expert downs, an x
// per item and their combine, were slower here in the model both times they were tried:
// docs/performance.md, nineteenth and twentieth looks; they take matvec_tma_items_q4_k.)
//
// Rows longer than shared memory holds x's planes for beside the stages (attn_output and the
// dense down, k 12288-18432) are taken in parts of kpart elements (the last may be shorter):
// the block walks all its groups through part 0, prepares x's planes of part 1, walks them
// again, and so on, each lane that writes a row adding that part's sum to what it stored
// before (so the rows need no combine between blocks, and the copies run on into the next part
// while x is prepared). glu needs one part. With y_part (not 0: one matrix, no ids), where a
// wave of blocks would otherwise leave many of them idle in its last round (GLM-5's
// attn_output: 384 tiles over 264 blocks, of which 120 take two), the units (part, tile) go
// to the blocks instead, a run of blocks a part taking its tiles in turn, and each unit stores
// its sum as partial p of its rows, at y + p * y_part: add_rmsnorm_cluster sums them in part
// order, so the rows come out the same bits as above where the parts are the same
// (matvec_tma_spread_<type>; ops.rs's spread_part_k may take more, shorter parts: DS3's
// attn_output in 4). matvec_tma_parts_<type> (below) walks the tiles of two or three
// matrices of one x instead, a group each. Dynamic shared memory tma_smem_bytes(kpart)
// (ops.rs): x's planes as tc_smem_bytes(kpart), then the stages.
//
// With ids (a token's MoE choices, written by the router in the launch before) x was written
// before the router, so it is complete when this kernel starts (the router waited for it
// before it let this kernel launch): the consumers prepare its planes while the router still
// runs, and the shared expert's groups (its choice is the token's last, whose matrices need no
// id) come first and need no wait either; each thread waits for the router before its first
// routed group. (H200, one call: decode DS3 1,143-1,144 -> 1,163-1,167 tokens/s, GLM-5
// 1,228-1,230 -> 1,251; docs/performance.md, twenty-second look.)
//
// Q5_K, IQ4_XS (rows of an even number of blocks), Q6_K (any rows: TcQ6kTile's
// ANY_ROW_START) and Q8_0 take the same kernels with their tiles (TcQ5k, TcIq4xs, TcQ6kTile,
// TcQ80): matvec_tma_q5_k, matvec_tma_iq4_xs, matvec_tma_groups_q6_k, matvec_tma_q8_0, and the
// items forms below (Q6_K's for rows of a multiple of 16 bytes). A stage row is a tile type's
// ROW bytes, 8 blocks padded to an odd multiple of 16 (1712 for Q6_K), so that the 8 rows of a
// warp's lanes start on distinct 16-byte bank groups, or of 32 where a lane loads 8 bytes of a
// row (1184 for Q4_K, 1440 for Q5_K, 1120 for IQ4_XS, 2208 for Q8_0: the 4 rows of a half-warp
// on distinct 32-byte ones; Q5_K's kernels then take all of SM120's 99 KiB at its k_max);
// Tile::STAGES of them (3, Q6_K's and Q8_0's 2) follow x's planes (tc_x_bytes).
#define TMA_BLOCKS 8     // 256-blocks per stage, one per consumer warp

// The bytes a segment of len bytes from address src (its low 32 bits enough) takes as
// bulk_copy_from_any copies it: from the 16-byte boundary below src, rounded up to 16.
__device__ __forceinline__ u32 segment_bytes(u32 src, u32 len) {
    return ((src & 15) + len + 15) & ~15u;
}

// A warp's copies of one stage of rows that start anywhere (even) modulo 16 (Q6_K's): lane's
// len bytes at src (copies: false for none) into its stage row dst (16-byte aligned), copied
// from the 16-byte boundary below src and rounded up to 16 bytes, counted on bar (lane 0
// expects the warp's bytes in all). A copy that would read past `end` (the matrix's end, even,
// the same for the warp; at most one lane's copy reaches it) stops at end's 16-byte boundary,
// and the lanes store the bytes after it, 2 each, so that nothing past the matrix is read.
__device__ __forceinline__ void bulk_copy_from_any(u8* dst, const u8* src, u32 len, bool copies,
                                                   const u8* end, u64* bar) {
    const int lane = threadIdx.x & 31;
    const u8* from = (const u8*)((unsigned long long)src & ~15ull);
    const u8* end16 = (const u8*)((unsigned long long)end & ~15ull);
    u32 bytes = copies ? segment_bytes((u32)(unsigned long long)src, len) : 0u;
    const bool at_end = copies && from + bytes > end;
    if (at_end) bytes = (u32)(end16 - from);
    const u32 ends = __ballot_sync(0xffffffffu, at_end);
    if (ends) {
        u8* to = (u8*)__shfl_sync(0xffffffffu, (unsigned long long)(dst + bytes), __ffs(ends) - 1);
        if (2 * lane < (int)(end - end16)) {
            *(u16*)(to + 2 * lane) = ld_nc16(end16 + 2 * lane);
            fence_proxy_async();  // before a later copy into the slot overwrites them
        }
    }
    const u32 total = __reduce_add_sync(0xffffffffu, bytes);
    __syncwarp();  // the tail's stores before the arrival that publishes the stage
    if (lane == 0) mbar_expect_bytes(bar, total);
    __syncwarp();
    if (copies && bytes > 0) bulk_copy(dst, from, bytes, bar);
}

// The WARPS consumer warps only (the producer warp has left).
template <int WARPS = 8>
__device__ __forceinline__ void consumers_sync() {
    asm volatile("bar.sync 1, %0;" ::"n"(32 * WARPS) : "memory");
}

template <class Tile, bool SPREAD, bool PARTS = false, bool QUERY = false>
__device__ __forceinline__ void matvec_tma_body(const u8* w, const u8* w2, const u8* sw,
                                                const u8* sw2, i64 mat_stride, const int* ids,
                                                int items, int rows, int k, int kpart,
                                                i64 row_bytes, const float* x, float* y,
                                                i64 y_stride, int glu, i64 y_part,
                                                const MatvecParts& pt = MatvecParts(),
                                                const QueryRows& qr = QueryRows()) {
#if __CUDA_ARCH__ >= 900
    constexpr int ROW = Tile::ROW, STAGE = 16 * ROW, BYTES = Tile::BYTES, STAGES = Tile::STAGES;
    static_assert(TMA_BLOCKS * BYTES % 16 == 0,
                  "a row's segments all lie as its first does modulo 16 (ANY_ROW_START)");
    extern __shared__ __align__(128) u8 tma_sm[];
    __shared__ u64 full[STAGES], empty[STAGES];
    __shared__ float partial[2][2][TMA_BLOCKS][16];  // [group parity][gate, up][warp][row]
    u8* stages = tma_sm + tc_x_bytes(kpart);
    const int mats = glu ? 2 : 1, tiles = (rows + 15) / 16;
    const DivBy by_tiles(tiles);
    // PARTS: the tiles of w (rows rows), then pt.w1's and pt.w2's, a group each.
    const int part_tiles[3] = {tiles, (pt.rows1 + 15) / 16, (pt.rows2 + 15) / 16};
    const int groups = PARTS ? tiles + part_tiles[1] + part_tiles[2] : items / mats * tiles;
    if (PARTS && pt.done) {
        for (int item = 0; item < 3; item++) parts_tail_prefetch(pt.latent, item);
    }
    // With a shared expert, groups 0 .. tiles - 1 are its choice (the token's last), then
    // choices 0, 1, ...: rot turns group order into choice order.
    const int choices = items / mats;
    const int rot = ids && sw && (glu || !w2) ? choices - 1 : 0;
    auto choice_of = [&](int grp) {
        int c = by_tiles.quot(grp) + rot;
        return c >= choices ? c - choices : c;
    };
    auto is_shared = [&](int grp) { return rot && grp < tiles; };
    const int nb = k / 256, part_blocks = kpart / 256;
    const int parts = (nb + part_blocks - 1) / part_blocks;
    // Part p's 256-blocks and stages (it starts at 256-block p * part_blocks).
    auto part_nb = [&](int p) { return min(part_blocks, nb - p * part_blocks); };
    auto part_steps = [&](int p) { return (part_nb(p) + TMA_BLOCKS - 1) / TMA_BLOCKS; };
    // With y_part (the parts spread), part p's groups go to blocks part_lo(p) .. part_hi(p) - 1
    // in turn: the grid split into a run of blocks a part (one block for several parts where
    // the grid has fewer blocks than parts), so that a block prepares x's planes of one part.
    auto part_lo = [&](int p) { return (int)((i64)p * gridDim.x / parts); };
    auto part_hi = [&](int p) {
        return max(part_lo(p) + 1, (int)((i64)(p + 1) * gridDim.x / parts));
    };
    // The block's first group of part p (groups: none) and the step to its next.
    auto first_group = [&](int p) {
        if (!SPREAD) return (int)blockIdx.x;
        const int b = (int)blockIdx.x;
        return b >= part_lo(p) && b < part_hi(p) ? b - part_lo(p) : groups;
    };
    auto group_step = [&](int p) { return SPREAD ? part_hi(p) - part_lo(p) : (int)gridDim.x; };
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // Unit m of group grp: its item (glu: the gate's, then the up's).
    auto item_of = [&](int grp, int m) {
        if (is_shared(grp)) return TcItem{m ? sw2 : sw, 0, true};
        return tc_item(choice_of(grp) + m * (items / 2), items, w, w2, sw, sw2, mat_stride, ids,
                       items);
    };
    // Group grp's tile of its m-th matrix (glu: the gate's, then the up's): the matrix, its
    // rows, the tile's index among them and the rows' output.
    struct GroupTile {
        const u8* mat;
        int rows, tile;
        float* y;
    };
    auto group_tile = [&](int grp, int m) {
        if (!PARTS)
            return GroupTile{item_of(grp, m).mat, rows, by_tiles.rem(grp),
                             y + choice_of(grp) * y_stride};
        if (grp < tiles) return GroupTile{w, rows, grp, y};
        grp -= tiles;
        if (grp < part_tiles[1]) return GroupTile{pt.w1, pt.rows1, grp, pt.y1};
        return GroupTile{pt.w2, pt.rows2, grp - part_tiles[1], pt.y2};
    };
    // Whether this thread has waited for the router (a consumer then lets the next kernel
    // launch, as pdl_enter does): before its first group of a routed choice. The chain clock
    // (common.cuh) stamps from the first block whose first group is routed: block 0's first
    // may be the shared expert's, done before it waits.
    bool routed = !ids;
    const bool stamps =
        threadIdx.x == 0 && (int)blockIdx.x == (rot && tiles < (int)gridDim.x ? tiles : 0);
    auto route = [&](bool consumer) {
        if (routed) return;
        pdl_wait(stamps);
        if (consumer) pdl_launch_next();
        routed = true;
    };
    // The block's next group from grp on whose item this rank holds (no ids with SPREAD).
    auto next_group = [&](int grp, bool consumer) {
        while (grp < groups) {
            if (!is_shared(grp)) route(consumer);
            if (item_of(grp, 0).held) break;
            grp += gridDim.x;
        }
        return grp;
    };
    init_stage_barriers(full, empty, STAGES, TMA_BLOCKS);
    if (warp == TMA_BLOCKS) {
        // Producer: stage n of the block's sequence into slot n % STAGES once the consumers
        // have released what it held before (its (n / STAGES - 1)-th phase).
        int n = 0;
        for (int p = 0; p < parts; p++) {
            const int pnb = part_nb(p), steps = part_steps(p);
            for (int grp = next_group(first_group(p), false); grp < groups;
                 grp = next_group(grp + group_step(p), false)) {
                for (int m = 0; m < mats; m++) {
                    const GroupTile u = group_tile(grp, m);
                    const int r0 = u.tile * 16, nr = min(16, u.rows - r0);
                    const u8* base = u.mat;
                    const u8* mat = base + (i64)r0 * row_bytes + (i64)p * part_blocks * BYTES;
                    for (int st = 0; st < steps; st++, n++) {
                        int slot = n % STAGES, cnt = min(TMA_BLOCKS, pnb - st * TMA_BLOCKS);
                        if (n >= STAGES) mbar_wait(&empty[slot], (n / STAGES - 1) & 1);
                        u8* dst = stages + slot * STAGE + lane * ROW;
                        const u8* src =
                            mat + (i64)lane * row_bytes + (i64)st * TMA_BLOCKS * BYTES;
                        if (Tile::ANY_ROW_START) {
                            bulk_copy_from_any(dst, src, cnt * BYTES, lane < nr,
                                               base + (i64)u.rows * row_bytes, &full[slot]);
                        } else {
                            if (lane == 0)
                                mbar_expect_bytes(&full[slot], (u32)(nr * cnt * BYTES));
                            __syncwarp();
                            if (lane < nr) bulk_copy(dst, src, cnt * BYTES, &full[slot]);
                        }
                    }
                }
            }
        }
        if (PARTS && pt.done) tma_parts_tail(pt, part_tiles, &partial[0][0][0][0]);
        if (QUERY && blockIdx.x == gridDim.x - 1) tma_query_tail(qr.latent);
        return;
    }
    if (!ids) pdl_enter();  // x may come from the previous kernel (with ids: see above)
    const float inv = QUERY ? query_norm_factor(qr) : 1.0f;
    if (QUERY) {  // the normed query latent, a share of it a block (the latent is not x)
        const LatentNorm& a = qr.latent;
        for (int i = 32 * TMA_BLOCKS * blockIdx.x + threadIdx.x; i < a.dq;
             i += 32 * TMA_BLOCKS * gridDim.x)
            a.qy[i] = __ldcg(a.qx + i) * inv;
    }
    // Consumer warp c takes 256-block c of each stage: rows g and g + 8 of the tile, whose
    // segments (Q4_K: 1184 = 32 mod 128 bytes apart) put the 4 rows of a half-warp's 8-byte
    // loads (the qs pieces) on distinct banks, and the 2 of a quarter-warp's 16-byte ones (the
    // headers).
    const int g = lane >> 2, t = lane & 3, c = warp;
    const float2 pf = TcQ4k::plane_factors(t);
    // The producer's n % STAGES and the parity of n / STAGES, as counters: the division by 3
    // a stage cost the consumers 2% of their rate over L2 (H100, forty-fifth look).
    int next_slot = 0, phase = 0, par = 0;
    for (int p = 0; p < parts; p++) {
        if (SPREAD && first_group(p) >= groups) continue;  // no unit of this part
        // The last group's dots of part p - 1 are behind its consumers_sync: its planes are free.
        const int pnb = part_nb(p), steps = part_steps(p), stride = tc_plane_stride(256 * pnb);
        const float* scales = (const float*)(tma_sm + 4 * stride);
        const float* sums = scales + tc_scales_len(256 * pnb);
        const typename Tile::B b = Tile::b_cols(tma_sm, 256 * pnb, g, t);
        tc_prepare_x<Tile::HALVES>(x + 256 * p * part_blocks, 256 * pnb, tma_sm,
                                   TMA_BLOCKS);  // by consumers
        consumers_sync();
        for (int grp = next_group(first_group(p), true); grp < groups;
             grp = next_group(grp + group_step(p), true), par ^= 1) {
            const GroupTile u = group_tile(grp, 0);
            const int tile = u.tile;
            for (int m = 0; m < mats; m++) {
                // Where rows g and g + 8's block c lies in a stage; ANY_ROW_START: after the
                // row's bytes before its 16-byte boundary (the same in every stage).
                int at_lo = g * ROW + BYTES * c, at_hi = at_lo + 8 * ROW;
                if (Tile::ANY_ROW_START) {
                    const u8* r = group_tile(grp, m).mat + (i64)(tile * 16 + g) * row_bytes +
                                  (i64)p * part_blocks * BYTES;
                    at_lo += (int)((unsigned long long)r & 15);
                    at_hi += (int)((unsigned long long)(r + 8 * row_bytes) & 15);
                }
                float acc_lo = 0.0f, acc_hi = 0.0f;
                for (int st = 0; st < steps; st++) {
                    const int slot = next_slot, kb = st * TMA_BLOCKS + c;
                    mbar_wait(&full[slot], phase);
                    if (++next_slot == STAGES) next_slot = 0, phase ^= 1;
                    Tile q;
                    if (kb < pnb) {
                        const u8* blo = stages + slot * STAGE + at_lo;
                        q.load_stage(blo, Tile::ANY_ROW_START ? blo + (at_hi - at_lo) : blo + 8 * ROW,
                                     t);
                    }
                    __syncwarp();
                    if (lane == 0) mbar_arrive(&empty[slot]);  // the slot is in registers
                    if (kb < pnb)
                        q.dot(b, kb, sums + 8 * kb, scales[kb], t, pf, acc_lo, acc_hi);
                }
                quad_sums(acc_lo, acc_hi);
                if (t == 0) {
                    partial[par][m][warp][g] = acc_lo;
                    partial[par][m][warp][g + 8] = acc_hi;
                }
            }
            consumers_sync();
            // The warps' partials in warp order, so that the glu and pair forms give the same
            // bits; a later part adds to the row its lane stored before.
            // qsq: the query's tiles (w's) times its norm's weights, and their sums of squares.
            const bool weighs = PARTS && pt.qsq && grp < tiles;
            if (weighs && warp == 0) {
                const int r = tile * 16 + lane;
                const bool live = lane < 16 && r < rows;
                float sum = 0.0f;
                for (int i = 0; i < TMA_BLOCKS && live; i++) sum += partial[par][0][i][lane];
                const float sq = warp_sum(sum * sum);
                if (live) u.y[r] = sum * pt.latent.qw[r];
                if (lane == 0) pt.qsq[tile] = sq;
            }
            if (!weighs && warp == 0 && lane < 16 && tile * 16 + lane < u.rows) {
                float sum = 0.0f;
                for (int i = 0; i < TMA_BLOCKS; i++) sum += partial[par][0][i][lane];
                if (glu) {
                    float up = 0.0f;
                    for (int i = 0; i < TMA_BLOCKS; i++) up += partial[par][1][i][lane];
                    sum = silu(sum) * up;
                }
                if (QUERY) sum *= inv;
                float* row = u.y + tile * 16 + lane;
                if (SPREAD)
                    row[p * y_part] = sum;
                else
                    *row = p == 0 ? sum : *row + sum;
            }
        }
    }
    if (PARTS && pt.done) tma_parts_tail(pt, part_tiles, &partial[0][0][0][0]);
#else
    __trap();  // ops.rs launches it on sm_90 and later only
#endif
}

// kname: the walk above; spread_name: one matrix's parts spread (y_part), a kernel of its own
// so that the others keep their code (H100: DS3's decode, which spreads nothing, 0.3% slower
// with both walks in one kernel).
#define DEFINE_MATVEC_TMA(kname, spread_name, Tile)                                             \
    extern "C" __global__ void __launch_bounds__(288, 2)                                        \
        kname(const u8* w, const u8* w2, const u8* sw, const u8* sw2, i64 mat_stride,           \
              const int* ids, int items, int rows, int k, int kpart, i64 row_bytes,             \
              const float* x, float* y, i64 y_stride, int glu) {                                \
        matvec_tma_body<Tile, false>(w, w2, sw, sw2, mat_stride, ids, items, rows, k, kpart,    \
                                     row_bytes, x, y, y_stride, glu, 0);                        \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(288, 2)                                        \
        spread_name(const u8* w, int rows, int k, int kpart, i64 row_bytes, const float* x,     \
                    float* y, i64 y_part) {                                                     \
        matvec_tma_body<Tile, true>(w, nullptr, nullptr, nullptr, 0, nullptr, 1, rows, k,       \
                                    kpart, row_bytes, x, y, 0, 0, y_part);                      \
    }
DEFINE_MATVEC_TMA(matvec_tma_q4_k, matvec_tma_spread_q4_k, TcQ4k)
DEFINE_MATVEC_TMA(matvec_tma_q5_k, matvec_tma_spread_q5_k, TcQ5k)
DEFINE_MATVEC_TMA(matvec_tma_iq4_xs, matvec_tma_spread_iq4_xs, TcIq4xs)
DEFINE_MATVEC_TMA(matvec_tma_groups_q6_k, matvec_tma_spread_q6_k, TcQ6kTile)
DEFINE_MATVEC_TMA(matvec_tma_q8_0, matvec_tma_spread_q8_0, TcQ80)

// The projections of one x by two or three matrices of one type (MLA's q_a, kv_a and the
// DSA indexer's key: Gpu::matvec_parts) in one launch, k in one part: the tiles of w, then of
// pt.w1 and pt.w2, a group each, taken by the blocks in turn. With pt.done, the launch also
// norms them as matvec_latent_<type>'s tail does (tma_parts_tail). On the CUDA cores (as
// matvec_latent_q4_k) GLM-5's took 16.7 us a layer on an H100's chain clock, here 10.6-11.0
// with the tail (6.9 without it); decode +2.0% (docs/performance.md, thirty-seventh look).
// With pt.qsq (Gpu::query_projections) it leaves its norms to q_b's launch: 7.1-7.8 us.
#define DEFINE_MATVEC_TMA_PARTS(kname, Tile)                                                    \
    extern "C" __global__ void __launch_bounds__(288, 2)                                        \
        kname(const u8* w, int rows, int k, i64 row_bytes, const float* x, float* y,            \
              MatvecParts pt) {                                                                 \
        matvec_tma_body<Tile, false, true>(w, nullptr, nullptr, nullptr, 0, nullptr, 1, rows,   \
                                           k, k, row_bytes, x, y, 0, 0, 0, pt);                 \
    }
DEFINE_MATVEC_TMA_PARTS(matvec_tma_parts_q4_k, TcQ4k)
DEFINE_MATVEC_TMA_PARTS(matvec_tma_parts_q5_k, TcQ5k)
DEFINE_MATVEC_TMA_PARTS(matvec_tma_parts_iq4_xs, TcIq4xs)
DEFINE_MATVEC_TMA_PARTS(matvec_tma_parts_q6_k, TcQ6kTile)
DEFINE_MATVEC_TMA_PARTS(matvec_tma_parts_q8_0, TcQ80)

// q-LoRA's q_b for one token after a parts launch in its qsq mode (QueryRows): the plain walk
// over x = qr.latent.qx, k in one part, its rows times the query norm's factor, the last
// block's producer warp writing the normed latent and the cache rows the parts launch left
// (tma_query_tail) beside its products, so that q_b's wait no longer waits for a tail.
#define DEFINE_MATVEC_TMA_QUERY(kname, Tile)                                                    \
    extern "C" __global__ void __launch_bounds__(288, 2)                                        \
        kname(const u8* w, int rows, int k, i64 row_bytes, float* y, QueryRows qr) {            \
        matvec_tma_body<Tile, false, false, true>(w, nullptr, nullptr, nullptr, 0, nullptr, 1,  \
                                                  rows, k, k, row_bytes, qr.latent.qx, y, 0, 0, \
                                                  0, MatvecParts(), qr);                        \
    }
DEFINE_MATVEC_TMA_QUERY(matvec_tma_query_q4_k, TcQ4k)
DEFINE_MATVEC_TMA_QUERY(matvec_tma_query_q5_k, TcQ5k)
DEFINE_MATVEC_TMA_QUERY(matvec_tma_query_iq4_xs, TcIq4xs)
DEFINE_MATVEC_TMA_QUERY(matvec_tma_query_q6_k, TcQ6kTile)
DEFINE_MATVEC_TMA_QUERY(matvec_tma_query_q8_0, TcQ80)

// ---- Q4_K items of an input each, rows of up to 2048 values, by bulk copies (sm_90+) ----
//
// The MoE down products (a token's choices, each with its own x of moe_ff values) and MLA's
// per-head v_b: matvec_tc8_q4_k's lanes load their weights themselves (the lane-address bound
// of matvec_tma_q4_k's notes), and matvec_tma_q4_k spreads a tile's 256-blocks over 8 warps
// that meet in shared memory, once per 16-row tile when a row is one stage (the downs there
// were slower: docs/performance.md). Here a stage holds a whole tile (16 rows of k <= 2048,
// copied as one segment a row), and one consumer warp multiplies all of it: no barrier between
// warps per tile. TMI_WARPS consumer warps, stage slot w for warp w, so tile n of the block's
// run goes to slot and warp n % TMI_WARPS; one producer warp.
//
// Arguments as matvec_tc_q4_k's where every item has its own x (x_group 1) and no pair, no glu
// and no combine (ops.rs sums a token's choices in moe_combine): block b takes the b-th of
// gridDim.x equal runs of consecutive tiles, which mostly share their item and so their x; a
// run's items' planes alternate between two buffers, prepared by the consumers together at
// the first tile of each item. Per row the sums are matvec_tc8_q4_k's with a warp per tile
// (the same 256-blocks in the same order), bit for bit. Dynamic shared memory
// tmi_smem_bytes(k) (ops.rs): two of x's planes as tc_smem_bytes(k), then TMI_WARPS stages.
// H200, one decode token (ncu), the downs and v_b: DS3 125.2 -> 111.8 us in 7 launches
// (+12.6 in 3 moe_combine), GLM-5 123.7 -> 101.2 (+11.6); decode GLM-5
// 797 -> 789 us a token, DS3 within noise. The combine in this launch, a fence and an atomic
// per tile and warp, was slower (DS3 850 -> 857 us; docs/performance.md, twenty-third look).
//
// matvec_tma_items_q5_k, matvec_tma_items_iq4_xs, matvec_tma_items_q6_k and
// matvec_tma_items_q8_0 take the same form with their tiles; Q5_K's and Q6_K's with 3 consumer
// warps, Q8_0's with 2, whose stages of 16 x 1440, 1712 or 2208 bytes and x's two buffers fit
// SM120's 99 KiB where 4 would not (ops.rs, TmaTile; H100, Q8_0's MoE row over L2 with its
// downs here 59.6 us, on the CUDA cores 70.0).
// Q6_K's rows are copied whole, so they must be a multiple of 16 bytes (k = 2048, the MoE
// downs of DeepSeek-V3 and GLM-5; ops.rs), and its blocks go in pairs: the even one 4-byte
// aligned, the odd one 2 bytes off, each with the loads of its case and no test (sm_90: 268
// instructions a block where a test and both paths took 286 on average). (At 023255f this
// form lost to the CUDA cores, H200, DS3's MoE row 136.3 -> 145.9 us; with its stage loop
// since cut from 407 to 321 instructions it wins, H100: DS3's MoE row 123.9 -> 112.2 us,
// GLM-5's 106.5 -> 95.7, 77% -> 86% of copy.)
template <class Tile, int TMI_WARPS>
__device__ __forceinline__ void matvec_tma_items_body(const u8* w, const u8* sw, i64 mat_stride,
                                                      const int* ids, int items, int rows,
                                                      int k, i64 row_bytes, const float* x,
                                                      i64 x_stride, float* y, i64 y_stride) {
#if __CUDA_ARCH__ >= 900
    constexpr int ROW = Tile::ROW, STAGE = 16 * ROW, BYTES = Tile::BYTES;
    extern __shared__ __align__(128) u8 tmi_sm[];
    __shared__ u64 full[TMI_WARPS], empty[TMI_WARPS];
    const int nb = k / 256, tiles = (rows + 15) / 16, groups = items * tiles;
    const DivBy by_tiles(tiles);
    const int stride = tc_plane_stride(k);
    const int plane_bytes = tc_x_bytes(k);
    u8* stages = tmi_sm + 2 * plane_bytes;
    const int g0 = (int)((i64)blockIdx.x * groups / gridDim.x);
    const int g1 = (int)((i64)(blockIdx.x + 1) * groups / gridDim.x);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    init_stage_barriers(full, empty, TMI_WARPS, 1);
    // x comes from the kernel before, so the consumers wait for it. The producer reads the
    // weights and the ids only, and starts while the kernel before still runs, as
    // matvec_tma_body's does: the ids come from the router (the MoE downs), two launches back
    // at least, which every kernel lets launch only after its own wait, so they are written
    // when this kernel starts; tc_item reads them through L2. (v_b's stages hold most of its
    // matrix, and MLA's few blocks leave the SMs free for them.)
    if (warp != TMI_WARPS) pdl_wait();
    // Item i's matrix, and whether this rank holds it.
    auto item = [&](int i) {
        return tc_item(i, items, w, nullptr, sw, nullptr, mat_stride, ids, 1);
    };
    if (warp == TMI_WARPS) {
        // Producer: the run's held tiles in order, tile n into slot n % TMI_WARPS once its
        // warp has released the tile before.
        int n = 0;
        for (int grp = g0; grp < g1; grp++) {
            const TcItem it = item(by_tiles.quot(grp));
            if (!it.held) continue;
            const int slot = n % TMI_WARPS, r0 = by_tiles.rem(grp) * 16, nr = min(16, rows - r0);
            if (n >= TMI_WARPS) mbar_wait(&empty[slot], (n / TMI_WARPS - 1) & 1);
            if (lane == 0) mbar_expect_bytes(&full[slot], (u32)(nr * nb * BYTES));
            __syncwarp();
            if (lane < nr)
                bulk_copy(stages + slot * STAGE + lane * ROW,
                          it.mat + (i64)(r0 + lane) * row_bytes, nb * BYTES, &full[slot]);
            n++;
        }
        return;
    }
    pdl_launch_next();
    const int g = lane >> 2, t = lane & 3;
    const float2 pf = TcQ4k::plane_factors(t);
    int n = 0, seg = 0;
    for (int grp = g0; grp < g1;) {
        // The run's tiles of item i: its planes into buffer seg % 2, which no warp reads any
        // more (every warp passed the barrier of the item before, so it is done with the one
        // before that).
        const int i = by_tiles.quot(grp), end = min(g1, (i + 1) * tiles);
        if (!item(i).held) {
            grp = end;
            continue;
        }
        u8* planes = tmi_sm + (seg++ & 1) * plane_bytes;
        tc_prepare_x<Tile::HALVES>(x + (i64)i * x_stride, k, planes, TMI_WARPS);
        consumers_sync<TMI_WARPS>();
        const float* scales = (const float*)(planes + 4 * stride);
        const float* sums = scales + tc_scales_len(k);
        const typename Tile::B b = Tile::b_cols(planes, k, g, t);
        for (; grp < end; grp++, n++) {
            if (n % TMI_WARPS != warp) continue;
            mbar_wait(&full[warp], (n / TMI_WARPS) & 1);
            const u8* blo = stages + warp * STAGE + g * ROW;
            const u8* bhi = blo + 8 * ROW;
            float acc_lo = 0.0f, acc_hi = 0.0f;
            if constexpr (BYTES % 4 != 0) {
                // Q6_K: the rows start 16-byte aligned and are a multiple of 8 blocks (ops.rs),
                // so block kb lies 4-byte aligned where kb is even and 2 off where it is odd.
                for (int kb = 0; kb < nb; kb += 2) {
                    Tile q;
                    q.template load_stage_at<0>(blo + BYTES * kb, bhi + BYTES * kb, t);
                    q.dot(b, kb, sums + 8 * kb, scales[kb], t, pf, acc_lo, acc_hi);
                    q.template load_stage_at<2>(blo + BYTES * (kb + 1), bhi + BYTES * (kb + 1), t);
                    q.dot(b, kb + 1, sums + 8 * (kb + 1), scales[kb + 1], t, pf, acc_lo, acc_hi);
                }
            } else {
                for (int kb = 0; kb < nb; kb++) {
                    Tile q;
                    q.load_stage(blo + BYTES * kb, bhi + BYTES * kb, t);
                    q.dot(b, kb, sums + 8 * kb, scales[kb], t, pf, acc_lo, acc_hi);
                }
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[warp]);  // the stage was read into registers
            quad_sums(acc_lo, acc_hi);
            const int r = by_tiles.rem(grp) * 16 + g;
            float* yi = y + (i64)i * y_stride;
            if (t == 0 && r < rows) yi[r] = acc_lo;
            if (t == 0 && r + 8 < rows) yi[r + 8] = acc_hi;
        }
    }
#else
    __trap();  // ops.rs launches it on sm_90 and later only
#endif
}

#define DEFINE_MATVEC_TMA_ITEMS(kname, Tile, warps)                                             \
    extern "C" __global__ void __launch_bounds__(32 * (warps + 1), 2)                          \
        kname(const u8* w, const u8* sw, i64 mat_stride, const int* ids, int items, int rows,   \
              int k, i64 row_bytes, const float* x, i64 x_stride, float* y, i64 y_stride) {     \
        matvec_tma_items_body<Tile, warps>(w, sw, mat_stride, ids, items, rows, k, row_bytes,   \
                                           x, x_stride, y, y_stride);                           \
    }
DEFINE_MATVEC_TMA_ITEMS(matvec_tma_items_q4_k, TcQ4k, 4)
DEFINE_MATVEC_TMA_ITEMS(matvec_tma_items_q5_k, TcQ5k, 3)
DEFINE_MATVEC_TMA_ITEMS(matvec_tma_items_iq4_xs, TcIq4xs, 4)
DEFINE_MATVEC_TMA_ITEMS(matvec_tma_items_q6_k, TcQ6kTile, 3)
DEFINE_MATVEC_TMA_ITEMS(matvec_tma_items_q8_0, TcQ80, 2)

// ---- Q6_K on integer dot products (matvec_x_digits + matvec_int_q6_k) ----
//
// The Q6_K CUDA-core piece above spends ~5 instructions per weight and row (the byte into a
// float, the bias, the FMA, the 6-bit assembly) and is issue-bound near 55% of the copy
// bandwidth on the lm head. Here x is made integer once per product, as for the tensor cores:
// matvec_x_digits writes four base-128 digit planes of every 256-block (28 bits of its largest
// value) to global memory, and each thread multiplies 4 weights (q, 0..63) by 4 digits of a
// plane with one dp4a. The -32 offset starts each sum (-32 times the sub-block's digit sum),
// the sub-block scales multiply the int32 sums, and per piece they become floats. Result: the
// f32 product to f32 rounding (nmse ~1e-14 against f64, like the kernel above), with ~3
// instructions per weight and row. Lab, H200: lm head 154880 x 6144 328 -> 280 us, and 324 ->
// 248 us with the weights staged through shared memory (matvec_int_q6_k below); shapes of
// fewer rows tied (ops.rs uses it from INT_Q6_MIN_ROWS rows on).
//
// Digits layout (k / 256 blocks): planes [4][k] s8, then digit sums [k / 16][4] i32 (-32 x the
// sum of the 16 digits of each plane), then scales [k / 256] f32. One warp per 256-block.
extern "C" __global__ void matvec_x_digits(const float* x, int k, u8* digits) {
    pdl_enter();
    int lane = threadIdx.x & 31, blk = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (blk >= k / 256) return;
    int* dsums = (int*)(digits + 4 * (i64)k);
    float* scales = (float*)(digits + 5 * (i64)k);
    XDigits xd = x_block_digits(x, blk, lane);
    if (lane == 0) scales[blk] = xd.s;
    int ds[4];
#pragma unroll
    for (int p = 0; p < 4; p++) {
        *(uint2*)(digits + p * (i64)k + 256 * blk + 8 * lane) = xd.words[p];
        ds[p] = -32 * (xd.dsum[p] + __shfl_xor_sync(0xffffffffu, xd.dsum[p], 1));
    }
    if ((lane & 1) == 0)
        *(int4*)(dsums + 4 * (16 * blk + lane / 2)) = make_int4(ds[0], ds[1], ds[2], ds[3]);
}

__device__ __forceinline__ int dp4a_u8s8(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Rows per group (lab: 8 rows 280 us on the lm head, 4 rows 294, 2 rows 305).
#define INT_Q6_ROWS 8
// A warp's stretch of each row per step: 4 blocks (its 32 lanes take one piece each), 840
// bytes, as 16-byte chunks from the aligned address below its start.
#define INT_Q6_STRETCH 840
#define INT_Q6_CHUNKS 54

// The 16 bytes at p (16-byte aligned); where the chunk straddles `end` (the matrix's last
// chunk: its end is only 2-byte aligned) the bytes before `end` and zeros, by 4- and 2-byte
// loads that stay before it.
__device__ __forceinline__ uint4 ld_chunk(const u8* p, const u8* end) {
    if (p + 16 <= end) return ld_stream16(p);
    u32 v[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u8* q = p + 4 * i;
        v[i] = q + 4 <= end ? __ldg((const u32*)q) : q + 2 <= end ? (u32)ld_nc16(q) : 0u;
    }
    return make_uint4(v[0], v[1], v[2], v[3]);
}

// Stretch s of each row (matvec_int_q6_k below) into registers: lanes take chunks lane and
// lane + 32 of the 16-byte aligned span that holds it; chunks past a row's end are zeros.
// Chunks may reach up to 15 bytes past a row's end into the next row, and only the last group
// (AT_END) has a row whose chunk can reach past the matrix's end, so only it checks that
// (checking in every group cost the lab 20%).
template <bool AT_END>
__device__ __forceinline__ void int_q6_fetch(const u8* const* row, i64 row_bytes, const u8* end,
                                             int s, int lane, uint4 (*next)[2]) {
#pragma unroll
    for (int r = 0; r < INT_Q6_ROWS; r++) {
        const u8* start = row[r] + (i64)s * INT_Q6_STRETCH;
        const u8* a = (const u8*)((unsigned long long)start & ~15ull);
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const u8* p = a + 16 * (lane + 32 * c);
            bool in = lane + 32 * c < INT_Q6_CHUNKS && p < row[r] + row_bytes;
            next[r][c] = !in ? make_uint4(0u, 0u, 0u, 0u) : AT_END ? ld_chunk(p, end) : ld_stream16(p);
        }
    }
}

// y[r] = row r of the Q6_K matrix w . x, x as digits (matvec_x_digits). Geometry of
// matvec_body with groups of INT_Q6_ROWS rows (1, 2 or 4 groups per block, read back from the
// grid size); each step covers 4 blocks of a group's rows, a piece per lane as piece_q6_k
// takes them (16 ql bytes: 16 values of quarter j and 16 of quarter j + 2 of half h).
//
// Q6_K blocks are 210 bytes, so a piece's 16 ql and 16 qh bytes sit at 2-byte alignment: read
// from global memory as 4-byte words (ld_words) every load of a warp touched ~8 L1 wavefronts,
// and the lm head ran at 55% of the copy bandwidth on L1 throughput. So the warp first copies
// each row's 840-byte stretch with aligned, coalesced 16-byte loads (lanes take chunks j and
// j + 32), one step ahead in registers, into its shared memory, and the pieces are read from
// there (lab, H200, lm head 154880 x 6144: 324 -> 248 us).
extern "C" __global__ void __launch_bounds__(32 * MATVEC_WARPS)
    matvec_int_q6_k(const u8* w, int rows, int k, i64 row_bytes, const u8* digits, float* y) {
    __shared__ __align__(16) u8 stage[MATVEC_WARPS][INT_Q6_ROWS][INT_Q6_CHUNKS * 16];
    __shared__ float partial[MATVEC_WARPS][INT_Q6_ROWS];
    // Groups per block as in matvec_body: the ks = MATVEC_WARPS / per_block warps of a group
    // take its steps in turn (part, part + ks, ...) and meet in shared memory.
    int groups = (rows + INT_Q6_ROWS - 1) / INT_Q6_ROWS, per_block = 1;
    while (per_block < MATVEC_WARPS && (int)gridDim.x * per_block < groups) per_block *= 2;
    int ks = MATVEC_WARPS / per_block;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = warp % ks;
    int r0 = (blockIdx.x * per_block + warp / ks) * INT_Q6_ROWS;
    const u8* row[INT_Q6_ROWS];
#pragma unroll
    for (int r = 0; r < INT_Q6_ROWS; r++) row[r] = w + (i64)min(r0 + r, rows - 1) * row_bytes;
    const u8* end = w + (i64)rows * row_bytes;
    const int* dsums = (const int*)(digits + 4 * (i64)k);
    const float* scales = (const float*)(digits + 5 * (i64)k);
    const float pf[4] = {2097152.0f, 16384.0f, 128.0f, 1.0f};  // plane weights 2^(21 - 7p)
    int nb = k / 256, steps = (nb + 3) / 4;
    // Step s's chunks of every row, in registers until the step before is done with the stage.
    uint4 next[INT_Q6_ROWS][2];
    bool at_end = r0 + INT_Q6_ROWS >= rows;
    auto fetch = [&](int s) {
        if (at_end)
            int_q6_fetch<true>(row, row_bytes, end, s, lane, next);
        else
            int_q6_fetch<false>(row, row_bytes, end, s, lane, next);
    };
    if (r0 < rows && part < steps) fetch(part);
    pdl_enter();
    float acc[INT_Q6_ROWS];
#pragma unroll
    for (int r = 0; r < INT_Q6_ROWS; r++) acc[r] = 0.0f;
    u8* sm = &stage[warp][0][0];
    for (int s = part; s < steps && r0 < rows; s += ks) {
        __syncwarp();
#pragma unroll
        for (int r = 0; r < INT_Q6_ROWS; r++) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                int j = lane + 32 * c;
                if (j < INT_Q6_CHUNKS) *(uint4*)(sm + r * INT_Q6_CHUNKS * 16 + 16 * j) = next[r][c];
            }
        }
        __syncwarp();
        if (s + ks < steps) fetch(s + ks);
        int q = 32 * s + lane;
        if (q >= nb * 8) continue;
        int blk = q >> 3, p = q & 7, h = p >> 2, j = (p >> 1) & 1, l0 = 16 * (p & 1);
        int e = 256 * blk + 128 * h + 32 * j + l0;  // quarter j; quarter j + 2 at e + 64
        uint4 xa[4], xb[4];
#pragma unroll
        for (int pl = 0; pl < 4; pl++) {
            xa[pl] = __ldg((const uint4*)(digits + pl * (i64)k + e));
            xb[pl] = __ldg((const uint4*)(digits + pl * (i64)k + e + 64));
        }
        int sa = 8 * h + 2 * j + (l0 >> 4);  // sub-block of quarter j in the block
        int4 da = __ldg((const int4*)(dsums + 4 * (16 * blk + sa)));
        int4 db = __ldg((const int4*)(dsums + 4 * (16 * blk + sa + 4)));
        float sx = __ldg(scales + blk);
#pragma unroll
        for (int r = 0; r < INT_Q6_ROWS; r++) {
            // The block in the stage: past the stretch start's offset from its chunk.
            int skew = (int)((unsigned long long)(row[r] + (i64)s * INT_Q6_STRETCH) & 15);
            const u8* b = sm + r * INT_Q6_CHUNKS * 16 + skew + 210 * (blk & 3);
            u32 ql[4], qh[4];
            const u32 mis = (u32)((unsigned long long)b & 3);
            lds_words_mis<4>(b + 64 * h + 32 * j + l0, mis, ql);
            // qh shifted down by 2j in its funnel shift: quarter j's high bits at bits 0-1 of
            // each byte, quarter j + 2's at 4-5, where qb wants them (SASS per ql word and row,
            // beside the two funnel shifts and 8 dp4a: 6 shift and logic instructions, not 9).
            lds_words_mis<4>(b + 128 + 32 * h + l0, mis, qh, 2 * j);
            int ia[4] = {da.x, da.y, da.z, da.w}, ib[4] = {db.x, db.y, db.z, db.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                u32 qa = (ql[i] & 0x0F0F0F0Fu) | ((qh[i] << 4) & 0x30303030u);
                u32 qb = ((ql[i] >> 4) & 0x0F0F0F0Fu) | (qh[i] & 0x30303030u);
#pragma unroll
                for (int pl = 0; pl < 4; pl++) {
                    ia[pl] = dp4a_u8s8(qa, (&xa[pl].x)[i], ia[pl]);
                    ib[pl] = dp4a_u8s8(qb, (&xb[pl].x)[i], ib[pl]);
                }
            }
            int sca = (signed char)b[192 + sa], scb = (signed char)b[196 + sa];
            float f = 0.0f;
#pragma unroll
            for (int pl = 0; pl < 4; pl++) f += pf[pl] * (float)(sca * ia[pl] + scb * ib[pl]);
            acc[r] += f16_to_f32((u16)(b[208] | (b[209] << 8))) * sx * f;
        }
    }
#pragma unroll
    for (int r = 0; r < INT_Q6_ROWS; r++) {
        float sum = warp_sum(acc[r]);
        if (lane == 0) partial[warp][r] = sum;
    }
    __syncthreads();
    if (part == 0 && lane < INT_Q6_ROWS && r0 + lane < rows) {
        float sum = 0.0f;
        for (int i = 0; i < ks; i++) sum += partial[warp + i][lane];
        y[r0 + lane] = sum;
    }
}

// ---- Q6_K on the tensor cores, the weights by bulk copies (sm_90 and later) ----
//
// matvec_int_q6_k above reached ~73% of the copy bandwidth on the lm head, its math alone
// near the whole time (eighteenth look). Here the Q6_K lm head takes matvec_tma_q4_k's
// shape: a producer warp has the copy engine move each tile's 16 rows into shared memory 8
// 256-blocks a stage, and 8 consumer warps multiply a 256-block each on the integer tensor
// cores with x's digit planes (prepared by the block, as for Q4_K). H200 (twenty-first look):
// lm head DS3 242 -> 211-229 us (78-84% of copy), GLM-5 252 -> 218-234 us (78-84%).
//
// The block's tiles (b, b + gridDim.x, ...) are one sequence of 256-blocks, tile after tile,
// and each stage takes the next 8 of it: rows of 28 blocks (DeepSeek-V3's lm head) then fill
// every stage, where a stage per 8 blocks of a tile left the last of 4 half empty (its fixed
// cost per stage made the kernel slower than matvec_int_q6_k there). A stage then holds two
// segments of each row, the end of tile i's row and the start of tile i + 1's: the producer's
// lanes 0-15 copy the 16 rows' first segments, lanes 16-31 their second (so k >= 2048: a stage
// spans at most two tiles).
//
// Rows are 210 bytes a 256-block, so a segment starts anywhere modulo 16 (even): each is copied
// from the 16-byte boundary below it (up to 14 bytes of the row before), the second after the
// first's bytes rounded up to 16, and consumers read 2-byte aligned words through funnel
// shifts (TcQ6k::load). The matrix may end 2-byte aligned: its last bytes past a 16-byte
// boundary are stored by the producer's lanes (bulk_copy_from_any), so that no copy reads past
// it.
//
// Each m16n8k32 product takes a 32-value quarter of a half (Q6_K's quarter j of half h: low
// 4 bits in the low (j < 2) or high nibble of ql[64h + 32 (j & 1) + l], high 2 bits at bits
// 2j of qh[32h + l]), which spans two 16-value sub-blocks of their own scale. Lanes t = 0, 1
// hold values of the first, t = 2, 3 of the second (8 each), so B's columns 0-3 are x's
// planes on the first sub-block (zero on the second) and columns 4-7 on the second: each
// lane's two outputs then belong to one sub-block and take its scale. A value q enters as the
// signed byte 4 (q - 32) (TcQ6k::quarter), so the -32 offset needs no sums of x. Single
// matrices with 2048 <= k <= TMA6_K_MAX (ops.rs): two stages of 16 x 1744 bytes beside x fit
// SM120's 99 KiB.
#define TMA6_STAGES 2
// A row's 8 blocks in two segments from 16-byte boundaries take 1728 bytes at most; 1744 is
// 80 modulo 128, so the 8 rows a load instruction reads fall on distinct pairs of banks.
#define TMA6_ROW 1744
#define TMA6_STAGE (16 * TMA6_ROW)

// y = w x for one Q6_K matrix of `rows` rows of k (a multiple of 256, at least 2048) values,
// row_bytes apart; w and x 16-byte aligned. Block 288 threads (8 consumer warps, 1 producer),
// dynamic shared memory tma6_smem_bytes(k) (ops.rs): x's planes, scales and sums as
// tc_prepare_x writes them (tc_x_bytes, the sums unused, the zeros q6_dot's B where a lane's
// columns are not its sub-block's), then the stages. One grid wave of blocks.
// With `pick` (the lm head), also the index of y's largest value at pick[0], as argmax_row
// finds it (grid_argmax; pick_work as its work): the greedy pick without a launch of its own.
extern "C" __global__ void __launch_bounds__(288, 2)
    matvec_tma_q6_k(const u8* w, int rows, int k, i64 row_bytes, const float* x, float* y,
                    int* pick_work, int* pick) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) u8 tma_sm[];
    __shared__ u64 full[TMA6_STAGES], empty[TMA6_STAGES];
    __shared__ float partial[2][TMA_BLOCKS][16];  // [tile parity][warp][row]
    const int stride = tc_plane_stride(k), nb = k / 256;
    const float* scales = (const float*)(tma_sm + 4 * stride);
    u8* stages = tma_sm + tc_x_bytes(k);
    const int tiles = (rows + 15) / 16, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // The block's tiles, and the stages of their sequence of blocks.
    const int mine = (tiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
    const int nst = (mine * nb + TMA_BLOCKS - 1) / TMA_BLOCKS;
    const u8* end = w + (i64)rows * row_bytes;
    init_stage_barriers(full, empty, TMA6_STAGES, TMA_BLOCKS);
    // The first row of the block's tile i, and row r of it from block b.
    auto first_row = [&](int i) { return 16 * ((int)blockIdx.x + i * (int)gridDim.x); };
    auto row_at = [&](int i, int r, int b) {
        return w + (i64)(first_row(i) + r) * row_bytes + 210 * b;
    };
    // Stage n starts at block a of the block's tile i0 (both advanced stage by stage) and takes
    // cnt0 = min(8, nb - a) blocks of it, then 8 - cnt0 of tile i0 + 1.
    if (warp == TMA_BLOCKS) {
        // Producer: lane seg * 16 + r copies row r's segment seg.
        const int seg = lane >> 4, r = lane & 15;
        for (int n = 0, i0 = 0, a = 0; n < nst; n++) {
            const int slot = n % TMA6_STAGES, cnt0 = min(TMA_BLOCKS, nb - a);
            const int i = i0 + seg, cnt = seg ? TMA_BLOCKS - cnt0 : cnt0;
            if (n >= TMA6_STAGES) mbar_wait(&empty[slot], (n / TMA6_STAGES - 1) & 1);
            const bool copies = cnt > 0 && i < mine && first_row(i) + r < rows;
            u8* dst = stages + slot * TMA6_STAGE + r * TMA6_ROW +
                      (seg ? segment_bytes((u32)(unsigned long long)row_at(i0, r, a), 210 * cnt0) : 0);
            bulk_copy_from_any(dst, row_at(copies ? i : 0, r, seg ? 0 : a), 210 * cnt, copies, end,
                               &full[slot]);
            a += TMA_BLOCKS;
            if (a >= nb) a -= nb, i0++;
        }
        return;
    }
    pdl_enter();  // x may come from the previous kernel
    tc_prepare_x(x, k, tma_sm, TMA_BLOCKS);
    consumers_sync();
    // Consumer warp c takes block c of each stage, rows g and g + 8 of its tile; acc_* sum
    // tile i0's rows, next_* tile i0 + 1's until i0 ends.
    const int g = lane >> 2, t = lane & 3, c = warp;
    const float2 pf = TcQ4k::plane_factors(t);
    // Where rows g and g + 8 lie modulo 16 (32-bit addresses suffice), from tile i0's row g
    // on: the stage rows' offsets follow from it as the producer's copies did.
    const u32 row8 = (u32)(8 * row_bytes), tile_step = (u32)(16 * gridDim.x * row_bytes);
    u32 row_lo = (u32)(unsigned long long)w + (u32)(16 * blockIdx.x + g) * (u32)row_bytes;
    float acc_lo = 0.0f, acc_hi = 0.0f, next_lo = 0.0f, next_hi = 0.0f;
    float best = NEG_INF;  // with pick: the best of the rows this lane stored
    int arg = 1 << 30;
    for (int n = 0, i0 = 0, a = 0; n < nst; n++) {
        const int slot = n % TMA6_STAGES, cnt0 = min(TMA_BLOCKS, nb - a);
        const bool second = c >= cnt0;  // the block is tile i0 + 1's
        const int i = i0 + second, blk = second ? c - cnt0 : a + c;
        mbar_wait(&full[slot], (n / TMA6_STAGES) & 1);
        TcQ6kTile q;
        if (i < mine) {
            const u32 first_lo = row_lo + 210 * a, next = row_lo + tile_step;
            u32 at_lo = ((first_lo & 15) + 210 * c), at_hi = ((first_lo + row8) & 15) + 210 * c;
            if (second) {
                at_lo = segment_bytes(first_lo, 210 * cnt0) + (next & 15) + 210 * blk;
                at_hi = segment_bytes(first_lo + row8, 210 * cnt0) + ((next + row8) & 15) + 210 * blk;
            }
            const u8* st = stages + slot * TMA6_STAGE + g * TMA6_ROW;
            q.load_stage(st + at_lo, st + 8 * TMA6_ROW + at_hi, t);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[slot]);  // the slot is in registers
        if (i < mine) {
            float d_lo = 0.0f, d_hi = 0.0f;
            q6_dot(q.lo, q.hi, TcQ6k::b_block(tma_sm, k, g, t, blk), scales[blk], pf, d_lo, d_hi);
            if (second) next_lo += d_lo, next_hi += d_hi;
            else acc_lo += d_lo, acc_hi += d_hi;
        }
        if (a + TMA_BLOCKS >= nb) {
            // Tile i0 ends in this stage: its rows' sums over the warps to y.
            const int par = i0 & 1, r0 = first_row(i0);
            quad_sums(acc_lo, acc_hi);
            if (t == 0) {
                partial[par][warp][g] = acc_lo;
                partial[par][warp][g + 8] = acc_hi;
            }
            consumers_sync();
            if (warp == 0 && lane < 16 && r0 + lane < rows) {
                float sum = 0.0f;
                for (int p = 0; p < TMA_BLOCKS; p++) sum += partial[par][p][lane];
                y[r0 + lane] = sum;
                argmax_pair(&best, &arg, sum, r0 + lane);
            }
            acc_lo = next_lo, acc_hi = next_hi, next_lo = 0.0f, next_hi = 0.0f;
        }
        a += TMA_BLOCKS;
        if (a >= nb) a -= nb, i0++, row_lo += tile_step;
    }
    if (pick && warp == 0) {
        warp_argmax(&best, &arg);
        grid_argmax(best, arg, rows, pick_work, pick);
    }
#else
    __trap();  // ops.rs launches it on sm_90 and later only
#endif
}

// matvec_t_<type>: the transposed product for small batches, y_b[j] = sum_i W_b[i, j] * x_b[i]
// over the `rows` rows of W_b (each k elements long, so y_b has k values), with the same
// W_b / x_b / y_b addressing as matvec. MLA's k_nope = k_b^T c_kv for a few tokens, in f32.
// One thread per 8 output columns walks down all rows; neighbouring threads read neighbouring
// units of each row. grid (ceil(k / 8 / 128), batch), block 128.
template <int ELEMS, int BYTES, void (*DQ8)(const u8*, int, float*)>
__device__ void matvec_t_body(const u8* w, i64 mat_stride, const int* ids, int rows, int k,
                              i64 row_bytes, const float* x, int x_group, i64 x_stride, float* y,
                              i64 y_stride) {
    int b = blockIdx.y;
    int u = blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= k / 8) return;
    i64 m = ids ? ids[b] : b;
    const int units_per_block = ELEMS / 8;
    const u8* col = w + m * mat_stride + (i64)(u / units_per_block) * BYTES;
    const float* xb = x + (i64)(b / x_group) * x_stride;
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int i = 0; i < rows; i++) {
        float v[8];
        DQ8(col + i * row_bytes, u % units_per_block, v);
        float xi = xb[i];
#pragma unroll
        for (int e = 0; e < 8; e++) acc[e] += v[e] * xi;
    }
    float* out = y + b * y_stride + 8 * u;
#pragma unroll
    for (int e = 0; e < 8; e++) out[e] = acc[e];
}

// embed_<type>: y[t, :] = the dequantized row ids[t] of w (n elements per row; ids null: the
// one row id0, a decode token's id passed by value, so that no copy precedes it). One block per
// row, a thread per 8-element unit up to 1024 (ops.rs): each thread's units are loads waited
// for one after another (128 threads took 7.9 us for DeepSeek-V3's 7168 values, ncu, H200).
// With h, also h[t, :] = rmsnorm(y[t, :]) * wv (eps; the kernel loads the norm's weights wv
// before its wait): the first layer's norm of the embedding in its launch (one launch fewer a
// decode token).
template <int ELEMS, int BYTES, void (*DQ8)(const u8*, int, float*)>
__device__ void embed_body(const u8* w, i64 row_bytes, const int* ids, int id0, int n,
                           float* y, const float wv[NORM_VALS], float* h, float eps) {
    int t = blockIdx.x;
    const u8* row = w + (i64)(ids ? ids[t] : id0) * row_bytes;
    const int units_per_block = ELEMS / 8;
    for (int u = threadIdx.x; u < n / 8; u += blockDim.x) {
        float v[8];
        DQ8(row + (i64)(u / units_per_block) * BYTES, u % units_per_block, v);
        float4* out = (float4*)(y + (i64)t * n + 8 * u);
        out[0] = make_float4(v[0], v[1], v[2], v[3]);
        out[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
    if (!h) return;
    // The first layer's norm here rather than in a launch of its own: the block reads back its
    // row (blockDim.x * NORM_VALS >= n: ops.rs).
    __shared__ float scratch[32];
    float v[NORM_VALS];
    __syncthreads();
    load_row(v, y + (i64)t * n, n);
    rms_store(v, wv, h + (i64)t * n, n, eps, scratch);
}

// The most warps a matvec_<type> block may have (see MATVEC_WIDE_WARPS).
template <void (*DQ8)(const u8*, int, float*)>
struct MatvecWarps {
    static const int MAX = MATVEC_WARPS;
};
template <>
struct MatvecWarps<dq8_f32> {
    static const int MAX = MATVEC_WIDE_WARPS;
};

// The piece function of each type that has one: PIECES per block (0: none, use
// generic_piece) and whether its loads need 16-byte aligned blocks.
template <void (*DQ8)(const u8*, int, float*)>
struct FastPiece {
    static const int PIECES = 0;
};
#define FAST_PIECE(name, pieces, align16)                       \
    template <>                                                 \
    struct FastPiece<dq8_##name> {                              \
        static const int PIECES = pieces;                       \
        static const bool ALIGN16 = align16;                    \
        static constexpr PieceFn FN = piece_##name;             \
    };
FAST_PIECE(f32, 2, true)
FAST_PIECE(f16, 1, true)
FAST_PIECE(bf16, 1, true)
FAST_PIECE(q5_0, 4, false)
FAST_PIECE(q8_0, 2, false)
FAST_PIECE(q2_k, 4, false)
FAST_PIECE(q3_k, 4, false)
FAST_PIECE(q4_k, 8, true)
FAST_PIECE(q5_k, 8, true)
FAST_PIECE(q6_k, 8, false)
FAST_PIECE(iq4_nl, 1, false)
FAST_PIECE(iq4_xs, 8, false)

template <int ELEMS, int BYTES, void (*DQ8)(const u8*, int, float*), bool HALF>
__device__ void matvec_dispatch(const u8* w, i64 mat_stride, const int* ids, int rows, int k,
                                i64 row_bytes, const float* x, int x_group, i64 x_stride,
                                float* y, i64 y_stride, const MatvecParts& parts) {
    typedef FastPiece<DQ8> F;
    u64 addresses = (u64)w | (u64)parts.w1 | (u64)parts.w2;
    if constexpr (F::PIECES == 0) {
        matvec_body<ELEMS, BYTES, ELEMS / 8, generic_piece<DQ8>, HALF>(
            w, mat_stride, ids, rows, k, row_bytes, x, x_group, x_stride, y, y_stride, parts);
    } else if constexpr (!F::ALIGN16) {
        matvec_body<ELEMS, BYTES, F::PIECES, F::FN, HALF>(
            w, mat_stride, ids, rows, k, row_bytes, x, x_group, x_stride, y, y_stride, parts);
    } else if (((addresses | mat_stride | row_bytes) & 15) == 0) {
        matvec_body<ELEMS, BYTES, F::PIECES, F::FN, HALF>(
            w, mat_stride, ids, rows, k, row_bytes, x, x_group, x_stride, y, y_stride, parts);
    } else {
        // A 16-byte piece type at an odd address (never seen in practice): the unit walk.
        matvec_body<ELEMS, BYTES, ELEMS / 8, generic_piece<DQ8>, HALF>(
            w, mat_stride, ids, rows, k, row_bytes, x, x_group, x_stride, y, y_stride, parts);
    }
}

#define DEFINE_MATVEC(name, elems, bytes)                                                    \
    extern "C" __global__ void __launch_bounds__(32 * MatvecWarps<dq8_##name>::MAX)         \
        matvec_##name(const u8* w, i64 mat_stride, const int* ids, int rows, int k,          \
                      i64 row_bytes, const float* x, int x_group, i64 x_stride, float* y,    \
                      i64 y_stride, MatvecParts parts) {                                     \
        matvec_dispatch<elems, bytes, dq8_##name, false>(w, mat_stride, ids, rows, k,        \
                                                         row_bytes, x, x_group, x_stride, y, \
                                                         y_stride, parts);                   \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) matvec_t_##name(                       \
        const u8* w, i64 mat_stride, const int* ids, int rows, int k, i64 row_bytes,         \
        const float* x, int x_group, i64 x_stride, float* y, i64 y_stride) {                 \
        pdl_enter();                                                                         \
        matvec_t_body<elems, bytes, dq8_##name>(w, mat_stride, ids, rows, k, row_bytes, x,   \
                                                x_group, x_stride, y, y_stride);             \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(1024) embed_##name(                       \
        const u8* w, i64 row_bytes, const int* ids, int id0, int n, float* y,                \
        const float* norm_w, float* h, float eps) {                                          \
        float wv[NORM_VALS]; /* the norm's weights while the kernel before ends */           \
        if (norm_w) load_row(wv, norm_w, n);                                                 \
        pdl_enter();                                                                         \
        embed_body<elems, bytes, dq8_##name>(w, row_bytes, ids, id0, n, y, wv, h, eps);      \
    }

FOR_EACH_QTYPE(DEFINE_MATVEC)

// The parts launch of MLA's q_a, kv_a and indexer key with the latent's norms in its last
// blocks (MatvecParts::done, parts_tail), for the types these take in the models' files; a
// kernel of its own, so that the others keep their code and registers (the tail would take
// matvec_q5_0, MLA's k_b, from 48 to 56). From sm_90 on the bulk-copy tile types take
// matvec_tma_parts_<type> instead; other types take matvec_<type> and latent_norm_rope.
#define DEFINE_MATVEC_LATENT(name, elems, bytes)                                            \
    extern "C" __global__ void __launch_bounds__(32 * MATVEC_WARPS) matvec_latent_##name(  \
        const u8* w, i64 mat_stride, const int* ids, int rows, int k, i64 row_bytes,        \
        const float* x, int x_group, i64 x_stride, float* y, i64 y_stride,                  \
        MatvecParts parts) {                                                                \
        parts_tail_prefetch(parts.latent, blockIdx.y);                                      \
        matvec_dispatch<elems, bytes, dq8_##name, false>(w, mat_stride, ids, rows, k,       \
                                                         row_bytes, x, x_group, x_stride, y, \
                                                         y_stride, parts);                   \
        parts_tail(parts);                                                                  \
    }
DEFINE_MATVEC_LATENT(q4_k, 256, 144)
DEFINE_MATVEC_LATENT(q5_k, 256, 176)
DEFINE_MATVEC_LATENT(q6_k, 256, 210)
DEFINE_MATVEC_LATENT(q8_0, 32, 34)
DEFINE_MATVEC_LATENT(iq4_xs, 256, 136)

// Half-warp row groups for the types of MLA's per-head k_b (rows of 128 values: 16 pieces or
// fewer). The host takes them through `matvec_half_kernel` (ops.rs).
#define DEFINE_MATVEC_HALF(name, elems, bytes)                                              \
    extern "C" __global__ void __launch_bounds__(32 * MATVEC_WARPS) matvec_half_##name(    \
        const u8* w, i64 mat_stride, const int* ids, int rows, int k, i64 row_bytes,        \
        const float* x, int x_group, i64 x_stride, float* y, i64 y_stride,                  \
        MatvecParts parts) {                                                                \
        matvec_dispatch<elems, bytes, dq8_##name, true>(w, mat_stride, ids, rows, k,        \
                                                        row_bytes, x, x_group, x_stride, y, \
                                                        y_stride, parts);                   \
    }
DEFINE_MATVEC_HALF(q4_0, 32, 18)
DEFINE_MATVEC_HALF(q5_0, 32, 22)
DEFINE_MATVEC_HALF(q8_0, 32, 34)
DEFINE_MATVEC_HALF(f16, 8, 16)
DEFINE_MATVEC_HALF(bf16, 8, 16)
