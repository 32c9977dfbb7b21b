// Quantized matrix-matrix products on tensor cores (prefill). Needs quant.cuh.
//
// matmul_<type>: Y[m, n] = sum_k X[row(m), k] * W[n, k] for m < M, n < N, with
//   row(m) = row_ids ? row_ids[m] : m  (gathers the tokens routed to one expert),
// X f32 (x_stride elements per row), W quantized (row_bytes per row), Y f32 (y_stride).
// Operands are rounded to bf16 and multiplied with mma.sync m16n8k16 (f32 accumulation):
// sm_80 and later, SM120 included (no wgmma / TMA; at most 99 KiB of shared memory per block).
// No dequantized copy of W exists anywhere: weight tiles are dequantized on the way into
// shared memory (or, in the cp.async kernels, into mma fragments).
//
// Two generations of kernels live here; ops.rs (Gpu::matmul) picks one per call:
// - matmul_cp_<q4_k|q8_0>, matmul_cp_spans_<q4_k|q8_0> and matmul_cp_spans64_q4_k (end of the
//   file): the prefill path for the types real models store their big matrices in. Raw weight
//   bytes through a cp.async ring, X pre-rounded to bf16 once per product (matmul_xprep,
//   scratch), split-K for narrow products (matmul_splitk_sum). Plain and grouped mode;
//   K % 256 == 0 and 16-byte aligned weights. 2-8x faster than the kernels below on an H200.
// - The kernels below, for every type and every mode: transposed (matmul_t_*), batched heads
//   (gridDim.z matrices), few rows (matmul_s16 / matmul_s32), and any call matmul_cp cannot
//   take (other types, misaligned weights, K not a multiple of 256).
//
// matmul_t_<type>: the same with W transposed, Y[m, n] = sum_k X[row(m), k] * W[k, n], for the
// per-head products with the rows on the reduced side (MLA's k_nope = k_b^T c_kv): W has k
// rows of n elements; n must be a multiple of 8.
//
// Tiles: BM (M) x 128 (N) x 32 (K) per block of 8 warps laid out 2 (M) x 4 (N), each warp
// owning a BM/2 x 32 corner. matmul_<type> / matmul_t_<type> use BM = 128 (large M: twice
// the MMAs per staged byte of the 64-row tile); matmul_m64_<type> / matmul_t_m64_<type> use
// BM = 64 for few rows per matrix, where a 128-row tile would mostly multiply padding.
// k must be a multiple of 32.
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
        ld_words<4>(b, hd);
        ld_words<2>(b + 16 + 32 * c + l0, qs);
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
        ld_words<2>(b + 64 * h + 32 * (j & 1) + l0, ql);
        ld_words<2>(b + 128 + 32 * h + l0, qh);
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

// Grouped mode: block z takes span z = (expert, first row r0, count). Moves w to the
// expert's matrix, row_ids (gathered rows) or x (consecutive rows) and y to row r0, and
// returns the span's row count.
template <typename X>
__device__ __forceinline__ int enter_span(const int* spans, i64 mat_stride, const u8*& w,
                                          const int*& row_ids, const X*& x, i64 x_stride,
                                          float*& y, i64 y_stride) {
    const int* sp = spans + 3 * blockIdx.z;
    int r0 = sp[1];
    w += (i64)sp[0] * mat_stride;
    if (row_ids)
        row_ids += r0;
    else
        x += (i64)r0 * x_stride;
    y += (i64)r0 * y_stride;
    return sp[2];
}

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
        M = enter_span(spans, mat_stride, w, row_ids, x, x_stride, y, y_stride);
        if ((int)blockIdx.y * BM >= M) return;  // whole block: before any barrier
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
        pdl_enter();                                                                          \
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
            ld_words<4>(b, hd);
            ld_words<8>(q, qs);
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
        M = enter_span(spans, mat_stride, w, row_ids, x, x_stride, y, y_stride);
        if ((int)blockIdx.y * BM >= M) return;  // whole block: before any barrier
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
        pdl_enter();                                                                          \
        matmul_small_body<bm, elems, bytes, dq8_##name>(w, row_bytes, x, x_stride, row_ids, y, \
                                                        y_stride, M, N, K, spans, mat_stride,  \
                                                        x_mat_stride, y_mat_stride);           \
    }

