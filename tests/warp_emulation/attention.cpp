// kernels/attention.cu's tensor-core attention, whole, on emulated blocks (block.h), as
// Gpu::attention_prefill_mma launches it: attention_bf16 for q, the keys and v, then
// attention_mma_<DQK>_<DV>. Input (Input, in order): the form (i32: its index in ATT_MMA_FORMS,
// kernels.rs), its padded dims dq and dvp and dynamic shared bytes (i32), q [T][heads][dn +
// dr], k_nope [S][heads][dn], k_pe [S][dr] (every head's), v [S][heads][dv] (buffers of f32),
// mask (buffer of u32 [T][words] or empty), dn, dr, dv, heads, tokens, pos0 (i32), scale *
// log2 e (f32), out (buffer, [T][heads][dv]); prints out.
int main(int argc, char** argv) {
    Input in(argv[1]);
    const int form = in.i32(), dq = in.i32(), dvp = in.i32(), shared = in.i32();
    auto q = in.buffer(), k_nope = in.buffer(), k_pe = in.buffer(), v = in.buffer();
    auto mask = in.buffer();
    const int dn = in.i32(), dr = in.i32(), dv = in.i32(), heads = in.i32(), tokens = in.i32(),
              pos0 = in.i32();
    const float scale2 = in.f32();
    auto out = in.buffer();
    const int keys = pos0 + tokens, dqk = dn + dr;
    const int words = (keys + 31) / 32;
    std::vector<u8> qb(2 * (size_t)heads * tokens * dq), kb(2 * (size_t)heads * keys * dq),
        vb(2 * (size_t)heads * keys * dvp);
    auto bf16 = [&](std::vector<u8>& dst, const float* a, i64 a_tok, i64 a_head, int da,
                    const float* b, i64 b_tok, i64 b_head, int db, int rows, int d) {
        const i64 n = (i64)heads * rows * d / 8;
        launch((unsigned)((n + 255) / 256), 256, 0, dst, [&] {
            attention_bf16(a, a_tok, a_head, da, b, b_tok, b_head, db, rows, heads, d,
                           ptr<u16>(dst));
        });
    };
    bf16(qb, ptr<float>(q), (i64)heads * dqk, dqk, dqk, nullptr, 0, 0, 0, tokens, dq);
    bf16(kb, ptr<float>(k_nope), (i64)heads * dn, dn, dn, ptr<float>(k_pe), dr, 0, dr, keys, dq);
    bf16(vb, ptr<float>(v), (i64)heads * dv, dv, dv, nullptr, 0, 0, 0, keys, dvp);
    auto kernel = form == 0 ? attention_mma_64_64 : form == 1 ? attention_mma_192_128
                                                              : attention_mma_256_256;
    const Dim3 grid{(unsigned)heads, (unsigned)((tokens + ATT_MMA_BQ - 1) / ATT_MMA_BQ), 1};
    launch(grid, ATT_MMA_THREADS, shared, out, [&] {
        kernel(ptr<u16>(qb), ptr<u16>(kb), ptr<u16>(vb), ptr<float>(out), (i64)heads * dv, dv, dv,
               ptr<u32>(mask), words, tokens, keys, pos0, scale2);
    });
    print_f32(out);
}
