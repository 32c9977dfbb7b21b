// DSA (DeepSeek sparse attention) lightning indexer: which keys each query may attend to.
//
// dsa_scores: scores[t, s] = sum_h w[t, h] * relu(scale * q[t, h, :] . k[s, :]) for s <= pos0 + t,
//   -inf for later keys. q: [T, heads, dim], k: [S, dim] (the indexer key cache, one head),
//   w: [T, heads] (the head weights), scores: [T, s_stride].
//   grid (ceil(S / TK / tiles), T), block 128: a block scores `tiles` tiles of TK = 32 KPL
//   keys, each copied into shared memory (cp.async) while the one before is scored, its query
//   loaded once; lane l of every warp takes keys l, l + 32, .. (KPL: 1 in dsa_scores, 2 in
//   dsa_scores2) of the tile, warp w heads 8w .. 8w + 7, then 8w + 32 .., and the 4 warps'
//   sums are added at the end. Dynamic shared memory dsa_scores_smem_bytes(): the token's
//   query [heads][dim] and two key tiles [TK][dim + 4] (row padding: conflict-free float4
//   reads). heads <= 64, heads * dim <= 8192, dim % 4 == 0, dim <= 256; k 16-byte aligned.
//   Where dim % 16 == 0, ops.rs takes dsa_scores_mma16/32/64 instead (the tensor cores: below).
//
// topk_rows: for each row t, the positions of the k largest of scores[t, 0 .. n_valid(t)),
//   n_valid(t) = pos0 + t + 1, ascending, -1 padded (all valid positions when there are at most
//   k). Equal scores at the boundary are taken lowest position first. One block of
//   TOPK_THREADS threads per row: a 3-pass radix select on the order-preserving u32 image of
//   the scores finds the k-th largest value (each pass: a histogram of the next 11, 11 and 10
//   bits, then a block scan over the bins from the top finds the digit; the select stops early
//   where the digit's keys are all taken), then one more pass over the row puts each selected
//   position in its place (a block scan of the threads' counts a chunk of the row). The first
//   pass keeps the keys of the first `cache_keys` positions in dynamic shared memory (4 bytes
//   each) for the others. At decode (T = 1) this block is alone on the GPU, so the kernel is
//   its latency: loads are issued in batches, each key is read once a pass.
//
// topk_rows_cluster4 / topk_rows_cluster8: the same selection, bit for bit, by a cluster of C
//   = 4 or 8 blocks a row (sm_90+; grid (C, T)): block r takes the r-th stretch of the row,
//   keeps its keys (up to `cache_keys`) in shared memory, and counts them into its own
//   histogram and its warps' sums of it; after a cluster barrier every block adds the
//   cluster's warp sums (distributed shared memory), and the warp whose bins hold the digit
//   adds those bins of every block, so all find the same digit and the passes need no other
//   exchange. The placement adds the counts of the blocks before it. For decode, where one
//   block per row leaves the GPU idle and each pass's shared atomics are one SM's work.

#define DSA_KEYS 32  // keys of a tile a lane's turn: a tile is DSA_KEYS * KPL keys
#define DSA_HC 8  // heads per warp pass
#define DSA_BATCH 8  // float4 loads a thread has in flight while filling shared memory

