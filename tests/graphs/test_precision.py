"""fp16 / bf16 graphs: structure (LayerNorm and Softmax in float32, one tied embedding, float32 logits),
accuracy against PyTorch float32 within verify.thresholds.TOLERANCES, and real TensorRT-RTX builds of both."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto

from andrea_export.errors import ConfigError, ExportError
from andrea_export.graphs.precision import convert_precision, emulate_in_fp32, graph_precision
from andrea_export.verify.thresholds import MIN_TOP1, TOLERANCES

HALF = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


@pytest.fixture(scope="module")
def graphs(tiny_onnx, tmp_path_factory):
    d = tmp_path_factory.mktemp("precision")
    return {p: convert_precision(tiny_onnx, d / f"model_{p}.onnx", p) for p in ("fp32", "fp16", "bf16")}


@pytest.fixture(scope="module")
def reference(tiny_model):
    ids = torch.randint(0, tiny_model.cfg.vocab_size, (4, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return ids.numpy(), tiny_model.float().eval()(ids).numpy()


def _run(model: onnx.ModelProto | str, ids: np.ndarray) -> np.ndarray:
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})[0]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_structure(graphs, precision):
    m = onnx.load(str(graphs[precision]))
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    assert graph_precision(m) == precision
    assert g.input[0].type.tensor_type.elem_type == TensorProto.INT64
    assert g.output[0].name == "logits" and g.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    last = producer["logits"]
    assert last.op_type == "Cast" and last.attribute[0].i == TensorProto.FLOAT
    assert producer[last.input[0]].op_type == "MatMul"  # the tied projection computes in half, cast once after
    for n in g.node:
        if n.op_type in ("LayerNormalization", "Softmax"):
            x = producer[n.input[0]]
            assert x.op_type == "Cast" and x.attribute[0].i == TensorProto.FLOAT, n.name
            for w in n.input[1:]:
                assert inits[w].data_type == TensorProto.FLOAT, w  # LayerNorm scale and bias stay float32
            (after,) = [c for c in g.node if n.output[0] in c.input]
            assert after.op_type == "Cast" and after.attribute[0].i == HALF[precision]
        if n.op_type == "MatMul" and n.input[1] in inits:
            assert inits[n.input[1]].data_type == HALF[precision]
    # The tied embedding: one half-precision initializer, read by the Gather and (transposed) the projection.
    wte = [t for t in g.initializer if list(t.dims) == [8449, 64]]
    assert len(wte) == 1 and wte[0].data_type == HALF[precision]
    readers = Counter(n.op_type for n in g.node if wte[0].name in n.input)
    assert readers == Counter({"Gather": 1, "Transpose": 1})
    float32 = {t.name for t in g.initializer if t.data_type == TensorProto.FLOAT}
    ln_params = {w for n in g.node if n.op_type == "LayerNormalization" for w in n.input[1:]}
    assert float32 == ln_params
    casts = Counter(n.op_type for n in g.node)["Cast"]
    n_ln, n_sm = (sum(n.op_type == op for n in g.node) for op in ("LayerNormalization", "Softmax"))
    assert casts == 2 * n_ln + 2 * n_sm + 1


def test_fp32_and_fp16_accuracy_in_onnxruntime(graphs, reference):
    ids, ref = reference
    for precision in ("fp32", "fp16"):
        out = _run(graphs[precision], ids)
        assert out.dtype == np.float32
        np.testing.assert_allclose(out, ref, **TOLERANCES[precision], err_msg=precision)
        assert (out.argmax(-1) == ref.argmax(-1)).mean() >= MIN_TOP1[precision]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_accuracy_emulated(graphs, reference, precision):
    """ONNX Runtime's CPU provider has no bf16 kernels: emulate_in_fp32 rounds every op's result to the half
    type instead (pessimistic: it rounds more often than a fused GPU kernel does)."""
    ids, ref = reference
    out = _run(emulate_in_fp32(onnx.load(str(graphs[precision]))), ids)
    np.testing.assert_allclose(out, ref, **TOLERANCES[precision], err_msg=precision)
    assert (out.argmax(-1) == ref.argmax(-1)).mean() >= MIN_TOP1[precision]
    assert np.abs(out - ref).max() > 0  # it did round


def test_emulation_matches_onnxruntime_fp16(graphs, reference):
    ids, _ = reference
    real = _run(graphs["fp16"], ids)
    emulated = _run(emulate_in_fp32(onnx.load(str(graphs["fp16"]))), ids)
    np.testing.assert_allclose(emulated, real, **TOLERANCES["fp16"])


def test_bf16_is_not_runnable_by_onnxruntime_cpu(graphs):
    """Why the emulation exists; if this starts passing, bf16 can be measured directly."""
    with pytest.raises(Exception, match="NOT_IMPLEMENTED"):
        _run(graphs["bf16"], np.zeros((1, 4), dtype=np.int64))


def test_external_data_round_trip(tiny_onnx, tmp_path):
    src = tmp_path / "ext.onnx"
    onnx.save(onnx.load(str(tiny_onnx)), str(src), save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    out = convert_precision(src, tmp_path / "ext16.onnx", "fp16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ext.onnx", "ext.onnx.data", "ext16.onnx", "ext16.onnx.data"]
    assert _run(out, np.zeros((1, 4), dtype=np.int64)).shape == (1, 4, 8449)


def test_errors(graphs, tiny_onnx, tmp_path):
    with pytest.raises(ConfigError) as e:
        convert_precision(tiny_onnx, tmp_path / "x.onnx", "int2")
    assert str(e.value) == "precision must be one of fp32, fp16, bf16, int8, int4, got 'int2'"
    with pytest.raises(ExportError) as e:
        convert_precision(graphs["fp16"], tmp_path / "x.onnx", "bf16")
    assert str(e.value) == f"{graphs['fp16']}: is already a fp16 graph; convert from the fp32 export"
    with pytest.raises(ExportError) as e:  # int8/int4 go to quantize.py, which refuses a converted graph too
        convert_precision(graphs["fp16"], tmp_path / "x.onnx", "int4")
    assert str(e.value) == f"{graphs['fp16']}: is already a fp16 graph; quantize the fp32 export"
    with pytest.raises(ExportError) as e:
        convert_precision(tmp_path / "none.onnx", tmp_path / "x.onnx", "fp16")
    assert str(e.value) == f"{tmp_path / 'none.onnx'}: no such ONNX file"
    assert list(tmp_path.iterdir()) == []


def test_weight_out_of_fp16_range(tiny_onnx, tmp_path):
    m = onnx.load(str(tiny_onnx))
    big = next(t for t in m.graph.initializer if t.name == "wpe.weight")
    a = onnx.numpy_helper.to_array(big).copy()
    a[0, 0] = 1e6
    big.CopyFrom(onnx.numpy_helper.from_array(a, big.name))
    onnx.save(m, str(tmp_path / "big.onnx"))
    with pytest.raises(ExportError) as e:
        convert_precision(tmp_path / "big.onnx", tmp_path / "big16.onnx", "fp16")
    assert str(e.value) == "initializer 'wpe.weight': 1 value(s) exceed the fp16 range (max |x| = 1e+06); keep this model in fp32"
    assert not (tmp_path / "big16.onnx").exists()
    convert_precision(tmp_path / "big.onnx", tmp_path / "bigbf16.onnx", "bf16")  # bf16 has float32's range


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_rtx_builds_half_precision(graphs, precision, tmp_path):
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX not installed: pip install 'andrea-export[rtx]'")
    from andrea_export.engine.builder import build_engine
    from andrea_export.engine.profiles import Profile

    r = build_engine(graphs[precision], tmp_path / f"{precision}.plan", builder="tensorrt-rtx",
                     profiles=Profile.parse("batch=1:1:2,seq=1:16:64"), progress=False)
    assert r.precision == precision and r.tf32 is True and r.plan_bytes > 0
