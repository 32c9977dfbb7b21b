// MLA prefill attention in its expanded form: ordinary causal multi-head attention with the
// nope+rope head dims of DeepSeek (192 / 128) and GLM-5 (256 / 256), flash-style: keys stream
// through shared memory in tiles and each query keeps a running max, sum and output (online
// softmax), so no [T, S] score matrix exists. f32 throughout.
//
// Query t (row t of q) sits at position pos0 + t and sees keys 0 ..= pos0 + t. The key of head
// h at position s is the concatenation [ka(s, h) (dka values) | kb(s, h) (dkb values)]: the
// per-head k_nope and the rope key k_pe that all heads share (kb_head = 0). `mask`, when not
// null, holds one bit per (query, key) ([T, mask_words] u32, bit s % 32 of word s / 32): DSA's
// top-k selection; a cleared bit hides the key.
//
// grid (heads, ceil(T / ATT_BQ)), block ATT_THREADS; dynamic shared memory
// attention_smem_bytes() in src/backend/cuda/kernels.rs: q tile [BQ][dqk + 4], k tile
// [BK][dqk + 4], v tile [BK][vw] with vw = 128 for dv <= 128, else 256. dqk = dka + dkb <= 256
// and a multiple of 4, dv <= 256.
//
// Work split, register-tiled like an SGEMM so that each shared-memory load feeds several FMAs:
// warp w owns queries 16 w .. 16 w + 16 of the block; lane = 8 qy + kx owns queries
// 16 w + qy + 4 b (b < 4). For scores it computes keys kx + 8 j (j < 2) of the tile, for the
// output dims 32 i + 4 kx + c (i < vw / 32, c < 4). The probabilities of a query row live in
// the 8 lanes of one qy, so P V gets them by shuffles. The +4 row padding of q and k puts the
// float4 rows that a warp reads together (consecutive queries, consecutive keys) in distinct
// banks.
//
// Tiles are copied with cp.async into separate k and v buffers, so that the next key tile
// lands while P V runs and the value tile lands while the scores run: two barriers a tile.

#define ATT_BQ 64
#define ATT_BK 16
#define ATT_THREADS 128

// Asynchronous 4-byte copy global -> shared (sm_80+). With `valid` false it reads nothing
// (src must still be a mapped address) and writes 0.
__device__ __forceinline__ void att_copy(float* dst, const float* src, bool valid) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src),
                 "r"(valid ? 4 : 0)
                 : "memory");
}

// This thread's copies have landed; a __syncthreads() must follow before others read them.
__device__ __forceinline__ void att_copy_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

struct AttArgs {
    const float *q, *ka, *kb, *v;
    float* out;
    const u32* mask;
    i64 q_tok, q_head, ka_tok, ka_head, kb_tok, kb_head, v_tok, v_head, o_tok, o_head;
    int dka, dkb, dv, mask_words, T, pos0;
    float scale;
};

// Keys s0 .. s0 + BK into ks (rows `stride` apart); rows at or past n_keys become 0.
__device__ __forceinline__ void att_load_keys(const AttArgs& a, float* ks, int stride, int s0,
                                              int n_keys, int h, int warp, int lane) {
    const int dqk = a.dka + a.dkb;
    for (int r = warp; r < ATT_BK; r += ATT_THREADS / 32) {
        int s = s0 + r;
        bool ok = s < n_keys;
        i64 sr = ok ? s : 0;
        const float* ra = a.ka + sr * a.ka_tok + h * a.ka_head;
        const float* rb = a.kb + sr * a.kb_tok + h * a.kb_head;
        for (int d = lane; d < dqk; d += 32)
            att_copy(ks + r * stride + d, d < a.dka ? ra + d : rb + (d - a.dka), ok);
    }
}

