// Element-wise operations over n contiguous f32 values.

// out = silu(gate) * up. out may alias gate or up.
extern "C" __global__ void silu_mul(const float* gate, const float* up, float* out, i64 n) {
    pdl_enter();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = silu(gate[i]) * up[i];
    }
}

// acc += x (the residual stream).
extern "C" __global__ void add_inplace(float* acc, const float* x, i64 n) {
    pdl_enter();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) acc[i] += x[i];
}

// Copies a block of rows x heads x cols floats between strided layouts: element (r, h, c) goes
// from src[r * src_row + h * src_head + c] to dst[r * dst_row + h * dst_head + c]. Slices,
// per-head column selections and cache appends. grid (rows, heads, ceil(cols / COPY_COLS)),
// block 128: a block copies COPY_COLS columns, every load before the first store (src and dst
// may alias as far as the compiler knows, which would otherwise serialize load and store).

#define COPY_VALS 4
#define COPY_COLS (128 * COPY_VALS)

extern "C" __global__ void __launch_bounds__(128) copy_block(
    const float* src, i64 src_row, i64 src_head, float* dst, i64 dst_row, i64 dst_head, int cols) {
    pdl_enter();
    const float* s = src + blockIdx.x * src_row + blockIdx.y * src_head;
    float* d = dst + blockIdx.x * dst_row + blockIdx.y * dst_head;
    int c0 = blockIdx.z * COPY_COLS + threadIdx.x;
    float v[COPY_VALS];
#pragma unroll
    for (int k = 0; k < COPY_VALS; k++) {
        int c = c0 + 128 * k;
        v[k] = c < cols ? s[c] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < COPY_VALS; k++) {
        int c = c0 + 128 * k;
        if (c < cols) d[c] = v[k];
    }
}
