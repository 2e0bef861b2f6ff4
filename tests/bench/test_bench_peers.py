"""The peers inside the benchmark (what users would run instead of our graph): Optimum's own GPT-2 export
of the same weights, and onnxruntime-genai on the build folder's genai_config.json. Each computes what
ours computes on the same inputs (so the ratios compare like with like), a run reports each as a ratio
to ours per scenario, and a missing runtime is a skipped row with its reason. Tiny config; timings are
never asserted."""

from __future__ import annotations

import csv
import io
import json
import sys

import numpy as np
import pytest

from andrea_export import bench
from andrea_export.bench import report
from andrea_export.bench.work import case_inputs

TINY = bench.Settings(warmup=1, warmup_s=0.0, min_repeats=3, max_repeats=3, budget_s=0.0)


@pytest.fixture(scope="module")
def run(lively_model, tmp_path_factory):
    pytest.importorskip("optimum.onnxruntime", reason="optimum-onnx (the 'hf' extra)")
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai (the 'genai' extra)")
    out = tmp_path_factory.mktemp("peers")
    doc = bench.run_benchmark(
        model=lively_model, backends=("ort-cpu", "optimum", "genai"), quick=True, threads=2, settings=TINY,
        prefill_grid=[(2, 16)], decode_grid=[(2, 15)], generate_grid=[(2, 8, 4)],
        out=out, workdir=out / "cache", quiet=True,
    )  # fmt: skip
    return doc, out


@pytest.fixture(scope="module")
def ctx(run, lively_model):
    return bench.Context(lively_model, 2, run[1] / "cache")  # the run's cached exports


def _ready(backend, ctx, scenarios=bench.SCENARIOS):
    backend.setup(ctx)
    backend.prepare(scenarios)
    return backend


@pytest.mark.parametrize("graph", ["optimum", "ours"])
def test_optimum_computes_what_ours_does(ctx, graph):
    """Optimum's graph (its own export through transformers' GPT-2), or ours as `export --hf-folder` writes
    it, in ORTModelForCausalLM: our logits on the same prefill and decode inputs, our greedy tokens."""
    ours, peer = _ready(bench.OrtBackend(), ctx), _ready(bench.OptimumBackend(graph=graph), ctx)
    assert peer.name == {"optimum": "optimum", "ours": "optimum-hf-folder"}[graph]
    (ids,) = case_inputs(ctx.cfg, "prefill", 2, 16, 0, seed=0)
    want = ours.prefill(ids)().copy_outputs_to_cpu()[0]
    got = peer.prefill(ids)().copy_outputs_to_cpu()[0]  # logits first, then the cache Optimum returns
    assert got.shape == want.shape == (2, 16, ctx.cfg.vocab_size)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)

    ids, mask, past = case_inputs(ctx.cfg, "decode", 2, 1, 15, seed=0)
    want = ours.decode(ids, mask, past)().copy_outputs_to_cpu()
    got = peer.decode(ids, mask, past)().copy_outputs_to_cpu()
    for w, g in zip(want, got):  # logits and every present key/value, in the same order
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)

    prompt = case_inputs(ctx.cfg, "generate", 2, 8, 0, seed=0)[0]
    tokens = ours.generate(prompt, 16)()
    assert len({t for row in tokens for t in row}) > 4  # the lively model's output varies
    assert peer.generate(prompt, 16)().tolist() == tokens


def test_genai_computes_what_ours_does(ctx):
    """onnxruntime-genai on the build folder layout (decoder.inplace.onnx + the genai_config.json build
    writes): its prefill leaves our last-token logits, its greedy tokens are ours; a decode step has no call."""
    ours, peer = _ready(bench.OrtBackend(), ctx), _ready(bench.GenaiBackend(), ctx)
    config = json.loads((ctx.inplace_decoder_onnx().parent / "genai_config.json").read_text())
    assert config["model"]["decoder"]["filename"] == "decoder.inplace.onnx"  # the in-place graph, as a build's
    assert config["search"]["past_present_share_buffer"] is True  # genai's one cache buffer, written in place
    (ids,) = case_inputs(ctx.cfg, "prefill", 2, 16, 0, seed=0)
    want = ours.prefill(ids)().copy_outputs_to_cpu()[0][:, -1]
    got = np.asarray(peer.prefill(ids)().get_logits()).reshape(want.shape)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)

    prompt = case_inputs(ctx.cfg, "generate", 2, 8, 0, seed=0)[0]
    tokens = ours.generate(prompt, 16)()
    assert peer.generate(prompt, 16)().tolist() == tokens
    assert peer.generate(prompt[:1], 16)().tolist() == tokens[:1]
    with pytest.raises(bench.Unavailable, match="no call for one step"):
        peer.decode(*case_inputs(ctx.cfg, "decode", 1, 1, 5, seed=0))


