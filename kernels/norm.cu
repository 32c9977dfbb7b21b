// Row normalizations. One block per row; x and y may be the same buffer.
//
// rmsnorm: y = x / sqrt(mean(x^2) + eps) * w
// layernorm: y = (x - mean) / sqrt(var + eps) * w + b   (the DSA indexer's key norm)

extern "C" __global__ void rmsnorm(const float* x, i64 x_stride, const float* w, float* y,
                                   i64 y_stride, int n, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + blockIdx.x * x_stride;
    float* yr = y + blockIdx.x * y_stride;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, scratch);
    float inv = rsqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}

extern "C" __global__ void layernorm(const float* x, i64 x_stride, const float* w, const float* b,
                                     float* y, i64 y_stride, int n, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + blockIdx.x * x_stride;
    float* yr = y + blockIdx.x * y_stride;
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += xr[i];
    float mean = block_sum(s, scratch) / (float)n;
    float v = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) v += (xr[i] - mean) * (xr[i] - mean);
    float inv = rsqrtf(block_sum(v, scratch) / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = (xr[i] - mean) * inv * w[i] + b[i];
}
