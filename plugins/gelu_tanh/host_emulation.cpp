// host_emulation.cpp: runs gelu_tanh.cu, unchanged, on the CPU, so its indexing (head / vector body /
// tail, bias wrap-around, the misaligned fallback) and its float32 math are tested without a GPU.
//
// Build (andrea_export/plugin/host_emulation.py does this):
//   g++ -O1 -std=c++17 -shared -fPIC -ffp-contract=off -o libgelu_host.so host_emulation.cpp
//
// What is emulated, and how faithfully:
// - a 1-D launch: every (block, thread) pair runs in turn; the kernel has no shared memory and no
//   barriers, so sequential execution is exact;
// - tanh.approx.f32 -> tanhf (glibc, about 1 ulp) rounded to 11 significant bits: an error of up to 2^-11
//   relative, the GPU instruction's documented bound (2^-10.987), so the float16 / bfloat16 entry points
//   carry here the error they carry there; ex2.approx.ftz.f32 -> exp2f (the float32 entry points' tanh);
// - fma.rn.f32 -> fmaf (correctly rounded, like the GPU); every other float32 operation is IEEE on both;
// - cvt.f32.f16, cvt.rn.f16.f32, cvt.rn.bf16.f32 -> bit-exact software round-to-nearest-even (the
//   exported andrea_emu_* functions let tests compare them with numpy / torch over all inputs);
// - ld/st.global.v4.u32 -> memcpy of 16 bytes, after checking the 16-byte alignment the GPU requires
//   (a misaligned vector access is skipped and the launch returns 2, where a GPU would fault).

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define ANDREA_HOST_EMULATION 1
#define ANDREA_DEVICE inline
#define __global__

struct AndreaDim3 {
    unsigned int x, y, z;
};
static AndreaDim3 threadIdx, blockIdx, blockDim, gridDim;

static inline float andrea_tanh(float x) {  // MUFU.TANH's error: tanhf rounded to 11 significant bits
    unsigned int u;
    const float t = tanhf(x);
    memcpy(&u, &t, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & ~0x1fffu;  // not inf / nan: round the low 13 bits
    float r;
    memcpy(&r, &u, 4);
    return r;
}
static inline float andrea_ex2(float x) { return exp2f(x); }
static inline float andrea_fma(float a, float b, float c) { return fmaf(a, b, c); }
static inline float andrea_bits_to_f32(unsigned int u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline unsigned int andrea_f32_to_bits(float f) {
    unsigned int u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float andrea_f16_to_f32(unsigned short h) {
    const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
    const unsigned int e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float32
        const float f = (float)m * 5.9604644775390625e-08f;
        return andrea_bits_to_f32(andrea_f32_to_bits(f) | sign);
    }
    if (e == 31) return andrea_bits_to_f32(sign | 0x7f800000u | (m << 13));  // inf / nan
    return andrea_bits_to_f32(sign | ((e + 112u) << 23) | (m << 13));
}
// float32 -> binary16, round to nearest even (F. Giesen's float_to_half_fast3_rtne).
static inline unsigned short andrea_f32_to_f16(float f) {
    unsigned int u = andrea_f32_to_bits(f);
    const unsigned int sign = u & 0x80000000u;
    u ^= sign;
    unsigned short o;
    if (u >= 0x47800000u) {  // >= 65536: inf, or nan (kept quiet)
        o = (u > 0x7f800000u) ? 0x7e00 : 0x7c00;
    } else if (u < 0x38800000u) {  // < 2^-14: subnormal or zero; let a float add do the rounding
        const float t = andrea_bits_to_f32(u) + 0.5f;
        o = (unsigned short)(andrea_f32_to_bits(t) - 0x3f000000u);
    } else {
        const unsigned int mant_odd = (u >> 13) & 1u;
        u += 0xc8000fffu;  // rebias exponent (15 - 127) << 23, plus rounding bias 0xfff
        u += mant_odd;
        o = (unsigned short)(u >> 13);
    }
    return (unsigned short)(o | (sign >> 16));
}
static inline unsigned short andrea_f32_to_bf16(float f) {
    const unsigned int u = andrea_f32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // quiet nan
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline unsigned int andrea_pack_f16x2(float lo, float hi) {
    return (unsigned int)andrea_f32_to_f16(lo) | ((unsigned int)andrea_f32_to_f16(hi) << 16);
}
static inline unsigned int andrea_pack_bf16x2(float lo, float hi) {
    return (unsigned int)andrea_f32_to_bf16(lo) | ((unsigned int)andrea_f32_to_bf16(hi) << 16);
}
static int andrea_misaligned = 0;  // a GPU would fault; here the access is skipped and the launch fails
static inline bool andrea_aligned16(const void* p) {
    if (((uintptr_t)p & 15u) == 0) return true;
    andrea_misaligned = 1;
    return false;
}
#define ANDREA_LD16(v, p) (andrea_aligned16(p) ? (void)memcpy(&(v), (p), 16) : (void)memset(&(v), 0, 16))
#define ANDREA_ST16(p, v) (andrea_aligned16(p) ? (void)memcpy((p), &(v), 16) : (void)0)

#include "gelu_tanh.cu"

// ---- emulated launches: the exported C API of libgelu_host.so ----------------------------------------

template <class F>
static void launch(int grid, int block, F body) {
    gridDim = {(unsigned int)grid, 1, 1};
    blockDim = {(unsigned int)block, 1, 1};
    for (int b = 0; b < grid; ++b)
        for (int t = 0; t < block; ++t) {
            blockIdx = {(unsigned int)b, 0, 0};
            threadIdx = {(unsigned int)t, 0, 0};
            body();
        }
}

// dtype: 0 float32, 1 float16, 2 bfloat16. bias == NULL selects the plain TanhGelu entry point.
extern "C" int andrea_emu_launch(int dtype, const void* x, const void* bias, int n, int bias_len, void* y,
                                 int grid, int block) {
    typedef unsigned short u16;
    andrea_misaligned = 0;
    switch (dtype * 2 + (bias != nullptr)) {
        case 0: launch(grid, block, [&] { gelu_tanh_f32((const float*)x, n, (float*)y); }); break;
        case 1: launch(grid, block, [&] { gelu_tanh_bias_f32((const float*)x, (const float*)bias, n, bias_len, (float*)y); }); break;
        case 2: launch(grid, block, [&] { gelu_tanh_f16((const u16*)x, n, (u16*)y); }); break;
        case 3: launch(grid, block, [&] { gelu_tanh_bias_f16((const u16*)x, (const u16*)bias, n, bias_len, (u16*)y); }); break;
        case 4: launch(grid, block, [&] { gelu_tanh_bf16((const u16*)x, n, (u16*)y); }); break;
        case 5: launch(grid, block, [&] { gelu_tanh_bias_bf16((const u16*)x, (const u16*)bias, n, bias_len, (u16*)y); }); break;
        default: return 1;
    }
    return andrea_misaligned ? 2 : 0;
}

// The conversions, over arrays, so tests can compare them bit for bit with numpy / torch.
extern "C" void andrea_emu_f32_to_f16(const float* in, unsigned short* out, int n) {
    for (int i = 0; i < n; ++i) out[i] = andrea_f32_to_f16(in[i]);
}
extern "C" void andrea_emu_f16_to_f32(const unsigned short* in, float* out, int n) {
    for (int i = 0; i < n; ++i) out[i] = andrea_f16_to_f32(in[i]);
}
extern "C" void andrea_emu_f32_to_bf16(const float* in, unsigned short* out, int n) {
    for (int i = 0; i < n; ++i) out[i] = andrea_f32_to_bf16(in[i]);
}
