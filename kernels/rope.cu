// Rotary embedding on adjacent pairs (GGUF "NORM" order: elements 2i and 2i+1 rotate together),
// in place. YaRN lives in the host-computed `inv_freq` (the blended per-pair frequency) and
// `mscale` (the cos/sin magnitude); the kernel only rotates.
//
// x: [T, heads] rows; the rope part of row (t, h) starts at x + t * tok_stride + h * head_stride
// and is `dims` long. Pair i of token t (position pos0 + t) turns by angle (pos0 + t) *
// inv_freq[i] (an f32 product, as the CPU twin computes it). grid (T, ceil(heads / HB)),
// block HB * lanes: `lanes` (dims / 2 rounded up to 32) threads per head, HB heads per block (a
// block per head and token left the prefill's 65536 one-warp blocks bound by block launches).
// copy (or null): the rotated values also to copy + t * copy_stride + h * dims (MLA's q_pe
// taken out of q in the same pass).

extern "C" __global__ void rope_pairs(float* x, i64 tok_stride, i64 head_stride, int dims,
                                      int heads, int lanes, int pos0, const float* inv_freq,
                                      float mscale, float* copy, i64 copy_stride) {
    pdl_enter();
    int i = threadIdx.x % lanes, h = blockIdx.y * (blockDim.x / lanes) + threadIdx.x / lanes;
    if (i >= dims / 2 || h >= heads) return;
    float* p = x + blockIdx.x * tok_stride + h * head_stride + 2 * i;
    float r[2];
    rope_pair(p[0], p[1], (float)(pos0 + (int)blockIdx.x), inv_freq[i], mscale, r);
    p[0] = r[0];
    p[1] = r[1];
    if (copy) {
        float* c = copy + blockIdx.x * copy_stride + h * dims + 2 * i;
        c[0] = r[0];
        c[1] = r[1];
    }
}
