"""The benchmark harness: statistics, interleaving, floors, environment, and one real run on the tiny
config (PyTorch + ONNX Runtime CPU; TensorRT skipped with its reason) whose outputs are checked.
Timings are never asserted: only that they exist and are consistent."""

from __future__ import annotations

import copy
import csv
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest

from andrea_export import bench
from andrea_export.bench import report as bench_report
from andrea_export.bench.work import case_inputs, forward_bytes, scenario_work
from andrea_export.config import ANDREA_120M, ANDREA_TINY

# ---------------------------------------------------------------- statistics


def test_stats_on_known_samples():
    ms = [float(x) for x in range(1, 11)]  # 1..10 ms
    st = bench.Stats.from_ns([int(x * 1e6) for x in reversed(ms)])  # order must not matter
    assert st.n == 10 and st.min_ms == 1 and st.max_ms == 10
    assert st.median_ms == pytest.approx(5.5)
    assert st.mean_ms == pytest.approx(5.5)
    assert st.p90_ms == pytest.approx(9.1)  # numpy's linear interpolation: 9 + 0.1 * (10 - 9)
    assert st.p99_ms == pytest.approx(9.91)
    std = math.sqrt(sum((x - 5.5) ** 2 for x in ms) / 9)  # sample standard deviation
    assert st.std_ms == pytest.approx(std)
    assert st.cv == pytest.approx(std / 5.5)
    assert st.cv == pytest.approx(0.5505, abs=1e-4)


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    values = sorted(rng.exponential(size=37).tolist())
    for q in (0, 1, 25, 50, 90, 99, 100):
        assert bench.percentile(values, q) == pytest.approx(np.percentile(values, q))
    with pytest.raises(ValueError):
        bench.percentile([], 50)


def test_stats_of_one_sample():
    st = bench.Stats.from_ns([3_000_000])
    assert (st.min_ms, st.median_ms, st.p99_ms, st.cv) == (3.0, 3.0, 3.0, 0.0)


def test_interleaved_order():
    # round r starts at backend r mod n: no backend always follows the same peer
    assert bench.interleaved_order(["a", "b"], 3) == ["a", "b", "b", "a", "a", "b"]
    assert bench.interleaved_order(["a", "b", "c"], 1) == ["a", "b", "c"]
    assert bench.interleaved_order(["a", "b", "c"], 4) == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert bench.interleaved_order(["a", "b"], 3, interleave=False) == ["a", "a", "a", "b", "b", "b"]


def test_run_interleaved_alternates_and_pairs_samples():
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    ns = {"a": 2_000_000, "b": 1_000_000}  # fake clocks: a takes 2 ms, b 1 ms
    timers = {k: (lambda fn, k=k: (fn(), ns[k])[1]) for k in fns}
    settings = bench.Settings(warmup=2, warmup_s=0.0, min_repeats=4, max_repeats=6, budget_s=1.0, gap_s=0.0)
    rounds_seen = []
    samples = bench.run_interleaved(fns, settings, timers, on_round=lambda d, t: rounds_seen.append((d, t)))
    timed = calls[-12:]
    assert timed == ["a", "b", "b", "a"] * 3  # each round starts at the next backend
    assert len(samples["a"]) == len(samples["b"]) == 6  # budget 1 s / 3 ms per round, clamped to max_repeats
    assert rounds_seen[-1] == (6, 6)
    assert bench.ratio_median(samples["a"], samples["b"]) == pytest.approx(2.0)


def test_run_interleaved_rotates_and_keeps_rounds_paired():
    """Three fake backends whose time is set per round: each backend's r-th sample must be round r's,
    whichever position it ran at, and the start rotates."""
    calls = []
    fns = {k: (lambda k=k: calls.append(k)) for k in ("x", "y", "z")}
    factor = {"x": 3, "y": 2, "z": 1}

    def timer_for(k):
        def t(fn):
            fn()
            r = sum(1 for c in calls if c == k)  # this backend's call count = its round, warm-up included
            return factor[k] * 1_000_000 * r  # round r: x = 3r ms, y = 2r ms, z = r ms (drift across rounds)
        return t

    settings = bench.Settings(warmup=1, warmup_s=0.0, min_repeats=5, max_repeats=5, budget_s=0.0, gap_s=0.0)
    samples = bench.run_interleaved(fns, settings, {k: timer_for(k) for k in fns})
    timed = calls[-15:]
    assert [timed[3 * i] for i in range(5)] == ["x", "y", "z", "x", "y"]  # round r starts at r mod 3
    assert all(sorted(timed[3 * i:3 * i + 3]) == ["x", "y", "z"] for i in range(5))  # each once per round
    assert samples["x"] == [3 * s for s in samples["z"]] and samples["y"] == [2 * s for s in samples["z"]]
    assert bench.ratio_median(samples["x"], samples["z"]) == 3.0
    assert bench.ratio_median(samples["y"], samples["z"]) == 2.0


def test_the_gap_before_each_call_is_a_busy_wait(monkeypatch):
    """The untimed gap before each call keeps the core busy: after a 100 ms sleep a decode step took 1.3x as
    long as after 5 ms (the idle vCPU slows down), and a busy gap of the same length did not (measured)."""
    import andrea_export.bench.harness as harness

    def no_sleep(s):
        raise AssertionError(f"time.sleep({s}) in the harness: the gap must keep the core busy")

    monkeypatch.setattr(harness.time, "sleep", no_sleep)
    starts = []
    fns = {k: (lambda: starts.append(harness.time.perf_counter())) for k in ("a", "b")}
    settings = bench.Settings(warmup=1, warmup_s=0.0, min_repeats=3, max_repeats=3, budget_s=0.0, gap_s=0.02)
    bench.run_interleaved(fns, settings)
    assert len(starts) >= 8
    assert min(b - a for a, b in zip(starts, starts[1:])) >= 0.02  # every call waited the whole gap


def test_ratio_median_cancels_drift():
    # the machine slows down 3x during the run; the per-iteration ratio stays 2
    base = [2, 4, 6, 6, 6]
    other = [1, 2, 3, 3, 3]
    assert bench.ratio_median(base, other) == 2.0
    with pytest.raises(ValueError):
        bench.ratio_median([1, 2], [1])


