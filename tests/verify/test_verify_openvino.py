"""An fp32 build's graphs on OpenVINO as the runtime runs them on this CPU (verify/openvino.py), checked
against PyTorch: in bf16 at bf16's thresholds where the CPU has bf16 instructions, in f32 at fp32's
thresholds everywhere. The trained demo passes with a measured error (nonzero in bf16, fp32-small in f32);
a graph of other weights fails; the verdict, named by what OpenVINO computed in, reaches the report and the
manifest's record, and a CPU without bf16 gets an f32 verdict, not a skipped one."""

import copy
import json

import numpy as np
import pytest
import torch

pytest.importorskip("openvino", reason="OpenVINO (the 'openvino' extra) is not installed")

from andrea_export.runtime.openvino import cpu_has_bf16  # noqa: E402
from andrea_export.verify.openvino import openvino_checks, openvino_precision, runtime_name  # noqa: E402

needs_bf16 = pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no bf16 instructions (OpenVINO reports no BF16)")
PRECISIONS = [pytest.param("bf16", marks=needs_bf16), "f32"]


@pytest.fixture(scope="module")
def folder(lively_model, tmp_path_factory):
    from andrea_export.graphs.export import export_onnx
    from andrea_export.graphs.kvcache import export_decoder_onnx

    out = tmp_path_factory.mktemp("ov-verify")
    export_onnx(lively_model, out / "model.onnx", quiet=True)
    export_decoder_onnx(lively_model, out / "decoder.onnx", quiet=True)
    return out


@pytest.fixture(scope="module")
def evaluation(demo_dir):
    from andrea_export.model import text

    tok = text.load_tokenizer(demo_dir / "tokenizer.json")
    return text.windows(text.encode(tok, (demo_dir / "heldout.txt").read_text()), 128)[:8], {"n": 8}


ARTIFACTS = {"onnx": "model.onnx", "decoder_onnx": "decoder.onnx"}


@needs_bf16
def test_the_trained_demo_in_bf16_passes_with_a_measured_error(folder, lively_model, evaluation):
    r = openvino_checks(folder, lively_model, ARTIFACTS, shapes=[(1, 32), (2, 64)], greedy_steps=16,
                        evaluation=evaluation, inference_precision="bf16")  # fmt: skip
    assert r["passed"] and r["inference_precision"] == "bf16" and r["thresholds"] == "bf16"
    assert r["comparison"]["artifact"] == "openvino-bf16"
    worst = max(s["max_abs"] for s in r["comparison"]["shapes"])
    assert worst > 1e-4  # bf16 rounding shows: it did not compute in fp32
    ppl = r["comparison"]["perplexity"]
    assert ppl["passed"] and ppl["rel_diff"] != 0.0
    assert r["greedy"]["steps"] == 16 and "agree" in r["greedy"]
    dec = r["decoder"]  # the decoder as the runtime runs it: attention fused, the cache in the plugin
    assert dec["passed"] and dec["fused_attention"] and 1e-4 < max(p["max_abs_logits"] for p in dec["per_prompt"])


