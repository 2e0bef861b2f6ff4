"""The real `tensorrt.plugin` (pure Python, from NVIDIA's bindings wheels on PyPI; see trt_plugin_wheel.py)
over a stand-in of the native core (trt_standin.py), for the oldest TensorRT we support (10.9, first with
aot_impl) and the newest."""

from __future__ import annotations

import sys

import pytest
from trt_plugin_wheel import TRT_PLUGIN_WHEELS, plugin_sources


@pytest.fixture(params=sorted(TRT_PLUGIN_WHEELS, key=lambda v: tuple(map(int, v.split(".")))))
def trt_plugin(request, monkeypatch):
    """(core, trtp): the stand-in `tensorrt` and the real `tensorrt.plugin` imported over it, fresh for each
    test (its registry and op namespaces are per process), with register.py's once-per-process state reset."""
    import trt_standin

    from andrea_export.plugin import register

    version = request.param
    package = plugin_sources(version)
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "tensorrt" or k.startswith("tensorrt.")}
    core = trt_standin.core_module(version, package)
    sys.modules["tensorrt"] = core
    monkeypatch.setattr(register, "_state", {})
    try:
        import tensorrt.plugin as trtp  # type: ignore[import-not-found,import-untyped,unused-ignore]

        yield core, trtp
    finally:
        for k in [k for k in sys.modules if k == "tensorrt" or k.startswith("tensorrt.")]:
            del sys.modules[k]
        sys.modules.update(saved)
