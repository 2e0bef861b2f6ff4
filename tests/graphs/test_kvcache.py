"""The KV-cache decoder graph: I/O layout as recorded, ORT runs with empty and short pasts, Polygraphy
agreement with PyTorch at every step (left-padded batch included), the engine profiles as data, and a
real TensorRT-RTX ahead-of-time build of the graph with both profiles (CPU, no GPU needed)."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from andrea_export.config import ANDREA_120M, ANDREA_TINY
from andrea_export.engine.backends import network_flags
from andrea_export.errors import ExportError, installed
from andrea_export.graphs.kvcache import export_decoder_onnx, optimization_profiles
from andrea_export.graphs.layout import KVLayout, check_decoder_onnx, kv_layout, read_config, read_kv_layout
from andrea_export.names import CONFIG_KEY, KV_LAYOUT_KEY
from andrea_export.verify.agreement import verify_decoder


@pytest.fixture(scope="module")
def model(lively_model):
    return lively_model


@pytest.fixture(scope="module")
def decoder(lively_decoder):
    return lively_decoder


def _dims(v):
    return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]


def test_graph_io_is_the_recorded_layout(decoder):
    m = onnx.load(str(decoder))
    io = {v.name: _dims(v) for v in list(m.graph.input) + list(m.graph.output)}
    assert [v.name for v in m.graph.input] == [
        "input_ids", "attention_mask",
        "past_key_values.0.key", "past_key_values.0.value", "past_key_values.1.key", "past_key_values.1.value",
    ]
    assert [v.name for v in m.graph.output] == [
        "logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value",
    ]
    assert io["input_ids"] == ["batch", "new_tokens"]
    assert io["attention_mask"] == ["batch", "past_len + new_tokens"]
    assert io["past_key_values.1.value"] == ["batch", 4, "past_len", 16]
    assert io["logits"] == ["batch", "new_tokens", 8449]
    assert io["present.0.key"] == ["batch", 4, "past_len + new_tokens", 16]
    # no exporter-invented axis names (s53, ...) anywhere in the graph
    invented = [v.name for v in m.graph.value_info if any(re.fullmatch(r"s\d+", str(d)) for d in _dims(v))]
    assert invented == []
    meta = {p.key: p.value for p in m.metadata_props}
    assert json.loads(meta[KV_LAYOUT_KEY]) == kv_layout(ANDREA_TINY).to_dict()
    assert read_config(decoder) == ANDREA_TINY and CONFIG_KEY in meta
    assert check_decoder_onnx(decoder) == read_kv_layout(decoder) == kv_layout(ANDREA_TINY)
    # the tied embedding stays one initializer; names match the standard export's
    big = [i.name for i in m.graph.initializer if 8449 in i.dims]
    assert big == ["wte.weight"]
    assert {n.op_type for n in m.graph.node} >= {"Gelu", "CumSum"}  # positions derived from the mask


def test_layout_as_data():
    layout = kv_layout(ANDREA_120M)
    d = layout.to_dict()
    assert d["feedback"]["present.11.value"] == "past_key_values.11.value"
    assert d["inputs"][2] == {"name": "past_key_values.0.key", "dtype": "float32", "shape": ["batch", 12, "past_len", 64]}
    assert len(d["inputs"]) == 2 + 24 and len(d["outputs"]) == 1 + 24
    assert KVLayout.from_dict(json.loads(json.dumps(d))) == layout
    with pytest.raises(ExportError) as e:
        KVLayout.from_dict({**d, "version": 7}, source="x.onnx metadata")
    assert str(e.value) == "x.onnx metadata: unsupported KV layout version 7 (this toolkit reads 1)"
    with pytest.raises(ExportError) as e:
        KVLayout.from_dict({**d, "n_head": 6}, source="x.onnx metadata")
    assert str(e.value) == "x.onnx metadata: KV layout does not match the one this toolkit writes for its sizes"


@pytest.mark.parametrize("past_len, new_tokens", [(0, 1), (0, 5), (1, 1), (1, 3), (2, 1), (9, 1), (4, 4)])
def test_onnxruntime_matches_pytorch_for_any_past(model, decoder, past_len, new_tokens):
    """Traced with past 4 / new 3 / batch 2; runs with an empty past, a past of 1, one token, batch 1."""
    layout = kv_layout(ANDREA_TINY)
    rng = np.random.default_rng(past_len * 10 + new_tokens)
    ids = rng.integers(0, 8449, size=(1, past_len + new_tokens))
    with torch.inference_mode():
        _, past = model.forward_with_cache(torch.from_numpy(ids[:, :past_len])) if past_len else (None, None)
        want, present = model.forward_with_cache(torch.from_numpy(ids[:, past_len:]), past)
    empty = np.zeros((1, 4, 0, 16), np.float32)
    feed = {"input_ids": ids[:, past_len:], "attention_mask": np.ones((1, past_len + new_tokens), np.int64)}
    for i, name in enumerate(layout.past_names):
        feed[name] = past[i // 2][i % 2].numpy() if past_len else empty
    out = ort.InferenceSession(str(decoder), providers=["CPUExecutionProvider"]).run(None, feed)
    assert out[0].shape == (1, new_tokens, 8449)
    np.testing.assert_allclose(out[0], want.numpy(), rtol=1e-4, atol=1e-4)
    for got, ref in zip(out[1:], (t for kv in present for t in kv)):
        assert got.shape == (1, 4, past_len + new_tokens, 16)
        np.testing.assert_allclose(got, ref.numpy(), rtol=1e-4, atol=1e-4)


def test_polygraphy_every_step_with_left_padding(model, decoder):
    report = verify_decoder(model, decoder, [[5, 6, 7, 8, 9, 10, 11], [300, 200, 100]], steps=5)
    assert report["passed"], report
    assert [s["past_len"] for s in report["per_step"]] == [0, 7, 8, 9, 10, 11]
    assert [s["new_tokens"] for s in report["per_step"]] == [7, 1, 1, 1, 1, 1]
    assert all(s["passed"] and s["max_abs_logits"] < 1e-4 for s in report["per_step"])


def test_left_padded_row_equals_unpadded(decoder):
    sess = ort.InferenceSession(str(decoder), providers=["CPUExecutionProvider"])
    empty = {n: np.zeros((2, 4, 0, 16), np.float32) for n in kv_layout(ANDREA_TINY).past_names}
    ids = np.array([[0, 0, 0, 300, 200, 100], [1, 2, 3, 4, 5, 6]], np.int64)
    mask = np.array([[0, 0, 0, 1, 1, 1], [1] * 6], np.int64)
    batched = sess.run(["logits"], {"input_ids": ids, "attention_mask": mask, **empty})[0]
    alone = sess.run(["logits"], {"input_ids": ids[:1, 3:], "attention_mask": mask[:1, 3:],
                                  **{n: v[:1] for n, v in empty.items()}})[0]
    assert np.isfinite(batched).all()
    np.testing.assert_allclose(batched[0, 3:], alone[0], rtol=1e-4, atol=1e-4)


def test_standard_graph_is_not_a_decoder(tiny_onnx):
    with pytest.raises(ExportError) as e:
        read_kv_layout(tiny_onnx)
    assert str(e.value) == (
        f"{tiny_onnx}: has no 'andrea.kv_layout' metadata: not a KV-cache decoder graph "
        "(export one with andrea_export.graphs.kvcache.export_decoder_onnx)"
    )


def test_export_refuses_old_opset(model, tmp_path):
    with pytest.raises(ExportError) as e:
        export_decoder_onnx(model, tmp_path / "d.onnx", opset=18, quiet=True)
    assert str(e.value) == "opset 18 is too old: tanh-GELU is one ONNX Gelu node only from opset 20"
    assert list(tmp_path.iterdir()) == []


def test_optimization_profiles_as_data():
    prefill, decode = optimization_profiles(ANDREA_120M, max_batch=4, opt_batch=2)
    assert prefill["name"] == "prefill" and decode["name"] == "decode"
    assert prefill["shapes"]["input_ids"] == {"min": [1, 1], "opt": [2, 256], "max": [4, 1024]}
    assert prefill["shapes"]["attention_mask"] == {"min": [1, 1], "opt": [2, 256], "max": [4, 1024]}
    assert prefill["shapes"]["past_key_values.3.key"] == {"min": [1, 12, 0, 64], "opt": [2, 12, 0, 64], "max": [4, 12, 0, 64]}
    assert decode["shapes"]["input_ids"] == {"min": [1, 1], "opt": [2, 1], "max": [4, 1]}
    assert decode["shapes"]["attention_mask"] == {"min": [1, 2], "opt": [2, 513], "max": [4, 1024]}
    assert decode["shapes"]["past_key_values.11.value"] == {"min": [1, 12, 1, 64], "opt": [2, 12, 512, 64], "max": [4, 12, 1023, 64]}
    names = [t.name for t in kv_layout(ANDREA_120M).inputs]
    assert list(prefill["shapes"]) == list(decode["shapes"]) == names


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_batch": 1, "opt_batch": 2}, "optimization profiles: need 1 <= opt_batch (2) <= max_batch (1)"),
        ({"prefill_opt_tokens": 0}, "optimization profiles: prefill_opt_tokens 0 must be in 1..128 (n_positions)"),
        ({"decode_opt_past": 128}, "optimization profiles: decode_opt_past 128 must be in 1..127 (n_positions - 1)"),
    ],
)
def test_optimization_profiles_refuse(kwargs, message):
    with pytest.raises(ExportError) as e:
        optimization_profiles(ANDREA_TINY, **kwargs)
    assert str(e.value) == message


HAVE_RTX = installed("tensorrt_rtx")


@pytest.mark.skipif(not HAVE_RTX, reason="TensorRT-RTX not installed: pip install 'andrea-export[rtx]'")
def test_tensorrt_rtx_builds_the_decoder_with_both_profiles(decoder):
    """An ahead-of-time build on the CPU: the parser takes the graph, and the profiles (prefill with an
    empty past, decode with a long one) are accepted. Running the engine needs an RTX GPU."""
    import tensorrt_rtx as trt

    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(decoder)), [parser.get_error(i).desc() for i in range(parser.num_errors)]
    config = builder.create_builder_config()
    for prof in optimization_profiles(ANDREA_TINY):
        p = builder.create_optimization_profile()
        for name, s in prof["shapes"].items():
            p.set_shape(name, s["min"], s["opt"], s["max"])
        assert config.add_optimization_profile(p) >= 0
    assert config.num_optimization_profiles == 2
    plan = builder.build_serialized_network(network, config)
    assert plan is not None and plan.nbytes > 0
