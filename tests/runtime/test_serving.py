"""A session as a service uses it: shared by many threads, given batches of prompts of different lengths,
loaded without PyTorch. Every check compares tokens exactly with the same requests run one by one."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import andrea_export
from andrea_export import runtime
from andrea_export.runtime import Request


@pytest.fixture(scope="module", params=["standard", "in-place"])
def session(request, build_dir, lively_model, tmp_path_factory):
    """Both decoders ONNX Runtime runs: the standard one, and the in-place one a build gives the CPU."""
    if request.param == "standard":
        return runtime.load(build_dir, backend="onnxruntime")
    from andrea_export.graphs.inplace_decoder import export_inplace_decoder

    path = export_inplace_decoder(lively_model, tmp_path_factory.mktemp("inplace") / "decoder.inplace.onnx", quiet=True)
    return runtime.load(path, backend="onnxruntime")


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
    # varied enough that a mix-up shows (the trained model's greedy decoding sends a few prompts into
    # the same run of newlines: 47 of these 48 outputs differ; two equal ones cannot be mixed up visibly)
    assert len({tuple(t) for t in alone}) >= 0.95 * len(alone)
    with ThreadPoolExecutor(threads) as pool:
        shared = list(pool.map(lambda r: session.generate(**r), requests))
    mixed_up = [i for i, (a, b) in enumerate(zip(alone, shared)) if a != b]
    assert not mixed_up, f"{len(mixed_up)} of {len(requests)} requests differ from the sequential run"


def test_a_serial_session_takes_turns(session):
    """A backend with one cache in the session (as TensorRT's buffers, contexts and CUDA graph are): the
    lock of SerialSession makes threads take turns, and a batch runs prompt by prompt."""

    class OneCache(runtime.SerialSession):
        backend = "one-cache"

        def __init__(self):
            super().__init__(session.cfg, session.layout, "one cache")
            self.cache, self.length = session._steps().__enter__(), 0  # the session's own kind of cache

        def _prefill(self, ids):
            self.length = len(ids)
            return self.cache.prefill(np.array([ids]), np.ones((1, len(ids)), dtype=np.int64))[0]

        def _decode(self, token):
            self.length += 1
            return self.cache.decode(np.array([token]), np.ones((1, self.length), dtype=np.int64))[0]

    serial, requests = OneCache(), _requests(16, seed=2)
    alone = [session.generate(**r) for r in requests]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda r: serial.generate(**r), requests)) == alone
    assert serial.generate_batch([Request(**r) for r in requests[:5]]) == alone[:5]

    stream = serial.stream([1, 2, 3], 4)
    next(stream)  # the stream holds the session: a call from the same thread would wait for itself
    with pytest.raises(runtime.InputError, match="this thread is already in a call of this session"):
        serial.generate([1], 1)
    stream.close()
    assert serial.generate(**requests[0]) == alone[0]


def test_a_batch_gives_each_prompt_the_tokens_it_gets_alone(session):
    requests = _requests(9, seed=1)
    requests[2]["max_new_tokens"] = 1  # a row that stops at once, beside rows that go on
    alone = [session.generate(**r) for r in requests]
    stop = alone[4][3]
    requests[4]["stop_ids"], alone[4] = [stop], alone[4][: alone[4].index(stop) + 1]  # a row that stops early
    assert session.generate_batch([Request(**r) for r in requests]) == alone


def test_generate_takes_a_list_of_prompts(session):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3], [40, 41, 42]]
    alone = [session.generate(p, [9, 3, 12][i], strategy="top-p", top_p=0.8, seed=7) for i, p in enumerate(prompts)]
    assert session.generate(prompts, [9, 3, 12], strategy="top-p", top_p=0.8, seed=7) == alone
    greedy = session.generate(prompts, 10)
    assert greedy == [session.generate(p, 10) for p in prompts] and len({tuple(g) for g in greedy}) == 3
    seeds = [1, 2, 3]
    assert session.generate(prompts, 6, strategy="top-k", seed=seeds) == [
        session.generate(p, 6, strategy="top-k", seed=s) for p, s in zip(prompts, seeds)]


def test_a_batch_that_does_not_fit_the_context_is_split(session):
    long_prompt, long_answer = Request(list(range(1, 101)), 4), Request([7, 8], 120)  # 100 + 120 > 128
    rows = [session._check(r) for r in (long_prompt, long_answer, long_answer)]
    assert [len(c) for c in session._chunks(rows)] == [1, 2]
    assert session.generate_batch([long_prompt, long_answer]) == [session.generate([*range(1, 101)], 4),
                                                                  session.generate([7, 8], 120)]


RUNTIME_NEEDS = {"numpy", "onnx", "onnxruntime"}  # what a runtime-only install brings (docs/python.md)


def _build_only_modules() -> list[str]:
    """The top-level modules of every pyproject dependency a runtime-only install leaves out."""
    import importlib.metadata
    import re
    import tomllib

    def norm(name: str) -> str:
        return re.split(r"[<>=!~ \[;]", name)[0].lower().replace("_", "-")

    pyproject = tomllib.loads((Path(andrea_export.__file__).parents[1] / "pyproject.toml").read_text())
    left_out = {norm(d) for d in pyproject["project"]["dependencies"]} - RUNTIME_NEEDS
    return sorted(m for m, dists in importlib.metadata.packages_distributions().items()
                  if left_out & {norm(d) for d in dists})

RUNTIME_ONLY = r"""
import sys

BLOCKED = set(sys.argv[2].split(","))

class BuildOnly:  # as if these were not installed: a service's environment
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not in a runtime install)")

sys.meta_path.insert(0, BuildOnly())
from andrea_export import runtime

sess = runtime.load(sys.argv[1])
print(sess.generate([1, 2, 3], 5, strategy="top-k", seed=0))
print(sess.generate([[1, 2, 3], [4]], 3))
print(" ".join(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED | {"andrea_export"})))
"""


def test_loading_and_generating_need_no_torch(build_dir, session):
    """A service runs the runtime where torch and the build tools are not installed: loading a folder and
    generating must import none of them, nor our export and build machinery."""
    blocked = _build_only_modules()
    assert {"torch", "polygraphy", "onnxscript", "onnx_ir"} <= set(blocked)
    root = str(Path(andrea_export.__file__).parents[1])
    run = subprocess.run([sys.executable, "-c", RUNTIME_ONLY, str(build_dir), ",".join(blocked)],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root}, cwd=root, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    single, batch, modules = run.stdout.strip().splitlines()
    assert single == str(session.generate([1, 2, 3], 5, strategy="top-k", seed=0))
    assert batch == str(session.generate([[1, 2, 3], [4]], 3))
    modules = modules.split()
    assert not [m for m in modules if m.split(".")[0] != "andrea_export"]
    build_side = ("andrea_export.model", "andrea_export.engine", "andrea_export.verify", "andrea_export.graphs.export",
                  "andrea_export.graphs.kvcache", "andrea_export.progress", "andrea_export.pipeline")
    assert not [m for m in modules if m.startswith(build_side)], modules
