"""TensorRT's import rules (engine/onnx_rules.py): each refuses what TensorRT refuses, and every graph the
pipeline hands to full TensorRT, in every precision, passes all of them."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from andrea_export.engine.onnx_rules import RULES, check_tensorrt_import, tensorrt_import_problems
from andrea_export.errors import BuildError
from andrea_export.names import PRECISIONS


def _dq_graph(q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None = None, **attrs) -> onnx.ModelProto:
    """x [1, K] @ DequantizeLinear(q [K, N], scale) -> y."""
    K, N = q.shape
    inits = [numpy_helper.from_array(q, "w"), numpy_helper.from_array(scale.astype(np.float32), "s")]
    inputs = ["w", "s"]
    if zero is not None:
        inits.append(numpy_helper.from_array(zero, "z"))
        inputs.append("z")
    nodes = [helper.make_node("DequantizeLinear", inputs, ["wd"], name="dq", **attrs),
             helper.make_node("MatMul", ["x", "wd"], ["y"], name="mm")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def _problems(model) -> str:
    return "\n".join(tensorrt_import_problems(model))


def test_a_correct_graph_has_no_problem():
    rng = np.random.default_rng(0)
    per_channel = _dq_graph(rng.integers(-127, 128, (64, 8)).astype(np.int8), np.full(8, 0.01), axis=1)
    int4_blocks = _dq_graph(rng.integers(-8, 8, (64, 8)).astype(ml_dtypes.int4), np.full((2, 8), 0.01), axis=0, block_size=32)
    assert tensorrt_import_problems(per_channel) == [] and tensorrt_import_problems(int4_blocks) == []


def test_int8_block_dequantization_is_refused():
    """What quantize.py used to give TensorRT for int8 (blocks of 64): TensorRT block-dequantizes INT4 only."""
    q = np.zeros((128, 8), dtype=np.int8)
    found = _problems(_dq_graph(q, np.full((2, 8), 0.01), axis=0, block_size=64))
    assert "block_size 64 on INT8" in found and RULES["block"] in found


def test_a_negative_or_zero_scale_is_refused():
    """ONNX Runtime's symmetric int4 writes negative scales (about 4 in 10 blocks); TensorRT wants them positive."""
    q = np.zeros((64, 8), dtype=ml_dtypes.int4)
    s = np.full((2, 8), 0.01)
    s[0, 3], s[1, 0] = -0.02, 0.0
    found = _problems(_dq_graph(q, s, axis=0, block_size=32))
    assert "2 of 16 scales are not positive" in found and RULES["positive"] in found


def test_zero_points_scale_shapes_and_contrib_ops_are_checked():
    q = np.zeros((64, 8), dtype=np.int8)
    assert RULES["zero_point"] in _problems(_dq_graph(q, np.full(8, 0.01), np.ones(8, dtype=np.int8), axis=1))
    assert "1-D scale of 8 for axis 0 of size 64" in _problems(_dq_graph(q, np.full(8, 0.01), axis=0))
    assert "scale shape [3, 8]" in _problems(_dq_graph(q.astype(ml_dtypes.int4), np.full((3, 8), 0.01), axis=0, block_size=32))
    m = _dq_graph(q, np.full(8, 0.01), axis=1)
    m.graph.node[1].domain, m.graph.node[1].op_type = "com.microsoft", "MatMulNBits"
    assert "com.microsoft.MatMulNBits" in _problems(m)


def test_check_tensorrt_import_names_the_file_and_the_rule(tmp_path):
    path = tmp_path / "model.int8.qdq.onnx"
    onnx.save(_dq_graph(np.zeros((128, 8), dtype=np.int8), np.full((2, 8), 0.01), axis=0, block_size=64), str(path))
    with pytest.raises(BuildError, match=r"model.int8.qdq.onnx: TensorRT would refuse this graph:\n  node 'dq': block_size"):
        check_tensorrt_import(path)


@pytest.fixture(scope="module", params=PRECISIONS)
def tensorrt_graphs(request, tiny_model, tmp_path_factory):
    """Every graph a `--builder tensorrt` build of `precision` exports, and the ones its engines are built from."""
    from andrea_export.pipeline import BuildOptions, _export_graphs, engine_sources

    tmp = tmp_path_factory.mktemp(f"trt-{request.param}")
    artifacts: dict[str, str] = {}
    _export_graphs(tmp, tiny_model, BuildOptions(config="andrea-tiny", precision=request.param), "tensorrt", artifacts)
    return request.param, tmp, artifacts, engine_sources(artifacts, "tensorrt")


def test_every_graph_handed_to_full_tensorrt_passes_its_import_rules(tensorrt_graphs):
    precision, tmp, artifacts, sources = tensorrt_graphs
    assert set(sources) == {"engine", "decoder_engine"}
    for role, name in sources.items():
        assert tensorrt_import_problems(onnx.load(str(tmp / name))) == [], (precision, role, name)
    if precision in ("int8", "int4"):  # the ONNX Runtime graphs beside them are what TensorRT must not get
        assert tensorrt_import_problems(onnx.load(str(tmp / artifacts["onnx"])))