// Each broadcast query float4 serves a lane's KPL keys, so a warp's shared loads per 4 FMA
// fall from 9 / 8 (KPL 1) to 10 / 16 (KPL 2); dsa_scores2 where its tiles fit
// (DSA_SCORES2_SMEM, kernels.rs: GLM-5's indexer), dsa_scores for the larger queries.
template <int KPL>
__device__ __forceinline__ void dsa_scores_body(const float* q, const float* k, const float* w,
                                                int heads, int dim, int S, int pos0, float scale,
                                                float* scores, i64 s_stride, int tiles) {
    constexpr int TK = DSA_KEYS * KPL;  // keys a tile
    pdl_enter();
    extern __shared__ __align__(16) float dsmem[];
    __shared__ float ws[64];
    __shared__ float part[4][TK];
    const int dim4 = dim / 4, kstride = dim + 4;
    float* qs = dsmem;                 // [heads][dim]
    float* kbuf = dsmem + heads * dim; // [2][TK][dim + 4]: this tile and the next
    const int t = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int tile0 = blockIdx.x * tiles;
    const int tile1 = min(tile0 + tiles, (S + TK - 1) / TK);

    // Key tile `tile` into buffer b by cp.async (rows past S zero-filled), one commit group.
    auto copy_tile = [&](int tile, int b) {
        const u32 base = (u32)__cvta_generic_to_shared(kbuf + b * TK * kstride);
        const int s0 = tile * TK;
        for (int i = tid; i < TK * dim4; i += 128) {
            int r = i / dim4, c = i - r * dim4;
            bool ok = s0 + r < S;
            cp16(base + 4 * (r * kstride + 4 * c), k + (i64)(ok ? s0 + r : 0) * dim + 4 * c, ok);
        }
        cp_commit();
    };
    if (tile0 < tile1) copy_tile(tile0, 0);

    // The query: loads in batches of DSA_BATCH a thread, all issued before the first is
    // stored (a block pays one memory latency per batch, not one per loop trip).
    const float4* q4 = (const float4*)(q + (i64)t * heads * dim);
    for (int i0 = tid; i0 < heads * dim4; i0 += DSA_BATCH * 128) {
        float4 v[DSA_BATCH];
#pragma unroll
        for (int j = 0; j < DSA_BATCH; j++) {
            int i = i0 + 128 * j;
            if (i < heads * dim4) v[j] = q4[i];
        }
#pragma unroll
        for (int j = 0; j < DSA_BATCH; j++) {
            int i = i0 + 128 * j;
            if (i < heads * dim4) ((float4*)qs)[i] = v[j];
        }
    }
    for (int i = tid; i < heads; i += blockDim.x) ws[i] = w[(i64)t * heads + i];

    for (int tile = tile0; tile < tile1; tile++) {
        const int b = (tile - tile0) & 1, s0 = tile * TK;
        // The previous tile's readers are past the barrier at its end, so its buffer is free.
        if (tile + 1 < tile1) {
            copy_tile(tile + 1, b ^ 1);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        const float* ks = kbuf + b * TK * kstride;
        const float4* kr[KPL];
#pragma unroll
        for (int j = 0; j < KPL; j++) kr[j] = (const float4*)(ks + (lane + DSA_KEYS * j) * kstride);
        float total[KPL];
#pragma unroll
        for (int j = 0; j < KPL; j++) total[j] = 0.0f;
        for (int hc = warp * DSA_HC; hc < heads; hc += 4 * DSA_HC) {
            float dot[DSA_HC][KPL];
            int qrow[DSA_HC];  // float4 offset of each head's query row (past heads: unused)
#pragma unroll
            for (int e = 0; e < DSA_HC; e++) {
#pragma unroll
                for (int j = 0; j < KPL; j++) dot[e][j] = 0.0f;
                qrow[e] = min(hc + e, heads - 1) * dim4;
            }
            const float4* q4s = (const float4*)qs;
            for (int d4 = 0; d4 < dim4; d4++) {
                float4 kv[KPL];
#pragma unroll
                for (int j = 0; j < KPL; j++) kv[j] = kr[j][d4];
#pragma unroll
                for (int e = 0; e < DSA_HC; e++) {
                    float4 qv = q4s[qrow[e] + d4];  // one address in every lane: a broadcast
#pragma unroll
                    for (int j = 0; j < KPL; j++)
                        dot[e][j] += qv.x * kv[j].x + qv.y * kv[j].y + qv.z * kv[j].z + qv.w * kv[j].w;
                }
            }
#pragma unroll
            for (int e = 0; e < DSA_HC; e++)
#pragma unroll
                for (int j = 0; j < KPL; j++)
                    if (hc + e < heads) total[j] += ws[hc + e] * fmaxf(scale * dot[e][j], 0.0f);
        }
#pragma unroll
        for (int j = 0; j < KPL; j++) part[warp][lane + DSA_KEYS * j] = total[j];
        __syncthreads();
        if (warp == 0) {
#pragma unroll
            for (int j = 0; j < KPL; j++) {
                const int r = lane + DSA_KEYS * j, s = s0 + r;
                float sum = part[0][r] + part[1][r] + part[2][r] + part[3][r];
                if (s < S) scores[(i64)t * s_stride + s] = s <= pos0 + t ? sum : NEG_INF;
            }
        }
    }
}

// A scores kernel: 128 threads running `body` (dsa_scores_body, dsa_scores_mma_body).
#define DSA_SCORES(name, body)                                                                \
    extern "C" __global__ void __launch_bounds__(128) name(                                   \
        const float* q, const float* k, const float* w, int heads, int dim, int S, int pos0,  \
        float scale, float* scores, i64 s_stride, int tiles) {                                \
        body(q, k, w, heads, dim, S, pos0, scale, scores, s_stride, tiles);                   \
    }
DSA_SCORES(dsa_scores, dsa_scores_body<1>)
DSA_SCORES(dsa_scores2, dsa_scores_body<2>)

// dsa_scores_mma: the same scores on the tensor cores, each product in split bf16 (q = qh + ql,
// k = kh + kl; qh.kh + qh.kl + ql.kh summed in f32 carry each term to ~2^-16, as MLA decode's
// products do). Warp w of a block takes keys 16w .. 16w + 15 of each tile of 64 and all heads,
// padded to 8 * NT: A (16 keys x 16 dims) straight from the cache, a float4 a lane a row (a
// lane's k slots 2c, 2c + 1, 2c + 8, 2c + 9 take dims 4c .. 4c + 3: the product is the same in
// any order of k), split in registers; B (16 dims x 8 heads) the query's hi and lo fragments,
// split once a block into shared memory in the order lanes read them (one 16-byte load a
// fragment). Dynamic shared memory dsa_scores_mma_smem_bytes(). dim % 16 == 0, dim <= 256;
// heads <= 8 NT; k 16-byte aligned. No key tile in shared memory: a warp's loads are whole
// 32-byte sectors, and its 16 rows' loads are in flight at once.
#define DSA_MMA_KEYS 64  // keys a block's tile: 16 a warp

template <int NT>
__device__ __forceinline__ void dsa_scores_mma_body(const float* q, const float* k, const float* w,
                                                    int heads, int dim, int S, int pos0,
                                                    float scale, float* scores, i64 s_stride,
                                                    int tiles) {
    pdl_enter();
    extern __shared__ __align__(16) uint4 qfrag[];  // [dim / 16][NT][32]: {bh0, bh1, bl0, bl1}
    const int t = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c = lane & 3;  // a fragment's row (key, head) and k quarter
    const int ksteps = dim / 16, dim4 = dim / 4;
    const int tile0 = blockIdx.x * tiles;
    const int tile1 = min(tile0 + tiles, (S + DSA_MMA_KEYS - 1) / DSA_MMA_KEYS);

    // Rows g and g + 8 of the warp's keys s0 .., 8 k steps (128 dims) from k step k0, a float4
    // a lane a row, all in flight at once.
    float4 kv[8][2];
    auto load_keys = [&](int s0, int k0) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float4* row = (const float4*)(k + (i64)min(s0 + g + 8 * r, S - 1) * dim);
#pragma unroll
            for (int j = 0; j < 8; j++)
                kv[j][r] = k0 + j < ksteps ? row[4 * (k0 + j) + c] : make_float4(0, 0, 0, 0);
        }
    };
    // The first keys' loads go out before the query's, so that a decode block waits one
    // memory latency, not two.
    const int first = tile0 * DSA_MMA_KEYS + 16 * warp;
    if (tile0 < tile1 && first <= pos0 + t) load_keys(first, 0);

    // The query, split: float4 i = (head h, dims 4j ..) is B's fragment for lane (h % 8, j % 4)
    // of N tile h / 8 at k step j / 4. Heads past `heads` are zero. Loads in batches of
    // DSA_BATCH a thread, all issued before the first is used.
    const float4* q4 = (const float4*)(q + (i64)t * heads * dim);
    for (int i0 = tid; i0 < 8 * NT * dim4; i0 += DSA_BATCH * 128) {
        float4 v[DSA_BATCH];
#pragma unroll
        for (int b = 0; b < DSA_BATCH; b++) {
            const int i = i0 + 128 * b;
            v[b] = i < heads * dim4 ? q4[i] : make_float4(0, 0, 0, 0);
        }
#pragma unroll
        for (int b = 0; b < DSA_BATCH; b++) {
            const int i = i0 + 128 * b, h = i / dim4, j = i - h * dim4;
            if (i >= 8 * NT * dim4) break;
            const u32 h0 = pack_bf16x2(v[b].x, v[b].y), h1 = pack_bf16x2(v[b].z, v[b].w);
            const u32 l0 = pack_bf16x2(v[b].x - bf16_to_f32((u16)h0),
                                       v[b].y - bf16_to_f32((u16)(h0 >> 16)));
            const u32 l1 = pack_bf16x2(v[b].z - bf16_to_f32((u16)h1),
                                       v[b].w - bf16_to_f32((u16)(h1 >> 16)));
            qfrag[((j >> 2) * NT + (h >> 3)) * 32 + (h & 7) * 4 + (j & 3)] =
                make_uint4(h0, h1, l0, l1);
        }
    }
    // This lane's heads' weights: columns 2c, 2c + 1 of each N tile.
    float wv[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int h = 8 * nt + 2 * c + e;
            wv[nt][e] = h < heads ? w[(i64)t * heads + h] : 0.0f;
        }
    __syncthreads();

    for (int tile = tile0; tile < tile1; tile++) {
        const int s0 = tile * DSA_MMA_KEYS + 16 * warp;  // this warp's keys s0 .. s0 + 15
        if (s0 > pos0 + t) {  // all in this row's future (prefill): no products
            if (lane < 16 && s0 + lane < S) scores[(i64)t * s_stride + s0 + lane] = NEG_INF;
            continue;
        }
        float acc[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
        for (int k0 = 0; k0 < ksteps; k0 += 8) {
            if (tile > tile0 || k0 > 0) load_keys(s0, k0);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if (k0 + j >= ksteps) break;
                u32 ah[4], al[4];
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const float4 v = kv[j][r];
                    ah[r] = pack_bf16x2(v.x, v.y);
                    ah[r + 2] = pack_bf16x2(v.z, v.w);
                    al[r] = pack_bf16x2(v.x - bf16_to_f32((u16)ah[r]),
                                        v.y - bf16_to_f32((u16)(ah[r] >> 16)));
                    al[r + 2] = pack_bf16x2(v.z - bf16_to_f32((u16)ah[r + 2]),
                                            v.w - bf16_to_f32((u16)(ah[r + 2] >> 16)));
                }
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const uint4 b = qfrag[((k0 + j) * NT + nt) * 32 + lane];
                    const u32 bh[2] = {b.x, b.y}, bl[2] = {b.z, b.w};
                    mma_bf16_16816(acc[nt], ah, bh);
                    mma_bf16_16816(acc[nt], ah, bl);
                    mma_bf16_16816(acc[nt], al, bh);
                }
            }
        }
        // acc[nt]: keys g (0, 1) and g + 8 (2, 3) by heads 8 nt + 2c (0, 2) and + 1 (1, 3).
        float sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int r = 0; r < 2; r++)
                sum[r] += wv[nt][0] * fmaxf(scale * acc[nt][2 * r], 0.0f) +
                          wv[nt][1] * fmaxf(scale * acc[nt][2 * r + 1], 0.0f);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
            sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
        }
        if (c < 2) {  // lane c = 0 writes key g, c = 1 key g + 8
            const int s = s0 + g + 8 * c;
            if (s < S) scores[(i64)t * s_stride + s] = s <= pos0 + t ? (c == 0 ? sum[0] : sum[1]) : NEG_INF;
        }
    }
}

