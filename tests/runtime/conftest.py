"""Fixtures for the runtime tests: the lively tiny model's KV-cache decoder in a folder (tests/conftest.py),
and an ONNX Runtime session on it."""

import pytest


@pytest.fixture(scope="session")
def build_dir(lively_decoder):
    return lively_decoder.parent


@pytest.fixture(scope="session")
def session(build_dir):
    from andrea_export import runtime

    return runtime.load(build_dir, backend="onnxruntime")


SLOT_ROWS, SLOT_CHUNK = 8, 32  # the stand-in slot engine's profiles: decoding rows, a prompt's chunk


@pytest.fixture(scope="session")
def slot_graphs(lively_model, tmp_path_factory):
    """(one-group, two-group) slot decoder graphs of the lively model (graphs/slot_decoder.py, two_groups.py)."""
    import onnx_ir as ir

    from andrea_export.graphs.slot_decoder import export_slot_decoder
    from andrea_export.graphs.two_groups import two_group_decoder

    tmp = tmp_path_factory.mktemp("slot-graphs")
    one = export_slot_decoder(lively_model, tmp / "decoder.slots.onnx", quiet=True)
    ir.save(two_group_decoder(ir.load(one)), tmp / "decoder.slots.two.onnx")
    return one, tmp / "decoder.slots.two.onnx"


def slot_plan(graph, path, version: str = "10.15.1", rows: int = SLOT_ROWS, chunk: int = SLOT_CHUNK):
    """A stand-in TensorRT plan of a two-group slot graph with the slot profiles (DECODE, MIXED)."""
    from fake_cuda import write_plan

    from andrea_export.graphs.layout import read_kv_layout
    from andrea_export.graphs.slot_decoder import slot_profiles

    return write_plan(path, graph, slot_profiles(read_kv_layout(graph), rows, chunk), trt_version=version)


def fake_slot_session(plan, graph, cudart=None, **kwargs):
    """A TrtSlotSession of `plan` on the stand-in CUDA and TensorRT 10.15 (what `graph` says of the model)."""
    from fake_cuda import FakeCudart, fake_tensorrt

    from andrea_export.graphs.layout import read_config, read_kv_layout
    from andrea_export.runtime import trt as trt_backend
    from andrea_export.runtime.trt_slots import TrtSlotSession

    cudart = cudart or FakeCudart()
    with pytest.MonkeyPatch.context() as mp:  # the stand-ins are read when the session loads
        mp.setattr(trt_backend, "_cudart", lambda: cudart)
        mp.setattr(trt_backend, "_tensorrt", lambda: fake_tensorrt(cudart, version="10.15.1"))
        return TrtSlotSession(plan, read_config(graph), read_kv_layout(graph), **kwargs)


@pytest.fixture(scope="session")
def trt_slot_session(slot_graphs, tmp_path_factory):
    """The lively model's slot engine on the stand-in TensorRT, shared (tests that break it make their own)."""
    _, two = slot_graphs
    return fake_slot_session(slot_plan(two, tmp_path_factory.mktemp("slot-plan") / "decoder.slots.plan"), two)