// Values s0 .. s0 + BK into vs ([BK][vw]); rows at or past n_keys and dims past dv become 0,
// so that a zero probability never meets a stale NaN.
__device__ __forceinline__ void att_load_values(const AttArgs& a, float* vs, int vw, int s0,
                                                int n_keys, int h, int warp, int lane) {
    for (int r = warp; r < ATT_BK; r += ATT_THREADS / 32) {
        int s = s0 + r;
        bool ok = s < n_keys;
        const float* rv = a.v + (ok ? s : 0) * a.v_tok + h * a.v_head;
        for (int d = lane; d < vw; d += 32)
            att_copy(vs + r * vw + d, d < a.dv ? rv + d : rv, ok && d < a.dv);
    }
}

// The whole block with output dims tiled as NC chunks of 32 (vw = 32 NC): NC = 4 serves
// dv <= 128 without paying for the 256-wide tile.
template <int NC>
__device__ __forceinline__ void attention_block(const AttArgs& a) {
    extern __shared__ float4 smem4[];
    const int dqk = a.dka + a.dkb, stride = dqk + 4, vw = 32 * NC;
    float* qs = (float*)smem4;        // [ATT_BQ][stride]
    float* ks = qs + ATT_BQ * stride;  // [ATT_BK][stride]
    float* vs = ks + ATT_BK * stride;  // [ATT_BK][vw]

    // The last query tiles have the most keys; blockIdx.y counts down so that they start
    // first and the short ones fill the tail.
    const int h = blockIdx.x, t0 = (gridDim.y - 1 - blockIdx.y) * ATT_BQ;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, qy = lane >> 3, kx = lane & 7;
    const int q_first = warp * 16 + qy;  // this thread's queries: q_first + 4 b

    for (int r = warp; r < ATT_BQ; r += ATT_THREADS / 32) {
        bool ok = t0 + r < a.T;
        const float* rq = a.q + (ok ? t0 + r : 0) * a.q_tok + h * a.q_head;
        for (int d = lane; d < dqk; d += 32) att_copy(qs + r * stride + d, rq + d, ok);
    }
    const int n_keys = a.pos0 + min(a.T, t0 + ATT_BQ);
    att_load_keys(a, ks, stride, 0, n_keys, h, warp, lane);

    float m[4], l[4], acc[4][NC][4];
#pragma unroll
    for (int b = 0; b < 4; b++) {
        m[b] = NEG_INF;
        l[b] = 0.0f;  // this lane's part; the 8 lanes of the row add up at the end
#pragma unroll
        for (int i = 0; i < NC; i++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[b][i][c] = 0.0f;
    }

    for (int s0 = 0; s0 < n_keys; s0 += ATT_BK) {
        // Bit k of vis[b]: key s0 + k is causal for query b and kept by the DSA mask.
        u32 vis[4];
#pragma unroll
        for (int b = 0; b < 4; b++) {
            int t = t0 + q_first + 4 * b, lim = a.pos0 + t - s0;
            u32 bits = 0;
            if (t < a.T && lim >= 0) {
                bits = lim >= ATT_BK - 1 ? (1u << ATT_BK) - 1 : (2u << lim) - 1;
                if (a.mask) bits &= a.mask[(i64)t * a.mask_words + (s0 >> 5)] >> (s0 & 31);
            }
            vis[b] = bits;
        }
        // A warp with no visible key in the tile (past the diagonal, or masked) skips it.
        const bool live = __any_sync(0xffffffffu, vis[0] | vis[1] | vis[2] | vis[3]);

        att_copy_wait();
        __syncthreads();  // k tile (and q, first time) landed; everyone is done with the v tile
        att_load_values(a, vs, vw, s0, n_keys, h, warp, lane);

        float p[4][2];  // scores, then probabilities, of keys kx + 8 j
        if (live) {
#pragma unroll
            for (int b = 0; b < 4; b++) p[b][0] = p[b][1] = 0.0f;
            const float* qr = qs + q_first * stride;
            const float* kr = ks + kx * stride;
            for (int d = 0; d < dqk; d += 4) {
                float4 qv[4], kv[2];
#pragma unroll
                for (int b = 0; b < 4; b++) qv[b] = *(const float4*)(qr + 4 * b * stride + d);
#pragma unroll
                for (int j = 0; j < 2; j++) kv[j] = *(const float4*)(kr + 8 * j * stride + d);
#pragma unroll
                for (int b = 0; b < 4; b++)
#pragma unroll
                    for (int j = 0; j < 2; j++) {
                        float s = p[b][j];
                        s = fmaf(qv[b].x, kv[j].x, s);
                        s = fmaf(qv[b].y, kv[j].y, s);
                        s = fmaf(qv[b].z, kv[j].z, s);
                        p[b][j] = fmaf(qv[b].w, kv[j].w, s);
                    }
            }

#pragma unroll
            for (int b = 0; b < 4; b++) {
                float mt = NEG_INF;
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    p[b][j] = (vis[b] >> (kx + 8 * j)) & 1 ? p[b][j] * a.scale : NEG_INF;
                    mt = fmaxf(mt, p[b][j]);
                }
#pragma unroll
                for (int o = 1; o < 8; o <<= 1)
                    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
                float m_new = fmaxf(m[b], mt);
                // Nothing visible yet: keep every exponent -inf (p = 0) rather than NaN.
                float base = m_new == NEG_INF ? 0.0f : m_new;
                float alpha = expf(m[b] - base);
                m[b] = m_new;
                l[b] *= alpha;
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    p[b][j] = expf(p[b][j] - base);
                    l[b] += p[b][j];
                }
#pragma unroll
                for (int i = 0; i < NC; i++)
#pragma unroll
                    for (int c = 0; c < 4; c++) acc[b][i][c] *= alpha;
            }
        }

        att_copy_wait();
        __syncthreads();  // v tile landed; everyone is done with the k tile
        if (s0 + ATT_BK < n_keys) att_load_keys(a, ks, stride, s0 + ATT_BK, n_keys, h, warp, lane);

        if (live) {
            const float* vc = vs + 4 * kx;
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int src = 0; src < 8; src++) {
                    const float* vr = vc + (src + 8 * j) * vw;
                    float pk[4];
#pragma unroll
                    for (int b = 0; b < 4; b++)
                        pk[b] = __shfl_sync(0xffffffffu, p[b][j], (lane & ~7) | src);
#pragma unroll
                    for (int i = 0; i < NC; i++) {
                        float4 vv = *(const float4*)(vr + 32 * i);
#pragma unroll
                        for (int b = 0; b < 4; b++) {
                            acc[b][i][0] = fmaf(pk[b], vv.x, acc[b][i][0]);
                            acc[b][i][1] = fmaf(pk[b], vv.y, acc[b][i][1]);
                            acc[b][i][2] = fmaf(pk[b], vv.z, acc[b][i][2]);
                            acc[b][i][3] = fmaf(pk[b], vv.w, acc[b][i][3]);
                        }
                    }
                }
        }
    }

