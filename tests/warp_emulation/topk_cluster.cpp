// kernels/dsa.cu's topk_rows_cluster4 and topk_rows_cluster8, whole, on an emulated cluster of
// blocks (block.h, run_cluster), as Gpu::topk_rows launches them for one decode row. Input
// (Input, in order): scores (buffer of f32, one row), pos0, k, cache_keys, blocks (4 or 8)
// (i32); prints the positions [k] (i32, as their bits).
int main(int argc, char** argv) {
    Input in(argv[1]);
    auto scores = in.buffer();
    const int pos0 = in.i32(), k = in.i32(), cache_keys = in.i32(), blocks = in.i32();
    expect(blocks == 4 || blocks == 8, "a cluster of 4 or 8 blocks");
    int* out = (int*)shared_pages(4 * (size_t)k);  // written by the blocks' processes
    std::memset(out, 0x5A, 4 * (size_t)k);         // every place is written
    const float* row = ptr<float>(scores);
    run_cluster(blocks, TOPK_THREADS, 4 * (size_t)cache_keys, [&] {
        if (blocks == 4) topk_rows_cluster4(row, 0, pos0, k, cache_keys, out);
        else topk_rows_cluster8(row, 0, pos0, k, cache_keys, out);
    });
    std::vector<u8> bits((u8*)out, (u8*)out + 4 * (size_t)k);
    print_f32(bits);
}
