"""The in-place KV-cache decoder (inplace_decoder.py) and ONNX Runtime's steps over it (runtime/ort.py):
its recorded layout, logits and cache contents against PyTorch for a ragged batch at every step, the
cache updated where it lies (no new buffers), the same tokens as the standard decoder in every precision
ONNX Runtime runs on a CPU, and clear errors past the buffer."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import pytest
import torch

from andrea_export import runtime
from andrea_export.errors import ExportError
from andrea_export.graphs.inplace_decoder import export_inplace_decoder
from andrea_export.graphs.layout import check_decoder_onnx, kv_layout
from andrea_export.names import KV_LAYOUT_KEY

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]  # ragged: the short row is padded


@pytest.fixture(scope="module")
def inplace(lively_model, tmp_path_factory):
    return export_inplace_decoder(lively_model, tmp_path_factory.mktemp("inplace") / "decoder.inplace.onnx", quiet=True)


@pytest.fixture(scope="module")
def session(inplace):
    return runtime.load(inplace, "onnxruntime", providers=["CPUExecutionProvider"])


def test_layout_is_recorded_and_checked(inplace, lively_model):
    layout = check_decoder_onnx(inplace)
    assert layout.shared and layout.cache == "shared"
    assert layout == dataclasses.replace(kv_layout(lively_model.cfg), cache="shared")
    m = onnx.load(str(inplace))
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in list(m.graph.input) + list(m.graph.output)}
    H, D = lively_model.cfg.n_head, lively_model.cfg.head_dim
    assert dims["past_key_values.0.key"] == dims["present.0.key"] == ["batch", H, "capacity", D]
    assert dims["attention_mask"] == ["batch", "total"]
    assert sum(n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft" for n in m.graph.node) == lively_model.cfg.n_layer
    # the standard decoder's record is unchanged by the new field (old build folders still read)
    assert "cache" not in kv_layout(lively_model.cfg).to_dict()


def test_unknown_cache_kind_is_refused(inplace, tmp_path):
    m = onnx.load(str(inplace))
    meta = {p.key: p for p in m.metadata_props}
    layout = json.loads(meta[KV_LAYOUT_KEY].value)
    layout["cache"] = "paged"
    meta[KV_LAYOUT_KEY].value = json.dumps(layout, sort_keys=True)
    onnx.save(m, tmp_path / "bad.onnx")
    with pytest.raises(ExportError, match="KV layout does not match"):
        check_decoder_onnx(tmp_path / "bad.onnx")


def _reference_step_logits(model, rows, steps):
    """PyTorch recomputing each row alone: prompt logits, then the logits of each greedy token's step."""
    out = []
    with torch.inference_mode():
        for row in rows:
            seq, logits = list(row), [model(torch.tensor([row])).numpy()[0]]
            for _ in range(steps):
                seq.append(int(logits[-1][-1].argmax()))
                logits.append(model(torch.tensor([seq])).numpy()[0][-1:])
            out.append(logits)
    return out


def test_ragged_batch_matches_pytorch_at_every_step_and_cache_is_written_in_place(lively_model, session):
    steps_n = 6
    ref = _reference_step_logits(lively_model, PROMPTS, steps_n)
    width = max(map(len, PROMPTS))
    ids = np.array([[0] * (width - len(r)) + r for r in PROMPTS], dtype=np.int64)  # as the base loop pads: left
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in PROMPTS], dtype=np.int64)
    with session._steps(width + steps_n) as steps:
        logits = steps.prefill(ids, mask)
        for b, r in enumerate(PROMPTS):  # the caller's columns: each row's tokens are its last len(r)
            np.testing.assert_allclose(logits[b, width - len(r):], ref[b][0], rtol=1e-4, atol=1e-4)
        buffers = [v.data_ptr() for v in steps.buffers]
        for t in range(steps_n):
            tokens = np.array([int(ref[b][t][-1].argmax()) for b in range(len(PROMPTS))])
            mask = np.concatenate([mask, np.ones((len(PROMPTS), 1), np.int64)], axis=1)
            logits = steps.decode(tokens, mask)
            for b in range(len(PROMPTS)):
                np.testing.assert_allclose(logits[b], ref[b][t + 1][-1], rtol=1e-4, atol=1e-4)
        assert [v.data_ptr() for v in steps.buffers] == buffers  # the same memory all along: nothing reallocated
        # the keys of layer 0 sit at each row's own positions 0 .. held-1, as PyTorch computes them
        key0 = steps.buffers[0].numpy()
        for b, r in enumerate(PROMPTS):
            seq = torch.tensor([r + [int(ref[b][t][-1].argmax()) for t in range(steps_n)]])
            with torch.inference_mode():
                _, present = lively_model.forward_with_cache(seq)
            held = len(r) + steps_n
            assert steps.held[b] == held
            np.testing.assert_allclose(key0[b, :, :held], present[0][0][0, :, :held].numpy(), rtol=1e-4, atol=1e-4)


def test_generate_equals_the_standard_decoder(session, lively_decoder, lively_prompt):
    standard = runtime.load(lively_decoder, "onnxruntime")
    prompts = [lively_prompt, lively_prompt[:2], [7, 8, 9]]
    assert session.generate(prompts, 24) == standard.generate(prompts, 24)
    kw = dict(strategy="top-p", top_p=0.9, seed=[1, 2, 3])
    assert session.generate(prompts, 16, **kw) == standard.generate(prompts, 16, **kw)
    np.testing.assert_allclose(session.forward(lively_prompt), standard.forward(lively_prompt), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_lower_precisions_decode_like_their_standard_graph(precision, inplace, lively_decoder, lively_prompt, tmp_path):
    from andrea_export.graphs.precision import convert_precision

    ours = convert_precision(inplace, tmp_path / f"decoder.{precision}.inplace.onnx", precision)
    theirs = convert_precision(lively_decoder, tmp_path / f"decoder.{precision}.onnx", precision)
    a, b = runtime.load(ours, "onnxruntime"), runtime.load(theirs, "onnxruntime")
    assert a.layout.shared and a.layout.cache_dtype == b.layout.cache_dtype
    assert a.generate([lively_prompt, [7, 8, 9]], 16) == b.generate([lively_prompt, [7, 8, 9]], 16)


def test_steps_past_the_buffer_are_refused(session):
    with session._steps(4) as steps:
        steps.prefill(np.array([[1, 2, 3, 4]]), np.ones((1, 4), np.int64))
        with pytest.raises(ValueError, match="holds 4 tokens"):
            steps.decode(np.array([5]), np.ones((1, 5), np.int64))
    with session._steps(8) as steps, pytest.raises(ValueError, match="0s then 1s"):
        steps.prefill(np.array([[1, 2, 0]]), np.array([[1, 1, 0]]))  # right padding handed in: not the contract


def test_the_in_place_graph_runs_on_the_cpu_provider_only(inplace, lively_decoder):
    """A GroupQueryAttention node falling back from CUDA to the CPU would update a copy of the buffer."""
    from andrea_export.deploy.genai import genai_config
    from andrea_export.errors import InputError

    assert runtime.load(inplace, "onnxruntime").session.get_providers() == ["CPUExecutionProvider"]
    with pytest.raises(InputError, match="CPU provider only"):
        runtime.load(inplace, "onnxruntime", providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(ExportError, match="cpu provider only"):
        genai_config(inplace, provider="cuda")
    assert genai_config(lively_decoder, provider="cuda")["search"]["past_present_share_buffer"] is False
