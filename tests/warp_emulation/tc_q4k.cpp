// One 16-row Q4_K tile times x through kernels/matvec.cu's TcQ4k, as one warp of the
// tensor-core kernels computes it: x into planes (tc_prepare_x), each 256-block's dot, the
// quad sums. The test prepends warp.h and the kernel's functions. argv: a file of nb (i32),
// 16 rows of nb Q4_K blocks, 256 nb f32 of x; prints the 16 row sums as f32 bits in hex.
#include <cstdio>

int main(int argc, char** argv) {
    FILE* f = std::fopen(argv[1], "rb");
    int nb = 0;
    if (!f || std::fread(&nb, 4, 1, f) != 1) return 2;
    const int k = 256 * nb;
    std::vector<u8> w(16 * 144 * nb);
    std::vector<float> x(k);
    if (std::fread(w.data(), 1, w.size(), f) != w.size() ||
        std::fread(x.data(), 4, k, f) != (size_t)k)
        return 2;
    const int stride = tc_plane_stride(k);
    std::vector<u8> sm(4 * stride + 4 * tc_scales_len(k) + 4 * (k / 32));
    float out[16];
    run_warp([&](int lane) {
        tc_prepare_x(x.data(), k, sm.data(), 1);
        WARP->arrive_and_wait();
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
        if (t == 0) out[g] = acc_lo, out[g + 8] = acc_hi;
    });
    for (float v : out) std::printf("%08x\n", __float_as_uint(v));
}
