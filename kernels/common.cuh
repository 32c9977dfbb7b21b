// Helpers every kernel family shares. NVRTC compiles each family as this file followed by the
// family's own source (see src/backend/cuda/kernels.rs), so no system header is needed.
//
// Conventions: activations are f32 in row-major [rows, cols]; every reduction accumulates in
// f32; a kernel that takes an optional pointer treats null as "absent".

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define NEG_INF (-__int_as_float(0x7f800000))

// The id of the shared expert among a token's MoE choices: moe_router writes it, the
// tensor-core matvec reads that item's matrix from the shared expert's tensor.
#define MOE_SHARED (-2)

// Programmatic dependent launch (sm_90 and later; device.rs launches every kernel with it
// there): a kernel may start while the one before it in the stream still runs, so each kernel
// calls pdl_wait() before it touches memory an earlier kernel writes or reads (only constant
// weights may be read before), and lets the next one start early with pdl_launch_next(). The
// next one's blocks then wait on the SMs instead of being launched after this grid ends.
// Without the launch attribute (or before sm_90) both are no-ops.
#ifdef MLA_CHAIN_CLOCK
// The chain clock, a diagnostic (MLA_CHAIN_CLOCK=1 puts the define before every family:
// kernels.rs). One thread (pdl_wait's `stamps`) stamps the global timer as its wait returns,
// once the kernel before has ended (or, launched without the attribute, as it starts), so that the
// host reads what each launch adds to the chain as it runs; ncu runs kernels one at a time.
// device.rs points every module's mla_chain_clock at one buffer: [0] the stamps taken, then
// (grid id, ns) pairs; a thread that waits twice stamps twice under one grid id.
#define CHAIN_CLOCK_STAMPS 8192
__device__ u64* mla_chain_clock;
__device__ __forceinline__ void chain_stamp() {
    u64 t, grid;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
    u64 i = atomicAdd(mla_chain_clock, 1ull);
    if (i < CHAIN_CLOCK_STAMPS) {
        mla_chain_clock[1 + 2 * i] = grid;
        mla_chain_clock[2 + 2 * i] = t;
    }
}
#endif
// Thread 0 of block 0: the chain clock's stamper unless a kernel names another.
__device__ __forceinline__ bool first_thread_of_grid() {
    return (blockIdx.x | blockIdx.y | blockIdx.z | threadIdx.x | threadIdx.y | threadIdx.z) == 0;
}
__device__ __forceinline__ void pdl_wait(bool stamps = first_thread_of_grid()) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#ifdef MLA_CHAIN_CLOCK
    if (stamps) chain_stamp();
#endif
}
__device__ __forceinline__ void pdl_launch_next() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
// A device-scope acquire-release fence: what the "last block in" counts need (count_in);
// __threadfence() is a sequentially consistent one (MEMBAR.SC), more than they need.
__device__ __forceinline__ void fence_acq_rel() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
// "Last block in", by one thread of a block after its block's stores (a __syncthreads before,
// so every thread's): a release fence, then n added to `count`, which `total` completes. The
// block whose add completes it puts the count back to 0 (for the next launch, in stream
// order) and fences again, so that after the __syncthreads that follows, its threads read the
// other blocks' stores. Returns whether this block completed the count.
__device__ __forceinline__ bool count_in(int* count, int n, int total) {
    fence_acq_rel();
    const bool last = atomicAdd(count, n) + n == total;
    if (last) {
        *count = 0;
        fence_acq_rel();
    }
    return last;
}
// The usual start of a kernel: wait for the previous one, then let the next one launch.
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_launch_next();
}

