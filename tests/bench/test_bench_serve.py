"""`bench --serve` (bench/serve.py) on the lively build, with our own client: every level streams its tokens
without an error, the ratios and goals are computed from the runs, and the report files are written."""

from __future__ import annotations

import json

import pytest

from andrea_export.bench import serve as bench_serve
from andrea_export.deploy import serve as serve_module


def test_the_serve_benchmark_runs_levels_and_modes_and_writes_its_report(lively_build, tmp_path):
    try:
        serve_module.triton_dist(serve_module.serve_python())
    except serve_module.ServeError as e:
        pytest.skip(f"no serving environment here ({e}); `make serve-env` makes it (CI does)")
    doc = bench_serve.run_serve_benchmark({"tiny": lively_build}, levels=(1, 4), modes=("in-flight", "serial"),
                                          per_client=2, slots=4, load="own", soak=120, out=tmp_path, log=lambda *_: None)
    runs = {(r["mode"], r["concurrency"]): r for r in doc["runs"]}
    assert set(runs) == {("in-flight", 1), ("in-flight", 4), ("serial", 1), ("serial", 4)}
    for r in runs.values():
        assert r["errors"] == 0 and r["tokens"] > 0 and r["rss_mb"] > 10 and r["ttft_ms"]["p50"] > 0
    assert runs["in-flight", 4]["requests"] == 8 and doc["settings"]["load"] == "own client"
    # latencies without each client's first request (the start's burst); the burst's TTFT kept beside
    assert runs["in-flight", 4]["latency_requests"] == 4 and runs["in-flight", 1]["latency_requests"] == 7
    assert runs["in-flight", 4]["ttft_all_ms"]["p99"] >= runs["in-flight", 4]["ttft_ms"]["p50"] > 0
    steps = doc["decode_step_ms"]["tiny"]
    assert set(steps) == {"1", "4"} and runs["in-flight", 4]["ideal_x"] == pytest.approx(4 * steps["1"] / steps["4"], rel=0.2)
    assert doc["soak"]["requests"] == 120 and doc["soak"]["errors"] == 0
    goals = {g["goal"] for g in doc["goals"]}
    assert not any("inter-token p99" in g for g in goals)  # no 16-stream level in this run
    assert any(g.startswith("soak:") for g in goals)
    saved = json.loads((tmp_path / "serve.json").read_text())
    assert saved["runs"] == json.loads(json.dumps(doc["runs"]))
    assert "| tiny | in-flight | 4 |" in (tmp_path / "serve.md").read_text() and (tmp_path / "serve.png").stat().st_size > 0
