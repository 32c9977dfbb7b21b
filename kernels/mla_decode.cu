// MLA decode in its absorbed form: every head attends over the shared latent cache, so one
// query token reads each cache row once per group of heads instead of expanding K and V.
//
//   score(h, s) = (q[h, :dl] . c_kv[s] + q[h, dl:] . k_pe[s]) * scale
//   out[h] = softmax_s(score) . c_kv
//
// Query token t (grid.z) sits at position pos0 + t: q_lat row t [H, dl] (q_nope absorbed by
// W_UK), q_pe row t [H, dr]; cache: [S, dl + dr] rows [c_kv | k_pe]. Its keys are positions
// 0 ..= pos0 + t, or, when key_ids is not null, the n_ids entries of key_ids row t (DSA top-k;
// -1 entries are skipped).
//
// Long contexts are split over the sequence (flash decoding): mla_decode_split handles
// `keys_per_split` keys for a group of MLA_HB heads and writes an unnormalized partial result
// (running max m, sum l, acc = sum p c_kv); mla_decode_combine merges the splits.
//
// mla_decode_split: grid (ceil(H / MLA_HB), n_splits, T), block 256 (8 warps, two heads each:
// lanes 0-15 score 16 keys for the first head, lanes 16-31 for the second); dynamic shared
// memory mla_decode_smem_bytes(): q rows [MLA_HB][dl + dr], key tile [MLA_BK][dl + dr + 1].
// dl % 32 == 0 and dl <= 512.

#define MLA_HB 16
#define MLA_BK 16
#define MLA_DL_MAX 512

extern "C" __global__ void __launch_bounds__(256) mla_decode_split(
    const float* q_lat, i64 ql_tok, const float* q_pe, i64 qp_tok, const float* cache, int dl,
    int dr, int n_heads, const int* key_ids, int n_ids, int pos0, int keys_per_split,
    float scale, float* part_acc, float* part_ml) {
    extern __shared__ float smem[];
    const int dk = dl + dr;
    float* qs = smem;                 // [MLA_HB][dk]
    float* cs = qs + MLA_HB * dk;     // [MLA_BK][dk + 1]

    int h0 = blockIdx.x * MLA_HB, split = blockIdx.y, t = blockIdx.z;
    int last = pos0 + t;  // the newest visible key position
    const int* ids = key_ids ? key_ids + (i64)t * n_ids : nullptr;
    int n_keys = ids ? n_ids : last + 1;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int half = lane >> 4, key = lane & 15;
    int hl = 2 * warp + half;  // this lane's head within the group (scoring)
    int h = h0 + hl;

    for (int i = tid; i < MLA_HB * dk; i += blockDim.x) {
        int r = i / dk, d = i % dk, hh = h0 + r;
        float val = 0.0f;
        if (hh < n_heads)
            val = d < dl ? q_lat[t * ql_tok + (i64)hh * dl + d] : q_pe[t * qp_tok + (i64)hh * dr + d - dl];
        qs[i] = val;
    }

    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    float acc[2][MLA_DL_MAX / 32];
#pragma unroll
    for (int i = 0; i < MLA_DL_MAX / 32; i++) acc[0][i] = acc[1][i] = 0.0f;

    int j_begin = split * keys_per_split, j_end = min(n_keys, j_begin + keys_per_split);
    for (int j0 = j_begin; j0 < j_end; j0 += MLA_BK) {
        __syncthreads();
        for (int i = tid; i < MLA_BK * dk; i += blockDim.x) {
            int r = i / dk, d = i % dk, j = j0 + r;
            int s = j < j_end ? (ids ? ids[j] : j) : -1;
            cs[r * (dk + 1) + d] = (s >= 0 && s <= last) ? cache[(i64)s * dk + d] : 0.0f;
        }
        __syncthreads();

        int j = j0 + key;
        bool ok = j < j_end && h < n_heads;
        if (ok && ids) ok = ids[j] >= 0 && ids[j] <= last;
        float score = NEG_INF;
        if (ok) {
            const float* qr = qs + hl * dk;
            const float* cr = cs + key * (dk + 1);
            float dot = 0.0f;
            for (int d = 0; d < dk; d++) dot += qr[d] * cr[d];
            score = dot * scale;
        }
        // Online softmax per head, over the 16 lanes of each half-warp.
        float tmax = score;
        for (int o = 8; o > 0; o >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
        float m_new = fmaxf(m[half], tmax);
        float p = (ok && m_new != NEG_INF) ? expf(score - m_new) : 0.0f;
        float alpha = m_new == NEG_INF ? 1.0f : expf(m[half] - m_new);
        float psum = p;
        for (int o = 8; o > 0; o >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, o);
        // Both heads' state lives in every lane of the warp: fetch the other half's values.
        float alpha_o = __shfl_xor_sync(0xffffffffu, alpha, 16);
        float m_new_o = __shfl_xor_sync(0xffffffffu, m_new, 16);
        float psum_o = __shfl_xor_sync(0xffffffffu, psum, 16);
        float al[2], mn[2], ps[2];
        al[half] = alpha, al[1 - half] = alpha_o;
        mn[half] = m_new, mn[1 - half] = m_new_o;
        ps[half] = psum, ps[1 - half] = psum_o;
#pragma unroll
        for (int e = 0; e < 2; e++) {
            l[e] = l[e] * al[e] + ps[e];
            m[e] = mn[e];
        }
        // acc[e][i] covers dim lane + 32 i of head 2 warp + e.
#pragma unroll
        for (int i = 0; i < MLA_DL_MAX / 32; i++) {
            acc[0][i] *= al[0];
            acc[1][i] *= al[1];
        }
        for (int kk = 0; kk < MLA_BK; kk++) {
            float p0 = __shfl_sync(0xffffffffu, p, kk);
            float p1 = __shfl_sync(0xffffffffu, p, 16 + kk);
            const float* cr = cs + kk * (dk + 1);
#pragma unroll
            for (int i = 0; i < MLA_DL_MAX / 32; i++) {
                int d = lane + 32 * i;
                if (d < dl) {
                    float c = cr[d];
                    acc[0][i] += p0 * c;
                    acc[1][i] += p1 * c;
                }
            }
        }
    }

#pragma unroll
    for (int e = 0; e < 2; e++) {
        int he = h0 + 2 * warp + e;
        if (he >= n_heads) continue;
        i64 base = ((i64)t * gridDim.y + split) * n_heads + he;
#pragma unroll
        for (int i = 0; i < MLA_DL_MAX / 32; i++) {
            int d = lane + 32 * i;
            if (d < dl) part_acc[base * dl + d] = acc[e][i];
        }
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
