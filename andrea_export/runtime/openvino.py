"""OpenVINO backend: the build's standard KV-cache decoder graph (`decoder.onnx`) read by OpenVINO's ONNX
frontend and made stateful, on the CPU plugin.

Why a second CPU runtime: on CPUs with bf16 instructions (AVX512-BF16, AMX) OpenVINO computes in bf16
by default (`INFERENCE_PRECISION_HINT`), which ONNX Runtime's CPU provider cannot do (it has no bf16
kernels on x86). The weights stay the build's fp32 ones; the matmuls round their inputs to bf16 and
accumulate in fp32. `inference_precision="f32"` keeps OpenVINO in full precision.

Stateful: `apply_make_stateful_transformation` (what optimum-intel applies to its own exports) turns every
`past_key_values.*` input / `present.*` output pair into one internal state, so the cache stays inside the
infer request between steps (no copy in, none out); only the ids, the mask and the logits cross. Each call
gets its own infer request, its states set to an empty cache for its batch (the graph derives the batch
from the past, so the state must start as [B, n_head, 0, head_dim], not OpenVINO's default). One
compiled model serves many threads: infer requests are independent (OpenVINO's threading rule), and
`infer` releases the GIL while it runs.

The graph derives positions from the mask, so left-padded batches are right here as in ONNX Runtime.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import InputError, require
from ..graphs.layout import KVLayout
from ..names import ATTENTION_MASK, INPUT_IDS
from .base import Session, Steps

PRECISIONS = ("default", "bf16", "f32")  # "default": OpenVINO's choice for this CPU (bf16 where it has bf16)


def cpu_config(threads: int | None = None, precision: str = "default") -> dict:
    """The CPU plugin's settings for every OpenVINO model of ours (runtime, verification, benchmark): one
    stream, latency; `threads` INFERENCE_NUM_THREADS (None: OpenVINO's choice); `precision` "bf16" / "f32"
    as INFERENCE_PRECISION_HINT ("default": OpenVINO's choice)."""
    config = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1"}
    if precision != "default":
        config["INFERENCE_PRECISION_HINT"] = precision
    if threads:
        config["INFERENCE_NUM_THREADS"] = str(threads)
    return config


def compute_precision(compiled) -> str:
    """What a compiled model computes in, as OpenVINO reports it: "bf16" or "f32"."""
    return compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()


def cpu_has_bf16() -> bool:
    """Whether OpenVINO's CPU plugin reports bf16 among this CPU's optimization capabilities."""
    ov = require("openvino", "openvino", "the OpenVINO backend")
    return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


class OpenVinoSession(Session):
    backend = "openvino"

    def __init__(self, onnx_path: str | Path, cfg: ModelConfig, layout: KVLayout, *, inference_precision: str = "default",
                 threads: int | None = None):  # fmt: skip
        """`inference_precision`: "default" (OpenVINO's: bf16 on a CPU with bf16 instructions, else f32), "bf16"
        (refused on a CPU without them: OpenVINO would emulate it slowly) or "f32". `threads`: the CPU
        plugin's INFERENCE_NUM_THREADS (default: OpenVINO's choice)."""
        ov = require("openvino", "openvino", "the OpenVINO backend")
        from openvino._offline_transformations import apply_make_stateful_transformation

        super().__init__(cfg, layout, str(onnx_path))
        if layout.shared:
            raise InputError(f"{onnx_path}: the OpenVINO backend reads the standard decoder (decoder.onnx), not the "
                             "in-place one (its GroupQueryAttention is an ONNX Runtime operator)")  # fmt: skip
        if inference_precision not in PRECISIONS:
            raise InputError(f"inference_precision must be one of {', '.join(PRECISIONS)}, not {inference_precision!r}")
        if inference_precision == "bf16" and not cpu_has_bf16():
            raise InputError("inference_precision 'bf16': this CPU has no bf16 instructions (OpenVINO reports no "
                             "BF16 capability); use 'f32' or 'default'")  # fmt: skip
        core = ov.Core()
        try:
            model = core.read_model(str(onnx_path))
            apply_make_stateful_transformation(model, dict(zip(layout.past_names, layout.present_names)))
        except RuntimeError as e:  # OpenVINO's frontend error for a graph it cannot read
            raise InputError(f"{onnx_path}: OpenVINO cannot read this graph: {str(e).strip().splitlines()[-1]}") from None
        self.compiled = core.compile_model(model, "CPU", cpu_config(threads, inference_precision))
        self.inference_precision = compute_precision(self.compiled)  # "bf16" / "f32", as OpenVINO reports it
        self._logits = self.compiled.output(0)

    def close(self) -> None:
        self.compiled = None

    def _steps(self, capacity: int | None = None):
        if self.compiled is None:
            raise InputError(f"{self.source}: this session is closed; load a new one")
        return contextlib.nullcontext(_OvSteps(self))


class _OvSteps(Steps):
    """One call's cache: the states of its own infer request."""

    def __init__(self, owner: OpenVinoSession):
        self.owner, self.layout = owner, owner.layout
        self.request = owner.compiled.create_infer_request()

    def prefill(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        import openvino as ov

        empty = np.zeros((ids.shape[0], self.layout.n_head, 0, self.layout.head_dim), dtype=np.dtype(self.layout.cache_dtype))
        for state in self.request.query_state():
            state.state = ov.Tensor(empty)
        return self._run(ids, mask)

    def decode(self, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return self._run(np.asarray(tokens)[:, None], mask)[:, -1]

    def _run(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        out = self.request.infer({INPUT_IDS: np.ascontiguousarray(ids, dtype=np.int64),
                                  ATTENTION_MASK: np.ascontiguousarray(mask, dtype=np.int64)})  # fmt: skip
        return np.array(out[self.owner._logits], dtype=np.float32)  # a copy: the request's tensor is reused
