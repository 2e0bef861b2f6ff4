"""The kernel's own source (plugins/gelu_tanh/gelu_tanh.cu), compiled for the CPU through
host_emulation.cpp, against the float64 reference: every length class (empty, shorter than a vector,
head + tail only, long), every pointer offset 0..7 elements for x and y independently (same offsets
take the vector path, different ones the scalar fallback), the plugin's grid and odd grids, every dtype.

Bounds (reference.error_bound, the GPU's too): the float32 entry points' tanh within 2^-20 relative, times
|x/2|, plus 2^-21|x/2| + 2^-23|y| of float32 rounding; float16/bfloat16 carry tanh.approx.f32's 2^-10.9
(emulated here at the same size: tanhf rounded to 11 bits) and half an ulp of the output format. So an
entry point with the wrong tanh for its storage fails here, on any CPU; the GPU's own error is checked by
benchmarks/gpu_checks.py on a GPU host."""

import shutil

import numpy as np
import pytest

from andrea_export.plugin.host_emulation import HostKernel, aligned_empty, build
from andrea_export.plugin.reference import STORAGE_NUMPY, error_bound, from_storage, gelu_tanh, to_storage

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler (g++)")

DTYPES = ("float32", "float16", "bfloat16")
LENGTHS = (*range(0, 18), 31, 33, 1023, 4097)
POISON = {"float32": np.float32(np.nan), "float16": np.float16(np.nan), "bfloat16": np.uint16(0x7FC1)}


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return HostKernel(build(tmp_path_factory.mktemp("host")))


def _run(kernel, dtype, values, x_off, y_off, bias=None, bias_off=0, grid=None, block=256):
    storage = STORAGE_NUMPY[dtype]
    n = values.size
    _, x = aligned_empty(n, storage, x_off)
    x[:] = to_storage(values, dtype)
    y_raw, y = aligned_empty(n, storage, y_off)
    y_raw[:] = POISON[dtype]
    b = None
    if bias is not None:
        _, b = aligned_empty(bias.size, storage, bias_off)
        b[:] = to_storage(bias, dtype)
    before = y_raw.copy()
    kernel.launch(x, y, dtype, bias=b, grid=grid, block=block)
    # nothing written outside y
    start = (y.ctypes.data - y_raw.ctypes.data) // y.itemsize
    outside = np.ones(y_raw.size, bool)
    outside[start : start + n] = False
    assert y_raw[outside].tobytes() == before[outside].tobytes()
    return from_storage(x, dtype), from_storage(y, dtype), None if b is None else from_storage(b, dtype)


