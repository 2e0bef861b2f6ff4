"""Does a runtime decode like the PyTorch reference?

- `verify_decoder`: Polygraphy compares the KV-cache decoder graph (ONNX Runtime) with PyTorch's
  `forward_with_cache`, step by step (prefill, then one token at a time), each side keeping its own cache,
  on every output: logits and every `present.*`.
- `greedy_agreement`: greedy decoding through a Session (KV cache) against PyTorch recomputing the whole
  sequence at every step (no cache): token for token, with the first divergence and the logit margins
  there. Lower precisions use the same report.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..graphs.layout import KVLayout, kv_layout, read_kv_layout, read_metadata
from ..model.andrea import Andrea
from ..names import ATTENTION_MASK, INPUT_IDS, LOGITS, PRECISION_KEY, WEIGHT_ONLY
from ..runtime.base import Session, check_ids
from .thresholds import TOLERANCES

# fp32's by default: an element fails only if BOTH its absolute and relative error exceed them (Polygraphy's rule).
FP32_TOLERANCES = TOLERANCES["fp32"]


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes  # numpy has no bfloat16; onnx depends on ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _torch_runner(model: Andrea, layout: KVLayout, name: str = "pytorch-kv"):
    """A Polygraphy runner with the decoder graph's I/O, computed by the PyTorch model."""
    from polygraphy.backend.base import BaseRunner
    from polygraphy.common import TensorMetadata

    class TorchDecoderRunner(BaseRunner):
        def activate_impl(self):
            pass

        def deactivate_impl(self):
            pass

        def get_input_metadata_impl(self):
            meta = TensorMetadata()
            for t in layout.inputs:
                meta.add(t.name, np.dtype(t.dtype), tuple(d if isinstance(d, int) else None for d in t.shape))
            return meta

        def infer_impl(self, feed_dict):
            t0 = time.perf_counter()
            feed = {k: torch.from_numpy(np.asarray(v)) for k, v in feed_dict.items()}
            past = [(feed[layout.past_names[2 * i]], feed[layout.past_names[2 * i + 1]]) for i in range(layout.n_layer)]
            with torch.inference_mode():
                logits, present = model.eval().forward_with_cache(feed[INPUT_IDS], past, feed[ATTENTION_MASK])
            self.inference_time = time.perf_counter() - t0
            out = OrderedDict([(LOGITS, logits.numpy())])
            for key, t in zip(layout.present_names, (t for kv in present for t in kv)):
                out[key] = t.numpy()
            return out

    return TorchDecoderRunner(name=name)


