"""The TensorRT slot cache (runtime/trt_slots.py) on the strict stand-ins (fake_cuda.py: TensorRT 10.15's KV-cache
contracts, CUDA's capture rules): its steps give ONNX Runtime's logits for the same graph, decode steps replay a
captured graph per bucket and allocate nothing, and each refusal of the stand-in that the cache relies on is
seen to fire. test_batcher.py runs every batcher test through it as well."""

from __future__ import annotations

import numpy as np
import pytest
from fake_cuda import FakeCudart
from slot_stand_ins import SLOT_CHUNK, SLOT_ROWS, fake_slot_session, slot_plan

from andrea_export import runtime
from andrea_export.errors import CudaError, InputError
from andrea_export.runtime import trt_slots
from andrea_export.runtime.trt_slots import buckets

NOTHING_LIVE = {"allocations": 0, "pinned": 0, "streams": 0, "graphs": 0, "graph_execs": 0}


@pytest.fixture(scope="module")
def ort_slots(slot_graphs):
    """ONNX Runtime on the one-group slot graph: the reference."""
    return runtime.load(slot_graphs[0], backend="onnxruntime")


@pytest.fixture
def fresh(slot_graphs, tmp_path):
    """A session of its own, on a device of its own (cudart), for tests that count or break things."""
    cudart = FakeCudart()
    session = fake_slot_session(slot_plan(slot_graphs[1], tmp_path / "decoder.slots.plan"), slot_graphs[1], cudart)
    yield session, cudart
    session.close()


def _prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 8449, n).tolist()


def test_generate_on_the_slot_engine_is_onnx_runtimes_on_the_same_graph(trt_slot_session, ort_slots):
    """Prompts longer than one chunk (several runs) and of one token; greedy and sampled: the same tokens, and
    the same logits to the last bit for every position of a prompt."""
    for n, strategy in ((1, "greedy"), (SLOT_CHUNK + 5, "greedy"), (40, "top-k")):
        prompt = _prompt(n, n)
        np.testing.assert_array_equal(trt_slot_session.forward(prompt), ort_slots.forward(prompt))
        kwargs = {"strategy": strategy, "seed": 3}
        assert trt_slot_session.generate(prompt, 24, **kwargs) == ort_slots.generate(prompt, 24, **kwargs)


def test_decode_steps_replay_one_captured_graph_per_bucket_and_allocate_nothing(fresh, ort_slots):
    session, cudart = fresh
    cache = session.slot_cache(6)
    assert sorted(cache.graphs) == buckets(6) == [1, 2, 4, 6] and cache.cuda_graph_error is None
    ours = ort_slots.slot_cache(6)
    prompts = [_prompt(5 + i, i) for i in range(6)]
    for i, p in enumerate(prompts):  # each prompt into its slot, alone
        group = (i, np.asarray([p]), np.asarray([len(p)]))
        np.testing.assert_array_equal(cache.run(group)[0], ours.run(group)[0])
    mallocs, launches = cudart.mallocs, cudart.launches
    held = np.asarray([len(p) for p in prompts])
    for rows in (3, 1, 6, 5):  # 3 and 5 rows run padded, on the graphs of 4 and 6
        held[:rows] += 1
        group = (0, np.full((rows, 1), 11), held[:rows].copy())
        np.testing.assert_array_equal(cache.run(group)[0], ours.run(group)[0])
    assert cudart.launches == launches + 4 and cudart.mallocs == mallocs
    for buffer, past in zip(ours.buffers, session.layout.past_names):  # the pads wrote nothing a sequence holds
        i = session.layout.past_names.index(past)
        device = cudart.device_bytes(cache.cache[i], buffer.nbytes).view(np.float32).reshape(buffer.shape)
        for slot, h in enumerate(held):
            np.testing.assert_array_equal(device[slot, :, :h], buffer[slot, :, :h])
    session.close()
    assert cudart.live() == NOTHING_LIVE  # the session's close freed its caches: device, pinned, graphs, stream


