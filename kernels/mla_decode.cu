// MLA decode in its absorbed form: every head attends over the shared latent cache, so one
// query token reads each cache row once per group of heads instead of expanding K and V.
//
//   score(h, s) = (q[h, :dl] . c_kv[s] + q[h, dl:] . k_pe[s]) * scale
//   out[h] = softmax_s(score) . c_kv
//
// Query token t (grid.z) sits at position pos0 + t: q_lat row t [H, dl] (q_nope absorbed by
// W_UK), q_pe row t [H, dr] (heads qp_head apart: dr, or dn + dr inside the whole query);
// with qp_freq (the rope's inv_freq, and its cos/sin scale qp_mscale) q_pe is not roped yet
// and the kernel ropes it as it loads it, as rope_pairs does (the decode query: one launch
// fewer); null: roped already. cache: [S] rows of the latent cache format (common.cuh,
// LATENT_DIMS): [c_kv | k_pe] as bf16 hi and lo planes. Its keys are positions 0 ..= pos0 + t,
// or, when key_ids is not null, the n_ids entries of key_ids row t (DSA top-k; -1 entries, and
// entries past pos0 + t, are skipped).
//
// Long contexts are split over the sequence (flash decoding): mla_decode_split handles
// `keys_per_split` keys for a group of heads and writes an unnormalized partial result
// (running max m, sum l, acc = sum p c_kv); mla_decode_combine merges the splits (at most
// MLA_MAX_SPLITS, kernels.rs). With one split (a short context) the split kernel writes the
// output itself and there is no combine.
//
// mla_decode_split runs on tensor cores (mma.sync m16n8k16, bf16 operands, f32 accumulation)
// with split precision: every f32 operand x is carried as x_hi = bf16(x) and
// x_lo = bf16(x - x_hi) (the cache's values are stored that way, the query's and the scores'
// are split here), and a product as a_hi b_hi + a_hi b_lo + a_lo b_hi (3 mma). The
// dropped a_lo b_lo and the rounding of the lo parts leave ~2^-18 (rms) relative error per
// product, near f32 (plain bf16: ~2^-9): scores are off by ~1e-6 relative, the output's nmse
// against an f64 twin is ~1e-11 (3xTF32 would be closer to f32 at twice the tensor work).
//
// The softmax runs in base 2 on ex2.approx (scores scaled by log2 e; relative error ~2^-22);
// the partial maxima m are stored back in natural units for the combine.
//
// Grid (ceil(H / heads per block), n_splits, T), block MLA_THREADS = 8 warps, dynamic shared
// memory mla_decode_smem_bytes(MLA_BK) (kernels.rs). Two forms: mla_decode_split holds
// MLA_HB = 32 heads as two m16 tiles of 4 warps each (W = 4), mla_decode_split16 one tile of
// 16 heads on all 8 warps (W = 8: for few heads, as on a tensor-parallel rank, where the first
// form leaves half of its warps idle). Warp w works on head tile w / W and on part c = w % W of
// the dims (MlaWarp<W>):
//   scores S [16 heads, MLA_BK keys] = Q K^T: warp c sums latent dims D c .. D c + D
//     (D = 512 / W) and, for 16c < dr, rope dims 16c .. 16c + 16 (D / 16 + 1 k16 steps; its Q
//     fragments, hi and lo, stay in registers); the W partial S of a head tile meet in shared
//     memory and every warp adds them in the same order, so all W hold bit-identical scores
//     and softmax state.
//   out [16 heads, D dims of part c] += P [16, MLA_BK keys] V [MLA_BK keys, D dims]: P comes
//     straight from the score accumulators (the m16n8 C layout of two n8 key tiles is the
//     m16k16 A layout of one k16 step), V is the same shared tile as K, read through
//     ldmatrix.trans.
// Key tiles of MLA_BK cache rows (576 dims; the format's missing dims are zero) go as they
// are, hi and lo planes, into shared memory by cp.async, double-buffered: tile i + 1's copies
// are issued before the warps work on tile i and waited for after it, so no register holds
// them and nothing is converted (when the cache was f32 and each tile was split here, the
// split and its stores were a quarter of the kernel's time, and its loads held 36 registers).
// Two barriers per tile; the second (__syncthreads_or) also tells whether the next tile has any
// visible key, so DSA padding tiles cost no math. Invalid keys (past the split, -1 ids,
// positions after the query) are zero-filled rows scored -inf. dl % 32 == 0, dl <= 512,
// dr <= 64.
//
// MLA_BK, 16 or 32, comes before this file (kernels.rs, mla_keys_per_tile: 32 where a block
// may take the 166 KB its stages then need, sm_90 and sm_100). A tile's chain (scores, the
// partials' exchange, softmax, P V, two barriers) is latency: ncu (H100, DS3 at 8K, 16 keys)
// put it at 7.6 cycles between a warp's instructions with shared memory a third busy and the
// tensor pipe 27%; 32 keys carry twice the mma work a chain (DS3 8K 47.1 -> 42.4 us).

