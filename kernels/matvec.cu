// Quantized matrix-vector products (decode) and embedding rows. Needs quant.cuh.
//
// matvec_<type>: for each batch item b (grid.y), y_b[r] = sum_k W_b[r, k] * x_b[k], where
//   W_b = w + m * mat_stride bytes, m = ids ? ids[b] : b   (the expert, head or 0)
//   x_b = x + (b / x_group) * x_stride                    (shared or per-item input)
//   y_b = y + b * y_stride
// W rows are `row_bytes` apart and `k` elements long (a whole number of blocks). One warp per
// row; the lanes walk the row in 8-element units, so consecutive lanes read consecutive bytes.

#define MATVEC_WARPS 8

template <int ELEMS, int BYTES, void (*DQ8)(const u8*, int, float*)>
__device__ void matvec_body(const u8* w, i64 mat_stride, const int* ids, int rows, int k,
                            i64 row_bytes, const float* x, int x_group, i64 x_stride, float* y,
                            i64 y_stride) {
    int b = blockIdx.y;
    int r = blockIdx.x * MATVEC_WARPS + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (r >= rows) return;
    i64 m = ids ? ids[b] : b;
    const u8* row = w + m * mat_stride + r * row_bytes;
    const float* xb = x + (i64)(b / x_group) * x_stride;
    const int units_per_block = ELEMS / 8;
    float sum = 0.0f;
    for (int u = lane; u < k / 8; u += 32) {
        float wv[8];
        DQ8(row + (i64)(u / units_per_block) * BYTES, u % units_per_block, wv);
        const float4* xp = (const float4*)(xb + 8 * u);
        float4 x0 = xp[0], x1 = xp[1];
        sum += wv[0] * x0.x + wv[1] * x0.y + wv[2] * x0.z + wv[3] * x0.w;
        sum += wv[4] * x1.x + wv[5] * x1.y + wv[6] * x1.z + wv[7] * x1.w;
    }
    sum = warp_sum(sum);
    if (lane == 0) y[b * y_stride + r] = sum;
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

// embed_<type>: y[t, :] = the dequantized row ids[t] of w (n elements per row).
template <int ELEMS, int BYTES, void (*DQ8)(const u8*, int, float*)>
__device__ void embed_body(const u8* w, i64 row_bytes, const int* ids, int n, float* y) {
    int t = blockIdx.x;
    const u8* row = w + (i64)ids[t] * row_bytes;
    const int units_per_block = ELEMS / 8;
    for (int u = threadIdx.x; u < n / 8; u += blockDim.x) {
        float v[8];
        DQ8(row + (i64)(u / units_per_block) * BYTES, u % units_per_block, v);
        float4* out = (float4*)(y + (i64)t * n + 8 * u);
        out[0] = make_float4(v[0], v[1], v[2], v[3]);
        out[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

#define DEFINE_MATVEC(name, elems, bytes)                                                    \
    extern "C" __global__ void __launch_bounds__(32 * MATVEC_WARPS) matvec_##name(           \
        const u8* w, i64 mat_stride, const int* ids, int rows, int k, i64 row_bytes,         \
        const float* x, int x_group, i64 x_stride, float* y, i64 y_stride) {                 \
        matvec_body<elems, bytes, dq8_##name>(w, mat_stride, ids, rows, k, row_bytes, x,     \
                                              x_group, x_stride, y, y_stride);               \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) matvec_t_##name(                       \
        const u8* w, i64 mat_stride, const int* ids, int rows, int k, i64 row_bytes,         \
        const float* x, int x_group, i64 x_stride, float* y, i64 y_stride) {                 \
        matvec_t_body<elems, bytes, dq8_##name>(w, mat_stride, ids, rows, k, row_bytes, x,   \
                                                x_group, x_stride, y, y_stride);             \
    }                                                                                        \
    extern "C" __global__ void embed_##name(const u8* w, i64 row_bytes, const int* ids, int n, \
                                            float* y) {                                      \
        embed_body<elems, bytes, dq8_##name>(w, row_bytes, ids, n, y);                       \
    }

FOR_EACH_QTYPE(DEFINE_MATVEC)
