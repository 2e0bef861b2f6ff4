"""Our graphs in ONNX Runtime (CPU or CUDA execution provider), with IO binding."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .base import Backend, Unavailable


def session_options(threads: int, spin: bool = False):
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


class OrtBackend(Backend):
    """ONNX Runtime with IO binding: CPU EP (intra_op_num_threads = threads, inter_op 1, sequential) or CUDA EP.

    `spin`: whether ORT's pool threads spin-wait between ops (ORT's default is to spin). Off by default
    here, because spinning threads left over from one backend's call steal the cores of the next one in
    an interleaved run; the setting is recorded."""

    def __init__(self, provider: str = "CPUExecutionProvider", spin: bool = False):
        self.provider = provider
        self.spin = spin
        self.cuda = provider == "CUDAExecutionProvider"
        self.name = "ort-cuda" if self.cuda else "ort-cpu"
        self.device = "cuda" if self.cuda else "cpu"
        self._sessions = {}

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
                "graph_optimization": "ORT_ENABLE_ALL", "io_binding": True}  # fmt: skip

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
            path = self.ctx.prefill_onnx() if role == "prefill" else self.ctx.decoder_onnx()
            self._sessions[role] = ort.InferenceSession(str(path), self.options, providers=[self.provider])
        return self._sessions[role]

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
        return self._bound(sess, {sess.get_inputs()[0].name: ids})

    def decode(self, ids, mask, past):
        from ...kvcache import ATTENTION_MASK, INPUT_IDS, kv_layout

        sess = self.session("decode")
        layout = kv_layout(self.ctx.cfg)
        feeds = {INPUT_IDS: ids, ATTENTION_MASK: mask, **dict(zip(layout.past_names, past))}
        return self._bound(sess, feeds)

    def generate(self, prompt, new_tokens):
        """Greedy, through the product's own loop (runtime.OrtSession: one batched call for all rows) on this
        harness's session and threads."""
        rs, prompts = self._runtime_session(self.session("decode")), prompt.tolist()
        return lambda: rs.generate(prompts, new_tokens)

    def _runtime_session(self, sess):
        """andrea_export.runtime's OrtSession wrapped around our session (same file, same options)."""
        if not hasattr(self, "_rs"):
            from ...graphs import kv_layout
            from ...runtime.ort import OrtSession

            # the runtime loads the graph with its own options; swap in ours (threads, no spinning)
            self._rs = OrtSession(self.ctx.decoder_onnx(), self.ctx.cfg, kv_layout(self.ctx.cfg),
                                  providers=[self.provider], intra_op_threads=self.ctx.threads)  # fmt: skip
            self._rs.session = sess
        return self._rs
