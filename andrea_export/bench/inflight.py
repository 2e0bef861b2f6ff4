"""In-flight batching in this process, as a GPU host's checks run it (benchmarks/gpu_checks.py): streams through
the runtime's Batcher on one session, timed as their callbacks get the tokens; and a batcher's runs recorded on
one slot cache and replayed on another's (the TensorRT slot engine's mixed steps against ONNX Runtime's).

No server and no client: what `serve_streams` measures is the batcher and the engine it steps, the floor under
what a served client sees (bench/load.py measures the server). Every stream arrives at once, so the first
tokens of the last to join wait for every prompt before theirs, chunk by chunk, as they would on a server
that opens with that many clients.

    with runtime.load(build, "tensorrt", in_flight=True) as session:
        figures = serve_streams(session, streams=64, prompt=128, new_tokens=128)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from ..runtime.base import Request, Session, SlotCache
from ..runtime.batcher import PREFILL_CHUNK, Batcher, Event


@dataclasses.dataclass
class Run:
    """One run of a slot cache: its groups (first, ids, held) as given, and the logits it returned."""

    group: tuple
    chunk: tuple | None
    logits: np.ndarray
    chunk_logits: np.ndarray | None

    @property
    def chunk_inside(self) -> bool:
        """Whether the chunk's slot lies among the decoding rows' (the case where the two groups' cache inputs
        overlap: that slot's decoding row is a pad)."""
        if self.chunk is None:
            return False
        first, ids, _ = self.group
        return first <= self.chunk[0] < first + len(ids)


class Recording:
    """A slot cache that keeps every run of the cache it wraps: the inputs and the logits, copied (a caller may
    reuse its arrays, a cache its output buffers)."""

    def __init__(self, cache: SlotCache):
        self.cache = cache
        self.layout, self.slots, self.max_chunk = cache.layout, cache.slots, cache.max_chunk
        self.runs: list[Run] = []

    def run(self, group: tuple, chunk: tuple | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        logits, chunk_logits = self.cache.run(group, chunk)
        self.runs.append(Run(_copy(group), None if chunk is None else _copy(chunk), np.array(logits),
                             None if chunk_logits is None else np.array(chunk_logits)))
        return logits, chunk_logits

    def close(self) -> None:
        self.cache.close()


def _copy(group: tuple) -> tuple:
    return int(group[0]), np.array(group[1]), np.array(group[2])


def record_batched(session: Session, requests: Sequence[Request], *, slots: int, prefill_chunk: int = PREFILL_CHUNK,
                   timeout: float = 600) -> tuple[list[list[int]], list[Run]]:
    """`requests` submitted at once to a Batcher on `session`: each one's tokens, and every run of its slot cache.
    RuntimeError when a request ends in an error or does not finish within `timeout` seconds."""
    tokens: list[list[int]] = [[] for _ in requests]
    errors: list[str] = []
    with Batcher(session, slots=slots, prefill_chunk=prefill_chunk) as batcher:
        recording = Recording(batcher.cache)
        batcher.cache = recording  # before the first submit: the engine thread steps what it finds there
        tickets = batcher.submit_all([(r, _record(out, errors)) for r, out in zip(requests, tokens)])
        _wait(tickets, timeout, errors)
    return tokens, recording.runs


def replay(runs: Sequence[Run], cache: SlotCache, *, rtol: float, atol: float) -> list[dict]:
    """Each of `runs` again, in order, on `cache` (fresh: as many slots as the recording's): per run, its
    decoding rows and chunk tokens, whether the chunk lay inside the rows, the largest |logit difference| and
    whether every logit is within `atol + rtol * |recorded|` and every row's top token the same. A pad row at
    the context's end (the joining slot's, whose logits the batcher drops and whose cache the chunk writes in
    the same run) is not compared."""
    n_positions = cache.layout.n_positions
    out = []
    for r in runs:
        logits, chunk_logits = cache.run(r.group, r.chunk)
        keep = np.asarray(r.group[2]) < n_positions
        pairs = [(r.logits[keep], np.asarray(logits)[keep])]
        if r.chunk is not None:
            assert r.chunk_logits is not None and chunk_logits is not None  # a run with a chunk returns its logits
            pairs.append((r.chunk_logits, np.asarray(chunk_logits)))
        worst, within, top = 0.0, True, True
        for want, got in pairs:
            if want.size == 0:
                continue
            want, got = want.astype(np.float64), got.astype(np.float64)
            worst = max(worst, float(np.abs(got - want).max()))
            within = within and bool(np.all(np.abs(got - want) <= atol + rtol * np.abs(want)))
            top = top and bool(np.array_equal(want[:, -1].argmax(-1), got[:, -1].argmax(-1)))
        out.append({"rows": int(keep.sum()), "chunk_tokens": 0 if r.chunk is None else int(r.chunk[1].shape[1]),
                    "chunk_inside": r.chunk_inside, "max_abs": worst, "within": within, "same_top": top})
    return out


def serve_streams(session: Session, streams: int, prompt: int, new_tokens: int, *, slots: int | None = None,
                  prefill_chunk: int = PREFILL_CHUNK, seed: int = 0, timeout: float = 600) -> dict:
    """`streams` requests of `prompt` random tokens and `new_tokens` greedy ones each (past the end-of-text
    token), submitted at once to a Batcher of `slots` (default: `streams`) on `session`: tokens/s (every token /
    from the submit to the last token), time to first token and inter-token gaps (every gap of every stream,
    pooled) p50 / p99 in ms, decode steps, the mean rows per step. The batcher (its cache, the CUDA graphs of a
    slot engine) is made before the clock starts."""
    rng = np.random.default_rng(seed)
    vocab = session.cfg.vocab_size
    requests = [Request(rng.integers(1, vocab, prompt).tolist(), new_tokens, ignore_eos=True) for _ in range(streams)]
    times: list[list[float]] = [[] for _ in requests]
    errors: list[str] = []
    with Batcher(session, slots=slots or streams, prefill_chunk=prefill_chunk) as batcher:
        t0 = time.perf_counter()
        tickets = [batcher.submit(r, _record(out, errors, stamp=True)) for r, out in zip(requests, times)]
        _wait(tickets, timeout, errors)
        rows = list(batcher.step_rows)
    tokens = sum(len(t) for t in times)
    end = max(t[-1] for t in times)
    ttft = [t[0] - t0 for t in times]
    itl = [b - a for t in times for a, b in zip(t, t[1:])]
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else float("nan")  # noqa: E731
    return {"streams": streams, "slots": slots or streams, "prompt": prompt, "new_tokens": new_tokens,
            "tokens": tokens, "wall_s": end - t0, "tokens_per_s": tokens / (end - t0),
            "ttft_ms": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
            "itl_ms": {"p50": pct(itl, 50), "p99": pct(itl, 99)},
            "steps": len(rows), "mean_rows": float(np.mean(rows)) if rows else 0.0}


def _record(out: list, errors: list[str], stamp: bool = False):
    """A request's callback: each token (or, with `stamp`, the time it came) into `out`, each error into `errors`.
    It runs on the engine thread: it records, and never blocks it."""
    def emit(event: Event) -> None:
        if event.token is not None:
            out.append(time.perf_counter() if stamp else event.token)
        if event.error:
            errors.append(event.error)
    return emit


def _wait(tickets, timeout: float, errors: list[str]) -> None:
    deadline = time.monotonic() + timeout
    for t in tickets:
        if not t.wait(max(deadline - time.monotonic(), 0)):
            raise RuntimeError(f"a request did not finish within {timeout:.0f} s")
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) ended in an error: {errors[0]}")


__all__ = ["Recording", "Run", "record_batched", "replay", "serve_streams"]
