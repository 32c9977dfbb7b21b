// What the parts harnesses (matvec_tail.cpp, tma_query.cpp) share, after the kernels' pieces:
// a token's q_a, kv_a and index key with the latent's norms as warp_emulation.rs's LatentCase
// writes them (Input, in order: the type (i32: -1 the CUDA-core kernel on Q2_K rows, else 0
// Q4_K, 1 Q6_K, 2 Q5_K, 3 IQ4_XS, 4 Q8_0), the rows of the query, kv and key parts (i32; no
// key part: 0), k (i32), row_bytes (i64), the three matrices, x, the query's norm, kv's norm, the key's
// norm weight and bias, inv_freq (buffers), dl, dr, pos (i32), mscale, eps, k_eps (f32)), and
// what they print of the cache rows.
struct LatentCase {
    int type, dq, dkv, dk, k;
    i64 row_bytes;
    std::vector<u8> w0, w1, w2, x, qw, kvw, kw, kb, inv_freq;
    int dl, dr, pos;
    float mscale, eps, k_eps;
    // Members in the input's order: C++ initializes them in declaration order.
    explicit LatentCase(Input& in)
        : type(in.i32()), dq(in.i32()), dkv(in.i32()), dk(in.i32()), k(in.i32()),
          row_bytes(in.i64_()), w0(in.buffer()), w1(in.buffer()), w2(in.buffer()),
          x(in.buffer()), qw(in.buffer()), kvw(in.buffer()), kw(in.buffer()), kb(in.buffer()),
          inv_freq(in.buffer()), dl(in.i32()), dr(in.i32()), pos(in.i32()), mscale(in.f32()),
          eps(in.f32()), k_eps(in.f32()) {}
    // The parts launch's items 1 and 2 and the norms over f: the parts' rows at 0, the normed
    // query at at_q, two latent cache rows at at_cache and two key rows at at_keys (the second
    // of each the token's).
    MatvecParts parts(float* f, size_t at_q, size_t at_cache, size_t at_keys) {
        MatvecParts parts{};
        parts.w1 = ptr(w1), parts.w2 = ptr(w2);
        parts.rows1 = dkv, parts.rows2 = dk;
        parts.y1 = f + dq, parts.y2 = dk ? f + dq + dkv : nullptr;
        LatentNorm& a = parts.latent;
        a.kv = parts.y1, a.w = ptr<float>(kvw), a.cache = (u16*)(f + at_cache) + 2 * LATENT_DIMS;
        a.inv_freq = ptr<float>(inv_freq);
        a.qx = f, a.qw = ptr<float>(qw), a.qy = f + at_q;
        a.kx = parts.y2, a.kw = ptr<float>(kw), a.kb = ptr<float>(kb);
        a.ky = dk ? f + at_keys + dk : nullptr;
        a.dl = dl, a.dr = dr, a.dq = dq, a.dk = dk, a.pos0 = pos;
        a.mscale = mscale, a.eps = eps, a.k_eps = k_eps;
        return parts;
    }
    // matvec_tma_parts_<type> of the case's tile type (type >= 0).
    auto tma_parts_kernel() const {
        return type == 0   ? matvec_tma_parts_q4_k
               : type == 1 ? matvec_tma_parts_q6_k
               : type == 2 ? matvec_tma_parts_q5_k
               : type == 3 ? matvec_tma_parts_iq4_xs
                           : matvec_tma_parts_q8_0;
    }
    // Appends at p what out holds of the token's cache rows (laid out as parts() says): the
    // latent as x_hi + x_lo (dims 0 .. dl, then the rope's), the key's row, then 1 where the
    // rows before both are as in `before` (else 0). Returns the end.
    float* put_cache_rows(float* p, const std::vector<u8>& out, const std::vector<u8>& before,
                          size_t at_cache, size_t at_keys) const {
        const float* f = (const float*)out.data();
        const u16* row = (const u16*)(f + at_cache) + 2 * LATENT_DIMS;
        for (int i = 0; i < dl + dr; i++) {
            const int d = i < dl ? i : LATENT_ROPE_AT + i - dl;
            *p++ = bf16_to_f32(row[d]) + bf16_to_f32(row[LATENT_DIMS + d]);
        }
        std::memcpy(p, f + at_keys + dk, 4 * dk);
        p += dk;
        const size_t row0 = 4 * at_cache, row0_bytes = 4 * LATENT_DIMS, keys0 = 4 * at_keys;
        *p++ = std::memcmp(&out[row0], &before[row0], row0_bytes) == 0 &&
                       std::memcmp(&out[keys0], &before[keys0], 4 * dk) == 0
                   ? 1.0f
                   : 0.0f;
        return p;
    }
};
