// gelu_tanh.cu: the ANDREA-120M tanh-GELU kernel behind the TensorRT plugins andrea::TanhGelu and
// andrea::TanhGeluBias (version "1"). See README.md beside this file for the math, the error bounds,
// the entry points and the changelog.
//
//   y = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))      (TanhGelu)
//   y = gelu(x + bias[i % bias_len])                                  (TanhGeluBias)
//
// - float16 / bfloat16 storage: tanh is ONE hardware instruction, PTX tanh.approx.f32 (SASS MUFU.TANH, sm_75+),
//   whose 2^-11 relative error is below the output format's own rounding.
// - float32 storage: tanh to float32 accuracy (about 2^-22 relative: an odd polynomial near 0, else
//   1 - 2 / (2^(2u log2 e) + 1) through ex2.approx.f32), since an fp32 engine is held to fp32's logits and
//   tanh.approx's error alone moved ANDREA-120M's logits by up to 6e-4. The kernel stays bound by memory.
// - the math is always float32.
// - 16-byte vector loads and stores for the aligned body, scalar head and tail for any length and any
//   pointer alignment (TensorRT may hand us tensors at element offsets); a fully scalar path when
//   x and y are misaligned relative to each other.
// - No #include at all: the source compiles with NVRTC without system headers, with nvcc, and with a
//   host C++ compiler for the CPU test harness (host_emulation.cpp defines ANDREA_HOST_EMULATION and
//   supplies the few device primitives below in software).
// - Calling convention of TensorRT AOT plugins (tensorrt.plugin.aot_impl): input pointers first, then
//   int32 scalar arguments, then output pointers. half/bfloat16 travel as raw 16-bit patterns
//   (unsigned short), which is the same ABI as __half / __nv_bfloat16 pointers.
//
// Launch: any 1-D grid works (grid-stride loops); the plugin uses 256 threads per block and
// ceil((n + 1) / (256 * VEC)) blocks (never 0), VEC = 16 / sizeof(element) (4 for fp32, 8 for fp16/bf16), so
// each thread handles at most one 16-byte vector plus at most one head and one tail element.

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)

#define ANDREA_DEVICE __device__ __forceinline__

