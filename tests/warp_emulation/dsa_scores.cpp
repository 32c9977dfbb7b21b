// kernels/dsa.cu's dsa_scores_mma kernels, whole, on emulated blocks (block.h), as
// Gpu::dsa_scores launches them. Input (Input, in order): the kernel's N tiles (i32: 2, 4 or
// 8), q [T][heads][dim], k [S][dim], w [T][heads] (buffers of f32), heads, dim, S, pos0 (i32),
// scale (f32), tokens, tiles, dynamic shared bytes (i32), scores (buffer, [T][s_stride]),
// s_stride (i64); prints scores.
int main(int argc, char** argv) {
    Input in(argv[1]);
    const int nt = in.i32();
    auto q = in.buffer(), k = in.buffer(), w = in.buffer();
    const int heads = in.i32(), dim = in.i32(), S = in.i32(), pos0 = in.i32();
    const float scale = in.f32();
    const int tokens = in.i32(), tiles = in.i32(), shared = in.i32();
    auto scores = in.buffer();
    const i64 s_stride = in.i64_();
    auto kernel = nt == 2 ? dsa_scores_mma16 : nt == 4 ? dsa_scores_mma32 : dsa_scores_mma64;
    const int per_block = DSA_MMA_KEYS * tiles;
    const Dim3 grid{(unsigned)((S + per_block - 1) / per_block), (unsigned)tokens, 1};
    launch(grid, 128, shared, scores, [&] {
        kernel(ptr<float>(q), ptr<float>(k), ptr<float>(w), heads, dim, S, pos0, scale,
               ptr<float>(scores), s_stride, tiles);
    });
    print_f32(scores);
}
