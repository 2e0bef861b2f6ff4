"""The build's fp32 graphs as `runtime.load(build, backend="openvino")` runs them on this CPU, checked against
PyTorch as every artifact is. OpenVINO computes in bf16 on a CPU with bf16 instructions and in f32 elsewhere;
the check runs in that precision at its thresholds (bf16's, or fp32's) and is named by it (`openvino-bf16`,
`openvino-f32`): the standard graph through Polygraphy (logits, top-1, KL, and the perplexity on the
evaluation text when the build has one); the KV-cache decoder as the runtime runs it (its attention fused,
the cache in the plugin at its KV_CACHE_PRECISION: runtime/openvino.py), step by step at the same
thresholds; and greedy decoding through that session (reported: a lower precision may part from fp32 at a
near-tie)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata

from ..catalog import Role
from ..graphs.export import INPUT_NAME, OUTPUT_NAME

# verify/thresholds.py's precision for what OpenVINO computes in
THRESHOLDS = {"bf16": "bf16", "f32": "fp32"}


def runtime_name(inference_precision: str) -> str:
    """The check's name in verify.json "runtimes" and the manifest: what runs, in what."""
    from ..runtime.openvino import check_name

    return check_name(inference_precision)


class OpenVinoRunner(BaseRunner):
    """A Polygraphy runner for an ONNX graph on OpenVINO's CPU plugin at `inference_precision`."""

    def __init__(self, onnx_path: str | Path, inference_precision: str = "bf16", name: str | None = None):
        super().__init__(name=name or runtime_name(inference_precision))
        self.onnx_path, self.inference_precision = str(onnx_path), inference_precision

    def activate_impl(self):
        from ..runtime.openvino import core, cpu_config

        ov_core = core()  # the process's one Core (see there why)
        config = cpu_config(None, self.inference_precision)
        self.compiled = ov_core.compile_model(ov_core.read_model(self.onnx_path), "CPU", config)
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


def openvino_precision() -> str:
    """What OpenVINO computes in on this CPU by default, "bf16" or "f32" (the runtime's default session does
    the same). Raises MissingDependency without OpenVINO."""
    from ..runtime.openvino import cpu_has_bf16

    return "bf16" if cpu_has_bf16() else "f32"


def decoder_steps_check(model, session, prompts, steps: int = 16, seed: int = 0, thresholds: str = "bf16") -> dict:
    """Each prompt, then `steps` more random ids one at a time through `session` (an OpenVINO session: its
    cache in the infer request's states), against PyTorch recomputing the whole sequence: every position's
    logits at the tolerances and next-token thresholds (top-1 beyond ties, max KL) of `thresholds`."""
    import torch

    from .metrics import lm_metrics, lm_passed, lm_thresholds
    from .thresholds import TOLERANCES

    rng = np.random.default_rng(seed)
    tol, floor = TOLERANCES[thresholds], lm_thresholds(thresholds)
    refs, outs, per_prompt = [], [], []
    for prompt in prompts:
        ids = list(prompt) + rng.integers(0, model.cfg.vocab_size, steps).tolist()
        out = session.forward_stepwise(ids, len(prompt))
        with torch.inference_mode():
            ref = model(torch.tensor([ids]))[0].float().numpy()
        refs.append(ref)
        outs.append(out)
        per_prompt.append({"prompt_len": len(prompt), "steps": steps, "max_abs_logits": float(np.abs(out - ref).max()),
                           "allclose": bool(np.allclose(out, ref, **tol))})  # fmt: skip
    lm = lm_metrics(np.concatenate(refs), np.concatenate(outs), floor.get("top1_tie", 0.0))
    return {"fused_attention": session.fused, "kv_cache_precision": session.kv_cache_precision,
            "tolerances": tol, "per_prompt": per_prompt, **lm,
            "passed": all(p["allclose"] for p in per_prompt) and lm_passed(lm, floor)}  # fmt: skip


