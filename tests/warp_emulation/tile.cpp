// One 16-row tile times x as one consumer warp of the tensor-core kernels computes it: x into
// planes (tc_prepare_x), each 256-block's dot, the quad sums. Q4_K through TcQ4k, Q6_K through
// TcQ6k and q6_dot (as matvec_tma_q6_k). Input (block.h's Input): the type (i32: 0 Q4_K, 1
// Q6_K), nb (i32), 16 rows of nb blocks (Q6_K: 16 bytes more after the last, which TcQ6k::load
// may read), 256 nb f32 of x (buffers); prints the 16 row sums.
int main(int argc, char** argv) {
    Input in(argv[1]);
    const bool q6 = in.i32() == 1;
    const int nb = in.i32(), k = 256 * nb;
    auto w = in.buffer(), xb = in.buffer();
    const float* x = ptr<float>(xb);
    const int stride = tc_plane_stride(k), block_bytes = q6 ? 210 : 144;
    std::vector<u8> sm(4 * stride + 4 * tc_scales_len(k) + 4 * (k / 32)), zeros(256), out(64);
    run_warp([&](int lane) {
        tc_prepare_x(x, k, sm.data(), 1);
        __syncwarp();
        const float* scales = (const float*)(sm.data() + 4 * stride);
        const float* sums = scales + tc_scales_len(k);
        const int g = lane >> 2, t = lane & 3;
        const float2 pf = TcQ4k::plane_factors(t);
        float acc_lo = 0.0f, acc_hi = 0.0f;
        for (int kb = 0; kb < nb; kb++) {
            const u8* blo = &w[(g * nb + kb) * block_bytes];
            const u8* bhi = &w[((g + 8) * nb + kb) * block_bytes];
            if (q6) {
                TcQ6k lo, hi;
                lo.load(blo, t);
                hi.load(bhi, t);
                q6_dot(lo, hi, TcQ6k::b_block(sm.data(), stride, zeros.data(), g, t, kb),
                       scales[kb], pf, acc_lo, acc_hi);
            } else {
                TcQ4k q;
                q.load_stage(blo, bhi, t);
                q.dot(TcQ4k::b_col(sm.data(), stride, g, t) + 256 * kb, sums + 8 * kb, scales[kb],
                      t, pf, acc_lo, acc_hi);
            }
        }
        quad_sums(acc_lo, acc_hi);
        float* o = ptr<float>(out);
        if (t == 0) o[g] = acc_lo, o[g + 8] = acc_hi;
    });
    print_f32(out);
}
