"""Choosing the next token from one row of logits: greedy, top-k, top-p (nucleus). NumPy, float64, seeded.

Greedy takes the lowest index among equal maxima (np.argmax), so it is deterministic across backends as
long as their logits order the same. Sampling strategies divide the logits by `temperature` first.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import InputError

STRATEGIES = ("greedy", "top-k", "top-p")


@dataclasses.dataclass(frozen=True)
class Sampling:
    strategy: str = "greedy"
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 0.9

    def check(self, vocab_size: int) -> Sampling:
        """Raise InputError naming the bad setting; returns self."""
        if self.strategy not in STRATEGIES:
            raise InputError(f"unknown sampling strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if self.strategy == "greedy":
            return self
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not np.isfinite(t) or t <= 0:
            raise InputError(f"temperature must be a number > 0, got {t!r} (for deterministic decoding use strategy 'greedy')")
        if self.strategy == "top-k":
            k = self.top_k
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= vocab_size:
                raise InputError(f"top_k must be an integer in 1..{vocab_size} (the vocabulary size), got {k!r}")
        if self.strategy == "top-p":
            p = self.top_p
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
                raise InputError(f"top_p must be a number in (0, 1], got {p!r}")
        return self


def next_token(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """The next token id from `logits` [vocab]."""
    if sampling.strategy == "greedy":
        return int(np.argmax(logits))
    z = np.asarray(logits, dtype=np.float64)
    with np.errstate(over="ignore"):  # a subnormal temperature: the maxima stay 0, the rest go to -inf (greedy)
        z = (z - z.max()) / sampling.temperature
    if sampling.strategy == "top-k":
        k = int(sampling.top_k)
        cand = np.argpartition(-z, k - 1)[:k] if k < z.size else np.arange(z.size)
        cand = cand[np.argsort(-z[cand], kind="stable")]  # deterministic order for the draw
    else:  # top-p: the smallest set of most likely tokens whose probability reaches top_p
        cand = np.argsort(-z, kind="stable")
    w = np.exp(z[cand] - z[cand[0]])
    p = w / w.sum()
    if sampling.strategy == "top-p":
        keep = int(np.searchsorted(np.cumsum(p), sampling.top_p, side="left")) + 1
        cand, p = cand[:keep], p[:keep] / p[:keep].sum()
    return int(cand[rng.choice(len(cand), p=p)])
