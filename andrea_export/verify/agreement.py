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
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..graphs.layout import kv_layout, read_kv_layout, read_metadata
from ..model.andrea import Andrea
from ..names import ATTENTION_MASK, INPUT_IDS, LOGITS, PRECISION_KEY, WEIGHT_ONLY
from ..runtime.base import Session, check_ids
from .metrics import lm_metrics
from .runners import InplaceRunner, TorchRunner, np_dtype, weight_only_session
from .thresholds import TOLERANCES

# fp32's by default: an element fails only if BOTH its absolute and relative error exceed them (Polygraphy's rule).
FP32_TOLERANCES = TOLERANCES["fp32"]


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
    from polygraphy.logger import G_LOGGER

    layout = read_kv_layout(onnx_path)  # the graph's; its cache may be fp16/bf16 (a lower-precision build)
    reference_layout = kv_layout(model.cfg)  # PyTorch's: float32
    if dataclasses.replace(layout, cache_dtype=reference_layout.cache_dtype, cache="concat") != reference_layout:
        raise ValueError(f"{onnx_path}: its KV layout {layout} is not that of the model ({model.cfg.name})")
    ids, mask = _left_padded(prompts, layout, steps)
    reference = TorchRunner(model, layout=reference_layout)
    candidate, run_layout = _decoder_runner(onnx_path, layout, providers or ["CPUExecutionProvider"],
                                            ids.shape[1] + steps)  # fmt: skip
    with G_LOGGER.verbosity(G_LOGGER.ERROR), reference, candidate:
        outputs, per_step = _decode_side_by_side(reference, candidate, reference_layout, run_layout, layout.shared,
                                                 ids, mask, steps)  # fmt: skip
        accuracy = _compare_steps(outputs, rtol, atol)
    # Polygraphy >= 0.53 returns one AccuracyResult per compare function (a list); older ones, the result.
    result = accuracy if hasattr(accuracy, "keys") else accuracy[0]
    for entry, verdict in zip(per_step, result[(reference.name, candidate.name)]):
        entry["passed"] = all(bool(v) for v in verdict.values())
    return {"passed": bool(accuracy), "steps": steps, "tolerances": {"rtol": rtol, "atol": atol}, "per_step": per_step}


