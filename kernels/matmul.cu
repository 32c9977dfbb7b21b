// Quantized matrix-matrix products on tensor cores (prefill). Needs quant.cuh.
//
// matmul_<type>: Y[m, n] = sum_k X[row(m), k] * W[n, k] for m < M, n < N, with
//   row(m) = row_ids ? row_ids[m] : m  (gathers the tokens routed to one expert),
// X f32 (x_stride elements per row), W quantized (row_bytes per row), Y f32 (y_stride).
// Operands are rounded to bf16 in shared memory and multiplied with mma.sync m16n8k16
// (f32 accumulation): sm_80 and later, SM120 included. The weight tile is dequantized from its
// blocks on the way into shared memory; no dequantized copy of W exists anywhere else.
// k must be a multiple of 32.
//
// matmul_t_<type>: the same with W transposed, Y[m, n] = sum_k X[row(m), k] * W[k, n], for the
// per-head products with the rows on the reduced side (MLA's k_nope = k_b^T c_kv): W has k
// rows of n elements; n must be a multiple of 8.
//
// Tiles: BM (M) x 128 (N) x 32 (K) per block of 8 warps laid out 2 (M) x 4 (N), each warp
// owning a BM/2 x 32 corner. matmul_<type> / matmul_t_<type> use BM = 128 (large M: twice
// the MMAs per staged byte of the 64-row tile); matmul_m64_<type> / matmul_t_m64_<type> use
// BM = 64 for few rows per matrix (the grouped MoE spans, ~16 rows per expert), where a
// 128-row tile would mostly multiply padding.
//
// Pipeline: two shared-memory stages. While the warps multiply stage s, every thread already
// holds the next tile in registers (X as raw f32, W dequantized to bf16 pairs) and writes it
// to stage s ^ 1 afterwards, so the global loads and the dequantization overlap the MMAs and
// there is one barrier per k step. Fragments come from shared memory through ldmatrix.
//
// Batched mode (spans == 0; the per-head products, one launch for all heads): block z
// multiplies matrix w + z * mat_stride (bytes) with X from x + z * x_mat_stride and Y at
// y + z * y_mat_stride (elements). With gridDim.z == 1 that is the plain single product.
//
// Grouped mode (the MoE prefill, one launch for all experts): spans != 0 points at
// gridDim.z triples (expert, first row r0, count). Block z multiplies matrix
// w + expert * mat_stride (bytes) for the global rows r0 .. r0 + count: local row m is global
// row r = r0 + m, read from X row row_ids ? row_ids[r] : r, written to Y row r. M is then
// unused (the grid's y covers the largest count); blocks past their span's count return at
// once. x_mat_stride and y_mat_stride are unused.

#define MM_BN 128
#define MM_BK 32
#define MM_THREADS 256
#define MM_PAD 8  // bf16 of padding per shared row: ldmatrix's 8 row addresses hit 32 banks

