"""The Session contract every backend implements, and everything that is the same for all of them: input
checks (before anything runs), the generation loop, sampling.

A backend provides two steps over a KV cache it keeps where it computes (host memory for ONNX Runtime's
CPU provider, device memory for CUDA / TensorRT):

    _prefill(ids)  -> logits [len(ids), vocab]   starts a new cache from the prompt
    _decode(token) -> logits [vocab]             appends one token to the cache

Sessions generate for one sequence at a time (batch 1): no padding, so the attention mask is all ones.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence

import numpy as np

from ..config import ModelConfig
from ..errors import AndreaExportError
from ..kvcache import KVLayout


class InputError(AndreaExportError):
    """Bad input to a runtime session (token ids, lengths, sampling settings, a build folder without the
    graph a backend needs). Raised before anything runs."""


def check_ids(ids, vocab_size: int, what: str = "prompt") -> list[int]:
    """`ids` as a list of ints; InputError if empty, not integers, or outside [0, vocab_size)."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise InputError(f"{what} must be a flat sequence of token ids, got an array of shape {list(arr.shape)}")
    if arr.size == 0:
        raise InputError(f"{what} is empty: give at least one token id")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{what} must hold integer token ids, got {arr.dtype}")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise InputError(
            f"{what} token id {int(arr[i])} at position {i} is outside the vocabulary [0, {vocab_size})"
            + (f" ({bad.size} such ids)" if bad.size > 1 else "")
        )
    return [int(x) for x in arr]


class Session(abc.ABC):
    """A loaded decoder. `forward(ids)` -> logits; `generate(prompt, ...)` -> new token ids."""

    backend: str = "?"

    def __init__(self, cfg: ModelConfig, layout: KVLayout, source: str):
        self.cfg = cfg
        self.layout = layout
        self.source = source

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.cfg.name} backend={self.backend} from {self.source}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Release device memory and handles (ONNX Runtime frees on garbage collection; TensorRT frees here)."""

    # -- backend steps -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def _prefill(self, ids: list[int]) -> np.ndarray:
        """Start a new cache with `ids`; logits [len(ids), vocab] float32 on the host."""

    @abc.abstractmethod
    def _decode(self, token: int) -> np.ndarray:
        """Append `token` to the cache; logits [vocab] float32 on the host."""

    # -- public API --------------------------------------------------------------------------------------
    def forward(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [len(ids), vocab] (float32) for a sequence: one prefill. Leaves the cache holding `ids`."""
        ids = check_ids(ids, self.cfg.vocab_size, "input")
        if len(ids) > self.cfg.n_positions:
            raise InputError(f"input ({len(ids)} tokens) exceeds the model's context of {self.cfg.n_positions} tokens")
        return self._prefill(ids)

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        strategy: str = "greedy",
        temperature: float = 1.0,
        top_k: int = 50,
        top_p: float = 0.9,
        seed: int | None = None,
        stop_ids: Sequence[int] = (),
    ) -> list[int]:
        """The new token ids (the prompt not repeated). Stops after `max_new_tokens` or at the first id in
        `stop_ids`, which is included as the last element. `seed` makes top-k / top-p sampling repeatable."""
        return [tok for tok, _ in self.stream(prompt_ids, max_new_tokens, strategy, temperature, top_k, top_p, seed, stop_ids)]

    def stream(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        strategy: str = "greedy",
        temperature: float = 1.0,
        top_k: int = 50,
        top_p: float = 0.9,
        seed: int | None = None,
        stop_ids: Sequence[int] = (),
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Like `generate`, one (token, logits it was chosen from) at a time. All input is checked before the
        first step runs."""
        from .sampling import Sampling, next_token

        cfg = self.cfg
        prompt = check_ids(prompt_ids, cfg.vocab_size, "prompt")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if len(prompt) + max_new_tokens > cfg.n_positions:
            raise InputError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = {len(prompt) + max_new_tokens} "
                f"exceeds the model's context of {cfg.n_positions} tokens"
            )
        sampling = Sampling(strategy, temperature, top_k, top_p).check(cfg.vocab_size)
        stops = set(check_ids(list(stop_ids), cfg.vocab_size, "stop_ids")) if len(stop_ids) else set()
        rng = np.random.default_rng(seed)
        return self._loop(prompt, max_new_tokens, sampling, rng, stops, next_token)

    def _loop(self, prompt, max_new_tokens, sampling, rng, stops, next_token):
        logits = self._prefill(prompt)[-1]
        for i in range(max_new_tokens):
            tok = next_token(logits, sampling, rng)
            yield tok, logits
            if tok in stops or i == max_new_tokens - 1:
                return
            logits = self._decode(tok)
