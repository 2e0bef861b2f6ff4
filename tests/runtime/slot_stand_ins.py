"""The stand-in slot engine the runtime tests share (a plain module: `from conftest import` finds whichever
directory's conftest pytest loaded last): a stand-in TensorRT plan of a two-group slot graph, and a
TrtSlotSession of it on the stand-in CUDA and TensorRT 10.15 (fake_cuda.py)."""

import pytest

SLOT_ROWS, SLOT_CHUNK = 8, 32  # the stand-in slot engine's profiles: decoding rows, a prompt's chunk


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