def test_a_mixed_step_with_the_chunk_below_the_decoding_rows_is_each_groups_alone(fresh, ort_slots):
    """Slot 0 joins with a chunk while slots 1-2 decode (its row among them a pad at the context's end): both
    groups' logits are ONNX Runtime's two-group run's, and the pad wrote nothing the chunk holds."""
    session, _ = fresh
    cache, ours = session.slot_cache(3), ort_slots.slot_cache(3)
    for i in (1, 2):
        g = (i, np.asarray([_prompt(7, i)]), np.asarray([7]))
        cache.run(g), ours.run(g)
    n = session.layout.n_positions
    group = (0, np.asarray([[0], [4], [5]]), np.asarray([n, 8, 8]))
    chunk = (0, np.asarray([_prompt(20, 9)]), np.asarray([20]))
    (rows, joined), (ref_rows, ref_joined) = cache.run(group, chunk), ours.run(group, chunk)
    np.testing.assert_array_equal(rows[1:], ref_rows[1:])  # row 0 is the pad: its logits are dropped
    np.testing.assert_array_equal(joined, ref_joined)
    step = (0, np.asarray([[3], [4], [5]]), np.asarray([21, 9, 9]))  # slot 0 decodes on from its chunk
    np.testing.assert_array_equal(cache.run(step)[0], ours.run(step)[0])


def test_a_replay_on_the_bindings_of_another_bucket_faults(fresh, monkeypatch):
    """The stand-in's rule the cache keeps: a graph replays only on the shapes it was captured with. With the
    rebinding before each replay removed, a 2-row step after a 4-row one faults."""
    session, cudart = fresh
    cache = session.slot_cache(4)
    ids = np.full((4, 1), 3)
    cache.run((0, ids, np.full(4, 2)))
    monkeypatch.setattr(cache, "_bind_decode", lambda rows, addresses: None)
    with pytest.raises(CudaError, match="cudaStreamSynchronize"):
        cache.run((0, ids[:2], np.full(2, 3)))
    assert "replayed while its context is bound to other shapes" in cudart.fault


def test_two_groups_writing_one_position_fault_where_the_cache_does_not_refuse_them(fresh, monkeypatch):
    """A chunk and a decoding row writing the same position of one slot race on a GPU: the cache refuses such a
    run (check_apart); with that check removed, the stand-in faults."""
    session, cudart = fresh
    cache = session.slot_cache(2)
    group, chunk = (0, np.asarray([[1], [2]]), np.asarray([3, 1])), (0, np.asarray([[5, 6, 7]]), np.asarray([3]))
    with pytest.raises(ValueError, match="written by both groups"):
        cache.run(group, chunk)
    monkeypatch.setattr(trt_slots, "check_apart", lambda a, b: None)
    with pytest.raises(CudaError):
        cache.run(group, chunk)
    assert "both write position 2 of one cache row" in cudart.fault


def test_what_the_slot_engine_refuses(trt_slot_session, slot_graphs, tmp_path, lively_decoder):
    with pytest.raises(InputError, match=f"slots must be an integer in 1..{SLOT_ROWS}"):
        trt_slot_session.slot_cache(SLOT_ROWS + 1)
    cache = trt_slot_session.slot_cache(2)
    with pytest.raises(ValueError, match=f"at most {SLOT_CHUNK}"):
        cache.run((0, np.ones((1, SLOT_CHUNK + 1), np.int64), np.asarray([SLOT_CHUNK + 1])))
    with pytest.raises(ValueError, match="rows 1..2 of 2 slots"):
        cache.run((1, np.ones((2, 1), np.int64), np.asarray([1, 1])))
    cache.close()
    with pytest.raises(InputError, match="closed"):
        cache.run((0, np.ones((1, 1), np.int64), np.asarray([1])))
    one = slot_graphs[0]
    from fake_cuda import write_plan

    from andrea_export.graphs.layout import check_decoder_onnx
    from andrea_export.graphs.slot_decoder import slot_profiles

    plan = write_plan(tmp_path / "one.plan", one, slot_profiles(check_decoder_onnx(one), 4, 8, two_groups=False),
                      trt_version="10.15.1")
    with pytest.raises(InputError, match="not the two-group slot decoder"):
        fake_slot_session(plan, one)
    with pytest.raises(InputError, match="static cache"):  # the batch-1 decoder's layout
        fake_slot_session(slot_plan(slot_graphs[1], tmp_path / "two.plan"), lively_decoder)


