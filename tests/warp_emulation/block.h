// One CUDA thread block on the host, for checking the tensor-core kernels without a GPU
// (tests/warp_emulation.rs): device functions and whole kernels, cut out of the source, run
// unchanged. Every thread is a host thread; the lanes of a warp meet at every warp collective
// (a shuffle, a vote, an mma.sync, ldmatrix, __syncwarp), whose fragment layouts (mma.sync
// m16n8k32 with 8-bit operands, m16n8k16 bf16) are the PTX ISA's. The copy machinery is here
// as the ISA defines it: mbarriers (arrival counts, transaction bytes, phases), bulk copies
// and cp.async copies that land at once or as late as they may (bulk_copy, cp16), named
// barriers. An mbarrier wait
// that never ends stops the run with a message (the test kills a run that hangs elsewhere).
// Only what the kernels use is here.
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <pthread.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(...)
#define __shared__ static  // one block runs at a time in a process (run_cluster: one each)
#define __cluster_dims__(...)
#define __CUDA_ARCH__ 900

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

struct uint2 { u32 x, y; };
struct uint4 { u32 x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline uint2 make_uint2(u32 x, u32 y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

struct Dim3 { unsigned x, y, z; };
thread_local Dim3 threadIdx;
Dim3 blockIdx, gridDim, blockDim;
thread_local int LANE;

[[noreturn]] inline void fail(const char* what) {
    std::fprintf(stderr, "emulation: %s\n", what);
    std::fflush(stderr);
    std::_Exit(3);
}
inline void expect(bool ok, const char* what) {
    if (!ok) fail(what);
}

inline float __uint_as_float(u32 u) { float f; std::memcpy(&f, &u, 4); return f; }
inline u32 __float_as_uint(float f) { u32 u; std::memcpy(&u, &f, 4); return u; }
inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }  // ties to even
inline float fmaxf(float a, float b) { return std::fmax(a, b); }
inline float fabsf(float a) { return std::fabs(a); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int __ffs(u32 x) { return x ? __builtin_ctz(x) + 1 : 0; }
template <class T>
inline T __ldg(const T* p) { return *p; }
template <class T>
inline T __ldcg(const T* p) { return *p; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// Blocks run one after another: a fence orders nothing more, an atomic needs no more than this.
inline void fence_acq_rel() { std::atomic_thread_fence(std::memory_order_acq_rel); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }

// Byte s_i (0-7) of the pair (x: 0-3, y: 4-7) for each result byte i.
inline u32 __byte_perm(u32 x, u32 y, u32 s) {
    u8 b[8];
    std::memcpy(b, &x, 4);
    std::memcpy(b + 4, &y, 4);
    u32 r = 0;
    for (int i = 0; i < 4; i++) r |= (u32)b[(s >> (4 * i)) & 7] << (8 * i);
    return r;
}

// PTX prmt.b32's default mode (kernels/matvec.cu's prmt): from the selector's low 16 bits,
// byte s_i & 7 of the pair for each result byte i, or its sign in all 8 bits where s_i & 8.
inline u32 prmt(u32 a, u32 b, u32 s) {
    u8 p[8];
    std::memcpy(p, &a, 4);
    std::memcpy(p + 4, &b, 4);
    u32 r = 0;
    for (int i = 0; i < 4; i++) {
        u32 sel = (s >> (4 * i)) & 15, v = p[sel & 7];
        r |= (sel & 8 ? (v & 0x80 ? 0xFFu : 0u) : v) << (8 * i);
    }
    return r;
}

// kernels/matvec.cu's lop3 helpers.
inline u32 bit_select(u32 a, u32 b, u32 mask) { return (a & mask) | (b & ~mask); }
inline u32 and_xor(u32 a, u32 mask, u32 flip) { return (a & mask) ^ flip; }

inline float f16_to_f32(u16 h) {  // finite values
    int e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24) : std::ldexp((float)(m | 1024), e - 25);
    return h >> 15 ? -v : v;
}

inline u32 __funnelshift_r(u32 lo, u32 hi, u32 sh) {
    return (u32)((((unsigned long long)hi << 32) | lo) >> (sh & 31));
}

inline uint4 ld_cached16(const u8* p) { uint4 v; std::memcpy(&v, p, 16); return v; }
inline uint4 ld_stream16(const u8* p) { uint4 v; std::memcpy(&v, p, 16); return v; }
inline void prefetch_l2(const void*) {}
inline uint2 ld_cached8(const u8* p) { uint2 v; std::memcpy(&v, p, 8); return v; }

// Programmatic dependent launch: one kernel at a time here (and no chain clock to stamp).
inline void pdl_wait(bool stamps = false) {}
inline void pdl_launch_next() {}
inline void pdl_enter() {}

// ---- a warp ----

// What the lanes post for one warp collective (shuffle values, ldmatrix addresses, mma
// fragments), read by every lane after one meeting. Collectives alternate between two sets:
// a lane that posts for the next but one has passed the next meeting, so every lane has read
// this one's.
struct Posted {
    u64 sent[32];
    u32 a[32][4], b[32][2];
};
struct Warp {
    std::barrier<> meet{32};
    Posted posted[2];
};
thread_local Warp* WARP;
thread_local unsigned COLLECTIVES;  // this lane's so far (the same in every lane)

inline void __syncwarp() { WARP->meet.arrive_and_wait(); }
inline Posted& collective() { return WARP->posted[COLLECTIVES++ & 1]; }
// What lane `from` sent, for every lane.
inline u64 exchange(u64 v, int from) {
    Posted& p = collective();
    p.sent[LANE] = v;
    __syncwarp();
    return p.sent[from];
}
inline float __shfl_xor_sync(unsigned, float v, int o) {
    return __uint_as_float((u32)exchange(__float_as_uint(v), LANE ^ o));
}
inline int __shfl_xor_sync(unsigned, int v, int o) { return (int)exchange((u32)v, LANE ^ o); }
inline u64 __shfl_sync(unsigned, u64 v, int from) { return exchange(v, from); }
inline int __shfl_up_sync(unsigned, int v, int d) {
    const int from = LANE >= d ? LANE - d : LANE;
    return (int)exchange((u32)v, from);
}
inline u32 __ballot_sync(unsigned, bool p) {
    u32 r = 0;
    for (int l = 0; l < 32; l++) r |= (u32)(exchange(p, l) != 0) << l;
    return r;
}
inline bool __any_sync(unsigned m, bool p) { return __ballot_sync(m, p) != 0; }
inline u32 __reduce_add_sync(unsigned, u32 v) {
    u32 r = 0;
    for (int l = 0; l < 32; l++) r += (u32)exchange(v, l);
    return r;
}
inline float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// D = A B, A 16 x 32 (rows), B 32 x 8 (columns). Lane (g = lane / 4, t = lane % 4)
// holds A rows g (a0, a2) and g + 8 (a1, a3), k = 4t .. 4t + 3 (a0, a1) and 16 + 4t .. (a2,
// a3); B column g, k = 4t .. (b0) and 16 + 4t .. (b1); D rows g (d0, d1) and g + 8 (d2, d3),
// columns 2t and 2t + 1.
inline int byte_value(u32 w, int i, bool is_signed) {
    int v = (w >> (8 * i)) & 255;
    return is_signed && v > 127 ? v - 256 : v;
}
inline void mma_16832(int* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, bool a_signed,
                      bool add = false) {
    Posted& p = collective();
    u32* a = p.a[LANE];
    a[0] = a0, a[1] = a1, a[2] = a2, a[3] = a3;
    p.b[LANE][0] = b0, p.b[LANE][1] = b1;
    __syncwarp();
    auto A = [&](int row, int k) {
        return byte_value(p.a[(row & 7) * 4 + (k & 15) / 4][(row >= 8) + 2 * (k >= 16)],
                          k & 3, a_signed);
    };
    auto B = [&](int k, int col) {
        return byte_value(p.b[col * 4 + (k & 15) / 4][k >= 16], k & 3, true);
    };
    int g = LANE >> 2, t = LANE & 3;
    for (int i = 0; i < 4; i++) {
        int row = g + 8 * (i >> 1), col = 2 * t + (i & 1), s = 0;
        for (int k = 0; k < 32; k++) s += A(row, k) * B(k, col);
        d[i] = add ? d[i] + s : s;
    }
}
inline void mma_s8_16832(int* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    mma_16832(d, a0, a1, a2, a3, b0, b1, true);
}
// D += A B.
inline void mma_s8_16832_acc(int* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    mma_16832(d, a0, a1, a2, a3, b0, b1, true, true);
}
inline void mma_u8s8_16832_acc(int* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    mma_16832(d, a0, a1, a2, a3, b0, b1, false, true);
}

// ---- the block: barriers, dynamic shared memory ----

std::barrier<>* BLOCK;  // __syncthreads
std::mutex NAMED_LOCK;
struct Named {
    int count;
    std::unique_ptr<std::barrier<>> barrier;
    std::atomic<long> arrivals{0};
};
std::map<int, Named> NAMED;  // by bar.sync id
u8* DYNAMIC_SHARED;
size_t DYNAMIC_SHARED_BYTES;

// After the block starts and after each block-wide or named barrier, a third of the warps
// (by a hash of block, warp, barrier count and run) sleep a little: a warp that reads what
// another wrote without a barrier between then reads it too early. In the first two blocks
// of a grid and its last (the sleeps add up over many).
thread_local unsigned BARRIERS_PASSED;
bool LATE_COPIES;
inline void stagger() {
    const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (b >= 2 && b + 1 != gridDim.x * gridDim.y * gridDim.z) return;
    unsigned h = ((blockIdx.x + 7 * blockIdx.y + 61 * blockIdx.z) * 131u + (threadIdx.x >> 5)) *
                     2654435761u ^
                 (BARRIERS_PASSED++ * 40503u + LATE_COPIES);
    h = (h ^ (h >> 15)) * 2246822519u;
    if ((h >> 13) % 3 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
}
inline void __syncthreads() {
    BLOCK->arrive_and_wait();
    stagger();
}
// The kernels' `extern __shared__` array (the test puts this in its place).
inline u8* dynamic_shared() { return DYNAMIC_SHARED; }
// Named barrier `id` of `count` threads (bar.sync / bar.arrive): made by its first user.
inline Named& named(int id, int count) {
    std::lock_guard<std::mutex> g(NAMED_LOCK);
    Named& b = NAMED[id];
    if (!b.barrier) b.count = count, b.barrier = std::make_unique<std::barrier<>>(count);
    expect(b.count == count, "a named barrier used with two thread counts");
    b.arrivals++;
    return b;
}
inline void named_sync(int id, int count) {
    named(id, count).barrier->arrive_and_wait();
    stagger();
}
template <int WARPS = 8>
inline void consumers_sync() { named_sync(1, 32 * WARPS); }
int OR_FLAG;
inline int __syncthreads_or(int p) {
    if (p) OR_FLAG = 1;  // a plain store of the same value by any thread: benign
    BLOCK->arrive_and_wait();
    const int r = OR_FLAG;
    BLOCK->arrive_and_wait();
    if (threadIdx.x == 0) OR_FLAG = 0;
    __syncthreads();
    return r;
}

// Shared-space addresses (cvta.to.shared) of the dynamic shared memory, and back.
const u32 SHARED_AT = 0x400;
inline u64 __cvta_generic_to_shared(const void* p) {
    expect((const u8*)p >= DYNAMIC_SHARED && (const u8*)p <= DYNAMIC_SHARED + DYNAMIC_SHARED_BYTES,
           "a shared address outside the dynamic shared memory");
    return SHARED_AT + (u32)((const u8*)p - DYNAMIC_SHARED);
}
inline u8* shared_ptr(u32 a, u32 bytes) {
    expect(a >= SHARED_AT && a - SHARED_AT + bytes <= DYNAMIC_SHARED_BYTES,
           "an access past the dynamic shared memory");
    return DYNAMIC_SHARED + (a - SHARED_AT);
}

// cp.async of 16 bytes (or zeros, src-size 0): with LATE_COPIES it lands only when the
// issuing thread waits for its group (cp.async.wait_group N: all but the newest N committed
// groups), else when issued.
struct CpCopy {
    u8* dst;
    const void* src;
    bool pred;
    void land() const {
        if (pred) std::memcpy(dst, src, 16);
        else std::memset(dst, 0, 16);
    }
};
thread_local std::vector<CpCopy> CP_OPEN;                  // not committed yet
thread_local std::vector<std::vector<CpCopy>> CP_GROUPS;  // committed, oldest first
inline void cp16(u32 dst, const void* src, bool pred) {
    const CpCopy c{shared_ptr(dst, 16), src, pred};
    if (LATE_COPIES) CP_OPEN.push_back(c);
    else c.land();
}
inline void cp_commit() { CP_GROUPS.push_back(std::move(CP_OPEN)), CP_OPEN.clear(); }
template <int N>
inline void cp_wait() {
    while (CP_GROUPS.size() > (size_t)N) {
        for (const CpCopy& c : CP_GROUPS.front()) c.land();
        CP_GROUPS.erase(CP_GROUPS.begin());
    }
}
// At a thread's end: on a GPU they would land in the next block's shared memory.
inline void cp_none_pending() {
    expect(CP_OPEN.empty(), "cp.async copies never committed");
    for (const auto& g : CP_GROUPS) expect(g.empty(), "cp.async copies no thread waited for");
    CP_GROUPS.clear();
}

// ---- bf16 tensor cores (kernels/mla_decode.cu) ----

inline u16 bf16_rne(float f) {  // finite values
    u32 u = __float_as_uint(f);
    return (u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline u32 pack_bf16x2(float lo, float hi) { return bf16_rne(lo) | ((u32)bf16_rne(hi) << 16); }
inline float bf16_value(u32 w, int half) { return __uint_as_float((half ? w >> 16 : w & 0xFFFFu) << 16); }
inline float ex2_approx(float x) { return std::exp2(x); }

// D += A B, A 16 x 16 (rows), B 16 x 8 (columns), bf16, f32 sums. Lane (g, t) holds A rows g
// (a0, a2) and g + 8 (a1, a3), k = 2t, 2t + 1 (a0, a1) and 8 + 2t .. (a2, a3); B column g,
// k = 2t .. (b0) and 8 + 2t .. (b1); C rows g (c0, c1) and g + 8 (c2, c3), columns 2t, 2t + 1;
// the lower k in each register's low half.
inline void mla_mma(float* c, const u32* a, u32 b0, u32 b1) {
    Posted& p = collective();
    u32* ar = p.a[LANE];
    for (int i = 0; i < 4; i++) ar[i] = a[i];
    p.b[LANE][0] = b0, p.b[LANE][1] = b1;
    __syncwarp();
    auto A = [&](int row, int k) {
        return bf16_value(p.a[(row & 7) * 4 + (k & 7) / 2][(row >= 8) + 2 * (k >= 8)], k & 1);
    };
    auto B = [&](int k, int col) { return bf16_value(p.b[col * 4 + (k & 7) / 2][k >= 8], k & 1); };
    int g = LANE >> 2, t = LANE & 3;
    for (int i = 0; i < 4; i++) {
        int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        double s = c[i];
        for (int k = 0; k < 16; k++) s += (double)A(row, k) * (double)B(k, col);
        c[i] = (float)s;
    }
}
// ldmatrix .x4 (.trans): lanes 8i .. 8i + 7 give the addresses of rows 0-7 of 8 x 8 b16 matrix
// i; r[i] of lane l holds its row l / 4, columns 2 (l % 4) and + 1 (transposed: column l / 4,
// rows 2 (l % 4) and + 1).
inline void ldmatrix(u32* r, u32 addr, bool trans) {
    expect(addr % 16 == 0, "ldmatrix: a row address off 16 bytes");
    Posted& p = collective();
    p.sent[LANE] = addr;
    __syncwarp();
    auto at = [&](int m, int row, int col) {
        u16 v;
        std::memcpy(&v, shared_ptr((u32)p.sent[8 * m + row], 16) + 2 * col, 2);
        return (u32)v;
    };
    const int q = LANE >> 2, e = 2 * (LANE & 3);
    for (int m = 0; m < 4; m++)
        r[m] = trans ? at(m, e, q) | at(m, e + 1, q) << 16 : at(m, q, e) | at(m, q, e + 1) << 16;
}
inline void mla_ldsm(u32* r, u32 addr) { ldmatrix(r, addr, false); }
inline void mla_ldsm_t(u32* r, u32 addr) { ldmatrix(r, addr, true); }

// ---- the bf16 tensor-core PTX of kernels/common.cuh (prefill products, attention) ----

inline uint4 make_uint4(u32 x, u32 y, u32 z, u32 w) { return {x, y, z, w}; }
inline void mma_bf16_16816(float* c, const u32* a, const u32* b) { mla_mma(c, a, b[0], b[1]); }
inline void ldsm_x4(u32* r, u32 addr) { ldmatrix(r, addr, false); }
inline void ldsm_x4_trans(u32* r, u32 addr) { ldmatrix(r, addr, true); }
inline u32 lop_or_and(u32 a, u32 mask, u32 orv) { return (a & mask) | orv; }
// fma.rn.bf16x2: per half a b + c, rounded once to bf16 (to nearest even; finite values). The
// product of two bf16 is exact in a double, and so is the sum at the gaps these kernels meet.
inline u32 bf2_fma(u32 a, u32 b, u32 c) {
    u32 r = 0;
    for (int h = 0; h < 2; h++) {
        const double v = (double)bf16_value(a, h) * bf16_value(b, h) + bf16_value(c, h);
        int e;
        const double m = std::frexp(v, &e);  // v = m 2^e, |m| in [0.5, 1): 8 significant bits
        const float f = (float)std::ldexp(std::nearbyint(std::ldexp(m, 8)), e - 8);
        r |= (__float_as_uint(f) >> 16) << (16 * h);
    }
    return r;
}

// ---- mbarriers and bulk copies ----

struct Mbarrier {
    int count, pending;
    long long tx;  // bytes expected and not yet arrived
    unsigned phase;
};
std::mutex MBAR_LOCK;
std::condition_variable MBAR_CHANGED;
std::map<const void*, Mbarrier> MBARS;
const auto HANG = std::chrono::seconds(60);

inline Mbarrier& mbar(const u64* b) {
    auto it = MBARS.find(b);
    expect(it != MBARS.end(), "an mbarrier used before mbar_init");
    return it->second;
}
// The phase completes once every arrival and every expected byte is in.
inline void mbar_settle(Mbarrier& m) {
    expect(m.pending >= 0, "more arrivals on an mbarrier than its count");
    if (m.pending == 0 && m.tx == 0) {
        m.phase++;
        m.pending = m.count;
        MBAR_CHANGED.notify_all();
    }
}
inline void mbar_init(u64* b, int count) {
    std::lock_guard<std::mutex> g(MBAR_LOCK);
    MBARS[b] = {count, count, 0, 0};
}
inline void mbar_expect_bytes(u64* b, u32 bytes) {
    std::lock_guard<std::mutex> g(MBAR_LOCK);
    Mbarrier& m = mbar(b);
    m.tx += bytes;
    m.pending--;
    mbar_settle(m);
}
inline void mbar_arrive(u64* b) {
    std::lock_guard<std::mutex> g(MBAR_LOCK);
    Mbarrier& m = mbar(b);
    m.pending--;
    mbar_settle(m);
}
// Bulk copies land either at once (where a producer that refills a stage before its readers
// released it spoils what they read) or as late as they may, when a thread waits on their
// mbarrier (where a reader that did not wait reads what was there before): launch runs each
// grid both ways.
struct Copy {
    void* dst;
    const void* src;
    u32 bytes;
    u64* bar;
};
std::vector<Copy> PENDING;  // under MBAR_LOCK

inline void land(const Copy& c) {
    std::memcpy(c.dst, c.src, c.bytes);
    Mbarrier& m = mbar(c.bar);
    m.tx -= c.bytes;
    mbar_settle(m);
}
// The late copies counted on b (MBAR_LOCK held).
inline void land_pending(const u64* b) {
    for (size_t i = 0; i < PENDING.size();) {
        if (PENDING[i].bar == b) {
            land(PENDING[i]);
            PENDING.erase(PENDING.begin() + i);
        } else {
            i++;
        }
    }
}
// Until the phase of the given parity has completed (the current phase's parity differs).
inline void mbar_wait(u64* b, u32 parity) {
    std::unique_lock<std::mutex> g(MBAR_LOCK);
    Mbarrier& m = mbar(b);
    const auto deadline = std::chrono::steady_clock::now() + HANG;
    for (;;) {
        land_pending(b);
        if ((m.phase & 1) != parity) return;
        if (MBAR_CHANGED.wait_until(g, deadline) == std::cv_status::timeout) break;
    }
    std::fprintf(stderr,
                 "emulation: thread %u waits on an mbarrier for parity %u: phase %u, %d "
                 "arrivals and %lld bytes missing\n",
                 threadIdx.x, parity, m.phase, m.pending, m.tx);
    fail("hang");
}
inline void init_stage_barriers(u64* full, u64* empty, int stages, int readers) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], readers);
        }
    }
    __syncthreads();
}

