// Mixture of experts: the router's expert choice, and the weighted sum of expert outputs.
//
// moe_router: one warp per token, logits [T, n_exp] (the router matvec's output).
//   gating 1 (softmax, DeepSeek-V2): s = softmax(logits); gating 2 (sigmoid, V3 / GLM-5):
//   s = sigmoid(logits). choice = s + bias (bias may be null; it steers selection only).
//   With n_group > 1, a group's score is the sum of its two largest choices; the top
//   group_used groups survive and the other experts are out (-inf, never 0). The k experts of
//   largest choice are taken in descending order (ties: lowest id); their weights are the
//   unbiased s, divided by their sum when `norm`, times `scale`.
//   ids [T, k] (i32), weights [T, k]. n_exp <= 1024, n_group <= 32.
//   Tensor parallelism: a rank holds experts held_lo .. held_hi - 1 (all at TP = 1); its ids
//   count from held_lo, and a choice held elsewhere gets id -1 and weight 0 (its output arrives
//   through the all-reduce; the normalization above still counts it).
//
// moe_combine: out[t, :] = sum_j weights[t, j] * rows[slots[t, j], :] (slots < 0 skipped);
//   rows are the expert outputs, one per (token, choice), in any order. A weight of 0 adds
//   nothing, so its row is not read (a choice held by another rank has no row here).
//   grid (ceil(dim / 256), T), block 256: one output value per thread.

#define ROUTER_MAX_EXP 1024

extern "C" __global__ void __launch_bounds__(32) moe_router(
    const float* logits, const float* bias, int n_exp, int k, int gating, int n_group,
    int group_used, int norm, float scale, int held_lo, int held_hi, int* ids, float* weights) {
    pdl_enter();
    __shared__ float s[ROUTER_MAX_EXP], choice[ROUTER_MAX_EXP];
    __shared__ int group_keep[32];
    int t = blockIdx.x, lane = threadIdx.x;
    const float* lg = logits + (i64)t * n_exp;

    if (gating == 1) {
        float mx = NEG_INF;
        for (int e = lane; e < n_exp; e += 32) mx = fmaxf(mx, lg[e]);
        mx = warp_max(mx);
        float sum = 0.0f;
        for (int e = lane; e < n_exp; e += 32) sum += expf(lg[e] - mx);
        sum = warp_sum(sum);
        for (int e = lane; e < n_exp; e += 32) s[e] = expf(lg[e] - mx) / sum;
    } else {
        for (int e = lane; e < n_exp; e += 32) s[e] = 1.0f / (1.0f + expf(-lg[e]));
    }
    for (int e = lane; e < n_exp; e += 32) choice[e] = s[e] + (bias ? bias[e] : 0.0f);
    __syncwarp();

    if (n_group > 1) {
        int per = n_exp / n_group;
        float gscore = NEG_INF;
        if (lane < n_group) {
            float a = NEG_INF, b = NEG_INF;  // two largest
            for (int e = lane * per; e < (lane + 1) * per; e++) {
                float c = choice[e];
                if (c > a) { b = a; a = c; } else if (c > b) { b = c; }
            }
            gscore = a + b;
            group_keep[lane] = 0;
        }
        __syncwarp();
        for (int r = 0; r < group_used; r++) {
            // Warp argmax over the group scores, lowest group on ties.
            float best = gscore;
            int arg = lane < n_group ? lane : 1 << 30;
            for (int o = 16; o > 0; o >>= 1) {
                float ob = __shfl_xor_sync(0xffffffffu, best, o);
                int oa = __shfl_xor_sync(0xffffffffu, arg, o);
                if (ob > best || (ob == best && oa < arg)) { best = ob; arg = oa; }
            }
            if (lane == arg) { group_keep[lane] = 1; gscore = NEG_INF; }
            __syncwarp();
        }
        for (int e = lane; e < n_exp; e += 32)
            if (!group_keep[e / per]) choice[e] = NEG_INF;
        __syncwarp();
    }

    float wsum = 0.0f, wmine = 0.0f;
    for (int j = 0; j < k; j++) {
        float best = NEG_INF;
        int arg = 1 << 30;
        for (int e = lane; e < n_exp; e += 32)
            if (choice[e] > best || (choice[e] == best && e < arg)) { best = choice[e]; arg = e; }
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(0xffffffffu, best, o);
            int oa = __shfl_xor_sync(0xffffffffu, arg, o);
            if (ob > best || (ob == best && oa < arg)) { best = ob; arg = oa; }
        }
        float wj = s[arg];
        bool held = arg >= held_lo && arg < held_hi;
        wsum += wj;
        if (lane == j) wmine = held ? wj : 0.0f;
        if (lane == 0) {
            ids[(i64)t * k + j] = held ? arg - held_lo : -1;
            choice[arg] = NEG_INF;
        }
        __syncwarp();
    }
    // k <= 32: lane j finishes weight j.
    if (lane < k) weights[(i64)t * k + lane] = (norm ? wmine / wsum : wmine) * scale;
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
