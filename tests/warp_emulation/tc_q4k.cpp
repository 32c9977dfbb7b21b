// One 16-row Q4_K tile times x through kernels/matvec.cu's TcQ4k, as one warp of the
// tensor-core kernels computes it: x into planes (tc_prepare_x), each 256-block's dot, the
// quad sums. Input (block.h's Input): nb (i32), 16 rows of nb Q4_K blocks, 256 nb f32 of x
// (buffers); prints the 16 row sums.
int main(int argc, char** argv) {
    Input in(argv[1]);
    const int nb = in.i32(), k = 256 * nb;
    auto w = in.buffer(), xb = in.buffer();
    const float* x = ptr<float>(xb);
    const int stride = tc_plane_stride(k);
    std::vector<u8> sm(4 * stride + 4 * tc_scales_len(k) + 4 * (k / 32)), out(64);
    run_warp([&](int lane) {
        tc_prepare_x(x, k, sm.data(), 1);
        __syncwarp();
        const float* scales = (const float*)(sm.data() + 4 * stride);
        const float* sums = scales + tc_scales_len(k);
        const int g = lane >> 2, t = lane & 3;
        const u8* bcol = TcQ4k::b_col(sm.data(), stride, g, t);
        const float2 pf = TcQ4k::plane_factors(t);
        float acc_lo = 0.0f, acc_hi = 0.0f;
        for (int kb = 0; kb < nb; kb++) {
            TcQ4k q;
            q.load_stage(&w[(g * nb + kb) * 144], &w[((g + 8) * nb + kb) * 144], t);
            q.dot(bcol + 256 * kb, sums + 8 * kb, scales[kb], t, pf, acc_lo, acc_hi);
        }
        quad_sums(acc_lo, acc_hi);
        float* o = ptr<float>(out);
        if (t == 0) o[g] = acc_lo, o[g + 8] = acc_hi;
    });
    print_f32(out);
}