def openvino_checks(folder: Path, model, artifacts: Mapping, shapes=None, greedy_steps: int = 32,
                    evaluation: tuple = (None, None), inference_precision: str = "bf16") -> dict:  # fmt: skip
    """The standard graph and the decoder of an fp32 build on OpenVINO in `inference_precision` (see the module
    docstring), at that precision's thresholds."""
    from ..progress import step
    from ..runtime import load
    from .agreement import greedy_agreement
    from .compare import verify

    name, thresholds = runtime_name(inference_precision), THRESHOLDS[inference_precision]
    wins, described = evaluation
    with step(f"Verifying the graphs on OpenVINO in {inference_precision} (runtime.load(..., backend='openvino'))"):
        runner = OpenVinoRunner(folder / artifacts[Role.ONNX], inference_precision)
        report = verify(model, {name: runner}, precision=thresholds, shapes=shapes, greedy_steps=0,
                        eval_windows=wins, eval_text=described, quiet=True)  # fmt: skip
        result = {"inference_precision": inference_precision, "graph": artifacts[Role.ONNX], "thresholds": thresholds,
                  "comparison": report.comparisons[0], "passed": report.passed}  # fmt: skip
    if Role.DECODER_ONNX in artifacts:
        rng = np.random.default_rng(0)
        n = min(16, model.cfg.n_positions // 4)
        prompts = [rng.integers(0, model.cfg.vocab_size, k).tolist() for k in (n, n // 2)]
        with step(f"Verifying the KV-cache decoder on OpenVINO in {inference_precision} step by step (attention "
                  "fused, cache in the plugin)"), load(folder / artifacts[Role.DECODER_ONNX], backend="openvino",
                                                        inference_precision=inference_precision) as sess:  # fmt: skip
            result["decoder"] = decoder_steps_check(model, sess, prompts, thresholds=thresholds)
            result["passed"] = result["passed"] and result["decoder"]["passed"]
            if greedy_steps:
                greedy = greedy_agreement(model, sess, prompts[0][:8], n_tokens=greedy_steps)
                greedy.pop("reference_tokens", None), greedy.pop("candidate_tokens", None)
                result["greedy"] = greedy  # reported, not gated: a lower precision may part from fp32 at a near-tie
            if result["passed"] and Role.DECODER_ONNX_INPLACE in artifacts:
                with step("Timing decode on OpenVINO and on ONNX Runtime (which `generate` runs by default)"):
                    result["decode"] = decode_race(folder / artifacts[Role.DECODER_ONNX_INPLACE], sess, prompts[0], name)
    return result


def decode_race(inplace: Path, openvino_session, prompt: list[int], name: str, rounds: int = 3) -> dict:
    """Batch-1 decode, tokens a second, of ONNX Runtime on the in-place decoder and of `openvino_session`, best of
    `rounds` interleaved (the same prompt and length; drift on a shared machine hits both): which one is faster
    depends on the model (measured on a 2-core AMD EPYC: OpenVINO in bf16 1.45x ONNX Runtime's fp32 on
    ANDREA-120M, where a step reads 366 MB; 0.36x on andrea-tiny, where its per-step overhead is the step).
    `generate` runs the faster where this CPU computes as the build did (runtime.cpu_default)."""
    from ..runtime import load

    n = min(32, openvino_session.cfg.n_positions - len(prompt))
    best = {"onnxruntime": 0.0, name: 0.0}
    with load(inplace, backend="onnxruntime") as ort_session:
        sessions = {"onnxruntime": ort_session, name: openvino_session}
        for _ in range(rounds):
            for key, sess in sessions.items():
                t0 = time.perf_counter()
                sess.generate(prompt, n, ignore_eos=True)
                best[key] = max(best[key], n / (time.perf_counter() - t0))
    return {"batch": 1, "prompt": len(prompt), "tokens": n, "tokens_per_s": best,
            "faster": max(best, key=lambda k: best[k])}
