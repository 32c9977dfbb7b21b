// Row normalizations. One block per row; x and y may be the same buffer.
//
// rmsnorm: y = x / sqrt(mean(x^2) + eps) * w
// layernorm: y = (x - mean) / sqrt(var + eps) * w + b   (the DSA indexer's key norm), then
//   with dr > 0 its first dr values rotated as adjacent pairs at position pos0 + row, as
//   rope_pairs turns them (the indexer's key straight into its cache row)
// add_rmsnorm: x += r (written back), then y = rmsnorm(x)  (residual add + the next norm);
//   add_rmsnorm_cluster: the same for one row (decode) by a cluster of blocks, r as parts to
//   sum first (partial sums, or a token's expert outputs with the router's weights)
// latent_norm_rope: the MLA latent of a token into its cache row (rmsnorm + rope), with the
//   query latent's rmsnorm and the indexer key's layernorm (+ rope) in the same launch; and
//   latent_rows, the cache's rows back as f32
//
// The row helpers (load_row, rms_store, layernorm_rope_row, the latent's rows) are in
// common.cuh: the matvec parts launch (matvec.cu) norms the latent with them too.

extern "C" __global__ void __launch_bounds__(1024) rmsnorm(const float* x, i64 x_stride,
                                                           const float* w, float* y,
                                                           i64 y_stride, int n, float eps) {
    __shared__ float scratch[32];
    float v[NORM_VALS], wv[NORM_VALS];
    load_row(wv, w, n);  // the weights while the kernel before ends
    pdl_enter();
    load_row(v, x + blockIdx.x * x_stride, n);
    rms_store(v, wv, y + blockIdx.x * y_stride, n, eps, scratch);
}

extern "C" __global__ void __launch_bounds__(1024) layernorm(
    const float* x, i64 x_stride, const float* w, const float* b, float* y, i64 y_stride, int n,
    float eps, int dr, int pos0, const float* inv_freq, float mscale) {
    pdl_enter();
    __shared__ float scratch[32];
    layernorm_rope_row(x + blockIdx.x * x_stride, w, b, y + blockIdx.x * y_stride, n, eps, dr,
                       (float)(pos0 + (int)blockIdx.x), inv_freq, mscale, scratch);
}

// The residual add fused with the norm after it, rows of n contiguous values: x += r is
// written back (x + r, the f32 sum add_inplace computes), then y = rmsnorm of the new x.
extern "C" __global__ void __launch_bounds__(1024) add_rmsnorm(float* x, const float* r,
                                                               const float* w, float* y, int n,
                                                               float eps) {
    pdl_enter();
    __shared__ float scratch[32];
    float* xr = x + (i64)blockIdx.x * n;
    const float* rr = r + (i64)blockIdx.x * n;
    float v[NORM_VALS], r_v[NORM_VALS], wv[NORM_VALS];
    load_row(v, xr, n);
    load_row(r_v, rr, n);
    load_row(wv, w, n);
#pragma unroll
    for (int k = 0; k < NORM_VALS; k++) {
        int i = threadIdx.x + k * blockDim.x;
        v[k] += r_v[k];
        if (i < n) xr[i] = v[k];
    }
    rms_store(v, wv, y + (i64)blockIdx.x * n, n, eps, scratch);
}

// add_rmsnorm_cluster: add_rmsnorm of one row of n <= NORM_CLUSTER * CLUSTER_THREADS *
// CLUSTER_VALS by a cluster of NORM_CLUSTER blocks (sm_90+), each on its slice of the row;
// their sums of squares meet in distributed shared memory, every block adding the cluster's
// in the same order (so the same 1 / rms). One block streams a decode row's bytes at a
// fraction of the GPU's rate: with a token's 9 expert outputs to sum it took 11 us (ncu, H100).
// r is the sum of r_parts parts r_part apart, added in order:
// - without weights (r_w null), the partial sums of a product whose k its blocks took in parts
//   (matvec_tma_body's y_part): the same bits as the one sum it would have stored;
// - with weights (r_w [r_parts]), a decode token's expert outputs (a part a choice), r = sum
//   of r_w[p] * part p, a part of weight 0 not added: moe_combine's sum, bit for bit but the
//   sign of an all-zero sum (the combine needs no launch of its own; the parts are all
//   written: every choice held).
#define NORM_CLUSTER 8
#define CLUSTER_THREADS 256
#define CLUSTER_VALS 4
#define SUM_PARTS_AT_ONCE 9

// This thread's values of its block's slice [lo, hi) of a row (0 past hi), loads at once.
__device__ __forceinline__ void load_slice(float v[CLUSTER_VALS], const float* row, int lo,
                                           int hi) {
#pragma unroll
    for (int k = 0; k < CLUSTER_VALS; k++) {
        int i = lo + threadIdx.x + k * CLUSTER_THREADS;
        v[k] = i < hi ? row[i] : 0.0f;
    }
}

