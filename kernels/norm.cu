// Row normalizations. One block per row; x and y may be the same buffer.
//
// rmsnorm: y = x / sqrt(mean(x^2) + eps) * w
// layernorm: y = (x - mean) / sqrt(var + eps) * w + b   (the DSA indexer's key norm)
//
// Thread i holds values i, i + blockDim.x, ... of its row in registers (at most NORM_VALS;
// the launch picks blockDim.x >= n / NORM_VALS, n <= 8192), so x, w and b are read once, every
// load of a thread issued before the first use: a decode row is one block on one SM, and its
// time is the memory latency, paid once rather than once per value.

#define NORM_VALS 8

extern "C" __global__ void __launch_bounds__(1024) rmsnorm(const float* x, i64 x_stride,
                                                           const float* w, float* y,
                                                           i64 y_stride, int n, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + blockIdx.x * x_stride;
    float* yr = y + blockIdx.x * y_stride;
    float v[NORM_VALS], wv[NORM_VALS];
#pragma unroll
    for (int k = 0; k < NORM_VALS; k++) {
        int i = threadIdx.x + k * blockDim.x;
        v[k] = i < n ? xr[i] : 0.0f;
        wv[k] = i < n ? w[i] : 0.0f;
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_VALS; k++) ss += v[k] * v[k];
    ss = block_sum(ss, scratch);
    float inv = rsqrtf(ss / (float)n + eps);
#pragma unroll
    for (int k = 0; k < NORM_VALS; k++) {
        int i = threadIdx.x + k * blockDim.x;
        if (i < n) yr[i] = v[k] * inv * wv[k];
    }
}

extern "C" __global__ void __launch_bounds__(1024) layernorm(const float* x, i64 x_stride,
                                                             const float* w, const float* b,
                                                             float* y, i64 y_stride, int n,
                                                             float eps) {
    __shared__ float scratch[32];
    const float* xr = x + blockIdx.x * x_stride;
    float* yr = y + blockIdx.x * y_stride;
    float v[NORM_VALS], wv[NORM_VALS], bv[NORM_VALS];
#pragma unroll
    for (int k = 0; k < NORM_VALS; k++) {
        int i = threadIdx.x + k * blockDim.x;
        v[k] = i < n ? xr[i] : 0.0f;
        wv[k] = i < n ? w[i] : 0.0f;
        bv[k] = i < n ? b[i] : 0.0f;
    }
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_VALS; k++) s += v[k];
    float mean = block_sum(s, scratch) / (float)n;
    float var = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_VALS; k++) {
        int i = threadIdx.x + k * blockDim.x;
        float c = v[k] - mean;
        if (i < n) var += c * c;
    }
    float inv = rsqrtf(block_sum(var, scratch) / (float)n + eps);
#pragma unroll
    for (int k = 0; k < NORM_VALS; k++) {
        int i = threadIdx.x + k * blockDim.x;
        if (i < n) yr[i] = (v[k] - mean) * inv * wv[k] + bv[k];
    }
}
