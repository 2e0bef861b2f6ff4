/*
gelu_tanh_lab.cu: kernel lab for the tanh-GELU (llm.c dev/cuda style): versions side by side, each validated
against a CPU reference, then timed against a device-to-device copy of the same bytes.

  v1  naive: one element per thread, float32 math with the libm tanhf (several instructions)
  v2  one element per thread, tanh.approx.f32 (one MUFU.TANH)
  v3  the production kernel (gelu_tanh.cu, included unchanged): 16-byte vectors, scalar head/tail
  then float32 I/O, what the accurate tanh of the float32 entry points costs:
  f32 accurate   the production gelu_tanh_f32 (polynomial / ex2.approx tanh, about 2^-22 relative)
  f32 approx     the same kernel body with tanh.approx.f32 (one MUFU.TANH), what the accurate tanh is weighed against

Compile (here, no GPU needed):
  nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/gelu_lab plugins/gelu_tanh/gelu_tanh_lab.cu
Run (GPU host):
  ./gelu_lab [version=3] [n=67108864]      fp16 I/O; prints max error and time, GB/s, % of copy bandwidth
*/

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "gelu_tanh.cu"

#define CUDA_CHECK(x)                                                                          \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

// ---- CPU reference (float64) ---------------------------------------------------------------------------
static void gelu_cpu(const std::vector<float>& x, std::vector<double>& y) {
    const double k = sqrt(2.0 / M_PI);
    for (size_t i = 0; i < x.size(); ++i) {
        const double v = x[i], u = k * (v + 0.044715 * v * v * v);
        y[i] = v / (1.0 + exp(-2.0 * u));
    }
}

// ---- v1: naive, tanhf ------------------------------------------------------------------------------------
__global__ void gelu_v1(const __half* x, int n, __half* y) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = __half2float(x[i]);
        y[i] = __float2half(0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v))));
    }
}

// ---- v2: scalar, tanh.approx ------------------------------------------------------------------------------
__global__ void gelu_v2(const __half* x, int n, __half* y) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2half(andrea::gelu<andrea::F16>(__half2float(x[i])));
}

// ---- float32 with tanh.approx: the production body, only the tanh differs --------------------------------
struct F32Approx : andrea::F32 {
    static __device__ __forceinline__ float tanh(float u) { return andrea_tanh(u); }
};
__global__ void gelu_f32_approx(const float* x, int n, float* y) { andrea::gelu_body<F32Approx, false>(x, nullptr, n, 0, y); }

// time one launch configuration: mean of `reps` launches, ms
template <class F>
static float time_ms(F launch_once, int reps) {
    cudaEvent_t t0, t1;
    CUDA_CHECK(cudaEventCreate(&t0));
    CUDA_CHECK(cudaEventCreate(&t1));
    launch_once();
    CUDA_CHECK(cudaEventRecord(t0));
    for (int r = 0; r < reps; ++r) launch_once();
    CUDA_CHECK(cudaEventRecord(t1));
    CUDA_CHECK(cudaEventSynchronize(t1));
    float ms;
    CUDA_CHECK(cudaEventElapsedTime(&ms, t0, t1));
    return ms / reps;
}

// float32 I/O: both tanh variants on the same inputs, max abs error of y and time against a copy
static void float32_section(int n, int block, int reps) {
    std::vector<float> hx(n), hy(n);
    for (int i = 0; i < n; ++i) hx[i] = 12.0f * rand() / RAND_MAX - 6.0f;
    std::vector<double> ref(n);
    gelu_cpu(hx, ref);
    float *dx, *dy;
    CUDA_CHECK(cudaMalloc(&dx, (size_t)n * 4 + 16));
    CUDA_CHECK(cudaMalloc(&dy, (size_t)n * 4 + 16));
    CUDA_CHECK(cudaMemcpy(dx, hx.data(), (size_t)n * 4, cudaMemcpyHostToDevice));
    const int grid = n / (block * 4) + 1;
    const float copy_ms = time_ms([&] { CUDA_CHECK(cudaMemcpyAsync(dy, dx, (size_t)n * 4, cudaMemcpyDeviceToDevice)); }, reps);
    for (int v = 0; v < 2; ++v) {
        auto launch_once = [&] {
            if (v == 0) gelu_tanh_f32<<<grid, block>>>(dx, n, dy);
            else gelu_f32_approx<<<grid, block>>>(dx, n, dy);
        };
        CUDA_CHECK(cudaMemset(dy, 0xff, (size_t)n * 4));  // NaN poison
        launch_once();
        CUDA_CHECK(cudaGetLastError());
        CUDA_CHECK(cudaMemcpy(hy.data(), dy, (size_t)n * 4, cudaMemcpyDeviceToHost));
        double max_abs = 0;
        for (int i = 0; i < n; ++i) {
            const double e = fabs(hy[i] - ref[i]);
            if (e > max_abs || e != e) max_abs = e;
        }
        const float ms = time_ms(launch_once, reps);
        printf("f32 %-8s  max_abs_err %.3g  %.1f us  %.0f GB/s  %.0f%% of D2D copy (%.1f us)\n",
               v == 0 ? "accurate" : "approx", max_abs, ms * 1e3, 8.0 * n / (ms * 1e6), 100.0 * copy_ms / ms,
               copy_ms * 1e3);
    }
    CUDA_CHECK(cudaFree(dx));
    CUDA_CHECK(cudaFree(dy));
}