// 16 bytes global -> shared without registers (sm_80+); dst is a shared-space address.
__device__ __forceinline__ void cp16(u32 dst, const void* src, bool pred) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(pred ? 16 : 0));  // src-size 0: zero-fill, nothing read
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Bulk copies (cp.async.bulk, sm_90 and later) into shared memory, counted on mbarriers: a
// stage is `full` when its producer's arrival and its copies' bytes are in, `empty` when its
// readers have arrived. A wait names the phase by its parity.
__device__ __forceinline__ u32 shared_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
// Thread block clusters (sm_90 and later): a barrier of every thread of the cluster, whose
// arrival releases and whose wait acquires the blocks' shared-memory writes (split in two
// where a block has work between them), and the address of p's place in block `rank`'s shared
// memory (for ld.shared::cluster).
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::
                     : "memory");
}
__device__ __forceinline__ u32 cluster_addr(const void* p, int rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_addr(p)), "r"(rank));
    return remote;
}
#endif
__device__ __forceinline__ void mbar_init(u64* b, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_addr(b)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_bytes(u64* b, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_addr(b)),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_addr(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* b, u32 parity) {
    asm volatile(
        "{\n .reg .pred p;\n wait_%=: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        " @!p bra wait_%=;\n}\n" ::"r"(shared_addr(b)),
        "r"(parity)
        : "memory");
}
// Orders this thread's ordinary stores to shared memory before later bulk copies (the async
// proxy) into the same bytes.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// `bytes` (a multiple of 16) from 16-byte aligned global src to shared dst, counted on b.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* b) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(shared_addr(dst)), "l"(src), "r"(bytes), "r"(shared_addr(b))
        : "memory");
}
// Each stage's barriers by thread 0, for the block: `full` completed by the producer's one
// arrival and the copies' bytes, `empty` by `readers` consumer warps' arrivals.
__device__ __forceinline__ void init_stage_barriers(u64* full, u64* empty, int stages,
                                                    int readers) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], readers);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
}

