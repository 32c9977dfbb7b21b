// MLA decode in its absorbed form: every head attends over the shared latent cache, so one
// query token reads each cache row once per group of heads instead of expanding K and V.
//
//   score(h, s) = (q[h, :dl] . c_kv[s] + q[h, dl:] . k_pe[s]) * scale
//   out[h] = softmax_s(score) . c_kv
//
// Query token t (grid.z) sits at position pos0 + t: q_lat row t [H, dl] (q_nope absorbed by
// W_UK), q_pe row t [H, dr]; cache: [S, dl + dr] rows [c_kv | k_pe]. Its keys are positions
// 0 ..= pos0 + t, or, when key_ids is not null, the n_ids entries of key_ids row t (DSA top-k;
// -1 entries, and entries past pos0 + t, are skipped).
//
// Long contexts are split over the sequence (flash decoding): mla_decode_split handles
// `keys_per_split` keys for a group of MLA_HB heads and writes an unnormalized partial result
// (running max m, sum l, acc = sum p c_kv); mla_decode_combine merges the splits.
//
// mla_decode_split: grid (ceil(H / MLA_HB), n_splits, T), block 256, no shared memory. Each
// warp owns two heads and walks the split's keys on its own (no block barriers): lane l holds
// dims l + 32 i of both heads' query and of both heads' accumulator in registers, reads dims
// l + 32 i of each key row (coalesced; the other warps of the block hit the same rows in L1),
// so one loaded cache value feeds 2 score FMAs and 2 accumulator FMAs. Keys are taken 32 at
// a time: one lane per key index checks it, a ballot lists the valid ones, so skipped DSA
// entries cost nothing. Online softmax per key; the rescale runs only when the max grows.
// dl % 32 == 0, dl <= 512, dr <= 64.

#define MLA_HB 16
#define MLA_DL_MAX 512
#define MLA_NL (MLA_DL_MAX / 32)  // latent dims per lane
#define MLA_NR 2                  // rope dims per lane (dr <= 64)