__device__ __forceinline__ void mma_bf16_16816(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four 8x8 bf16 matrices; lane l gives the shared address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(u32* r, const u16* p) {
    u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// The same, each matrix transposed (B fragments from a [k][n] tile).
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const u16* p) {
    u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// 8 weights -> 4 bf16 pairs.
__device__ __forceinline__ uint4 pack8(const float* v) {
    return make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                      pack_bf16x2(v[6], v[7]));
}

// N little-endian words from any byte address: N + 1 aligned 4-byte loads joined by funnel
// shifts (the extra one only when p is unaligned, and then it holds bytes of the range).
template <int N>
__device__ __forceinline__ void mm_words(const u8* p, u32* out) {
    const u8* base = (const u8*)((unsigned long long)p & ~3ull);
    u32 sh = 8 * (u32)((unsigned long long)p & 3);
    u32 a[N + 1];
#pragma unroll
    for (int i = 0; i < N; i++) a[i] = __ldg((const unsigned int*)(base + 4 * i));
    a[N] = sh ? __ldg((const unsigned int*)(base + 4 * N)) : 0u;
#pragma unroll
    for (int i = 0; i < N; i++) out[i] = __funnelshift_r(a[i], a[i + 1], sh);
}

__device__ __forceinline__ int byte_of(u32 w, int i) { return (w >> (8 * i)) & 0xff; }

// One 8-element unit into the weight tile: dq8_<type> (byte loads), or for the types that
// dominate prefill a version with word loads (the byte loads made the loader LSU-bound).
template <void (*DQ8)(const u8*, int, float*)>
struct MmUnit {
    static __device__ __forceinline__ void dq(const u8* b, int u, float* y) { DQ8(b, u, y); }
};

// Q4_K (layout in quant.cuh): header words d | dmin, scales[0..12); 8 qs bytes.
template <>
struct MmUnit<dq8_q4_k> {
    static __device__ __forceinline__ void dq(const u8* b, int u, float* y) {
        int e0 = 8 * u, c = e0 >> 6, s = e0 >> 5, l0 = e0 & 31, shift = 4 * (s & 1);
        u32 hd[4], qs[2];
        mm_words<4>(b, hd);
        mm_words<2>(b + 16 + 32 * c + l0, qs);
        // kquant_scale_min on the words: scales[i] is byte i % 4 of hd[1 + i / 4].
        int i = s & 3, sc, mn;
        if (s < 4) {
            sc = byte_of(hd[1], i) & 63;
            mn = byte_of(hd[2], i) & 63;
        } else {
            sc = (byte_of(hd[3], i) & 15) | ((byte_of(hd[1], i) >> 6) << 4);
            mn = (byte_of(hd[3], i) >> 4) | ((byte_of(hd[2], i) >> 6) << 4);
        }
        float dl = f16_to_f32((u16)(hd[0] & 0xffff)) * (float)sc;
        float ml = f16_to_f32((u16)(hd[0] >> 16)) * (float)mn;
#pragma unroll
        for (int k = 0; k < 8; k++)
            y[k] = dl * (float)((byte_of(qs[k >> 2], k & 3) >> shift) & 15) - ml;
    }
};

// Q6_K (layout in quant.cuh; blocks only 2-byte aligned): 8 ql bytes, 8 qh bytes, one scale.
template <>
struct MmUnit<dq8_q6_k> {
    static __device__ __forceinline__ void dq(const u8* b, int u, float* y) {
        int e0 = 8 * u, h = e0 >> 7, j = (e0 & 127) >> 5, l0 = e0 & 31;
        u32 ql[2], qh[2];
        mm_words<2>(b + 64 * h + 32 * (j & 1) + l0, ql);
        mm_words<2>(b + 128 + 32 * h + l0, qh);
        const signed char* scales = (const signed char*)(b + 192);
        float dl = f16_to_f32(load_u16(b + 208)) * (float)scales[8 * h + 2 * j + (l0 >> 4)];
        int lshift = 4 * (j >> 1);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            int q = ((byte_of(ql[k >> 2], k & 3) >> lshift) & 15) |
                    (((byte_of(qh[k >> 2], k & 3) >> (2 * j)) & 3) << 4);
            y[k] = dl * (float)(q - 32);
        }
    }
};

