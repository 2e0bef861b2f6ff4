"""Float64 reference of the plugin's exact function, storage conversions, and the error bounds the
kernel is held to (used by the CPU tests, the ONNX-level checks and benchmarks/gpu_checks.py).

    TanhGelu:      y = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))
    TanhGeluBias:  y = TanhGelu(x + bias)      bias broadcast over the last axis (i % bias_len)

Error bounds (|y_kernel - y_ref| <= bound, elementwise; y_ref from the float64 reference on the kernel's
own inputs, i.e. after they were rounded to the storage dtype):

- float32 math. The kernel computes u = x * fma(c1, x*x, c0) (c0 = sqrt(2/pi), c1 = 0.044715*c0 in
  float32), t = tanh(u), y = fma(0.5x, t, 0.5x). Each rounding is <= 2^-24 relative; propagated to y
  that is <= 2^-21 * |0.5x| + 2^-23 * |y| (the 1 + tanh form has no cancellation because of the FMA).
  The only other error is tanh's own, times |0.5x| * |t|, by the storage's entry points (TANH_REL_ERR):
    * float16 / bfloat16: tanh.approx.f32, relative error <= 2^-10.987 (PTX ISA manual): 2^-10.9. The host
      emulation rounds glibc's tanhf to 11 significant bits, an error of the same size.
    * float32: gelu_tanh.cu's tanh_accurate (a polynomial, or ex2.approx.f32 and a division): 2^-20 (read
      back from the host emulation's outputs: 2^-21.3 at worst over 4M points in [-12, 12]; ex2.approx adds up
      to 2^-22 on a GPU, where exp2f adds less).
  For the bias variant the float32 sum x + bias adds <= 2^-24 * |x + bias| * max|gelu'| (< 1.13).
- float16 / bfloat16 outputs: the float32 result is rounded once more, adding half an ulp of the output
  format at |y| (float16: 10 mantissa bits, subnormal ulp 2^-24; bfloat16: 7 bits, ulp floor 2^-133).
"""

from __future__ import annotations

import math

import numpy as np

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
CUBIC = 0.044715

TANH_APPROX_REL_ERR = 2.0**-10.9  # tanh.approx.f32, PTX ISA: max relative error 2^-10.987 (rounded up)
TANH_ACCURATE_REL_ERR = 2.0**-20  # gelu_tanh.cu's tanh_accurate
# The tanh of each storage's entry points (gelu_tanh.cu's traits), as a relative error bound: what the kernel
# is held to on a GPU and in host emulation, and the error the tests' stand-in TensorRT engine gives each
# plugin call.
TANH_REL_ERR = {"float32": TANH_ACCURATE_REL_ERR, "float16": TANH_APPROX_REL_ERR, "bfloat16": TANH_APPROX_REL_ERR}


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """TanhGelu in float64, written as x / (1 + exp(-2u)) (= 0.5x(1 + tanh u), u = sqrt(2/pi)(x + 0.044715x^3))
    so that it stays accurate where 1 + tanh(u) would cancel (x below about -3)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):  # x^3 or exp(-2u) = inf for huge |x|: y = x, or x / inf = -0
        u = SQRT_2_OVER_PI * (x + CUBIC * x**3)
        return x / (1.0 + np.exp(-2.0 * u))


def gelu_tanh_bias(x: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """TanhGeluBias in float64: bias (1-D, length = last dim) broadcast over the last axis."""
    x = np.asarray(x, dtype=np.float64)
    bias = np.asarray(bias, dtype=np.float64)
    if bias.ndim != 1 or (x.ndim and x.shape[-1] != bias.shape[0]):
        raise ValueError(f"bias must be 1-D with length = last dim of x; got x {x.shape}, bias {bias.shape}")
    return gelu_tanh(x + bias)


def gelu_tanh_bias_flat(x: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """The kernel's view of the bias variant: flat x, y[i] = gelu(x[i] + bias[i % len(bias)])."""
    x = np.asarray(x, dtype=np.float64).ravel()
    bias = np.asarray(bias, dtype=np.float64).ravel()
    return gelu_tanh(x + bias[np.arange(x.size) % bias.size])


# ---- storage types ------------------------------------------------------------------------------------


def to_storage(values: np.ndarray, dtype: str) -> np.ndarray:
    """Round values to the kernel's storage: float32 / float16 arrays, bfloat16 as uint16 bit patterns
    (round to nearest even, like cvt.rn.bf16.f32 and torch)."""
    v = np.asarray(values)
    if dtype == "float32":
        return v.astype(np.float32)
    if dtype == "float16":
        return v.astype(np.float16)
    if dtype == "bfloat16":
        u = v.astype(np.float32).view(np.uint32).astype(np.uint64)
        nan = np.isnan(v.astype(np.float32))
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
        return r
    raise ValueError(f"unsupported dtype {dtype!r}")


def from_storage(stored: np.ndarray, dtype: str) -> np.ndarray:
    """Storage array (as from to_storage) -> float64 values."""
    s = np.asarray(stored)
    if dtype == "bfloat16":
        return (s.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return s.astype(np.float64)


STORAGE_NUMPY = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def ulp(values: np.ndarray, dtype: str) -> np.ndarray:
    """Unit in the last place of |values| in the output format."""
    a = np.abs(np.asarray(values, dtype=np.float64))
    mant, min_exp = {"float32": (23, -126), "float16": (10, -14), "bfloat16": (7, -126)}[dtype]
    e = np.floor(np.log2(np.maximum(a, 2.0**min_exp)))
    return np.exp2(e - mant)


def error_bound(x: np.ndarray, dtype: str, *, bias: np.ndarray | None = None) -> np.ndarray:
    """Elementwise |y_kernel - y_ref| bound for the kernel's inputs x (flat, storage values as float64)
    and optional bias (flat, wrapping as in the kernel), on a GPU and in host emulation alike."""
    x = np.asarray(x, dtype=np.float64).ravel()
    if bias is not None:
        b = np.asarray(bias, dtype=np.float64).ravel()
        s = x + b[np.arange(x.size) % b.size]
    else:
        s = x
    ref = gelu_tanh(s)
    hx = 0.5 * np.abs(s)
    t = np.abs(np.tanh(SQRT_2_OVER_PI * (s + CUBIC * s**3)))
    f32 = hx * t * TANH_REL_ERR[dtype] + 2.0**-21 * hx + 2.0**-23 * np.abs(ref) + 2.0**-140
    if bias is not None:
        f32 = f32 + 2.0**-24 * np.abs(s) * 1.13
    if dtype == "float32":
        return f32
    return f32 + 0.5 * ulp(np.abs(ref) + f32, dtype)
