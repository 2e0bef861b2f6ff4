"""int8 / int4 engines keep their weights quantized (verify/engine.quantized_weights_check): TensorRT may fold a
Q/DQ graph's weights back into floats (NVIDIA/TensorRT#4833), and such an engine's logits are right, so only its
size tells. Graphs are written with external weights that are never read (only shapes and types are), plans as
sparse files of the size under test."""

import json

import onnx
import pytest
from onnx import TensorProto, helper

from andrea_export.verify.engine import KERNELS_ALLOWANCE, quantized_weights_check
from andrea_export.verify.folder import engine_weights_checks

MB = 1 << 20


def _graph(path, quantized: int, dtype=TensorProto.INT8, floats: int = 1 << 20):
    """A Q/DQ-shaped graph's initializers: `quantized` elements of `dtype`, `floats` float32 elements."""
    def weight(name, data_type, n):
        t = TensorProto(name=name, data_type=data_type, dims=[n])
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", "weights.data"), ("offset", "0"), ("length", "0")):  # never read
            t.external_data.add(key=key, value=value)
        return t

    inits = [weight("w_q", dtype, quantized), weight("w_f", TensorProto.FLOAT, floats)]
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], initializer=inits)
    onnx.save(helper.make_model(g), str(path))
    return path


def _plan(path, nbytes: int):
    with open(path, "wb") as f:
        f.truncate(nbytes)  # sparse: only the size is read
    return path


@pytest.mark.parametrize("dtype,bits", [(TensorProto.INT8, 8), (TensorProto.INT4, 4)])
def test_a_plan_of_quantized_size_passes_and_one_of_float_size_fails(tmp_path, dtype, bits):
    n = 64 * MB  # 256 MB as float32: big enough to judge
    graph = _graph(tmp_path / "model.qdq.onnx", n, dtype)
    floats = 4 * MB
    quantized = n * bits // 8 + floats
    ok = quantized_weights_check(_plan(tmp_path / "ok.plan", quantized + 8 * MB), graph)  # plus kernels
    assert ok["judged"] and ok["passed"] and ok["weights_quantized_bytes"] == quantized
    assert ok["weights_as_float32_bytes"] == 4 * n + floats and ok["quantized_weights"] == n
    twice = quantized_weights_check(_plan(tmp_path / "twice.plan", 2 * quantized + 8 * MB), graph)
    assert twice["passed"]  # weights kept once per optimization profile (TensorRT-RTX, two profiles) still pass
    folded = quantized_weights_check(_plan(tmp_path / "folded.plan", 4 * n + floats + 2 * MB), graph)
    assert folded["judged"] and not folded["passed"] and "folded the Q/DQ weights back" in folded["detail"]


def test_too_few_weights_to_tell_is_said_not_passed_off_as_checked(tmp_path):
    graph = _graph(tmp_path / "tiny.qdq.onnx", 1 << 18)  # 1 MB as float32, like andrea-tiny
    r = quantized_weights_check(_plan(tmp_path / "tiny.plan", 6 * MB), graph)
    assert r["passed"] and not r["judged"] and r["detail"].startswith("not judged")
    assert f"allowance {KERNELS_ALLOWANCE >> 20} MB" in r["detail"]


def test_a_graph_without_quantized_weights_is_no_quantized_engine(tmp_path):
    graph = _graph(tmp_path / "float.onnx", 1 << 20, TensorProto.FLOAT)
    r = quantized_weights_check(_plan(tmp_path / "f.plan", 8 * MB), graph)
    assert not r["passed"] and "has no quantized weights" in r["detail"]


def test_the_folder_check_reads_each_engines_graph_from_its_sidecar_and_keeps_it_inside(tmp_path):
    from andrea_export.errors import BuildError

    _graph(tmp_path / "model.int4.qdq.onnx", 64 * MB, TensorProto.INT4)
    _graph(tmp_path / "decoder.int4.qdq.onnx", 64 * MB, TensorProto.INT4)
    _plan(tmp_path / "model.plan", 40 * MB)
    _plan(tmp_path / "decoder.plan", 300 * MB)  # as float32: folded
    info = {"onnx": "model.int4.qdq.onnx"}
    decoder_info = {"builder": "tensorrt", "builder_version": "10.13.3", "plan_bytes": 300 * MB, "plan_sha256": "0" * 64,
                    "compute_capabilities": ["9.0"], "onnx": "decoder.int4.qdq.onnx"}  # fmt: skip
    (tmp_path / "decoder.plan.json").write_text(json.dumps(decoder_info))
    artifacts = {"engine": "model.plan", "decoder_engine": "decoder.plan", "decoder_engine_info": "decoder.plan.json"}
    checks = engine_weights_checks(tmp_path, artifacts, info)
    assert checks["engine"]["passed"] and not checks["decoder_engine"]["passed"]
    assert checks["decoder_engine"]["graph"] == "decoder.int4.qdq.onnx"
    with pytest.raises(BuildError, match="outside the build folder"):
        engine_weights_checks(tmp_path, {"engine": "model.plan"}, {"onnx": "../elsewhere.onnx"})