// A proxy fence: the emulated copies and stores are one memory already.
inline void fence_proxy_async() {}

// cp.async.bulk global -> shared: 16-byte aligned, a multiple of 16 bytes, into the dynamic
// shared memory.
inline void bulk_copy(void* dst, const void* src, u32 bytes, u64* b) {
    expect((uintptr_t)dst % 16 == 0 && (uintptr_t)src % 16 == 0 && bytes % 16 == 0 && bytes > 0,
           "bulk_copy: not 16-byte aligned, or not a multiple of 16 bytes");
    expect((u8*)dst >= DYNAMIC_SHARED && (u8*)dst + bytes <= DYNAMIC_SHARED + DYNAMIC_SHARED_BYTES,
           "bulk_copy: past the dynamic shared memory");
    std::lock_guard<std::mutex> g(MBAR_LOCK);
    if (LATE_COPIES) {
        PENDING.push_back({dst, src, bytes, b});
        MBAR_CHANGED.notify_all();  // a thread may be waiting for it
    } else {
        land({dst, src, bytes, b});
    }
}

// ---- a cluster of blocks (sm_90's thread block clusters) ----

// run_cluster runs each block of a cluster in a process of its own (fork), so that its
// __shared__ variables (statics) are its own. At each cluster barrier a block's first thread
// copies the process's static data (.data and .bss, where the statics are; GCC ignores a
// section attribute on a template's static) into the block's slot of memory the processes
// share (two sets of slots, by the barrier's parity), and ld.shared::cluster reads the slot of
// the block it names, at the variable's place: what that block wrote before the barrier,
// which is all a kernel may read of it (what it writes after is not ordered before the read).
extern "C" u8 __data_start[], _end[];
unsigned CLUSTER_RANK, CLUSTER_SIZE, CLUSTER_PHASE;
pthread_barrier_t* CLUSTER_BARRIER;  // in the shared memory: the blocks' first threads
u8* CLUSTER_SLOTS;                   // [parity][rank] copies of the static data
inline size_t static_bytes() { return _end - __data_start; }
// Unchecked, words then the last bytes: the copy takes in the sanitizer's red zones between
// variables.
__attribute__((no_sanitize_address)) inline void copy_statics(u8* to) {
    const size_t words = static_bytes() / 8;
    const volatile u64* from = (const volatile u64*)__data_start;
    for (size_t i = 0; i < words; i++) ((u64*)to)[i] = from[i];
    const volatile u8* tail = __data_start;
    for (size_t i = 8 * words; i < static_bytes(); i++) to[i] = tail[i];
}
inline void cluster_sync() {
    __syncthreads();
    if (threadIdx.x == 0) {
        const size_t slot = (CLUSTER_PHASE & 1) * CLUSTER_SIZE + CLUSTER_RANK;
        copy_statics(CLUSTER_SLOTS + slot * static_bytes());
        pthread_barrier_wait(CLUSTER_BARRIER);
        CLUSTER_PHASE++;
    }
    __syncthreads();
}
// The kernels' split barrier (arrive once done reading the others, wait before leaving): the
// copies outlive the blocks, so arriving is nothing and waiting is a whole barrier.
inline void cluster_arrive() {}
inline void cluster_wait() { cluster_sync(); }
inline int cluster_load(const int* p, int rank) {
    const size_t at = (const u8*)p - __data_start;
    expect(at + 4 <= static_bytes(), "ld.shared::cluster of a variable that is not __shared__");
    expect(CLUSTER_PHASE > 0 && (unsigned)rank < CLUSTER_SIZE, "ld.shared::cluster outside a cluster");
    const size_t slot = ((CLUSTER_PHASE - 1) & 1) * CLUSTER_SIZE + rank;
    int v;
    std::memcpy(&v, CLUSTER_SLOTS + slot * static_bytes() + at, 4);
    return v;
}
// Memory the processes of a cluster share (zeroed), for what its blocks write to global memory.
inline u8* shared_pages(size_t bytes) {
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    expect(m != MAP_FAILED, "mmap");
    return (u8*)m;
}
inline void run_grid(Dim3 grid, int threads, size_t shared, const std::function<void()>& thread);
// One cluster of `size` blocks (blockIdx.x = rank; blockIdx.y, z 0), `threads` threads and
// `shared` bytes of dynamic shared memory each. Call it before any thread is started.
inline void run_cluster(unsigned size, int threads, size_t shared,
                        const std::function<void()>& thread) {
    u8* m = shared_pages(sizeof(pthread_barrier_t) + 64 + 2 * size * static_bytes());
    CLUSTER_BARRIER = (pthread_barrier_t*)m;
    pthread_barrierattr_t attr;
    pthread_barrierattr_init(&attr);
    pthread_barrierattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_barrier_init(CLUSTER_BARRIER, &attr, size);
    CLUSTER_SLOTS = m + sizeof(pthread_barrier_t) + 64;
    CLUSTER_SIZE = size;
    std::vector<pid_t> blocks;
    for (unsigned r = 0; r < size; r++) {
        const pid_t pid = fork();
        expect(pid >= 0, "fork");
        if (pid == 0) {
            CLUSTER_RANK = r;
            run_grid({1, 1, 1}, threads, shared, thread);
            std::fflush(stdout);
            std::_Exit(0);
        }
        blocks.push_back(pid);
    }
    for (pid_t pid : blocks) {
        int status = 0;
        expect(waitpid(pid, &status, 0) == pid, "waitpid");
        expect(WIFEXITED(status) && WEXITSTATUS(status) == 0, "a block of the cluster failed");
    }
}

