"""The build's fp32 graphs on OpenVINO in bf16 (what `runtime.load(build, backend="openvino")` computes on
a CPU with bf16 instructions), checked against PyTorch as every artifact is: the standard graph through
Polygraphy at bf16's thresholds (logits, top-1, KL, and the perplexity on the evaluation text when the build
has one); the KV-cache decoder as the runtime runs it (its attention fused, the cache in the plugin at its
KV_CACHE_PRECISION: runtime/openvino.py), step by step at the same thresholds; and greedy decoding through
that session (reported: bf16 may part from fp32 at a near-tie)."""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata

from ..graphs.export import INPUT_NAME, OUTPUT_NAME

NAME = "openvino-bf16"


class OpenVinoRunner(BaseRunner):
    """A Polygraphy runner for an ONNX graph on OpenVINO's CPU plugin at `inference_precision`."""

    def __init__(self, onnx_path: str | Path, inference_precision: str = "bf16", name: str = NAME):
        super().__init__(name=name)
        self.onnx_path, self.inference_precision = str(onnx_path), inference_precision

    def activate_impl(self):
        import openvino as ov

        from ..runtime.openvino import cpu_config

        core = ov.Core()
        self.compiled = core.compile_model(core.read_model(self.onnx_path), "CPU", cpu_config(None, self.inference_precision))
        self.request = self.compiled.create_infer_request()

    def deactivate_impl(self):
        del self.request, self.compiled

    def get_input_metadata_impl(self):
        return TensorMetadata().add(INPUT_NAME, np.int64, (None, None))

    def infer_impl(self, feed_dict):
        t0 = time.perf_counter()
        out = self.request.infer({INPUT_NAME: np.asarray(feed_dict[INPUT_NAME], dtype=np.int64)})
        self.inference_time = time.perf_counter() - t0
        return OrderedDict([(OUTPUT_NAME, np.array(out[self.compiled.output(0)], dtype=np.float32))])


def openvino_blocker() -> str | None:
    """Why the bf16 check cannot run here (None: it can)."""
    from ..errors import MissingDependency
    from ..runtime.openvino import cpu_has_bf16

    try:
        return None if cpu_has_bf16() else "this CPU has no bf16 instructions: OpenVINO computes in f32 here"
    except MissingDependency:
        return "OpenVINO is not installed (pip install 'andrea-export[openvino]')"


def decoder_steps_check(model, session, prompts, steps: int = 16, seed: int = 0) -> dict:
    """Each prompt, then `steps` more random ids one at a time through `session` (an OpenVINO session: its
    cache in the infer request's states), against PyTorch recomputing the whole sequence: every position's
    logits at bf16's tolerances and next-token thresholds (top-1 beyond ties, max KL)."""
    import torch

    from .compare import lm_metrics, lm_passed, lm_thresholds
    from .thresholds import TOLERANCES

    rng = np.random.default_rng(seed)
    tol, floor = TOLERANCES["bf16"], lm_thresholds("bf16")
    refs, outs, per_prompt = [], [], []
    for prompt in prompts:
        ids = list(prompt) + rng.integers(0, model.cfg.vocab_size, steps).tolist()
        out = session.forward_stepwise(ids, len(prompt))
        with torch.inference_mode():
            ref = model(torch.tensor([ids]))[0].float().numpy()
        refs.append(ref), outs.append(out)
        per_prompt.append({"prompt_len": len(prompt), "steps": steps, "max_abs_logits": float(np.abs(out - ref).max()),
                           "allclose": bool(np.allclose(out, ref, **tol))})  # fmt: skip
    lm = lm_metrics(np.concatenate(refs), np.concatenate(outs), floor.get("top1_tie", 0.0))
    return {"fused_attention": session.fused, "kv_cache_precision": session.kv_cache_precision,
            "tolerances": tol, "per_prompt": per_prompt, **lm,
            "passed": all(p["allclose"] for p in per_prompt) and lm_passed(lm, floor)}  # fmt: skip


def openvino_checks(folder: Path, model, artifacts: dict, shapes=None, greedy_steps: int = 32,
                    evaluation: tuple = (None, None)) -> dict:  # fmt: skip
    """The standard graph and the decoder of an fp32 build on OpenVINO in bf16 (see the module docstring)."""
    from ..progress import step
    from ..runtime import load
    from .agreement import greedy_agreement
    from .compare import verify

    wins, described = evaluation
    with step("Verifying the graphs on OpenVINO in bf16 (runtime.load(..., backend='openvino'))"):
        report = verify(model, {NAME: OpenVinoRunner(folder / artifacts["onnx"])}, precision="bf16", shapes=shapes,
                        greedy_steps=0, eval_windows=wins, eval_text=described, quiet=True)  # fmt: skip
        result = {"inference_precision": "bf16", "graph": artifacts["onnx"], "thresholds": "bf16",
                  "comparison": report.comparisons[0], "passed": report.passed}  # fmt: skip
    if "decoder_onnx" in artifacts:
        rng = np.random.default_rng(0)
        n = min(16, model.cfg.n_positions // 4)
        prompts = [rng.integers(0, model.cfg.vocab_size, k).tolist() for k in (n, n // 2)]
        with step("Verifying the KV-cache decoder on OpenVINO in bf16 step by step (attention fused, cache in "
                  "the plugin)"), load(folder / artifacts["decoder_onnx"], backend="openvino", inference_precision="bf16") as sess:  # fmt: skip
            result["decoder"] = decoder_steps_check(model, sess, prompts)
            result["passed"] = result["passed"] and result["decoder"]["passed"]
            if greedy_steps:
                greedy = greedy_agreement(model, sess, prompts[0][:8], n_tokens=greedy_steps)
                greedy.pop("reference_tokens", None), greedy.pop("candidate_tokens", None)
                result["greedy"] = greedy  # reported, not gated: bf16 may part from fp32 at a near-tie
    return result
