// Mixture of experts: the router's expert choice, and the weighted sum of expert outputs.
//
// moe_router: one block of ROUTER_THREADS per token, logits [T, n_exp] (the router matvec's
//   output). gating 1 (softmax, DeepSeek-V2): s = softmax(logits); gating 2 (sigmoid, V3 /
//   GLM-5): s = sigmoid(logits). choice = s + bias (bias may be null; it steers selection
//   only). With n_group > 1, a group's score is its largest choice (softmax: V2's
//   group-limited greedy) or the sum of its two largest (sigmoid: V3's noaux_tc); the top
//   group_used groups survive and the other experts are out (-inf, never 0). The k experts of
//   largest choice are taken in descending order (ties: lowest id); their weights are the
//   unbiased s, divided by their sum when `norm`, times `scale`.
//   ids [T, k] (i32), weights [T, k]. n_exp <= 1024, n_group <= 32, k <= 32. With `shared`,
//   rows of k + 1: the last choice is the shared expert (id MOE_SHARED = -2, weight 1), which
//   the expert products then run with the routed ones (matvec_tc_q4_k's sw, moe_combine).
//   Tensor parallelism: a rank holds experts held_lo .. held_hi - 1 (all at TP = 1); its ids
//   count from held_lo, and a choice held elsewhere gets id -1 and weight 0 (its output arrives
//   through the all-reduce; the normalization above still counts it).
//
//   Selection by rank, not by k rounds of argmax: each thread counts, for its experts, the
//   experts that come before them (larger choice, or equal and lower id, in the total order of
//   float_key), and the one of rank j < k is choice j. All experts at once, no serial rounds
//   of warp reductions (one warp doing k of them took ~10 us per decode token on an H200).
// moe_combine: out[t, :] = sum_j weights[t, j] * rows[slots[t, j], :] (slots < 0 skipped);
//   rows are the expert outputs, one per (token, choice), in any order. A weight of 0 adds
//   nothing, so its row is not read (a choice held by another rank has no row here).
//   grid (ceil(dim / 256), T), block 256: one output value per thread.

#define ROUTER_MAX_EXP 1024
#define ROUTER_THREADS 256

// f's bits as an int that orders like f (Rust's f32::total_cmp): -0 < +0, NaN at the ends.
__device__ __forceinline__ int float_key(float f) {
    int b = __float_as_int(f);
    return b ^ ((b >> 31) & 0x7FFFFFFF);
}

// How many of `keys[0, n)` (16-byte aligned) come before key `kv` of entry `v`: larger, or
// equal and lower index. Four keys per shared-memory load, several loads in flight.
__device__ __forceinline__ int before(int ku, int u, int kv, int v) {
    return (ku > kv) | ((ku == kv) & (u < v));
}
__device__ __forceinline__ int rank_of(const int* keys, int n, int kv, int v) {
    int r = 0, u = 0;
#pragma unroll 4
    for (; u + 4 <= n; u += 4) {
        int4 k4 = *(const int4*)(keys + u);
        r += before(k4.x, u, kv, v) + before(k4.y, u + 1, kv, v) + before(k4.z, u + 2, kv, v) +
             before(k4.w, u + 3, kv, v);
    }
    for (; u < n; u++) r += before(keys[u], u, kv, v);
    return r;
}

extern "C" __global__ void __launch_bounds__(ROUTER_THREADS) moe_router(
    const float* logits, const float* bias, int n_exp, int k, int gating, int n_group,
    int group_used, int norm, float scale, int held_lo, int held_hi, int shared, int* ids,
    float* weights) {
    pdl_enter();
    __shared__ float s[ROUTER_MAX_EXP], scratch[32];
    __shared__ __align__(16) int key[ROUTER_MAX_EXP], group_key[32];
    __shared__ int chosen[32];
    int t = blockIdx.x, tid = threadIdx.x;
    const float* lg = logits + (i64)t * n_exp;

    if (gating == 1) {
        float mx = NEG_INF;
        for (int e = tid; e < n_exp; e += blockDim.x) mx = fmaxf(mx, lg[e]);
        mx = block_max(mx, scratch);
        float sum = 0.0f;
        for (int e = tid; e < n_exp; e += blockDim.x) sum += expf(lg[e] - mx);
        sum = block_sum(sum, scratch);
        for (int e = tid; e < n_exp; e += blockDim.x) s[e] = expf(lg[e] - mx) / sum;
    } else {
        for (int e = tid; e < n_exp; e += blockDim.x) s[e] = 1.0f / (1.0f + expf(-lg[e]));
    }
    for (int e = tid; e < n_exp; e += blockDim.x)
        key[e] = float_key(s[e] + (bias ? bias[e] : 0.0f));
    __syncthreads();

    if (n_group > 1) {
        int per = n_exp / n_group;
        if (tid < n_group) {
            float a = NEG_INF, b = NEG_INF;  // the group's two largest choices
            for (int e = tid * per; e < (tid + 1) * per; e++) {
                float c = s[e] + (bias ? bias[e] : 0.0f);
                if (c > a) {
                    b = a;
                    a = c;
                } else if (c > b) {
                    b = c;
                }
            }
            group_key[tid] = float_key(gating == 1 ? a : a + b);
        }
        __syncthreads();
        for (int e = tid; e < n_exp; e += blockDim.x) {
            int g = e / per;
            if (rank_of(group_key, n_group, group_key[g], g) >= group_used)
                key[e] = float_key(NEG_INF);
        }
        __syncthreads();
    }

    for (int e = tid; e < n_exp; e += blockDim.x) {
        int r = rank_of(key, n_exp, key[e], e);
        if (r < k) chosen[r] = e;
    }
    __syncthreads();
    // k <= 32: lane j of the first warp finishes choice j.
    int row = k + (shared ? 1 : 0);
    if (tid < 32) {
        int e = tid < k ? chosen[tid] : 0;
        float wj = tid < k ? s[e] : 0.0f;
        float wsum = warp_sum(wj);
        if (tid < k) {
            bool held = e >= held_lo && e < held_hi;
            ids[(i64)t * row + tid] = held ? e - held_lo : -1;
            weights[(i64)t * row + tid] = held ? (norm ? wj / wsum : wj) * scale : 0.0f;
        } else if (tid == k && shared) {
            ids[(i64)t * row + k] = MOE_SHARED;
            weights[(i64)t * row + k] = 1.0f;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) moe_combine(
    const float* rows, const int* slots, const float* weights, int k, int dim, float* out) {
    pdl_enter();
    int t = blockIdx.y, d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= dim) return;
    const float* wt = weights + (i64)t * k;
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        int r = slots ? slots[(i64)t * k + j] : t * k + j;
        if (r >= 0 && wt[j] != 0.0f) sum += wt[j] * rows[(i64)r * dim + d];
    }
    out[(i64)t * dim + d] = sum;
}
