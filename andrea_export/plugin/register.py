"""Register the tanh-GELU plugins with TensorRT as ahead-of-time (AOT) quickly deployable plugins.

    register_plugins()   # then parse the plugin ONNX graph / build the engine in this process

Creates "andrea::TanhGelu" (x -> y) and "andrea::TanhGeluBias" (x, bias -> y), version "1": the identity
fixed in andrea_export/plugin/__init__.py. Each has a shape function (output like x), an autotune entry
(FP32|FP16|BF16, LINEAR; inputs and output share one type) and an `aot_impl` that returns our NVRTC-compiled
PTX, the entry point for the dtype, the launch grid and the int32 scalar arguments. TensorRT embeds that
kernel in the engine, so the engine runs in trtexec, Triton or any C++ runtime without Python or a plugin
library. Needs TensorRT >= 10.9 (first release with aot_impl).

Importing this module needs no TensorRT; register_plugins() imports it and raises MissingDependency when
it is missing.

Documentation followed (the pure-Python sources of tensorrt.plugin, TensorRT 11.4 bindings wheel, and the
TensorRT docs), see also shared/research/tensorrt-facts.md §2:
- Python plugins guide: https://docs.nvidia.com/deeplearning/tensorrt/latest/inference-library/plugins-python.html
- tensorrt.plugin API (register / autotune / aot_impl, KernelLaunchParams, SymIntExprs):
  https://docs.nvidia.com/deeplearning/tensorrt/latest/_static/python-api/tensorrt.plugin/
- NVIDIA/TensorRT samples/python/quickly_deployable_plugins (README "AOT plugins", oait_kernels.py for the
  calling convention: input pointers, then the int32 extra args, then output pointers).
Caveats honoured here: `aot_impl` must take `tactic` and carry a return annotation (the validator
rejects it otherwise); all registered attributes are passed to aot_impl positionally, so these plugins
have no attributes at all; extra args can only be SymInt32, so the GELU constants live in the kernel.

Do NOT add `from __future__ import annotations` to this module: tensorrt.plugin inspects the annotations of
the decorated functions at run time and needs real classes, not strings.
"""

import re
from typing import Any, List, Tuple, Union

from ..errors import MissingDependency, PluginError
from . import GELU_BIAS_OP, GELU_OP, PLUGIN_NAMESPACE
from .compile import (
    BLOCK_SIZE,
    CompiledKernel,
    best_arch,
    check_driver,
    compile_ptx,
    cuda_driver_version,
    detect_compute_capability,
    kernel_name,
    vector_width,
)

MIN_TENSORRT = (10, 9)
PLUGIN_IDS = (f"{PLUGIN_NAMESPACE}::{GELU_OP}", f"{PLUGIN_NAMESPACE}::{GELU_BIAS_OP}")
_IO_TYPES = "FP32|FP16|BF16"

_state: dict[str, Any] = {}  # "kernel": the CompiledKernel the engines embed; "ids": what is registered


def _import_tensorrt() -> Any:
    try:
        import tensorrt as trt

        if not hasattr(trt, "__version__"):  # e.g. only tensorrt-stubs' tensorrt/__init__.pyi is there
            raise ImportError(f"'tensorrt' at {list(getattr(trt, '__path__', []))} is not TensorRT (no __version__)")
    except ImportError as e:
        raise MissingDependency(
            f"Registering the tanh-GELU TensorRT plugins needs TensorRT >= 10.9, whose Python module 'tensorrt' "
            f"could not be imported ({e}). Install TensorRT on a GPU host (pip install 'andrea-export[tensorrt]'), "
            f"or build the standard-Gelu engine instead"
        ) from e
    version = tuple(int(p) for p in re.findall(r"\d+", trt.__version__)[:2])
    if version < MIN_TENSORRT:
        raise MissingDependency(
            f"The tanh-GELU AOT plugin needs TensorRT >= 10.9 (tensorrt.plugin.aot_impl); found {trt.__version__}"
        )
    return trt