#define DEFINE_MATMUL_SMALL(name, elems, bytes)                    \
    MATMUL_SMALL_KERNEL(matmul_s16_##name, 16, 3, name, elems, bytes) \
    MATMUL_SMALL_KERNEL(matmul_s32_##name, 32, 2, name, elems, bytes)

FOR_EACH_QTYPE(DEFINE_MATMUL_SMALL)

// ---------------------------------------------------------------------------------------------
// matmul_cp_<type> / matmul_cp_spans_<type> (Q4_K and Q8_0, the types of real prefill weights;
// matmul_cp_spans64_q4_k: 64-row tiles for spans of 48 rows or more on average):
// raw weight bytes staged by cp.async and dequantized straight into mma B fragments. Plain
// (one matrix, gridDim.z == 1) and grouped mode; not transposed. K % 256 == 0, W, its rows
// and matrices 16-byte aligned, Y rows 16-byte aligned (ops.rs checks; else the kernels above).
//
// Ring: STAGES shared-memory stages per k step of 64, each the X tile and the RAW weight bytes
// of the BN x 64 W tile (Q4_K: the row's 32 qs bytes of this 64-chunk, and with a block's first
// chunk its 16-byte header into one of two header slots outside the ring: re-reading it every
// step cost 40% of the grouped product's L2 sectors; Q8_0: the 80-byte 16-aligned window
// holding the row's two 34-byte blocks), all
// copied by cp.async with prefetch distance STAGES - 2, so one barrier per k step suffices
// (the slot being refilled was read two steps ago). Q4_K sub-block scale and min of the next
// stage are decoded once per (row, sub-block) into a small double buffer, not per fragment.
// No bf16 weight tile exists: each warp dequantizes its B fragments from the raw bytes into
// registers and reuses them for its WM / 16 m16 tiles.
//
// k order: inside every 32-element group the X columns are permuted (perm32) so that the B
// fragment of thread c for k16 step s, logical k (2c, 2c+1, 2c+8, 2c+9), is 4 consecutive
// quant bytes 8c + 4(s&1) .. +3 of the row (Q4_K: low nibbles for s < 2, high for s >= 2;
// Q8_0: block 0 for s < 2, block 1 for s >= 2). The product is a sum over k, so any common
// permutation of X and W columns gives the same result.
//
// X: matmul_xprep writes X as bf16 in that order once per product into scratch (ops.rs
// allocates it; plain mode gathers the rows through row_ids there, grouped mode converts X's
// rows as they are and the tiles gather them), tiles load it by cp.async into 128-byte rows
// with 16-byte chunks XOR-swizzled, A fragments come by ldmatrix (conflict-free). Grouped: an
// m16 tile with no row of the span (16 rows or fewer in a 32-row tile) skips its fragments
// and MMAs (warp-uniform).
//
// Dense tiles are numbered with M fastest, so the blocks of one wave share W tiles (each W
// tile read from DRAM about once) while the bf16 X stays in L2. Split-K (plain mode, when the
// tiles do not fill the GPU, e.g. the narrow q_a / kv_a products, or for the columns a last
// round would leave to few blocks: ops.rs, matmul_cp_plan): blockIdx.y takes a range of k steps
// and writes f32 partials [split][M][N] into scratch; matmul_splitk_sum adds them in split
// order into Y (deterministic).
//
// Q4_K dequantizes in bf16 (fma.rn.bf16x2), ~2 instructions per weight pair fewer than in f32:
// its nibble becomes bf16 128 + q by a magic-number OR (0x4300 | q), then (128 + q) - 128 = q
// exactly and q (d sc) + (-dmin mn), the scale and min rounded to bf16 like the operands
// (against the exact dequantization ~1e-6 to 1e-5 NMSE). Q8_0's byte q = (q & 127) - 128
// (bit 7) becomes 128 + (q & 127) by the same OR and -128 - 128 (bit 7) by another (both exact
// in bf16), and q d comes from one fma of the first and d onto the second times d (exact),
// with d rounded to bf16 (emulated products ~7.3e-6 NMSE against f64 on the exact weights,
// 4.9e-6 with d q in f32).

#define Q4K_T 0
#define Q80_T 1

__device__ __forceinline__ u32 bf2_fma(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ u32 lop_or_and(u32 a, u32 mask, u32 orv) {
    u32 d;  // (a & mask) | orv: one LOP3
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(orv));
    return d;
}

// Logical position L (0..31) of a 32-group of the permuted X -> physical k.
__device__ __forceinline__ int perm32(int L) {
    return 8 * ((L & 7) >> 1) + 4 * ((L >> 4) & 1) + ((L >> 3) & 1) + 2 * (L & 1);
}

// xb[r][K] (bf16, permuted) = X[row(r)], one thread per (row, 32-group).
extern "C" __global__ void matmul_xprep(const float* __restrict__ x, i64 x_stride,
                                        const int* __restrict__ row_ids, int rows, int K,
                                        u16* __restrict__ xb) {
    pdl_enter();
    int groups = K >> 5;
    i64 id = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (i64)rows * groups) return;
    int r = (int)(id / groups), gi = (int)(id % groups);
    i64 src = row_ids ? row_ids[r] : r;
    const float4* p = (const float4*)(x + src * x_stride + 32 * gi);
    float v[32];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float4 f = __ldg(p + i);
        v[4 * i] = f.x, v[4 * i + 1] = f.y, v[4 * i + 2] = f.z, v[4 * i + 3] = f.w;
    }
    u32 o[16];
#pragma unroll
    for (int q = 0; q < 16; q++) o[q] = pack_bf16x2(v[perm32(2 * q)], v[perm32(2 * q + 1)]);
    uint4* d = (uint4*)(xb + (i64)r * K + 32 * gi);
#pragma unroll
    for (int i = 0; i < 4; i++)
        d[i] = make_uint4(o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]);
}