DSA_SCORES(dsa_scores_mma16, dsa_scores_mma_body<2>)
DSA_SCORES(dsa_scores_mma32, dsa_scores_mma_body<4>)
DSA_SCORES(dsa_scores_mma64, dsa_scores_mma_body<8>)

// keep_mask: the selection as bits for attention_prefill: bits[t, s / 32] bit s % 32 is set for
//   every position s = ids[t, j] in 0 .. n_keys (bits zeroed before; -1 padding sets none).
//   One thread per id.
extern "C" __global__ void keep_mask(const int* ids, int rows, int k, int n_keys, int words,
                                     u32* bits) {
    pdl_enter();
    i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (i >= (i64)rows * k) return;
    int s = ids[i];
    if (s >= 0 && s < n_keys) atomicOr(&bits[i / k * words + s / 32], 1u << (s % 32));
}

// Larger float <=> larger key; -inf is the smallest non-NaN key.
__device__ __forceinline__ u32 order_key(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// v[0] + .. + v[n - 1] (n <= 32) in every lane of the warp: one read a lane and one warp
// reduction, where a lane's loop over v took up to 31 reads and adds (the top-k kernels run
// alone on their SMs, bound by the instructions they issue).
__device__ __forceinline__ int warp_sum_first(const int* v, int n) {
    const int lane = threadIdx.x & 31;
    return __reduce_add_sync(0xffffffffu, lane < n ? v[lane] : 0);
}

// Inclusive prefix sum over the warp.
__device__ __forceinline__ int warp_scan(int v) {
    const int lane = threadIdx.x & 31;
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += n;
    }
    return v;
}