// The SwiGLU gate, silu(g) = g / (1 + exp(-g)): one expression for silu_mul and the
// tensor-core matvec's glu form, so that both give the same bits.
__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// IEEE half -> float (exact).
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// bfloat16 -> float (exact: bf16 is the top half of an f32).
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// Two floats -> packed bf16x2 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 2^x by the special function unit (relative error ~2^-22; -inf -> 0): the softmaxes of MLA
// decode and the tensor-core attention, which work in base 2.
__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// c += a b on the tensor cores: m16n8k16, bf16 A (4 registers) and B (2), f32 C (4).
__device__ __forceinline__ void mma_bf16_16816(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four 8x8 bf16 matrices from shared memory; lane l gives the address of row l % 8 of matrix
// l / 8. _trans: each matrix transposed (B fragments from a [k][n] tile).
__device__ __forceinline__ void ldsm_x4(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// The MLA latent cache format: one row per position of LATENT_DIMS bf16 values x_hi = bf16(x),
// then LATENT_DIMS values x_lo = bf16(x - x_hi), where dim d < LATENT_ROPE_AT is c_kv's d and
// LATENT_ROPE_AT + j is k_pe's j; dims past either part's width stay zero. x_hi + x_lo carries
// x to ~2^-17, as the split-precision products of mla_decode_split use it, which so copy tiles
// as they are. latent_norm_rope writes rows, mla_decode_split and latent_rows read them.
#define LATENT_DIMS 576
#define LATENT_ROPE_AT 512
#define LATENT_ROW_BYTES (4 * LATENT_DIMS)
__device__ __forceinline__ void latent_store(u16* row, int d, float x) {
    const u16 hi = (u16)pack_bf16x2(x, 0.0f);
    row[d] = hi;
    row[LATENT_DIMS + d] = (u16)pack_bf16x2(x - bf16_to_f32(hi), 0.0f);
}

// Little-endian loads from byte pointers of any alignment.
__device__ __forceinline__ u16 load_u16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }
__device__ __forceinline__ u32 load_u32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

// N little-endian words from any byte address through the read-only path: N + 1 aligned
// 4-byte loads (neighbouring threads' words share L1 lines, so these keep the L1 allocation)
// joined by funnel shifts. The extra word is read only when p is unaligned, and then it holds
// bytes of the range itself.
template <int N>
__device__ __forceinline__ void ld_words(const u8* p, u32* out) {
    const u8* base = (const u8*)((unsigned long long)p & ~3ull);
    u32 sh = 8 * (u32)((unsigned long long)p & 3);
    u32 a[N + 1];
#pragma unroll
    for (int i = 0; i < N; i++) a[i] = __ldg((const unsigned int*)(base + 4 * i));
    a[N] = sh ? __ldg((const unsigned int*)(base + 4 * N)) : 0u;
#pragma unroll
    for (int i = 0; i < N; i++) out[i] = __funnelshift_r(a[i], a[i + 1], sh);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The sum over each half of the warp (lanes 0-15, 16-31), in every lane of that half.
__device__ __forceinline__ float half_warp_sum(float v) {
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// `scratch` holds 32 floats of shared memory; the call ends with a barrier so it can be reused.
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

// The argmax's order on (value, index) pairs: the larger value, then the lower index (a NaN,
// never larger, never wins). warp_argmax: the best pair of the warp, in every lane.
__device__ __forceinline__ void argmax_pair(float* best, int* arg, float ob, int oa) {
    if (ob > *best || (ob == *best && oa < *arg)) {
        *best = ob;
        *arg = oa;
    }
}
__device__ __forceinline__ void warp_argmax(float* best, int* arg) {
    for (int o = 16; o > 0; o >>= 1)
        argmax_pair(best, arg, __shfl_xor_sync(0xffffffffu, *best, o),
                    __shfl_xor_sync(0xffffffffu, *arg, o));
}

// The end of an argmax over a grid's blocks of n values, by one whole warp of each block
// whose lanes all hold the block's best pair: the last block in reduces the blocks' pairs and
// writes the index to out[0] (0 when no value is above -inf, as for NaNs, so that it always
// names a row of the embedding). work: [1 + 2 * grid] i32, work[0] zero before the launch and
// after it (count_in).
__device__ void grid_argmax(float best, int arg, int n, int* work, int* out) {
    const int lane = threadIdx.x & 31;
    int last = 0;
    if (lane == 0) {
        work[1 + 2 * blockIdx.x] = __float_as_int(best);
        work[2 + 2 * blockIdx.x] = arg;
        last = count_in(work, 1, gridDim.x);
    }
    __syncwarp();  // lane 0's acquire before the other lanes' loads
    if (!__shfl_sync(0xffffffffu, last, 0)) return;
    best = NEG_INF;
    arg = 1 << 30;
#pragma unroll 4
    for (int b = lane; b < (int)gridDim.x; b += 32)
        argmax_pair(&best, &arg, __int_as_float(__ldcg(work + 1 + 2 * b)), __ldcg(work + 2 + 2 * b));
    warp_argmax(&best, &arg);
    if (lane == 0) out[0] = arg < n ? arg : 0;
}

// Rotary embedding of one adjacent pair (x0, x1) into y[0], y[1] (y may hold x): the angle
// pos * inv_freq (an f32 product, as the CPU computes it), cos and sin scaled by YaRN's mscale.
// rope_cos_sin and rope_turn are its two halves, for pairs that share an angle.
__device__ __forceinline__ float2 rope_cos_sin(float pos, float inv_freq, float mscale) {
    float s, c;
    sincosf(pos * inv_freq, &s, &c);
    return make_float2(c * mscale, s * mscale);
}
__device__ __forceinline__ void rope_turn(float x0, float x1, float2 cs, float* y) {
    y[0] = x0 * cs.x - x1 * cs.y;
    y[1] = x0 * cs.y + x1 * cs.x;
}
__device__ __forceinline__ void rope_pair(float x0, float x1, float pos, float inv_freq,
                                          float mscale, float* y) {
    rope_turn(x0, x1, rope_cos_sin(pos, inv_freq, mscale), y);
}

__device__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : NEG_INF;
    v = warp_max(v);
    __syncthreads();
    return v;
}

// ---- Row norms by one block or one warp (norm.cu's kernels; the latent's also in matvec.cu's
// parts and query tails) ----
//
// Thread i of the team holds values i, i + size, ... of its row in registers (at most V; the
// launch picks a team of at least n / V), so x, w and b are read once, every load of a thread
// issued before the first use: a decode row is one team on one SM, and its time is the memory
// latency, paid once rather than once per value. L2: read through L2 only (rows other blocks
// of the same grid wrote).
#define NORM_VALS 8

// The threads that hold a row: a whole block, or one warp (the bulk-copy kernels' producer
// warp, which norms rows while the block's other warps still compute theirs).
struct BlockTeam {
    static __device__ __forceinline__ int rank() { return threadIdx.x; }
    static __device__ __forceinline__ int size() { return blockDim.x; }
    static __device__ __forceinline__ float sum(float v, float* scratch) {
        return block_sum(v, scratch);
    }
    static __device__ __forceinline__ void sync() { __syncthreads(); }
};
struct WarpTeam {
    static __device__ __forceinline__ int rank() { return threadIdx.x & 31; }
    static __device__ __forceinline__ int size() { return 32; }
    static __device__ __forceinline__ float sum(float v, float*) { return warp_sum(v); }
    static __device__ __forceinline__ void sync() { __syncwarp(); }
};

// This thread's values of a row of n (0 past the end), all loads issued at once.
template <int V = NORM_VALS, bool L2 = false, class Team = BlockTeam>
__device__ __forceinline__ void load_row(float v[V], const float* row, int n) {
#pragma unroll
    for (int k = 0; k < V; k++) {
        int i = Team::rank() + k * Team::size();
        v[k] = i >= n ? 0.0f : L2 ? __ldcg(row + i) : row[i];
    }
}

// 1 / sqrt(mean(v^2) + eps) for a row of n held as load_row leaves it.
template <int V = NORM_VALS, class Team = BlockTeam>
__device__ __forceinline__ float rms_inv(const float v[V], int n, float eps, float* scratch) {
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < V; k++) ss += v[k] * v[k];
    ss = Team::sum(ss, scratch);
    return rsqrtf(ss / (float)n + eps);
}

// y = v / sqrt(mean(v^2) + eps) * w for a row of n held as load_row leaves it (w likewise).
template <int V = NORM_VALS, class Team = BlockTeam>
__device__ __forceinline__ void rms_store(const float v[V], const float wv[V], float* y, int n,
                                          float eps, float* scratch) {
    float inv = rms_inv<V, Team>(v, n, eps, scratch);
#pragma unroll
    for (int k = 0; k < V; k++) {
        int i = Team::rank() + k * Team::size();
        if (i < n) y[i] = v[k] * inv * wv[k];
    }
}

// Row xr of n values layer-normed into yr (w, b), then with dr > 0 its first dr values
// rotated as adjacent pairs at position `pos`, as rope_pairs turns them.
template <int V = NORM_VALS, bool L2 = false, class Team = BlockTeam>
__device__ __forceinline__ void layernorm_rope_row(const float* xr, const float* w,
                                                   const float* b, float* yr, int n, float eps,
                                                   int dr, float pos, const float* inv_freq,
                                                   float mscale, float* scratch) {
    float v[V], wv[V], bv[V];
    load_row<V, L2, Team>(v, xr, n);
    load_row<V, false, Team>(wv, w, n);
    load_row<V, false, Team>(bv, b, n);
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < V; k++) s += v[k];
    float mean = Team::sum(s, scratch) / (float)n;
    float var = 0.0f;
#pragma unroll
    for (int k = 0; k < V; k++) {
        int i = Team::rank() + k * Team::size();
        float c = v[k] - mean;
        if (i < n) var += c * c;
    }
    float inv = rsqrtf(Team::sum(var, scratch) / (float)n + eps);
#pragma unroll
    for (int k = 0; k < V; k++) {
        int i = Team::rank() + k * Team::size();
        if (i < n) yr[i] = (v[k] - mean) * inv * wv[k] + bv[k];
    }
    if (dr == 0) return;
    Team::sync();  // a pair's two values come from different threads
    for (int i = Team::rank(); i < dr / 2; i += Team::size())
        rope_pair(yr[2 * i], yr[2 * i + 1], pos, inv_freq[i], mscale, yr + 2 * i);
}