// Runs thread() for every thread of every block of `grid`, one block after another, with
// `threads` threads a block (one host thread each, kept from block to block) and `shared`
// bytes of dynamic shared memory (allocated exactly, filled with garbage for each block).
inline void run_grid(Dim3 grid, int threads, size_t shared, const std::function<void()>& thread) {
    const unsigned blocks = grid.x * grid.y * grid.z;
    if (blocks == 0) return;
    std::vector<u8> smem(shared);
    std::barrier<> block_barrier(threads);
    BLOCK = &block_barrier;
    std::vector<std::unique_ptr<Warp>> warps;
    for (int w = 0; w < (threads + 31) / 32; w++) warps.push_back(std::make_unique<Warp>());
    unsigned next = 0;  // the block to run, set between blocks by the barrier's completion
    auto start = [&] {
        const unsigned b = next;
        blockIdx = {CLUSTER_RANK + b % grid.x, b / grid.x % grid.y, b / grid.x / grid.y};
        gridDim = grid;
        blockDim = {(unsigned)threads, 1, 1};
        for (size_t i = 0; i < shared; i++) smem[i] = (u8)(0x5A + 77 * i + b);
        DYNAMIC_SHARED = smem.data(), DYNAMIC_SHARED_BYTES = shared;
        NAMED.clear();
        OR_FLAG = 0;
    };
    auto finish = [&]() noexcept {
        // On a GPU they would land in the next block's shared memory.
        expect(PENDING.empty(), "bulk copies no thread waited for");
        for (auto& [id, b] : NAMED)
            expect(b.arrivals % b.count == 0, "a named barrier left with arrivals at the block's end");
        MBARS.clear();
        if (++next < blocks) start();
    };
    std::barrier<decltype(finish)> between(threads, finish);
    start();
    std::vector<std::thread> pool;
    for (int i = 0; i < threads; i++)
        pool.emplace_back([&, i] {
            threadIdx = {(unsigned)i, 0, 0};
            LANE = i & 31;
            WARP = warps[i / 32].get();
            while (next < blocks) {
                COLLECTIVES = 0;
                BARRIERS_PASSED = 0;
                stagger();
                thread();
                cp_none_pending();
                between.arrive_and_wait();
            }
        });
    for (auto& t : pool) t.join();
}
// A grid of blocks, one after another, twice: copies landing at once, then late. Both runs
// must leave the same bits in `out`, which the second starts from as the first did.
inline void launch(Dim3 grid, int threads, size_t shared, std::vector<u8>& out,
                   const std::function<void()>& thread) {
    const std::vector<u8> before = out;
    std::vector<u8> first;
    for (bool late : {false, true}) {
        LATE_COPIES = late;
        out = before;
        run_grid(grid, threads, shared, thread);
        if (!late) first = out;
    }
    expect(out == first, "copies landing at once and late give different results");
}
inline void launch(unsigned grid, int threads, size_t shared, std::vector<u8>& out,
                   const std::function<void()>& thread) {
    launch(Dim3{grid, 1, 1}, threads, shared, out, thread);
}
// Runs lane(l) for l = 0 .. 31 as one warp (threadIdx.x = l).
template <class Lane>
void run_warp(Lane lane) {
    run_grid({1, 1, 1}, 32, 0, [&] { lane(LANE); });
}

