// kernels/matvec.cu's parts launches with the latent's norms in their tails, on emulated
// blocks (block.h): type -1, as matvec_latent_<type> runs it (matvec_body, then parts_tail)
// with Q2_K rows (the tail is the same for every type); else matvec_tma_parts_<type> with
// `shared` bytes of dynamic shared memory. Input (Input, in order): a LatentCase
// (latent_case.h), grid, shared (i32). Prints the three parts' rows, the normed query, the
// cache rows (LatentCase::put_cache_rows) and the counters.
#include "latent_case.h"

int main(int argc, char** argv) {
    Input in(argv[1]);
    LatentCase c(in);
    const int grid = in.i32(), shared = in.i32();
    // One buffer for all the launch writes: the parts' rows, the query, two cache rows and two
    // key rows (the second of each the token's), the counters.
    const size_t at_q = c.dq + c.dkv + c.dk, at_cache = at_q + c.dq,
                 at_keys = at_cache + 2 * LATENT_DIMS, at_done = at_keys + 2 * c.dk,
                 n = at_done + 3;
    std::vector<u8> out(4 * n);
    float* f = (float*)out.data();
    for (size_t i = 0; i < at_done; i++) f[i] = 1000.0f + i;  // the untouched rows' values
    std::memset(f + at_done, 0, 12);
    const std::vector<u8> before = out;
    MatvecParts parts = c.parts(f, at_q, at_cache, at_keys);
    parts.done = (int*)(f + at_done);
    if (c.type < 0) {
        launch(Dim3{(unsigned)grid, c.dk ? 3u : 2u, 1}, 32 * MATVEC_WARPS, 0, out, [&] {
            matvec_body<256, 84, 4, piece_q2_k, false>(ptr(c.w0), 0, nullptr, c.dq, c.k,
                                                       c.row_bytes, ptr<float>(c.x), 1, 0, f,
                                                       0, parts);
            parts_tail(parts);
        });
    } else {
        auto kernel = c.tma_parts_kernel();
        launch((unsigned)grid, 288, shared, out, [&] {
            kernel(ptr(c.w0), c.dq, c.k, c.row_bytes, ptr<float>(c.x), f, parts);
        });
    }
    f = (float*)out.data();
    std::vector<u8> printed(4 * (at_cache + c.dl + c.dr + c.dk + 4));
    float* p = (float*)printed.data();
    std::memcpy(p, f, 4 * at_cache);
    p = c.put_cache_rows(p + at_cache, out, before, at_cache, at_keys);
    for (int i = 0; i < 3; i++) *p++ = (float)((int*)(f + at_done))[i];
    print_f32(printed);
}
