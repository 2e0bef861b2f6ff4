"""The float64 reference is the spec's formula, equals PyTorch's tanh GELU, and the bias variant
broadcasts over the last axis."""

import numpy as np
import pytest
import torch

from andrea_export.plugin.reference import (
    TANH_REL_ERR,
    error_bound,
    from_storage,
    gelu_tanh,
    gelu_tanh_bias,
    gelu_tanh_bias_flat,
    to_storage,
    ulp,
)


def test_formula_points():
    assert gelu_tanh(np.array([0.0]))[0] == 0.0
    x = np.linspace(-3, 5, 81)
    want = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))  # the spec's form
    np.testing.assert_allclose(gelu_tanh(x), want, rtol=1e-14, atol=1e-16)
    assert gelu_tanh(np.array([-1e200]))[0] == 0.0 and gelu_tanh(np.array([1e200]))[0] == 1e200
    assert abs(gelu_tanh(np.array([1.0]))[0] - 0.8411919906082768) < 1e-15


def test_matches_torch_float64():
    x = np.linspace(-20, 20, 10001)
    want = torch.nn.functional.gelu(torch.from_numpy(x), approximate="tanh").numpy()
    # torch evaluates 0.5x(1 + tanh u), which cancels to 0 below x of about -7: absolute agreement there
    np.testing.assert_allclose(gelu_tanh(x), want, rtol=1e-14, atol=1e-15)


def test_bias_broadcasts_over_last_axis():
    rng = np.random.default_rng(0)
    x, b = rng.standard_normal((2, 3, 8)), rng.standard_normal(8)
    np.testing.assert_array_equal(gelu_tanh_bias(x, b), gelu_tanh(x + b))
    np.testing.assert_array_equal(gelu_tanh_bias_flat(x, b).reshape(x.shape), gelu_tanh(x + b))
    with pytest.raises(ValueError, match=r"^bias must be 1-D with length = last dim of x; got x \(2, 3, 8\), bias \(7,\)$"):
        gelu_tanh_bias(x, b[:7])


def test_storage_round_trip_and_ulp():
    v = np.array([1.0, -2.5, 3.140625, 65280.0])
    for dtype in ("float32", "float16", "bfloat16"):
        np.testing.assert_array_equal(from_storage(to_storage(v, dtype), dtype), v)
    assert from_storage(to_storage(np.array([1 + 2**-8]), "bfloat16"), "bfloat16")[0] == 1.0  # tie to even
    assert ulp(np.array([1.0]), "float16")[0] == 2**-10
    assert ulp(np.array([1e-7]), "float16")[0] == 2**-24  # subnormal
    assert ulp(np.array([3.0]), "bfloat16")[0] == 2**-6


def test_float32_is_held_to_float32_and_the_half_formats_to_tanh_approx():
    """An fp32 engine is held to fp32's logits: its entry points' tanh bound is float32-sized, about 2^-20 of
    |x/2|, while float16 / bfloat16 carry tanh.approx's 2^-10.9 (below their own output rounding)."""
    x = np.array([4.0])
    assert error_bound(x, "float32")[0] < 1e-5  # 3.3e-6: 2^-20 of tanh and float32 rounding, of |x/2| = 2
    assert error_bound(x, "float16")[0] > 2.0 * 2**-11  # |x/2| * 2^-10.9, plus half an ulp
    assert TANH_REL_ERR == {"float32": 2.0**-20, "float16": 2.0**-10.9, "bfloat16": 2.0**-10.9}