// The norms that put a token's MLA latent into its cache (model/mla.rs), by the blocks of
// latent_norm_rope (norm.cu) or the last blocks of the products that made them (matvec.cu's
// parts launch). Token t's rows (a block each):
//   latent_row: kv [T, dl + dr] -> cache row t (pointing at the first row to fill) in the
//     latent cache format: c_kv = rmsnorm(kv[t, 0..dl)) * w at dims 0 .. dl, k_pe =
//     kv[t, dl..dl+dr) rotated as adjacent pairs at position pos0 + t, exactly as rope_pairs
//     turns them (angle = f32 pos * inv_freq[i]), at dims LATENT_ROPE_AT ..; each value as its
//     hi and lo bf16 parts, the row's other dims left as they are (zero);
//   query_row (qx not null): qy[t] = rmsnorm(qx[t]) * qw, rows of dq (q-LoRA's q_a);
//   key_row (kx not null): the DSA indexer's key into its cache row, rows of dk: ky[t] =
//     layernorm(kx[t]) (kw, kb, k_eps), its first dr values roped as k_pe.
// dl <= LATENT_ROPE_AT, dr <= LATENT_DIMS - LATENT_ROPE_AT, dr <= dk, each width <= V x the
// team's threads (V: the values a thread holds, as load_row's).
struct LatentNorm {
    const float* kv;
    const float* w;
    u16* cache;
    const float* inv_freq;
    const float* qx;
    const float* qw;
    float* qy;
    const float* kx;
    const float* kw;
    const float* kb;
    float* ky;
    int dl, dr, dq, dk, pos0;
    float mscale, eps, k_eps;
};

