"""The TensorRT stand-in (fake_cuda.py) on a slot decoder engine (graphs/slot_decoder.py): it holds a runtime to
TensorRT 10.15's KV-cache-update contracts, and each refusal is seen to fire: a present bound elsewhere than its
past, a write past the cache's end (TensorRT drops it silently), an `is_causal` attention over unequal lengths,
a plan of what TensorRT would not build. Bound in place, its step is ONNX Runtime's slot cache's, bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fake_cuda import FakeCudart, cudaError_t, fake_tensorrt, write_plan

from andrea_export import runtime
from andrea_export.config import ANDREA_TINY
from andrea_export.graphs.kvcache import optimization_profiles
from andrea_export.graphs.layout import check_decoder_onnx, kv_layout
from andrea_export.graphs.slot_decoder import export_slot_decoder, slot_profiles

VERSION = "10.15.1"
SLOTS, CHUNK = 4, 16


@pytest.fixture(scope="module")
def slot_graph(lively_model, tmp_path_factory):
    return export_slot_decoder(lively_model, tmp_path_factory.mktemp("slots") / "decoder.slots.onnx", quiet=True)


def _engine(graph, tmp_path, version: str = VERSION):
    rt = FakeCudart()
    trt = fake_tensorrt(rt, version=version)
    layout = check_decoder_onnx(graph)
    plan = write_plan(tmp_path / "slots.plan", graph, slot_profiles(layout, SLOTS, CHUNK, two_groups=False),
                      trt_version=version)
    logger = trt.Logger(trt.Logger.INTERNAL_ERROR)
    return rt, layout, trt.Runtime(logger).deserialize_cuda_engine(plan.read_bytes()), logger


class Step:
    """One enqueue of the engine on device buffers: the cache [SLOTS, H, C, D] per past, allocated once."""

    def __init__(self, rt, layout, engine):
        self.rt, self.layout, self.engine = rt, layout, engine
        self.shape = (SLOTS, layout.n_head, layout.n_positions, layout.head_dim)
        self.cache = {n: self._alloc(np.zeros(self.shape, np.float32)) for n in layout.past_names}
        _, self.stream = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
        self.ctx = engine.create_execution_context()
        assert self.ctx.set_optimization_profile_async(1, self.stream)  # the chunk profile: one row, 1..CHUNK tokens

    def _alloc(self, array: np.ndarray) -> int:
        _, ptr = self.rt.cudaMalloc(max(array.nbytes, 1))
        self.rt.device_bytes(ptr, array.nbytes)[...] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        return ptr

    def read(self, ptr: int, shape, dtype=np.float32) -> np.ndarray:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.rt.device_bytes(ptr, n).view(dtype).reshape(shape).copy()

    def run(self, ids: np.ndarray, held: int, bind=None) -> bool:
        """Slot 0's step: `ids` [1, T], holding `held` tokens after it; `bind`: {name: address} overrides."""
        L = self.layout
        mask = (np.arange(held)[None, :] < held).astype(np.int64)
        self.logits = self._alloc(np.zeros((1, ids.shape[1], L.vocab_size), np.float32))
        addresses = {"input_ids": self._alloc(ids.astype(np.int64)), "attention_mask": self._alloc(mask),
                     "logits": self.logits}
        for past, present in zip(L.past_names, L.present_names):
            addresses[past] = addresses[present] = self.cache[past]
        addresses.update(bind or {})
        row = (1, *self.shape[1:])
        shapes = {"input_ids": ids.shape, "attention_mask": mask.shape, **{n: row for n in L.past_names}}
        assert all(self.ctx.set_input_shape(n, s) for n, s in shapes.items())
        assert all(self.ctx.set_tensor_address(n, a) for n, a in addresses.items())
        return self.ctx.execute_async_v3(self.stream)


def test_each_present_is_reported_as_its_past_and_only_from_tensorrt_10_15(slot_graph, lively_decoder, tmp_path):
    _, layout, engine, _ = _engine(slot_graph, tmp_path)
    assert {p: engine.get_aliased_input_tensor(p) for p in layout.present_names} == dict(
        zip(layout.present_names, layout.past_names))
    assert engine.get_aliased_input_tensor("logits") is None
    assert engine.get_aliased_input_tensor("past_key_values.0.key") is None
    with pytest.raises(ValueError, match="no KV-cache-update layer"):  # no such plan can be built before 10.15
        _engine(slot_graph, tmp_path, version="10.14.1")
    older = fake_tensorrt(FakeCudart(), version="10.14.1")  # the batch-1 decoder's engine loads there, without it
    plan = write_plan(tmp_path / "decoder.plan", lively_decoder, optimization_profiles(kv_layout(ANDREA_TINY)),
                      trt_version="10.14.1")
    engine = older.Runtime(older.Logger()).deserialize_cuda_engine(plan.read_bytes())
    assert engine.get_tensor_name(0) == "input_ids" and not hasattr(engine, "get_aliased_input_tensor")