#define MLA_HB 32
static_assert(MLA_BK == 16 || MLA_BK == 32, "key tiles of one or two k16 steps");
#define MLA_NK (MLA_BK / 8)   // n8 key tiles of the scores
#define MLA_KP (MLA_BK / 16)  // k16 steps of P V
#define MLA_THREADS 256
#define MLA_DL_MAX 512
#define MLA_DR_MAX 64
static_assert(MLA_DL_MAX == LATENT_ROPE_AT && MLA_DL_MAX + MLA_DR_MAX == LATENT_DIMS,
              "a key tile's dims are the cache format's");
#define MLA_ROWB ((MLA_DL_MAX + MLA_DR_MAX + 8) * 2)  // bytes of one bf16 row (+16: no bank conflicts)
#define MLA_TILEB (MLA_BK * MLA_ROWB)                   // one hi or lo tile
#define MLA_STAGEB (2 * MLA_TILEB)                      // hi tile, then lo tile
#define MLA_XS_FLOATS (8 * 16 * MLA_BK)                  // partial scores of the 8 warps
#define MLA_MAX_SPLITS 1024                             // split weights mla_decode_combine holds
#define MLA_COMBINE_THREADS 512
#define MLA_LOG2E 1.4426950408889634f
#define MLA_LN2 0.6931471805599453f