// y[m][n] = sum over the splits of part[split][m][n] (N % 4 == 0), one float4 per thread.
extern "C" __global__ void matmul_splitk_sum(const float* __restrict__ part, int splits, int M,
                                             int N, float* __restrict__ y, i64 y_stride) {
    pdl_enter();
    i64 i4 = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i4 >= (i64)M * N / 4) return;
    float4 s = ((const float4*)part)[i4];
    for (int k = 1; k < splits; k++) {
        float4 t = ((const float4*)(part + (i64)k * M * N))[i4];
        s.x += t.x, s.y += t.y, s.z += t.z, s.w += t.w;
    }
    i64 e = 4 * i4;
    int m = (int)(e / N), n = (int)(e % N);
    *(float4*)(y + (i64)m * y_stride + n) = s;
}

// Shared-memory layout of one configuration (mirrored by matmul_cp_smem in kernels.rs).
template <int QT, int BM, int BN, int WM, int WN, int STAGES>
struct CpCfg {
    static constexpr int THREADS = 32 * (BM / WM) * (BN / WN);
    static constexpr int MI = WM / 16, NJ = WN / 8;
    static constexpr int XB = BM * 128;  // BM rows of 64 bf16 per stage
    static constexpr int WQ = QT == Q4K_T ? 32 : 80;        // raw bytes per W row per stage
    static constexpr int STAGE = XB + BN * WQ;
    // Q4_K: the rows' 16-byte block headers, loaded once per 256-block (every fourth k step)
    // into one of 2 slots; decoded scales, 2 buffers.
    static constexpr int HB = QT == Q4K_T ? 2 * BN * 16 : 0;
    static constexpr int SB = QT == Q4K_T ? 2 * BN * 16 : 0;
    static constexpr int SMEM = STAGES * STAGE + HB + SB;
    static_assert(SMEM <= 99 * 1024, "SM120: at most 99 KiB of shared memory per block");
    static_assert(STAGES >= 3, "one barrier per step needs 3 stages");
};

// How many of a warp's m16 tiles hold rows, as a type: the compute step is unrolled for it,
// without a test per MMA (a test per MMA, though warp-uniform, made ptxas put a WARPSYNC
// before each: 41 of a grouped k step's 388 instructions on sm_90).
template <int N>
struct LiveTiles {
    static constexpr int n = N;
};

