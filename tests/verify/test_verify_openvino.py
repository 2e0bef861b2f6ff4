"""An fp32 build's graphs on OpenVINO in bf16 (verify/openvino.py), checked against PyTorch at bf16's
thresholds: the trained demo passes with a measured, nonzero bf16 error and perplexity shift; a graph of
other weights fails; the verdict reaches the report and the manifest's record."""

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("openvino", reason="OpenVINO (the 'openvino' extra) is not installed")

from andrea_export.verify.openvino import NAME, openvino_blocker, openvino_checks  # noqa: E402

pytestmark = pytest.mark.skipif(openvino_blocker() is not None, reason=str(openvino_blocker()))


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


def test_the_trained_demo_in_bf16_passes_with_a_measured_error(folder, lively_model, evaluation):
    r = openvino_checks(folder, lively_model, ARTIFACTS, shapes=[(1, 32), (2, 64)], greedy_steps=16,
                        evaluation=evaluation)  # fmt: skip
    assert r["passed"] and r["inference_precision"] == "bf16" and r["comparison"]["artifact"] == NAME
    worst = max(s["max_abs"] for s in r["comparison"]["shapes"])
    assert worst > 1e-4  # bf16 rounding shows: it did not compute in fp32
    ppl = r["comparison"]["perplexity"]
    assert ppl["passed"] and ppl["rel_diff"] != 0.0
    assert r["greedy"]["steps"] == 16 and "agree" in r["greedy"]
    dec = r["decoder"]  # the decoder as the runtime runs it: attention fused, the cache in the plugin
    assert dec["passed"] and dec["fused_attention"] and 1e-4 < max(p["max_abs_logits"] for p in dec["per_prompt"])


def test_a_graph_of_other_weights_fails(folder, lively_model, evaluation):
    other = copy.deepcopy(lively_model)
    with torch.no_grad():
        other.ln_f.weight.mul_(1.25)  # the graph holds the demo's weights; the reference now differs
    r = openvino_checks(folder, other, ARTIFACTS, shapes=[(1, 32)], greedy_steps=0, evaluation=evaluation)
    assert not r["passed"] and not r["comparison"]["perplexity"]["passed"] and not r["decoder"]["passed"]
    assert "greedy" not in r


def test_a_build_records_the_openvino_verdict(tiny_build):
    import json

    out, _ = tiny_build
    report = json.loads((out / "verify.json").read_text())
    ov = report["runtimes"][NAME]
    assert ov["passed"] and ov["graph"] == "model.onnx" and np.isfinite(ov["comparison"]["shapes"][0]["max_kl"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["verification"]["runtimes"] == {NAME: True}


def test_the_decoder_check_fails_a_fusion_that_drops_the_causal_mask(folder, lively_model, monkeypatch):
    import openvino.opset13 as ops

    from andrea_export import runtime
    from andrea_export.runtime import openvino as rov
    from andrea_export.verify.openvino import decoder_steps_check

    prompts = [[5, 9, 11, 2, 7, 3, 8, 1], [4, 4, 6]]
    with runtime.load(folder / "decoder.onnx", backend="openvino", inference_precision="bf16") as sess:
        good = decoder_steps_check(lively_model, sess, prompts)
    assert good["passed"] and good["fused_attention"] and good["kv_cache_precision"] is not None
    found = rov._attention

    def unmasked(*args):  # every key allowed (allowed or not allowed): a prompt's tokens see the ones after them
        match = found(*args)
        if match is None:
            return None
        allowed = match[3]
        return (*match[:3], ops.logical_or(allowed, ops.logical_not(allowed)).output(0), *match[4:])

    monkeypatch.setattr(rov, "_attention", unmasked)
    with runtime.load(folder / "decoder.onnx", backend="openvino", inference_precision="bf16") as sess:
        bad = decoder_steps_check(lively_model, sess, prompts)
    assert bad["fused_attention"] and not bad["passed"]
    assert max(p["max_abs_logits"] for p in bad["per_prompt"]) > 10 * max(p["max_abs_logits"] for p in good["per_prompt"])