// s = the slice's sum over p of c_p * part p in order, from -0 (so that c_0 = 1 leaves part
// 0's bits: fmaf(1, v, s) is v + s rounded once); SUM_PARTS_AT_ONCE parts' loads at a time
// with their weights (no load waits on a weight: a part of weight 0 is read, not added), as
// many as a token's 8 expert outputs and its shared expert's, one round trip (5 at a time
// took two; the parts past the last are not read).
__device__ __forceinline__ void sum_parts(float s[CLUSTER_VALS], const float* r, int parts,
                                          i64 stride, const float* weights, int lo, int hi) {
#pragma unroll
    for (int k = 0; k < CLUSTER_VALS; k++) s[k] = -0.0f;
#pragma unroll 1
    for (int p0 = 0; p0 < parts; p0 += SUM_PARTS_AT_ONCE) {
        float c[SUM_PARTS_AT_ONCE], v[SUM_PARTS_AT_ONCE][CLUSTER_VALS];
#pragma unroll
        for (int u = 0; u < SUM_PARTS_AT_ONCE; u++) {
            const int p = p0 + u;
            c[u] = p >= parts ? 0.0f : weights ? weights[p] : 1.0f;
            load_slice(v[u], r + p * stride, lo, p < parts ? hi : lo);
        }
#pragma unroll
        for (int u = 0; u < SUM_PARTS_AT_ONCE; u++)
            if (c[u] != 0.0f) {
#pragma unroll
                for (int k = 0; k < CLUSTER_VALS; k++) s[k] = fmaf(c[u], v[u][k], s[k]);
            }
    }
}

#if __CUDA_ARCH__ >= 900
#define NORM_CLUSTER_DIMS __cluster_dims__(NORM_CLUSTER, 1, 1)
#else
#define NORM_CLUSTER_DIMS
#endif
extern "C" __global__ void NORM_CLUSTER_DIMS __launch_bounds__(CLUSTER_THREADS)
    add_rmsnorm_cluster(float* x, const float* r, int r_parts, i64 r_part, const float* r_w,
                        const float* w, float* y, int n, float eps) {
#if __CUDA_ARCH__ >= 900
    __shared__ float scratch[32], block_ss;
    const int slice = (n + NORM_CLUSTER - 1) / NORM_CLUSTER;
    const int lo = blockIdx.x * slice, hi = min(n, lo + slice);
    float v[CLUSTER_VALS], r_v[CLUSTER_VALS], wv[CLUSTER_VALS];
    // The norm's weights while the kernel before ends: a token's other bytes have taken them
    // out of L2 since the last one.
    load_slice(wv, w, lo, hi);
    pdl_enter();
    load_slice(v, x, lo, hi);
    sum_parts(r_v, r, r_parts, r_part, r_w, lo, hi);
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < CLUSTER_VALS; k++) {
        int i = lo + threadIdx.x + k * CLUSTER_THREADS;
        v[k] += r_v[k];
        if (i < hi) x[i] = v[k];
        ss += v[k] * v[k];
    }
    ss = block_sum(ss, scratch);
    if (threadIdx.x == 0) block_ss = ss;
    cluster_sync();
    // Lane b reads block b's sum (the grid is one cluster: block b is its rank b).
    float part = 0.0f;
    int lane = threadIdx.x & 31;
    if (lane < NORM_CLUSTER)
        asm volatile("ld.shared::cluster.f32 %0, [%1];"
                     : "=f"(part)
                     : "r"(cluster_addr(&block_ss, lane))
                     : "memory");
    // No block leaves while another may still read its sum.
    cluster_arrive();
    const float inv = rsqrtf(warp_sum(part) / (float)n + eps);
#pragma unroll
    for (int k = 0; k < CLUSTER_VALS; k++) {
        int i = lo + threadIdx.x + k * CLUSTER_THREADS;
        if (i < hi) y[i] = v[k] * inv * wv[k];
    }
    cluster_wait();
#endif
}

// latent_norm_rope: the MLA latent of T tokens into their cache rows, with the query latent's
// rmsnorm (a.qx not null) and the indexer key's layernorm + rope (a.kx not null) in the same
// launch: block (t, y) takes row y of token t (common.cuh: latent_row, then query_row and
// key_row where given). Grid (T, 1 + (qx != 0) + (kx != 0)), block x >=
// max(dl, dq, dk) / NORM_VALS (the norm launch of the widest row). For one token the
// CUDA-core parts launch that makes kv, qx and kx does it in its last blocks instead
// (matvec.cu, parts_tail).
extern "C" __global__ void __launch_bounds__(1024) latent_norm_rope(LatentNorm a) {
    pdl_enter();
    __shared__ float scratch[32];
    if (blockIdx.y == 0)
        latent_row<NORM_VALS, false>(a, blockIdx.x, scratch);
    else if (blockIdx.y == 1 && a.qx)
        query_row<NORM_VALS, false>(a, blockIdx.x, scratch);
    else
        key_row<NORM_VALS, false>(a, blockIdx.x, scratch);
}

// Rows 0 .. gridDim.x of a latent cache back as f32 (x_hi + x_lo): c_kv [rows, dl] and k_pe
// [rows, dr], what the prefill's expanded attention reads. Grid (rows), any block.
extern "C" __global__ void latent_rows(const u16* cache, int dl, int dr, float* c_kv,
                                       float* k_pe) {
    pdl_enter();
    const i64 r = blockIdx.x;
    const u16* row = cache + r * (2 * LATENT_DIMS);
    for (int i = threadIdx.x; i < dl + dr; i += blockDim.x) {
        const int d = i < dl ? i : LATENT_ROPE_AT + i - dl;
        const float x = bf16_to_f32(row[d]) + bf16_to_f32(row[LATENT_DIMS + d]);
        if (i < dl)
            c_kv[r * dl + i] = x;
        else
            k_pe[r * dr + i - dl] = x;
    }
}