def test_a_step_bound_in_place_is_onnx_runtimes_slot_cache_bit_for_bit(slot_graph, lively_prompt, tmp_path):
    rt, layout, engine, _ = _engine(slot_graph, tmp_path)
    step = Step(rt, layout, engine)
    ours = runtime.load(slot_graph, "onnxruntime").slot_cache(SLOTS)
    prompt = np.asarray([lively_prompt[:CHUNK]])
    for ids, held in ((prompt, prompt.shape[1]), (np.asarray([[7]]), prompt.shape[1] + 1)):
        assert step.run(ids, held) and rt.cudaStreamSynchronize(step.stream) == (cudaError_t.cudaSuccess,)
        logits, _ = ours.run((0, ids, np.asarray([held])))
        np.testing.assert_array_equal(step.read(step.logits, logits.shape), logits)
        for past, buffer in zip(layout.past_names, ours.buffers):  # the cache updated where it lies, as ORT's
            np.testing.assert_array_equal(step.read(step.cache[past], step.shape), buffer)


def test_a_present_bound_elsewhere_than_its_past_is_refused(slot_graph, tmp_path):
    rt, layout, engine, logger = _engine(slot_graph, tmp_path)
    step = Step(rt, layout, engine)
    elsewhere = step._alloc(np.zeros(step.shape, np.float32))
    assert not step.run(np.asarray([[5, 6]]), 2, bind={layout.present_names[1]: elsewhere})
    assert any("bound to different addresses" in m for _, m in logger.messages)
    assert step.run(np.asarray([[5, 6]]), 2)  # bound in place, it runs


def _shifted_writes(graph, out):
    """The slot graph with each write one position later (the write index's Max gets + 1)."""
    model = onnx.load(str(graph))
    scatter = next(n for n in model.graph.node if n.op_type == "TensorScatter")
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(1, np.int64), "one"))
    index = scatter.input[2]
    for n in model.graph.node:
        if n.op_type == "TensorScatter":
            n.input[2] = "shifted_index"
    producer = next(i for i, n in enumerate(model.graph.node) if index in n.output)
    model.graph.node.insert(producer + 1, onnx.helper.make_node("Add", [index, "one"], ["shifted_index"]))
    onnx.save(model, str(out))
    return out


def test_a_write_past_the_cache_end_faults_where_tensorrt_would_drop_it(slot_graph, tmp_path):
    rt, layout, engine, _ = _engine(_shifted_writes(slot_graph, tmp_path / "shifted.onnx"), tmp_path)
    step = Step(rt, layout, engine)
    n = layout.n_positions
    assert step.run(np.asarray([[5]]), n - 1)
    assert rt.cudaStreamSynchronize(step.stream) == (cudaError_t.cudaSuccess,)  # writes position n - 1: inside
    assert step.run(np.asarray([[5]]), n)  # writes position n: past the end
    assert rt.cudaStreamSynchronize(step.stream) == (cudaError_t.cudaErrorIllegalAddress,)
    assert "past the cache's end" in rt.fault


def test_is_causal_over_unequal_lengths_fails_the_enqueue(slot_graph, tmp_path):
    model = onnx.load(str(slot_graph))
    for n in model.graph.node:
        if n.op_type == "Attention":
            n.attribute.append(onnx.helper.make_attribute("is_causal", 1))
    onnx.save(model, str(tmp_path / "causal.onnx"))
    rt, layout, engine, _ = _engine(tmp_path / "causal.onnx", tmp_path)
    step = Step(rt, layout, engine)
    assert step.run(np.asarray([[5, 6]]), 2)
    assert rt.cudaStreamSynchronize(step.stream) == (cudaError_t.cudaErrorIllegalAddress,)
    assert "upper-left" in rt.fault


def test_a_plan_of_an_attention_tensorrt_ignores_cannot_be_made(slot_graph, tmp_path):
    model = onnx.load(str(slot_graph))
    lengths = onnx.helper.make_tensor_value_info("lengths", onnx.TensorProto.INT64, ["batch"])
    model.graph.input.append(lengths)
    next(n for n in model.graph.node if n.op_type == "Attention").input.extend(["", "", "lengths"])
    onnx.save(model, str(tmp_path / "nonpad.onnx"))
    with pytest.raises(ValueError, match="nonpad_kv_seqlen"):
        write_plan(tmp_path / "p.plan", tmp_path / "nonpad.onnx", [], trt_version=VERSION)