def test_the_builds_gate_on_the_slot_engine_passes_it_here_and_fails_a_broken_one(slot_graphs, lively_model, monkeypatch):
    """verify's slot engine check (verify/engine.py, what a GPU host runs on decoder.slots.plan), here on the
    stand-ins: greedy decoding agrees with PyTorch and four requests batched get their tokens alone, captured and
    not; a cache that binds every prompt's chunk at slot 0 does not get through it."""
    from fake_cuda import fake_tensorrt

    from andrea_export.catalog import Role
    from andrea_export.runtime import trt as trt_backend
    from andrea_export.verify.engine import slot_engine_checks

    one, two = slot_graphs
    slot_plan(two, one.parent / "decoder.slots.plan")
    cudart = FakeCudart()
    monkeypatch.setattr(trt_backend, "_cudart", lambda: cudart)
    monkeypatch.setattr(trt_backend, "_tensorrt", lambda: fake_tensorrt(cudart, version="10.15.1"))
    artifacts = {Role.DECODER_ONNX_SLOTS: one.name, Role.SLOT_ENGINE: "decoder.slots.plan"}
    result = slot_engine_checks(one.parent, lively_model, artifacts, 12, "fp32")
    assert result["passed"], result
    assert all(p["batched_equals_alone"] and p["greedy"]["agree"] for p in result["paths"].values())
    real = trt_slots.TrtSlotCache._group

    def chunk_in_slot_0(self, prefix, rows, tokens, first, *buffers):  # every prompt's chunk bound at slot 0
        return real(self, prefix, rows, tokens, 0 if prefix and first != self.slots else first, *buffers)

    monkeypatch.setattr(trt_slots.TrtSlotCache, "_group", chunk_in_slot_0)
    with pytest.raises(CudaError, match="700"):  # the batched run faults: a chunk overwrote slot 0's decoding row
        slot_engine_checks(one.parent, lively_model, artifacts, 12, "fp32")
    assert "both write position" in cudart.fault


def test_load_in_flight_gives_the_build_folders_slot_engine(slot_graphs, tmp_path, monkeypatch, build_dir):
    """runtime.load(folder, "tensorrt", in_flight=True): the TrtSlotSession of the folder's decoder.slots.plan,
    its files checked against the manifest (a changed one is refused); a folder without one is told how to build it."""
    import json
    import shutil

    from fake_cuda import fake_tensorrt

    from andrea_export.catalog import Role
    from andrea_export.folder.atomic import sha256_file
    from andrea_export.graphs.layout import read_config
    from andrea_export.runtime import trt as trt_backend
    from andrea_export.runtime.trt_slots import TrtSlotSession

    one, two = slot_graphs
    folder = tmp_path / "build"
    folder.mkdir()
    shutil.copy(one, folder / "decoder.slots.onnx")
    shutil.copy(two, folder / "decoder.slots.two.onnx")
    slot_plan(folder / "decoder.slots.two.onnx", folder / "decoder.slots.plan")
    names = {Role.DECODER_ONNX_SLOTS: "decoder.slots.onnx", Role.SLOT_ENGINE_ONNX: "decoder.slots.two.onnx",
             Role.SLOT_ENGINE: "decoder.slots.plan"}
    artifacts = {r.value: {"path": n, "sha256": sha256_file(folder / n), "bytes": (folder / n).stat().st_size}
                 for r, n in names.items()}
    (folder / "manifest.json").write_text(json.dumps({"schema_version": 1, "model": read_config(one).to_dict(),
                                                      "artifacts": artifacts}))
    cudart = FakeCudart()
    monkeypatch.setattr(trt_backend, "_cudart", lambda: cudart)
    monkeypatch.setattr(trt_backend, "_tensorrt", lambda: fake_tensorrt(cudart, version="10.15.1"))
    with runtime.load(folder, "tensorrt", in_flight=True) as sess:
        assert isinstance(sess, TrtSlotSession) and sess.max_slots == SLOT_ROWS
        assert sess.generate([1, 2, 3], 5) == runtime.load(one, "onnxruntime").generate([1, 2, 3], 5)
    assert runtime.has_slot_engine(folder) and not runtime.has_slot_engine(build_dir)
    with pytest.raises(InputError, match="backend 'tensorrt'"):
        runtime.load(folder, "onnxruntime", in_flight=True)
    with pytest.raises(InputError, match="build --max-slots N"):
        runtime.load(build_dir, "tensorrt", in_flight=True)
    (folder / "decoder.slots.plan").write_text((folder / "decoder.slots.plan").read_text() + " ")
    with pytest.raises(InputError, match="changed since the build"):
        runtime.load(folder, "tensorrt", in_flight=True)


def test_a_stopped_batcher_gives_back_its_slot_cache(fresh):
    """A session outlives its batchers (a benchmark makes one per level, a server one per model load): each
    batcher's cache, device memory and CUDA graphs, goes when the batcher stops, not when the session closes."""
    from andrea_export.runtime import Request
    from andrea_export.runtime.batcher import Batcher

    session, cudart = fresh
    before = cudart.live()
    for slots in (2, 4):
        with Batcher(session, slots=slots) as batcher:
            assert cudart.live()["graph_execs"] == before["graph_execs"] + len(buckets(slots))
            assert batcher.submit(Request(_prompt(5), 3), lambda e: None).wait(60)
        assert cudart.live() == before