def test_the_trained_demo_in_f32_passes_at_fp32_thresholds(folder, lively_model, evaluation):
    """What a CPU without bf16 runs: OpenVINO in f32, its fused attention's cache in f32 too, held to fp32's
    bounds (1e-4 on the logits, top-1 0.999, KL 1e-6, perplexity 1e-4 relative)."""
    r = openvino_checks(folder, lively_model, ARTIFACTS, shapes=[(1, 32), (2, 64)], greedy_steps=16,
                        evaluation=evaluation, inference_precision="f32")  # fmt: skip
    assert r["passed"] and r["inference_precision"] == "f32" and r["thresholds"] == "fp32"
    assert r["comparison"]["artifact"] == "openvino-f32"
    assert max(s["max_abs"] for s in r["comparison"]["shapes"]) < 1e-4
    assert abs(r["comparison"]["perplexity"]["rel_diff"]) < 1e-4
    dec = r["decoder"]
    assert dec["passed"] and dec["fused_attention"] and dec["kv_cache_precision"] == "f32"
    assert max(p["max_abs_logits"] for p in dec["per_prompt"]) < 1e-4 and dec["tolerances"]["atol"] == 1e-4
    assert r["greedy"]["agree"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_graph_of_other_weights_fails(folder, lively_model, evaluation, precision):
    other = copy.deepcopy(lively_model)
    with torch.no_grad():
        other.ln_f.weight.mul_(1.25)  # the graph holds the demo's weights; the reference now differs
    r = openvino_checks(folder, other, ARTIFACTS, shapes=[(1, 32)], greedy_steps=0, evaluation=evaluation,
                        inference_precision=precision)  # fmt: skip
    assert not r["passed"] and not r["comparison"]["perplexity"]["passed"] and not r["decoder"]["passed"]
    assert "greedy" not in r


def test_a_build_records_the_openvino_verdict_in_what_it_computed(tiny_build):
    out, _ = tiny_build
    name = runtime_name(openvino_precision())
    report = json.loads((out / "verify.json").read_text())
    ov = report["runtimes"][name]
    assert ov["passed"] and ov["graph"] == "model.onnx" and np.isfinite(ov["comparison"]["shapes"][0]["max_kl"])
    assert ov["inference_precision"] == openvino_precision()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["verification"]["runtimes"] == {name: True}
    assert all(s["artifact"] in ("engine", "decoder_engine") for s in manifest["verification"]["skipped"])


def test_a_cpu_without_bf16_verifies_openvino_in_f32_not_unverified(tiny_build, tmp_path, monkeypatch):
    """On a CPU without bf16 instructions OpenVINO computes in f32: the build's verification runs the OpenVINO
    path there in f32 at fp32's thresholds and says so; only the engines are 'not run here'. (Here OpenVINO
    is told the CPU has no bf16, so it computes in f32 as it would on such a CPU.)"""
    import shutil

    from click.testing import CliRunner

    from andrea_export import runtime
    from andrea_export.cli import main
    from andrea_export.runtime import openvino as rov

    monkeypatch.setattr(rov, "cpu_has_bf16", lambda: False)
    assert openvino_precision() == "f32"
    out = tmp_path / "build"
    shutil.copytree(tiny_build[0], out)
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 0, result.output
    assert "openvino-f32" in result.output and "openvino-bf16" not in result.output
    skipped = [line for line in result.output.splitlines() if "not run here" in line]
    assert skipped and all("openvino" not in line for line in skipped), skipped
    with runtime.load(out, backend="openvino") as sess:  # the runtime's default session there: f32 throughout
        assert sess.inference_precision == "f32" and sess.kv_cache_precision == "f32"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_decoder_check_fails_a_fusion_that_drops_the_causal_mask(folder, lively_model, monkeypatch, precision):
    import openvino.opset13 as ops

    from andrea_export import runtime
    from andrea_export.runtime import openvino as rov
    from andrea_export.verify.openvino import THRESHOLDS, decoder_steps_check

    prompts, thresholds = [[5, 9, 11, 2, 7, 3, 8, 1], [4, 4, 6]], THRESHOLDS[precision]
    with runtime.load(folder / "decoder.onnx", backend="openvino", inference_precision=precision) as sess:
        good = decoder_steps_check(lively_model, sess, prompts, thresholds=thresholds)
    assert good["passed"] and good["fused_attention"] and good["kv_cache_precision"] is not None
    found = rov._attention

    def unmasked(*args):  # every key allowed (allowed or not allowed): a prompt's tokens see the ones after them
        match = found(*args)
        if match is None:
            return None
        allowed = match[3]
        return (*match[:3], ops.logical_or(allowed, ops.logical_not(allowed)).output(0), *match[4:])

    monkeypatch.setattr(rov, "_attention", unmasked)
    with runtime.load(folder / "decoder.onnx", backend="openvino", inference_precision=precision) as sess:
        bad = decoder_steps_check(lively_model, sess, prompts, thresholds=thresholds)
    assert bad["fused_attention"] and not bad["passed"]
    assert max(p["max_abs_logits"] for p in bad["per_prompt"]) > 10 * max(p["max_abs_logits"] for p in good["per_prompt"])