// ---- the harnesses' input and output ----

// The test's arguments in order: i32 / i64 scalars, and buffers (u64 length, then bytes); an
// empty buffer is a null pointer.
struct Input {
    FILE* f;
    explicit Input(const char* path) : f(std::fopen(path, "rb")) { expect(f, "no input file"); }
    template <class T>
    T scalar() {
        T v;
        expect(std::fread(&v, sizeof v, 1, f) == 1, "input too short");
        return v;
    }
    int i32() { return scalar<int>(); }
    float f32() { return scalar<float>(); }
    i64 i64_() { return scalar<i64>(); }
    // Exactly the bytes given (a read past them is the sanitizer's).
    std::vector<u8> buffer() {
        std::vector<u8> b(scalar<u64>());
        expect(std::fread(b.data(), 1, b.size(), f) == b.size(), "input too short");
        return b;
    }
};
template <class T = u8>
inline T* ptr(std::vector<u8>& b) { return b.empty() ? nullptr : (T*)b.data(); }
// f32 values as their bits in hex, a line each.
inline void print_f32(const std::vector<u8>& b) {
    for (size_t i = 0; i + 4 <= b.size(); i += 4) {
        u32 u;
        std::memcpy(&u, &b[i], 4);
        std::printf("%08x\n", u);
    }
}