// Exclusive prefix sum over the block (whole warps, at most 32), and the block's total. One
// barrier: `scratch` (32 ints) may be written again only past the next one, so a caller
// scanning in turn alternates two.
__device__ __forceinline__ int block_scan(int v, int* scratch, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int incl = warp_scan(v);
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    total = warp_sum_first(scratch, blockDim.x >> 5);
    return warp_sum_first(scratch, warp) + incl - v;
}

#define TOPK_THREADS 1024  // kernels.rs
#define TOPK_BATCH 8  // keys a thread loads before it uses them: loads in flight, not in turn

// Where a sweep over a stretch of a row takes its keys: the row (the first pass, which keeps
// the first n_cached in `cached`), the cache alone (it holds the whole stretch: decode rows up
// to the cache's size), or the cache and then the row past it. One form a sweep, so that a
// key's load is one instruction, not a branch on the pass and the position.
enum { KEYS_ROW, KEYS_CACHE, KEYS_BOTH };

template <int SRC>
__device__ __forceinline__ u32 topk_key(const float* row, int first, const u32* cached,
                                        int n_cached, int i) {
    if (SRC == KEYS_CACHE) return cached[i];
    if (SRC == KEYS_ROW) return order_key(row[first + i]);
    return i < n_cached ? cached[i] : order_key(row[first + i]);
}

