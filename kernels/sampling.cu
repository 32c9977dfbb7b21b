// Turning logits into a token on the GPU, so only one integer crosses the bus per step.
//
// argmax_row: out[0] = the index of the largest of x[0 .. n) (lowest on ties; 0 when no value
//   is larger than -inf, as for NaNs, so that the id always names a row of the embedding).
//   grid (ceil(n / ARGMAX_SPAN)), block ARGMAX_THREADS; work: [1 + 2 * grid] i32, zero
//   (work[0] counts the blocks in, and the last puts it back to 0).
//
// top_p_sample: one row of logits; p_i = exp((x_i - max) / temperature). The kept set is
//   {i : p_i >= thr} for the largest thr whose kept mass is at least top_p of the total (the
//   nucleus, as a threshold: equal to sorting and cutting, up to ties). The token is the first
//   kept index, in index order, at which the running kept mass reaches u times the kept mass
//   (u uniform in [0, 1), drawn on the host). probs: [n] scratch. grid (1), block 1024.

// Block argmax over (value, index) pairs; every thread gets the block's best pair.
__device__ void block_argmax(float* best, int* arg, float* sv, int* si) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    warp_argmax(best, arg);
    if (lane == 0) { sv[warp] = *best; si[warp] = *arg; }
    __syncthreads();
    *best = lane < nw ? sv[lane] : NEG_INF;
    *arg = lane < nw ? si[lane] : 1 << 30;
    warp_argmax(best, arg);
}

// A block per ARGMAX_SPAN values, every thread's loads issued at once: the logits' one pass
// is a single round trip (one block of 1024 threads walking 154880 values took ~150 dependent
// steps on the token's critical path). The last block in reduces the blocks' best pairs.
#define ARGMAX_THREADS 256
#define ARGMAX_PER_THREAD 16
#define ARGMAX_SPAN (ARGMAX_THREADS * ARGMAX_PER_THREAD)

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_row(const float* x, int n, int* work, int* out) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ int si[32];
    int first = blockIdx.x * ARGMAX_SPAN + threadIdx.x;
    float v[ARGMAX_PER_THREAD];
#pragma unroll
    for (int j = 0; j < ARGMAX_PER_THREAD; j++) {
        int i = first + j * ARGMAX_THREADS;
        v[j] = i < n ? x[i] : NEG_INF;
    }
    float best = NEG_INF;
    int arg = 1 << 30;
#pragma unroll
    for (int j = 0; j < ARGMAX_PER_THREAD; j++) argmax_pair(&best, &arg, v[j], first + j * ARGMAX_THREADS);
    block_argmax(&best, &arg, sv, si);
    if (threadIdx.x < 32) grid_argmax(best, arg, n, work, out);
}

// The kept mass for threshold bits `thr` (p >= thr, p positive floats compare as u32 bits).
__device__ float mass_at(const float* probs, int n, u32 thr, float* scratch) {
    float m = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (__float_as_uint(probs[i]) >= thr) m += probs[i];
    return block_sum(m, scratch);
}

extern "C" __global__ void __launch_bounds__(1024) top_p_sample(
    const float* x, int n, float temperature, float top_p, float u, float* probs, int* out) {
    pdl_enter();
    __shared__ float scratch[32];
    float mx = NEG_INF;
    for (int i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, x[i]);
    mx = block_max(mx, scratch);
    float z = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float p = expf((x[i] - mx) / temperature);
        probs[i] = p;
        z += p;
    }
    z = block_sum(z, scratch);  // its barrier also publishes probs
    float target = top_p * z;

    // Bisection on the bits of the threshold: mass(lo) >= target > mass(hi).
    u32 lo = 0, hi = __float_as_uint(1.0f) + 1;
    while (hi - lo > 1) {
        u32 mid = lo + (hi - lo) / 2;
        if (mass_at(probs, n, mid, scratch) >= target) lo = mid; else hi = mid;
    }
    float kept = mass_at(probs, n, lo, scratch);
    float goal = u * kept;

    // First kept index whose running mass reaches the goal, chunk by chunk in index order.
    float before = 0.0f;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int found = 1 << 30, last_kept = -1;
    for (int c0 = 0; c0 < n; c0 += blockDim.x) {
        int i = c0 + threadIdx.x;
        float v = (i < n && __float_as_uint(probs[i]) >= lo) ? probs[i] : 0.0f;
        if (v > 0.0f) last_kept = i;
        float incl = v;
        for (int o = 1; o < 32; o <<= 1) {
            float w = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += w;
        }
        if (lane == 31) scratch[warp] = incl;
        __syncthreads();
        float wbefore = 0.0f, total = 0.0f;
        for (int w = 0; w < 32; w++) {
            if (w < warp) wbefore += scratch[w];
            total += scratch[w];
        }
        __syncthreads();
        float run = before + wbefore + incl;
        int hit = (v > 0.0f && run >= goal) ? i : 1 << 30;
        found = min(found, hit);
        before += total;
    }
    // Smallest hit over the block; fall back to the last kept index (rounding at the end).
    __shared__ int best_found, best_last;
    if (threadIdx.x == 0) { best_found = 1 << 30; best_last = -1; }
    __syncthreads();
    atomicMin(&best_found, found);
    atomicMax(&best_last, last_kept);
    __syncthreads();
    if (threadIdx.x == 0) out[0] = best_found < n ? best_found : best_last;
}
