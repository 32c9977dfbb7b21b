// One 16-row tile times x as one consumer warp of the tensor-core kernels computes it: x into
// planes (tc_prepare_x), each 256-block's dot through the type's tile (TcQ4k, TcQ5k, TcIq4xs,
// TcQ6kTile, TcQ80, as the bulk-copy kernels call it), the quad sums. Input (block.h's Input):
// the type (i32: 0 Q4_K, 1 Q6_K, 2 Q5_K, 3 IQ4_XS, 4 Q8_0), nb (i32), 16 rows of nb blocks (Q6_K: 16
// bytes more after the last, which TcQ6k::load may read), 256 nb f32 of x (buffers); prints
// the 16 row sums.
template <class Tile>
void tile_dots(const u8* w, int nb, const u8* sm, int g, int t, float& acc_lo, float& acc_hi) {
    const int k = 256 * nb, stride = tc_plane_stride(k);
    const float* scales = (const float*)(sm + 4 * stride);
    const float* sums = scales + tc_scales_len(k);
    const float2 pf = TcQ4k::plane_factors(t);
    const typename Tile::B b = Tile::b_cols(sm, k, g, t);
    for (int kb = 0; kb < nb; kb++) {
        Tile q;
        q.load_stage(&w[(g * nb + kb) * Tile::BYTES], &w[((g + 8) * nb + kb) * Tile::BYTES], t);
        q.dot(b, kb, sums + 8 * kb, scales[kb], t, pf, acc_lo, acc_hi);
    }
}

int main(int argc, char** argv) {
    Input in(argv[1]);
    const int type = in.i32();
    const int nb = in.i32(), k = 256 * nb;
    auto w = in.buffer(), xb = in.buffer();
    const float* x = ptr<float>(xb);
    std::vector<u8> sm(tc_x_bytes(k), 0xAB), out(64);  // not zeros: tc_prepare_x writes them
    run_warp([&](int lane) {
        if (type == 3)
            tc_prepare_x<true>(x, k, sm.data(), 1);
        else
            tc_prepare_x(x, k, sm.data(), 1);
        __syncwarp();
        const int g = lane >> 2, t = lane & 3;
        float acc_lo = 0.0f, acc_hi = 0.0f;
        auto dots = type == 0   ? tile_dots<TcQ4k>
                    : type == 1 ? tile_dots<TcQ6kTile>
                    : type == 2 ? tile_dots<TcQ5k>
                    : type == 3 ? tile_dots<TcIq4xs>
                                : tile_dots<TcQ80>;
        dots(w.data(), nb, sm.data(), g, t, acc_lo, acc_hi);
        quad_sums(acc_lo, acc_hi);
        float* o = ptr<float>(out);
        if (t == 0) o[g] = acc_lo, o[g + 8] = acc_hi;
    });
    print_f32(out);
}
