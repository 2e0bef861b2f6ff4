"""Run the plugin kernel's own CUDA source on the CPU: plugins/gelu_tanh/host_emulation.cpp includes
gelu_tanh.cu unchanged, supplies the few device primitives in software and emulates a 1-D launch.
Built with the host C++ compiler (g++ or $CXX) into a cached shared library and called through ctypes.

This is a test instrument (the GPU remains the judge of tanh.approx's accuracy and of speed): it checks
the kernel's indexing for every length and pointer alignment, its bias wrap-around, and its float32 math.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MissingDependency, PluginError
from .compile import BLOCK_SIZE, grid_size, kernel_source_path
from .reference import STORAGE_NUMPY

_DTYPE_CODE = {"float32": 0, "float16": 1, "bfloat16": 2}
_FLAGS = ("-O1", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math")


def _harness() -> Path:
    return kernel_source_path().with_name("host_emulation.cpp")


def build(cache_dir: str | os.PathLike[str] | None = None, cxx: str | None = None) -> Path:
    """Compile host_emulation.cpp (+ gelu_tanh.cu) into libgelu_host-<hash>.so; cached by source hash."""
    compiler = cxx or os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        raise MissingDependency(f"The CPU emulation of the tanh-GELU kernel needs a C++ compiler ('{compiler}' not found)")
    src, kernel = _harness(), kernel_source_path()
    h = hashlib.sha256()
    for p in (src, kernel):
        h.update(p.read_bytes())
    h.update(" ".join((compiler, *_FLAGS)).encode())
    from .compile import default_cache_dir

    out_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir().parent / "host"
    out = out_dir / f"libgelu_host-{h.hexdigest()[:16]}.so"
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    proc = subprocess.run(
        [compiler, *_FLAGS, "-I", str(kernel.parent), "-o", str(tmp), str(src)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise PluginError(f"host build of the tanh-GELU kernel failed ({compiler})", log=proc.stderr)
    os.replace(tmp, out)
    return out


class HostKernel:
    """The kernel's entry points on the CPU."""

    def __init__(self, library: str | os.PathLike[str] | None = None):
        self.path = Path(library) if library is not None else build()
        self._lib = ctypes.CDLL(str(self.path))
        self._lib.andrea_emu_launch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                                ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]  # fmt: skip
        self._lib.andrea_emu_launch.restype = ctypes.c_int

    def launch(
        self,
        x: np.ndarray,
        y: np.ndarray,
        dtype: str,
        bias: np.ndarray | None = None,
        grid: int | None = None,
        block: int = BLOCK_SIZE,
    ) -> None:
        """Launch on storage arrays exactly as given (their addresses included: slices of a buffer give
        misaligned pointers). grid defaults to the plugin's grid for x.size."""
        storage = STORAGE_NUMPY[dtype]
        for name, a in (("x", x), ("y", y), ("bias", bias)):
            if a is not None and (a.dtype != storage or not a.flags.c_contiguous):
                raise PluginError(f"{name} must be a contiguous {np.dtype(storage).name} array for {dtype}")
        if y.size != x.size:
            raise PluginError(f"y has {y.size} elements, x has {x.size}")
        n = x.size
        rc = self._lib.andrea_emu_launch(
            _DTYPE_CODE[dtype],
            x.ctypes.data,
            None if bias is None else bias.ctypes.data,
            n,
            0 if bias is None else bias.size,
            y.ctypes.data,
            grid_size(n, dtype, block) if grid is None else grid,
            block,
        )
        if rc == 2:
            raise PluginError("misaligned 16-byte access in the tanh-GELU kernel (a GPU would fault)")
        if rc != 0:
            raise PluginError(f"andrea_emu_launch returned {rc}")

    def convert(self, what: str, a: np.ndarray) -> np.ndarray:
        """The emulated conversions: 'f32_to_f16', 'f16_to_f32' (uint16 bits in/out), 'f32_to_bf16'."""
        fn = getattr(self._lib, f"andrea_emu_{what}")
        src_t, dst_t = {"f32_to_f16": (np.float32, np.uint16), "f16_to_f32": (np.uint16, np.float32),
                        "f32_to_bf16": (np.float32, np.uint16)}[what]  # fmt: skip
        a = np.ascontiguousarray(a, dtype=src_t)
        out = np.empty(a.shape, dtype=dst_t)
        fn(ctypes.c_void_p(a.ctypes.data), ctypes.c_void_p(out.ctypes.data), ctypes.c_int(a.size))
        return out


def aligned_empty(n: int, dtype: Any, offset: int = 0, align: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(buffer, view): view has n elements and starts `offset` elements past an `align`-byte boundary."""
    item = np.dtype(dtype).itemsize
    raw: np.ndarray = np.empty(n + offset + align // item + 8, dtype=dtype)
    skip = (-raw.ctypes.data % align) // item
    return raw, raw[skip + offset : skip + offset + n]
