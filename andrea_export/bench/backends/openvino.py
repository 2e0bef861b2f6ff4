"""OpenVINO on the CPU, two ways:

- the peer a user of Intel's stack runs (`openvino`, `openvino-f32`, `openvino-int8`, `openvino-int4`):
  optimum-intel's export of transformers' GPT-2 holding the same weights (what `optimum-cli export openvino`
  does; int8 / int4 by its NNCF weight compression: int8 symmetric per channel, int4 symmetric in groups of
  128, NNCF's default and ours (graphs/quantize.py), every layer), run by `OVModelForCausalLM` (stateful: the cache lives in the infer request). `openvino`
  takes OpenVINO's default inference precision, which is bf16 on a CPU with bf16 instructions; `-f32` sets
  INFERENCE_PRECISION_HINT f32. The quantized ones keep the default for their activations.
- ours on OpenVINO (`ours-openvino`): the build's own decoder.onnx through `runtime.openvino` (our loop,
  OpenVINO's default precision, attention fused with its cache at the plugin's default KV_CACHE_PRECISION,
  as optimum-intel's exports get it), i.e. what `runtime.load(build, backend="openvino")` gives a user.

Prefill: one call of the prompt on an empty cache. Decode: not timed alone (the stateful request owns the
cache, as genai's generator does); its steps are inside generate. Every backend records the precision
OpenVINO reports it computes in (`compute_precision`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import tempfile
from pathlib import Path

import numpy as np

from .base import Backend, Unavailable

MODES = ("default", "f32", "int8", "int4")
NOT_ALONE = ("the stateful model owns its cache (no call for one step on a given past); its decode steps "
             "are timed inside generate")  # fmt: skip


def _precision(compiled) -> str:
    """"bf16" / "fp32" (the bench's names) from what a compiled model reports."""
    from ...runtime.openvino import compute_precision

    name = compute_precision(compiled)
    return {"f32": "fp32"}.get(name, name)


def int4_group(cfg) -> int:
    """NNCF's int4 group: our MatMulNBits block (128 where n_embd allows; andrea-tiny: 64)."""
    from ...graphs.quantize import block_for

    block = block_for(cfg.n_embd, "int4")
    assert block is not None, "quantize.check_model_shape refuses a width no int4 block divides"
    return block


def export_with_optimum_intel(model, out: str | Path, mode: str) -> Path:
    """`out/` with optimum-intel's OpenVINO export of `model` (through transformers' GPT-2), weights
    compressed for `mode` int8 / int4, openvino_model.xml written last."""
    from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig

    from ...deploy.optimum import to_transformers
    from ...folder.atomic import staging

    group = int4_group(model.cfg)
    quant = {"int8": OVWeightQuantizationConfig(bits=8, sym=True),
             "int4": OVWeightQuantizationConfig(bits=4, sym=True, group_size=group, ratio=1.0)}.get(mode)  # fmt: skip
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="andrea-hf-") as hf_dir, staging(out, marker_suffix=".xml") as tmp:
        to_transformers(model).save_pretrained(hf_dir)
        ov_model = OVModelForCausalLM.from_pretrained(hf_dir, export=True, compile=False, quantization_config=quant,
                                                      load_in_8bit=False if quant is None else None)  # fmt: skip
        ov_model.save_pretrained(tmp)
    return out


def _versions() -> str:
    return "-".join(f"{d}{importlib.metadata.version(d)}" for d in ("openvino", "optimum-intel", "nncf"))