def verify_decoder(
    model: Andrea,
    onnx_path: str | Path,
    prompts: Sequence[Sequence[int]],
    steps: int = 8,
    *,
    rtol: float = FP32_TOLERANCES["rtol"],
    atol: float = FP32_TOLERANCES["atol"],
    providers: list[str] | None = None,
) -> dict:
    """Prefill `prompts` (a batch; shorter ones are left-padded with id 0 and mask 0), then `steps` decode
    steps feeding back each runner's own `present.*`; the next tokens are the reference's greedy choices,
    so both runners see the same ids. Polygraphy compares every output at every step.

    Returns {"passed", "steps", "tolerances", "per_step": [{"step", "past_len", "new_tokens", "passed",
    "max_abs_logits"}]}.
    """
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator, CompareFunc, RunResults
    from polygraphy.logger import G_LOGGER

    layout = read_kv_layout(onnx_path)  # the graph's; its cache may be fp16/bf16 (a lower-precision build)
    reference_layout = kv_layout(model.cfg)  # PyTorch's: float32
    if dataclasses.replace(layout, cache_dtype=reference_layout.cache_dtype, cache="concat") != reference_layout:
        raise ValueError(f"{onnx_path}: its KV layout {layout} is not that of the model ({model.cfg.name})")
    rows = [check_ids(p, layout.vocab_size) for p in prompts]
    width = max(len(r) for r in rows)
    if width + steps > layout.n_positions:
        raise ValueError(f"longest prompt ({width}) + steps ({steps}) exceeds the context of {layout.n_positions}")
    ids = np.array([[0] * (width - len(r)) + r for r in rows], dtype=np.int64)
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=np.int64)
    reference = _torch_runner(model, reference_layout)
    providers = providers or ["CPUExecutionProvider"]
    source, name, run_layout = str(onnx_path), f"onnxrt:{Path(onnx_path).name}", layout
    if layout.cache_dtype == "bfloat16" and providers == ["CPUExecutionProvider"]:
        import onnx

        from ..graphs.precision import emulate_in_fp32

        # ONNX Runtime's CPU provider has no bf16 kernels: the emulated twin (every op rounded to bf16) takes
        # and returns its cache in float32 holding bf16 values
        source, name = emulate_in_fp32(onnx.load(source)).SerializeToString(), name + " (bf16 emulated)"
        run_layout = dataclasses.replace(layout, cache_dtype="float32")
    if layout.shared:  # the in-place graph keeps its own cache: run it through the runtime's steps
        candidate = _inplace_runner(onnx_path, providers, width + steps, name)
    elif read_metadata(onnx_path).get(PRECISION_KEY, "fp32") in WEIGHT_ONLY:  # Q/DQ, computed as TensorRT does
        from .compare import weight_only_session

        candidate = OnnxrtRunner(weight_only_session(source, providers), name=name)
    else:
        candidate = OnnxrtRunner(SessionFromOnnx(source, providers=providers), name=name)
    outputs: dict[str, list] = {reference.name: [], candidate.name: []}
    per_step = []
    with G_LOGGER.verbosity(G_LOGGER.ERROR), reference, candidate:
        past = {r.name: {n: np.zeros((len(rows), l.n_head, 0, l.head_dim), dtype=_np_dtype(l.cache_dtype))
                         for n in l.past_names}
                for r, l in ((reference, reference_layout), (candidate, run_layout))}
        new, step_mask = ids, mask
        for s in range(steps + 1):
            got = {}
            for r in (reference, candidate):
                out = r.infer({INPUT_IDS: new, ATTENTION_MASK: step_mask, **past[r.name]})
                got[r.name] = out = {k: np.asarray(v) for k, v in out.items()}
                past[r.name] = {reference_layout.feedback[k]: out[k] for k in layout.present_names}
                outputs[r.name].append(_real_positions(out, step_mask, new.shape[1]) if layout.shared else out)
            ref_logits = got[reference.name][LOGITS]
            compared = outputs[reference.name][-1][LOGITS] - outputs[candidate.name][-1][LOGITS]
            per_step.append({
                "step": s, "past_len": int(step_mask.shape[1] - new.shape[1]), "new_tokens": int(new.shape[1]),
                "max_abs_logits": float(np.abs(compared).max()),
            })
            new = ref_logits[:, -1].argmax(-1).astype(np.int64)[:, None]
            step_mask = np.concatenate([step_mask, np.ones_like(new)], axis=1)
        results = RunResults()
        for name, outs in outputs.items():
            results.add(outs, runner_name=name)
        try:  # Polygraphy >= 0.53 names it SimpleCompareFunc (CompareFunc.simple is deprecated there)
            from polygraphy.comparator import SimpleCompareFunc as simple
        except ImportError:
            simple = CompareFunc.simple
        accuracy = Comparator.compare_accuracy(
            results, compare_func=simple(rtol=rtol, atol=atol, check_error_stat="elemwise")
        )
    # Polygraphy >= 0.53 returns one AccuracyResult per compare function (a list); older ones, the result.
    result = accuracy if hasattr(accuracy, "keys") else accuracy[0]
    for entry, verdict in zip(per_step, result[(reference.name, candidate.name)]):
        entry["passed"] = all(bool(v) for v in verdict.values())
    return {"passed": bool(accuracy), "steps": steps, "tolerances": {"rtol": rtol, "atol": atol}, "per_step": per_step}


def _real_positions(out: dict, mask: np.ndarray, new_tokens: int) -> dict:
    """`out` with padded positions zeroed: what a padded position holds differs between a graph padded on
    the left (the reference) and one padded on the right (the in-place graph), and nobody reads it."""
    real = mask.astype(bool)
    kept = {LOGITS: np.where(real[:, -new_tokens:, None], out[LOGITS], 0)}
    for name, value in out.items():
        if name != LOGITS:
            kept[name] = np.where(real[:, None, :, None], value, 0).astype(value.dtype)
    return kept


def _inplace_runner(onnx_path, providers, capacity: int, name: str):
    """A Polygraphy runner with the standard decoder's I/O around the in-place graph: it keeps its cache in
    the runtime's buffers (the `past_*` fed to it are not read) and returns `present.*` in the standard
    layout (each row's tokens last, left-padded) for the comparison."""
    from polygraphy.backend.base import BaseRunner

    from ..runtime.ort import OrtSession

    class InplaceRunner(BaseRunner):
        def activate_impl(self):
            from ..graphs.layout import read_decoder

            cfg, layout = read_decoder(onnx_path)
            self.session = OrtSession(onnx_path, cfg, layout, providers=providers)
            self.steps = None

        def deactivate_impl(self):
            self.session = self.steps = None

        def get_input_metadata_impl(self):  # the standard decoder's inputs, in this graph's cache dtype
            from polygraphy.common import TensorMetadata

            meta = TensorMetadata()
            for t in dataclasses.replace(self.session.layout, cache="concat").inputs:
                meta.add(t.name, _np_dtype(t.dtype), tuple(d if isinstance(d, int) else None for d in t.shape))
            return meta

        def infer_impl(self, feed_dict):
            t0 = time.perf_counter()
            ids, mask = feed_dict[INPUT_IDS], feed_dict[ATTENTION_MASK]
            if self.steps is None:
                self.steps = self.session._steps(capacity).__enter__()
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

    return InplaceRunner(name=name)


