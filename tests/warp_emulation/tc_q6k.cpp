// One 16-row Q6_K tile times x through kernels/matvec.cu's TcQ6k and q6_dot, as a consumer
// warp of matvec_tma_q6_k computes it: x into planes (tc_prepare_x), each 256-block's dot, the
// quad sums. Input and output as tc_q4k.cpp's (blocks of 210 bytes, 16 more after the last).
int main(int argc, char** argv) {
    Input in(argv[1]);
    const int nb = in.i32(), k = 256 * nb;
    auto w = in.buffer(), xb = in.buffer();
    const float* x = ptr<float>(xb);
    const int stride = tc_plane_stride(k);
    std::vector<u8> sm(4 * stride + 4 * tc_scales_len(k) + 4 * (k / 32)), zeros(256), out(64);
    run_warp([&](int lane) {
        tc_prepare_x(x, k, sm.data(), 1);
        __syncwarp();
        const float* scales = (const float*)(sm.data() + 4 * stride);
        const int g = lane >> 2, t = lane & 3;
        const float2 pf = TcQ4k::plane_factors(t);
        float acc_lo = 0.0f, acc_hi = 0.0f;
        for (int blk = 0; blk < nb; blk++) {
            TcQ6k lo, hi;
            lo.load(&w[(g * nb + blk) * 210], t);
            hi.load(&w[((g + 8) * nb + blk) * 210], t);
            q6_dot(lo, hi, TcQ6k::b_block(sm.data(), stride, zeros.data(), g, t, blk), scales[blk],
                   pf, acc_lo, acc_hi);
        }
        quad_sums(acc_lo, acc_hi);
        float* o = ptr<float>(out);
        if (t == 0) o[g] = acc_lo, o[g + 8] = acc_hi;
    });
    print_f32(out);
}
