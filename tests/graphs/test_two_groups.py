"""The two-group in-place decoder (two_groups.py) through the slot cache that runs it (runtime/ort.py): each
group's logits and cache writes equal the one-group graph's bit for bit, in fp32 and int4 (MatMulNBits);
each weight matmul is one node for both groups; groups that would overwrite each other are refused."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from andrea_export import runtime
from andrea_export.graphs.inplace_decoder import export_inplace_decoder
from andrea_export.graphs.quantize import quantize_weights
from andrea_export.graphs.two_groups import PREFIX, two_group_decoder


@pytest.fixture(scope="module", params=["fp32", "int4"])
def inplace(request, lively_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("two-groups")
    path = export_inplace_decoder(lively_model, folder / "decoder.inplace.onnx", quiet=True)
    if request.param == "int4":
        path = quantize_weights(path, folder / "decoder.int4.inplace.onnx", "int4")
    return path


def _same(inplace, got, want):
    """fp32: bit for bit. MatMulNBits sums its int8 products in an order that follows the run's row count
    (one row alone and several differ by a few ulps already in the one-group graph), so int4 to rounding."""
    if "int4" in inplace.name:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert np.array_equal(got, want)


def _weight_matmuls(model: onnx.ModelProto) -> int:
    inits = {t.name for t in model.graph.initializer}
    return sum(n.op_type in ("MatMul", "MatMulNBits") and (n.input[1] in inits or n.op_type == "MatMulNBits")
               for n in model.graph.node)


def test_each_weight_matmul_serves_both_groups(inplace):
    one = onnx.load(str(inplace))
    two = ir.to_proto(two_group_decoder(ir.load(inplace)))
    onnx.checker.check_model(two)
    gqa = lambda m: sum(n.op_type == "GroupQueryAttention" for n in m.graph.node)  # noqa: E731
    assert gqa(two) == 2 * gqa(one)  # attention per group
    assert _weight_matmuls(two) == _weight_matmuls(one) > 0  # every weight matmul once, for both
    names = [v.name for v in one.graph.input] + [v.name for v in one.graph.output]
    got = {v.name for v in two.graph.input} | {v.name for v in two.graph.output}
    assert got == set(names) | {PREFIX + n for n in names}
    assert len({t.name for t in two.graph.initializer}) == len(one.graph.initializer)  # no weight copied


def _one_group(session, past: list[np.ndarray], ids: np.ndarray, held: np.ndarray):
    """The one-group graph on `past` (each [rows, H, capacity, D]): logits and the updated caches."""
    L = session.layout
    mask = (np.arange(held.max())[None, :] < held[:, None]).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask, **dict(zip(L.past_names, past))}
    logits, *present = session.session.run(None, feeds)
    return logits, present


def test_two_groups_in_one_run_compute_what_each_computes_alone(inplace):
    """Three slots decode one token while a fourth prefills a chunk of 5, in one run: the logits and every
    cache byte equal two runs of the one-group graph (the decoding rows hold different lengths, and the
    chunk's slot lies among them with its pad past its prompt, as the batcher places it)."""
    session = runtime.load(inplace, "onnxruntime")
    cache = session.slot_cache(4)
    L, rng = session.layout, np.random.default_rng(0)
    for b in cache.buffers:
        b[:] = rng.standard_normal(b.shape).astype(b.dtype)  # a filled cache: what rows hold matters
    before = [b.copy() for b in cache.buffers]
    held = np.array([9, 4, L.n_positions, 17])  # slot 2 is the chunk's: its pad goes to the last position
    ids = rng.integers(0, L.vocab_size, (4, 1))
    chunk_ids = rng.integers(0, L.vocab_size, (1, 5))
    logits, chunk_logits = cache.run((0, ids, held), (2, chunk_ids, np.array([12])))

    alone, present = _one_group(session, [b[:4] for b in before], ids, held)
    keep = [0, 1, 3]
    _same(inplace, logits[keep], alone[keep])
    chunk_alone, chunk_present = _one_group(session, [b[2:3] for b in before], chunk_ids, np.array([12]))
    _same(inplace, chunk_logits, chunk_alone)
    for got, old, p, q in zip(cache.buffers, before, present, chunk_present):  # a present: each row's tokens only
        for row in keep:
            _same(inplace, got[row, :, :held[row]], p[row, :, :held[row]])
            assert np.array_equal(got[row, :, held[row]:], old[row, :, held[row]:])  # nothing written past them
        _same(inplace, got[2, :, :12], q[0, :, :12])  # the chunk's slot


def test_a_lone_group_runs_on_the_one_group_graph(inplace):
    session = runtime.load(inplace, "onnxruntime")
    cache = session.slot_cache(2)
    ids = np.array([[3, 4, 5]])
    logits, none = cache.run((1, ids, np.array([3])))
    assert none is None
    L = session.layout
    empty = [np.zeros((1, L.n_head, L.n_positions, L.head_dim), np.float32) for _ in L.past_names]
    _same(inplace, logits, _one_group(session, empty, ids, np.array([3]))[0])


def test_groups_that_would_overwrite_each_other_are_refused(inplace):
    session = runtime.load(inplace, "onnxruntime")
    cache = session.slot_cache(3)
    decode = (0, np.ones((3, 1), np.int64), np.array([5, 6, 7]))
    with pytest.raises(ValueError, match="slot 1 is written by both groups"):
        cache.run(decode, (1, np.ones((1, 4), np.int64), np.array([6])))  # slot 1's pad at 5: inside the chunk
    with pytest.raises(ValueError, match="rows 2..3 of 3 slots"):
        cache.run((2, np.ones((2, 1), np.int64), np.array([3, 3])))  # past the last slot
