// MLA prefill attention in its expanded form: ordinary causal multi-head attention with the
// nope+rope head dims of DeepSeek (192 / 128) and GLM-5 (256 / 256), flash-style: keys stream
// through shared memory in tiles and each query keeps a running max, sum and output (online
// softmax), so no [T, S] score matrix exists. attention_prefill: f32 throughout (prompts of
// fewer than 16 rows, the backend's f32 path); attention_mma_<DQK>_<DV> (end of the file): the
// same on tensor cores with bf16 operands, for longer prompts.
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

// ---------------------------------------------------------------------------------------------
// attention_mma_<DQK>_<DV>: the same attention on tensor cores (mma.sync m16n8k16, bf16
// operands, f32 accumulation), for prompts the backend runs on its bf16 path (16 rows or more;
// shorter ones stay on attention_prefill, in f32). attention_bf16 first rounds q, the keys
// [k_nope | k_pe] and v to bf16, head-major ([heads][rows][D], D = DQK or DV, zero past the
// head's own dims), so that tiles copy by cp.async in 16-byte pieces and a query row is a
// contiguous run.
//
// Block: 4 warps, each 16 of the block's ATT_MMA_BQ = 64 queries, whose A fragments of Q K^T
// (DQK / 16 k16 steps x 4 registers) it holds for the whole block. Keys in tiles of BK through
// two shared stages, [BK][DQK + 8] keys and [BK][DV + 8] values (rows 16 bytes apart modulo
// 128: ldmatrix conflict-free); tile i + 1 is copied while tile i is multiplied, one barrier a
// tile. Per tile and warp: S [16, BK] = Q K^T (B fragments by ldmatrix from the key rows, as
// the weight rows of matmul_body), the online softmax in base 2 on S's C fragments (a lane's
// rows g and g + 8; a row's max over its 4 lanes by shuffles, its sum kept per lane and added
// up at the end), then O [16, DV] += P V, P's A fragments packed from S's C fragments (the
// m16n8 C layout of two key tiles is the m16k16 A layout) and V's B fragments by
// ldmatrix.trans. A warp whose queries see no key of a tile (past the diagonal) skips it.

#define ATT_MMA_BQ 64
#define ATT_MMA_THREADS 128

// dst[h][r][D] = bf16 of [a(r, h) (da values) | b(r, h) (db values) | zeros], rows r < rows,
// a(r, h) at a + r * a_tok + h * a_head (b likewise; unused where db = 0). A thread per 8.
extern "C" __global__ void attention_bf16(const float* a, i64 a_tok, i64 a_head, int da,
                                          const float* b, i64 b_tok, i64 b_head, int db,
                                          int rows, int heads, int D, u16* dst) {
    pdl_enter();
    const int pieces = D / 8;
    const i64 id = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (i64)heads * rows * pieces) return;
    const i64 hr = id / pieces;  // h * rows + r
    const int c = (int)(id % pieces), r = (int)(hr % rows), h = (int)(hr / rows);
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; e++) {
        const int d = 8 * c + e;
        v[e] = d < da        ? a[r * a_tok + h * a_head + d]
               : d < da + db ? b[r * b_tok + h * b_head + (d - da)]
                             : 0.0f;
    }
    *(uint4*)(dst + hr * D + 8 * c) = make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]),
                                                pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7]));
}

struct AttMmaArgs {
    const u16 *q, *k, *v;  // attention_bf16's: [heads][T][DQK], [heads][S][DQK], [heads][S][DV]
    float* out;
    const u32* mask;
    i64 o_tok, o_head;
    int dv, mask_words, T, S, pos0;
    float scale2;  // scale * log2 e
};

// Rows s0 .. s0 + BK of a head's [rows][D] bf16 at src into a stage [BK][D + 8] at shared
// address dst, 16 bytes a copy; zeros from row n_keys on.
template <int D, int BK>
__device__ __forceinline__ void att_copy_rows(u32 dst, const u16* src, int s0, int n_keys,
                                              int tid) {
    constexpr int COPIES = BK * D / 8;
    static_assert(COPIES % ATT_MMA_THREADS == 0, "whole rounds of copies");
#pragma unroll
    for (int i = 0; i < COPIES / ATT_MMA_THREADS; i++) {
        const int f = tid + i * ATT_MMA_THREADS, r = f / (D / 8), ch = f % (D / 8);
        const bool ok = s0 + r < n_keys;
        cp16(dst + 2 * (r * (D + 8) + 8 * ch), src + (i64)(ok ? s0 + r : 0) * D + 8 * ch, ok);
    }
}

