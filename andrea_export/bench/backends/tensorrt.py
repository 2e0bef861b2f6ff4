"""TensorRT engines (GPU hosts only): native GELU or the project's plugin."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from ...errors import CudaError
from ...names import INPUT_IDS
from ..harness import cpu_timer, cuda_event_timer
from .base import Backend, Unavailable


class TrtBackend(Backend):
    """A TensorRT engine (GPU host only): `variant` "native" (ONNX Gelu -> TensorRT's own layers) or
    "plugin" (tanh-GELU as the project's plugin). Engines are built by the build stage and passed in as
    paths ({"prefill": plan, "decode": plan}); timing uses CUDA events on one stream. Inputs are handed over in
    the element types the engine declares (an fp16 / bf16 decoder engine keeps its cache in 2-byte elements),
    copied before the timed stream may read them.

    Thin hook: it needs `tensorrt` and a GPU, neither of which the CPU development machines have."""

    device = "cuda"
    timer = staticmethod(cuda_event_timer)

    def __init__(self, variant: str, engines: dict[str, str | Path] | None = None):
        if variant not in ("native", "plugin"):
            raise ValueError(f"TensorRT variant must be 'native' or 'plugin', not {variant!r}")
        self.variant = variant
        self.name = f"trt-{variant}"
        self.engines = {k: Path(v) for k, v in (engines or {}).items()}

    def timer_for(self, scenario):
        # generation runs through runtime.TrtSession, which syncs every step to return host logits: wall time
        return cpu_timer if scenario == "generate" else cuda_event_timer

    def check(self):
        if not torch.cuda.is_available():
            return "no NVIDIA GPU visible (torch.cuda.is_available() is False); TensorRT engines run on GPU hosts only"
        if importlib.util.find_spec("tensorrt") is None:
            return "the 'tensorrt' module is not installed (pip install 'andrea-export[tensorrt]')"
        if not self.engines:
            return f"no {self.variant}-GELU engine given (build one with `andrea-export build`, pass it as trt_engines)"
        missing = [str(p) for p in self.engines.values() if not p.is_file()]
        if missing:
            return f"engine file(s) not found: {', '.join(missing)}"
        return None

    def setup(self, ctx):
        import tensorrt as trt

        self.trt = trt
        self.cfg = ctx.cfg
        # A plugin engine needs no registration here: the AOT plugin's kernel is embedded in the plan.
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engines = {}
        self.stream = torch.cuda.Stream()
        return {"tensorrt": trt.__version__, "engines": {k: str(v) for k, v in self.engines.items()}}

    def _context(self, role: str):
        if role not in self.engines:
            raise Unavailable(f"{self.name}: no '{role}' engine given")
        if role not in self._engines:
            engine = self.runtime.deserialize_cuda_engine(self.engines[role].read_bytes())
            context = engine.create_execution_context()
            if role == "decode" and engine.num_optimization_profiles > 1:
                # a decoder engine carries kvcache.optimization_profiles: [prefill, decode]
                if not context.set_optimization_profile_async(1, self.stream.cuda_stream):
                    raise CudaError(f"{self.name}: {self.engines[role]}: TensorRT refused optimization profile 1 "
                                    "(decode); the engine is not a decoder engine of this toolkit's profiles")
                self.stream.synchronize()
            self._engines[role] = (engine, context)
        return self._engines[role]

    def _torch_dtype(self, engine, name: str):
        trt = self.trt
        return {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                trt.int32: torch.int32, trt.int64: torch.int64}[engine.get_tensor_dtype(name)]

    def _inputs(self, engine, feeds: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """`feeds` on the device in the engine's own element types (a float32 cache bound to an fp16 engine's
        input would be read as other numbers, and past its end)."""
        return {name: torch.from_numpy(np.ascontiguousarray(arr)).to(self.device, self._torch_dtype(engine, name))
                for name, arr in feeds.items()}  # fmt: skip

    def _bound(self, role: str, feeds: dict[str, np.ndarray]):
        engine, ctx = self._context(role)
        trt = self.trt
        from ...runtime.trt import bind, enqueue

        tensors = self._inputs(engine, feeds)
        bind(ctx, {name: tuple(arr.shape) for name, arr in feeds.items()}, {})  # a refused shape raises: no timing
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT:
                tensors[name] = torch.empty(tuple(ctx.get_tensor_shape(name)), dtype=self._torch_dtype(engine, name),
                                            device=self.device)  # fmt: skip
        bind(ctx, {}, {name: t.data_ptr() for name, t in tensors.items()})
        stream = self.stream
        if self.device == "cuda":  # the copies above ran on the current stream: the timed one waits for them
            stream.wait_stream(torch.cuda.current_stream())

        def run():
            with torch.cuda.stream(stream):
                enqueue(ctx, stream.cuda_stream)  # False (nothing ran) raises instead of timing nothing
            return tensors

        return run

    def prefill(self, ids):
        return self._bound("prefill", {INPUT_IDS: ids})

    def decode(self, ids, mask, past):
        from ...graphs.layout import kv_layout
        from ...names import ATTENTION_MASK, INPUT_IDS

        names = kv_layout(self.cfg).past_names
        return self._bound("decode", {INPUT_IDS: ids, ATTENTION_MASK: mask, **dict(zip(names, past))})

    def generate(self, prompt, new_tokens):
        """Batch 1 only, through andrea_export.runtime's TrtSession (needs decoder.onnx beside the engine)."""
        if prompt.shape[0] != 1 or "decode" not in self.engines:
            raise Unavailable(f"{self.name}: generation needs a decoder engine and batch 1 (runtime.TrtSession)")
        from ... import runtime

        if not hasattr(self, "_session"):
            self._session = runtime.load(self.engines["decode"], backend="tensorrt")
        ids = prompt[0].tolist()
        return lambda: self._session.generate(ids, new_tokens, ignore_eos=True)  # every run the same length