# ---------------------------------------------------------------- floors


def test_floor_arithmetic_andrea_120m():
    cfg = ANDREA_120M
    assert bench.weight_bytes(cfg) == 92_331_264 * 4 == 369_325_056
    assert bench.matmul_params(cfg) == 12 * 12 * 768**2 + 8449 * 768 == 91_423_488
    # prefill of T tokens, no past: 2 * matmul weights * T + causal attention (T(T+1)/2 pairs, 4 C flops each)
    T = 128
    assert bench.forward_flops(cfg, 1, T) == 2 * 91_423_488 * T + 4 * 768 * (T * (T + 1) // 2) * 12
    # decode after a past of 127: weights (but 896 unused position rows) + KV read + new K/V + logits
    b = bench.forward_bytes(cfg, batch=1, new=1, past=127)
    assert b == (92_331_264 - (1024 - 128) * 768) * 4 + 2 * 12 * 127 * 768 * 4 + 2 * 12 * 768 * 4 + 8449 * 4
    machine = {"bandwidth_GBps": 10.0, "matmul_GFLOPs": 100.0}
    t, bound = bench.floor_seconds(bench.forward_flops(cfg, 1, 1, 127), b, machine)
    assert bound == "memory" and t == pytest.approx(b / 10e9)
    t, bound = bench.floor_seconds(bench.forward_flops(cfg, 1, 1024), bench.forward_bytes(cfg, 1, 1024), machine)
    assert bound == "compute" and t == pytest.approx(bench.forward_flops(cfg, 1, 1024) / 100e9)


def test_combine_limits_takes_the_best():
    a = {"device": "cpu", "bandwidth_GBps": 20.0, "copy_GBps": 18.0, "read_GBps": 20.0, "matmul_GFLOPs": 150.0,
         "torch_matmul_GFLOPs": 150.0, "ort_matmul_GFLOPs": 120.0}
    b = dict(a, bandwidth_GBps=30.0, read_GBps=30.0, matmul_GFLOPs=100.0, torch_matmul_GFLOPs=100.0)
    c = bench.combine_limits(a, b)
    assert (c["bandwidth_GBps"], c["matmul_GFLOPs"], c["ort_matmul_GFLOPs"]) == (30.0, 150.0, 120.0)
    assert c["measurements"] == [a, b]


def test_generate_work_is_prefill_plus_steps():
    cfg = ANDREA_TINY
    f, b = bench.scenario_work(cfg, "generate", 2, 8, 0, 4)
    assert f == bench.forward_flops(cfg, 2, 8) + sum(bench.forward_flops(cfg, 2, 1, p) for p in (8, 9, 10))
    assert b == bench.forward_bytes(cfg, 2, 8) + sum(bench.forward_bytes(cfg, 2, 1, p) for p in (8, 9, 10))


# ---------------------------------------------------------------- environment


def test_environment_keys():
    env = bench.environment()
    for key in ("cpu", "memory_GiB", "gpus", "platform", "python", "libraries", "torch", "onnxruntime_providers", "git",
                "loadavg_start"):  # fmt: skip
        assert key in env, key
    assert env["cpu"]["logical_cores"] >= 1 and env["cpu"]["model"]
    assert env["libraries"]["torch"] and env["libraries"]["onnxruntime"]
    assert set(env["git"]) == {"revision", "dirty"}
    json.dumps(env)  # serializable


# ---------------------------------------------------------------- one real run on the tiny config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from andrea_export.model.checkpoint import random_init

    out = tmp_path_factory.mktemp("bench")
    model = random_init(ANDREA_TINY, seed=0, announce=False)
    doc = bench.run_benchmark(
        model=model, backends=("torch", "ort-cpu", "ort-cpu-concat", "trt-native"), quick=True, threads=2,
        settings=bench.Settings(warmup=1, warmup_s=0.0, min_repeats=3, max_repeats=3, budget_s=0.0),
        prefill_grid=[(1, 16), (2, 32)], decode_grid=[(1, 15), (2, 15)], generate_grid=[(1, 8, 3)],
        out=out, workdir=out / "cache", quiet=True,
    )  # fmt: skip
    return doc, out


def test_run_rows_and_skips(run):
    doc, _ = run
    assert doc["backends"]["torch"]["status"] == "ok" and doc["backends"]["torch"]["threads"] == 2
    for name in ("ort-cpu", "ort-cpu-concat"):
        assert doc["backends"][name]["status"] == "ok" and doc["backends"][name]["threads"] == 2
    assert doc["backends"]["ort-cpu"]["decoder_graph"].startswith("decoder.inplace.onnx: in-place cache")
    assert doc["backends"]["ort-cpu-concat"]["decoder_graph"].startswith("decoder.onnx: standard graph")
    assert doc["backends"]["trt-native"]["status"] == "skipped" and doc["backends"]["trt-native"]["reason"]
    keys = {(r["scenario"], r["backend"], r["batch"], r["seq"], r["past"]) for r in doc["rows"]}
    for backend in ("torch", "ort-cpu", "ort-cpu-concat"):
        assert ("prefill", backend, 2, 32, 0) in keys
        assert ("decode", backend, 2, 1, 15) in keys
        assert ("generate", backend, 1, 8, 0) in keys
    assert doc["backends"]["ort-cpu"]["prefill_graph"].startswith("the in-place decoder")  # as runtime runs a prompt
    assert doc["backends"]["ort-cpu-concat"]["prefill_graph"] == "model.onnx (no cache)"
    assert len(doc["rows"]) == 3 * 5  # 5 cases (2 prefill, 2 decode, 1 generate) x 3 backends
    for r in doc["rows"]:
        assert r["n"] == 3
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["p90_ms"] <= r["p99_ms"] <= r["max_ms"]
        assert r["floor_ms"] > 0 and r["x_floor"] == pytest.approx(r["median_ms"] / r["floor_ms"])
        assert r["bound"] in ("memory", "compute") and r["tokens_per_s"] > 0
    pairs = [(q["baseline"], q["backend"]) for q in doc["ratios"]]  # every pair of a case, the earlier as baseline
    assert pairs == [("torch", "ort-cpu"), ("torch", "ort-cpu-concat"), ("ort-cpu", "ort-cpu-concat")] * 5
    assert all(q["speedup"] > 0 for q in doc["ratios"])
    concat = {(r["scenario"], r["batch"]): r for r in doc["rows"] if r["backend"] == "ort-cpu-concat"}
    ours = {(r["scenario"], r["batch"]): r for r in doc["rows"] if r["backend"] == "ort-cpu"}
    assert [(g["scenario"], g["batch"]) for g in doc["inplace"]] == list(concat) == [
        ("prefill", 1), ("prefill", 2), ("decode", 1), ("decode", 2), ("generate", 1)]  # prefill: model.onnx vs in-place
    for g in doc["inplace"]:  # the in-place gain: concat time / in-place time, paired by round
        key = (g["scenario"], g["batch"])
        assert g["time_ratio"] == concat[key]["x_ours"] > 0
        assert (g["concat_ms"], g["inplace_ms"]) == (concat[key]["median_ms"], ours[key]["median_ms"])
    assert doc["inplace"] == bench_report.inplace_gain(doc)
    m = doc["machine"]
    assert m["bandwidth_GBps"] > 0 and m["matmul_GFLOPs"] > 0 and m["threads"] == 2
    assert len(m["measurements"]) == 2  # at the start and at the end; the best of each figure counts
    assert m["matmul_GFLOPs"] == max(x["matmul_GFLOPs"] for x in m["measurements"])
    assert m["matmul_GFLOPs"] == max(m["torch_matmul_GFLOPs"], m["ort_matmul_GFLOPs"])
    assert len(doc["goals"]) == 17 and all(g["met"] is None for g in doc["goals"])  # not in this tiny grid, no peers
    assert isinstance(doc["warnings"], list) and len(doc["loadavg_end"]) == 3


def test_quantized_backends_run_and_report_precision(run):
    """ort-cpu-int8 / -int4: ours on graphs quantized (quantize.py) from the same weights, cached beside the
    fp32 exports; their rows say their precision and leave the fp32 floor out."""
    import onnx

    from andrea_export.graphs.quantize import matmulnbits
    from andrea_export.model.checkpoint import random_init

    cache = run[1] / "cache"
    doc = bench.run_benchmark(
        model=random_init(ANDREA_TINY, seed=0, announce=False), backends=("ort-cpu", "ort-cpu-int8", "ort-cpu-int4"),
        quick=True, threads=2,
        settings=bench.Settings(warmup=1, warmup_s=0.0, min_repeats=3, max_repeats=3, budget_s=0.0),
        prefill_grid=[(1, 16)], decode_grid=[(2, 15)], generate_grid=[(1, 8, 3)], workdir=cache, quiet=True,
    )  # fmt: skip
    for name, precision in (("ort-cpu", "fp32"), ("ort-cpu-int8", "int8"), ("ort-cpu-int4", "int4")):
        info = doc["backends"][name]
        assert info["status"] == "ok" and info["precision"].startswith(precision), info
        assert info["decoder_graph"].startswith("decoder.inplace.onnx: in-place cache")
        rows = [r for r in doc["rows"] if r["backend"] == name]
        assert sorted(r["scenario"] for r in rows) == ["decode", "generate", "prefill"]
        for r in rows:
            assert r["precision"] == precision and r["median_ms"] > 0 and r["tokens_per_s"] > 0
            if precision == "fp32":
                assert r["x_floor"] == pytest.approx(r["median_ms"] / r["floor_ms"]) and r["gbps"] > 0
            elif r["scenario"] == "prefill":  # compute-bound, and the int8 product rate is not measured: no floor
                assert r["x_floor"] is r["floor_ms"] is r["bound"] is r["gbps"] is r["bytes"] is None
            else:  # decode, generate: the memory floor of their own bytes
                assert r["bound"] == "memory" and r["bytes"] == scenario_work(
                    ANDREA_TINY, r["scenario"], r["batch"], r["seq"], r["past"], r["new_tokens"], precision)[1]
                assert r["floor_ms"] == pytest.approx(r["bytes"] / doc["machine"]["bandwidth_GBps"] / 1e6)
    (folder,) = [d for d in cache.iterdir() if (d / "decoder.inplace.onnx").is_file()]
    cfg, C = ANDREA_TINY, ANDREA_TINY.n_embd
    for precision, bits in (("int8", 8), ("int4", 4)):
        for stem in ("decoder.inplace",):  # prefill too runs the in-place decoder
            graph = onnx.load(str(folder / f"{stem}.{precision}.onnx"))
            nodes = matmulnbits(graph)
            assert nodes and all(n["bits"] == bits for n in nodes), (stem, precision, nodes[:1])
        # the byte model is the graph's own weights: all of them, but the float32 tables only gathered from
        sizes = {i.name: onnx.numpy_helper.to_array(i).nbytes for i in graph.graph.initializer}
        tables = sum(n for name, n in sizes.items() if n in (4 * cfg.vocab_size * C, 4 * cfg.n_positions * C))
        batch, past = 2, 15
        gathered = 4 * (batch + past + 1) * C  # one token row per row of the batch, the positions used
        kv_and_logits = forward_bytes(cfg, batch, 1, past) - forward_bytes(cfg, batch, 1, past, write_kv=False) \
            + 2 * cfg.n_layer * batch * past * C * 4 + batch * cfg.vocab_size * 4  # fmt: skip
        model = forward_bytes(cfg, batch, 1, past, precision=precision) - kv_and_logits
        assert model == pytest.approx(sum(sizes.values()) - tables + gathered, rel=1e-3), precision
    assert "precision" in bench_report.to_csv(doc).splitlines()[0]


def test_same_inputs_same_outputs(run):
    """Backends get the same arrays, and they compute the same thing (decode step, generation; tiny model)."""
    from andrea_export.model.checkpoint import random_init

    cfg = ANDREA_TINY
    ids, mask, past = case_inputs(cfg, "decode", 2, 1, 5, seed=0)
    again = case_inputs(cfg, "decode", 2, 1, 5, seed=0)
    assert np.array_equal(ids, again[0]) and all(np.array_equal(a, b) for a, b in zip(past, again[2]))
    assert ids.shape == (2, 1) and mask.shape == (2, 6) and past[0].shape == (2, cfg.n_head, 5, cfg.head_dim)
    ctx = bench.Context(random_init(cfg, seed=0, announce=False), 1, run[1] / "cache")  # the run's cached exports
    assert ctx.fingerprint == run[0]["weights"]["fingerprint"]
    t, o, c = bench.TorchBackend(), bench.OrtBackend(), bench.OrtBackend(cache="concat")
    t.setup(ctx), o.setup(ctx), c.setup(ctx)
    logits_t = t.decode(ids, mask, past)()[0].numpy()
    logits_o = o.decode(ids, mask, past)().copy_outputs_to_cpu()[0]
    np.testing.assert_allclose(logits_t, logits_o, atol=1e-4, rtol=1e-4)
    assert np.array_equal(t.generate(ids, 3)().numpy(), o.generate(ids, 3)())  # runtime.OrtSession, batched
    assert t.generate(ids[:1], 3)().numpy().tolist() == o.generate(ids[:1], 3)()
    assert c.generate(ids, 3)() == o.generate(ids, 3)()  # the two decoder graphs through the runtime's loop


def test_inplace_decode_step_is_the_standard_step(run):
    """ort-cpu's decode step on the in-place graph: the same logits as the standard graph's (ort-cpu-concat)
    on the same past, its cache buffers (capacity P + 1) are the bound outputs themselves, holding the
    past and, at row P, the new token's keys and values; a second call writes row P again (same work)."""
    from andrea_export.model.checkpoint import random_init

    cfg = ANDREA_TINY
    ctx = bench.Context(random_init(cfg, seed=0, announce=False), 1, run[1] / "cache")
    inplace, concat = bench.OrtBackend(), bench.OrtBackend(cache="concat")
    assert (inplace.name, inplace.cache, concat.name) == ("ort-cpu", "inplace", "ort-cpu-concat")
    inplace.setup(ctx), concat.setup(ctx)
    for batch, P in ((1, 1), (2, 15)):
        ids, mask, past = case_inputs(cfg, "decode", batch, 1, P, seed=1)
        want = concat.decode(ids, mask, past)().copy_outputs_to_cpu()  # logits, then present [B, H, P + 1, D] each
        step = inplace.decode(ids, mask, past)
        binding = step()
        got = binding.copy_outputs_to_cpu()
        np.testing.assert_allclose(got[0], want[0], atol=1e-4, rtol=1e-4)
        assert [v.data_ptr() for v in binding.get_outputs()[1:]] == [v.data_ptr() for v in step.cache]  # in place
        for buf, present, p in zip(got[1:], want[1:], past):
            assert buf.shape == present.shape == (batch, cfg.n_head, P + 1, cfg.head_dim)
            assert np.array_equal(buf[:, :, :P], p)  # the past, untouched
            np.testing.assert_allclose(buf[:, :, P], present[:, :, P], atol=1e-5, rtol=1e-5)  # the new row
        assert np.array_equal(step().copy_outputs_to_cpu()[0], got[0])


def test_which_graph_each_ort_backend_runs():
    cpu, concat, cuda = bench.make_backends(["ort-cpu", "ort-cpu-concat", "ort-cuda"])
    assert (cpu.cache, concat.cache, cuda.cache) == ("inplace", "concat", "concat")
    assert "ort-cpu-concat" in bench.DEFAULT_BACKENDS
    with pytest.raises(ValueError, match="no float32 kernels"):  # ORT's CUDA GroupQueryAttention
        bench.OrtBackend("CUDAExecutionProvider", cache="inplace")


def test_json_round_trip(run):
    doc, out = run
    loaded = bench_report.load_json(out / "bench.json")
    assert loaded == json.loads(json.dumps(doc))
    assert loaded["schema_version"] == bench_report.SCHEMA_VERSION and loaded["kind"] == bench_report.KIND
    bad = copy.deepcopy(loaded)
    bad["schema_version"] = 99
    with pytest.raises(bench_report.BenchSchemaError, match="schema_version"):
        bench_report.validate(bad)
    with pytest.raises(bench_report.BenchSchemaError):
        bench_report.validate({"kind": "something else"})


def test_csv_and_markdown_written(run):
    doc, out = run
    rows = list(csv.DictReader(io.StringIO((out / "bench.csv").read_text())))
    assert len(rows) == len(doc["rows"])
    assert list(rows[0]) == list(bench_report.CSV_FIELDS)
    assert float(rows[0]["median_ms"]) == pytest.approx(doc["rows"][0]["median_ms"])
    md = (out / "bench.md").read_text()
    assert "| backend | shape | median ms" in md and "## Goals" in md and "trt-native" in md
    assert md.count("| torch | B=") == 5  # one row per case in the result tables
    assert "## The in-place cache: `ort-cpu-concat` (standard decoder) time / `ort-cpu` (in-place decoder)" in md
    for g in doc["inplace"]:
        assert f"| {g['scenario']} | {bench_report._shape(g)} | {bench_report._fmt(g['concat_ms'])} |" in md


def test_png_plots_written(run):
    """A plot draws curves: tokens/s over the decode grid's two batches; no prefill plot, since no batch of
    the prefill grid has two lengths (quick mode used to plot single points on a log axis)."""
    pytest.importorskip("matplotlib")
    _, out = run
    data = (out / "tokens_per_s.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert not (out / "prefill_latency.png").exists()


def test_plots_draw_only_curves_and_keep_the_legend_off_them(run, tmp_path):
    import copy

    pytest.importorskip("matplotlib")
    doc, _ = run
    doc = copy.deepcopy(doc)
    extra = [dict(r, seq=64) for r in doc["rows"] if r["scenario"] == "prefill" and r["batch"] == 1]
    doc["rows"] += extra  # batch 1 now has two lengths: a prefill panel; batch 2 still has none
    files = {p.name for p in bench_report.write_plots(doc, tmp_path)}
    assert {"prefill_latency.png", "tokens_per_s.png"} <= files
    only_batch_1 = [r for r in doc["rows"] if r["scenario"] != "decode" or r["batch"] == 1]
    assert "tokens_per_s.png" not in {p.name for p in bench_report.write_plots({**doc, "rows": only_batch_1},
                                                                              tmp_path / "b1")}


def test_compare_ratios(run):
    doc, out = run
    same = bench_report.compare(out / "bench.json", out / "bench.json")
    assert len(same) == len(doc["rows"]) and all(r["ratio"] == pytest.approx(1.0) for r in same)
    b = copy.deepcopy(doc)
    for r in b["rows"]:
        r["median_ms"] = r["median_ms"] * (0.5 if r["backend"] == "ort-cpu" else 2.0)
    b["rows"] = [r for r in b["rows"] if r["scenario"] != "generate"]  # rows only in A are left out
    rows = bench_report.compare(doc, b)
    assert len(rows) == 12  # 15 rows less the 3 generate ones
    for r in rows:
        assert r["ratio"] == pytest.approx(0.5 if r["backend"] == "ort-cpu" else 2.0)
    assert "| prefill | torch |" in bench_report.compare_markdown(rows)


def _goal_doc(decode_x=(1.25, 1.4), prefill_gflops=96.0, int8=2.5, int4=1 / 2.5, gen_int4=2.6):
    """A hand-made result: ort-cpu decode rows at 1x127 and 8x512 (plus one off the grid), prefill 1x128 of
    torch and ort-cpu, and the ratios of ours over torch and of the quantized backends over ours."""
    dec = lambda b, p, x, be="ort-cpu": {"scenario": "decode", "backend": be, "batch": b, "past": p, "seq": 1,
                                         "new_tokens": 1, "median_ms": 40.0 * x, "floor_ms": 40.0, "x_floor": x,
                                         "bound": "memory", "gbps": 8.0}  # fmt: skip
    rows = [dec(1, 127, decode_x[0]), dec(8, 512, decode_x[1]), dec(2, 5, 9.0),  # 2x5: not a grid case
            dec(1, 127, 0.5, "ort-cpu-int8"), dec(1, 127, 0.5, "ort-cpu-int4"),
            {"scenario": "prefill", "backend": "torch", "batch": 1, "seq": 128, "past": 0, "median_ms": 300.0,
             "gflops": 80.0},
            {"scenario": "prefill", "backend": "ort-cpu", "batch": 1, "seq": 128, "past": 0, "median_ms": 250.0,
             "gflops": prefill_gflops}]  # fmt: skip
    for r in rows[3:5]:
        r.update(floor_ms=None, x_floor=None, bound=None, gbps=None)  # quantized rows: no fp32 floor
    gen = {"scenario": "generate", "batch": 1, "seq": 32, "past": 0, "new_tokens": 128}
    rows += [dict(gen, backend=b, median_ms=m) for b, m in (("ort-cpu", 2000.0), ("ort-cpu-int4", 800.0))]
    d127 = {"scenario": "decode", "batch": 1, "seq": 1, "past": 127, "new_tokens": 1}
    ratios = [{"scenario": "prefill", "batch": 1, "seq": 128, "past": 0, "new_tokens": 0, "baseline": "torch",
               "backend": "ort-cpu", "speedup": 1.2},
              dict(d127, baseline="ort-cpu", backend="ort-cpu-int8", speedup=int8),
              dict(d127, baseline="ort-cpu-int4", backend="ort-cpu", speedup=int4),  # int4 ran first: flipped
              dict(gen, baseline="ort-cpu", backend="ort-cpu-int4", speedup=gen_int4)]  # fmt: skip
    return {"rows": rows, "ratios": ratios, "machine": {"bandwidth_GBps": 10.0, "matmul_GFLOPs": 100.0}}


def test_goals_on_synthetic_rows():
    g = bench.goals(_goal_doc())
    names = ["decode step at every decode case", "prefill 128 tokens (batch 1)", "vs PyTorch eager",
             "int8 (ort-cpu-int8)", "int4 (ort-cpu-int4)", "generate, batch 1", "batch 8, past 128",
             "int4 decode step, batch 1, past 127", "int4 decode step, batch 1, past 127 (ort-cpu-int4) vs its own bytes",
             "int8 decode step, batch 1, past 127", "int8 decode step, batch 1, past 127 (ort-cpu-int8) vs its own bytes",
             "batch 8, past 1023",
             "batch 1, past 1023", "than Optimum", "than onnxruntime-genai", "OpenVINO or CTranslate2",
             "OpenVINO's default"]  # fmt: skip
    assert len(g) == len(names) and all(n in x["name"] for n, x in zip(names, g))
    assert [x["met"] for x in g] == [True, True, False, True, False, True] + [None] * 11  # 1.4 x floor <= 1.5; no peers
    floor, prefill, torch_, int8, int4, gen = g[:6]
    assert floor["value"] == 1.4 and "B=8 P=512" in floor["detail"] and "2 of the grid's 10 cases" in floor["detail"]
    assert prefill["value"] == pytest.approx(100 / 96) and torch_["value"] == 1.2
    assert int8["value"] == 2.5 and int4["value"] == pytest.approx(2.5) and gen["value"] == 2.6  # int4 < 3: not met
    assert "fp32 2000.00 ms, int4 800.00 ms" in gen["detail"]
    g = bench.goals(_goal_doc(decode_x=(1.25, 1.3), prefill_gflops=80.0, int8=1.9, int4=1 / 3.2, gen_int4=2.4))
    assert [x["met"] for x in g[:6]] == [True, False, False, False, True, False]
    assert g[0]["value"] == 1.3 and "B=8 P=512" in g[0]["detail"] and g[1]["value"] == pytest.approx(1.25)
    g = bench.goals(_goal_doc(decode_x=(1.6, 1.3)))
    assert g[0]["met"] is False and g[0]["value"] == 1.6
    doc = _goal_doc()
    doc["ratios"] = [dict(doc["ratios"][0], baseline="ort-cpu", backend="torch", speedup=1 / 1.5)]  # ort-cpu ran first
    doc["rows"] = [r for r in doc["rows"] if r["backend"] in ("torch", "ort-cpu") and r["scenario"] == "prefill"]
    g = bench.goals(doc)
    assert g[2]["value"] == pytest.approx(1.5) and g[2]["met"] is True
    assert [x["detail"] for x in (g[0], g[3], g[4], g[5])] == ["not run"] * 4 and g[0]["met"] is None


def test_the_floor_goal_says_what_the_worst_case_costs_if_memory_and_compute_do_not_overlap():
    """The floor is max(memory time, compute time); ONNX Runtime runs the step's ops one after another, so
    the goal's detail also gives the sum (the time if they do not overlap) and the step against it."""
    doc = _goal_doc()
    worst = next(r for r in doc["rows"] if r["backend"] == "ort-cpu" and r.get("past") == 512)
    worst.update(flops=1e9, bytes=4e8)  # 10 ms at 100 GFLOP/s, 40 ms at 10 GB/s; median 56 ms
    detail = bench.goals(doc)[0]["detail"]
    assert "memory 40.0 ms + compute 10.0 ms = 50.0 ms" in detail and "1.12x that" in detail


def test_unknown_names_are_user_errors():
    from andrea_export.errors import AndreaExportError

    with pytest.raises(AndreaExportError, match="unknown backend"):
        bench.make_backends(["tensorflow"])
    with pytest.raises(AndreaExportError, match="unknown scenario"):
        bench.run_benchmark(model=None, scenarios=["train"], quiet=True)


def test_trt_backend_skips_with_reason_without_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the skip path is not taken")
    reason = bench.TrtBackend("plugin", {"prefill": "missing.plan"}).check()
    assert "GPU" in reason


def test_parse_names_and_engine_specs(tmp_path):
    from andrea_export.errors import AndreaExportError

    assert bench.parse_names("torch, ort-cpu", bench.BACKENDS, "backend") == ["torch", "ort-cpu"]
    with pytest.raises(AndreaExportError, match="unknown backend"):
        bench.parse_names("torch,tf", bench.BACKENDS, "backend")
    specs = bench.parse_engine_specs(["native:prefill=a.plan", "native:decode=b.plan", "plugin:prefill=c.plan"])
    assert specs == {"trt-native": {"prefill": Path("a.plan"), "decode": Path("b.plan")},
                     "trt-plugin": {"prefill": Path("c.plan")}}  # fmt: skip
    with pytest.raises(AndreaExportError, match="VARIANT:ROLE=PLAN"):
        bench.parse_engine_specs(["fast:prefill=a.plan"])


def test_floor_read_in_the_same_rounds_gives_the_paired_goal():
    from andrea_export import bench

    doc = {
        "machine": {"bandwidth_GBps": 50.0, "matmul_GFLOPs": 400.0},
        "rows": [
            {"scenario": "decode", "backend": "mem-read", "batch": 1, "past": 127, "median_ms": 5.0, "gbps": 74.0,
             "x_floor": 1.0, "floor_ms": 5.0, "bound": "memory"},
            {"scenario": "decode", "backend": "ort-cpu", "batch": 1, "past": 127, "median_ms": 8.0, "gbps": 46.0,
             "x_floor": 1.6, "floor_ms": 5.0, "bound": "memory"},
        ],
        "ratios": [{"scenario": "decode", "batch": 1, "seq": 1, "past": 127, "new_tokens": 1,
                    "baseline": "mem-read", "backend": "ort-cpu", "speedup": 0.625}],
    }
    paired = [g for g in bench.goals(doc) if "same rounds" in g["name"] and "fp32" in g["name"]]
    assert len(paired) == 1
    assert paired[0]["value"] == pytest.approx(1.6) and paired[0]["met"] is False and "B=1 P=127" in paired[0]["detail"]
    doc["ratios"][0]["speedup"] = 1 / 1.2  # ours 1.2x the floor read in the same rounds: within 1.3x
    paired = [g for g in bench.goals(doc) if "same rounds" in g["name"] and "fp32" in g["name"]]
    assert paired[0]["value"] == pytest.approx(1.2) and paired[0]["met"] is True
    # a read that beat the machine's measured bandwidth (x floor < 0.95, a warning of the run) was disturbed:
    # it is no floor to hold a backend against, so the paired goal leaves that case out and says so
    doc["rows"][0]["x_floor"] = 0.35
    paired = [g for g in bench.goals(doc) if "same rounds" in g["name"] and "fp32" in g["name"]]
    assert paired[0]["met"] is None and "B=1 P=127" in paired[0]["detail"] and "left out" in paired[0]["detail"]


def _tiny_context(tmp_path):
    """The run's real Context (one thread) around random andrea-tiny weights."""
    from andrea_export.bench.backends import Context
    from andrea_export.model.checkpoint import random_init

    return Context(random_init(ANDREA_TINY, seed=0, announce=False), 1, tmp_path)


@pytest.mark.parametrize("precision", ["fp32", "int8", "int4"])
def test_mem_read_reads_the_decode_step_bytes(precision, tmp_path):
    """mem-read (and mem-read-int8 / -int4: a quantized step's own bytes) reads exactly the step's bytes."""
    import numpy as np

    from andrea_export import bench
    from andrea_export.config import ANDREA_TINY

    ctx = _tiny_context(tmp_path)
    (b,) = bench.make_backends(["mem-read" if precision == "fp32" else f"mem-read-{precision}"])
    assert b.precision == precision
    b.setup(ctx)
    past = [np.zeros((2, ANDREA_TINY.n_head, 9, ANDREA_TINY.head_dim), np.float32)]
    run = b.decode(np.zeros((2, 1), np.int64), np.ones((2, 10), np.int64), past)
    expected = bench.forward_bytes(ANDREA_TINY, 2, 1, 9, precision=precision) // 4
    assert float(run()) == expected  # a sum of ones over exactly the step's bytes


def test_the_mem_read_backends_of_a_run_share_one_buffer(tmp_path):
    """Each reader of a case holding its own buffer took 2.4 GB apiece at batch 32 past 1023 (a run with
    mem-read, -int8 and -int4 beside the peers was killed for memory): they read views of one."""
    import numpy as np

    from andrea_export import bench
    from andrea_export.config import ANDREA_TINY

    ctx, runs = _tiny_context(tmp_path), []
    for b in bench.make_backends(["mem-read", "mem-read-int8", "mem-read-int4"]):
        b.setup(ctx)
        past = [np.zeros((2, ANDREA_TINY.n_head, 9, ANDREA_TINY.head_dim), np.float32)]
        runs.append(b.decode(np.zeros((2, 1), np.int64), np.ones((2, 10), np.int64), past))
    assert len({r.buffer.untyped_storage().data_ptr() for r in runs}) == 1
    assert [float(r()) for r in runs] == [bench.forward_bytes(ANDREA_TINY, 2, 1, 9, precision=p) // 4
                                          for p in ("fp32", "int8", "int4")]  # fmt: skip


@pytest.mark.parametrize("flag, spinning", [("--spin", True), ("--no-spin", False), (None, True)])
def test_cli_spin_reaches_every_ort_backend(tmp_path, flag, spinning):
    """`bench` lets ORT spin-wait by default (ORT's own default, what `runtime.load` gives a user, and what
    onnxruntime-genai always does), so that peers compare like with like; a run with a spinning backend
    waits out the spin (about 40 ms measured) before each call, so that it does not steal the next call's
    cores; `--no-spin` keeps the short gap."""
    from click.testing import CliRunner

    from andrea_export.cli import main

    out = tmp_path / "b"
    result = CliRunner().invoke(main, ["bench", "--config", "andrea-tiny", "--quick", "--backends", "ort-cpu",
                                       "--scenarios", "prefill", "--prefill-grid", "1x8", "--threads", "1", "--out",
                                       str(out)] + ([flag] if flag else []))
    assert result.exit_code == 0, result.output
    assert f"report: {out / 'bench.md'}" in result.output and "| backend |" not in result.output  # no table dump
    doc = json.loads((out / "bench.json").read_text())
    assert doc["backends"]["ort-cpu"]["spin_wait"] is spinning
    assert doc["settings"]["gap_s"] == (bench.Settings().spin_gap_s if spinning else bench.Settings().gap_s)


def test_trt_backend_does_not_time_what_tensorrt_refused(tiny_onnx, tmp_path, monkeypatch):
    """set_input_shape / set_tensor_address / execute_async_v3 report a refusal by returning False; the bench's
    TensorRT backend used to ignore it and time whatever ran. Over the strict TensorRT stand-in (tests/runtime):
    a shape outside the engine's profile raises before anything is timed."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "runtime"))
    from fake_cuda import FakeCudart, fake_tensorrt, write_plan

    from andrea_export.errors import CudaError

    plan = write_plan(tmp_path / "model.plan", tiny_onnx, [
        {"name": "prefill", "shapes": {"input_ids": {"min": [1, 1], "opt": [1, 16], "max": [2, 32]}}}])
    backend = bench.TrtBackend("native", {"prefill": plan})
    trt = fake_tensorrt(FakeCudart())
    backend.trt, backend.runtime, backend._engines, backend.device = trt, trt.Runtime(trt.Logger()), {}, "cpu"
    with pytest.raises(CudaError, match=r"refused shape \[1, 64\] for 'input_ids'"):
        backend.prefill(np.zeros((1, 64), dtype=np.int64))  # longer than the profile's 32


def test_issue_24_goals_on_synthetic_rows():
    """The quantized floors (x_floor of the int4 / int8 decode step at 1x127: int4 <= 1.5, int8 <= 1.3), int4
    >= 3x fp32 at batch 8, no CPU peer faster than ours at its precision, and our fastest accurate run
    (ort-cpu or ours-openvino) against OpenVINO's default."""
    from andrea_export.bench import report

    dec = lambda be, x, b=1, p=127: {"scenario": "decode", "backend": be, "batch": b, "past": p, "seq": 1,
                                     "new_tokens": 1, "median_ms": 2.0 * x, "floor_ms": 2.0, "x_floor": x,
                                     "bytes": 67e6, "gbps": 20.0, "bound": "memory", "flops": 1e9,
                                     "precision": be.rsplit("-", 1)[1]}  # fmt: skip
    gen = {"scenario": "generate", "seq": 32, "past": 0, "new_tokens": 128}
    rows = [dec("ort-cpu-int4", 1.4), dec("ort-cpu-int8", 1.35)]
    rows += [dict(gen, backend=b, batch=n, median_ms=ms, precision=p)
             for b, p, n, ms in (("ort-cpu", "fp32", 1, 1000.0), ("ours-openvino", "bf16", 1, 800.0),
                                 ("openvino", "bf16", 1, 900.0), ("ort-cpu", "fp32", 8, 2000.0),
                                 ("ours-openvino", "bf16", 8, 2100.0), ("openvino", "bf16", 8, 1900.0))]  # fmt: skip
    ratios = [dict(gen, batch=n, baseline=a, backend=b, speedup=s)
              for n, a, b, s in ((1, "ort-cpu", "ours-openvino", 1.25), (1, "ort-cpu", "openvino", 1000 / 900),
                                 (1, "ours-openvino", "openvino", 800 / 900), (8, "ort-cpu", "ours-openvino", 2000 / 2100),
                                 (8, "ort-cpu", "openvino", 2000 / 1900), (8, "ours-openvino", "openvino", 2100 / 1900))]  # fmt: skip
    ratios.append({"scenario": "decode", "batch": 8, "seq": 1, "past": 128, "new_tokens": 1, "baseline": "ort-cpu",
                   "backend": "ort-cpu-int4", "speedup": 3.1})
    d127 = {"scenario": "decode", "batch": 1, "seq": 1, "past": 127, "new_tokens": 1}
    rows += [dec("mem-read-int4", 1.2), dec("mem-read-int8", 1.0)]  # the read of each one's bytes, same rounds
    ratios += [dict(d127, baseline="mem-read-int4", backend="ort-cpu-int4", speedup=1 / 1.25),  # t_q = 1.25 t_read
               dict(d127, baseline="ort-cpu-int8", backend="mem-read-int8", speedup=1.4)]  # the other way round
    rows += [dec("ort-cpu", 1.0, 8, 128), dec("ort-cpu-int4", 1.0, 8, 128)]
    doc = {"rows": rows, "ratios": ratios, "machine": {"bandwidth_GBps": 36.0, "matmul_GFLOPs": 200.0},
           "backends": {b: {"status": "ok"} for b in ("ort-cpu", "ours-openvino", "openvino", "ort-cpu-int4")}}
    doc["peers"] = report.peers(doc)
    assert [(q["peer"], q["ours"], q["batch"]) for q in doc["peers"]["ratios"]] == [("openvino", "ours-openvino", 1),
                                                                                  ("openvino", "ours-openvino", 8)]
    g = {x["name"]: x for x in bench.goals(doc)}
    int4_floor = g["int4 decode step, batch 1, past 127 (ort-cpu-int4) vs its own memory floor"]
    int8_floor = g["int8 decode step, batch 1, past 127 (ort-cpu-int8) vs its own memory floor"]
    assert (int4_floor["value"], int4_floor["met"], int8_floor["met"]) == (1.4, True, False)
    assert "67.0 MB" in int4_floor["detail"]
    int4_paired = g["int4 decode step, batch 1, past 127 (ort-cpu-int4) vs its own bytes read in the same rounds"]
    int8_paired = g["int8 decode step, batch 1, past 127 (ort-cpu-int8) vs its own bytes read in the same rounds"]
    assert (int4_paired["value"], int4_paired["met"]) == (pytest.approx(1.25), True)
    assert (int8_paired["value"], int8_paired["met"]) == (pytest.approx(1.4), False)
    assert "2.40 ms (20.0 GB/s)" in int4_paired["detail"]  # mem-read-int4's row
    b8 = g["decode step, batch 8, past 128: int4 (ort-cpu-int4) vs our fp32 (ort-cpu)"]
    assert (b8["value"], b8["met"]) == (3.1, True)
    peer = next(x for n, x in g.items() if "OpenVINO or CTranslate2" in n)
    assert peer["value"] == pytest.approx(1900 / 2100) and peer["met"] is False and "B=8" in peer["detail"]
    best = next(x for n, x in g.items() if "fastest accurate" in n)
    # batch 1: ours-openvino 800 ms beats 900; batch 8: ort-cpu 2000 ms loses to 1900: the worst is 0.95
    assert best["value"] == pytest.approx(1900 / 2000) and best["met"] is False and "ours ort-cpu" in best["detail"]


@pytest.fixture(scope="module")
def fp16_decoder(tiny_model, tmp_path_factory):
    from andrea_export.graphs.kvcache import export_decoder_onnx
    from andrea_export.graphs.precision import convert_precision

    d = tmp_path_factory.mktemp("fp16-decoder")
    return convert_precision(export_decoder_onnx(tiny_model, d / "decoder.onnx", quiet=True), d / "decoder.fp16.onnx",
                             "fp16")  # fmt: skip


def _fake_trt_backend(tmp_path, graph, monkeypatch, stream_ok=True):
    """The bench's TensorRT backend over the strict TensorRT stand-in (tests/runtime), its decoder engine "built"
    from `graph` with both profiles; on the CPU (device "cpu"), its stream a fake CUDA stream."""
    import types

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "runtime"))
    from fake_cuda import FakeCudart, fake_tensorrt, write_plan

    from andrea_export.graphs.kvcache import optimization_profiles
    from andrea_export.graphs.layout import read_kv_layout

    cudart = FakeCudart()
    plan = write_plan(tmp_path / "decoder.plan", graph, optimization_profiles(read_kv_layout(graph)))
    backend = bench.TrtBackend("plugin", {"decode": plan})
    trt = fake_tensorrt(cudart)
    backend.trt, backend.runtime, backend._engines, backend.device = trt, trt.Runtime(trt.Logger()), {}, "cpu"
    backend.cfg = ANDREA_TINY
    handle = 0xDEAD  # no stream of this device: TensorRT refuses to select a profile on it
    if stream_ok:
        handle = int(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking)[1])
    backend.stream = types.SimpleNamespace(cuda_stream=handle, synchronize=lambda: None)
    return backend


