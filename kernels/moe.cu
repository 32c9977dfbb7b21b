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
// moe_route_f32: the router product of an f32 router and moe_router in one launch (decode):
//   block e of token t computes logit e = router row e . x_t into logits [T, n_exp]; the last
//   block of token t to finish routes it. grid (n_exp, T), block ROUTER_THREADS; x rows and
//   router rows of dim % 4 == 0 values, 16-byte aligned; `done` [T] ints, zero before the
//   launch and after it (the routing block resets its token's).
//
//   Selection by rank, not by k rounds of argmax: each thread counts, for its experts, the
//   experts that come before them (larger choice, or equal and lower id, in the total order of
//   float_key), and the one of rank j < k is choice j. All experts at once, no serial rounds
//   of warp reductions (one warp doing k of them took ~10 us per decode token on an H200).
//   Only candidates are ranked, against each other: the experts at or above the k-th largest
//   of 32 chunks' maxima, which hold the top k and whatever comes before any of them (about 9
//   of 256 for independent random logits, by simulation, not 256 against 256). A group's two
//   best are a shuffle reduction over the lanes sharing it.
// moe_combine: out[t, :] = sum_j weights[t, j] * rows[slots[t, j], :] (slots < 0 skipped);
//   rows are the expert outputs, one per (token, choice), in any order. A weight of 0 adds
//   nothing, so its row is not read (a choice held by another rank has no row here).
//   grid (ceil(dim / 256), T), block 256: one output value per thread.

#define ROUTER_MAX_EXP 1024
#define ROUTER_THREADS 256
#define ROUTE_VALS 8
#define KEY_MIN ((int)0x80000000)  // below every float_key

// f's bits as an int that orders like f (Rust's f32::total_cmp): -0 < +0, NaN at the ends.
// Its own inverse.
__device__ __forceinline__ int float_key(float f) {
    int b = __float_as_int(f);
    return b ^ ((b >> 31) & 0x7FFFFFFF);
}
__device__ __forceinline__ float key_float(int k) {
    return __int_as_float(float_key(__int_as_float(k)));
}

// How many of `keys[from, from + n)` (keys + from 16-byte aligned) come before key `kv` of
// entry `v`: larger, or equal and lower index. Four keys per shared-memory load, several
// loads in flight.
__device__ __forceinline__ int before(int ku, int u, int kv, int v) {
    return (ku > kv) | ((ku == kv) & (u < v));
}
__device__ __forceinline__ int rank_of(const int* keys, int from, int n, int kv, int v) {
    int r = 0, u = from, end = from + n;
#pragma unroll 4
    for (; u + 4 <= end; u += 4) {
        int4 k4 = *(const int4*)(keys + u);
        r += before(k4.x, u, kv, v) + before(k4.y, u + 1, kv, v) + before(k4.z, u + 2, kv, v) +
             before(k4.w, u + 3, kv, v);
    }
    for (; u < end; u++) r += before(keys[u], u, kv, v);
    return r;
}

