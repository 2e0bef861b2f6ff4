"""Which builder: TensorRT (GPU hosts) or TensorRT-RTX (ahead of time on any CPU), its Python module, and the
network flags both need (strongly typed)."""

from __future__ import annotations

from ..errors import BuildError, ConfigError, MissingDependency, gpu_compute_capability, installed, require
from ..names import BUILDERS

BUILDER_MODULES = {"tensorrt": ("tensorrt", "tensorrt"), "tensorrt-rtx": ("tensorrt_rtx", "rtx")}  # module, pip extra


def trt_module(builder: str):
    """The imported `tensorrt` or `tensorrt_rtx` module for `builder` ("tensorrt" / "tensorrt-rtx")."""
    if builder not in BUILDER_MODULES:
        raise ConfigError(f"builder must be one of auto, {', '.join(BUILDERS)}; got {builder!r}")
    module, extra = BUILDER_MODULES[builder]
    why = f"Building engines with {BUILDER_NAMES[builder]}"
    mod = require(module, extra, why)
    if not hasattr(mod, "Builder"):  # tensorrt-stubs installs an empty `tensorrt` namespace package
        raise MissingDependency(
            f"{why} needs the Python module '{module}', which could not be imported (only a package without "
            f"the library is installed: {list(getattr(mod, '__path__', []))[:1]}). "
            f"Install it with: pip install 'andrea-export[{extra}]'"
        )
    return mod


BUILDER_NAMES = {"tensorrt": "TensorRT", "tensorrt-rtx": "TensorRT-RTX"}


def network_flags(trt) -> int:
    """`create_network` flags for a strongly typed network. Opt-in on TensorRT 10.x, always on (and ignored)
    in 11 and TensorRT-RTX; the enum's value differs (1 on 10.x, 0 on 11), so it is taken from the enum."""
    return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)


def resolve_builder(choice: str = "auto") -> str:
    """"tensorrt" or "tensorrt-rtx". auto: TensorRT when it imports and a GPU is present, else
    TensorRT-RTX (which builds on a CPU), else an error that says what to install."""
    if choice == "auto":
        if gpu_compute_capability() is not None and installed("tensorrt"):
            return "tensorrt"
        if installed("tensorrt_rtx"):
            return "tensorrt-rtx"
        raise MissingDependency(
            "no engine builder available: install TensorRT-RTX, which builds engines on any machine "
            "(pip install 'andrea-export[rtx]'), or, on a host with an NVIDIA GPU, TensorRT "
            "(pip install 'andrea-export[tensorrt]')"
        )
    trt_module(choice)  # raises ConfigError / MissingDependency
    if choice == "tensorrt" and gpu_compute_capability() is None:
        raise BuildError("TensorRT builds engines on a GPU and none was found; use --builder tensorrt-rtx to build on a CPU")
    return choice