template <int DQK, int DV, int BK>
__device__ __forceinline__ void attention_mma_body(const AttMmaArgs& a) {
    constexpr int KS = DQK + 8, VS = DV + 8;           // bf16 per shared row
    constexpr int KST = BK * KS, VST = BK * VS;         // bf16 per stage
    constexpr int QK = DQK / 16, NT = BK / 8, NV = DV / 8;
    static_assert(DQK % 16 == 0 && DV % 16 == 0 && BK % 32 == 0, "whole k16 steps, mask words");
    extern __shared__ __align__(16) u16 att_smem[];
    const u32 kbase = (u32)__cvta_generic_to_shared(att_smem);  // [2][BK][KS]
    const u32 vbase = kbase + 2 * 2 * KST;                       // [2][BK][VS]

    // The last query tiles have the most keys: blockIdx.y counts down so that they start first.
    const int h = blockIdx.x, t0 = (gridDim.y - 1 - blockIdx.y) * ATT_MMA_BQ;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c4 = lane & 3;
    const int q0 = t0 + 16 * warp;                        // this warp's first query
    const int q_last = min(a.T - 1, q0 + 15);             // and its last (< q0: none)
    const u16* kh = a.k + (i64)h * a.S * DQK;
    const u16* vh = a.v + (i64)h * a.S * DV;
    const int n_keys = a.pos0 + min(a.T, t0 + ATT_MMA_BQ);
    const int n_tiles = (n_keys + BK - 1) / BK;

    // Keys and values s0 .. s0 + BK into stage st (zeros from n_keys on).
    auto load = [&](int s0, int st) {
        att_copy_rows<DQK, BK>(kbase + 2 * st * KST, kh, s0, n_keys, tid);
        att_copy_rows<DV, BK>(vbase + 2 * st * VST, vh, s0, n_keys, tid);
    };
    if (n_tiles > 0) load(0, 0);
    cp_commit();

    // Q's A fragments: a0 (row g, dims 2 c4, + 1), a1 (row g + 8), a2 and a3 the same 8 dims on.
    u32 qf[QK][4];
    const u16* qh = a.q + (i64)h * a.T * DQK;
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int row = q0 + g + 8 * hh;
        const u32* qr = (const u32*)(qh + (i64)min(row, a.T - 1) * DQK) + c4;
#pragma unroll
        for (int kk = 0; kk < QK; kk++) {
            qf[kk][hh] = row < a.T ? qr[8 * kk] : 0u;
            qf[kk][2 + hh] = row < a.T ? qr[8 * kk + 4] : 0u;
        }
    }

    float o[NV][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < NV; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[n][e] = 0.0f;
    // ldmatrix lane addresses (bytes into a stage): keys as matmul_body's [n][k] weight rows,
    // values as its [k][n] (.trans) ones.
    const u32 k_lane = 2 * (((lane & 7) + (lane >> 4) * 8) * KS + ((lane >> 3) & 1) * 8);
    const u32 v_lane = 2 * (((lane & 7) + ((lane >> 3) & 1) * 8) * VS + (lane >> 4) * 8);

    for (int it = 0; it < n_tiles; it++) {
        const int st = it & 1, s0 = it * BK;
        cp_wait<0>();
        __syncthreads();  // tile it landed for all; tile it - 1's stage read by all
        if (it + 1 < n_tiles) load(s0 + BK, st ^ 1);
        cp_commit();
        if (q_last < q0 || s0 > a.pos0 + q_last) continue;  // warp-uniform: nothing visible

        float s[NT][4];
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[j][e] = 0.0f;
        const u32 kt = kbase + 2 * st * KST + k_lane;
#pragma unroll
        for (int kk = 0; kk < QK; kk++)
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                u32 r[4];
                ldsm_x4(r, kt + 2 * (8 * j * KS + 16 * kk));
                const u32 b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                mma_bf16_16816(s[j], qf[kk], b0);
                mma_bf16_16816(s[j + 1], qf[kk], b1);
            }

        // Visible: key s <= pos0 + row (and its DSA bit); the rest -inf. A tile below the
        // warp's diagonal without a mask needs no test.
        if (a.mask || q0 + 15 >= a.T || s0 + BK - 1 > a.pos0 + q0) {
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int row = q0 + g + 8 * hh;
                u32 bits[BK / 32];
#pragma unroll
                for (int w = 0; w < BK / 32; w++)
                    bits[w] = a.mask && row < a.T && (s0 >> 5) + w < a.mask_words
                                  ? a.mask[(i64)row * a.mask_words + (s0 >> 5) + w]
                                  : ~0u;
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int kj = 8 * j + 2 * c4 + e;
                        const bool vis = row < a.T && s0 + kj <= a.pos0 + row &&
                                         ((bits[kj >> 5] >> (kj & 31)) & 1);
                        if (!vis) s[j][2 * hh + e] = NEG_INF;
                    }
            }
        }
        // Online softmax in base 2 (m: the running max of score * scale2, per row). O is
        // rescaled only when a row of the warp has a new max (alpha exactly 1 for the others).
        float base[2], alpha[2];
        bool moved = false;
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            float mx = NEG_INF;
#pragma unroll
            for (int j = 0; j < NT; j++) mx = fmaxf(mx, fmaxf(s[j][2 * hh], s[j][2 * hh + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mt = fmaxf(m[hh], mx * a.scale2);  // scale2 > 0: -inf stays -inf
            // Nothing visible yet: every exponent -inf (p = 0) rather than NaN.
            base[hh] = mt == NEG_INF ? 0.0f : mt;
            alpha[hh] = mt == m[hh] ? 1.0f : ex2_approx(m[hh] - base[hh]);
            moved |= mt != m[hh];
            m[hh] = mt;
            l[hh] *= alpha[hh];
        }
        if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
            for (int n = 0; n < NV; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) o[n][e] *= alpha[e >> 1];
        }
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[j][e] = ex2_approx(fmaf(s[j][e], a.scale2, -base[e >> 1]));
                l[e >> 1] += s[j][e];
            }

        const u32 vt = vbase + 2 * st * VST + v_lane;
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            const u32 p[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]),
                              pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                              pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < NV; n += 2) {
                u32 r[4];
                ldsm_x4_trans(r, vt + 2 * (16 * kk * VS + 8 * n));
                const u32 b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                mma_bf16_16816(o[n], p, b0);
                mma_bf16_16816(o[n + 1], p, b1);
            }
        }
    }
    cp_wait<0>();

