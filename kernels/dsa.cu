// DSA (DeepSeek sparse attention) lightning indexer: which keys each query may attend to.
//
// dsa_scores: scores[t, s] = sum_h w[t, h] * relu(scale * q[t, h, :] . k[s, :]) for s <= pos0 + t,
//   -inf for later keys. q: [T, heads, dim], k: [S, dim] (the indexer key cache, one head),
//   w: [T, heads] (the head weights), scores: [T, s_stride].
//   grid (ceil(S / 32), T), block 128: a block scores 32 keys, lane l of every warp key l of
//   the tile; warp w takes heads 8w .. 8w + 7, then 8w + 32 .., and the 4 warps' sums are
//   added at the end. Dynamic shared memory dsa_scores_smem_bytes(): the token's query
//   [heads][dim] and the key tile [32][dim + 4] (row padding: conflict-free float4 reads).
//   heads <= 64, heads * dim <= 8192, dim % 4 == 0, dim <= 256; k 16-byte aligned.
//
// topk_rows: for each row t, the positions of the k largest of scores[t, 0 .. n_valid(t)),
//   n_valid(t) = pos0 + t + 1, ascending, -1 padded (all valid positions when there are at most
//   k). Equal scores at the boundary are taken lowest position first. One block of 256 threads
//   per row: a 4-pass radix select on the order-preserving u32 image of the scores finds the
//   k-th largest value, then a block scan writes the selected positions in order.

#define DSA_KEYS 32
#define DSA_HC 8  // heads per warp pass

extern "C" __global__ void __launch_bounds__(128) dsa_scores(
    const float* q, const float* k, const float* w, int heads, int dim, int S, int pos0,
    float scale, float* scores, i64 s_stride) {
    pdl_enter();
    extern __shared__ __align__(16) float dsmem[];
    __shared__ float ws[64];
    __shared__ float part[4][DSA_KEYS];
    const int dim4 = dim / 4, kstride = dim + 4;
    float* qs = dsmem;                 // [heads][dim]
    float* ks = dsmem + heads * dim;   // [DSA_KEYS][dim + 4]
    int t = blockIdx.y, s0 = blockIdx.x * DSA_KEYS, tid = threadIdx.x;
    int lane = tid & 31, warp = tid >> 5;

    const float4* q4 = (const float4*)(q + (i64)t * heads * dim);
    for (int i = tid; i < heads * dim4; i += blockDim.x) ((float4*)qs)[i] = q4[i];
    for (int i = tid; i < heads; i += blockDim.x) ws[i] = w[(i64)t * heads + i];
    for (int i = tid; i < DSA_KEYS * dim4; i += blockDim.x) {
        int r = i / dim4, c = i - r * dim4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (s0 + r < S) v = __ldg((const float4*)(k + (i64)(s0 + r) * dim) + c);
        *(float4*)(ks + r * kstride + 4 * c) = v;
    }
    __syncthreads();

    const float4* kr = (const float4*)(ks + lane * kstride);
    float total = 0.0f;
    for (int hc = warp * DSA_HC; hc < heads; hc += 4 * DSA_HC) {
        float dot[DSA_HC];
        int qrow[DSA_HC];  // float4 offset of each head's query row (past heads: unused)
#pragma unroll
        for (int e = 0; e < DSA_HC; e++) {
            dot[e] = 0.0f;
            qrow[e] = min(hc + e, heads - 1) * dim4;
        }
        const float4* q4s = (const float4*)qs;
        for (int d4 = 0; d4 < dim4; d4++) {
            float4 kv = kr[d4];
#pragma unroll
            for (int e = 0; e < DSA_HC; e++) {
                float4 qv = q4s[qrow[e] + d4];  // the same address in every lane: a broadcast
                dot[e] += qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
            }
        }
#pragma unroll
        for (int e = 0; e < DSA_HC; e++)
            if (hc + e < heads) total += ws[hc + e] * fmaxf(scale * dot[e], 0.0f);
    }
    part[warp][lane] = total;
    __syncthreads();
    if (warp == 0) {
        int s = s0 + lane;
        float sum = part[0][lane] + part[1][lane] + part[2][lane] + part[3][lane];
        if (s < S) scores[(i64)t * s_stride + s] = s <= pos0 + t ? sum : NEG_INF;
    }
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
    pdl_enter();
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
