// kernels/matmul.cu's prefill products as ops.rs runs them, on emulated blocks (block.h):
// matmul_xprep, then matmul_cp_<type> (plain, split over k when splits > 1, then
// matmul_splitk_sum) or matmul_cp_spans_<type> (grouped). Input (Input, in order): the kernel
// (i32: 0 matmul_cp_q4_k, 1 matmul_cp_q8_0, 2 matmul_cp_spans_q4_k, 3 matmul_cp_spans_q8_0,
// 4 matmul_cp_spans64_q4_k),
// w (buffer), row_bytes (i64), x (buffer of f32), x_rows (i32), row_ids (buffer of i32), y
// (buffer), y_stride (i64), M, N, K (i32), spans (buffer of i32), n_spans (i32), mat_stride
// (i64), tiles_m, ksteps, splits, threads, block columns, dynamic shared bytes (i32); prints y.
int main(int argc, char** argv) {
    Input in(argv[1]);
    const int kernel = in.i32();
    auto w = in.buffer();
    const i64 row_bytes = in.i64_();
    auto x = in.buffer();
    const int x_rows = in.i32();
    auto row_ids = in.buffer(), y = in.buffer();
    const i64 y_stride = in.i64_();
    const int M = in.i32(), N = in.i32(), K = in.i32();
    auto spans = in.buffer();
    const int n_spans = in.i32();
    const i64 mat_stride = in.i64_();
    const int tiles_m = in.i32(), ksteps = in.i32(), splits = in.i32(), threads = in.i32();
    const int bn = in.i32(), shared = in.i32();
    const bool grouped = kernel >= 2;
    const unsigned span_bm = kernel == 4 ? 64 : 32;
    auto cp = kernel == 0   ? matmul_cp_q4_k
              : kernel == 1 ? matmul_cp_q8_0
              : kernel == 2 ? matmul_cp_spans_q4_k
              : kernel == 3 ? matmul_cp_spans_q8_0
                            : matmul_cp_spans64_q4_k;

    // X as bf16 in the kernels' k order: plain mode gathers the rows, grouped mode converts
    // X's rows as they are.
    const int rows = grouped ? x_rows : M;
    std::vector<u8> xb(2 * (size_t)rows * K);
    launch(((i64)rows * K / 32 + 255) / 256, 256, 0, xb, [&] {
        matmul_xprep(ptr<float>(x), K, grouped ? nullptr : ptr<int>(row_ids), rows, K,
                     ptr<u16>(xb));
    });
    if (grouped) {
        launch(Dim3{(unsigned)((N + bn - 1) / bn), (M + span_bm - 1) / span_bm, (unsigned)n_spans},
               threads, shared, y, [&] {
                   cp(ptr(w), row_bytes, ptr<u16>(xb), ptr<int>(row_ids), ptr<float>(y),
                      y_stride, M, N, K, ptr<int>(spans), mat_stride, 0, 0, nullptr);
               });
    } else {
        // Split over k: f32 partials [split][M][N], summed in split order into y.
        std::vector<u8> part(splits > 1 ? 4 * (size_t)splits * M * N : 0);
        launch(Dim3{(unsigned)(tiles_m * ((N + bn - 1) / bn)), (unsigned)splits, 1}, threads,
               shared, splits > 1 ? part : y, [&] {
                   cp(ptr(w), row_bytes, ptr<u16>(xb), nullptr, ptr<float>(y), y_stride, M, N,
                      K, nullptr, 0, tiles_m, ksteps, ptr<float>(part));
               });
        if (splits > 1)
            launch(((i64)M * N / 4 + 255) / 256, 256, 0, y, [&] {
                matmul_splitk_sum(ptr<float>(part), splits, M, N, ptr<float>(y), y_stride);
            });
    }
    print_f32(y);
}