// One radix pass in one form: the keys of positions first .. first + len of `row` that match
// `prefix` under `mask`, counted into h by their digit at `shift` (bins - 1 its mask) by
// THREADS threads.
template <int THREADS, int SRC>
__device__ __forceinline__ void topk_count_from(const float* row, int first, int len,
                                                u32* cached, int n_cached, u32 prefix, u32 mask,
                                                int shift, int bins, int* h) {
    const int tid = threadIdx.x;
    for (int c0 = 0; c0 < len; c0 += TOPK_BATCH * THREADS) {  // warp-uniform trips
        u32 keys[TOPK_BATCH];
#pragma unroll
        for (int j = 0; j < TOPK_BATCH; j++) {
            int i = c0 + j * THREADS + tid;
            keys[j] = i < len ? topk_key<SRC>(row, first, cached, n_cached, i) : 0u;
        }
#pragma unroll
        for (int j = 0; j < TOPK_BATCH; j++) {
            int i = c0 + j * THREADS + tid;
            if (SRC == KEYS_ROW && i < n_cached) cached[i] = keys[j];
            // Plain shared atomics: grouping a warp's equal digits first (__match_any_sync,
            // or a ballot on the first lane's digit) was slower (lab, H200: 8K keys
            // 40.5 and 15.8 us against 13.0), and so were 4 copies of the first pass's bins
            // by lane (lab, H100: the GLM-5 file's own rows of 8193 keys 10.2 -> 10.7 us).
            // The first pass (mask 0) counts every key.
            if (i < len && (SRC == KEYS_ROW || (keys[j] & mask) == prefix))
                atomicAdd(&h[(keys[j] >> shift) & (bins - 1)], 1);
        }
    }
}

// Radix pass `pass` over the stretch; pass 0 reads the scores and keeps the first n_cached
// keys in `cached` (the first pass has mask 0).
template <int THREADS>
__device__ __forceinline__ void topk_count(const float* row, int first, int len, u32* cached,
                                           int n_cached, int pass, u32 prefix, u32 mask,
                                           int shift, int bins, int* h) {
    if (pass == 0)
        topk_count_from<THREADS, KEYS_ROW>(row, first, len, cached, n_cached, prefix, mask,
                                           shift, bins, h);
    else if (n_cached == len)
        topk_count_from<THREADS, KEYS_CACHE>(row, first, len, cached, n_cached, prefix, mask,
                                             shift, bins, h);
    else
        topk_count_from<THREADS, KEYS_BOTH>(row, first, len, cached, n_cached, prefix, mask,
                                            shift, bins, h);
}

// A thread's TOPK_BATCH keys at positions i0 .. of a stretch of `len` (0 past it; i0 % 8 == 0):
// two 16-byte reads where they are all kept.
template <int SRC>
__device__ __forceinline__ void topk_keys_at(const float* row, int first, const u32* cached,
                                             int n_cached, int len, int i0,
                                             u32 keys[TOPK_BATCH]) {
    if (SRC != KEYS_ROW && i0 + TOPK_BATCH <= n_cached) {
        const uint4 a = *(const uint4*)(cached + i0), b = *(const uint4*)(cached + i0 + 4);
        keys[0] = a.x, keys[1] = a.y, keys[2] = a.z, keys[3] = a.w;
        keys[4] = b.x, keys[5] = b.y, keys[6] = b.z, keys[7] = b.w;
        return;
    }
#pragma unroll
    for (int j = 0; j < TOPK_BATCH; j++)
        keys[j] = i0 + j < len ? topk_key<SRC>(row, first, cached, n_cached, i0 + j) : 0u;
}

// The placement over a stretch of `len` positions, once the k-th largest key is `prefix` under
// `mask`: the keys above it are all taken, and the first `remaining` equal to it (lowest
// position first); position i goes to orow[gt + min(eq, remaining)], gt and eq the keys above
// and equal before it, counted from the gt and eq passed in (the stretches before). Chunks of
// TOPK_BATCH * TOPK_THREADS positions, thread j taking TOPK_BATCH in a row: it counts its keys
// (above | equal << 16), one block scan of the counts gives each thread its places, and it
// writes its positions from the keys it holds. Without WRITE, the thread's counts of the whole
// stretch are added to gt and eq (no scan). gt and eq end as the counts past the stretch.
// scratch: 64 ints.
template <int SRC, bool WRITE>
__device__ __forceinline__ void topk_place_from(const float* row, int first, const u32* cached,
                                                int n_cached, int len, u32 prefix, u32 mask,
                                                int remaining, int& gt, int& eq, int* orow,
                                                int* scratch) {
    for (int c0 = 0; c0 < len; c0 += TOPK_BATCH * TOPK_THREADS) {  // block-uniform trips
        const int i0 = c0 + TOPK_BATCH * (int)threadIdx.x;
        u32 keys[TOPK_BATCH];
        topk_keys_at<SRC>(row, first, cached, n_cached, len, i0, keys);
        int counts = 0;  // above | equal << 16: at most TOPK_BATCH * TOPK_THREADS each
#pragma unroll
        for (int j = 0; j < TOPK_BATCH; j++) {
            const u32 key = keys[j] & mask;
            const bool in = i0 + j < len;
            counts += in && key > prefix ? 1 : in && key == prefix ? 0x10000 : 0;
        }
        if (!WRITE) {
            gt += counts & 0xffff;
            eq += counts >> 16;
            continue;
        }
        int total;  // scratch's halves in turn (block_scan)
        const int before =
            block_scan(counts, scratch + 32 * (c0 / (TOPK_BATCH * TOPK_THREADS) & 1), total);
        int g = gt + (before & 0xffff), e = eq + (before >> 16);
#pragma unroll
        for (int j = 0; j < TOPK_BATCH; j++) {
            const u32 key = keys[j] & mask;
            if (i0 + j >= len) break;
            if (key > prefix) {
                orow[g + min(e, remaining)] = first + i0 + j;
                g++;
            } else if (key == prefix) {
                if (e < remaining) orow[g + e] = first + i0 + j;
                e++;
            }
        }
        gt += total & 0xffff;
        eq += total >> 16;
    }
}