class OpenVinoBackend(Backend):
    """optimum-intel's OVModelForCausalLM on its own export of the same weights (see the module docstring)."""

    def __init__(self, mode: str = "default"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self.name = "openvino" if mode == "default" else f"openvino-{mode}"
        self.precision = mode if mode in ("int8", "int4") else "fp32"  # until setup reads what OpenVINO computes in

    def check(self):
        for module in ("openvino", "optimum.intel", "nncf", "transformers"):
            try:
                found = importlib.util.find_spec(module) is not None
            except ImportError:
                found = False
            if not found:
                return f"'{module}' is not installed (pip install 'andrea-export[peers]': openvino, optimum-intel, nncf)"
        return None

    def setup(self, ctx):
        self.ctx = ctx
        return {"threads": ctx.threads, "device": "cpu", "versions": _versions(),
                "exporter": "optimum-intel OVModelForCausalLM.from_pretrained(export=True)"
                + {"int8": ", NNCF int8 symmetric per channel", "int4": f", NNCF int4 symmetric, groups of {int4_group(ctx.cfg)}, ratio 1.0"}
                .get(self.mode, ""),
                "precision_hint": "f32" if self.mode == "f32" else "OpenVINO's default"}  # fmt: skip

    def prepare(self, scenarios):
        from optimum.intel import OVModelForCausalLM

        try:
            xml = self.ctx.cached(f"openvino-{self.mode}-{_versions()}/openvino_model.xml",
                                  lambda p: export_with_optimum_intel(self.ctx.model, p.parent, self.mode))  # fmt: skip
            from ...runtime.openvino import cpu_config

            cfg = cpu_config(self.ctx.threads, "f32" if self.mode == "f32" else "default")
            self.hf = OVModelForCausalLM.from_pretrained(xml.parent, ov_config=cfg, compile=True)
        except Exception as e:  # a third-party exporter's error (any type) fails this peer, not the whole run
            raise Unavailable(f"optimum-intel's export or load failed: {type(e).__name__}: {e}") from e
        from ...runtime.openvino import kv_cache_precision_of

        compute = _precision(self.hf.request.get_compiled_model())
        self.kv_cache_precision = kv_cache_precision_of(self.hf.request.get_compiled_model())
        if self.mode not in ("int8", "int4"):
            self.precision = compute
        self.compute_precision = compute

    def prefill(self, ids):
        import torch

        ids = torch.from_numpy(ids)
        mask = torch.ones_like(ids)
        return lambda: self.hf(input_ids=ids, attention_mask=mask).logits  # no past: a fresh cache each call

    def decode(self, ids, mask, past):
        raise Unavailable(NOT_ALONE)

    def generate(self, prompt, new_tokens):
        """Greedy `OVModelForCausalLM.generate` of exactly `new_tokens` tokens: [B, new_tokens] token ids."""
        import torch

        ids = torch.from_numpy(prompt)
        mask = torch.ones_like(ids)

        def run():
            out = self.hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   do_sample=False, pad_token_id=self.hf.config.eos_token_id)  # fmt: skip
            return out[:, ids.shape[1]:].numpy()

        return run


class OursOpenVinoBackend(Backend):
    """Our decoder.onnx in our runtime on OpenVINO (`runtime.openvino.OpenVinoSession`), default precision."""

    name = "ours-openvino"

    def check(self):
        return None if importlib.util.find_spec("openvino") else "openvino is not installed (pip install 'andrea-export[openvino]')"

    def setup(self, ctx):
        self.ctx = ctx
        return {"threads": ctx.threads, "device": "cpu", "version": importlib.metadata.version("openvino"),
                "decoder_graph": "decoder.onnx (standard graph), made stateful by OpenVINO",
                "loop": "andrea_export.runtime (runtime.load(build, backend='openvino'))"}  # fmt: skip

    def prepare(self, scenarios):
        from ...graphs.layout import kv_layout
        from ...runtime.openvino import OpenVinoSession

        self.session = OpenVinoSession(self.ctx.decoder_onnx(), self.ctx.cfg, kv_layout(self.ctx.cfg),
                                       threads=self.ctx.threads)  # fmt: skip
        self.precision = self.compute_precision = _precision(self.session.compiled)
        self.kv_cache_precision = self.session.kv_cache_precision  # None: attention not fused (the graph's cache)

    def prefill(self, ids):
        mask = np.ones_like(ids)

        def run():
            with self.session._steps() as steps:
                return steps.prefill(ids, mask)

        return run

    def decode(self, ids, mask, past):
        raise Unavailable(NOT_ALONE)

    def generate(self, prompt, new_tokens):
        prompts = prompt.tolist()
        return lambda: self.session.generate(prompts, new_tokens, ignore_eos=True)  # fixed length