template <int BM, int ELEMS, int BYTES, void (*DQ8)(const u8*, int, float*), bool TRANS>
__device__ __forceinline__ void matmul_body(const u8* w, i64 row_bytes, const float* x,
                                            i64 x_stride, const int* row_ids, float* y,
                                            i64 y_stride, int M, int N, int K, const int* spans,
                                            i64 mat_stride, i64 x_mat_stride, i64 y_mat_stride) {
    // Per-thread shares of a tile: X has BM rows of 32 f32 (XV float4 per thread, TPR threads
    // per row); W has 128 x 32 weights = 512 units of 8, two per thread.
    constexpr int XV = BM * MM_BK / 4 / MM_THREADS;
    constexpr int TPR = MM_THREADS / BM;
    constexpr int MI = BM / 32;  // m16 subtiles per warp (BM / 2 rows)
    constexpr int XS = MM_BK + MM_PAD;                                  // xs row, [m][k]
    constexpr int WS = TRANS ? MM_BN + MM_PAD : MM_BK + MM_PAD;         // ws row
    constexpr int WSTAGE = TRANS ? MM_BK * WS : MM_BN * WS;  // [k][n] if TRANS, else [n][k]

    if (spans) {
        const int* sp = spans + 3 * blockIdx.z;
        int ex = sp[0], r0 = sp[1];
        M = sp[2];
        if ((int)blockIdx.y * BM >= M) return;  // whole block: before any barrier
        w += (i64)ex * mat_stride;
        if (row_ids)
            row_ids += r0;
        else
            x += (i64)r0 * x_stride;
        y += (i64)r0 * y_stride;
    } else {
        w += (i64)blockIdx.z * mat_stride;
        x += (i64)blockIdx.z * x_mat_stride;
        y += (i64)blockIdx.z * y_mat_stride;
    }
    __shared__ __align__(16) u16 xs[2][BM * XS];
    __shared__ __align__(16) u16 ws[2][WSTAGE];

    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int m0 = blockIdx.y * BM, n0 = blockIdx.x * MM_BN;
    int wm = (warp >> 2) * (BM / 2), wn = (warp & 3) * 32;  // this warp's corner in the tile

    float acc[MI][4][4];  // [m16 subtile][n8 subtile][fragment]
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    // X loader: row xr, columns xc .. xc + 4 XV (the row is fixed, so gather it once).
    int xr = tid / TPR, xc = (tid % TPR) * 4 * XV;
    const float* xrow = nullptr;
    if (m0 + xr < M) {
        i64 src = row_ids ? row_ids[m0 + xr] : m0 + xr;
        xrow = x + src * x_stride + xc;
    }
    // W loader: unit s of this thread covers 8 weights at (wr[s], wc[s]) of the tile, [n][k]
    // (wc along k) or, transposed, [k][n] (wc along n); wsrc is its block, 0 when out of range.
    int wr[2], wc[2];
    const u8* wsrc[2];
    int wunit[2];
#pragma unroll
    for (int s = 0; s < 2; s++) {
        int unit = tid + MM_THREADS * s;
        if (TRANS) {  // 32 rows (k) x 16 units (n)
            wr[s] = unit >> 4;
            wc[s] = (unit & 15) * 8;
            int e = n0 + wc[s];
            wsrc[s] = e < N ? w + (i64)wr[s] * row_bytes + (i64)(e / ELEMS) * BYTES : nullptr;
            wunit[s] = (e % ELEMS) / 8;
        } else {  // 128 rows (n) x 4 units (k)
            wr[s] = unit >> 2;
            wc[s] = (unit & 3) * 8;
            wsrc[s] = n0 + wr[s] < N ? w + (i64)(n0 + wr[s]) * row_bytes : nullptr;
            wunit[s] = 0;
        }
    }

    float4 xv[XV];
    uint4 wv[2];
    // Tile k0 into registers.
    auto fetch = [&](int k0) {
#pragma unroll
        for (int i = 0; i < XV; i++)
            xv[i] = xrow ? ((const float4*)(xrow + k0))[i] : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int s = 0; s < 2; s++) {
            float v[8];
            if (!wsrc[s]) {
                wv[s] = make_uint4(0, 0, 0, 0);
                continue;
            }
            if (TRANS) {
                MmUnit<DQ8>::dq(wsrc[s] + (i64)k0 * row_bytes, wunit[s], v);
            } else {
                int e = k0 + wc[s];
                MmUnit<DQ8>::dq(wsrc[s] + (i64)(e / ELEMS) * BYTES, (e % ELEMS) / 8, v);
            }
            wv[s] = pack8(v);
        }
    };
    // Registers -> stage st (bf16).
    auto stash = [&](int st) {
        uint4* xd = (uint4*)&xs[st][xr * XS + xc];
#pragma unroll
        for (int i = 0; i < XV / 2; i++)
            xd[i] = make_uint4(pack_bf16x2(xv[2 * i].x, xv[2 * i].y),
                               pack_bf16x2(xv[2 * i].z, xv[2 * i].w),
                               pack_bf16x2(xv[2 * i + 1].x, xv[2 * i + 1].y),
                               pack_bf16x2(xv[2 * i + 1].z, xv[2 * i + 1].w));
#pragma unroll
        for (int s = 0; s < 2; s++) *(uint4*)&ws[st][wr[s] * WS + wc[s]] = wv[s];
    };

    // ldmatrix lane addresses. A (xs [m][k]): matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15) in
    // the order of the mma's a0..a3. B from [n][k]: (n 0-7, k 0-7), (n 0-7, k 8-15),
    // (n 8-15, k 0-7), (n 8-15, k 8-15) = b[j][0], b[j][1], b[j+1][0], b[j+1][1]; from [k][n]
    // with .trans the same four, addressed by k rows.
    int a_off = (wm + (lane & 15)) * XS + (lane >> 4) * 8;
    int b_off = TRANS ? ((lane & 7) + ((lane >> 3) & 1) * 8) * WS + wn + (lane >> 4) * 8
                      : (wn + (lane & 7) + (lane >> 4) * 8) * WS + ((lane >> 3) & 1) * 8;

    fetch(0);
    stash(0);
    __syncthreads();
    int nk = K / MM_BK;
    for (int t = 0; t < nk; t++) {
        int st = t & 1;
        if (t + 1 < nk) fetch((t + 1) * MM_BK);  // in flight during the MMAs below
#pragma unroll
        for (int kk = 0; kk < MM_BK; kk += 16) {
            u32 a[MI][4], b[4][2];
#pragma unroll
            for (int i = 0; i < MI; i++) ldmatrix_x4(a[i], &xs[st][a_off + 16 * i * XS + kk]);
#pragma unroll
            for (int j = 0; j < 4; j += 2) {
                u32 r[4];
                if (TRANS)
                    ldmatrix_x4_trans(r, &ws[st][b_off + kk * WS + 8 * j]);
                else
                    ldmatrix_x4(r, &ws[st][b_off + 8 * j * WS + kk]);
                b[j][0] = r[0];
                b[j][1] = r[1];
                b[j + 1][0] = r[2];
                b[j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) mma_bf16_16816(acc[i][j], a[i], b[j]);
        }
        // Stage st ^ 1 was last read in step t - 1, which every thread finished before the
        // barrier that ended it; one barrier per step then publishes the new stage.
        if (t + 1 < nk) stash(st ^ 1);
        __syncthreads();
    }

    // C fragment: (row g, cols 2c, 2c+1) and (row g + 8, same cols).
    int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int m = m0 + wm + 16 * i + g + 8 * h;
                int n = n0 + wn + 8 * j + 2 * c;
                if (m < M) {
                    if (n < N) y[(i64)m * y_stride + n] = acc[i][j][2 * h];
                    if (n + 1 < N) y[(i64)m * y_stride + n + 1] = acc[i][j][2 * h + 1];
                }
            }
}

