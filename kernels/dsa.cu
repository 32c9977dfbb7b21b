// DSA (DeepSeek sparse attention) lightning indexer: which keys each query may attend to.
//
// dsa_scores: scores[t, s] = sum_h w[t, h] * relu(scale * q[t, h, :] . k[s, :]) for s <= pos0 + t,
//   -inf for later keys. q: [T, heads, dim], k: [S, dim] (the indexer key cache, one head),
//   w: [T, heads] (the head weights), scores: [T, s_stride].
//   grid (ceil(S / 128), T), block 128: one key per thread, the query in shared memory.
//   heads * dim <= 8192.
//
// topk_rows: for each row t, the positions of the k largest of scores[t, 0 .. n_valid(t)),
//   n_valid(t) = pos0 + t + 1, ascending, -1 padded (all valid positions when there are at most
//   k). Equal scores at the boundary are taken lowest position first. One block of 256 threads
//   per row: a 4-pass radix select on the order-preserving u32 image of the scores finds the
//   k-th largest value, then a block scan writes the selected positions in order.

extern "C" __global__ void dsa_scores(const float* q, const float* k, const float* w, int heads,
                                      int dim, int S, int pos0, float scale, float* scores,
                                      i64 s_stride) {
    __shared__ float qs[8192];
    __shared__ float ws[64];
    int t = blockIdx.y, s = blockIdx.x * blockDim.x + threadIdx.x;
    for (int i = threadIdx.x; i < heads * dim; i += blockDim.x) qs[i] = q[(i64)t * heads * dim + i];
    for (int i = threadIdx.x; i < heads; i += blockDim.x) ws[i] = w[(i64)t * heads + i];
    __syncthreads();
    if (s >= S) return;
    float total = NEG_INF;
    if (s <= pos0 + t) {
        const float* kr = k + (i64)s * dim;
        total = 0.0f;
        for (int h = 0; h < heads; h++) {
            const float* qr = qs + h * dim;
            float dot = 0.0f;
            for (int d = 0; d < dim; d++) dot += qr[d] * kr[d];
            total += ws[h] * fmaxf(scale * dot, 0.0f);
        }
    }
    scores[(i64)t * s_stride + s] = total;
}

// Larger float <=> larger key; -inf is the smallest non-NaN key.
__device__ __forceinline__ u32 order_key(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Exclusive prefix sum over the block of 256 threads; *total gets the block's sum.
__device__ int block_scan_256(int v, int* scratch, int* total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = v;
    for (int o = 1; o < 32; o <<= 1) {
        int n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    int before = 0, sum = 0;
    for (int i = 0; i < 8; i++) {
        if (i < warp) before += scratch[i];
        sum += scratch[i];
    }
    __syncthreads();
    *total = sum;
    return before + incl - v;
}

extern "C" __global__ void __launch_bounds__(256) topk_rows(const float* scores, i64 s_stride,
                                                            int pos0, int k, int* out) {
    __shared__ int hist[256];
    __shared__ int scratch[2][8];
    __shared__ u32 sel_prefix;
    __shared__ int sel_remaining;
    int t = blockIdx.x, tid = threadIdx.x;
    int n = pos0 + t + 1;
    const float* row = scores + (i64)t * s_stride;
    int* orow = out + (i64)t * k;

    if (n <= k) {
        for (int i = tid; i < k; i += blockDim.x) orow[i] = i < n ? i : -1;
        return;
    }

    // Radix select, 8 bits a pass from the top: find the key of the k-th largest score.
    u32 prefix = 0, mask = 0;
    int remaining = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        hist[tid] = 0;
        __syncthreads();
        for (int i = tid; i < n; i += blockDim.x) {
            u32 key = order_key(row[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1);
        }
        __syncthreads();
        if (tid == 0) {
            int cum = 0, digit = 255;
            for (; digit > 0; digit--) {
                if (cum + hist[digit] >= remaining) break;
                cum += hist[digit];
            }
            sel_prefix = prefix | ((u32)digit << shift);
            sel_remaining = remaining - cum;
        }
        __syncthreads();
        prefix = sel_prefix;
        remaining = sel_remaining;
        mask |= 255u << shift;
    }
    // Now: keys > prefix are all taken, and the first `remaining` keys == prefix.
    int gt_before = 0, eq_before = 0;
    for (int c0 = 0; c0 < n; c0 += blockDim.x) {
        int i = c0 + tid;
        u32 key = i < n ? order_key(row[i]) : 0;
        int gt = i < n && key > prefix, eq = i < n && key == prefix;
        int gt_total, eq_total;
        int gt_pos = block_scan_256(gt, scratch[0], &gt_total);
        int eq_pos = block_scan_256(eq, scratch[1], &eq_total);
        int g = gt_before + gt_pos, e = eq_before + eq_pos;
        if (gt || (eq && e < remaining)) orow[g + min(e, remaining)] = i;
        gt_before += gt_total;
        eq_before += eq_total;
    }
}
