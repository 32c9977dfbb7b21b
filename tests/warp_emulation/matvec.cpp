// kernels/matvec.cu's CUDA-core matrix-vector body (matvec_body, as matvec_<type> runs it)
// with the Q2_K, Q3_K and Q5_0 pieces, on emulated blocks (block.h). Input (Input, in order):
// the type (i32: 0 Q2_K, 1 Q3_K, 2 Q5_0, 3 Q5_0 on half warps as matvec_half_q5_0), w
// (buffer), rows, k (i32), row_bytes (i64), x, y (buffers), grid and warps a block (i32);
// prints y.
int main(int argc, char** argv) {
    Input in(argv[1]);
    const int type = in.i32();
    auto w = in.buffer();
    const int rows = in.i32(), k = in.i32();
    const i64 row_bytes = in.i64_();
    auto x = in.buffer(), y = in.buffer();
    const int grid = in.i32(), warps = in.i32();
    launch(grid, 32 * warps, 0, y, [&] {
        const MatvecParts parts{};
        if (type == 0)
            matvec_body<256, 84, 4, piece_q2_k, false>(ptr(w), 0, nullptr, rows, k, row_bytes,
                                                       ptr<float>(x), 1, 0, ptr<float>(y), 0,
                                                       parts);
        else if (type == 1)
            matvec_body<256, 110, 4, piece_q3_k, false>(ptr(w), 0, nullptr, rows, k, row_bytes,
                                                        ptr<float>(x), 1, 0, ptr<float>(y), 0,
                                                        parts);
        else if (type == 2)
            matvec_body<32, 22, 4, piece_q5_0, false>(ptr(w), 0, nullptr, rows, k, row_bytes,
                                                      ptr<float>(x), 1, 0, ptr<float>(y), 0,
                                                      parts);
        else
            matvec_body<32, 22, 4, piece_q5_0, true>(ptr(w), 0, nullptr, rows, k, row_bytes,
                                                     ptr<float>(x), 1, 0, ptr<float>(y), 0,
                                                     parts);
    });
    print_f32(y);
}
