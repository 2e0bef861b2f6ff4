"""The TensorRT enums the stand-ins share (trt_enums.py) against the real ones of TensorRT-RTX, and each stand-in
using them: a stand-in whose enum drifts from TensorRT's would test a type code TensorRT does not have."""

import pytest


def _real(name: str) -> dict[str, int]:
    trt = pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX (the 'rtx' extra) has the real enums")
    return {k: int(v) for k, v in getattr(trt, name).__members__.items()}


def test_datatype_is_tensorrts():
    from trt_enums import DataType

    assert {d.name: d.value for d in DataType} == _real("DataType")


@pytest.mark.parametrize("standin", ["plugin/trt_standin.py", "runtime/fake_cuda.py"])
def test_each_standin_has_tensorrts_datatype(standin):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent / standin
    spec = importlib.util.spec_from_file_location(f"_standin_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert {d.name: d.value for d in module.DataType} == _real("DataType")
