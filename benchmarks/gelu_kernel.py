"""The tanh-GELU plugin kernel on a GPU, outside TensorRT: load our NVRTC PTX with CuPy, check it against
the float64 reference (and PyTorch's tanh GELU) for every dtype, odd lengths and misaligned offsets, and
time it against torch's GELU and a device-to-device copy of the same bytes.

Needs an NVIDIA GPU, PyTorch with CUDA and CuPy (cupy-cuda13x for an R580+ driver). Used by gpu_checks.py;
also runnable alone:  python benchmarks/gelu_kernel.py
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from andrea_export.plugin.compile import BLOCK_SIZE, best_arch, compile_ptx, grid_size, kernel_name
from andrea_export.plugin.reference import error_bound, gelu_tanh

DTYPES = ("float32", "float16", "bfloat16")


class NoGpu(RuntimeError):
    pass


def require_gpu() -> tuple[Any, Any]:
    """(torch, cupy), or NoGpu with a message that says what is missing."""
    try:
        import torch
    except ImportError as e:
        raise NoGpu(f"needs PyTorch ({e})") from e
    if not torch.cuda.is_available():
        raise NoGpu("no CUDA GPU visible (torch.cuda.is_available() is False); run this on a GPU host")
    try:
        import cupy
    except ImportError as e:
        raise NoGpu(f"needs CuPy to load the PTX (pip install cupy-cuda13x): {e}") from e
    return torch, cupy


@dataclass
class Kernels:
    module: Any
    arch: str
    ptx_isa: str
    driver_floor: str

    def fn(self, dtype: str, bias: bool) -> Any:
        return self.module.get_function(kernel_name(dtype, bias))


def load(torch: Any, cupy: Any) -> Kernels:
    """Compile for this GPU (compile.py, NVRTC) and let the driver JIT the PTX: the driver-floor check."""
    cc = torch.cuda.get_device_capability()
    k = compile_ptx(best_arch(cc))
    path = Path(tempfile.mkdtemp()) / "gelu_tanh.ptx"
    path.write_text(k.ptx)
    return Kernels(cupy.RawModule(path=str(path)), k.arch, k.ptx_isa, k.driver_floor)


_TORCH_DTYPE = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def _cp(cupy: Any, t: Any) -> Any:
    """A zero-copy CuPy view of a torch CUDA tensor (bfloat16 as raw 16-bit words)."""
    import torch

    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return cupy.from_dlpack(t)


def run(kern: Kernels, cupy: Any, x: Any, y: Any, dtype: str, bias: Any = None) -> None:
    n = x.numel()
    grid = (grid_size(n, dtype),)
    if bias is None:
        kern.fn(dtype, False)(grid, (BLOCK_SIZE,), (_cp(cupy, x), np.int32(n), _cp(cupy, y)))
    else:
        kern.fn(dtype, True)(grid, (BLOCK_SIZE,), (_cp(cupy, x), _cp(cupy, bias), np.int32(n), np.int32(bias.numel()), _cp(cupy, y)))  # fmt: skip


def check(torch: Any, cupy: Any, kern: Kernels, seed: int = 0) -> list[dict[str, Any]]:
    """Correctness rows: per (dtype, variant) the worst err/bound over odd lengths and misaligned offsets."""
    rows = []
    g = torch.Generator(device="cuda").manual_seed(seed)
    for dtype in DTYPES:
        tdt = getattr(torch, _TORCH_DTYPE[dtype])
        for bias_len in (0, 3, 768):
            worst, worst_torch, cases, failures = 0.0, 0.0, 0, 0
            lengths = [bias_len * r for r in (1, 3, 5, 1301)] if bias_len else [1, 7, 17, 1023, 4097, 1_000_003]
            for n in lengths:
                for x_off, y_off in ((0, 0), (1, 1), (3, 3), (5, 2), (7, 0)):
                    # fresh inputs every time; outputs poisoned with NaN
                    xb = (torch.rand(n + 8, generator=g, device="cuda") * 16 - 8).to(tdt)
                    yb = torch.full((n + 8,), float("nan"), device="cuda", dtype=tdt)
                    x, y = xb[x_off : x_off + n], yb[y_off : y_off + n]
                    b = None
                    if bias_len:
                        b = (torch.rand(bias_len, generator=g, device="cuda") * 4 - 2).to(tdt)
                    run(kern, cupy, x, y, dtype, b)
                    torch.cuda.synchronize()
                    xv = x.double().cpu().numpy()
                    yv = y.double().cpu().numpy()
                    bv = None if b is None else b.double().cpu().numpy()
                    s = xv if bv is None else xv + bv[np.arange(n) % bias_len]
                    ref = gelu_tanh(s)
                    bound = error_bound(xv, dtype, bias=bv)
                    ratio = np.abs(yv - ref) / bound
                    ratio[~np.isfinite(yv)] = np.inf  # poison left = element not written
                    worst = max(worst, float(ratio.max()))
                    failures += int((ratio > 1).sum())
                    # PyTorch's tanh GELU on the same inputs (float32 opmath inside torch)
                    tin = x.float() if b is None else x.float() + b.float().repeat(n // bias_len)
                    ty = torch.nn.functional.gelu(tin, approximate="tanh").to(tdt).double().cpu().numpy()
                    worst_torch = max(worst_torch, float(np.abs(yv - ty).max()))
                    cases += 1
            rows.append({"dtype": dtype, "variant": f"bias[{bias_len}]" if bias_len else "plain", "cases": cases,
                         "max_err_over_bound": worst, "max_abs_diff_vs_torch": worst_torch, "failures": failures})  # fmt: skip
    return rows


def _time(torch: Any, fn: Any, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        fn()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / reps * 1e3  # microseconds


def bench(torch: Any, cupy: Any, kern: Kernels, n: int = 64 << 20, dtype: str = "float16") -> dict[str, Any]:
    """Time ours vs torch's GELU vs a D2D copy (y.copy_(x): the same bytes read and written)."""
    tdt = getattr(torch, _TORCH_DTYPE[dtype])
    x = torch.randn(n, device="cuda").to(tdt)
    y = torch.empty_like(x)
    ours = _time(torch, lambda: run(kern, cupy, x, y, dtype))
    tgelu = _time(torch, lambda: torch.nn.functional.gelu(x, approximate="tanh"))
    copy = _time(torch, lambda: y.copy_(x))
    nbytes = 2 * n * x.element_size()
    return {"n": n, "dtype": dtype, "ours_us": ours, "torch_gelu_us": tgelu, "copy_us": copy,
            "ours_GBps": nbytes / ours / 1e3, "copy_GBps": nbytes / copy / 1e3,
            "pct_of_copy": 100.0 * copy / ours}  # fmt: skip


def main() -> int:
    try:
        torch, cupy = require_gpu()
    except NoGpu as e:
        print(f"gelu_kernel: {e}", file=sys.stderr)
        return 2
    kern = load(torch, cupy)
    for r in check(torch, cupy, kern):
        print(r)
    print(bench(torch, cupy, kern))
    return 0


if __name__ == "__main__":
    sys.exit(main())
