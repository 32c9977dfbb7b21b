// Element-wise operations over n contiguous f32 values.

// out = silu(gate) * up, silu(g) = g / (1 + exp(-g)). out may alias gate or up.
extern "C" __global__ void silu_mul(const float* gate, const float* up, float* out, i64 n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// acc += x (the residual stream).
extern "C" __global__ void add_inplace(float* acc, const float* x, i64 n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) acc[i] += x[i];
}

// Copies a block of rows x heads x cols floats between strided layouts: element (r, h, c) goes
// from src[r * src_row + h * src_head + c] to dst[r * dst_row + h * dst_head + c]. Slices,
// per-head column selections and cache appends. grid (rows, heads), block 128.
extern "C" __global__ void copy_block(const float* src, i64 src_row, i64 src_head, float* dst,
                                      i64 dst_row, i64 dst_head, int cols) {
    const float* s = src + blockIdx.x * src_row + blockIdx.y * src_head;
    float* d = dst + blockIdx.x * dst_row + blockIdx.y * dst_head;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) d[c] = s[c];
}
