"""The backends: one module each (Polygraphy's layout), all behind `Backend` (base.py). `make_backends`
turns names into instances."""

from __future__ import annotations

from collections.abc import Iterable

from ...errors import AndreaExportError
from .base import Backend, Context, Unavailable, default_cache_dir, weights_fingerprint
from .ctranslate2 import Ct2Backend
from .genai import GenaiBackend
from .llama_cpp import LlamaCppBackend
from .mem import MemReadBackend
from .openvino import OpenVinoBackend, OursOpenVinoBackend
from .optimum import OptimumBackend
from .ort import OrtBackend, session_options
from .pytorch import TorchBackend, torch_greedy
from .tensorrt import TrtBackend

BACKENDS = ("mem-read", "mem-read-int8", "mem-read-int4", "torch", "ort-cpu", "ort-cpu-concat", "ort-cpu-int8", "ort-cpu-int4", "ours-openvino", "ort-cuda",
            "trt-native", "trt-plugin", "optimum", "genai", "openvino", "openvino-f32", "openvino-int8", "openvino-int4",
            "ctranslate2", "ctranslate2-int8", "llama-cpp", "llama-cpp-q8_0", "llama-cpp-q4_0", "optimum-hf-folder")
DEFAULT_BACKENDS = BACKENDS[:-1]  # optimum-hf-folder (Optimum's loop on our graph) on request


def make_backends(names: Iterable[str], trt_engines: dict[str, dict] | None = None, ort_spin: bool = True) -> list[Backend]:
    out: list[Backend] = []
    for n in names:
        if n in ("mem-read", "mem-read-int8", "mem-read-int4"):
            out.append(MemReadBackend("fp32" if n == "mem-read" else n.rsplit("-", 1)[1]))
        elif n == "torch":
            out.append(TorchBackend())
        elif n == "ort-cpu":
            out.append(OrtBackend("CPUExecutionProvider", spin=ort_spin))
        elif n == "ort-cpu-concat":  # ours on the standard graph: what the in-place cache gains
            out.append(OrtBackend("CPUExecutionProvider", spin=ort_spin, cache="concat"))
        elif n in ("ort-cpu-int8", "ort-cpu-int4"):  # ours, weight-only quantized from the same weights
            out.append(OrtBackend("CPUExecutionProvider", spin=ort_spin, precision=n.rsplit("-", 1)[1]))
        elif n == "ort-cuda":
            out.append(OrtBackend("CUDAExecutionProvider", spin=ort_spin))
        elif n == "optimum":
            out.append(OptimumBackend(spin=ort_spin))
        elif n == "optimum-hf-folder":
            out.append(OptimumBackend(spin=ort_spin, graph="ours"))
        elif n == "genai":
            out.append(GenaiBackend())
        elif n == "ours-openvino":  # our graph and loop on OpenVINO (bf16 where the CPU has it)
            out.append(OursOpenVinoBackend())
        elif n.startswith("openvino"):
            out.append(OpenVinoBackend(n.partition("-")[2] or "default"))
        elif n.startswith("ctranslate2"):
            out.append(Ct2Backend(n.partition("-")[2] or "float32"))
        elif n.startswith("llama-cpp"):
            out.append(LlamaCppBackend(n.removeprefix("llama-cpp").lstrip("-") or "f32"))
        elif n in ("trt-native", "trt-plugin"):
            out.append(TrtBackend(n.split("-", 1)[1], (trt_engines or {}).get(n)))
        else:
            raise AndreaExportError(f"unknown backend {n!r}; known: {', '.join(BACKENDS)}")
    return out


__all__ = ["BACKENDS", "DEFAULT_BACKENDS", "Backend", "Context", "Ct2Backend", "GenaiBackend", "LlamaCppBackend", "MemReadBackend",
           "OpenVinoBackend", "OptimumBackend", "OursOpenVinoBackend", "OrtBackend", "TorchBackend", "TrtBackend", "Unavailable", "default_cache_dir",
           "make_backends", "session_options", "torch_greedy", "weights_fingerprint"]