def plugin_kernel() -> CompiledKernel | None:
    """The PTX that registered plugins embed (None until register_plugins ran): what the manifest records."""
    return _state.get("kernel")


def register_plugins(arch: str | None = None, nvrtc: str | None = None) -> tuple[str, ...]:
    """Register both plugins with TensorRT's plugin registry (once per process; later calls are no-ops).

    arch: the PTX target the engines embed; default: the GPU TensorRT builds on (best_arch of its compute
    capability), or sm_80 when no GPU answers. nvrtc: a libnvrtc to compile with (see compile.load_nvrtc).
    The kernel is compiled here (cached on disk), so a broken toolchain fails now and not mid-build, and its
    PTX ISA is checked against the installed driver (cuDriverGetVersion), which would refuse a newer one."""
    trt = _import_tensorrt()
    import tensorrt.plugin as trtp  # type: ignore[import-not-found,import-untyped,unused-ignore]  # no stubs

    if "ids" in _state:
        return tuple(_state["ids"])
    kernel = compile_ptx(arch or best_arch(detect_compute_capability()), nvrtc=nvrtc)
    check_driver(kernel, cuda_driver_version())  # an older driver would refuse the PTX late, inside TensorRT
    _state["kernel"] = kernel
    dtypes = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}

    def entry(x: Any, bias: bool) -> tuple[str, int]:
        try:
            dtype = dtypes[x.dtype]
        except KeyError:
            raise PluginError(f"tanh-GELU plugin: unsupported input type {x.dtype}") from None
        return kernel_name(dtype, bias), BLOCK_SIZE * vector_width(dtype)

    def launch_params(numel: Any, per_block: int) -> Any:
        launch = trtp.KernelLaunchParams()
        launch.grid_x = trtp.cdiv(numel + 1, per_block)  # = compile.grid_size: never 0 blocks
        launch.block_x = BLOCK_SIZE
        launch.shared_mem = 0
        return launch

    # ---- andrea::TanhGelu: y = gelu_tanh(x) ----------------------------------------------------------
    @trtp.register(PLUGIN_IDS[0])
    def _gelu_desc(x: trtp.TensorDesc) -> trtp.TensorDesc:
        return x.like()

    @trtp.autotune(PLUGIN_IDS[0])
    def _gelu_autotune(x: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(f"{_IO_TYPES}, {_IO_TYPES}", "LINEAR")]

    @trtp.aot_impl(PLUGIN_IDS[0])
    def _gelu_aot(
        x: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc], tactic: int
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs]:
        name, per_block = entry(x, bias=False)
        numel = x.shape_expr.numel()
        # kernel(const T* x, int n, T* y)
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(numel)])
        return name, kernel.ptx, launch_params(numel, per_block), extra

    # ---- andrea::TanhGeluBias: y = gelu_tanh(x + bias), bias over the last axis -------------------------
    @trtp.register(PLUGIN_IDS[1])
    def _gelu_bias_desc(x: trtp.TensorDesc, bias: trtp.TensorDesc) -> trtp.TensorDesc:
        return x.like()

    @trtp.autotune(PLUGIN_IDS[1])
    def _gelu_bias_autotune(
        x: trtp.TensorDesc, bias: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc]
    ) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(f"{_IO_TYPES}, {_IO_TYPES}, {_IO_TYPES}", "LINEAR")]

    @trtp.aot_impl(PLUGIN_IDS[1])
    def _gelu_bias_aot(
        x: trtp.TensorDesc, bias: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc], tactic: int
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs]:
        name, per_block = entry(x, bias=True)
        numel = x.shape_expr.numel()
        # kernel(const T* x, const T* bias, int n, int bias_len, T* y); bias holds last-dim elements
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(numel), trtp.SymInt32(bias.shape_expr.numel())])
        return name, kernel.ptx, launch_params(numel, per_block), extra

    _state["ids"] = PLUGIN_IDS
    return PLUGIN_IDS