extern "C" __global__ void __launch_bounds__(256, 2) mla_decode_split(
    const float* q_lat, i64 ql_tok, const float* q_pe, i64 qp_tok, const float* cache, int dl,
    int dr, int n_heads, const int* key_ids, int n_ids, int pos0, int keys_per_split,
    float scale, float* part_acc, float* part_ml) {
    const int dk = dl + dr, nl = dl / 32;
    int split = blockIdx.y, t = blockIdx.z;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int h0 = blockIdx.x * MLA_HB + 2 * warp;  // this warp's heads: h0, h0 + 1
    if (h0 >= n_heads) return;
    bool two = h0 + 1 < n_heads;
    int last = pos0 + t;  // the newest visible key position
    const int* ids = key_ids ? key_ids + (i64)t * n_ids : nullptr;
    int n_keys = ids ? n_ids : last + 1;

    // Query dims of this lane, both heads (zero for a missing second head).
    float ql[2][MLA_NL], qr[2][MLA_NR];
#pragma unroll
    for (int e = 0; e < 2; e++) {
        bool he = e == 0 || two;
        const float* qle = q_lat + t * ql_tok + (i64)(h0 + e) * dl;
        const float* qpe = q_pe + t * qp_tok + (i64)(h0 + e) * dr;
#pragma unroll
        for (int i = 0; i < MLA_NL; i++) ql[e][i] = (he && i < nl) ? qle[lane + 32 * i] : 0.0f;
#pragma unroll
        for (int i = 0; i < MLA_NR; i++) {
            int d = lane + 32 * i;
            qr[e][i] = (he && d < dr) ? qpe[d] : 0.0f;
        }
    }

    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    float acc[2][MLA_NL];
#pragma unroll
    for (int i = 0; i < MLA_NL; i++) acc[0][i] = acc[1][i] = 0.0f;

    int j_begin = split * keys_per_split, j_end = min(n_keys, j_begin + keys_per_split);
    for (int j0 = j_begin; j0 < j_end; j0 += 32) {
        int j = j0 + lane;
        int s = j < j_end ? (ids ? ids[j] : j) : -1;
        u32 valid = __ballot_sync(0xffffffffu, s >= 0 && s <= last);
        while (valid) {
            int b = __ffs(valid) - 1;
            valid &= valid - 1;
            int sb = __shfl_sync(0xffffffffu, s, b);
            const float* row = cache + (i64)sb * dk;

            float c[MLA_NL], r[MLA_NR];
#pragma unroll
            for (int i = 0; i < MLA_NL; i++) c[i] = i < nl ? __ldg(row + lane + 32 * i) : 0.0f;
#pragma unroll
            for (int i = 0; i < MLA_NR; i++) {
                int d = lane + 32 * i;
                r[i] = d < dr ? __ldg(row + dl + d) : 0.0f;
            }
            float dot0 = 0.0f, dot1 = 0.0f;
#pragma unroll
            for (int i = 0; i < MLA_NL; i++) {
                dot0 += ql[0][i] * c[i];
                dot1 += ql[1][i] * c[i];
            }
#pragma unroll
            for (int i = 0; i < MLA_NR; i++) {
                dot0 += qr[0][i] * r[i];
                dot1 += qr[1][i] * r[i];
            }
            // Reduce both dots at once: lanes 0-15 end with head 0's, lanes 16-31 head 1's.
            bool upper = lane >= 16;
            float a = upper ? dot1 : dot0, o = upper ? dot0 : dot1;
            a += __shfl_xor_sync(0xffffffffu, o, 16);
            for (int off = 8; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
            float other = __shfl_xor_sync(0xffffffffu, a, 16);
            float sc[2];
            sc[0] = (upper ? other : a) * scale;
            sc[1] = (upper ? a : other) * scale;

#pragma unroll
            for (int e = 0; e < 2; e++) {
                if (sc[e] > m[e]) {  // the same in every lane: no divergence
                    float alpha = m[e] == NEG_INF ? 0.0f : expf(m[e] - sc[e]);
                    l[e] *= alpha;
#pragma unroll
                    for (int i = 0; i < MLA_NL; i++) acc[e][i] *= alpha;
                    m[e] = sc[e];
                }
                float p = expf(sc[e] - m[e]);
                l[e] += p;
#pragma unroll
                for (int i = 0; i < MLA_NL; i++) acc[e][i] += p * c[i];
            }
        }
    }

#pragma unroll
    for (int e = 0; e < 2; e++) {
        int he = h0 + e;
        if (he >= n_heads) continue;
        i64 base = ((i64)t * gridDim.y + split) * n_heads + he;
#pragma unroll
        for (int i = 0; i < MLA_NL; i++)
            if (i < nl) part_acc[base * dl + lane + 32 * i] = acc[e][i];
        if (lane == 0) {
            part_ml[base * 2] = m[e];
            part_ml[base * 2 + 1] = l[e];
        }
    }
}

// out[t, h, :] = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s, M = max_s m_s.
// grid (H, T), block 128; out row t starts at out + t * out_tok, head h at h * dl.
extern "C" __global__ void mla_decode_combine(const float* part_acc, const float* part_ml,
                                              int n_splits, int n_heads, int dl, float* out,
                                              i64 out_tok) {
    int h = blockIdx.x, t = blockIdx.y;
    part_acc += (i64)t * n_splits * n_heads * dl;
    part_ml += (i64)t * n_splits * n_heads * 2;
    float mx = NEG_INF;
    for (int s = 0; s < n_splits; s++) mx = fmaxf(mx, part_ml[((i64)s * n_heads + h) * 2]);
    float denom = 0.0f;
    for (int s = 0; s < n_splits; s++) {
        float ms = part_ml[((i64)s * n_heads + h) * 2];
        if (ms != NEG_INF) denom += expf(ms - mx) * part_ml[((i64)s * n_heads + h) * 2 + 1];
    }
    float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
    for (int d = threadIdx.x; d < dl; d += blockDim.x) {
        float sum = 0.0f;
        for (int s = 0; s < n_splits; s++) {
            float ms = part_ml[((i64)s * n_heads + h) * 2];
            if (ms != NEG_INF) sum += expf(ms - mx) * part_acc[((i64)s * n_heads + h) * dl + d];
        }
        out[t * out_tok + (i64)h * dl + d] = sum * inv;
    }
}