template <int V, bool L2, class Team = BlockTeam>
__device__ __forceinline__ void latent_row(const LatentNorm& a, int t, float* scratch) {
    const float pos = (float)(a.pos0 + t);
    const float* xr = a.kv + t * (i64)(a.dl + a.dr);
    u16* yr = a.cache + t * (i64)(2 * LATENT_DIMS);

    // k_pe: one pair per thread (a loop for widths past the team).
    for (int i = Team::rank(); i < a.dr / 2; i += Team::size()) {
        const float x0 = L2 ? __ldcg(xr + a.dl + 2 * i) : xr[a.dl + 2 * i];
        const float x1 = L2 ? __ldcg(xr + a.dl + 2 * i + 1) : xr[a.dl + 2 * i + 1];
        float y[2];
        rope_pair(x0, x1, pos, a.inv_freq[i], a.mscale, y);
        latent_store(yr, LATENT_ROPE_AT + 2 * i, y[0]);
        latent_store(yr, LATENT_ROPE_AT + 2 * i + 1, y[1]);
    }

    // c_kv: as rmsnorm.
    float v[V], wv[V];
    load_row<V, L2, Team>(v, xr, a.dl);
    load_row<V, false, Team>(wv, a.w, a.dl);
    const float inv = rms_inv<V, Team>(v, a.dl, a.eps, scratch);
#pragma unroll
    for (int k = 0; k < V; k++) {
        int i = Team::rank() + k * Team::size();
        if (i < a.dl) latent_store(yr, i, v[k] * inv * wv[k]);
    }
}

template <int V, bool L2, class Team = BlockTeam>
__device__ __forceinline__ void query_row(const LatentNorm& a, int t, float* scratch) {
    float v[V], wv[V];
    load_row<V, L2, Team>(v, a.qx + (i64)t * a.dq, a.dq);
    load_row<V, false, Team>(wv, a.qw, a.dq);
    rms_store<V, Team>(v, wv, a.qy + (i64)t * a.dq, a.dq, a.eps, scratch);
}

template <int V, bool L2, class Team = BlockTeam>
__device__ __forceinline__ void key_row(const LatentNorm& a, int t, float* scratch) {
    layernorm_rope_row<V, L2, Team>(a.kx + (i64)t * a.dk, a.kw, a.kb, a.ky + (i64)t * a.dk, a.dk,
                              a.k_eps, a.dr, (float)(a.pos0 + t), a.inv_freq, a.mscale, scratch);
}