// topk_place_from over a stretch of `len` positions, n_cached of them kept.
template <bool WRITE>
__device__ __forceinline__ void topk_place(const float* row, int first, const u32* cached,
                                           int n_cached, int len, u32 prefix, u32 mask,
                                           int remaining, int& gt, int& eq, int* orow,
                                           int* scratch) {
    if (n_cached == len)
        topk_place_from<KEYS_CACHE, WRITE>(row, first, cached, n_cached, len, prefix, mask,
                                           remaining, gt, eq, orow, scratch);
    else
        topk_place_from<KEYS_BOTH, WRITE>(row, first, cached, n_cached, len, prefix, mask,
                                          remaining, gt, eq, orow, scratch);
}

// Where a radix pass's digit search leaves its result for the block (topk_select).
struct TopkDigit {
    u32 prefix;
    int remaining, whole;
};

// A radix pass's digit from its bins' counts, the bins from the top, in three pieces (the
// cluster kernels gather the counts in their own way): thread j holds c[b], the count of
// digit bins - 1 - per * j - b for b < per (per = bins / TOPK_THREADS, 1 or 2), and the digit
// is where the count of larger keys first reaches `remaining`.
//
// topk_home_warp: from the warps' counts (warp_counts, 32), the warp whose bins hold the
// digit, and the count of larger keys in the warps before it; every lane of every warp.
__device__ __forceinline__ int topk_home_warp(const int* warp_counts, int remaining,
                                              int& before) {
    const int lane = threadIdx.x & 31;
    const int w = warp_counts[lane], upto = warp_scan(w);  // TOPK_THREADS / 32 == 32 warps
    const int home = __ffs(__ballot_sync(0xffffffffu, upto >= remaining)) - 1;
    before = __shfl_sync(0xffffffffu, upto - w, home);
    return home;
}

// topk_warp_digit: the home warp alone scans its threads' counts into sel.
__device__ __forceinline__ void topk_warp_digit(const int c[2], int bins, int shift, u32 prefix,
                                                int remaining, int before, TopkDigit* sel) {
    const int per = bins / TOPK_THREADS;
    const int count = per == 2 ? c[0] + c[1] : c[0];
    int larger = before + warp_scan(count) - count;
    if (larger < remaining && larger + count >= remaining) {
#pragma unroll
        for (int b = 0; b < 2; b++) {
            if (b == per) break;
            if (larger + c[b] >= remaining) {
                sel->prefix = prefix | ((u32)(bins - 1 - per * (int)threadIdx.x - b) << shift);
                sel->remaining = remaining - larger;
                sel->whole = larger + c[b] == remaining;
                break;
            }
            larger += c[b];
        }
    }
}

// topk_take_digit: behind a barrier, every thread's prefix, mask and remaining become the
// pass's; true where the digit's keys are all taken (no finer pass is needed).
__device__ __forceinline__ bool topk_take_digit(const TopkDigit* sel, int bins, int shift,
                                                u32& prefix, u32& mask, int& remaining) {
    __syncthreads();
    prefix = sel->prefix;
    remaining = sel->remaining;
    mask |= (u32)(bins - 1) << shift;
    return sel->whole;
}

// The three for one block's bins. Two barriers: every warp finds from the warps' sums the
// one whose bins hold the digit, and that warp alone scans its threads' counts.
__device__ __forceinline__ bool topk_select(const int c[2], int bins, int shift, u32& prefix,
                                            u32& mask, int& remaining, int* scratch,
                                            TopkDigit* sel) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int per = bins / TOPK_THREADS;
    const int count = per == 2 ? c[0] + c[1] : c[0];
    const int warp_count = __reduce_add_sync(0xffffffffu, count);
    if (lane == 0) scratch[warp] = warp_count;
    __syncthreads();
    int before;
    if (warp == topk_home_warp(scratch, remaining, before))
        topk_warp_digit(c, bins, shift, prefix, remaining, before, sel);
    return topk_take_digit(sel, bins, shift, prefix, mask, remaining);
}