__device__ __forceinline__ void mla_split2(float x0, float x1, u32& hi, u32& lo) {
    hi = pack_bf16x2(x0, x1);
    lo = pack_bf16x2(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
}

__device__ __forceinline__ void mla_mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mla_ldsm(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void mla_ldsm_t(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// The cache position of split key j (-1: not visible).
__device__ __forceinline__ int mla_key(const int* ids, int j, int j_end, int last) {
    if (j >= j_end) return -1;
    int s = ids ? __ldg(ids + j) : j;
    return s <= last ? s : -1;
}

// Key s (-1: zeros) into row kr of the stage at shared address `stage`: chunks sub + 16 i
// (i < 9) of the row's 144 16-byte chunks, 72 of the hi plane then 72 of the lo plane, into
// the stage's hi and lo tiles; one commit group.
__device__ __forceinline__ void mla_copy_key(u32 stage, const u8* cache, int s, int kr, int sub) {
    const int half = LATENT_ROW_BYTES / 32;  // chunks per plane
    const u8* row = cache + (i64)max(s, 0) * LATENT_ROW_BYTES;
    const u32 dst = stage + kr * MLA_ROWB;
#pragma unroll
    for (int i = 0; i < 9; i++) {
        const int c = sub + 16 * i, lo = c >= half;
        cp16(dst + lo * MLA_TILEB + 16 * (c - lo * half), row + 16 * c, s >= 0);
    }
    cp_commit();
}

// Query values d, d + 1 (d even) of head h at tile dims (latent below 512, rope from 512):
// where they lie, and how many of the two are in the row (0 outside it).
struct MlaQ {
    const float* p;
    int n;
};
__device__ __forceinline__ MlaQ mla_q_at(const float* ql, const float* qp, int qp_head, int h,
                                         int n_heads, int d, int dl, int dr) {
    const bool latent = d < MLA_DL_MAX;
    const int dd = latent ? d : d - MLA_DL_MAX;
    const float* p = latent ? ql + (i64)h * dl + dd : qp + (i64)h * qp_head + dd;
    return {p, h >= n_heads ? 0 : (latent ? dl : dr) - dd};
}

// One warp's share of a 16-head tile in the split kernels (W warps a tile): warp c sums
// latent dims D c .. D c + D of the scores (and, for 16c < dr, rope dims 16c .. 16c + 16) and
// owns those dims of the output. Rows grp and grp + 8 of the tile are this lane's.
template <int W>
struct MlaWarp {
    static constexpr int D = MLA_DL_MAX / W;  // latent dims per warp
    static constexpr int KL = D / 16;         // its latent k steps (a rope one follows)
    static constexpr int NT = D / 8;          // its output n8 tiles
    int c, grp, tig;
    bool rope;  // warp-uniform
    // Q fragments (A, m16k16) of the KL + 1 k steps, hi and lo: k step ks < KL covers latent
    // dims D c + 16ks, ks = KL rope dims 16c.
    u32 qh[KL + 1][4], qlo[KL + 1][4];
    // Running max, this thread's part of the sum, and out[row][D c + 8n + 2tig + {0, 1}] in
    // o[n][2r], o[n][2r + 1] (row grp + 8r).
    float m[2], l[2], o[NT][4];
    u32 ph[MLA_KP][4], plo[MLA_KP][4];  // P of the current key tile, A fragments of its k16 steps

    __device__ __forceinline__ MlaWarp(int c_, int lane, int dr)
        : c(c_), grp(lane >> 2), tig(lane & 3), rope(16 * c_ < dr) {
        m[0] = m[1] = NEG_INF;
        l[0] = l[1] = 0.0f;
#pragma unroll
        for (int n = 0; n < NT; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    }

    // The query of heads h_tile .. h_tile + 15 of token t (at position last), the kernels' q
    // arguments as they are, q_pe roped here where qp_freq is given.
    __device__ __forceinline__ void load_q(const float* q_lat, i64 ql_tok, const float* q_pe,
                                           i64 qp_tok, int qp_head, const float* qp_freq,
                                           float qp_mscale, int t, int h_tile, int n_heads,
                                           int dl, int dr, int last) {
        const float* ql = q_lat + t * ql_tok;
        const float* qp = q_pe + t * qp_tok;
        const bool pair = ((ql_tok | qp_tok | qp_head | dr) & 1) == 0 &&
                          (((unsigned long long)q_lat | (unsigned long long)q_pe) & 7) == 0;
        // The rope step's pairs of this lane: 8c + tig and 8c + tig + 4 (e >> 1), their
        // frequencies loaded with the query.
        const bool turn = qp_freq && rope;  // warp-uniform
        float freq[2] = {0.0f, 0.0f};
        if (turn) {
#pragma unroll
            for (int i = 0; i < 2; i++)
                freq[i] = __ldg(qp_freq + min(8 * c + tig + 4 * i, dr / 2 - 1));
        }
        // Every load before any value is used: with each value zeroed outside the row right
        // after its load, ptxas waited for each load before the next (20 round trips a lane
        // in the 16-head form; H100 lab, one split of 24 keys: the launch 10.8 -> 8.3 us, in
        // the decode chain 7.2-7.7 -> 6.7-6.8 us; docs/performance.md, thirty-ninth look).
        MlaQ at[KL + 1][4];
#pragma unroll
        for (int ks = 0; ks < KL + 1; ks++) {
            int d0 = ks < KL ? D * c + 16 * ks : MLA_DL_MAX + 16 * c;
#pragma unroll
            for (int e = 0; e < 4; e++)
                at[ks][e] = mla_q_at(ql, qp, qp_head, h_tile + grp + 8 * (e & 1), n_heads,
                                     d0 + 2 * tig + 8 * (e >> 1), dl, dr);
        }
        float2 qv[KL + 1][4];
        if (pair) {  // one 8-byte load, from q_lat's first value where the pair is outside
#pragma unroll
            for (int ks = 0; ks < KL + 1; ks++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    qv[ks][e] = __ldg((const float2*)(at[ks][e].n >= 2 ? at[ks][e].p : ql));
        } else {
#pragma unroll
            for (int ks = 0; ks < KL + 1; ks++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    qv[ks][e] = make_float2(__ldg(at[ks][e].n >= 1 ? at[ks][e].p : ql),
                                            __ldg(at[ks][e].n >= 2 ? at[ks][e].p + 1 : ql));
        }
        asm volatile("" ::: "memory");  // the loads above, the zeros below
#pragma unroll
        for (int ks = 0; ks < KL + 1; ks++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int n = at[ks][e].n;
                qv[ks][e] = make_float2(n >= 1 ? qv[ks][e].x : 0.0f, n >= 2 ? qv[ks][e].y : 0.0f);
            }
        if (turn) {  // two angles, each for the lane's two heads (e & 1)
            const float2 cs[2] = {rope_cos_sin((float)last, freq[0], qp_mscale),
                                  rope_cos_sin((float)last, freq[1], qp_mscale)};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float r[2];
                rope_turn(qv[KL][e].x, qv[KL][e].y, cs[e >> 1], r);
                qv[KL][e] = make_float2(r[0], r[1]);
            }
        }
#pragma unroll
        for (int ks = 0; ks < KL + 1; ks++)
#pragma unroll
            for (int e = 0; e < 4; e++) mla_split2(qv[ks][e].x, qv[ks][e].y, qh[ks][e], qlo[ks][e]);
    }

    // This warp's partial scores of the key tile (hi and lo tiles at shared khi, klo; qk_off
    // the lane's ldmatrix offset) into xw[(c * MLA_NK + n) * 32] (xw: the head tile's partials
    // at this lane); the three products in separate sums (independent mma chains).
    __device__ __forceinline__ void scores(u32 khi, u32 klo, u32 qk_off, float4* xw) const {
        float shh[MLA_NK][4], shl[MLA_NK][4], slh[MLA_NK][4];
#pragma unroll
        for (int n = 0; n < MLA_NK; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) shh[n][e] = shl[n][e] = slh[n][e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KL + 1; ks++) {
            if (ks == KL && !rope) break;
            int d0 = ks < KL ? D * c + 16 * ks : MLA_DL_MAX + 16 * c;
#pragma unroll
            for (int kp = 0; kp < MLA_KP; kp++) {
                u32 bh[4], bl[4];
                const u32 at = qk_off + kp * 16 * MLA_ROWB + 2 * d0;
                mla_ldsm(bh, khi + at);
                mla_ldsm(bl, klo + at);
#pragma unroll
                for (int n2 = 0; n2 < 2; n2++) {
                    const int n = 2 * kp + n2;
                    mla_mma(shl[n], qh[ks], bl[2 * n2], bl[2 * n2 + 1]);
                    mla_mma(slh[n], qlo[ks], bh[2 * n2], bh[2 * n2 + 1]);
                    mla_mma(shh[n], qh[ks], bh[2 * n2], bh[2 * n2 + 1]);
                }
            }
        }
#pragma unroll
        for (int n = 0; n < MLA_NK; n++)
            xw[(c * MLA_NK + n) * 32] = make_float4(shh[n][0] + (shl[n][0] + slh[n][0]),
                                                    shh[n][1] + (shl[n][1] + slh[n][1]),
                                                    shh[n][2] + (shl[n][2] + slh[n][2]),
                                                    shh[n][3] + (shl[n][3] + slh[n][3]));
    }

    // The tile's full scores from the W warps' partials (added in the order c = 0, 1, .. by
    // every warp, so all W hold bit-identical scores and softmax state), the keys' flags vf
    // (0: not visible, scored -inf), the online softmax, and P.
    __device__ __forceinline__ void softmax(const float4* xw, const int* vf, float scale2) {
        // sc[n][e]: row grp + 8 (e >> 1), key 8n + 2tig + (e & 1).
        float sc[MLA_NK][4];
#pragma unroll
        for (int n = 0; n < MLA_NK; n++) {
            float4 a = xw[n * 32];
#pragma unroll
            for (int cc = 1; cc < W; cc++) {
                float4 b = xw[(cc * MLA_NK + n) * 32];
                a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w;
            }
            bool v0 = vf[8 * n + 2 * tig], v1 = vf[8 * n + 2 * tig + 1];
            sc[n][0] = v0 ? a.x * scale2 : NEG_INF;
            sc[n][1] = v1 ? a.y * scale2 : NEG_INF;
            sc[n][2] = v0 ? a.z * scale2 : NEG_INF;
            sc[n][3] = v1 ? a.w * scale2 : NEG_INF;
        }
        // Per row (a row lives in the 4 lanes of a quad).
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float mx = fmaxf(sc[0][2 * r], sc[0][2 * r + 1]);
#pragma unroll
            for (int n = 1; n < MLA_NK; n++)
                mx = fmaxf(mx, fmaxf(sc[n][2 * r], sc[n][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            float mn = fmaxf(m[r], mx);
            float alpha = (mn == NEG_INF || m[r] == mn) ? 1.0f : ex2_approx(m[r] - mn);
            float base = mn == NEG_INF ? 0.0f : mn;
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < MLA_NK; n++)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; e++) {
                    sc[n][e] = ex2_approx(sc[n][e] - base);  // -inf -> 0
                    sum += sc[n][e];
                }
            m[r] = mn;
            l[r] = l[r] * alpha + sum;
            if (alpha != 1.0f) {
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    o[n][2 * r] *= alpha;
                    o[n][2 * r + 1] *= alpha;
                }
            }
        }
#pragma unroll
        for (int kp = 0; kp < MLA_KP; kp++) {
            mla_split2(sc[2 * kp][0], sc[2 * kp][1], ph[kp][0], plo[kp][0]);
            mla_split2(sc[2 * kp][2], sc[2 * kp][3], ph[kp][1], plo[kp][1]);
            mla_split2(sc[2 * kp + 1][0], sc[2 * kp + 1][1], ph[kp][2], plo[kp][2]);
            mla_split2(sc[2 * kp + 1][2], sc[2 * kp + 1][3], ph[kp][3], plo[kp][3]);
        }
    }

    // out += P V over this warp's dims: V is the key tile, read through ldmatrix.trans at the
    // lane's offset pv_off.
    __device__ __forceinline__ void values(u32 khi, u32 klo, u32 pv_off) {
#pragma unroll
        for (int kp = 0; kp < MLA_KP; kp++)
#pragma unroll
            for (int nb = 0; nb < NT / 2; nb++) {
                u32 a = pv_off + kp * 16 * MLA_ROWB + 2 * (D * c + 16 * nb);
                u32 vh[4], vl[4];
                mla_ldsm_t(vh, khi + a);
                mla_ldsm_t(vl, klo + a);
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    float* on = o[2 * nb + hf];
                    mla_mma(on, ph[kp], vl[2 * hf], vl[2 * hf + 1]);
                    mla_mma(on, plo[kp], vh[2 * hf], vh[2 * hf + 1]);
                    mla_mma(on, ph[kp], vh[2 * hf], vh[2 * hf + 1]);
                }
            }
    }

    // The split's partial result of heads h_tile .. (or, with one split, the output itself,
    // as mla_decode_combine would make it: the same operations, so the same bits).
    __device__ __forceinline__ void store(int h_tile, int n_heads, int dl, int t, int split,
                                          float* part_acc, float* part_ml, float* out,
                                          i64 out_tok) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
            int h = h_tile + grp + 8 * r;
            if (h >= n_heads) continue;
            if (gridDim.y == 1) {
                const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
                float* orow = out + t * out_tok + (i64)h * dl;
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    int d = D * c + 8 * n + 2 * tig;
                    if (d < dl)
                        *(float2*)(orow + d) =
                            make_float2(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
                }
                continue;
            }
            i64 base = ((i64)t * gridDim.y + split) * n_heads + h;
#pragma unroll
            for (int n = 0; n < NT; n++) {
                int d = D * c + 8 * n + 2 * tig;
                if (d < dl)
                    *(float2*)(part_acc + base * dl + d) = make_float2(o[n][2 * r], o[n][2 * r + 1]);
            }
            if (c == 0 && tig == 0) {
                part_ml[base * 2] = m[r] * MLA_LN2;
                part_ml[base * 2 + 1] = l[r];
            }
        }
    }
};

// ldmatrix row addresses (bytes from a tile's start) of a lane: 8-lane group li gives the
// rows of matrix li. K^T (QK): keys lr + 8 (li >> 1), dims + 8 (li & 1) -> b0, b1 of key
// tiles 0, 1. V (PV, .trans): keys lr + 8 (li & 1), dims + 8 (li >> 1) -> b0, b1 of dim
// tiles n0, n0 + 8.
__device__ __forceinline__ u32 mla_qk_off(int lane) {
    const int li = lane >> 3, lr = lane & 7;
    return (lr + 8 * (li >> 1)) * MLA_ROWB + 16 * (li & 1);
}
__device__ __forceinline__ u32 mla_pv_off(int lane) {
    const int li = lane >> 3, lr = lane & 7;
    return (lr + 8 * (li & 1)) * MLA_ROWB + 16 * (li >> 1);
}

// The split's keys of token t: j_begin .. j_end of its key list, in n_tiles tiles.
struct MlaSplit {
    int last, j_begin, j_end, n_tiles;
    const int* ids;
};
__device__ __forceinline__ MlaSplit mla_split_of(const int* key_ids, int n_ids, int pos0, int t,
                                                 int split, int keys_per_split) {
    MlaSplit s;
    s.last = pos0 + t;
    s.ids = key_ids ? key_ids + (i64)t * n_ids : nullptr;
    const int n_keys = s.ids ? n_ids : s.last + 1;
    s.j_begin = split * keys_per_split;
    s.j_end = min(n_keys, s.j_begin + keys_per_split);
    s.n_tiles = s.j_end > s.j_begin ? (s.j_end - s.j_begin + MLA_BK - 1) / MLA_BK : 0;
    return s;
}

template <int W>
__device__ __forceinline__ void mla_split_body(
    const float* q_lat, i64 ql_tok, const float* q_pe, i64 qp_tok, int qp_head,
    const float* qp_freq, float qp_mscale, const u8* cache, int dl, int dr, int n_heads,
    const int* key_ids, int n_ids, int pos0, int keys_per_split, float scale, float* part_acc,
    float* part_ml, float* out, i64 out_tok) {
    constexpr int HB = 16 * (8 / W);  // heads per block
    pdl_enter();
    extern __shared__ __align__(16) unsigned char mla_smem[];
    float4* xs = (float4*)(mla_smem + 2 * MLA_STAGEB);     // [head tile][c][n][lane]
    int* vflag = (int*)(mla_smem + 2 * MLA_STAGEB + 4 * MLA_XS_FLOATS);  // [stage][key]
    const u32 sbase = (u32)__cvta_generic_to_shared(mla_smem);

    const int split = blockIdx.y, t = blockIdx.z, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int ht = warp / W;
    const int h_tile = blockIdx.x * HB + 16 * ht;  // first head of this warp's tile
    const bool active = h_tile < n_heads;
    const MlaSplit sp = mla_split_of(key_ids, n_ids, pos0, t, split, keys_per_split);

    // Loader: thread tid copies keys kr, kr + 16 .. of a tile, 16 threads a key. The first
    // tile's copies go out before the query's loads, and all of those before the first use: a
    // short context is a few tiles, where each round trip to memory waited on alone was most of
    // the time (ncu, H200, DS3 at one key: half of the stall samples on the query's conversions).
    const int kr = tid >> 4, sub = tid & 15;
    bool vis_next = false;  // any of this thread's keys of the next tile visible
    if (sp.n_tiles > 0) {
#pragma unroll
        for (int kk = kr; kk < MLA_BK; kk += 16) {
            const int s = mla_key(sp.ids, sp.j_begin + kk, sp.j_end, sp.last);
            mla_copy_key(sbase, cache, s, kk, sub);
            if (sub == 0) vflag[kk] = s >= 0;
            vis_next |= s >= 0;
        }
    }
    MlaWarp<W> w(warp % W, lane, dr);
    w.load_q(q_lat, ql_tok, q_pe, qp_tok, qp_head, qp_freq, qp_mscale, t, h_tile, n_heads, dl,
             dr, sp.last);
    const u32 qk_off = mla_qk_off(lane), pv_off = mla_pv_off(lane);
    const float scale2 = scale * MLA_LOG2E;
    float4* xw = xs + (ht * W) * MLA_NK * 32 + lane;  // this head tile's partials, this lane

    cp_wait<0>();
    int any = __syncthreads_or(vis_next);
    for (int it = 0; it < sp.n_tiles; it++) {
        const int cur = it & 1;
        const bool more = it + 1 < sp.n_tiles;
        vis_next = false;
        if (more) {  // into the stage and flags that tile it - 1 left before the last barrier
#pragma unroll
            for (int kk = kr; kk < MLA_BK; kk += 16) {
                const int j = sp.j_begin + (it + 1) * MLA_BK + kk;
                const int s = mla_key(sp.ids, j, sp.j_end, sp.last);
                mla_copy_key(sbase + (cur ^ 1) * MLA_STAGEB, cache, s, kk, sub);
                if (sub == 0) vflag[(cur ^ 1) * MLA_BK + kk] = s >= 0;
                vis_next |= s >= 0;
            }
        }
        if (any) {  // block-uniform
            const u32 khi = sbase + cur * MLA_STAGEB, klo = khi + MLA_TILEB;
            if (active) w.scores(khi, klo, qk_off, xw);
            __syncthreads();
            if (active) {
                w.softmax(xw, vflag + cur * MLA_BK, scale2);
                w.values(khi, klo, pv_off);
            }
        }
        cp_wait<0>();
        any = __syncthreads_or(vis_next);
    }
    if (active) w.store(h_tile, n_heads, dl, t, split, part_acc, part_ml, out, out_tok);
}

#define MLA_SPLIT(name, W, BLOCKS)                                                          \
    extern "C" __global__ void __launch_bounds__(MLA_THREADS, BLOCKS) name(                   \
        const float* q_lat, i64 ql_tok, const float* q_pe, i64 qp_tok, int qp_head,           \
        const float* qp_freq, float qp_mscale, const u8* cache, int dl, int dr,               \
        int n_heads, const int* key_ids, int n_ids, int pos0, int keys_per_split,             \
        float scale, float* part_acc, float* part_ml, float* out, i64 out_tok) {              \
        mla_split_body<W>(q_lat, ql_tok, q_pe, qp_tok, qp_head, qp_freq, qp_mscale, cache, dl, \
                          dr, n_heads, key_ids, n_ids, pos0, keys_per_split, scale, part_acc,  \
                          part_ml, out, out_tok);                                             \
    }
MLA_SPLIT(mla_decode_split, 4, 1)
MLA_SPLIT(mla_decode_split16, 8, 1)
// The 16-head form held to 128 registers (no spills under nvcc, sm_90), so that two blocks
// share an SM where shared memory allows (the H200: 2 x 83 KiB), for long splits of few heads
// (Gpu::mla_decode_form); short ones lose by it (the first tile's latency).
MLA_SPLIT(mla_decode_split16x2, 8, 2)

// out[t, h, :] = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s, M = max_s m_s.
// grid (H, T, C), block of at most MLA_COMBINE_THREADS (ops.rs, mla_combine_shape); out row
// t starts at out + t * out_tok, head h at h * dl (both 16-byte aligned: dl % 4 == 0,
// out_tok % 4 == 0). Block z takes chunk z of the C (a power of two, dividing dl / 32) chunks
// of dims, so that few heads still fill the GPU. The block computes the split weights
// exp(m_s - M) once into shared memory (n_splits <= MLA_MAX_SPLITS). Thread tid sums float4 column tid % cols of its chunk (cols = dl / 4 / C)
// over the splits of its group g = tid / cols: g, g + G, ... (G groups), four splits' loads
// in flight per step; the groups' sums meet in shared memory, added in group order. A split
// without a visible key has weight 0 and zero partials.
extern "C" __global__ void __launch_bounds__(MLA_COMBINE_THREADS) mla_decode_combine(
    const float* part_acc, const float* part_ml, int n_splits, int n_heads, int dl, float* out,
    i64 out_tok) {
    pdl_enter();
    __shared__ float w[MLA_MAX_SPLITS];
    __shared__ float red[32];
    __shared__ float4 sums[MLA_COMBINE_THREADS];
    const int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x;
    const i64 first = (i64)t * n_splits * n_heads + h;  // (split 0, head h) of token t
    const float* ml = part_ml + first * 2;
    const int cols = dl / 4 / gridDim.z, groups = blockDim.x / cols, g = tid / cols;
    const int col = blockIdx.z * cols + tid % cols;  // float4 column of the head's row
    const i64 step = (i64)n_heads * dl / 4;          // float4s from one split to the next
    const float4* acc = (const float4*)(part_acc + first * dl) + col;
    // The thread's first four rows (splits g, g + groups, ...; clamped) go out with the
    // weights' loads, not a round trip after them.
    float4 a[4];
#pragma unroll
    for (int u = 0; u < 4; u++) a[u] = __ldg(acc + min(g + u * groups, n_splits - 1) * step);
    float mx = NEG_INF;
    for (int s = tid; s < n_splits; s += blockDim.x) mx = fmaxf(mx, ml[(i64)s * n_heads * 2]);
    mx = block_max(mx, red);
    float den = 0.0f;
    for (int s = tid; s < n_splits; s += blockDim.x) {
        float ms = ml[(i64)s * n_heads * 2];
        float e = ms == NEG_INF ? 0.0f : expf(ms - mx);
        w[s] = e;
        den += e * ml[(i64)s * n_heads * 2 + 1];
    }
    den = block_sum(den, red);  // ends with a barrier: w is visible
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (g < groups) {
        int s = g;
        bool loaded = true;  // a holds the rows of s, s + groups, ...
        for (; s + 3 * groups < n_splits; s += 4 * groups, loaded = false) {
#pragma unroll
            for (int u = 0; u < 4 && !loaded; u++) a[u] = __ldg(acc + (s + u * groups) * step);
#pragma unroll
            for (int u = 0; u < 4; u++) {
                float e = w[s + u * groups];
                sum.x += e * a[u].x, sum.y += e * a[u].y, sum.z += e * a[u].z, sum.w += e * a[u].w;
            }
        }
#pragma unroll
        for (int u = 0; u < 3; u++, s += groups) {  // fewer than 4 left
            if (s >= n_splits) break;
            float4 v = loaded ? a[u] : __ldg(acc + s * step);
            float e = w[s];
            sum.x += e * v.x, sum.y += e * v.y, sum.z += e * v.z, sum.w += e * v.w;
        }
    }
    sums[tid] = sum;
    __syncthreads();
    if (tid >= cols) return;
    for (int gg = 1; gg < groups; gg++) {
        float4 b = sums[tid + gg * cols];
        sum.x += b.x, sum.y += b.y, sum.z += b.z, sum.w += b.w;
    }
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
    *(float4*)(out + t * out_tok + (i64)h * dl + 4 * col) =
        make_float4(sum.x * inv, sum.y * inv, sum.z * inv, sum.w * inv);
}