#pragma unroll
    for (int b = 0; b < 4; b++) {
        float lt = l[b];
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) lt += __shfl_xor_sync(0xffffffffu, lt, o);
        int t = t0 + q_first + 4 * b;
        if (t >= a.T) continue;
        float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
        float* o = a.out + (i64)t * a.o_tok + h * a.o_head;
#pragma unroll
        for (int i = 0; i < NC; i++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int d = 32 * i + 4 * kx + c;
                if (d < a.dv) o[d] = acc[b][i][c] * inv;
            }
    }
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_prefill(
    const float* q, i64 q_tok, i64 q_head, const float* ka, i64 ka_tok, i64 ka_head, int dka,
    const float* kb, i64 kb_tok, i64 kb_head, int dkb, const float* v, i64 v_tok, i64 v_head,
    int dv, float* out, i64 o_tok, i64 o_head, const u32* mask, int mask_words, int T, int pos0,
    float scale) {
    pdl_enter();
    AttArgs a = {q,      ka,     kb,      v,     out,     mask,    q_tok,      q_head,
                 ka_tok, ka_head, kb_tok, kb_head, v_tok, v_head, o_tok,      o_head,
                 dka,    dkb,    dv,      mask_words, T,  pos0,    scale};
    if (dv <= 128)
        attention_block<4>(a);
    else
        attention_block<8>(a);
}
