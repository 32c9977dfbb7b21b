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
// grid (ceil(T / ATT_BQ), heads), block 128; dynamic shared memory attention_smem_bytes() in
// src/backend/cuda/kernels.rs: q tile [BQ][dqk], k tile [BK][dqk + 1], v tile [BK][dv].
// dqk = dka + dkb <= 256, dv <= 256.

#define ATT_BQ 16
#define ATT_BK 32
#define ATT_DV_MAX 256

extern "C" __global__ void __launch_bounds__(128) attention_prefill(
    const float* q, i64 q_tok, i64 q_head, const float* ka, i64 ka_tok, i64 ka_head, int dka,
    const float* kb, i64 kb_tok, i64 kb_head, int dkb, const float* v, i64 v_tok, i64 v_head,
    int dv, float* out, i64 o_tok, i64 o_head, const u32* mask, int mask_words, int T, int pos0,
    float scale) {
    extern __shared__ float smem[];
    const int dqk = dka + dkb;
    float* qs = smem;                       // [ATT_BQ][dqk]
    float* ks = qs + ATT_BQ * dqk;          // [ATT_BK][dqk + 1]
    float* vs = ks + ATT_BK * (dqk + 1);    // [ATT_BK][dv]

    int h = blockIdx.y, t0 = blockIdx.x * ATT_BQ;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    for (int i = tid; i < ATT_BQ * dqk; i += blockDim.x) {
        int r = i / dqk, d = i % dqk;
        qs[i] = t0 + r < T ? q[(i64)(t0 + r) * q_tok + h * q_head + d] : 0.0f;
    }

    // Each warp owns 4 queries; lane j holds the score of key j of the tile, and output dims
    // lane + 32 i.
    const int QW = ATT_BQ / 4;
    float m[QW], l[QW], acc[QW][ATT_DV_MAX / 32];
#pragma unroll
    for (int a = 0; a < QW; a++) {
        m[a] = NEG_INF;
        l[a] = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_DV_MAX / 32; i++) acc[a][i] = 0.0f;
    }

    int t_last = min(T, t0 + ATT_BQ) - 1;
    int n_keys = pos0 + t_last + 1;
    for (int s0 = 0; s0 < n_keys; s0 += ATT_BK) {
        __syncthreads();  // the previous tile is consumed (and qs is written, first time)
        for (int i = tid; i < ATT_BK * dqk; i += blockDim.x) {
            int r = i / dqk, d = i % dqk, s = s0 + r;
            float val = 0.0f;
            if (s < n_keys)
                val = d < dka ? ka[(i64)s * ka_tok + h * ka_head + d]
                              : kb[(i64)s * kb_tok + h * kb_head + (d - dka)];
            ks[r * (dqk + 1) + d] = val;
        }
        for (int i = tid; i < ATT_BK * dv; i += blockDim.x) {
            int r = i / dv, d = i % dv, s = s0 + r;
            vs[i] = s < n_keys ? v[(i64)s * v_tok + h * v_head + d] : 0.0f;
        }
        __syncthreads();

#pragma unroll
        for (int a = 0; a < QW; a++) {
            int qi = warp * QW + a, t = t0 + qi;
            if (t >= T) continue;  // warp-uniform
            int s = s0 + lane;
            bool ok = s <= pos0 + t;
            if (ok && mask) ok = (mask[(i64)t * mask_words + (s >> 5)] >> (s & 31)) & 1;
            float score = NEG_INF;
            if (ok) {
                const float* qr = qs + qi * dqk;
                const float* kr = ks + lane * (dqk + 1);
                float dot = 0.0f;
                for (int d = 0; d < dqk; d++) dot += qr[d] * kr[d];
                score = dot * scale;
            }
            float m_new = fmaxf(m[a], warp_max(score));
            if (m_new == NEG_INF) continue;  // nothing visible yet (warp-uniform)
            float p = ok ? expf(score - m_new) : 0.0f;
            float alpha = expf(m[a] - m_new);
            l[a] = l[a] * alpha + warp_sum(p);
            m[a] = m_new;
#pragma unroll
            for (int i = 0; i < ATT_DV_MAX / 32; i++) acc[a][i] *= alpha;
            for (int j = 0; j < ATT_BK; j++) {
                float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
                for (int i = 0; i < ATT_DV_MAX / 32; i++) {
                    int d = lane + 32 * i;
                    if (d < dv) acc[a][i] += pj * vs[j * dv + d];
                }
            }
        }
    }

#pragma unroll
    for (int a = 0; a < QW; a++) {
        int t = t0 + warp * QW + a;
        if (t >= T) continue;
        float inv = l[a] > 0.0f ? 1.0f / l[a] : 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_DV_MAX / 32; i++) {
            int d = lane + 32 * i;
            if (d < dv) out[(i64)t * o_tok + h * o_head + d] = acc[a][i] * inv;
        }
    }
}