#define MATMUL_KERNEL(kname, bm, minblocks, name, elems, bytes, trans)                         \
    extern "C" __global__ void __launch_bounds__(MM_THREADS, minblocks) kname(                 \
        const u8* w, i64 row_bytes, const float* x, i64 x_stride, const int* row_ids, float* y, \
        i64 y_stride, int M, int N, int K, const int* spans, i64 mat_stride, i64 x_mat_stride, \
        i64 y_mat_stride) {                                                                   \
        matmul_body<bm, elems, bytes, dq8_##name, trans>(w, row_bytes, x, x_stride, row_ids, y, \
                                                         y_stride, M, N, K, spans, mat_stride,  \
                                                         x_mat_stride, y_mat_stride);           \
    }

#define DEFINE_MATMUL(name, elems, bytes)                                       \
    MATMUL_KERNEL(matmul_##name, 128, 2, name, elems, bytes, false)            \
    MATMUL_KERNEL(matmul_t_##name, 128, 2, name, elems, bytes, true)           \
    MATMUL_KERNEL(matmul_m64_##name, 64, 2, name, elems, bytes, false)         \
    MATMUL_KERNEL(matmul_t_m64_##name, 64, 2, name, elems, bytes, true)

FOR_EACH_QTYPE(DEFINE_MATMUL)

// ---------------------------------------------------------------------------------------------
// matmul_s16_<type> / matmul_s32_<type>: the same product (plain, batched or grouped mode, not
// transposed) for few rows per matrix: the grouped MoE spans of ~16 tokens per expert, where
// the 64-row tile above multiplied 3/4 padding and dequantized every weight tile for 16 rows.
// Here the weights dominate: each block dequantizes a BN = 256 (N) x 64 (K) weight tile per
// k step once, for BM = 16 or 32 rows (one or two m16 tiles). 8 warps side by side along N,
// each owning BM x 32 outputs. Thread t owns weight row n0 + t: per k step it loads that row's
// 64 weights (Q4_K: the 16-byte header and 32 qs bytes, both nibbles used, as 16-byte loads)
// into registers before the MMAs and dequantizes them to shared memory after them. One shared
// stage (41.5 KiB at BM = 32), two barriers per step. K must be a multiple of 64. Spans with
// more than BM rows take several y blocks, as in the 64-row kernel.

#define MS_BN 256
#define MS_BK 64
#define MS_WS (MS_BK + MM_PAD)  // bf16 per shared row (144 bytes: ldmatrix conflict-free)

// One thread's 64 weights (k0 .. k0 + 64 of one row) per k step: load() issues the global
// loads, get() gives 32 bf16 pairs. Generic: unit by unit through MmUnit at load time.
template <int ELEMS, int BYTES, void (*DQ8)(const u8*, int, float*)>
struct MmRow64 {
    uint4 v[8];
    __device__ __forceinline__ void load(const u8* row, int k0) {
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int e = k0 + 8 * u;
            float f[8];
            MmUnit<DQ8>::dq(row + (i64)(e / ELEMS) * BYTES, (e % ELEMS) / 8, f);
            v[u] = pack8(f);
        }
    }
    __device__ __forceinline__ void get(uint4* out) {
#pragma unroll
        for (int u = 0; u < 8; u++) out[u] = v[u];
    }
};

// nibble byte j of w (each byte < 16) as a float: 2^23 + q built by a byte permute, minus 2^23.
__device__ __forceinline__ float nib_f(u32 w, int j) {
    return __int_as_float((int)__byte_perm(w, 0x4B000000u, 0x7650u | (u32)j)) - 8388608.0f;
}

// Q4_K: 64 weights at k0 (a multiple of 64) are chunk c = (k0 % 256) / 64 of a block: the 32
// qs bytes at 16 + 32 c, low nibbles sub-block 2c, high nibbles sub-block 2c + 1.
template <int ELEMS, int BYTES>
struct MmRow64<ELEMS, BYTES, dq8_q4_k> {
    u32 hd[4], qs[8];
    int c;
    __device__ __forceinline__ void load(const u8* row, int k0) {
        const u8* b = row + (i64)(k0 >> 8) * 144;
        c = (k0 >> 6) & 3;
        const u8* q = b + 16 + 32 * c;
        if ((((unsigned long long)b) & 15) == 0) {
            uint4 h = __ldg((const uint4*)b), q0 = __ldg((const uint4*)q),
                  q1 = __ldg((const uint4*)(q + 16));
            hd[0] = h.x, hd[1] = h.y, hd[2] = h.z, hd[3] = h.w;
            qs[0] = q0.x, qs[1] = q0.y, qs[2] = q0.z, qs[3] = q0.w;
            qs[4] = q1.x, qs[5] = q1.y, qs[6] = q1.z, qs[7] = q1.w;
        } else {
            mm_words<4>(b, hd);
            mm_words<8>(q, qs);
        }
    }
    __device__ __forceinline__ void get(uint4* out) {
        // kquant_scale_min for sub-blocks 2c and 2c + 1 (both < 4 or both >= 4).
        int sc0, mn0, sc1, mn1;
        if (c < 2) {
            int i = 2 * c;
            sc0 = byte_of(hd[1], i) & 63, mn0 = byte_of(hd[2], i) & 63;
            sc1 = byte_of(hd[1], i + 1) & 63, mn1 = byte_of(hd[2], i + 1) & 63;
        } else {
            int i = 2 * c - 4;
            sc0 = (byte_of(hd[3], i) & 15) | ((byte_of(hd[1], i) >> 6) << 4);
            mn0 = (byte_of(hd[3], i) >> 4) | ((byte_of(hd[2], i) >> 6) << 4);
            sc1 = (byte_of(hd[3], i + 1) & 15) | ((byte_of(hd[1], i + 1) >> 6) << 4);
            mn1 = (byte_of(hd[3], i + 1) >> 4) | ((byte_of(hd[2], i + 1) >> 6) << 4);
        }
        float d = f16_to_f32((u16)(hd[0] & 0xffff)), dm = f16_to_f32((u16)(hd[0] >> 16));
        float dl0 = d * (float)sc0, ml0 = dm * (float)mn0;
        float dl1 = d * (float)sc1, ml1 = dm * (float)mn1;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            float lo[8], hi[8];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                u32 wl = qs[2 * u + h] & 0x0F0F0F0Fu, wh = (qs[2 * u + h] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    lo[4 * h + j] = dl0 * nib_f(wl, j) - ml0;
                    hi[4 * h + j] = dl1 * nib_f(wh, j) - ml1;
                }
            }
            out[u] = pack8(lo);
            out[4 + u] = pack8(hi);
        }
    }
};

template <int BM, int ELEMS, int BYTES, void (*DQ8)(const u8*, int, float*)>
__device__ __forceinline__ void matmul_small_body(const u8* w, i64 row_bytes, const float* x,
                                                  i64 x_stride, const int* row_ids, float* y,
                                                  i64 y_stride, int M, int N, int K,
                                                  const int* spans, i64 mat_stride,
                                                  i64 x_mat_stride, i64 y_mat_stride) {
    constexpr int MI = BM / 16;                                 // m16 tiles per warp
    constexpr int XF = BM * MS_BK / 4;                          // float4 per X tile
    constexpr int XV = (XF + MM_THREADS - 1) / MM_THREADS;      // per thread

    if (spans) {
        const int* sp = spans + 3 * blockIdx.z;
        int ex = sp[0], r0 = sp[1];
        M = sp[2];
        if ((int)blockIdx.y * BM >= M) return;  // whole block: before any barrier
        w += (i64)ex * mat_stride;
        if (row_ids)
            row_ids += r0;
        else
            x += (i64)r0 * x_stride;
        y += (i64)r0 * y_stride;
    } else {
        w += (i64)blockIdx.z * mat_stride;
        x += (i64)blockIdx.z * x_mat_stride;
        y += (i64)blockIdx.z * y_mat_stride;
    }
    __shared__ __align__(16) u16 xs[BM * MS_WS];     // [m][k]
    __shared__ __align__(16) u16 ws[MS_BN * MS_WS];  // [n][k]

    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int m0 = blockIdx.y * BM, n0 = blockIdx.x * MS_BN;
    int wn = warp * 32;  // this warp's columns in the tile

    float acc[MI][4][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    // X loader: float4 f = tid + 256 i of the tile is row f / 16, columns 4 (f % 16) ...
    const float* xp[XV];
    int xoff[XV];
#pragma unroll
    for (int i = 0; i < XV; i++) {
        int f = tid + MM_THREADS * i, r = f >> 4, col = (f & 15) * 4;
        xoff[i] = f < XF ? r * MS_WS + col : -1;
        xp[i] = nullptr;
        if (f < XF && m0 + r < M) {
            i64 src = row_ids ? row_ids[m0 + r] : m0 + r;
            xp[i] = x + src * x_stride + col;
        }
    }
    // W loader: row n0 + tid of the matrix, 0 past N.
    const u8* wrow = n0 + tid < N ? w + (i64)(n0 + tid) * row_bytes : nullptr;
    MmRow64<ELEMS, BYTES, DQ8> wl;
    float4 xv[XV];

    auto load = [&](int k0) {
#pragma unroll
        for (int i = 0; i < XV; i++)
            xv[i] = xp[i] ? __ldg((const float4*)(xp[i] + k0)) : make_float4(0.f, 0.f, 0.f, 0.f);
        if (wrow) wl.load(wrow, k0);
    };
    auto stash = [&]() {
#pragma unroll
        for (int i = 0; i < XV; i++)
            if (xoff[i] >= 0)
                *(uint2*)&xs[xoff[i]] = make_uint2(pack_bf16x2(xv[i].x, xv[i].y),
                                                   pack_bf16x2(xv[i].z, xv[i].w));
        uint4 v[8];
        if (wrow) {
            wl.get(v);
        } else {
#pragma unroll
            for (int u = 0; u < 8; u++) v[u] = make_uint4(0, 0, 0, 0);
        }
        uint4* wd = (uint4*)&ws[tid * MS_WS];
#pragma unroll
        for (int u = 0; u < 8; u++) wd[u] = v[u];
    };

    // ldmatrix lane addresses, as in matmul_body ([m][k] A, [n][k] B).
    int a_off = (lane & 15) * MS_WS + (lane >> 4) * 8;
    int b_off = (wn + (lane & 7) + (lane >> 4) * 8) * MS_WS + ((lane >> 3) & 1) * 8;

    load(0);
    int nk = K / MS_BK;
    for (int t = 0; t < nk; t++) {
        stash();
        __syncthreads();
        if (t + 1 < nk) load((t + 1) * MS_BK);  // in flight during the MMAs below
#pragma unroll
        for (int kk = 0; kk < MS_BK; kk += 16) {
            u32 a[MI][4], b[4][2];
#pragma unroll
            for (int i = 0; i < MI; i++) ldmatrix_x4(a[i], &xs[a_off + 16 * i * MS_WS + kk]);
#pragma unroll
            for (int j = 0; j < 4; j += 2) {
                u32 r[4];
                ldmatrix_x4(r, &ws[b_off + 8 * j * MS_WS + kk]);
                b[j][0] = r[0];
                b[j][1] = r[1];
                b[j + 1][0] = r[2];
                b[j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) mma_bf16_16816(acc[i][j], a[i], b[j]);
        }
        __syncthreads();  // the stage is rewritten at the top of the next step
    }

    int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int m = m0 + 16 * i + g + 8 * h;
                int n = n0 + wn + 8 * j + 2 * c;
                if (m < M) {
                    if (n < N) y[(i64)m * y_stride + n] = acc[i][j][2 * h];
                    if (n + 1 < N) y[(i64)m * y_stride + n + 1] = acc[i][j][2 * h + 1];
                }
            }
}

#define MATMUL_SMALL_KERNEL(kname, bm, minblocks, name, elems, bytes)                          \
    extern "C" __global__ void __launch_bounds__(MM_THREADS, minblocks) kname(                 \
        const u8* w, i64 row_bytes, const float* x, i64 x_stride, const int* row_ids, float* y, \
        i64 y_stride, int M, int N, int K, const int* spans, i64 mat_stride, i64 x_mat_stride, \
        i64 y_mat_stride) {                                                                   \
        matmul_small_body<bm, elems, bytes, dq8_##name>(w, row_bytes, x, x_stride, row_ids, y, \
                                                        y_stride, M, N, K, spans, mat_stride,  \
                                                        x_mat_stride, y_mat_stride);           \
    }

#define DEFINE_MATMUL_SMALL(name, elems, bytes)                    \
    MATMUL_SMALL_KERNEL(matmul_s16_##name, 16, 3, name, elems, bytes) \
    MATMUL_SMALL_KERNEL(matmul_s32_##name, 32, 2, name, elems, bytes)

FOR_EACH_QTYPE(DEFINE_MATMUL_SMALL)
