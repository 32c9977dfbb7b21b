// kernels/matvec.cu's matvec_tma_q6_k, whole, on emulated blocks (block.h). Input (Input, in
// order): w (buffer), rows, k (i32), row_bytes (i64), x, y (buffers), grid and dynamic shared
// bytes (i32), the pick's work and id (buffers, both empty for none); prints y, then the id.
int main(int argc, char** argv) {
    Input in(argv[1]);
    auto w = in.buffer();
    const int rows = in.i32(), k = in.i32();
    const i64 row_bytes = in.i64_();
    auto x = in.buffer(), y = in.buffer();
    const int grid = in.i32(), shared = in.i32();
    auto work = in.buffer(), pick = in.buffer();
    launch(grid, 288, shared, y, [&] {
        matvec_tma_q6_k(ptr(w), rows, k, row_bytes, ptr<float>(x), ptr<float>(y), ptr<int>(work),
                        ptr<int>(pick));
    });
    print_f32(y);
    print_f32(pick);
}