extern "C" __global__ void __launch_bounds__(TOPK_THREADS, 1) topk_rows(
    const float* scores, i64 s_stride, int pos0, int k, int cache_keys, int* out) {
    extern __shared__ __align__(16) u32 cached[];  // [min(n, cache_keys)] the keys of the first positions
    __shared__ int hist[2048];
    __shared__ int scratch[64];
    __shared__ TopkDigit sel;
    const int t = blockIdx.x, tid = threadIdx.x;
    const int n = pos0 + t + 1, n_cached = min(n, cache_keys);
    const float* row = scores + (i64)t * s_stride;
    int* orow = out + (i64)t * k;
    // The first pass's bins, zeroed while the kernel before ends.
    for (int b = tid; b < 2048; b += TOPK_THREADS) hist[b] = 0;
    __syncthreads();
    pdl_enter();

    if (n <= k) {
        for (int i = tid; i < k; i += TOPK_THREADS) orow[i] = i < n ? i : -1;
        return;
    }
    // Radix select, 11 + 11 + 10 bits from the top: find the key of the k-th largest score.
    u32 prefix = 0, mask = 0;
    int remaining = k;
    for (int pass = 0; pass < 3; pass++) {
        const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0, bins = pass == 2 ? 1024 : 2048;
        topk_count<TOPK_THREADS>(row, 0, n, cached, n_cached, pass, prefix, mask, shift, bins,
                                 hist);
        __syncthreads();
        // Each bin is read by one thread, which zeroes it for the next pass (topk_select's
        // barriers come between).
        const int per = bins / TOPK_THREADS;
        int c[2] = {0, 0};
#pragma unroll
        for (int b = 0; b < 2; b++)
            if (b < per) {
                c[b] = hist[bins - 1 - per * tid - b];
                hist[bins - 1 - per * tid - b] = 0;
            }
        if (topk_select(c, bins, shift, prefix, mask, remaining, scratch, &sel)) break;
    }

    // Now, comparing keys under `mask` (the passes' bits; fewer where a pass's digit was taken
    // whole, then every key equal to prefix is taken), the placement (topk_place_from).
    int gt = 0, eq = 0;
    topk_place<true>(row, 0, cached, n_cached, n, prefix, mask, remaining, gt, eq, orow,
                     scratch);
}

#if __CUDA_ARCH__ >= 900
#define TOPK_CLUSTER_DIMS(C) __cluster_dims__(C, 1, 1)
#else
#define TOPK_CLUSTER_DIMS(C)
#endif

#if __CUDA_ARCH__ >= 900
// The int at `p` in this block's shared memory, read from the same place in block `rank`'s.
__device__ __forceinline__ int cluster_load(const int* p, int rank) {
    int v;
    asm volatile("ld.shared::cluster.s32 %0, [%1];" : "=r"(v) : "r"(cluster_addr(p, rank)) : "memory");
    return v;
}
#endif

