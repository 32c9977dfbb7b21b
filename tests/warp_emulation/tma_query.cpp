// kernels/matvec.cu's q-LoRA pair on emulated blocks (block.h): matvec_tma_parts_<type> in its
// qsq mode (the query latent's tiles times its norm's weights, their sums of squares), then
// matvec_tma_query_<type> (q_b, its rows times the norm's factor, its last block writing the
// normed latent and the cache rows). Input (Input, in order): a LatentCase (latent_case.h) of
// a tile type, the parts' grid and shared bytes (i32), q_b (buffer), its rows (i32),
// row_bytes (i64), grid and shared bytes (i32). Prints the three parts' rows (the query's
// weighed), q_b's rows, the normed latent and the cache rows (LatentCase::put_cache_rows).
#include "latent_case.h"

int main(int argc, char** argv) {
    Input in(argv[1]);
    LatentCase c(in);
    const int grid = in.i32(), shared = in.i32();
    auto wb = in.buffer();
    const int rows_b = in.i32();
    const i64 row_bytes_b = in.i64_();
    const int grid_b = in.i32(), shared_b = in.i32();
    // One buffer for all the launches write: the parts' rows, the sums of squares, q_b's rows,
    // the normed latent, two cache rows and two key rows (the second of each the token's).
    const int tiles = (c.dq + 15) / 16;
    const size_t at_sq = c.dq + c.dkv + c.dk, at_b = at_sq + tiles, at_q = at_b + rows_b,
                 at_cache = at_q + c.dq, at_keys = at_cache + 2 * LATENT_DIMS,
                 n = at_keys + 2 * c.dk;
    std::vector<u8> out(4 * n);
    float* f = (float*)out.data();
    for (size_t i = 0; i < n; i++) f[i] = 1000.0f + i;  // the untouched rows' values
    const std::vector<u8> before = out;
    MatvecParts parts = c.parts(f, at_q, at_cache, at_keys);
    parts.qsq = f + at_sq;
    QueryRows qr{f + at_sq, tiles, parts.latent};
    auto parts_kernel = c.tma_parts_kernel();
    auto query_kernel = c.type == 0   ? matvec_tma_query_q4_k
                        : c.type == 1 ? matvec_tma_query_q6_k
                        : c.type == 2 ? matvec_tma_query_q5_k
                        : c.type == 3 ? matvec_tma_query_iq4_xs
                                      : matvec_tma_query_q8_0;
    launch((unsigned)grid, 288, shared, out, [&] {
        parts_kernel(ptr(c.w0), c.dq, c.k, c.row_bytes, ptr<float>(c.x), f, parts);
    });
    launch((unsigned)grid_b, 288, shared_b, out, [&] {
        query_kernel(ptr(wb), rows_b, c.dq, row_bytes_b, f + at_b, qr);
    });
    f = (float*)out.data();
    std::vector<u8> printed(4 * (at_sq + rows_b + c.dq + c.dl + c.dr + c.dk + 1));
    float* p = (float*)printed.data();
    std::memcpy(p, f, 4 * at_sq);
    std::memcpy(p + at_sq, f + at_b, 4 * (rows_b + c.dq));
    c.put_cache_rows(p + at_sq + rows_b + c.dq, out, before, at_cache, at_keys);
    print_f32(printed);
}
