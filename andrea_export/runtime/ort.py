"""ONNX Runtime backend: the KV-cache decoder graph through IO binding.

Each step binds the previous step's `present.*` OrtValues as this step's `past_key_values.*` inputs, and
asks ONNX Runtime to allocate the new `present.*` on the execution device: the cache never leaves the
device between steps (host memory with the CPU provider, GPU memory with the CUDA provider). Only the
token ids go in and the logits come out through host memory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..kvcache import ATTENTION_MASK, INPUT_IDS, LOGITS, KVLayout
from .base import Session


def _providers(requested: list[str] | None) -> list[str]:
    import onnxruntime as ort

    if requested:
        return list(requested)
    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


class OrtSession(Session):
    backend = "onnxruntime"

    def __init__(
        self,
        onnx_path: str | Path,
        cfg: ModelConfig,
        layout: KVLayout,
        *,
        providers: list[str] | None = None,
        intra_op_threads: int | None = None,
    ):
        import onnxruntime as ort

        super().__init__(cfg, layout, str(onnx_path))
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if intra_op_threads:
            opts.intra_op_num_threads = intra_op_threads
        self.session = ort.InferenceSession(str(onnx_path), opts, providers=_providers(providers))
        on_gpu = self.session.get_providers()[0] == "CUDAExecutionProvider"
        self.device = ("cuda", 0) if on_gpu else ("cpu", 0)
        self._past: list = []  # OrtValues, layout.past_names order
        self._len = 0  # tokens in the cache

    def _empty_past(self) -> list:
        import onnxruntime as ort

        shape = [1, self.layout.n_head, 0, self.layout.head_dim]
        dtype = np.dtype(self.layout.cache_dtype)
        return [ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, *self.device) for _ in self.layout.past_names]

    def _run(self, ids: list[int]) -> np.ndarray:
        """One step with `ids` as new tokens after the cache; updates the cache, returns logits [T, vocab]."""
        layout = self.layout
        binding = self.session.io_binding()
        binding.bind_cpu_input(INPUT_IDS, np.asarray([ids], dtype=np.int64))
        binding.bind_cpu_input(ATTENTION_MASK, np.ones((1, self._len + len(ids)), dtype=np.int64))
        for name, value in zip(layout.past_names, self._past):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output(LOGITS, "cpu")
        for name in layout.present_names:
            binding.bind_output(name, *self.device)  # allocated by ORT on the device, kept for the next step
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        self._past = outputs[1:]
        self._len += len(ids)
        return outputs[0].numpy()[0]

    def _prefill(self, ids: list[int]) -> np.ndarray:
        self._past, self._len = self._empty_past(), 0
        return self._run(ids)

    def _decode(self, token: int) -> np.ndarray:
        return self._run([token])[-1]

    @property
    def cache_length(self) -> int:
        return self._len

    def close(self) -> None:
        self._past, self._len = [], 0