// GROUPED: spans (the X rows gathered through row_ids); else plain mode (part != null:
// split-K partials, ksteps k steps per split). xb: bf16 X from matmul_xprep, K per row.
template <int QT, bool GROUPED, int BM, int BN, int WM, int WN, int STAGES>
__device__ __forceinline__ void matmul_cp_body(const u8* w, i64 row_bytes, const u16* xb,
                                               const int* row_ids, float* y, i64 y_stride, int M,
                                               int N, int K, const int* spans, i64 mat_stride,
                                               int tiles_m, int ksteps, float* part) {
    using C = CpCfg<QT, BM, BN, WM, WN, STAGES>;
    constexpr int T = C::THREADS, MI = C::MI, NJ = C::NJ;
    extern __shared__ __align__(128) u8 smem[];
    const u32 sbase = (u32)__cvta_generic_to_shared(smem);

    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int m0, n0, kb0 = 0, kb1 = K >> 6;
    if (GROUPED) {
        M = enter_span(spans, mat_stride, w, row_ids, xb, (i64)K, y, y_stride);
        m0 = blockIdx.y * BM;
        if (m0 >= M) return;  // whole block: before any barrier
        n0 = blockIdx.x * BN;
    } else {
        m0 = (blockIdx.x % tiles_m) * BM;
        n0 = (blockIdx.x / tiles_m) * BN;
        if (part) {
            kb0 = blockIdx.y * ksteps;
            kb1 = min(kb1, kb0 + ksteps);
            y = part + (i64)blockIdx.y * M * N;
            y_stride = N;
        }
    }
    const int nk = kb1 - kb0;

    // A thread's copies are the same at every k step but for the k offset, so their sources
    // (byte offsets from the block's first row), destinations and valid flags are found once
    // here (found at every step, their 64-bit arithmetic had taken 176 of the 465
    // instructions of a k step of the 8-warp matmul_cp_q4_k on sm_90; 78 of 370 after).
    // X: 8 chunks of 16 bytes per row and stage; row r's chunk ch lands at r * 128 +
    // (ch ^ r % 8) * 16 (T / 8 rows apart from one copy to the next, a multiple of 8: the
    // same swizzle). W: copy f of the stage lands at 16 f (Q4_K: f < 2 BN the half f % 2 of
    // row f / 2's qs, then row f - 2 BN's header into a header slot; Q8_0: piece f % 5 of row
    // f / 5's 80-byte window).
    constexpr int XI = (BM * 8 + T - 1) / T;
    constexpr int WI = QT == Q4K_T ? (BN * 3 + T - 1) / T : (BN * 5 + T - 1) / T;
    static_assert(T % 64 == 0 && 2 * BN % T == 0, "whole rows of swizzle, qs then headers");
    const u8* xbase = (const u8*)(GROUPED ? xb : xb + (i64)m0 * K);
    const u8* wbase = w + (i64)n0 * row_bytes;
    u32 xoff[XI], woff[WI], xok = 0, wok = 0;
#pragma unroll
    for (int i = 0; i < XI; i++) {
        int f = tid + i * T, r = f >> 3;
        bool ok = (BM * 8 % T == 0 || f < BM * 8) && m0 + r < M;
        i64 row = !ok ? 0 : GROUPED && row_ids ? row_ids[m0 + r] : GROUPED ? m0 + r : r;
        xoff[i] = ok ? (u32)(2 * (row * K + 8 * (f & 7))) : 0u;
        xok |= (u32)ok << i;
    }
#pragma unroll
    for (int i = 0; i < WI; i++) {
        int f = tid + i * T;
        int r = QT == Q4K_T ? (f < 2 * BN ? f >> 1 : f - 2 * BN) : f / 5;
        int col = QT == Q4K_T ? (f < 2 * BN ? 16 + 16 * (f & 1) : 0) : 16 * (f - 5 * r);
        bool ok = f < (QT == Q4K_T ? 3 : 5) * BN && n0 + r < N;
        woff[i] = ok ? (u32)(r * row_bytes + col) : 0u;
        wok |= (u32)ok << i;
    }
    const u32 xdst = (tid >> 3) * 128 + (((tid & 7) ^ ((tid >> 3) & 7)) << 4);

    auto load_stage = [&](int slot, int kb) {
        const u32 st = sbase + slot * C::STAGE;
        const int k0 = kb << 6;
#pragma unroll
        for (int i = 0; i < XI; i++)
            if (BM * 8 % T == 0 || tid + i * T < BM * 8)
                cp16(st + xdst + i * T * 16, xbase + xoff[i] + 2 * k0, (xok >> i) & 1);
        const u32 wq = st + C::XB;
        if (QT == Q4K_T) {
            const int blk = kb >> 2, c = kb & 3;
            const u8* wk = wbase + blk * 144;
            const u32 wh = sbase + STAGES * C::STAGE + (blk & 1) * BN * 16;
            // The header of a block comes with its first step (or a split's first step): its
            // slot is read by the decodes of the block's 4 steps, the last of which comes
            // before the block after next is loaded (STAGES - 1 steps ahead, fewer than 6).
            const bool header = c == 0 || kb == kb0;
#pragma unroll
            for (int i = 0; i < WI; i++) {
                const int f = tid + i * T;
                if (i < 2 * BN / T)
                    cp16(wq + 16 * f, wk + woff[i] + 32 * c, (wok >> i) & 1);
                else if (header && (BN * 3 % T == 0 || f < BN * 3))
                    cp16(wh + 16 * (f - 2 * BN), wk + woff[i], (wok >> i) & 1);
            }
        } else {
            const u8* wk = wbase + ((i64)kb * 68 & ~15ll);  // two 34-byte blocks from byte 68 kb
#pragma unroll
            for (int i = 0; i < WI; i++)
                if (BN * 5 % T == 0 || tid + i * T < BN * 5)
                    cp16(wq + 16 * (tid + i * T), wk + woff[i], (wok >> i) & 1);
        }
    };
    // Q4_K: (scale, min) of sub-blocks 2c, 2c + 1 of every row of a landed stage -> buffer buf
    // as bf16x2 (d sc, d sc) and (-dmin mn, -dmin mn), each, a row a thread (one header read,
    // one d and dmin for both; a sub-block a thread had cost 60 of a k step's instructions).
    auto decode = [&](int slot, int kb, int buf) {
        if (QT != Q4K_T) return;
        const u8* wh = smem + STAGES * C::STAGE + ((kb >> 2) & 1) * BN * 16;
        uint4* sb = (uint4*)(smem + STAGES * C::STAGE + C::HB + buf * BN * 16);
        // kquant_scale_min on the header words, both sub-blocks at once: theirs are bytes
        // (2c) % 4 and + 1 of the words, from bit b.
        const int c = kb & 3, b = 16 * (c & 1);
#pragma unroll
        for (int i = 0; i < (BN + T - 1) / T; i++) {
            int r = tid + i * T;
            if (BN % T == 0 || r < BN) {
                uint4 hd = *(const uint4*)(wh + r * 16);
                u32 sc, mn;  // sub-block 2c's in bits 0-7, 2c + 1's in bits 8-15
                if (c < 2) {
                    sc = (hd.y >> b) & 0x3F3Fu;
                    mn = (hd.z >> b) & 0x3F3Fu;
                } else {
                    sc = ((hd.w >> b) & 0x0F0Fu) | (((hd.y >> (b + 6)) & 0x0303u) << 4);
                    mn = ((hd.w >> (b + 4)) & 0x0F0Fu) | (((hd.z >> (b + 6)) & 0x0303u) << 4);
                }
                float d = f16_to_f32((u16)(hd.x & 0xffff)), dm = f16_to_f32((u16)(hd.x >> 16));
                float dl0 = d * (float)(sc & 0xff), ml0 = dm * (float)(mn & 0xff);
                float dl1 = d * (float)(sc >> 8), ml1 = dm * (float)(mn >> 8);
                sb[r] = make_uint4(pack_bf16x2(dl0, dl0), pack_bf16x2(-ml0, -ml0),
                                   pack_bf16x2(dl1, dl1), pack_bf16x2(-ml1, -ml1));
            }
        }
    };

    const int wm = (warp / (BN / WN)) * WM, wn = (warp % (BN / WN)) * WN;
    const int g = lane >> 2, c4 = lane & 3;

    float acc[MI][NJ][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

    // ldmatrix A (bf16 X): lane -> row wm + 16 i + (lane & 15), chunk 2 kk + (lane >> 4).
    const int a_row = wm + (lane & 15);
    const int a_sw = a_row & 7, a_hi = lane >> 4;

    // One k step from slot on the first `live` m16 tiles (LiveTiles); sel = Q4_K: scale
    // buffer, Q8_0: the window's offset 68 kb % 16.
    auto compute = [&](int slot, int sel, auto live) {
        constexpr int LIVE = decltype(live)::n;
        const u32 xs = sbase + slot * C::STAGE;
        const u8* wq = smem + slot * C::STAGE + C::XB;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            u32 a[MI][4];
#pragma unroll
            for (int i = 0; i < LIVE; i++)
                ldsm_x4(a[i], xs + (a_row + 16 * i) * 128 + (((2 * kk + a_hi) ^ a_sw) << 4));
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                const int r = wn + 8 * j + g;
                u32 b0, b1;
                if (QT == Q4K_T) {
                    u32 wv = *(const u32*)(wq + r * 32 + 8 * c4 + 4 * (kk & 1));
                    uint2 sc = *(const uint2*)(smem + STAGES * C::STAGE + C::HB + sel * BN * 16 +
                                               r * 16 + 8 * (kk >> 1));
                    if (kk >= 2) wv >>= 4;
                    // bf16 128 + q from the nibble; (128 + q) - 128 = q exactly; q d sc - m.
                    const u32 ONE = 0x3F803F80u, M128 = 0xC300C300u;
                    u32 ra = lop_or_and(wv, 0x000F000Fu, 0x43004300u);
                    u32 rb = lop_or_and(wv >> 8, 0x000F000Fu, 0x43004300u);
                    b0 = bf2_fma(bf2_fma(ra, ONE, M128), sc.x, sc.y);
                    b1 = bf2_fma(bf2_fma(rb, ONE, M128), sc.x, sc.y);
                } else {
                    // Window: block 0 = d at sel, qs at sel + 2; block 1 = d at sel + 34, qs
                    // at sel + 36.
                    const u8* rowp = wq + r * 80 + sel;
                    u32 wv;
                    float d;
                    if (kk < 2) {
                        const u8* q0 = rowp + 8 * c4 + 4 * kk;  // qs byte 8c + 4 kk at q0 + 2
                        u32 lo = *(const u32*)q0, hi = *(const u32*)(q0 + 4);
                        wv = __byte_perm(lo, hi, 0x5432);
                        d = f16_to_f32(*(const u16*)rowp);
                    } else {
                        wv = *(const u32*)(rowp + 36 + 8 * c4 + 4 * (kk - 2));
                        d = f16_to_f32(*(const u16*)(rowp + 34));
                    }
                    // Bytes (q0, q2) and (q1, q3) in the halves, q = (q & 127) - 128 (bit 7):
                    // bf16 128 + (q & 127) and -128 - 128 (bit 7), times d, summed in one fma.
                    // (d q in f32, rounded once, was 2-9% slower on an H100; d as a bf16 hi +
                    // lo pair too: thirtieth look.)
                    const u32 d2 = pack_bf16x2(d, d), NEG0 = 0x80008000u, wb = wv >> 8;
                    b0 = bf2_fma(lop_or_and(wv, 0x007F007Fu, 0x43004300u), d2,
                                 bf2_fma(lop_or_and(wv, 0x00800080u, 0xC300C300u), d2, NEG0));
                    b1 = bf2_fma(lop_or_and(wb, 0x007F007Fu, 0x43004300u), d2,
                                 bf2_fma(lop_or_and(wb, 0x00800080u, 0xC300C300u), d2, NEG0));
                }
                u32 bb[2] = {b0, b1};
#pragma unroll
                for (int i = 0; i < LIVE; i++) mma_bf16_16816(acc[i][j], a[i], bb);
            }
        }
    };

    // Grouped: one warp row (wm = 0), whose m16 tile i holds rows where the span has more
    // than m0 + 16 i (m0 < M: the first always).
    static_assert(!GROUPED || (WM == BM && MI <= 4), "grouped: one warp row of 1 to 4 m16 tiles");
    const int live = GROUPED ? min(MI, (M - m0 + 15) / 16) : MI;

    // Pipeline: STAGES - 1 steps in flight at the start; scales decoded one step ahead.
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < nk) load_stage(s, kb0 + s);
        cp_commit();
    }
    cp_wait<STAGES - 2>();
    __syncthreads();
    decode(0, kb0, 0);
    for (int t = 0; t < nk; t++) {
        cp_wait<STAGES - 3>();
        __syncthreads();  // step t + 1 landed for all; scales of t visible; slot t - 1 free
        int tn = t + STAGES - 1;
        if (tn < nk) load_stage(tn % STAGES, kb0 + tn);
        cp_commit();  // possibly empty: keeps the group count per step fixed for cp_wait
        if (t + 1 < nk) decode((t + 1) % STAGES, kb0 + t + 1, (t + 1) & 1);
        const int sel = QT == Q4K_T ? (t & 1) : (int)(((i64)(kb0 + t) * 68) & 15);
        if (live >= MI)
            compute(t % STAGES, sel, LiveTiles<MI>{});
        else if (MI > 3 && live == 3)
            compute(t % STAGES, sel, LiveTiles<(MI > 3 ? 3 : 1)>{});
        else if (MI > 2 && live == 2)
            compute(t % STAGES, sel, LiveTiles<(MI > 2 ? 2 : 1)>{});
        else
            compute(t % STAGES, sel, LiveTiles<1>{});
    }
    cp_wait<0>();

    // C fragment: (row g, cols 2c, 2c+1) and (row g + 8, same cols); N % 8 == 0.
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int m = m0 + wm + 16 * i + g + 8 * h;
                int n = n0 + wn + 8 * j + 2 * c4;
                if (m < M && n < N)
                    *(float2*)(y + (i64)m * y_stride + n) =
                        make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
            }
}

