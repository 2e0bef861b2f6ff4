"""A session as a service uses it: shared by many threads, given batches of prompts of different lengths,
loaded without PyTorch. Every check compares tokens exactly with the same requests run one by one."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

STRATEGIES = [
    {"strategy": "greedy"},
    {"strategy": "top-k", "top_k": 20, "temperature": 1.3},
    {"strategy": "top-p", "top_p": 0.9, "temperature": 0.8},
]


def _requests(n: int, seed: int = 0) -> list[dict]:
    """`n` generate() keyword sets: prompts of 1..40 tokens, 1..24 new tokens, every strategy, seeded."""
    r = random.Random(seed)
    return [
        {"prompt_ids": [r.randrange(8449) for _ in range(r.randint(1, 40))], "max_new_tokens": r.randint(1, 24),
         "seed": r.randrange(1000), **STRATEGIES[i % len(STRATEGIES)]}
        for i in range(n)
    ]


def test_threads_sharing_a_session_get_the_sequential_tokens(session):
    threads, per_thread = 8, 6
    requests = _requests(threads * per_thread)
    alone = [session.generate(**r) for r in requests]
    assert len({tuple(t) for t in alone}) == len(alone)  # varied enough that a mix-up shows
    with ThreadPoolExecutor(threads) as pool:
        shared = list(pool.map(lambda r: session.generate(**r), requests))
    mixed_up = [i for i, (a, b) in enumerate(zip(alone, shared)) if a != b]
    assert not mixed_up, f"{len(mixed_up)} of {len(requests)} requests differ from the sequential run"
