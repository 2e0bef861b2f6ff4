"""Our graphs in ONNX Runtime (CPU or CUDA execution provider), with IO binding."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .base import Backend, Unavailable


def session_options(threads: int, spin: bool = True):
    """The ONNX Runtime session options of every ORT-based backend (ours and the peers'), so that they
    differ in graph and loop only: `threads` intra-op threads, one inter-op thread, sequential, all graph
    optimizations, spin-waiting as `spin`."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    so.log_severity_level = 3
    return so


PRECISIONS = {  # the weights a backend's graphs hold -> what the report says about them
    "fp32": "fp32",
    "int8": "int8 weight-only (graphs/quantize.py: MatMulNBits, blocks of 128, accuracy_level 4: int8 x int8 products; "
            "embedding gather table fp32)",
    "int4": "int4 weight-only (graphs/quantize.py: MatMulNBits, blocks of 128, the head 32, accuracy_level 4: int8 x int8 products; "
            "embedding gather table fp32)",
}

CACHES = {  # the KV-cache decoder a backend runs -> what the report says about it
    "inplace": "decoder.inplace.onnx: in-place cache (GroupQueryAttention; past and present one buffer per "
               "layer and kind, bound once)",
    "concat": "decoder.onnx: standard graph (each step concatenates the past and the new token into a new present)",
}


class OrtBackend(Backend):
    """ONNX Runtime with IO binding: CPU EP (intra_op_num_threads = threads, inter_op 1, sequential) or CUDA EP.

    `cache`: the KV-cache decoder that decode and generate run, as a user gets it (`runtime.load`):
    "inplace" (graphs/inplace_decoder.py) on the CPU provider, "concat" (graphs/kvcache.py) on the CUDA provider, whose
    GroupQueryAttention has no float32 kernels. `ort-cpu-concat` is the CPU provider on the standard graphs,
    so that a run shows what the in-place decoder gains. Prefill: the in-place backends run the prompt
    through the in-place decoder, writing its cache (what `runtime` does with a prompt, and what the
    peers' prefill does); the others run the plain `model.onnx`.

    `spin`: whether ORT's pool threads spin-wait between ops (ORT's default, what `runtime.load` gives a
    user and what onnxruntime-genai always does). They keep spinning for a while after a call, so a run
    with a spinning backend waits longer before each call (Settings.spin_gap_s); the setting is recorded."""

    def __init__(self, provider: str = "CPUExecutionProvider", spin: bool = True, cache: str | None = None,
                 precision: str = "fp32"):  # fmt: skip
        self.provider = provider
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
        self.precision = precision
        self.spin = self.spins = spin
        self.cuda = provider == "CUDAExecutionProvider"
        self.cache = cache or ("concat" if self.cuda else "inplace")
        if self.cache not in CACHES:
            raise ValueError(f"cache must be one of {', '.join(CACHES)}, not {cache!r}")
        if precision != "fp32" and (self.cuda or self.cache != "inplace"):
            raise ValueError("int8 / int4 (MatMulNBits) run on the CPU provider's in-place decoder only")
        if self.cuda and self.cache == "inplace":
            raise ValueError("ONNX Runtime's CUDA GroupQueryAttention has no float32 kernels: the CUDA provider "
                             "runs the standard decoder")  # fmt: skip
        # what its kernels compute in: MatMulNBits with accuracy_level 4 quantizes activations to int8 blocks
        self.compute_precision = "fp32" if precision == "fp32" else "int8 products (MatMulNBits accuracy_level 4)"
        self.name = "ort-cuda" if self.cuda else "ort-cpu" if self.cache == "inplace" else "ort-cpu-concat"
        if precision != "fp32":
            self.name = f"ort-cpu-{precision}"
        self.device = "cuda" if self.cuda else "cpu"
        self._sessions: dict[str, Any] = {}

    @property
    def inplace(self) -> bool:
        return self.cache == "inplace"

    def check(self):
        try:
            import onnxruntime as ort
        except ImportError:
            return "onnxruntime is not installed"
        if self.provider not in ort.get_available_providers():
            return f"{self.provider} is not available in this onnxruntime (providers: {', '.join(ort.get_available_providers())})"
        if self.cuda and not torch.cuda.is_available():
            return "no NVIDIA GPU visible"
        return None

    def setup(self, ctx):
        self.ctx = ctx
        self.options = session_options(ctx.threads, self.spin)
        return {"threads": ctx.threads, "inter_op_threads": 1, "provider": self.provider, "spin_wait": self.spin,
                "graph_optimization": "ORT_ENABLE_ALL", "io_binding": True, "decoder_graph": CACHES[self.cache],
                "prefill_graph": "the in-place decoder (the prompt's cache written, as runtime does)" if self.inplace
                else "model.onnx (no cache)",
                "precision": PRECISIONS[self.precision]}  # fmt: skip

    def prepare(self, scenarios):
        if "prefill" in scenarios:
            self.session("prefill")
        if "decode" in scenarios or "generate" in scenarios:
            try:
                self.session("decode")
            except Unavailable as e:  # prefill can still run; decode/generate cases say why they are missing
                self._missing = str(e)

    def session(self, role: str):
        import onnxruntime as ort

        if role == "decode" and getattr(self, "_missing", None):
            raise Unavailable(self._missing)
        if role not in self._sessions:
            path = self._decoder_onnx() if role == "decode" or self.inplace else self._graph(self.ctx.prefill_onnx)
            self._sessions[role] = ort.InferenceSession(str(path), self.options, providers=[self.provider])
        return self._sessions[role]

    def _decoder_onnx(self):
        return self._graph(self.ctx.inplace_decoder_onnx if self.inplace else self.ctx.decoder_onnx)

    def _graph(self, fp32_export):
        """The fp32 export, or its quantized copy (same weights) for ort-cpu-int8 / -int4."""
        path = fp32_export()
        return path if self.precision == "fp32" else self.ctx.quantized(path, self.precision)

    def _bound(self, sess, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
        import onnxruntime as ort

        binding = sess.io_binding()
        dev = "cuda" if self.cuda else "cpu"
        keep = []
        for name, arr in feeds.items():
            v = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr), dev, 0)
            keep.append(v)
            binding.bind_ortvalue_input(name, v)
        for o in sess.get_outputs():
            binding.bind_output(o.name, dev)

        def run():  # returns the binding: .copy_outputs_to_cpu() gives the outputs (not done in the timed call)
            sess.run_with_iobinding(binding)
            if self.cuda:
                binding.synchronize_outputs()
            return binding if keep else None

        return run

    def prefill(self, ids):
        sess = self.session("prefill")
        if self.inplace:
            from ...graphs.layout import kv_layout

            return self._inplace_step(sess, ids, None, kv_layout(self.ctx.cfg))
        return self._bound(sess, {sess.get_inputs()[0].name: ids})

    def decode(self, ids, mask, past):
        from ...graphs.kvcache import ATTENTION_MASK, INPUT_IDS, kv_layout

        sess = self.session("decode")
        layout = kv_layout(self.ctx.cfg)
        if self.inplace:
            B, P = ids.shape[0], past[0].shape[2]
            if ids.shape[1] != 1 or mask.shape != (B, P + 1) or not (mask == 1).all():
                raise ValueError(f"decode: one new token per row after a full past of {P} (mask of ones [{B}, {P + 1}])")
            return self._inplace_step(sess, ids, past, layout)
        feeds = {INPUT_IDS: ids, ATTENTION_MASK: mask, **dict(zip(layout.past_names, past))}
        return self._bound(sess, feeds)

    def _inplace_step(self, sess, ids, past, layout):
        """One step on the in-place graph (CPU): `ids` [B, T] after a past of P tokens (`past`: the
        harness's arrays, or None for a prompt: P = 0), copied once (here, not in the timed call) into
        buffers of capacity P + T, each bound as both its past input and its present output; the mask (ones
        [B, P + T]) says each row holds P + T tokens, so every call writes positions P .. P + T - 1 again
        and does the same work."""
        import onnxruntime as ort

        from ...names import ATTENTION_MASK, INPUT_IDS, LOGITS

        (B, T), P = ids.shape, 0 if past is None else past[0].shape[2]
        buffers = []
        for p in past if past is not None else [None] * len(layout.past_names):
            buf = np.zeros((B, layout.n_head, P + T, layout.head_dim), np.float32)  # rows P..: the step writes them
            if p is not None:
                buf[:, :, :P] = p
            buffers.append(ort.OrtValue.ortvalue_from_numpy(buf))  # CPU: buf's own memory, no copy
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        mask = np.ones((B, P + T), dtype=np.int64)
        binding = sess.io_binding()
        binding.bind_cpu_input(INPUT_IDS, ids)
        binding.bind_cpu_input(ATTENTION_MASK, mask)
        binding.bind_output(LOGITS, "cpu")  # first: outputs come back in binding order
        for past_name, present_name, buf in zip(layout.past_names, layout.present_names, buffers):
            binding.bind_ortvalue_input(past_name, buf)
            binding.bind_ortvalue_output(present_name, buf)
        keep = (ids, mask, buffers)

        def run():  # the binding: .copy_outputs_to_cpu() gives logits, then each buffer [B, n_head, P + 1, head_dim]
            sess.run_with_iobinding(binding)
            return binding if keep else None

        # the OrtValues bound as past and present, on the function the harness times (tests check the outputs are these)
        run.cache = buffers  # type: ignore[attr-defined]
        return run

    def generate(self, prompt, new_tokens):
        """Greedy, through the product's own loop (runtime.OrtSession: one batched call for all rows) on this
        harness's session and threads."""
        rs, prompts = self._runtime_session(self.session("decode")), prompt.tolist()
        return lambda: rs.generate(prompts, new_tokens, ignore_eos=True)  # fixed length

    def _runtime_session(self, sess):
        """andrea_export.runtime's OrtSession wrapped around our session (same file, same options): on the
        in-place graph it steps over one preallocated buffer per layer and kind, as a user's call does."""
        if not hasattr(self, "_rs"):
            from ...graphs.inplace_decoder import inplace_layout
            from ...graphs.layout import kv_layout
            from ...runtime.ort import OrtSession

            layout = inplace_layout(kv_layout(self.ctx.cfg)) if self.inplace else kv_layout(self.ctx.cfg)
            # our session as it is (this harness's threads and spin-waiting), not a second load of the graph
            self._rs = OrtSession(self._decoder_onnx(), self.ctx.cfg, layout, providers=[self.provider], session=sess)
        return self._rs
