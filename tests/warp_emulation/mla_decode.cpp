// kernels/mla_decode.cu's split kernels and mla_decode_combine, whole, on emulated blocks
// (block.h), as Gpu::mla_decode_with launches them. Input (Input, in order): the split kernel
// (i32: 0 mla_decode_split, 1 mla_decode_split16), q_lat (buffer), ql_tok (i64), q_pe (buffer),
// qp_tok (i64), qp_head (i32), qp_freq (buffer), qp_mscale (f32), cache (buffer), dl, dr,
// n_heads (i32), key_ids (buffer of i32), n_ids, pos0, keys_per_split (i32), scale (f32), out
// (buffer), out_tok (i64), tokens, splits, heads per block, threads and dynamic shared bytes of
// the split kernel, chunks and threads of the combine (i32); prints out.
int main(int argc, char** argv) {
    Input in(argv[1]);
    const int form = in.i32();
    auto q_lat = in.buffer();
    const i64 ql_tok = in.i64_();
    auto q_pe = in.buffer();
    const i64 qp_tok = in.i64_();
    const int qp_head = in.i32();
    auto qp_freq = in.buffer();
    const float qp_mscale = in.f32();
    auto cache = in.buffer();
    const int dl = in.i32(), dr = in.i32(), n_heads = in.i32();
    auto key_ids = in.buffer();
    const int n_ids = in.i32(), pos0 = in.i32(), per = in.i32();
    const float scale = in.f32();
    auto out = in.buffer();
    const i64 out_tok = in.i64_();
    const int tokens = in.i32(), splits = in.i32(), per_block = in.i32(), threads = in.i32(),
              shared = in.i32(), chunks = in.i32(), combine_threads = in.i32();
    // acc [T, splits, heads, dl], then (m, l) [T, splits, heads, 2]; NaN until written
    const size_t n_acc = (size_t)tokens * splits * n_heads * dl;
    std::vector<u8> work(4 * (n_acc + (size_t)tokens * splits * n_heads * 2), 0xFF);
    float* acc = (float*)work.data();
    float* ml = acc + n_acc;
    auto kernel = form == 0 ? mla_decode_split : mla_decode_split16;
    const Dim3 grid{(unsigned)((n_heads + per_block - 1) / per_block), (unsigned)splits,
                    (unsigned)tokens};
    launch(grid, threads, shared, splits > 1 ? work : out, [&] {
        kernel(ptr<float>(q_lat), ql_tok, ptr<float>(q_pe), qp_tok, qp_head, ptr<float>(qp_freq),
               qp_mscale, ptr(cache), dl, dr, n_heads, ptr<int>(key_ids), n_ids, pos0, per, scale,
               acc, ml, ptr<float>(out), out_tok);
    });
    if (splits > 1)
        launch(Dim3{(unsigned)n_heads, (unsigned)tokens, (unsigned)chunks}, combine_threads, 0, out,
               [&] { mla_decode_combine(acc, ml, splits, n_heads, dl, ptr<float>(out), out_tok); });
    print_f32(out);
}
