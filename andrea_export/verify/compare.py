"""Verification: Polygraphy runs the PyTorch reference and each artifact on the same token ids and
judges them with its comparator and explicit tolerances; we add the figures that matter for a language
model (top-1 / top-5 agreement, KL divergence of the next-token distributions, greedy agreement).

The PyTorch model is always the reference (runner 0): a plugin graph or an engine is never judged
against another artifact that could share its bug. The runners, the figures, the report and the
reference model live in their own modules (runners, metrics, report, reference, inputs); their names
import from here too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..model.andrea import Andrea
from ..names import INPUT_IDS as INPUT_NAME
from ..names import LOGITS as OUTPUT_NAME
from ..progress import step
from .inputs import GREEDY_PROMPT, check_inputs, default_shapes
from .metrics import greedy_agreement_of_runners, lm_metrics, lm_passed, lm_thresholds, perplexity_of_runner
from .reference import check_model_io, reference_model_for
from .report import VerifyReport, print_summary
from .runners import TorchRunner, onnxrt_runner, weight_only_session

__all__ = [
    "GREEDY_PROMPT", "TorchRunner", "VerifyReport", "check_inputs", "check_model_io", "default_shapes",
    "greedy_agreement_of_runners", "lm_metrics", "lm_passed", "lm_thresholds", "onnxrt_runner",
    "perplexity_of_runner", "print_summary", "reference_model_for", "verify", "weight_only_session",
]  # fmt: skip

# Tolerances per precision live in thresholds.py (TOLERANCES, MIN_TOP1, MIN_TOP5, MAX_KL), with the measurements
# behind them. An element of the logits fails only if BOTH its absolute and relative error exceed the
# tolerances (Polygraphy's rule; relative error is taken against the reference).


def verify(
    model: Andrea,
    artifacts: dict[str, object],
    *,
    precision: str = "fp32",
    shapes: list[tuple[int, int]] | None = None,
    greedy_steps: int = 32,
    seed: int = 0,
    skipped: list | None = None,
    eval_windows: np.ndarray | None = None,
    eval_text: dict | None = None,
    quiet: bool = False,
) -> VerifyReport:
    """Compare each artifact runner with the PyTorch reference.

    Args:
        model: the reference model.
        artifacts: name -> Polygraphy runner, or a path to an ONNX file (run with ONNX Runtime).
        precision: selects the tolerances (thresholds.TOLERANCES, MIN_TOP1 / MIN_TOP5, MAX_KL).
        shapes: (batch, seq) pairs; default `default_shapes(context)`.
        greedy_steps: greedy tokens decoded per artifact (0 to skip).
        skipped: artifacts that cannot run here, as {"artifact", "reason"} dicts, carried into the report.
        eval_windows: token windows of a real text ([n, T] int64, text.windows): the perplexity of every
            artifact is then measured beside PyTorch's and must be within thresholds.MAX_PPL_REL of it.
            Without them the report says why none was computed.
        eval_text: what the windows are (sha256, tokens, ...), carried into the report.
    """
    from .thresholds import TOLERANCES

    cfg = model.cfg
    check_inputs(cfg, shapes, greedy_steps)
    shapes = shapes or default_shapes(cfg.n_positions)
    tol, lm_tol = TOLERANCES[precision], lm_thresholds(precision)
    runners: list = [TorchRunner(model)]  # then Polygraphy's runners
    for name, a in artifacts.items():
        runners.append(onnxrt_runner(a, name=name) if isinstance(a, (str, Path)) else a)
    rng = np.random.default_rng(seed)
    feeds = [{INPUT_NAME: rng.integers(0, cfg.vocab_size, size=s, dtype=np.int64)} for s in shapes]
    with _polygraphy_errors_only():  # our own summary replaces Polygraphy's per-output log
        results, accuracy = _run_and_compare(runners, feeds, tol, quiet)
        greedy = _greedy(runners, rng, cfg.vocab_size, greedy_steps, quiet)
        ppl = None
        if eval_windows is not None:
            with step(f"Perplexity on {eval_windows.size:,} tokens of text with each runner", quiet):
                ppl = {r.name: perplexity_of_runner(r, eval_windows) for r in runners}
    ref = runners[0].name
    comparisons = []
    for r in runners[1:]:
        per_shape = [_shape_entry(shape, accuracy[(ref, r.name)][it][OUTPUT_NAME], results[ref][it][OUTPUT_NAME],
                                  results[r.name][it][OUTPUT_NAME], lm_tol) for it, shape in enumerate(shapes)]  # fmt: skip
        comparisons.append(_comparison(ref, r.name, per_shape, greedy.get(r.name), ppl, precision))
    return VerifyReport(
        passed=all(c["passed"] for c in comparisons), precision=precision, tolerances=tol, lm_thresholds=lm_tol,
        shapes=[list(s) for s in shapes], comparisons=comparisons, skipped=list(skipped or []),
        perplexity=_perplexity_summary(ref, ppl, eval_windows, eval_text, precision),
    )


@contextlib.contextmanager
def _polygraphy_errors_only() -> Iterator[None]:
    from polygraphy.logger import G_LOGGER

    severity = G_LOGGER.module_severity
    G_LOGGER.module_severity = G_LOGGER.ERROR
    try:
        yield
    finally:
        G_LOGGER.module_severity = severity


def _run_and_compare(runners: list, feeds: list[dict], tol: dict, quiet: bool):
    """Every runner on every feed (Polygraphy's Comparator), each artifact's outputs judged against the
    reference's elementwise: (run results, accuracy per (reference, artifact) pair)."""
    from polygraphy.comparator import Comparator, SimpleCompareFunc

    with step(f"Running {', '.join(r.name for r in runners)} on {len(feeds)} input shapes", quiet):
        results = Comparator.run(runners, data_loader=feeds)
    compare = SimpleCompareFunc(rtol=tol["rtol"], atol=tol["atol"], check_error_stat="elemwise")
    pairs = [(0, i) for i in range(1, len(runners))]
    return results, Comparator.compare_accuracy(results, comparisons=pairs, compare_func=compare)[0]


def _greedy(runners: list, rng: np.random.Generator, vocab_size: int, steps: int, quiet: bool) -> dict:
    """Greedy agreement of each artifact with the reference from one random prompt ({} with no steps)."""
    if not steps:
        return {}
    with step(f"Greedy decoding {steps} tokens with each runner", quiet):
        for r in runners:
            r.activate()
        try:
            prompt = rng.integers(0, vocab_size, size=(1, GREEDY_PROMPT))
            return greedy_agreement_of_runners(runners, prompt.astype(np.int64), steps)
        finally:
            for r in runners:
                r.deactivate()


def _shape_entry(shape, ocr, ref: np.ndarray, out: np.ndarray, lm_tol: dict) -> dict:
    """One shape's verdict: the logits within tolerance elementwise (Polygraphy's `ocr`) and the LM figures
    within the precision's thresholds."""
    lm = lm_metrics(ref, out, tie=lm_tol.get("top1_tie", 0.0), top5_tie=lm_tol.get("top5_tie", 0.0))
    return {
        "shape": list(shape), "passed": bool(ocr) and lm_passed(lm, lm_tol), "logits_within_tolerance": bool(ocr),
        "max_abs": float(ocr.max_absdiff), "mean_abs": float(ocr.mean_absdiff),
        "median_abs": float(ocr.median_absdiff), "max_rel": float(ocr.max_reldiff),
        "mean_rel": float(ocr.mean_reldiff), "median_rel": float(ocr.median_reldiff), **lm,
    }  # fmt: skip


def _comparison(ref: str, name: str, per_shape: list[dict], greedy: dict | None, ppl: dict | None,
                precision: str) -> dict:  # fmt: skip
    """One artifact's verdict: every shape, greedy agreement (binding at fp32 only, where a tie cannot flip a
    token), and its perplexity within MAX_PPL_REL of the reference's."""
    from .thresholds import MAX_PPL_REL

    passed = all(s["passed"] for s in per_shape) and (greedy is None or greedy["agree"] or precision != "fp32")
    p = None
    if ppl is not None:
        rel = ppl[name] / ppl[ref] - 1.0
        p = {"perplexity": ppl[name], "reference": ppl[ref], "rel_diff": rel, "passed": abs(rel) <= MAX_PPL_REL[precision]}
        passed = passed and p["passed"]
    return {"reference": ref, "artifact": name, "passed": passed, "shapes": per_shape, "greedy": greedy, "perplexity": p}


def _perplexity_summary(ref: str, ppl: dict | None, eval_windows: np.ndarray | None, eval_text: dict | None,
                        precision: str) -> dict:  # fmt: skip
    from .thresholds import MAX_PPL_REL

    if ppl is None or eval_windows is None:
        return {"computed": False, "reason": "no evaluation text and tokenizer were given (build --tokenizer "
                "--eval-text): perplexity is not computed; on random weights it would not mean anything"}  # fmt: skip
    return {"computed": True, "text": eval_text or {}, "windows": int(eval_windows.shape[0]),
            "window": int(eval_windows.shape[1]), "predicted_tokens": int(eval_windows[:, 1:].size),
            "max_rel_diff": MAX_PPL_REL[precision], "reference": {ref: ppl[ref]},
            "artifacts": {name: ppl[name] for name in ppl if name != ref}}  # fmt: skip