// Configurations measured on an H200 (lab: 2048 x 18432 x 7168 q4_k 4.4 -> 2.0 ms, q8_0
// 5.3 -> 2.2 ms; grouped MoE q8_0 10.2 -> 1.9 ms). Plain: 128 x 128 tiles, 4 warps of 128 x 32
// side by side along N, so that each warp's B fragments (the dequantization) serve 8 m16 tiles
// (255 registers on sm_90 and sm_120, none spilled; two blocks per SM by registers; Q4_K 4
// stages, 92 KiB; Q8_0 3 stages, 78 KiB). H200, 2026-12-05, 2048 x 18432 x 7168 Q4_K: 8 warps
// of 64 x 32 1.81 ms (46.2% of mma.sync; ncu: tensor pipe 48.8% active, a k step 370
// instructions a warp for 64 mma), 4 of 64 x 64 1.78 ms, 4 of 128 x 32 1.57 ms (53.3%; tensor
// pipe 57.9%, 472 instructions for 128 mma). Grouped (spans of ~16-32 rows): 32-row tiles,
// warps of 32 x 32 side by side along N (Q4_K 128 columns, 4 stages, 40 KiB, five blocks per
// SM; Q8_0 256 columns, 3 stages, 72 KiB). Grouped Q4_K lab (H200, DS3
// gate, 512 tokens x 8 of 256 experts): 3 stages / 4 blocks 1359 us, 256 columns or 64 x 32
// warps 7-15% slower, headers once per block 1251 us, then 4 stages / 5 blocks 1192 us (41%
// of copy on the experts' weights; ncu: L2 82% busy); an L2::128B prefetch hint: no change.
// Spans of 48 rows or more on average (2048 prompt tokens and more: ~64 an expert), Q4_K:
// 64-row tiles, 4 warps of 64 x 32 (each weight tile read once for 64 rows, not twice for 32;
// 186 registers with two blocks an SM, where three spilled; not timed yet).
#define MATMUL_CP_KERNEL(kname, qt, grouped, bm, bn, wm, wn, stages, minb)                     \
    extern "C" __global__ void __launch_bounds__(                                              \
        CpCfg<qt, bm, bn, wm, wn, stages>::THREADS, minb)                                       \
        kname(const u8* w, i64 row_bytes, const u16* xb, const int* row_ids, float* y,         \
              i64 y_stride, int M, int N, int K, const int* spans, i64 mat_stride,             \
              int tiles_m, int ksteps, float* part) {                                          \
        pdl_enter();                                                                           \
        matmul_cp_body<qt, grouped, bm, bn, wm, wn, stages>(                                   \
            w, row_bytes, xb, row_ids, y, y_stride, M, N, K, spans, mat_stride, tiles_m,       \
            ksteps, part);                                                                     \
    }

MATMUL_CP_KERNEL(matmul_cp_q4_k, Q4K_T, false, 128, 128, 128, 32, 4, 2)
MATMUL_CP_KERNEL(matmul_cp_q8_0, Q80_T, false, 128, 128, 128, 32, 3, 2)
MATMUL_CP_KERNEL(matmul_cp_spans_q4_k, Q4K_T, true, 32, 128, 32, 32, 4, 5)
MATMUL_CP_KERNEL(matmul_cp_spans64_q4_k, Q4K_T, true, 64, 128, 64, 32, 4, 2)
MATMUL_CP_KERNEL(matmul_cp_spans_q8_0, Q80_T, true, 32, 256, 32, 32, 3, 2)
