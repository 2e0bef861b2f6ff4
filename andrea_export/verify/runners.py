"""The Polygraphy runners verification compares: the PyTorch reference (the full-sequence graph's I/O or
the KV-cache decoder's), ONNX Runtime on a graph, and the in-place decoder through the runtime's own steps.

Polygraphy's own PytRunner wants CUDA and returns a tuple; these run on a CPU and keep the runner contract
(`infer` returns the outputs and sets `inference_time`)."""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata

from ..graphs.layout import KVLayout
from ..model.andrea import Andrea
from ..names import ATTENTION_MASK, INPUT_IDS, LOGITS


def np_dtype(name: str):
    """The numpy dtype of a layout's dtype name; bfloat16 is ml_dtypes' (numpy has none; onnx depends on it)."""
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _metadata(layout: KVLayout) -> TensorMetadata:
    meta = TensorMetadata()
    for t in layout.inputs:
        meta.add(t.name, np_dtype(t.dtype), tuple(d if isinstance(d, int) else None for d in t.shape))
    return meta


class TorchRunner(BaseRunner):
    """The PyTorch reference as a Polygraphy runner. Without `layout`: the full-sequence graph's I/O
    (input_ids -> logits). With a KV layout: the decoder graph's (input_ids, attention_mask, past.* ->
    logits, present.*), computed by `forward_with_cache`, so that each side keeps its own cache."""

    def __init__(self, model: Andrea, name: str | None = None, layout: KVLayout | None = None):
        super().__init__(name=name or ("pytorch" if layout is None else "pytorch-kv"))
        self.model = model.eval()
        self.layout = layout

    def activate_impl(self):
        pass

    def deactivate_impl(self):
        pass

    def get_input_metadata_impl(self):
        if self.layout is None:
            return TensorMetadata().add(INPUT_IDS, np.int64, (None, None))
        return _metadata(self.layout)

    def infer_impl(self, feed_dict):
        t0 = time.perf_counter()
        feed = {k: torch.from_numpy(np.asarray(v)) for k, v in feed_dict.items()}
        with torch.inference_mode():
            out = self._full(feed) if self.layout is None else self._step(feed, self.layout)
        self.inference_time = time.perf_counter() - t0
        return out

    def _full(self, feed: dict) -> OrderedDict:
        return OrderedDict([(LOGITS, self.model(feed[INPUT_IDS]).float().numpy())])

    def _step(self, feed: dict, layout: KVLayout) -> OrderedDict:
        past = [(feed[layout.past_names[2 * i]], feed[layout.past_names[2 * i + 1]]) for i in range(layout.n_layer)]
        logits, present = self.model.forward_with_cache(feed[INPUT_IDS], past, feed[ATTENTION_MASK])
        out = OrderedDict([(LOGITS, logits.numpy())])
        for key, t in zip(layout.present_names, (t for kv in present for t in kv)):
            out[key] = t.numpy()
        return out


