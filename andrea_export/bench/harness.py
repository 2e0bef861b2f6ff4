"""The timing harness: how long to measure (Settings), interleaved rounds, clocks, and the statistics
of the samples (percentiles, Stats, the median of per-round ratios). Pure Python; knows nothing of models."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable


@dataclasses.dataclass(frozen=True)
class Settings:
    """How long to measure. `budget_s` is the timed wall time aimed at per case (all backends together);
    the number of timed rounds is budget / (time of one warm-up round), clamped to [min_repeats, max_repeats]."""

    warmup: int = 2  # warm-up rounds, at least
    warmup_s: float = 1.0  # and at least this long (lazy initialisation, caches, clocks), as trtexec's --warmUp
    long_round_s: float = 1.0  # a warm-up round longer than this is warm-up enough (large prefill cases)
    min_repeats: int = 5
    max_repeats: int = 50
    budget_s: float = 4.0
    # untimed pause before each call, so thread pools of the previous backend stop spin-waiting (PyTorch's
    # OpenMP threads spin after a parallel region and slowed the next ORT call 2x in a measured case)
    gap_s: float = 0.005
    # the pause when a backend of the run spin-waits (ONNX Runtime's pool threads keep spinning about 40 ms
    # after a call; with 5 ms the next backend's decode step took 1.2-1.3x as long, with 50 ms no longer)
    spin_gap_s: float = 0.05
    interleave: bool = True  # False: each backend's rounds in one block (A A A B B B), to see interference

    @classmethod
    def quick(cls) -> Settings:
        return cls(warmup=2, warmup_s=0.3, min_repeats=5, max_repeats=15, budget_s=1.0)


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted values, linear interpolation between the two
    nearest order statistics (numpy's default, Excel's PERCENTILE.INC)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclasses.dataclass(frozen=True)
class Stats:
    """Summary of timed samples, in milliseconds; cv = sample standard deviation / mean (0 for one sample)."""

    n: int
    min_ms: float
    median_ms: float
    mean_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    std_ms: float
    cv: float

    @classmethod
    def from_ns(cls, samples_ns: Iterable[int | float]) -> Stats:
        ms = sorted(float(s) / 1e6 for s in samples_ns)
        if not ms:
            raise ValueError("no samples")
        n = len(ms)
        mean = sum(ms) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in ms) / (n - 1)) if n > 1 else 0.0
        return cls(n=n, min_ms=ms[0], median_ms=percentile(ms, 50), mean_ms=mean, p90_ms=percentile(ms, 90),
                   p99_ms=percentile(ms, 99), max_ms=ms[-1], std_ms=std, cv=std / mean if mean else 0.0)  # fmt: skip


def interleaved_order(names: list[str], rounds: int, interleave: bool = True) -> list[str]:
    """The order calls are made in: every round runs each backend once, round r starting at backend
    r mod n (A B, B A, A B ...), so that no backend always follows the same peer (a spin-waiting one
    would slow it in every round); with interleave=False each backend's rounds run as one block (A A A B B B)."""
    if not interleave:
        return [name for name in names for _ in range(rounds)]
    n = len(names)
    return [names[(r + i) % n] for r in range(rounds) for i in range(n)]


def ratio_median(baseline_ns: list[int], other_ns: list[int]) -> float:
    """Median over iterations of baseline[i] / other[i] (> 1: `other` is faster). Samples pair up by round."""
    if len(baseline_ns) != len(other_ns) or not baseline_ns:
        raise ValueError("ratio_median needs two equally long, non-empty sample lists (one per round)")
    return percentile(sorted(b / o for b, o in zip(baseline_ns, other_ns)), 50)


Timer = Callable[[Callable[[], object]], int]


def cpu_timer(fn: Callable[[], object]) -> int:
    """Nanoseconds of one synchronous call."""
    t0 = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - t0


def cuda_event_timer(fn: Callable[[], object]) -> int:
    """Nanoseconds between two CUDA events recorded around `fn` on torch's current stream (GPU time)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return int(start.elapsed_time(end) * 1e6)


def run_interleaved(
    fns: dict[str, Callable[[], object]],
    settings: Settings,
    timers: dict[str, Timer] | None = None,
    on_round: Callable[[int, int], None] | None = None,
) -> dict[str, list[int]]:
    """Warm up, then time `fns` in interleaved rounds. Returns name -> one sample (ns) per timed round.

    The number of timed rounds: settings.budget_s / (slowest warm-up round), within [min_repeats, max_repeats].
    `on_round(done, total)` is called after each timed round (progress bars)."""
    names = list(fns)
    timers = timers or {}
    warm: dict[str, list[int]] = {n: [] for n in names}
    t_end = time.perf_counter() + settings.warmup_s
    while True:
        t_round = time.perf_counter()
        for n in names:
            _settle(settings.gap_s, len(names))
            warm[n].append(timers.get(n, cpu_timer)(fns[n]))
        done = len(warm[names[0]])
        if time.perf_counter() - t_round > settings.long_round_s:
            break
        if (done >= max(1, settings.warmup) and time.perf_counter() >= t_end) or done >= 1000:
            break
    round_ns = max(1, sum(warm[n][-1] for n in names))
    rounds = int(min(settings.max_repeats, max(settings.min_repeats, settings.budget_s * 1e9 // round_ns)))
    samples: dict[str, list[int]] = {n: [] for n in names}
    order = interleaved_order(names, rounds, settings.interleave)
    for i, n in enumerate(order):
        _settle(settings.gap_s, len(names))
        samples[n].append(timers.get(n, cpu_timer)(fns[n]))
        if on_round and (i + 1) % len(names) == 0:  # samples[n][r] is round r's: pairing by round holds
            on_round((i + 1) // len(names), rounds)  # with interleave=False: calls done / backends
    return samples


def _settle(gap_s: float, n_backends: int) -> None:
    """Wait `gap_s` busily: a sleeping core slows down (on these VMs a decode step after a 100 ms sleep took
    1.3x as long as after 5 ms; after a 100 ms busy wait it did not), and a user's loop never idles either."""
    if gap_s > 0 and n_backends > 1:
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:
            pass