def _check(dtype, xv, yv, bv=None):
    assert np.isfinite(yv).all(), "an element was not written (poison left)"
    if bv is None:
        ref = gelu_tanh(xv)
    else:
        ref = gelu_tanh(xv + bv[np.arange(xv.size) % bv.size])
    bound = error_bound(xv, dtype, bias=bv)
    err = np.abs(yv - ref)
    assert (err <= bound).all(), f"max err/bound {np.max(err / bound):.3g} at {int(np.argmax(err / bound))}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_length_and_alignment(kernel, dtype):
    rng = np.random.default_rng(1)
    for n in LENGTHS:
        for x_off in range(8):
            for y_off in {x_off, (x_off + 1) % 8, (x_off + 3) % 8}:
                values = rng.uniform(-6, 6, n)
                _check(dtype, *_run(kernel, dtype, values, x_off, y_off)[:2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grid,block", [(1, 1), (1, 32), (3, 64), (7, 256)])
def test_any_grid_covers_everything(kernel, dtype, grid, block):
    rng = np.random.default_rng(2)
    for n in (5, 100, 4097):
        _check(dtype, *_run(kernel, dtype, rng.uniform(-6, 6, n), 3, 3, grid=grid, block=block)[:2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_variant(kernel, dtype):
    rng = np.random.default_rng(3)
    for bias_len in (1, 3, 8, 16, 24, 768):
        for rows in (1, 3):
            n = rows * bias_len
            bias = rng.uniform(-2, 2, bias_len)
            # x_off 0 + bias_off 0: vector bias loads (when bias_len % VEC == 0); otherwise the gather
            for x_off, y_off, bias_off in ((0, 0, 0), (0, 0, 1), (2, 2, 0), (5, 1, 3), (7, 7, 7)):
                values = rng.uniform(-6, 6, n)
                _check(dtype, *_run(kernel, dtype, values, x_off, y_off, bias=bias, bias_off=bias_off))


@pytest.mark.parametrize("dtype", DTYPES)
def test_wide_range_and_specials(kernel, dtype):
    big = {"float32": 1e30, "float16": 60000.0, "bfloat16": 1e30}[dtype]
    values = np.concatenate([
        [0.0, -0.0, 1e-30, -1e-30, 6e-8, -6e-8, 1e-3, -1e-3, big, -big, 10.0, -10.0, 20.0, -20.0],
        np.linspace(-12, 12, 4001),
    ])  # fmt: skip
    xv, yv, _ = _run(kernel, dtype, values, 0, 0)
    _check(dtype, xv, yv)
    assert yv[9] == 0.0 and yv[8] == xv[8]  # gelu(-big) = 0 exactly, gelu(big) = big (no inf/nan)


def test_conversions_match_numpy_and_torch(kernel):
    torch = pytest.importorskip("torch")
    every_half = np.arange(65536, dtype=np.uint16)
    f = kernel.convert("f16_to_f32", every_half)
    np.testing.assert_array_equal(f.view(np.uint32), every_half.view(np.float16).astype(np.float32).view(np.uint32))
    rng = np.random.default_rng(4)
    probes = np.concatenate([
        rng.standard_normal(20000).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 20, 20000),
        f[np.isfinite(f)],  # every half value,
        (f[np.isfinite(f)] * np.float32(1 + 2**-11)),  # ...between neighbours (ties and near-ties)
        np.array([65504, 65519.99, 65520, 1e10, 2**-25, 2**-24 * 1.5, np.inf, -np.inf], np.float32),
    ]).astype(np.float32)  # fmt: skip
    with np.errstate(over="ignore"):  # numpy warns when it rounds to inf, as it should
        want_f16 = probes.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(kernel.convert("f32_to_f16", probes), want_f16)
    want_bf16 = torch.from_numpy(probes).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(kernel.convert("f32_to_bf16", probes), want_bf16)
    np.testing.assert_array_equal(to_storage(probes, "bfloat16"), want_bf16)


def test_float32_tanh_is_float32_accurate_across_the_whole_range(kernel):
    """Dense over the range where tanh is neither 0-like nor saturated, both sides of the polynomial's switch at
    |u| = 0.55 (x about 0.63) included, then the far tails: the float32 entry point's error stays within the
    float32 bound, and its tanh within 2^-20 relative, read back from y = x/2 (1 + t) (measured: 2^-21.3)."""
    from andrea_export.plugin.reference import CUBIC, SQRT_2_OVER_PI

    x = np.concatenate([np.linspace(-12, 12, 1 << 20), np.linspace(0.55, 0.72, 4097), -np.linspace(0.55, 0.72, 4097),
                        np.array([0.0, -0.0, 1e-30, -1e-30, 50.0, -50.0, 1e4, -1e4])])  # fmt: skip
    xv, yv, _ = _run(kernel, "float32", x, 0, 0)
    _check("float32", xv, yv)
    keep = np.abs(xv) > 0.25  # t from y: 2y/x - 1 loses its relative precision where t is small
    u = SQRT_2_OVER_PI * (xv[keep] + CUBIC * xv[keep] ** 3)
    t_kernel = 2.0 * yv[keep] / xv[keep] - 1.0
    rel = np.abs(t_kernel - np.tanh(u)) / np.abs(np.tanh(u))
    assert rel.max() < 2.0**-20, np.log2(rel.max())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_half_formats_keep_tanh_approx(kernel, dtype):
    """float16 / bfloat16 outputs round to 11 / 8 bits anyway: their entry points keep tanh.approx (one MUFU.TANH,
    test_compile.py checks the SASS), and its emulated error is visible in float32 arithmetic before rounding."""
    x = np.linspace(-6, 6, 4096)
    xv, yv, _ = _run(kernel, dtype, x, 0, 0)
    _check(dtype, xv, yv)
