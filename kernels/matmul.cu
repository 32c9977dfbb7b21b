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
// Tiles: 64 (M) x 64 (N) x 32 (K) per block of 4 warps; each warp owns a 32 x 32 corner.
//
// Grouped mode (the MoE prefill, one launch for all experts): spans != 0 points at
// gridDim.z triples (expert, first row r0, count). Block z multiplies matrix
// w + expert * mat_stride (bytes) for the global rows r0 .. r0 + count: local row m is global
// row r = r0 + m, read from X row row_ids ? row_ids[r] : r, written to Y row r. M is then
// unused (the grid's y covers the largest count); blocks past their span's count return at
// once. spans == 0: one matrix, rows 0 .. M, mat_stride unused.

#define MM_BM 64
#define MM_BN 64
#define MM_BK 32
#define MM_PAD 8  // bf16 elements of padding per shared row: fragment loads hit 32 banks

__device__ __forceinline__ void mma_bf16_16816(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <int ELEMS, int BYTES, void (*DQ8)(const u8*, int, float*), bool TRANS>
__device__ void matmul_body(const u8* w, i64 row_bytes, const float* x, i64 x_stride,
                            const int* row_ids, float* y, i64 y_stride, int M, int N, int K,
                            const int* spans, i64 mat_stride) {
    if (spans) {
        const int* sp = spans + 3 * blockIdx.z;
        int ex = sp[0], r0 = sp[1];
        M = sp[2];
        if ((int)blockIdx.y * MM_BM >= M) return;  // whole block: before any barrier
        w += (i64)ex * mat_stride;
        if (row_ids)
            row_ids += r0;
        else
            x += (i64)r0 * x_stride;
        y += (i64)r0 * y_stride;
    }
    // Tiles as bf16 pairs (u32), [row][k]; 64 x (32 + 8) bf16 each.
    __shared__ __align__(16) u16 xs[MM_BM][MM_BK + MM_PAD];
    __shared__ __align__(16) u16 ws[MM_BN][MM_BK + MM_PAD];

    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int m0 = blockIdx.y * MM_BM, n0 = blockIdx.x * MM_BN;
    int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;  // this warp's corner in the tile
    int g = lane >> 2, c = lane & 3;                    // mma fragment coordinates

    float acc[2][4][4];  // [m16 subtile][n8 subtile][fragment]
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    // X loader: thread -> (row tid / 2, 16 columns); W loader: two 8-element units.
    int xr = tid >> 1, xc = (tid & 1) * 16;
    const float* xrow = nullptr;
    if (m0 + xr < M) {
        i64 src = row_ids ? row_ids[m0 + xr] : m0 + xr;
        xrow = x + src * x_stride;
    }
    for (int k0 = 0; k0 < K; k0 += MM_BK) {
        // X tile -> bf16.
        u32* xdst = (u32*)&xs[xr][xc];
        if (xrow) {
            const float4* p = (const float4*)(xrow + k0 + xc);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float4 v = p[i];
                xdst[2 * i] = pack_bf16x2(v.x, v.y);
                xdst[2 * i + 1] = pack_bf16x2(v.z, v.w);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) xdst[i] = 0;
        }
        // W tile: dequantize 8-element units straight into bf16.
#pragma unroll
        for (int s = 0; s < 2 && TRANS; s++) {
            int unit = tid + 128 * s;  // 256 units: 32 rows (k) x 8 units (n)
            int kk = unit >> 3, nn = (unit & 7) * 8;
            float v[8];
            if (k0 + kk < K && n0 + nn < N) {
                int e = n0 + nn;
                DQ8(w + (i64)(k0 + kk) * row_bytes + (i64)(e / ELEMS) * BYTES, (e % ELEMS) / 8, v);
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++) v[i] = 0.0f;
            }
#pragma unroll
            for (int i = 0; i < 8; i++) ws[nn + i][kk] = (u16)(pack_bf16x2(v[i], 0.0f) & 0xffff);
        }
#pragma unroll
        for (int s = 0; s < 2 && !TRANS; s++) {
            int unit = tid + 128 * s;  // 256 units: 64 rows x 4 units
            int n = unit >> 2, kk = (unit & 3) * 8;
            u32* wdst = (u32*)&ws[n][kk];
            if (n0 + n < N) {
                int e = k0 + kk;
                float v[8];
                DQ8(w + (i64)(n0 + n) * row_bytes + (i64)(e / ELEMS) * BYTES,
                    (e % ELEMS) / 8, v);
#pragma unroll
                for (int i = 0; i < 4; i++) wdst[i] = pack_bf16x2(v[2 * i], v[2 * i + 1]);
            } else {
#pragma unroll
                for (int i = 0; i < 4; i++) wdst[i] = 0;
            }
        }
        __syncthreads();

#pragma unroll
        for (int kk = 0; kk < MM_BK; kk += 16) {
            u32 a[2][4], b[4][2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                int r = wm + 16 * i + g;
                a[i][0] = *(const u32*)&xs[r][kk + 2 * c];
                a[i][1] = *(const u32*)&xs[r + 8][kk + 2 * c];
                a[i][2] = *(const u32*)&xs[r][kk + 2 * c + 8];
                a[i][3] = *(const u32*)&xs[r + 8][kk + 2 * c + 8];
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int n = wn + 8 * j + g;
                b[j][0] = *(const u32*)&ws[n][kk + 2 * c];
                b[j][1] = *(const u32*)&ws[n][kk + 2 * c + 8];
            }
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) mma_bf16_16816(acc[i][j], a[i], b[j]);
        }
        __syncthreads();
    }

    // C fragment: (row g, cols 2c, 2c+1) and (row g + 8, same cols).
#pragma unroll
    for (int i = 0; i < 2; i++)
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

#define DEFINE_MATMUL(name, elems, bytes)                                                     \
    extern "C" __global__ void __launch_bounds__(128) matmul_##name(                          \
        const u8* w, i64 row_bytes, const float* x, i64 x_stride, const int* row_ids, float* y, \
        i64 y_stride, int M, int N, int K, const int* spans, i64 mat_stride) {                \
        matmul_body<elems, bytes, dq8_##name, false>(w, row_bytes, x, x_stride, row_ids, y,   \
                                                     y_stride, M, N, K, spans, mat_stride);   \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) matmul_t_##name(                        \
        const u8* w, i64 row_bytes, const float* x, i64 x_stride, const int* row_ids, float* y, \
        i64 y_stride, int M, int N, int K, const int* spans, i64 mat_stride) {                \
        matmul_body<elems, bytes, dq8_##name, true>(w, row_bytes, x, x_stride, row_ids, y,    \
                                                    y_stride, M, N, K, spans, mat_stride);    \
    }

FOR_EACH_QTYPE(DEFINE_MATMUL)
