// kernels/matvec.cu's matvec_tma_items_<type>, whole, on emulated blocks (block.h). Input
// (Input, in order): the type (i32: 0 Q4_K, 1 Q6_K, 2 Q5_K, 3 IQ4_XS, 4 Q8_0) and the block's threads
// (i32), w, sw (buffers), mat_stride (i64), ids (buffer of i32), items, rows, k (i32),
// row_bytes (i64), x (buffer), x_stride (i64), y (buffer), y_stride (i64), grid and dynamic
// shared bytes (i32); prints y.
int main(int argc, char** argv) {
    Input in(argv[1]);
    const int type = in.i32(), threads = in.i32();
    auto w = in.buffer(), sw = in.buffer();
    const i64 mat_stride = in.i64_();
    auto ids = in.buffer();
    const int items = in.i32(), rows = in.i32(), k = in.i32();
    const i64 row_bytes = in.i64_();
    auto x = in.buffer();
    const i64 x_stride = in.i64_();
    auto y = in.buffer();
    const i64 y_stride = in.i64_();
    const int grid = in.i32(), shared = in.i32();
    auto kernel = type == 0   ? matvec_tma_items_q4_k
                  : type == 1 ? matvec_tma_items_q6_k
                  : type == 2 ? matvec_tma_items_q5_k
                  : type == 3 ? matvec_tma_items_iq4_xs
                              : matvec_tma_items_q8_0;
    launch(grid, threads, shared, y, [&] {
        kernel(ptr(w), ptr(sw), mat_stride, ptr<int>(ids), items, rows, k, row_bytes,
               ptr<float>(x), x_stride, ptr<float>(y), y_stride);
    });
    print_f32(y);
}
