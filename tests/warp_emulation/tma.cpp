// kernels/matvec.cu's matvec_tma_<type>, whole, on emulated blocks (block.h). Input (Input, in
// order): the type (i32: 0 Q4_K, 1 Q6_K, 2 Q5_K, 3 IQ4_XS, 4 Q8_0), w, w2, sw, sw2 (buffers), mat_stride
// (i64), ids (buffer of i32), items, rows, k, kpart (i32), row_bytes (i64), x, y (buffers),
// y_stride (i64), glu (i32), y_part (i64: partials of spread parts by matvec_tma_spread_<type>,
// or 0), grid and dynamic shared bytes (i32); prints y.
int main(int argc, char** argv) {
    Input in(argv[1]);
    const int type = in.i32();
    auto w = in.buffer(), w2 = in.buffer(), sw = in.buffer(), sw2 = in.buffer();
    const i64 mat_stride = in.i64_();
    auto ids = in.buffer();
    const int items = in.i32(), rows = in.i32(), k = in.i32(), kpart = in.i32();
    const i64 row_bytes = in.i64_();
    auto x = in.buffer(), y = in.buffer();
    const i64 y_stride = in.i64_();
    const int glu = in.i32();
    const i64 y_part = in.i64_();
    const int grid = in.i32(), shared = in.i32();
    auto kernel = type == 0   ? matvec_tma_q4_k
                  : type == 1 ? matvec_tma_groups_q6_k
                  : type == 2 ? matvec_tma_q5_k
                  : type == 3 ? matvec_tma_iq4_xs
                              : matvec_tma_q8_0;
    auto spread = type == 0   ? matvec_tma_spread_q4_k
                  : type == 1 ? matvec_tma_spread_q6_k
                  : type == 2 ? matvec_tma_spread_q5_k
                  : type == 3 ? matvec_tma_spread_iq4_xs
                              : matvec_tma_spread_q8_0;
    launch(grid, 288, shared, y, [&] {
        if (y_part)
            spread(ptr(w), rows, k, kpart, row_bytes, ptr<float>(x), ptr<float>(y), y_part);
        else
            kernel(ptr(w), ptr(w2), ptr(sw), ptr(sw2), mat_stride, ptr<int>(ids), items, rows,
                   k, kpart, row_bytes, ptr<float>(x), ptr<float>(y), y_stride, glu);
    });
    print_f32(y);
}