def greedy_agreement(
    model: Andrea,
    session: Session | str | Path,
    prompt_ids: Sequence[int],
    n_tokens: int = 64,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    max_kl: float | None = None,
) -> dict:
    """Greedy-decode `n_tokens` through `session` (KV cache) and through PyTorch recomputing the full
    sequence each step (no cache); compare token for token.

    Returns a dict:
        steps, agree (bool), matched (tokens equal before the first divergence),
        first_divergence (step index or None),
        at_divergence: None or {reference_token, candidate_token, reference_margin (top-1 minus top-2 logit of
            the reference), candidate_margin (the candidate's logit of its token minus its logit of the
            reference's token)},
        min_reference_margin (smallest top-1/top-2 gap of the reference over the steps compared: how close
            the run came to a tie), max_abs_logit_diff (over the steps with identical contexts),
        reference_tokens, candidate_tokens, seconds {reference, candidate};
        with `rtol` and `atol` (a precision's verification tolerances): tolerances, and passed: every logit of
        every step compared (up to and including the first divergence) is within them of the reference. So
        the tokens agree, or part where the reference's top two are closer than the tolerance lets both move
        (a tie that precision cannot resolve); a divergence with any logit further off fails. Always: max_kl,
        the largest KL(reference || candidate) of a next-token distribution over the steps compared; with
        `max_kl` given, passed also needs it within that bound (logit tolerances loose enough for int4's
        ties let a wrong distribution through; its KL does not).
    """
    from .compare import lm_metrics

    if not isinstance(session, Session):
        from ..runtime import load

        session = load(session)
    prompt = check_ids(prompt_ids, model.cfg.vocab_size)
    model = model.eval()

    t0 = time.perf_counter()
    cand_tokens, cand_logits = [], []
    for tok, logits in session.stream(prompt, n_tokens, strategy="greedy"):
        cand_tokens.append(tok)
        cand_logits.append(np.asarray(logits, dtype=np.float64))
    t_cand = time.perf_counter() - t0

    t0 = time.perf_counter()
    ids = list(prompt)
    ref_tokens, ref_logits = [], []
    with torch.inference_mode():
        for _ in range(n_tokens):
            logits = model(torch.tensor([ids]))[0, -1].double().numpy()
            tok = int(np.argmax(logits))
            ref_tokens.append(tok)
            ref_logits.append(logits)
            ids.append(tok)
    t_ref = time.perf_counter() - t0

    first = next((i for i, (a, b) in enumerate(zip(ref_tokens, cand_tokens)) if a != b), None)
    compared = range(len(ref_tokens) if first is None else first + 1)  # contexts identical up to here
    margins = [float(np.diff(np.sort(ref_logits[i])[-2:])[0]) for i in compared]
    report = {
        "steps": n_tokens,
        "agree": first is None,
        "matched": n_tokens if first is None else first,
        "first_divergence": first,
        "at_divergence": None,
        "min_reference_margin": min(margins),
        "max_abs_logit_diff": max(float(np.abs(ref_logits[i] - cand_logits[i]).max()) for i in compared),
        "max_kl": lm_metrics(np.stack([ref_logits[i] for i in compared]),
                             np.stack([cand_logits[i] for i in compared]))["max_kl"],
        "reference_tokens": ref_tokens,
        "candidate_tokens": cand_tokens,
        "seconds": {"reference": t_ref, "candidate": t_cand},
    }
    if rtol is not None and atol is not None:
        report["tolerances"] = {"rtol": rtol, "atol": atol}
        report["passed"] = all(np.allclose(cand_logits[i], ref_logits[i], rtol=rtol, atol=atol) for i in compared)
    if max_kl is not None:
        report["max_kl_bound"] = max_kl
        report["passed"] = report.get("passed", True) and report["max_kl"] <= max_kl
    if first is not None:
        r, c = ref_tokens[first], cand_tokens[first]
        report["at_divergence"] = {
            "reference_token": r,
            "candidate_token": c,
            "reference_margin": margins[first],
            "candidate_margin": float(cand_logits[first][c] - cand_logits[first][r]),
        }
    return report
