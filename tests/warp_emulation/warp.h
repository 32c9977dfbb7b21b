// One CUDA warp on the host, for checking the tensor-core kernels' fragment math without a GPU
// (tests/warp_emulation.rs). The 32 lanes are 32 threads that meet at every warp collective
// (a shuffle, an mma.sync), so device functions run unchanged; the fragment layouts of
// mma.sync.m16n8k32 with 8-bit operands are the PTX ISA's. Only what the functions under test
// use is here.
#include <barrier>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#define __device__
#define __forceinline__ inline

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

struct uint2 { u32 x, y; };
struct uint4 { u32 x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline uint2 make_uint2(u32 x, u32 y) { return {x, y}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

struct Dim3 { unsigned x, y, z; };
thread_local Dim3 threadIdx;
thread_local int LANE;
std::barrier<>* WARP;  // the 32 lanes' meeting point

inline float __uint_as_float(u32 u) { float f; std::memcpy(&f, &u, 4); return f; }
inline u32 __float_as_uint(float f) { u32 u; std::memcpy(&u, &f, 4); return u; }
inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }  // ties to even
inline float fmaxf(float a, float b) { return std::fmax(a, b); }
inline float fabsf(float a) { return std::fabs(a); }

// Byte s_i (0-7) of the pair (x: 0-3, y: 4-7) for each result byte i.
inline u32 __byte_perm(u32 x, u32 y, u32 s) {
    u8 b[8];
    std::memcpy(b, &x, 4);
    std::memcpy(b + 4, &y, 4);
    u32 r = 0;
    for (int i = 0; i < 4; i++) r |= (u32)b[(s >> (4 * i)) & 7] << (8 * i);
    return r;
}

inline float f16_to_f32(u16 h) {  // finite values
    int e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24) : std::ldexp((float)(m | 1024), e - 25);
    return h >> 15 ? -v : v;
}

inline u32 __funnelshift_r(u32 lo, u32 hi, u32 sh) {
    return (u32)((((unsigned long long)hi << 32) | lo) >> (sh & 31));
}

inline uint4 ld_cached16(const u8* p) { uint4 v; std::memcpy(&v, p, 16); return v; }
inline uint2 ld_cached8(const u8* p) { uint2 v; std::memcpy(&v, p, 8); return v; }

u32 SHUFFLED[32];
inline u32 shuffle(u32 v, int from) {
    SHUFFLED[LANE] = v;
    WARP->arrive_and_wait();
    u32 r = SHUFFLED[from];
    WARP->arrive_and_wait();
    return r;
}
inline float __shfl_xor_sync(unsigned, float v, int o) {
    return __uint_as_float(shuffle(__float_as_uint(v), LANE ^ o));
}
inline int __shfl_xor_sync(unsigned, int v, int o) { return (int)shuffle((u32)v, LANE ^ o); }
inline float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// D = A B, A 16 x 32 (rows), B 32 x 8 (columns). Lane (g = lane / 4, t = lane % 4)
// holds A rows g (a0, a2) and g + 8 (a1, a3), k = 4t .. 4t + 3 (a0, a1) and 16 + 4t .. (a2,
// a3); B column g, k = 4t .. (b0) and 16 + 4t .. (b1); D rows g (d0, d1) and g + 8 (d2, d3),
// columns 2t and 2t + 1.
u32 A_REGS[32][4], B_REGS[32][2];
inline int byte_value(u32 w, int i, bool is_signed) {
    int v = (w >> (8 * i)) & 255;
    return is_signed && v > 127 ? v - 256 : v;
}
inline void mma_16832(int* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, bool a_signed) {
    u32* a = A_REGS[LANE];
    a[0] = a0, a[1] = a1, a[2] = a2, a[3] = a3;
    B_REGS[LANE][0] = b0, B_REGS[LANE][1] = b1;
    WARP->arrive_and_wait();
    auto A = [&](int row, int k) {
        return byte_value(A_REGS[(row & 7) * 4 + (k & 15) / 4][(row >= 8) + 2 * (k >= 16)], k & 3,
                          a_signed);
    };
    auto B = [&](int k, int col) {
        return byte_value(B_REGS[col * 4 + (k & 15) / 4][k >= 16], k & 3, true);
    };
    int g = LANE >> 2, t = LANE & 3;
    for (int i = 0; i < 4; i++) {
        int row = g + 8 * (i >> 1), col = 2 * t + (i & 1), s = 0;
        for (int k = 0; k < 32; k++) s += A(row, k) * B(k, col);
        d[i] = s;
    }
    WARP->arrive_and_wait();
}
inline void mma_s8_16832(int* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    mma_16832(d, a0, a1, a2, a3, b0, b1, true);
}
inline void mma_u8s8_16832(int* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    mma_16832(d, a0, a1, a2, a3, b0, b1, false);
}

// Runs lane(l) for l = 0 .. 31 as one warp (threadIdx.x = l).
template <class Lane>
void run_warp(Lane lane) {
    std::barrier<> warp(32);
    WARP = &warp;
    std::vector<std::thread> threads;
    for (int l = 0; l < 32; l++)
        threads.emplace_back([&, l] {
            LANE = l;
            threadIdx = {(unsigned)l, 0, 0};
            lane(l);
        });
    for (auto& t : threads) t.join();
}
