"""bench/inflight.py, which benchmarks/gpu_checks.py runs on a GPU host, run here on the stand-in slot engine
(fake_cuda.py) and ONNX Runtime: a batcher's runs recorded, replayed on another cache and compared (a run that
differs is caught), and streams timed through the batcher."""

from __future__ import annotations

import numpy as np
import pytest

from andrea_export import runtime
from andrea_export.bench.inflight import record_batched, replay, serve_streams
from andrea_export.runtime import Request


def _requests() -> list[Request]:
    """Five requests on four slots: the first ends first, so the fifth joins slot 0 below three decoding rows."""
    rng = np.random.default_rng(1)
    lengths = [(3, 2), (20, 12), (9, 12), (40, 12), (25, 6)]  # (prompt, new tokens); chunks of 16
    return [Request(rng.integers(1, 8449, p).tolist(), n, ignore_eos=True) for p, n in lengths]


@pytest.fixture(scope="module")
def ort_slots(slot_graphs):
    """ONNX Runtime on the one-group slot graph the stand-in engine was made from."""
    return runtime.load(slot_graphs[0], backend="onnxruntime")


@pytest.fixture(scope="module")
def recorded(trt_slot_session):
    return record_batched(trt_slot_session, _requests(), slots=4, prefill_chunk=16)


def test_recorded_runs_are_the_batchers_and_its_tokens_each_requests_alone(recorded, trt_slot_session):
    tokens, runs = recorded
    assert tokens == [trt_slot_session.generate(r.prompt_ids, r.max_new_tokens, ignore_eos=True) for r in _requests()]
    inside = [r for r in runs if r.chunk_inside]
    assert inside, "no run had the chunk among the decoding rows"
    n = trt_slot_session.layout.n_positions
    assert all(r.group[2][r.chunk[0] - r.group[0]] == n for r in inside)  # the joining slot's row: a pad at the end


def test_a_replay_on_onnx_runtime_agrees_and_a_run_that_differs_is_caught(recorded, ort_slots):
    _, runs = recorded
    ort = ort_slots
    rows = replay(runs, ort.slot_cache(4), rtol=0, atol=0)  # the stand-in computes with ONNX Runtime: bit for bit
    assert len(rows) == len(runs) and all(r["within"] and r["same_top"] and r["max_abs"] == 0 for r in rows)
    assert {r["chunk_inside"] for r in rows} == {True, False}
    assert all(r["rows"] == len(run.group[1]) - run.chunk_inside for r, run in zip(rows, runs))  # the pad: not compared
    k = next(i for i, r in enumerate(runs) if r.chunk_inside)
    assert runs[k].chunk_logits is not None
    runs[k].chunk_logits[0, -1, 7] += 0.5  # one logit of one run off
    rows = replay(runs, ort.slot_cache(4), rtol=1e-2, atol=1e-2)
    assert [i for i, r in enumerate(rows) if not r["within"]] == [k] and rows[k]["max_abs"] == pytest.approx(0.5)
    runs[k].chunk_logits[0, -1, 7] -= 0.5


def test_serve_streams_times_every_token_of_every_stream(ort_slots):
    got = serve_streams(ort_slots, streams=3, prompt=8, new_tokens=5, prefill_chunk=4)
    assert got["tokens"] == 15 and got["slots"] == 3 and got["wall_s"] > 0
    assert got["tokens_per_s"] == pytest.approx(15 / got["wall_s"])
    assert 0 < got["ttft_ms"]["p50"] <= got["ttft_ms"]["p99"] <= got["wall_s"] * 1e3
    assert 0 < got["itl_ms"]["p50"] <= got["itl_ms"]["p99"]
    assert got["steps"] >= 4 and 1 <= got["mean_rows"] <= 3  # 4 decode steps at least after each first token
