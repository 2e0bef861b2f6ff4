"""Fixtures for the runtime tests: the lively tiny model's KV-cache decoder in a folder (tests/conftest.py),
and an ONNX Runtime session on it."""

import pytest
from slot_stand_ins import fake_slot_session, slot_plan


@pytest.fixture(scope="session")
def build_dir(lively_decoder):
    return lively_decoder.parent


@pytest.fixture(scope="session")
def session(build_dir):
    from andrea_export import runtime

    return runtime.load(build_dir, backend="onnxruntime")




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


@pytest.fixture(scope="session")
def trt_slot_session(slot_graphs, tmp_path_factory):
    """The lively model's slot engine on the stand-in TensorRT, shared (tests that break it make their own)."""
    _, two = slot_graphs
    return fake_slot_session(slot_plan(two, tmp_path_factory.mktemp("slot-plan") / "decoder.slots.plan"), two)
