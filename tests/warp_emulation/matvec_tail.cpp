// kernels/matvec.cu's parts launches with the latent's norms in their tails, on emulated
// blocks (block.h): type -1, as matvec_latent_<type> runs it (matvec_body, then parts_tail)
// with Q2_K rows (the tail is the same for every type); else matvec_tma_parts_<type> (0
// Q4_K, 1 Q6_K, 2 Q5_K, 3 IQ4_XS) with `shared` bytes of dynamic shared memory. Input
// (Input, in order): the type, the rows of the query, kv and key parts (i32; no key part: 0),
// k (i32), row_bytes (i64), the three matrices, x, the query's norm, kv's norm, the key's
// norm weight and bias, inv_freq (buffers), dl, dr, pos (i32), mscale, eps, k_eps (f32),
// grid, shared (i32). Prints the three parts'
// rows, the normed query, the cache row's latent as x_hi + x_lo (dims 0 .. dl, then the rope's),
// the key's cache row, 1 where the rows before both are untouched (else 0), and the counters.
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
    // One buffer for all the launch writes: the parts' rows, the query, two cache rows and two
    // key rows (the second of each the token's), the counters.
    const size_t at_q = dq + dkv + dk, at_cache = at_q + dq, at_keys = at_cache + 2 * LATENT_DIMS,
                 at_done = at_keys + 2 * dk, n = at_done + 3;
    std::vector<u8> out(4 * n);
    float* f = (float*)out.data();
    for (size_t i = 0; i < at_done; i++) f[i] = 1000.0f + i;  // the untouched rows' values
    std::memset(f + at_done, 0, 12);
    const std::vector<u8> before = out;
    MatvecParts parts{};
    parts.w1 = ptr(w1), parts.w2 = ptr(w2);
    parts.rows1 = dkv, parts.rows2 = dk;
    parts.y1 = f + dq, parts.y2 = dk ? f + dq + dkv : nullptr;
    parts.done = (int*)(f + at_done);
    LatentNorm& a = parts.latent;
    a.kv = parts.y1, a.w = ptr<float>(kvw), a.cache = (u16*)(f + at_cache) + 2 * LATENT_DIMS;
    a.inv_freq = ptr<float>(inv_freq);
    a.qx = f, a.qw = ptr<float>(qw), a.qy = f + at_q;
    a.kx = parts.y2, a.kw = ptr<float>(kw), a.kb = ptr<float>(kb);
    a.ky = dk ? f + at_keys + dk : nullptr;
    a.dl = dl, a.dr = dr, a.dq = dq, a.dk = dk, a.pos0 = pos;
    a.mscale = mscale, a.eps = eps, a.k_eps = k_eps;
    if (type < 0) {
        launch(Dim3{(unsigned)grid, dk ? 3u : 2u, 1}, 32 * MATVEC_WARPS, 0, out, [&] {
            matvec_body<256, 84, 4, piece_q2_k, false>(ptr(w0), 0, nullptr, dq, k, row_bytes,
                                                       ptr<float>(x), 1, 0, f, 0, parts);
            parts_tail(parts);
        });
    } else {
        auto kernel = type == 0   ? matvec_tma_parts_q4_k
                      : type == 1 ? matvec_tma_parts_q6_k
                      : type == 2 ? matvec_tma_parts_q5_k
                                  : matvec_tma_parts_iq4_xs;
        launch((unsigned)grid, 288, shared, out, [&] {
            kernel(ptr(w0), dq, k, row_bytes, ptr<float>(x), f, parts);
        });
    }
    f = (float*)out.data();
    std::vector<u8> printed(4 * (at_cache + dl + dr + dk + 4));
    float* p = (float*)printed.data();
    std::memcpy(p, f, 4 * at_cache);
    p += at_cache;
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
    for (int i = 0; i < 3; i++) *p++ = (float)((int*)(f + at_done))[i];
    print_f32(printed);
}
