// One 16-row tile times x as one consumer warp of the tensor-core kernels computes it: x into
// planes (tc_prepare_x), each 256-block's dot, the quad sums. Q4_K, Q5_K and IQ4_XS through
// their tile types (TcQ4k, TcQ5k, TcIq4xs), Q6_K through TcQ6k and q6_dot (as
// matvec_tma_q6_k). Input (block.h's Input): the type (i32: 0 Q4_K, 1 Q6_K, 2 Q5_K, 3
// IQ4_XS), nb (i32), 16 rows of nb blocks (Q6_K: 16 bytes more after the last, which
// TcQ6k::load may read), 256 nb f32 of x (buffers); prints the 16 row sums.
template <class Tile>
void tile_dots(const u8* w, int nb, const u8* sm, int stride, int g, int t, float& acc_lo,
               float& acc_hi) {
    const int k = 256 * nb;
    const float* scales = (const float*)(sm + 4 * stride);
    const float* sums = scales + tc_scales_len(k);
    const float2 pf = TcQ4k::plane_factors(t);
    for (int kb = 0; kb < nb; kb++) {
        Tile q;
        q.load_stage(&w[(g * nb + kb) * Tile::BYTES], &w[((g + 8) * nb + kb) * Tile::BYTES], t);
        q.dot(Tile::b_col(sm, stride, g, t) + 256 * kb, sums + 8 * kb, scales[kb], t, pf, acc_lo,
              acc_hi);
    }
}

int main(int argc, char** argv) {
    Input in(argv[1]);
    const int type = in.i32();
    const int nb = in.i32(), k = 256 * nb;
    auto w = in.buffer(), xb = in.buffer();
    const float* x = ptr<float>(xb);
    const int stride = tc_plane_stride(k);
    std::vector<u8> sm(4 * stride + 4 * tc_scales_len(k) + 4 * (k / 32)), zeros(256), out(64);
    run_warp([&](int lane) {
        if (type == 3)
            tc_prepare_x<true>(x, k, sm.data(), 1);
        else
            tc_prepare_x(x, k, sm.data(), 1);
        __syncwarp();
        const float* scales = (const float*)(sm.data() + 4 * stride);
        const int g = lane >> 2, t = lane & 3;
        float acc_lo = 0.0f, acc_hi = 0.0f;
        if (type == 1) {
            const float2 pf = TcQ4k::plane_factors(t);
            for (int kb = 0; kb < nb; kb++) {
                TcQ6k lo, hi;
                lo.load(&w[(g * nb + kb) * 210], t);
                hi.load(&w[((g + 8) * nb + kb) * 210], t);
                q6_dot(lo, hi, TcQ6k::b_block(sm.data(), stride, zeros.data(), g, t, kb),
                       scales[kb], pf, acc_lo, acc_hi);
            }
        } else if (type == 0) {
            tile_dots<TcQ4k>(w.data(), nb, sm.data(), stride, g, t, acc_lo, acc_hi);
        } else if (type == 2) {
            tile_dots<TcQ5k>(w.data(), nb, sm.data(), stride, g, t, acc_lo, acc_hi);
        } else {
            tile_dots<TcIq4xs>(w.data(), nb, sm.data(), stride, g, t, acc_lo, acc_hi);
        }
        quad_sums(acc_lo, acc_hi);
        float* o = ptr<float>(out);
        if (t == 0) o[g] = acc_lo, o[g + 8] = acc_hi;
    });
    print_f32(out);
}