// The choice of one token from its logits `lg` [n_exp] (read through L2: in moe_route_f32
// other blocks wrote them), by the whole block (ROUTER_THREADS); outputs at ids, weights.
__device__ void route_token(const float* lg, const float* bias, int n_exp, int k, int gating,
                            int n_group, int group_used, int norm, float scale, int held_lo,
                            int held_hi, int shared, int* ids, float* weights) {
    __shared__ float s[ROUTER_MAX_EXP], scratch[32];
    __shared__ __align__(16) int key[ROUTER_MAX_EXP], group_key[32];
    __shared__ __align__(16) int chunk_max[32];
    __shared__ int2 cand[ROUTER_MAX_EXP];
    __shared__ int kept[32], chosen[32], n_cand;
    const int tid = threadIdx.x, lane = tid % 32;
    const int NEG_KEY = float_key(NEG_INF);
    if (tid == 0) n_cand = 0;

    float mx = 0.0f, sum = 1.0f;  // softmax's max and sum
    if (gating == 1) {
        mx = NEG_INF;
        for (int e = tid; e < n_exp; e += blockDim.x) mx = fmaxf(mx, __ldcg(lg + e));
        mx = block_max(mx, scratch);
        sum = 0.0f;
        for (int e = tid; e < n_exp; e += blockDim.x) sum += expf(__ldcg(lg + e) - mx);
        sum = block_sum(sum, scratch);
    }
    for (int e = tid; e < n_exp; e += blockDim.x) {
        float l = __ldcg(lg + e), b = bias ? __ldg(bias + e) : 0.0f;  // both loads at once
        float se = gating == 1 ? expf(l - mx) / sum : 1.0f / (1.0f + expf(-l));
        s[e] = se;
        key[e] = float_key(se + b);
    }
    __syncthreads();

    // Kept groups: kept[0 .. n_kept) their ids (all experts as one group without groups).
    int per = n_exp, n_kept = 1;
    if (n_group > 1) {
        per = n_exp / n_group;
        // L lanes per group (a power of two, dividing 32): each keeps the two best of its
        // experts, then the lanes merge theirs.
        const int L = n_group <= 8 ? 32 : n_group <= 16 ? 16 : 8;
        const int g = tid / L;
        int a = NEG_KEY, b = NEG_KEY;  // a >= b
        if (g < n_group) {
            for (int j = tid % L; j < per; j += L) {
                int c = key[g * per + j];
                b = max(b, min(a, c));
                a = max(a, c);
            }
        }
        for (int o = L / 2; o > 0; o >>= 1) {
            int a2 = __shfl_xor_sync(0xffffffffu, a, o), b2 = __shfl_xor_sync(0xffffffffu, b, o);
            b = max(max(b, b2), min(a, a2));
            a = max(a, a2);
        }
        if (g < n_group && tid % L == 0)
            group_key[g] = float_key(gating == 1 ? key_float(a) : key_float(a) + key_float(b));
        __syncthreads();
        if (tid < n_group) {
            int r = rank_of(group_key, 0, n_group, group_key[tid], tid);
            if (r < group_used) kept[r] = tid;  // kept in order of score (any order would do)
        }
        __syncthreads();
        n_kept = min(group_used, n_group);
        for (int e = tid; e < n_exp; e += blockDim.x) {
            int gr = e / per;
            bool in = false;
            for (int i = 0; i < n_kept; i++) in |= kept[i] == gr;
            if (!in) key[e] = NEG_KEY;
        }
    }
    // The top k are among the candidates, the experts at or above T: the k-th largest of the
    // maxima of 32 disjoint chunks of experts (8 threads' each; k <= 32). At least k experts
    // are at or above T, so one below it comes after k others; and whatever comes before a
    // candidate is one too, so its rank among the candidates is its rank among all. A thread
    // masked its own experts above, so it needs no barrier before their maximum.
    static_assert(ROUTER_THREADS / 8 == 32, "32 chunks of 8 threads");
    int mk = KEY_MIN;
    for (int e = tid; e < n_exp; e += blockDim.x) mk = max(mk, key[e]);
    for (int o = 1; o < 8; o <<= 1) mk = max(mk, __shfl_xor_sync(0xffffffffu, mk, o));
    if (lane % 8 == 0) chunk_max[tid / 8] = mk;
    __syncthreads();
    // Every warp finds T itself (the lane whose chunk ranks k - 1): no barrier more.
    const int cm = chunk_max[lane];
    const u32 kth = __ballot_sync(0xffffffffu, rank_of(chunk_max, 0, 32, cm, lane) == k - 1);
    const int T = __shfl_sync(0xffffffffu, cm, __ffs(kth) - 1);
    for (int e0 = 0; e0 < n_exp; e0 += blockDim.x) {
        const int e = e0 + tid;
        const bool in = e < n_exp && key[e] >= T;
        const u32 ins = __ballot_sync(0xffffffffu, in);
        int at = 0;
        if (lane == 0 && ins) at = atomicAdd(&n_cand, __popc(ins));
        at = __shfl_sync(0xffffffffu, at, 0) + __popc(ins & ((1u << lane) - 1));
        if (in) cand[at] = make_int2(key[e], e);
    }
    __syncthreads();
    // Ranks among the candidates (all experts when many tie, as with equal logits).
    const int nc = n_cand;
    for (int i = tid; i < nc; i += blockDim.x) {
        const int2 c = cand[i];
        int r = 0;
        for (int j = 0; j < nc; j++) r += before(cand[j].x, cand[j].y, c.x, c.y);
        if (r < k) chosen[r] = c.y;
    }
    __syncthreads();
    // k <= 32: lane j of the first warp finishes choice j.
    if (tid < 32) {
        int e = tid < k ? chosen[tid] : 0;
        float wj = tid < k ? s[e] : 0.0f;
        float wsum = warp_sum(wj);
        if (tid < k) {
            bool held = e >= held_lo && e < held_hi;
            ids[tid] = held ? e - held_lo : -1;
            weights[tid] = held ? (norm ? wj / wsum : wj) * scale : 0.0f;
        } else if (tid == k && shared) {
            ids[k] = MOE_SHARED;
            weights[k] = 1.0f;
        }
    }
}