// ---- v3: production kernel -------------------------------------------------------------------------------
static void launch(int version, const __half* x, __half* y, int n, int block) {
    if (version == 1) gelu_v1<<<(n + block - 1) / block, block>>>(x, n, y);
    else if (version == 2) gelu_v2<<<(n + block - 1) / block, block>>>(x, n, y);
    else gelu_tanh_f16<<<n / (block * 8) + 1, block>>>((const unsigned short*)x, n, (unsigned short*)y);
}

int main(int argc, char** argv) {
    const int version = argc > 1 ? atoi(argv[1]) : 3;
    const int n = argc > 2 ? atoi(argv[2]) : (64 << 20);
    const int block = 256, reps = 50;
    int dev;
    CUDA_CHECK(cudaGetDevice(&dev));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    printf("device %s (sm_%d%d), n = %d fp16\n", prop.name, prop.major, prop.minor, n);

    std::vector<float> hx(n);
    std::vector<__half> hxh(n), hy(n);
    srand(0);
    for (int i = 0; i < n; ++i) {
        hxh[i] = __float2half(12.0f * rand() / RAND_MAX - 6.0f);
        hx[i] = __half2float(hxh[i]);
    }
    std::vector<double> ref(n);
    gelu_cpu(hx, ref);

    __half *dx, *dy;
    CUDA_CHECK(cudaMalloc(&dx, (size_t)n * 2 + 16));
    CUDA_CHECK(cudaMalloc(&dy, (size_t)n * 2 + 16));
    CUDA_CHECK(cudaMemcpy(dx, hxh.data(), (size_t)n * 2, cudaMemcpyHostToDevice));

    for (int v = 1; v <= 3; ++v) {
        if (version != 3 && v != version) continue;  // version 3 (default) runs all, for the table
        CUDA_CHECK(cudaMemset(dy, 0xff, (size_t)n * 2));  // NaN poison
        launch(v, dx, dy, n, block);
        CUDA_CHECK(cudaGetLastError());
        CUDA_CHECK(cudaMemcpy(hy.data(), dy, (size_t)n * 2, cudaMemcpyDeviceToHost));
        double max_err = 0;
        int bad = 0;
        for (int i = 0; i < n; ++i) {
            const double got = __half2float(hy[i]), e = fabs(got - ref[i]);
            // half an fp16 ulp of the output + tanh.approx's 2^-10.9 relative on |x/2|
            const double a = fabs(ref[i]);
            const double ulp = a < 6.103515625e-05 ? 5.960464477539063e-08 : exp2(floor(log2(a)) - 10);
            const double bound = 0.5 * ulp + fabs(0.5 * hx[i]) * exp2(-10.9) + 1e-7;
            if (!(e <= bound) && bad++ < 5) printf("  v%d mismatch at %d: x=%g got %g want %g\n", v, i, hx[i], got, ref[i]);
            if (e > max_err || e != e) max_err = e;
        }
        cudaEvent_t t0, t1;
        CUDA_CHECK(cudaEventCreate(&t0));
        CUDA_CHECK(cudaEventCreate(&t1));
        launch(v, dx, dy, n, block);
        CUDA_CHECK(cudaEventRecord(t0));
        for (int r = 0; r < reps; ++r) launch(v, dx, dy, n, block);
        CUDA_CHECK(cudaEventRecord(t1));
        CUDA_CHECK(cudaEventSynchronize(t1));
        float ms;
        CUDA_CHECK(cudaEventElapsedTime(&ms, t0, t1));
        ms /= reps;
        CUDA_CHECK(cudaEventRecord(t0));
        for (int r = 0; r < reps; ++r) CUDA_CHECK(cudaMemcpyAsync(dy, dx, (size_t)n * 2, cudaMemcpyDeviceToDevice));
        CUDA_CHECK(cudaEventRecord(t1));
        CUDA_CHECK(cudaEventSynchronize(t1));
        float copy_ms;
        CUDA_CHECK(cudaEventElapsedTime(&copy_ms, t0, t1));
        copy_ms /= reps;
        const double gbs = 4.0 * n / (ms * 1e6);
        printf("v%d  %s  max_err %.3g  %.1f us  %.0f GB/s  %.0f%% of D2D copy (%.1f us)\n", v, bad ? "FAIL" : "ok  ",
               max_err, ms * 1e3, gbs, 100.0 * copy_ms / ms, copy_ms * 1e3);
    }
    CUDA_CHECK(cudaFree(dx));
    CUDA_CHECK(cudaFree(dy));
    if (version == 3) float32_section(n, block, reps);
    return 0;
}
