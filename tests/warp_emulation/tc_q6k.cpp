// One 16-row Q6_K tile times x through kernels/matvec.cu's TcQ6k and q6_dot, as a consumer
// warp of matvec_tma_q6_k computes it: x into planes (tc_prepare_x), each 256-block's dot, the
// quad sums. Input and output as tc_q4k.cpp's (blocks of 210 bytes).
#include <cstdio>

int main(int argc, char** argv) {
    FILE* f = std::fopen(argv[1], "rb");
    int nb = 0;
    if (!f || std::fread(&nb, 4, 1, f) != 1) return 2;
    const int k = 256 * nb;
    std::vector<u8> w(16 * 210 * nb + 16);  // TcQ6k::load reads a few bytes past a block
    std::vector<float> x(k);
    if (std::fread(w.data(), 1, 16 * 210 * nb, f) != 16 * 210 * (size_t)nb ||
        std::fread(x.data(), 4, k, f) != (size_t)k)
        return 2;
    const int stride = tc_plane_stride(k);
    std::vector<u8> sm(4 * stride + 4 * tc_scales_len(k) + 4 * (k / 32)), zeros(256);
    float out[16];
    run_warp([&](int lane) {
        tc_prepare_x(x.data(), k, sm.data(), 1);
        WARP->arrive_and_wait();
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
        if (t == 0) out[g] = acc_lo, out[g + 8] = acc_hi;
    });
    for (float v : out) std::printf("%08x\n", __float_as_uint(v));
}
