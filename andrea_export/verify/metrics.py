"""The figures a language model's outputs are judged by beside Polygraphy's elementwise check: top-1 / top-5
agreement and KL divergence of the next-token distributions (with each precision's thresholds), greedy
agreement of runners, and perplexity on real text."""

from __future__ import annotations

import numpy as np
import torch

from ..names import INPUT_IDS as INPUT_NAME
from ..names import LOGITS as OUTPUT_NAME


def lm_thresholds(precision: str) -> dict:
    """The next-token thresholds of `precision` (thresholds.py): max_kl, and min_top1 (with its top1_tie, where
    the precision has one) or (int4) min_top5 (with its top5_tie)."""
    from .thresholds import MAX_KL, MIN_TOP1, MIN_TOP5, TOP1_TIE, TOP5_TIE

    floor = {"min_top1": MIN_TOP1[precision]} if precision in MIN_TOP1 else {"min_top5": MIN_TOP5[precision]}
    if precision in TOP1_TIE:
        floor["top1_tie"] = TOP1_TIE[precision]
    if precision in TOP5_TIE:
        floor["top5_tie"] = TOP5_TIE[precision]
    return {**floor, "max_kl": MAX_KL[precision]}


def lm_passed(lm: dict, thresholds: dict) -> bool:
    """Whether `lm` (lm_metrics, computed with the thresholds' ties) meets `thresholds` (lm_thresholds)."""
    return (lm.get("top1_beyond_ties", lm["top1_agreement"]) >= thresholds.get("min_top1", 0.0)
            and lm.get("top5_beyond_ties", lm["top5_overlap"]) >= thresholds.get("min_top5", 0.0)
            and lm["max_kl"] <= thresholds["max_kl"])


def lm_metrics(ref: np.ndarray, out: np.ndarray, tie: float = 0.0, top5_tie: float = 0.0) -> dict:
    """Top-1 / top-5 agreement and KL(ref || out) of next-token distributions over all positions;
    top1_beyond_ties: top-1 agreement where a position whose tokens differ but whose reference puts the
    artifact's token within `tie` logits of its own counts as agreeing (a tie the precision cannot resolve);
    top5_beyond_ties: top-5 overlap where a reference top-5 token the artifact dropped counts as kept when the
    reference puts it within `top5_tie` logits of the artifact's lowest pick."""
    ref_t = torch.from_numpy(ref.astype(np.float64)).flatten(0, -2)
    out_t = torch.from_numpy(out.astype(np.float64)).flatten(0, -2)
    want, got = ref_t.argmax(-1), out_t.argmax(-1)
    top1 = (want == got).double().mean().item()
    lead = ref_t.gather(-1, want[:, None]) - ref_t.gather(-1, got[:, None])  # the reference's margin over the pick
    beyond = ((want == got) | (lead[:, 0] <= tie)).double().mean().item()
    r5, o5 = ref_t.topk(5, dim=-1).indices, out_t.topk(5, dim=-1).indices
    kept = (r5[:, :, None] == o5[:, None, :]).any(-1)  # each reference top-5 token: among the artifact's?
    top5 = kept.double().mean().item()  # share of the top-5 sets
    lowest = ref_t.gather(-1, o5).min(-1, keepdim=True).values  # the artifact's lowest pick, by the reference
    top5_beyond = (kept | (ref_t.gather(-1, r5) - lowest <= top5_tie)).double().mean().item()
    lp, lq = ref_t.log_softmax(-1), out_t.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {"top1_agreement": top1, "top1_beyond_ties": beyond, "top5_overlap": top5,
            "top5_beyond_ties": top5_beyond, "max_kl": kl.max().item(),
            "mean_kl": kl.mean().item()}


def greedy_agreement_of_runners(runners, prompt: np.ndarray, steps: int) -> dict:
    """Greedy-decode `steps` tokens from `prompt` with each Polygraphy runner of the standard graph (full
    recompute each step, no cache); report where the artifacts first leave the reference. (The KV-cache
    decoder's counterpart, through a runtime Session, is agreement.greedy_agreement.)"""
    seqs = []
    for r in runners:
        ids = prompt.copy()
        for _ in range(steps):
            logits = r.infer({INPUT_NAME: ids})[OUTPUT_NAME]
            ids = np.concatenate([ids, logits[:, -1:].argmax(-1).astype(np.int64)], axis=1)
        seqs.append(ids[0, prompt.shape[1]:].tolist())
    ref = seqs[0]
    result = {}
    for r, seq in zip(runners[1:], seqs[1:]):
        first = next((i for i, (a, b) in enumerate(zip(ref, seq)) if a != b), None)
        result[r.name] = {"steps": steps, "agree": first is None, "first_divergence": first}
    return result


def perplexity_of_runner(runner, windows: np.ndarray) -> float:
    """Perplexity of a Polygraphy runner (PyTorch, an ONNX graph on ONNX Runtime, an engine) on token
    windows, a few thousand tokens per call."""
    from ..model.text import perplexity

    with runner:
        return perplexity(lambda ids: runner.infer({INPUT_NAME: ids})[OUTPUT_NAME], windows,
                          batch=max(1, 4096 // windows.shape[1]))