#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        float lt = l[hh];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        const int row = q0 + g + 8 * hh;
        if (row >= a.T) continue;
        const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
        float* orow = a.out + (i64)row * a.o_tok + (i64)h * a.o_head;
#pragma unroll
        for (int n = 0; n < NV; n++) {
            const int d = 8 * n + 2 * c4;
            if (d < a.dv) orow[d] = o[n][2 * hh] * inv;
            if (d + 1 < a.dv) orow[d + 1] = o[n][2 * hh + 1] * inv;
        }
    }
}

// Forms by padded head dims (ops.rs, attention_mma_form): the golden models' small heads,
// DeepSeek's 192 / 128, GLM-5's 256 / 256 (shared memory 36, 84 and 66 KiB).
#define ATTENTION_MMA(dqk, dv, bk)                                                             \
    extern "C" __global__ void __launch_bounds__(ATT_MMA_THREADS, 2)                           \
        attention_mma_##dqk##_##dv(const u16* q, const u16* k, const u16* v, float* out,       \
                                   i64 o_tok, i64 o_head, int dvv, const u32* mask,            \
                                   int mask_words, int T, int S, int pos0, float scale2) {     \
        pdl_enter();                                                                           \
        AttMmaArgs a = {q, k, v, out, mask, o_tok, o_head, dvv, mask_words, T, S, pos0, scale2}; \
        attention_mma_body<dqk, dv, bk>(a);                                                    \
    }
ATTENTION_MMA(64, 64, 64)
ATTENTION_MMA(192, 128, 64)
ATTENTION_MMA(256, 256, 32)