// tanh.approx.f32: max relative error about 2^-11 (PTX ISA, "tanh" floating-point instruction). One MUFU.TANH.
ANDREA_DEVICE float andrea_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// ex2.approx.ftz.f32: 2^x, max relative error about 2^-22 (PTX ISA). One MUFU.EX2.
ANDREA_DEVICE float andrea_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
ANDREA_DEVICE float andrea_fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
ANDREA_DEVICE float andrea_bits_to_f32(unsigned int u) { return __uint_as_float(u); }
ANDREA_DEVICE float andrea_f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
// Two floats to one packed pair, round-to-nearest-even; the low half holds `lo` (cvt.rn.f16x2.f32 puts
// its first source operand in the upper half). sm_80+ (PTX ISA 7.0).
ANDREA_DEVICE unsigned int andrea_pack_f16x2(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
ANDREA_DEVICE unsigned int andrea_pack_bf16x2(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
ANDREA_DEVICE unsigned short andrea_f32_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
ANDREA_DEVICE unsigned short andrea_f32_to_bf16(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
ANDREA_DEVICE unsigned int andrea_f32_to_bits(float f) { return __float_as_uint(f); }
// 16-byte global load/store, written in PTX so that they stay ONE instruction each (LDG.E.128 /
// STG.E.128): a plain struct copy may be split into four 32-bit accesses. `p` must be 16-byte aligned.
#define ANDREA_LD16(v, p)                                                                   \
    asm("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"                                        \
        : "=r"((v).w[0]), "=r"((v).w[1]), "=r"((v).w[2]), "=r"((v).w[3])                   \
        : "l"(p))
#define ANDREA_ST16(p, v)                                                                   \
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};"                               \
                 :                                                                          \
                 : "l"(p), "r"((v).w[0]), "r"((v).w[1]), "r"((v).w[2]), "r"((v).w[3])      \
                 : "memory")

#elif defined(ANDREA_HOST_EMULATION)
// The host harness (host_emulation.cpp) has defined ANDREA_DEVICE, __global__, __restrict__,
// threadIdx/blockIdx/blockDim/gridDim, ANDREA_LD16/ANDREA_ST16 and the andrea_* primitives before including this file.
#else
#error "gelu_tanh.cu: compile with NVRTC or nvcc, or on the host through host_emulation.cpp"
#endif

namespace andrea {

// 16 bytes, 16-byte aligned: loads and stores of this type are LDG.E.128 / STG.E.128.
struct alignas(16) Vec16 {
    unsigned int w[4];
};

// sqrt(2/pi) and 0.044715 * sqrt(2/pi), rounded to float32 (same constants as NVIDIA's geluPlugin).
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubicCoef = 0.035677408136300125f;

// tanh(u) to float32 accuracy, for the float32 entry points. |u| < 0.55: u + u^3 P(u^2), P of degree 4 fitted
// to tanh's relative error (2^-23.8 in float32 arithmetic); above: 1 - 2 / (e^(2|u|) + 1), no cancellation
// (the quotient is at most 1/2), e^(2|u|) = 2^(2 log2(e) |u|) by ex2.approx (inf past |u| = 44: tanh = 1), the
// sign put back. NaN stays NaN. Relative error <= 2^-20 (reference.py's TANH_ACCURATE_REL_ERR).
ANDREA_DEVICE float tanh_accurate(float u) {
    const float a = andrea_bits_to_f32(andrea_f32_to_bits(u) & 0x7fffffffu);
    if (a < 0.55f) {
        const float s = u * u;
        float p = -6.349245551973581e-3f;
        p = andrea_fma(p, s, 2.112264558672905e-2f);
        p = andrea_fma(p, s, -5.386409908533096e-2f);
        p = andrea_fma(p, s, 1.33326917886734e-1f);
        p = andrea_fma(p, s, -3.3333319425582886e-1f);
        return andrea_fma(p * s, u, u);
    }
    const float e = andrea_ex2(2.8853900817779268f * a);  // 2 log2(e) |u|
    const float t = 1.0f - 2.0f / (e + 1.0f);
    return andrea_bits_to_f32(andrea_f32_to_bits(t) | (andrea_f32_to_bits(u) & 0x80000000u));
}

// gelu_tanh in float32 with the storage's tanh (S::tanh): u = sqrt(2/pi) * x * (1 + 0.044715 x^2);
// y = 0.5x + 0.5x * tanh(u) (one FMA, no cancellation in 1 + tanh(u) for negative x).
template <class S>
ANDREA_DEVICE float gelu(float x) {
    const float u = x * andrea_fma(kCubicCoef, x * x, kSqrt2OverPi);
    const float t = S::tanh(u);
    const float hx = 0.5f * x;
    return andrea_fma(hx, t, hx);
}

// Storage traits: element type, elements per 16-byte vector, scalar and vector conversion.
struct F32 {
    typedef float T;
    static constexpr int kVec = 4;
    static ANDREA_DEVICE float tanh(float u) { return tanh_accurate(u); }
    static ANDREA_DEVICE float load(T v) { return v; }
    static ANDREA_DEVICE T store(float f) { return f; }
    static ANDREA_DEVICE void unpack(const Vec16& v, float (&f)[kVec]) {
        for (int k = 0; k < 4; ++k) f[k] = andrea_bits_to_f32(v.w[k]);
    }
    static ANDREA_DEVICE Vec16 pack(const float (&f)[kVec]) {
        Vec16 v;
        for (int k = 0; k < 4; ++k) v.w[k] = andrea_f32_to_bits(f[k]);
        return v;
    }
};

struct F16 {
    typedef unsigned short T;  // IEEE binary16 bit pattern (__half)
    static constexpr int kVec = 8;
    static ANDREA_DEVICE float tanh(float u) { return andrea_tanh(u); }
    static ANDREA_DEVICE float load(T v) { return andrea_f16_to_f32(v); }
    static ANDREA_DEVICE T store(float f) { return andrea_f32_to_f16(f); }
    static ANDREA_DEVICE void unpack(const Vec16& v, float (&f)[kVec]) {
        for (int k = 0; k < 4; ++k) {  // little-endian: element 2k in the low half of word k
            f[2 * k] = andrea_f16_to_f32((unsigned short)(v.w[k] & 0xffffu));
            f[2 * k + 1] = andrea_f16_to_f32((unsigned short)(v.w[k] >> 16));
        }
    }
    static ANDREA_DEVICE Vec16 pack(const float (&f)[kVec]) {
        Vec16 v;
        for (int k = 0; k < 4; ++k) v.w[k] = andrea_pack_f16x2(f[2 * k], f[2 * k + 1]);
        return v;
    }
};

struct BF16 {
    typedef unsigned short T;  // bfloat16 bit pattern (__nv_bfloat16): the upper half of a float32
    static constexpr int kVec = 8;
    static ANDREA_DEVICE float tanh(float u) { return andrea_tanh(u); }
    static ANDREA_DEVICE float load(T v) { return andrea_bits_to_f32((unsigned int)v << 16); }
    static ANDREA_DEVICE T store(float f) { return andrea_f32_to_bf16(f); }
    static ANDREA_DEVICE void unpack(const Vec16& v, float (&f)[kVec]) {
        for (int k = 0; k < 4; ++k) {
            f[2 * k] = andrea_bits_to_f32(v.w[k] << 16);
            f[2 * k + 1] = andrea_bits_to_f32(v.w[k] & 0xffff0000u);
        }
    }
    static ANDREA_DEVICE Vec16 pack(const float (&f)[kVec]) {
        Vec16 v;
        for (int k = 0; k < 4; ++k) v.w[k] = andrea_pack_bf16x2(f[2 * k], f[2 * k + 1]);
        return v;
    }
};

// The whole kernel body, shared by every entry point. HasBias selects y = gelu(x + bias[i % bias_len]).
template <class S, bool HasBias>
ANDREA_DEVICE void gelu_body(const typename S::T* __restrict__ x, const typename S::T* __restrict__ bias,
                             int n, int bias_len, typename S::T* __restrict__ y) {
    typedef typename S::T T;
    constexpr int V = S::kVec;
    if (n <= 0 || (HasBias && bias_len <= 0)) return;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nthreads = (long long)gridDim.x * blockDim.x;

    // Vector body [head, head + nvec * V): x and y share their offset within 16 bytes, so after `head`
    // scalar elements both are 16-byte aligned. Otherwise everything goes through the scalar path.
    const unsigned long long xa = (unsigned long long)x, ya = (unsigned long long)y;
    long long head = n, nvec = 0;
    if (((xa ^ ya) & 15ull) == 0 && (xa % sizeof(T)) == 0) {
        head = (long long)(((16ull - (xa & 15ull)) & 15ull) / sizeof(T));
        if (head > n) head = n;
        nvec = (n - head) / V;
    }
    const long long tail = head + nvec * V;

    // Scalar head and tail (and the whole tensor on the misaligned path).
    for (long long i = tid; i < head; i += nthreads) {
        float v = S::load(x[i]);
        if (HasBias) v += S::load(bias[(unsigned int)i % (unsigned int)bias_len]);
        y[i] = S::store(gelu<S>(v));
    }
    for (long long i = tail + tid; i < n; i += nthreads) {
        float v = S::load(x[i]);
        if (HasBias) v += S::load(bias[(unsigned int)i % (unsigned int)bias_len]);
        y[i] = S::store(gelu<S>(v));
    }

    const Vec16* __restrict__ xv = reinterpret_cast<const Vec16*>(x + head);
    Vec16* __restrict__ yv = reinterpret_cast<Vec16*>(y + head);
    // Bias by vectors too when every vector's bias slice is one aligned 16-byte chunk.
    const bool bias_vec = HasBias && head == 0 && (bias_len % V) == 0 &&
                          (((unsigned long long)bias) & 15ull) == 0;
    for (long long v = tid; v < nvec; v += nthreads) {
        float f[V];
        Vec16 in;
        ANDREA_LD16(in, xv + v);
        S::unpack(in, f);
        if (HasBias) {
            unsigned int b = (unsigned int)(head + v * V) % (unsigned int)bias_len;
            if (bias_vec) {
                float fb[V];
                Vec16 bv;
                ANDREA_LD16(bv, bias + b);
                S::unpack(bv, fb);
                for (int k = 0; k < V; ++k) f[k] += fb[k];
            } else {
                for (int k = 0; k < V; ++k) {
                    f[k] += S::load(bias[b]);
                    if (++b == (unsigned int)bias_len) b = 0;
                }
            }
        }
        for (int k = 0; k < V; ++k) f[k] = gelu<S>(f[k]);
        const Vec16 out = S::pack(f);
        ANDREA_ST16(yv + v, out);
    }
}

}  // namespace andrea

// ---- entry points (extern "C": the PTX .entry names are exactly these) ----------------------------

extern "C" __global__ void gelu_tanh_f32(const float* __restrict__ x, int n, float* __restrict__ y) {
    andrea::gelu_body<andrea::F32, false>(x, nullptr, n, 0, y);
}
extern "C" __global__ void gelu_tanh_f16(const unsigned short* __restrict__ x, int n,
                                         unsigned short* __restrict__ y) {
    andrea::gelu_body<andrea::F16, false>(x, nullptr, n, 0, y);
}
extern "C" __global__ void gelu_tanh_bf16(const unsigned short* __restrict__ x, int n,
                                          unsigned short* __restrict__ y) {
    andrea::gelu_body<andrea::BF16, false>(x, nullptr, n, 0, y);
}
extern "C" __global__ void gelu_tanh_bias_f32(const float* __restrict__ x, const float* __restrict__ bias,
                                              int n, int bias_len, float* __restrict__ y) {
    andrea::gelu_body<andrea::F32, true>(x, bias, n, bias_len, y);
}
extern "C" __global__ void gelu_tanh_bias_f16(const unsigned short* __restrict__ x,
                                              const unsigned short* __restrict__ bias, int n, int bias_len,
                                              unsigned short* __restrict__ y) {
    andrea::gelu_body<andrea::F16, true>(x, bias, n, bias_len, y);
}
extern "C" __global__ void gelu_tanh_bias_bf16(const unsigned short* __restrict__ x,
                                               const unsigned short* __restrict__ bias, int n, int bias_len,
                                               unsigned short* __restrict__ y) {
    andrea::gelu_body<andrea::BF16, true>(x, bias, n, bias_len, y);
}