extern "C" __global__ void __launch_bounds__(ROUTER_THREADS) moe_router(
    const float* logits, const float* bias, int n_exp, int k, int gating, int n_group,
    int group_used, int norm, float scale, int held_lo, int held_hi, int shared, int* ids,
    float* weights) {
    pdl_enter();
    const int t = blockIdx.x, row = k + (shared ? 1 : 0);
    route_token(logits + (i64)t * n_exp, bias, n_exp, k, gating, n_group, group_used, norm,
                scale, held_lo, held_hi, shared, ids + (i64)t * row, weights + (i64)t * row);
}

// Minimum one block per SM: with none, ptxas fit 8 blocks (32 registers) by spreading the
// eight loads of a thread over four round trips; 2 blocks of 91 registers fit, as many as
// 256 experts need of an H200.
extern "C" __global__ void __launch_bounds__(ROUTER_THREADS, 1) moe_route_f32(
    const float* x, const float* w, int dim, float* logits, int* done, const float* bias,
    int n_exp, int k, int gating, int n_group, int group_used, int norm, float scale,
    int held_lo, int held_hi, int shared, int* ids, float* weights) {
    __shared__ float scratch[32];
    __shared__ bool last;
    const int e = blockIdx.x, t = blockIdx.y, n4 = dim / 4;
    const float4* wr = (const float4*)(w + (i64)e * dim);
    // The router row into L2 while the previous kernel finishes (x may not be read yet), and
    // the bias that the routing block reads (a 128-byte line a block).
    for (int i = threadIdx.x * 8; i < n4; i += blockDim.x * 8) prefetch_l2(wr + i);
    if (bias && threadIdx.x == 0 && 32 * e < n_exp) prefetch_l2(bias + 32 * e);
    pdl_enter();
    const float4* xr = (const float4*)(x + (i64)t * dim);
    float acc = 0.0f;
    // ROUTE_VALS float4 of the row and of x per thread in flight at once (unconditional loads
    // at clamped indexes): as a plain loop each load waited for the one before (ncu, H200:
    // 7 round trips for DeepSeek-V3's 7168-value rows, most of the kernel's 11.7 us).
    for (int i0 = threadIdx.x; i0 < n4; i0 += ROUTE_VALS * blockDim.x) {
        float4 a[ROUTE_VALS], b[ROUTE_VALS];
#pragma unroll
        for (int u = 0; u < ROUTE_VALS; u++) {
            int i = min(i0 + u * (int)blockDim.x, n4 - 1);
            a[u] = __ldg(wr + i);
            b[u] = __ldg(xr + i);
        }
#pragma unroll
        for (int u = 0; u < ROUTE_VALS; u++) {
            float p = (a[u].x * b[u].x + a[u].y * b[u].y) + (a[u].z * b[u].z + a[u].w * b[u].w);
            acc += i0 + u * (int)blockDim.x < n4 ? p : 0.0f;
        }
    }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) {
        logits[(i64)t * n_exp + e] = acc;
        last = count_in(done + t, 1, gridDim.x);
    }
    __syncthreads();
    if (!last) return;
    const int row = k + (shared ? 1 : 0);
    route_token(logits + (i64)t * n_exp, bias, n_exp, k, gating, n_group, group_used, norm,
                scale, held_lo, held_hi, shared, ids + (i64)t * row, weights + (i64)t * row);
}

extern "C" __global__ void __launch_bounds__(256) moe_combine(
    const float* rows, const int* slots, const float* weights, int k, int dim, float* out) {
    pdl_enter();
    int t = blockIdx.y, d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= dim) return;
    const float* wt = weights + (i64)t * k;
    float sum = 0.0f;
    // Eight choices at a time: their slots and weights, then all of their rows' loads (row 0
    // stands in for a skipped one), then the sum in choice order. One choice after the other
    // waited a round trip each (ncu, H200: 6.2 us for 9 choices).
    for (int j0 = 0; j0 < k; j0 += 8) {
        int r[8];
        float w[8], v[8];
        bool use[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int j = j0 + u;
            r[u] = j >= k ? -1 : slots ? slots[(i64)t * k + j] : t * k + j;
            w[u] = j < k ? wt[j] : 0.0f;
            use[u] = r[u] >= 0 && w[u] != 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = rows[(i64)(use[u] ? r[u] : 0) * dim + d];
#pragma unroll
        for (int u = 0; u < 8; u++)
            if (use[u]) sum += w[u] * v[u];
    }
    out[(i64)t * dim + d] = sum;
}
