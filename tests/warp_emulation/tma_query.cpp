// kernels/matvec.cu's q-LoRA pair on emulated blocks (block.h): matvec_tma_parts_<type> in its
// qsq mode (the query latent's tiles times its norm's weights, their sums of squares), then
// matvec_tma_query_<type> (q_b, its rows times the norm's factor, its last block writing the
// normed latent and the cache rows). Input (Input, in order): the type (i32: 0 Q4_K, 1 Q6_K,
// 2 Q5_K, 3 IQ4_XS), the rows of the query, kv and key parts (i32; no key part: 0), k (i32),
// row_bytes (i64), the three matrices, x, the query's norm, kv's norm, the key's norm weight
// and bias, inv_freq (buffers), dl, dr, pos (i32), mscale, eps, k_eps (f32), the parts' grid
// and shared bytes (i32), q_b (buffer), its rows (i32), row_bytes (i64), grid and shared bytes
// (i32). Prints the three parts' rows (the query's weighed), q_b's rows, the normed latent,
// the cache row's latent as x_hi + x_lo (dims 0 .. dl, then the rope's), the key's cache row,
// and 1 where the rows before both are untouched (else 0).
int main(int argc, char** argv) {
    Input in(argv[1]);
    const int type = in.i32();
    const int dq = in.i32(), dkv = in.i32(), dk = in.i32(), k = in.i32();
    const i64 row_bytes = in.i64_();
    auto w0 = in.buffer(), w1 = in.buffer(), w2 = in.buffer(), x = in.buffer();
    auto qw = in.buffer(), kvw = in.buffer(), kw = in.buffer(), kb = in.buffer();
    auto inv_freq = in.buffer();
    const int dl = in.i32(), dr = in.i32(), pos = in.i32();
    const float mscale = in.f32(), eps = in.f32(), k_eps = in.f32();
    const int grid = in.i32(), shared = in.i32();
    auto wb = in.buffer();
    const int rows_b = in.i32();
    const i64 row_bytes_b = in.i64_();
    const int grid_b = in.i32(), shared_b = in.i32();
    // One buffer for all the launches write: the parts' rows, the sums of squares, q_b's rows,
    // the normed latent, two cache rows and two key rows (the second of each the token's).
    const int tiles = (dq + 15) / 16;
    const size_t at_sq = dq + dkv + dk, at_b = at_sq + tiles, at_q = at_b + rows_b,
                 at_cache = at_q + dq, at_keys = at_cache + 2 * LATENT_DIMS,
                 n = at_keys + 2 * dk;
    std::vector<u8> out(4 * n);
    float* f = (float*)out.data();
    for (size_t i = 0; i < n; i++) f[i] = 1000.0f + i;  // the untouched rows' values
    const std::vector<u8> before = out;
    auto bind = [&](float* f, MatvecParts& parts, LatentNorm& a) {
        parts.w1 = ptr(w1), parts.w2 = ptr(w2);
        parts.rows1 = dkv, parts.rows2 = dk;
        parts.y1 = f + dq, parts.y2 = dk ? f + dq + dkv : nullptr;
        parts.qsq = f + at_sq;
        a.kv = parts.y1, a.w = ptr<float>(kvw), a.cache = (u16*)(f + at_cache) + 2 * LATENT_DIMS;
        a.inv_freq = ptr<float>(inv_freq);
        a.qx = f, a.qw = ptr<float>(qw), a.qy = f + at_q;
        a.kx = parts.y2, a.kw = ptr<float>(kw), a.kb = ptr<float>(kb);
        a.ky = dk ? f + at_keys + dk : nullptr;
        a.dl = dl, a.dr = dr, a.dq = dq, a.dk = dk, a.pos0 = pos;
        a.mscale = mscale, a.eps = eps, a.k_eps = k_eps;
    };
    auto parts_kernel = type == 0   ? matvec_tma_parts_q4_k
                        : type == 1 ? matvec_tma_parts_q6_k
                        : type == 2 ? matvec_tma_parts_q5_k
                                    : matvec_tma_parts_iq4_xs;
    auto query_kernel = type == 0   ? matvec_tma_query_q4_k
                        : type == 1 ? matvec_tma_query_q6_k
                        : type == 2 ? matvec_tma_query_q5_k
                                    : matvec_tma_query_iq4_xs;
    launch((unsigned)grid, 288, shared, out, [&] {
        float* f = (float*)out.data();
        MatvecParts parts{};
        bind(f, parts, parts.latent);
        parts_kernel(ptr(w0), dq, k, row_bytes, ptr<float>(x), f, parts);
    });
    launch((unsigned)grid_b, 288, shared_b, out, [&] {
        float* f = (float*)out.data();
        MatvecParts parts{};
        QueryRows qr{};
        bind(f, parts, qr.latent);
        qr.sq = f + at_sq, qr.tiles = tiles;
        query_kernel(ptr(wb), rows_b, dq, row_bytes_b, f + at_b, qr);
    });
    f = (float*)out.data();
    std::vector<u8> printed(4 * (at_sq + rows_b + dq + dl + dr + dk + 1));
    float* p = (float*)printed.data();
    std::memcpy(p, f, 4 * at_sq);
    p += at_sq;
    std::memcpy(p, f + at_b, 4 * (rows_b + dq));
    p += rows_b + dq;
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
    print_f32(printed);
}