def test_trt_backend_hands_a_half_precision_engine_its_own_dtypes(fp16_decoder, tmp_path, monkeypatch):
    """An fp16 decoder engine keeps its cache in 2-byte elements: float32 arrays bound there would be read as other
    numbers, and past the buffers' ends, so the bench hands every input over in the engine's dtypes."""
    import torch

    from andrea_export.graphs.layout import kv_layout

    backend = _fake_trt_backend(tmp_path, fp16_decoder, monkeypatch)
    engine, _ = backend._context("decode")
    past = [np.zeros((1, 4, 3, 16), np.float32) for _ in kv_layout(ANDREA_TINY).past_names]
    feeds = {"input_ids": np.ones((1, 1), np.int64), "attention_mask": np.ones((1, 4), np.int64),
             **dict(zip(kv_layout(ANDREA_TINY).past_names, past))}  # fmt: skip
    tensors = backend._inputs(engine, feeds)
    assert {tensors[n].dtype for n in kv_layout(ANDREA_TINY).past_names} == {torch.float16}
    assert tensors["input_ids"].dtype == tensors["attention_mask"].dtype == torch.int64


def test_trt_backend_refuses_an_engine_whose_decode_profile_tensorrt_refused(fp16_decoder, tmp_path, monkeypatch):
    """set_optimization_profile_async reports a refusal by returning False; timing the decode engine on whatever
    profile stayed selected would measure the wrong thing, so the refusal is an error before anything is timed."""
    from andrea_export.errors import CudaError

    backend = _fake_trt_backend(tmp_path, fp16_decoder, monkeypatch, stream_ok=False)
    with pytest.raises(CudaError, match="refused optimization profile 1 \\(decode\\)"):
        backend._context("decode")
    assert "decode" not in backend._engines
