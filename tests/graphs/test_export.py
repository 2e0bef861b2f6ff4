import hashlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from andrea_export.config import ANDREA_120M, ANDREA_TINY
from andrea_export.errors import ExportError
from andrea_export.graphs.export import INPUT_NAME, OUTPUT_NAME, export_onnx, op_counts
from andrea_export.graphs.layout import check_onnx, read_config, read_metadata


def test_graph_io_and_gelu_nodes(tiny_onnx):
    model = check_onnx(tiny_onnx)
    counts = op_counts(model)
    assert counts["Gelu(tanh)"] == ANDREA_TINY.n_layer and counts["Gelu(none)"] == 0
    assert counts["LayerNormalization"] == 2 * ANDREA_TINY.n_layer + 1
    (inp,), (out,) = model.graph.input, model.graph.output
    assert inp.name == INPUT_NAME and inp.type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert [d.dim_param for d in inp.type.tensor_type.shape.dim] == ["batch", "seq"]
    assert out.name == OUTPUT_NAME and out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    dims = out.type.tensor_type.shape.dim
    assert (dims[0].dim_param, dims[1].dim_param, dims[2].dim_value) == ("batch", "seq", ANDREA_TINY.vocab_size)
    assert any(o.version >= 20 for o in model.opset_import if o.domain in ("", "ai.onnx"))
    assert read_config(tiny_onnx) == ANDREA_TINY


def test_tied_embedding_is_one_initializer(tiny_onnx):
    model = onnx.load(str(tiny_onnx))
    vocab_sized = [i.name for i in model.graph.initializer if ANDREA_TINY.vocab_size in i.dims]
    assert len(vocab_sized) == 1


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (2, ANDREA_TINY.n_positions)])
def test_onnxruntime_matches_pytorch(tiny_model, tiny_onnx, shape):
    ids = torch.randint(0, ANDREA_TINY.vocab_size, shape)
    sess = ort.InferenceSession(str(tiny_onnx), providers=["CPUExecutionProvider"])
    got = sess.run(None, {INPUT_NAME: ids.numpy()})[0]
    with torch.no_grad():
        want = tiny_model(ids).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_export_is_deterministic_and_atomic(tiny_model, tiny_onnx, tmp_path):
    again = export_onnx(tiny_model, tmp_path / "model.onnx", quiet=True)
    digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (tiny_onnx, again)]
    assert digest[0] == digest[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]  # no staging leftovers


def test_external_data_round_trip(tiny_model, tmp_path):
    out = export_onnx(tiny_model, tmp_path / "ext.onnx", external_data=True, quiet=True)
    assert (tmp_path / "ext.onnx.data").stat().st_size > 2_000_000
    assert out.stat().st_size < 200_000
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    ids = np.array([[1, 2, 3]])
    with torch.no_grad():
        np.testing.assert_allclose(sess.run(None, {INPUT_NAME: ids})[0], tiny_model(torch.from_numpy(ids)).numpy(),
                                   rtol=1e-4, atol=1e-5)


def test_failed_export_leaves_nothing(tiny_model, tmp_path):
    with pytest.raises(ExportError, match="opset 18 is too old: tanh-GELU is one ONNX Gelu node only from opset 20"):
        export_onnx(tiny_model, tmp_path / "m.onnx", opset=18, quiet=True)
    assert not list(tmp_path.iterdir())


def test_not_an_onnx_file(tmp_path):
    fake = tmp_path / "model.onnx"
    fake.write_bytes(b"\x00\x01garbage that is no protobuf" * 10)
    with pytest.raises(ExportError, match="model.onnx: not an ONNX model|model.onnx: not a valid ONNX model"):
        check_onnx(fake)
    with pytest.raises(ExportError, match="no such ONNX file"):
        check_onnx(tmp_path / "absent.onnx")


def test_foreign_onnx_has_no_config(tmp_path):
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    path = tmp_path / "relu.onnx"
    onnx.save(onnx.helper.make_model(graph), str(path))
    with pytest.raises(ExportError, match="has no 'andrea.config' metadata: not exported by andrea-export"):
        read_config(path)


def test_weight_source_recorded(tiny_onnx):
    assert read_metadata(tiny_onnx)["andrea.weights"] == '{"kind": "random-init", "seed": 0}'


@pytest.mark.slow
def test_full_size_export(tmp_path):
    from andrea_export.model.checkpoint import random_init

    model = random_init(ANDREA_120M, announce=False)
    path = export_onnx(model, tmp_path / "andrea-120m.onnx", quiet=True)
    counts = op_counts(check_onnx(path))
    assert counts["Gelu(tanh)"] == 12
    size = path.stat().st_size
    assert 369_000_000 < size < 371_000_000  # the tied matrix stored once (twice would be ~395 MB)