def _left_padded(prompts: Sequence[Sequence[int]], layout, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompts as one batch, left-padded with id 0 and mask 0: (ids, attention mask)."""
    rows = [check_ids(p, layout.vocab_size) for p in prompts]
    width = max(len(r) for r in rows)
    if width + steps > layout.n_positions:
        raise ValueError(f"longest prompt ({width}) + steps ({steps}) exceeds the context of {layout.n_positions}")
    ids = np.array([[0] * (width - len(r)) + r for r in rows], dtype=np.int64)
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=np.int64)
    return ids, mask


def _decoder_runner(onnx_path: str | Path, layout, providers: list[str], capacity: int):
    """The runner of the decoder graph, with the layout its cache is fed in: (runner, layout). A bf16 graph
    on the CPU runs as its emulated twin (every op rounded to bf16), since ONNX Runtime's CPU provider has
    no bf16 kernels; the twin takes and returns its cache in float32 holding bf16 values."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    source, name, run_layout = str(onnx_path), f"onnxrt:{Path(onnx_path).name}", layout
    twin = None
    if layout.cache_dtype == "bfloat16" and providers == ["CPUExecutionProvider"]:
        import onnx

        from ..graphs.precision import emulate_in_fp32

        source = twin = emulate_in_fp32(onnx.load(source)).SerializeToString()
        name, run_layout = name + " (bf16 emulated)", dataclasses.replace(layout, cache_dtype="float32")
    weight_only = read_metadata(onnx_path).get(PRECISION_KEY, "fp32") in WEIGHT_ONLY  # Q/DQ: computed as TensorRT does
    if layout.shared:  # the in-place graphs keep their own cache: run them through the runtime's steps
        return InplaceRunner(onnx_path, providers, capacity, name, source=twin, weight_only=weight_only,
                             cache_dtype=run_layout.cache_dtype), run_layout
    if weight_only:
        return OnnxrtRunner(weight_only_session(source, providers), name=name), run_layout
    return OnnxrtRunner(SessionFromOnnx(source, providers=providers), name=name), run_layout


def _decode_side_by_side(reference, candidate, reference_layout, run_layout, shared: bool, ids: np.ndarray,
                         mask: np.ndarray, steps: int) -> tuple[dict[str, list], list[dict]]:  # fmt: skip
    """Prefill, then `steps` decode steps, each runner fed back its own `present.*` and both the reference's
    greedy tokens: ({runner name: outputs per step}, per-step entries with the largest logit difference)."""
    outputs: dict[str, list] = {reference.name: [], candidate.name: []}
    per_step = []
    past = {r.name: {n: np.zeros((len(ids), l.n_head, 0, l.head_dim), dtype=np_dtype(l.cache_dtype))
                     for n in l.past_names}
            for r, l in ((reference, reference_layout), (candidate, run_layout))}  # fmt: skip
    new, step_mask = ids, mask
    for s in range(steps + 1):
        got = {}
        for r in (reference, candidate):
            out = r.infer({INPUT_IDS: new, ATTENTION_MASK: step_mask, **past[r.name]})
            got[r.name] = out = {k: np.asarray(v) for k, v in out.items()}
            past[r.name] = {reference_layout.feedback[k]: out[k] for k in run_layout.present_names}
            outputs[r.name].append(_real_positions(out, step_mask, new.shape[1]) if shared else out)
        compared = outputs[reference.name][-1][LOGITS] - outputs[candidate.name][-1][LOGITS]
        per_step.append({
            "step": s, "past_len": int(step_mask.shape[1] - new.shape[1]), "new_tokens": int(new.shape[1]),
            "max_abs_logits": float(np.abs(compared).max()),
        })
        new = got[reference.name][LOGITS][:, -1].argmax(-1).astype(np.int64)[:, None]
        step_mask = np.concatenate([step_mask, np.ones_like(new)], axis=1)
    return outputs, per_step


def _compare_steps(outputs: dict[str, list], rtol: float, atol: float):
    """Polygraphy's elementwise verdict on every output of every step."""
    from polygraphy.comparator import Comparator, CompareFunc, RunResults

    results = RunResults()
    for name, outs in outputs.items():
        results.add(outs, runner_name=name)
    try:  # Polygraphy >= 0.53 names it SimpleCompareFunc (CompareFunc.simple is deprecated there)
        from polygraphy.comparator import SimpleCompareFunc as simple
    except ImportError:
        simple = CompareFunc.simple
    return Comparator.compare_accuracy(results, compare_func=simple(rtol=rtol, atol=atol, check_error_stat="elemwise"))


def _real_positions(out: dict, mask: np.ndarray, new_tokens: int) -> dict:
    """`out` with padded positions zeroed: what a padded position holds differs between a graph padded on
    the left (the reference) and one padded on the right (the in-place graph), and nobody reads it."""
    real = mask.astype(bool)
    kept = {LOGITS: np.where(real[:, -new_tokens:, None], out[LOGITS], 0)}
    for name, value in out.items():
        if name != LOGITS:
            kept[name] = np.where(real[:, None, :, None], value, 0).astype(value.dtype)
    return kept


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
    if not isinstance(session, Session):
        from ..runtime import load

        session = load(session)
    prompt = check_ids(prompt_ids, model.cfg.vocab_size)
    cand_tokens, cand_logits, t_cand = _session_greedy(session, prompt, n_tokens)
    ref_tokens, ref_logits, t_ref = _recomputed_greedy(model.eval(), prompt, n_tokens)
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
    }  # fmt: skip
    if rtol is not None and atol is not None:
        report["tolerances"] = {"rtol": rtol, "atol": atol}
        report["passed"] = all(np.allclose(cand_logits[i], ref_logits[i], rtol=rtol, atol=atol) for i in compared)
    if max_kl is not None:
        report["max_kl_bound"] = max_kl
        report["passed"] = report.get("passed", True) and report["max_kl"] <= max_kl
    if first is not None:
        r, c = ref_tokens[first], cand_tokens[first]
        report["at_divergence"] = {"reference_token": r, "candidate_token": c, "reference_margin": margins[first],
                                   "candidate_margin": float(cand_logits[first][c] - cand_logits[first][r])}
    return report


def _session_greedy(session: Session, prompt: list[int], n_tokens: int) -> tuple[list[int], list[np.ndarray], float]:
    """Greedy decoding through the session's KV cache: (tokens, float64 logits of each step, seconds)."""
    t0 = time.perf_counter()
    tokens, logits = [], []
    for tok, step_logits in session.stream(prompt, n_tokens, strategy="greedy", ignore_eos=True):
        tokens.append(tok)
        logits.append(np.asarray(step_logits, dtype=np.float64))
    return tokens, logits, time.perf_counter() - t0


def _recomputed_greedy(model: Andrea, prompt: list[int], n_tokens: int) -> tuple[list[int], list[np.ndarray], float]:
    """Greedy decoding by PyTorch recomputing the whole sequence at every step (no cache), the reference a
    cache cannot share a bug with: (tokens, float64 logits of each step, seconds)."""
    t0 = time.perf_counter()
    ids = list(prompt)
    tokens, logits = [], []
    with torch.inference_mode():
        for _ in range(n_tokens):
            step_logits = model(torch.tensor([ids]))[0, -1].double().numpy()
            tok = int(np.argmax(step_logits))
            tokens.append(tok)
            logits.append(step_logits)
            ids.append(tok)
    return tokens, logits, time.perf_counter() - t0
