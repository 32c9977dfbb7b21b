// kernels/dsa.cu's topk_rows, whole, on emulated blocks (block.h), as Gpu::topk_rows launches
// it: a block of TOPK_THREADS a row, `cache_keys` keys of shared memory. Input (Input, in
// order): scores (buffer of f32, [T][s_stride]), s_stride (i64), tokens, pos0, k, cache_keys
// (i32); prints the positions [T][k] (i32, as their bits).
int main(int argc, char** argv) {
    Input in(argv[1]);
    auto scores = in.buffer();
    const i64 s_stride = in.i64_();
    const int tokens = in.i32(), pos0 = in.i32(), k = in.i32(), cache_keys = in.i32();
    std::vector<u8> out(4 * (size_t)tokens * k, 0x5A);  // every place is written
    launch((unsigned)tokens, TOPK_THREADS, 4 * (size_t)cache_keys, out, [&] {
        topk_rows(ptr<float>(scores), s_stride, pos0, k, cache_keys, ptr<int>(out));
    });
    print_f32(out);
}
