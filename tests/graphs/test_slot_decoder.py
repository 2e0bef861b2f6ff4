"""The slot decoder (slot_decoder.py): the in-place decoder in standard opset-24 ops, shaped by TensorRT's rules
(a static cache updated by TensorScatter, each present straight from it; Attention with 4-D inputs and an
explicit bool mask, none of the attributes or inputs TensorRT ignores or refuses), and run by ONNX Runtime
through the same steps as the GroupQueryAttention graph: PyTorch's logits and keys at every step of a ragged
batch, the cache updated where it lies, and a mask that never lets a row read past what it holds."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from andrea_export import runtime
from andrea_export.graphs.layout import check_decoder_onnx, kv_layout
from andrea_export.graphs.slot_decoder import WRITE_AXIS, export_slot_decoder, slot_layout

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]  # ragged: the short row is padded


@pytest.fixture(scope="module")
def slots(lively_model, tmp_path_factory):
    return export_slot_decoder(lively_model, tmp_path_factory.mktemp("slots") / "decoder.slots.onnx", quiet=True)


@pytest.fixture(scope="module")
def session(slots):
    return runtime.load(slots, "onnxruntime")


def test_layout_is_static_and_recorded(slots, lively_model):
    cfg = lively_model.cfg
    layout = check_decoder_onnx(slots)
    assert layout == slot_layout(kv_layout(cfg)) and layout.shared and layout.static
    m = onnx.load(str(slots))
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(m.graph.input) + list(m.graph.output)}
    assert dims["past_key_values.0.key"] == dims["present.0.key"] == ["batch", cfg.n_head, cfg.n_positions, cfg.head_dim]
    assert {o.domain for o in m.opset_import} == {""} and m.opset_import[0].version == 24  # standard ops only


def test_every_present_comes_straight_from_a_tensor_scatter_of_its_past(slots, lively_model):
    """TensorRT's KV-cache update needs the cache a network input and its output a network output, with nothing
    in between (a Cast or a copy would make it a different tensor, and the update would not be in place)."""
    m = onnx.load(str(slots))
    producer = {o: n for n in m.graph.node for o in n.output}
    layout = slot_layout(kv_layout(lively_model.cfg))
    scatters = [n for n in m.graph.node if n.op_type == "TensorScatter"]
    assert len(scatters) == 2 * lively_model.cfg.n_layer
    for past, present in zip(layout.past_names, layout.present_names):
        node = producer[present]
        assert node.op_type == "TensorScatter" and node.input[0] == past
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"axis": WRITE_AXIS}  # mode stays linear: TensorRT refuses circular


def test_attention_uses_only_what_tensorrt_maps(slots, lively_model):
    """Three inputs and a mask, one output, only `scale`: TensorRT's parser ignores nonpad_kv_seqlen, refuses
    past_*/present_* and softmax_precision, and reads is_causal as upper-left (ONNX: lower-right)."""
    m = onnx.load(str(slots))
    attention = [n for n in m.graph.node if n.op_type == "Attention"]
    assert len(attention) == lively_model.cfg.n_layer
    inferred = onnx.shape_inference.infer_shapes(m)
    types = {v.name: v.type.tensor_type for v in [*inferred.graph.value_info, *inferred.graph.output]}
    for node in attention:
        assert len(node.input) == 4 and len(node.output) == 1
        assert [a.name for a in node.attribute] == ["scale"]
        q, k, v, mask = (types[name] for name in node.input)
        assert all(len(t.shape.dim) == 4 for t in (q, k, v, mask))
        assert mask.elem_type == onnx.TensorProto.BOOL


def test_ragged_batch_matches_pytorch_at_every_step_in_place(lively_model, session):
    steps_n = 5
    width = max(map(len, PROMPTS))
    ids = np.array([[0] * (width - len(r)) + r for r in PROMPTS], dtype=np.int64)
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in PROMPTS], dtype=np.int64)
    seqs = [list(r) for r in PROMPTS]
    with session._steps(8) as steps, torch.inference_mode():
        assert steps.capacity == lively_model.cfg.n_positions  # the graph's static length, whatever was asked
        logits = steps.prefill(ids, mask)
        buffers = [v.data_ptr() for v in steps.buffers]
        for t in range(steps_n + 1):
            for b, seq in enumerate(seqs):
                want = lively_model(torch.tensor([seq])).numpy()[0]
                got = logits[b, width - len(seq):] if t == 0 else logits[b][None]
                np.testing.assert_allclose(got, want[-len(got):], rtol=1e-4, atol=1e-4)
            if t == steps_n:
                break
            tokens = (logits[:, -1] if t == 0 else logits).argmax(-1)
            for seq, token in zip(seqs, tokens):
                seq.append(int(token))
            mask = np.concatenate([mask, np.ones((len(seqs), 1), np.int64)], axis=1)
            logits = steps.decode(tokens, mask)
        assert [v.data_ptr() for v in steps.buffers] == buffers  # the same memory all along
        values = steps.buffers[1].numpy()  # layer 0's values at each row's own positions 0 .. held-1
        for b, seq in enumerate(seqs):
            _, present = lively_model.forward_with_cache(torch.tensor([seq]))
            np.testing.assert_allclose(values[b, :, :len(seq)], present[0][1][0].numpy(), rtol=1e-4, atol=1e-4)


def test_positions_past_what_a_row_holds_are_never_read(lively_model, session, lively_prompt):
    """The mask keeps each new token to positions <= its own: keys and values beyond them (another request's
    leftovers in a reused slot) change nothing. Finite leftovers only: a NaN under the mask gives 0 * NaN."""
    prompt = lively_prompt[:6]
    with session._steps() as steps:
        clean = steps.prefill(np.array([prompt]), np.ones((1, len(prompt)), np.int64))
        clean_next = steps.decode(np.array([7]), np.ones((1, len(prompt) + 1), np.int64))
    with session._steps() as steps:
        steps.prefill(np.array([prompt]), np.ones((1, len(prompt)), np.int64))
        for buffer in steps.buffers:  # leftovers everywhere past the prompt's positions
            data = buffer.numpy()
            data[:, :, len(prompt):] = 1e4
            buffer.update_inplace(data)
        steps.held = np.array([len(prompt)])
        dirty_next = steps.decode(np.array([7]), np.ones((1, len(prompt) + 1), np.int64))
    np.testing.assert_array_equal(dirty_next, clean_next)
    assert np.isfinite(clean).all()


def test_generate_and_lower_precisions_equal_the_in_place_graph(slots, lively_model, lively_prompt, tmp_path):
    from andrea_export.graphs.inplace_decoder import export_inplace_decoder
    from andrea_export.graphs.precision import convert_precision

    inplace = export_inplace_decoder(lively_model, tmp_path / "decoder.inplace.onnx", quiet=True)
    prompts = [lively_prompt, lively_prompt[:2], [7, 8, 9]]
    ours, theirs = runtime.load(slots, "onnxruntime"), runtime.load(inplace, "onnxruntime")
    assert ours.generate(prompts, 24) == theirs.generate(prompts, 24)
    for precision in ("fp16", "int4"):
        a = runtime.load(convert_precision(slots, tmp_path / f"decoder.{precision}.slots.onnx", precision), "onnxruntime")
        b = runtime.load(convert_precision(inplace, tmp_path / f"decoder.{precision}.inplace.onnx", precision), "onnxruntime")
        assert a.layout.static and a.layout.cache_dtype == b.layout.cache_dtype
        assert a.generate(prompts, 16) == b.generate(prompts, 16), precision


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_each_form_the_build_writes_passes_step_by_step_verification(slots, lively_model, tmp_path, precision):
    """bf16 (no ONNX Runtime CPU kernels: its float32 twin, rounded as bf16, through the runtime's steps) and the
    int8 Q/DQ form TensorRT imports (computed without ONNX Runtime's activation quantization), as a build writes
    and verifies them (pipeline._export_slot_decoder)."""
    from andrea_export.graphs.precision import convert_precision
    from andrea_export.graphs.quantize import write_qdq
    from andrea_export.verify.agreement import verify_decoder
    from andrea_export.verify.thresholds import TOLERANCES

    convert = write_qdq if precision == "int8" else convert_precision
    graph = convert(slots, tmp_path / f"decoder.{precision}.slots.onnx", precision)
    report = verify_decoder(lively_model, graph, PROMPTS, steps=8, **TOLERANCES[precision])
    assert report["passed"], report["per_step"]
    assert all(0 < s["max_abs_logits"] for s in report["per_step"])  # not the fp32 graph under another name