// The kernel of a cluster of C blocks.
template <int C>
__device__ __forceinline__ void topk_rows_cluster(const float* scores, i64 s_stride, int pos0,
                                                  int k, int cache_keys, int* out) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(16) u32 cached[];  // [min(len, cache_keys)] the keys of the stretch's start
    __shared__ int hist[2][2048];    // by pass parity: the third pass zeroes the first's again
    __shared__ int scratch[64];
    __shared__ int warp_counts[2][32];  // by pass parity: the block's warp sums of its bins
    __shared__ int warp_gt[32], warp_eq[32];
    __shared__ int block_gt, block_eq, base_gt, base_eq;
    __shared__ TopkDigit sel;
    const int rank = blockIdx.x, t = blockIdx.y, tid = threadIdx.x, lane = tid & 31,
              warp = tid >> 5;
    const int n = pos0 + t + 1;
    const float* row = scores + (i64)t * s_stride;
    int* orow = out + (i64)t * k;
    // The first two passes' bins, zeroed while the kernel before ends.
    for (int b = tid; b < 2 * 2048; b += TOPK_THREADS) (&hist[0][0])[b] = 0;
    __syncthreads();
    pdl_enter();

    if (n <= k) {  // the whole cluster returns
        if (rank == 0)
            for (int i = tid; i < k; i += TOPK_THREADS) orow[i] = i < n ? i : -1;
        return;
    }
    // This block's stretch of the row: positions b0 .. b0 + len.
    const int stretch = ((n + C - 1) / C + 31) & ~31;
    const int b0 = min(rank * stretch, n), len = min(b0 + stretch, n) - b0;
    const int n_cached = min(len, cache_keys);

    // Radix select as topk_rows, each block counting its stretch.
    u32 prefix = 0, mask = 0;
    int remaining = k;
    for (int pass = 0; pass < 3; pass++) {
        const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0, bins = pass == 2 ? 1024 : 2048;
        int* h = hist[pass & 1];
        if (pass == 2) {  // no block reads the first pass's bins since the second's barrier
            for (int b = tid; b < bins; b += TOPK_THREADS) h[b] = 0;
            __syncthreads();
        }
        topk_count<TOPK_THREADS>(row, b0, len, cached, n_cached, pass, prefix, mask, shift, bins,
                                 h);
        __syncthreads();
        // The block's warp sums of its own bins, for the cluster's home warp.
        const int per = bins / TOPK_THREADS;  // 2 or 1
        int c[2] = {0, 0};
#pragma unroll
        for (int b = 0; b < 2; b++)
            if (b < per) c[b] = h[bins - 1 - per * tid - b];
        const int count = __reduce_add_sync(0xffffffffu, per == 2 ? c[0] + c[1] : c[0]);
        if (lane == 0) warp_counts[pass & 1][warp] = count;
        // Every block's counts and warp sums of this pass are in; the other parity's readers
        // (the pass before) are past this barrier too.
        cluster_sync();
        if (warp == 0) {
            int w = 0;
#pragma unroll
            for (int q = 0; q < C; q++) w += cluster_load(&warp_counts[pass & 1][lane], q);
            scratch[lane] = w;
        }
        __syncthreads();
        // Only the home warp reads every block's bins (its 32 or 64 of them): the remote reads
        // of a pass fall from 2048 C a block to 96 C.
        int before;
        if (warp == topk_home_warp(scratch, remaining, before)) {
#pragma unroll
            for (int b = 0; b < 2; b++) {
                if (b == per) break;
                const int d = bins - 1 - per * tid - b;
                c[b] = 0;
#pragma unroll
                for (int q = 0; q < C; q++) c[b] += cluster_load(h + d, q);
            }
            topk_warp_digit(c, bins, shift, prefix, remaining, before, &sel);
        }
        if (topk_take_digit(&sel, bins, shift, prefix, mask, remaining)) break;
    }

    // The placement of topk_rows within the stretch, after the keys of the blocks before it:
    // the block's counts first, then the cluster's before it.
    int above = 0, equal = 0;  // this thread's keys of the stretch
    topk_place<false>(row, b0, cached, n_cached, len, prefix, mask, remaining, above, equal,
                      orow, scratch);
    above = __reduce_add_sync(0xffffffffu, above);
    equal = __reduce_add_sync(0xffffffffu, equal);
    if (lane == 0) warp_gt[warp] = above, warp_eq[warp] = equal;
    __syncthreads();
    if (warp == 0) {
        const int sg = warp_sum_first(warp_gt, 32), se = warp_sum_first(warp_eq, 32);
        if (lane == 0) block_gt = sg, block_eq = se;
    }
    cluster_sync();  // every block's counts
    if (warp == 0) {
        int bg = lane < rank ? cluster_load(&block_gt, lane) : 0;
        int be = lane < rank ? cluster_load(&block_eq, lane) : 0;
        bg = __reduce_add_sync(0xffffffffu, bg);
        be = __reduce_add_sync(0xffffffffu, be);
        if (lane == 0) base_gt = bg, base_eq = be;
    }
    __syncthreads();
    // No block leaves (its counts unread) before all have read them: waited at the end.
    cluster_arrive();
    int gt = base_gt, eq = base_eq;
    topk_place<true>(row, b0, cached, n_cached, len, prefix, mask, remaining, gt, eq, orow,
                     scratch);
    cluster_wait();
#endif
}

// Clusters of 4 blocks take decode rows while a block's stretch fits its cache: fewer blocks
// to merge and wait for at each pass (lab, H200, the GLM-5 file's own rows of 16K / 24K / 49K
// keys: 16.3 / 16.2 / 16.8 us on 8 blocks, 11.7 / 12.2 / 16.0 on 4); 8 blocks take longer rows.
extern "C" __global__ void TOPK_CLUSTER_DIMS(4) __launch_bounds__(TOPK_THREADS, 1)
    topk_rows_cluster4(const float* scores, i64 s_stride, int pos0, int k, int cache_keys,
                       int* out) {
    topk_rows_cluster<4>(scores, s_stride, pos0, k, cache_keys, out);
}
extern "C" __global__ void TOPK_CLUSTER_DIMS(8) __launch_bounds__(TOPK_THREADS, 1)
    topk_rows_cluster8(const float* scores, i64 s_stride, int pos0, int k, int cache_keys,
                       int* out) {
    topk_rows_cluster<8>(scores, s_stride, pos0, k, cache_keys, out);
}