def test_report_carries_each_peer_as_a_ratio_to_ours(run):
    doc, out = run
    assert {n: b["status"] for n, b in doc["backends"].items()} == {"ort-cpu": "ok", "optimum": "ok", "genai": "ok"}
    for n in ("optimum", "genai"):  # the same session threads as ours
        assert doc["backends"][n]["threads"] == doc["backends"]["ort-cpu"]["threads"] == 2
    rows = {(r["scenario"], r["backend"]): r for r in doc["rows"]}
    assert all(r["x_ours"] == 1.0 for (_, b), r in rows.items() if b == "ort-cpu")
    ran = {("prefill", "optimum"), ("decode", "optimum"), ("generate", "optimum"), ("prefill", "genai"),
           ("generate", "genai")}  # fmt: skip
    assert {(s, b) for s, b in rows if b != "ort-cpu"} == ran
    pe = doc["peers"]
    assert pe["ours"] == "ort-cpu"
    assert {(q["scenario"], q["peer"]) for q in pe["ratios"]} == ran
    for q in pe["ratios"]:
        r = rows[(q["scenario"], q["peer"])]
        assert q["time_ratio"] == r["x_ours"] > 0
        assert q["peer_ms"] == r["median_ms"] and q["ours_ms"] == rows[(q["scenario"], "ort-cpu")]["median_ms"]
    assert pe["skipped"] == [{"peer": "genai", "scenario": "decode",
                              "reason": doc["backends"]["genai"]["skipped_cases"]["decode"]}]  # fmt: skip
    table = list(csv.DictReader(io.StringIO((out / "bench.csv").read_text())))
    assert all(float(r["x_ours"]) > 0 for r in table)
    md = (out / "bench.md").read_text()
    assert "## Peers: time / ours at the same precision" in md and "`genai` not run (decode)" in md
    for q in pe["ratios"]:
        assert f"| {q['scenario']} | {report._shape(q)} | {q['peer']} |" in md
    assert (out / "peers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    goal = next(g for g in doc["goals"] if "onnxruntime-genai" in g["name"])
    assert goal["value"] == min(q["time_ratio"] for q in pe["ratios"] if q["peer"] == "genai")


def test_peers_of_a_hand_made_report():
    """report.peers on a document written by hand: a ratio per peer row that has our row of the same case
    (not for a case we did not run, nor for a non-peer backend, nor where x_ours is missing), and every peer
    that did not run, wholly or per scenario, with its reason."""
    def row(backend, scenario, ms, x, batch=2, seq=16):
        return {"backend": backend, "scenario": scenario, "batch": batch, "seq": seq, "past": 0, "new_tokens": 0,
                "median_ms": ms, "x_ours": x}

    doc = {"rows": [row("ort-cpu", "prefill", 4.0, 1.0), row("optimum", "prefill", 6.0, 1.5),
                    row("genai", "prefill", 3.0, 0.75), row("ort-cuda", "prefill", 1.0, 0.25),  # not a peer
                    row("optimum", "prefill", 9.0, 2.25, seq=32),  # no row of ours for this case
                    row("optimum", "decode", 5.0, None), row("ort-cpu", "decode", 2.0, 1.0)],  # no ratio
           "backends": {"ort-cpu": {"status": "ok"}, "optimum": {"status": "ok"},
                        "genai": {"status": "ok", "skipped_cases": {"decode": "no call for one step"}},
                        "optimum-hf-folder": {"status": "unavailable", "reason": "optimum is not installed"}}}
    case = {"batch": 2, "seq": 16, "past": 0, "new_tokens": 0}
    assert report.peers(doc) == {
        "ours": "ort-cpu",
        "ratios": [{"scenario": "prefill", **case, "peer": "optimum", "precision": "fp32", "ours": "ort-cpu",
                    "peer_ms": 6.0, "ours_ms": 4.0, "time_ratio": 1.5},
                   {"scenario": "prefill", **case, "peer": "genai", "precision": "fp32", "ours": "ort-cpu",
                    "peer_ms": 3.0, "ours_ms": 4.0, "time_ratio": 0.75}],
        "skipped": [{"peer": "genai", "scenario": "decode", "reason": "no call for one step"},
                    {"peer": "optimum-hf-folder", "scenario": "all", "reason": "unavailable: optimum is not installed"}],
    }  # fmt: skip



def test_missing_peer_runtimes_are_skipped_rows_with_the_reason(run, lively_model, monkeypatch):
    """With optimum and onnxruntime-genai not importable (None in sys.modules: Python's way to block an
    import), the run still runs ours, and each peer is a skipped row saying what to install."""
    for module in ("optimum", "optimum.onnxruntime", "onnxruntime_genai"):
        monkeypatch.setitem(sys.modules, module, None)
    doc = bench.run_benchmark(model=lively_model, backends=("ort-cpu", "optimum", "genai"), scenarios=["prefill"],
                              quick=True, threads=1, settings=TINY, prefill_grid=[(1, 8)],
                              workdir=run[1] / "cache", quiet=True, plots=False)  # fmt: skip
    assert doc["backends"]["ort-cpu"]["status"] == "ok" and [r["backend"] for r in doc["rows"]] == ["ort-cpu"]
    for peer, extra in (("optimum", "hf"), ("genai", "genai")):
        b = doc["backends"][peer]
        assert b["status"] == "skipped" and f"andrea-export[{extra}]" in b["reason"]
    assert [(s["peer"], s["scenario"]) for s in doc["peers"]["skipped"]] == [("optimum", "all"), ("genai", "all")]
    assert doc["peers"]["ratios"] == []
    md = report.to_markdown(doc)
    assert "`optimum` not run (all): skipped: 'optimum.onnxruntime' is not installed" in md


def test_peer_goals_on_synthetic_rows():
    """The issue's peer targets: Optimum's decode step >= 2x ours at batch 8 past 1023 and >= 1.5x at batch 1,
    and no peer faster than ours anywhere (value: the worst case's peer time / ours)."""
    rows = [
        {"scenario": "decode", "backend": "optimum", "batch": 8, "seq": 1, "past": 1023, "new_tokens": 1,
         "median_ms": 24.0, "x_ours": 2.4},
        {"scenario": "decode", "backend": "optimum", "batch": 1, "seq": 1, "past": 1023, "new_tokens": 1,
         "median_ms": 13.0, "x_ours": 1.3},
        {"scenario": "generate", "backend": "genai", "batch": 1, "seq": 32, "past": 0, "new_tokens": 128,
         "median_ms": 900.0, "x_ours": 0.9},
        {"scenario": "generate", "backend": "genai", "batch": 8, "seq": 32, "past": 0, "new_tokens": 128,
         "median_ms": 3000.0, "x_ours": 1.1},
    ]  # fmt: skip
    g = {x["name"]: x for x in bench.goals({"rows": rows, "ratios": [], "machine": {"matmul_GFLOPs": 100.0}})
         if "Optimum" in x["name"] or "onnxruntime-genai" in x["name"]}
    met = {name.split(":")[0].split(" (")[0]: (x["value"], x["met"]) for name, x in g.items()}
    assert met == {
        "decode step, batch 8, past 1023": (2.4, True),
        "decode step, batch 1, past 1023": (1.3, False),
        "not slower than Optimum + ONNX Runtime in any case it runs": (1.3, True),
        "not slower than onnxruntime-genai in any case it runs": (0.9, False),
    }
    assert "generate B=1" in g["not slower than onnxruntime-genai in any case it runs (the worst case's peer time / ours)"]["detail"]
