"""The peer a Hugging Face user runs instead of our graph: transformers' GPT-2 holding the same weights
(`deploy.optimum.to_transformers`), exported by Optimum's own exporter (what `optimum-cli export onnx --task
text-generation-with-past` does), run by Optimum's `ORTModelForCausalLM` in ONNX Runtime with the same
session options as ours (`ort.session_options`).

Prefill and decode time Optimum's graph alone (one session call, inputs bound once, as ours); generate
times `ORTModelForCausalLM.generate`, transformers' loop, which is what a user's call costs. Optimum's
graph takes `position_ids` and returns the cache also after a prefill; ours computes positions from the
mask, and our prefill graph returns logits only.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import tempfile
from pathlib import Path

import numpy as np

from .base import Unavailable
from .ort import OrtBackend

TASK = "text-generation-with-past"


def export_with_optimum(model, out: str | Path) -> Path:
    """`out/` with Optimum's ONNX export of `model` (through transformers' GPT-2), model.onnx last."""
    from optimum.exporters.onnx import main_export

    from ...deploy.optimum import to_transformers
    from ...folder.atomic import staging

    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="andrea-hf-") as hf_dir, staging(out, marker_suffix=".onnx") as tmp:
        to_transformers(model).save_pretrained(hf_dir)
        # validation against PyTorch is Optimum's own check; the tests compare its tokens with ours instead
        main_export(hf_dir, output=tmp, task=TASK, device="cpu", do_validation=False)
    return out


def _versions() -> str:
    return "-".join(f"{d}{importlib.metadata.version(d)}" for d in ("optimum-onnx", "transformers"))


class OptimumBackend(OrtBackend):
    """Optimum's ORTModelForCausalLM on its own GPT-2 export of the same weights, CPU execution provider.

    `graph="ours"` (backend `optimum-hf-folder`): the same loader on our decoder as `export --hf-folder`
    writes it, so that only Optimum's loop differs from ours (its generate against ours)."""

    def __init__(self, spin: bool = True, graph: str = "optimum"):
        super().__init__("CPUExecutionProvider", spin=spin, cache="concat")
        if graph not in ("optimum", "ours"):
            raise ValueError(f"graph must be 'optimum' or 'ours', not {graph!r}")
        self.graph = graph
        self.name = "optimum" if graph == "optimum" else "optimum-hf-folder"

    def check(self):
        for module in ("optimum.onnxruntime", "transformers"):
            try:
                found = importlib.util.find_spec(module) is not None
            except ImportError:  # the parent package is missing
                found = False
            if not found:
                return f"'{module}' is not installed (pip install 'andrea-export[hf]': optimum-onnx, transformers)"
        return super().check()

    def setup(self, ctx):
        info = super().setup(ctx)
        exporter = f"optimum main_export, task {TASK}" if self.graph == "optimum" else "ours: export --hf-folder"
        info.update(io_binding="prefill/decode: bound as ours; generate: ORTModelForCausalLM's own",
                    exporter=exporter, versions=_versions())  # fmt: skip
        if self.graph == "optimum":
            info["decoder_graph"] = "Optimum's model.onnx (prefill and decode; each step concatenates the cache)"
        return info

    def prepare(self, scenarios):
        from optimum.onnxruntime import ORTModelForCausalLM

        try:
            if self.graph == "optimum":
                onnx = self.ctx.cached(f"optimum-{_versions()}/model.onnx",
                                       lambda p: export_with_optimum(self.ctx.model, p.parent))  # fmt: skip
            else:
                from ...deploy.optimum import write_hf_folder

                onnx = self.ctx.cached("hf-folder/model.onnx",
                                       lambda p: write_hf_folder(self.ctx.model, p.parent, quiet=True))  # fmt: skip
            self.hf = ORTModelForCausalLM.from_pretrained(onnx.parent, session_options=self.options,
                                                          provider=self.provider)  # fmt: skip
        except Exception as e:  # a third-party exporter's error (any type) fails this peer, not the whole run
            raise Unavailable(f"Optimum's export or load failed: {type(e).__name__}: {e}") from e
        names = [i.name for i in self.hf.session.get_inputs()]
        self.past_names = [n for n in names if n.startswith("past_key_values.")]
        if len(self.past_names) != 2 * self.ctx.cfg.n_layer:
            raise Unavailable(f"Optimum's export has {len(self.past_names)} cache inputs, not 2 x {self.ctx.cfg.n_layer}")
        self.has_positions = "position_ids" in names

    def session(self, role: str):
        return self.hf.session  # one graph: an empty past makes it a prefill

    def _feeds(self, ids: np.ndarray, past: list[np.ndarray]) -> dict[str, np.ndarray]:
        batch, new = ids.shape
        past_len = past[0].shape[2]
        feeds = {"input_ids": ids, "attention_mask": np.ones((batch, past_len + new), np.int64),
                 **dict(zip(self.past_names, past))}  # fmt: skip
        if self.has_positions:
            feeds["position_ids"] = np.broadcast_to(np.arange(past_len, past_len + new, dtype=np.int64), (batch, new))
        return feeds

    def prefill(self, ids):
        cfg = self.ctx.cfg
        empty = np.zeros((ids.shape[0], cfg.n_head, 0, cfg.head_dim), np.float32)
        return self._bound(self.hf.session, self._feeds(ids, [empty] * len(self.past_names)))

    def decode(self, ids, mask, past):
        # `past` is ordered as our layout (layer 0 key, value, layer 1 ...), which is Optimum's order too
        return self._bound(self.hf.session, self._feeds(ids, past))

    def generate(self, prompt, new_tokens):
        """Greedy `ORTModelForCausalLM.generate` of exactly `new_tokens` tokens (no stop at the end token,
        as ours): [B, new_tokens] token ids."""
        import torch

        ids = torch.from_numpy(prompt)
        mask = torch.ones_like(ids)
        eos = self.hf.config.eos_token_id

        def run():
            out = self.hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   do_sample=False, pad_token_id=eos)  # fmt: skip
            return out[:, ids.shape[1]:].numpy()

        return run