class InplaceRunner(BaseRunner):
    """The in-place decoder graph behind the standard decoder's I/O: it keeps its cache in the runtime's
    buffers (the `past_*` fed to it are not read) and returns `present.*` in the standard layout (each row's
    tokens last, left-padded), so that Polygraphy compares it with the reference like any decoder.

    `source`: what ONNX Runtime loads instead of the file (a bf16 graph's float32 twin, as bytes), and `weight_only`:
    a Q/DQ graph, loaded as weight_only_session does (computed as TensorRT does); the cache's dtype is then
    `cache_dtype` (the twin's float32)."""

    def __init__(self, onnx_path: str | Path, providers: list[str], capacity: int, name: str | None = None, *,
                 source: bytes | None = None, weight_only: bool = False, cache_dtype: str | None = None):
        super().__init__(name=name or f"onnxrt:{Path(onnx_path).name}")
        self.onnx_path, self.providers, self.capacity = onnx_path, providers, capacity
        self.source, self.weight_only, self.cache_dtype = source, weight_only, cache_dtype
        # while active: an OrtSession and the cache steps of the call being compared (Polygraphy activates first)
        self.session: Any = None
        self.steps: Any = None

    def activate_impl(self):
        from ..graphs.layout import read_decoder
        from ..runtime.ort import OrtSession

        cfg, layout = read_decoder(self.onnx_path)
        session = None
        if self.source is not None or self.weight_only:
            # quiet: a bf16 twin's TensorScatter reads its cache through a Cast, so ONNX Runtime copies it (the
            # result is the same) and warns of it at every step
            session = weight_only_session(self.source or str(self.onnx_path), self.providers, quiet=True)
        if self.cache_dtype:
            layout = dataclasses.replace(layout, cache_dtype=self.cache_dtype)
        self.session = OrtSession(self.onnx_path, cfg, layout, providers=self.providers, session=session)
        self.steps = None

    def deactivate_impl(self):
        self.session = self.steps = None

    def get_input_metadata_impl(self):  # the standard decoder's inputs, in this graph's cache dtype
        return _metadata(dataclasses.replace(self.session.layout, cache="concat"))

    def infer_impl(self, feed_dict):
        t0 = time.perf_counter()
        ids, mask = feed_dict[INPUT_IDS], feed_dict[ATTENTION_MASK]
        if self.steps is None:
            self.steps = self.session._steps(self.capacity).__enter__()
            logits = self.steps.prefill(ids, mask)
        else:
            logits = self.steps.decode(ids[:, -1], mask)[:, None]
        width = mask.shape[1]
        out = OrderedDict([(LOGITS, logits)])
        for name, buffer in zip(self.session.layout.present_names, self.steps.buffers):
            held = buffer.numpy()
            present = np.zeros(held.shape[:2] + (width,) + held.shape[3:], dtype=held.dtype)
            for b, n in enumerate(self.steps.held):  # row b holds its n tokens at 0..n-1
                present[b, :, width - n:] = held[b, :, :n]
            out[name] = present
        self.inference_time = time.perf_counter() - t0
        return out


def onnxrt_runner(onnx_path: str | Path, name: str | None = None):
    """Polygraphy's ONNX Runtime runner (the CUDA provider when onnxruntime-gpu has it, else the CPU).

    A bf16 graph runs on the CPU through `precision.emulate_in_fp32` (every op rounded to bf16), since
    ONNX Runtime's CPU provider has no bf16 kernels; the runner's name then says so."""
    import onnx
    import onnxruntime as ort
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    from ..graphs.precision import emulate_in_fp32, graph_precision
    from ..names import WEIGHT_ONLY

    ort.set_default_logger_severity(3)  # errors only: its constant-folding notes on fp16 graphs are noise
    providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()]
    name = name or f"onnxrt:{Path(onnx_path).name}"
    model = onnx.load(str(onnx_path), load_external_data=False)
    if graph_precision(model) == "bf16" and providers == ["CPUExecutionProvider"]:
        emulated = emulate_in_fp32(onnx.load(str(onnx_path)))
        return OnnxrtRunner(SessionFromOnnx(emulated.SerializeToString(), providers=providers), name=name + " (bf16 emulated)")
    if graph_precision(model) in WEIGHT_ONLY:
        return OnnxrtRunner(weight_only_session(str(onnx_path), providers), name=name)
    return OnnxrtRunner(SessionFromOnnx(str(onnx_path), providers=providers), name=name)


def weight_only_session(source, providers: list[str], quiet: bool = False):
    """An ONNX Runtime session for a weight-only graph (a path or its bytes). ORT rewrites a Q/DQ graph's
    DequantizeLinear -> MatMul into MatMulNBits that quantizes the activations to int8 too (accuracy level 4)
    unless told not to: not what TensorRT computes, so verification turns that off."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    if quiet:
        options.log_severity_level = 3
    return ort.InferenceSession(source, options, providers=providers)
