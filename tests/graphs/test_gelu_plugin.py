"""The tanh-GELU plugin pass: every Gelu(approximate="tanh") becomes a call of the model-local function
andrea.TanhGelu (or andrea.TanhGeluBias), and the file still computes the same numbers."""

from __future__ import annotations

import json
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn

from andrea_export.config import ANDREA_120M, ANDREA_TINY
from andrea_export.engine.backends import network_flags
from andrea_export.errors import PluginError
from andrea_export.graphs.export import export_onnx, op_counts
from andrea_export.graphs.gelu_plugin import PLUGIN_KEY, apply_gelu_plugin
from andrea_export.model.andrea import Andrea
from andrea_export.names import CONFIG_KEY

L = ANDREA_TINY.n_layer


def _ids(batch=2, seq=16, vocab=ANDREA_TINY.vocab_size, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq), dtype=np.int64)


def _ort(path, feeds):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def _export_module(module: nn.Module, path: Path, opset: int = 20, shape=(2, 8)) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module.eval(), (torch.randn(*shape),), dynamo=True, opset_version=opset, input_names=["x"],
            output_names=["y"], verbose=False,
        )
    program.save(path)
    return path


def _plugin_calls(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node if n.domain == "andrea")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model (seed 0), its plain export, and the plugin and fused-plugin graphs made from it."""
    torch.manual_seed(0)
    model = Andrea(ANDREA_TINY).eval()
    d = tmp_path_factory.mktemp("gelu_plugin")
    plain = export_onnx(model, d / "plain.onnx", quiet=True)
    plugin_report = apply_gelu_plugin(plain, d / "plugin.onnx")
    fused_report = apply_gelu_plugin(plain, d / "fused.onnx", fuse_bias=True)
    return model, plain, plugin_report, fused_report


def test_every_tanh_gelu_becomes_a_plugin_call(tiny):
    _, plain, report, _ = tiny
    assert (report.tanh_gelu, report.tanh_gelu_bias, report.replaced, report.erf_gelu_left) == (L, 0, L, 0)
    assert report.path.name == "plugin.onnx" and report.path.is_file()
    onnx.checker.check_model(str(report.path), full_check=True)
    model = onnx.load(str(report.path))
    assert report.path.read_bytes() == model.SerializeToString()  # the streamed write is what onnx.save writes
    counts = op_counts(model)
    assert counts["TanhGelu"] == L
    assert not any(k.startswith("Gelu") for k in counts)  # no plain Gelu left in the main graph
    assert counts["Add"] == op_counts(onnx.load(str(plain)))["Add"]
    assert report.summary() == f"plugin calls: {L} x andrea.TanhGelu"


def test_call_nodes_carry_the_plugin_identity(tiny):
    model = onnx.load(str(tiny[2].path))
    calls = [n for n in model.graph.node if n.domain == "andrea"]
    assert len(calls) == L
    for n in calls:
        attrs = {a.name: a for a in n.attribute}
        assert set(attrs) == {"plugin_namespace", "plugin_version"}  # no `aot`: see the module docstring
        assert attrs["plugin_namespace"].type == onnx.AttributeProto.STRING
        assert attrs["plugin_namespace"].s == b"andrea"
        assert attrs["plugin_version"].type == onnx.AttributeProto.STRING
        assert attrs["plugin_version"].s == b"1"
        assert n.op_type == "TanhGelu" and len(n.input) == 1 and len(n.output) == 1
    assert [n.name for n in calls] == ["node_gelu", "node_gelu_1"]  # the Gelu nodes' names are kept
    (func,) = model.functions
    assert (func.domain, func.name, list(func.input), list(func.output)) == ("andrea", "TanhGelu", ["x"], ["y"])
    (body,) = func.node
    assert (body.op_type, body.domain) == ("Gelu", "")
    assert onnx.helper.get_attribute_value(body.attribute[0]) == b"tanh"
    assert {o.domain: o.version for o in func.opset_import} == {"": 20}
    assert {o.domain: o.version for o in model.opset_import} == {"": 20, "andrea": 1}


def test_metadata_is_kept_and_says_the_pass_ran(tiny):
    _, plain, report, fused = tiny
    before = {p.key: p.value for p in onnx.load(str(plain), load_external_data=False).metadata_props}
    for r, fused_bias, ops in ((report, False, (L, 0)), (fused, True, (0, L))):
        meta = {p.key: p.value for p in onnx.load(str(r.path), load_external_data=False).metadata_props}
        assert meta[CONFIG_KEY] == before[CONFIG_KEY]
        assert set(before) <= set(meta)
        assert json.loads(meta[PLUGIN_KEY]) == {
            "plugins": {"andrea::TanhGelu": ops[0], "andrea::TanhGeluBias": ops[1]},
            "plugin_version": "1",
            "fused_bias": fused_bias,
            "erf_gelu_left": 0,
            "decomposed_tanh_gelu_left": 0,
        }


def test_onnxruntime_runs_the_plugin_graph_like_the_plain_one_and_pytorch(tiny):
    model, plain, report, fused = tiny
    ids = _ids()
    want = _ort(plain, {"input_ids": ids})
    for path in (report.path, fused.path):
        got = _ort(path, {"input_ids": ids})
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(_ort(report.path, {"input_ids": ids}), ref, rtol=1e-4, atol=1e-4)


def test_fused_bias_folds_the_add_into_the_call(tiny):
    _, plain, _, report = tiny
    assert (report.tanh_gelu, report.tanh_gelu_bias, report.not_fused) == (0, L, {})
    assert report.summary() == f"plugin calls: 0 x andrea.TanhGelu, {L} x andrea.TanhGeluBias"
    onnx.checker.check_model(str(report.path), full_check=True)
    before, after = onnx.load(str(plain)), onnx.load(str(report.path))
    assert op_counts(after)["TanhGeluBias"] == L
    assert op_counts(after)["Add"] == op_counts(before)["Add"] - L
    biases = [f"h.{i}.mlp.c_fc.bias" for i in range(L)]
    assert not [n for n in after.graph.node if n.op_type == "Add" and set(n.input) & set(biases)]
    calls = [n for n in after.graph.node if n.domain == "andrea"]
    assert [n.input[1] for n in calls] == biases
    producers = {o: n for n in after.graph.node for o in n.output}
    assert all(producers[n.input[0]].op_type == "MatMul" for n in calls)
    (func,) = after.functions
    assert (func.name, list(func.input)) == ("TanhGeluBias", ["x", "bias"])
    assert [(n.op_type, n.name) for n in func.node] == [("Add", "TanhGeluBias/Add"), ("Gelu", "TanhGeluBias/Gelu")]


def test_polygraphy_finds_plugin_and_plain_graphs_equal_on_onnxruntime(tiny):
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator, SimpleCompareFunc

    _, plain, report, fused = tiny
    runners = [
        OnnxrtRunner(SessionFromOnnx(str(plain), providers=["cpu"]), name="plain"),
        OnnxrtRunner(SessionFromOnnx(str(report.path), providers=["cpu"]), name="plugin"),
        OnnxrtRunner(SessionFromOnnx(str(fused.path), providers=["cpu"]), name="plugin-fused"),
    ]
    feeds = [{"input_ids": _ids(1, 7, seed=1)}, {"input_ids": _ids(3, 32, seed=2)}]
    results = Comparator.run(runners, data_loader=feeds)
    assert results
    accuracy = Comparator.compare_accuracy(
        results, comparisons=[(0, 1), (0, 2)],
        compare_func=SimpleCompareFunc(atol=1e-6, rtol=1e-6, check_error_stat="max"),
    )
    assert bool(accuracy)
    if not hasattr(accuracy, "keys"):  # Polygraphy >= 0.53 returns one AccuracyResult per compare function
        (accuracy,) = accuracy
    assert list(accuracy.keys()) == [("plain", "plugin"), ("plain", "plugin-fused")]
    assert all(accuracy.stats(pair) == (2, 0, 2) for pair in accuracy.keys())  # (matched, mismatched, total)


def test_tanh_gelu_module_is_converted(tmp_path):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.GELU(approximate="tanh"))
    src = _export_module(module, tmp_path / "tanh.onnx", shape=(2, 3, 8))  # 3-D: Linear is MatMul + Add
    report = apply_gelu_plugin(src)
    assert report.path == tmp_path / "tanh.plugin.onnx"  # the default name: beside the input
    assert (report.tanh_gelu, report.erf_gelu_left) == (1, 0)
    x = np.random.default_rng(0).standard_normal((2, 3, 8), dtype=np.float32)
    with torch.no_grad():
        want = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(_ort(report.path, {"x": x}), want, rtol=1e-6, atol=1e-6)
    fused = apply_gelu_plugin(src, tmp_path / "tanh.fused.onnx", fuse_bias=True)
    assert (fused.tanh_gelu, fused.tanh_gelu_bias) == (0, 1)
    np.testing.assert_allclose(_ort(fused.path, {"x": x}), want, rtol=1e-6, atol=1e-6)


def test_erf_gelu_is_left_alone_and_the_pass_refuses(tmp_path):
    src = _export_module(nn.Sequential(nn.Linear(8, 16), nn.GELU()), tmp_path / "erf.onnx")
    with pytest.raises(PluginError) as e:
        apply_gelu_plugin(src, tmp_path / "out.onnx")
    assert str(e.value) == (
        f"{src}: no Gelu(approximate='tanh') node to hand to the plugin; 1 erf GELU node(s) (Gelu, "
        "approximate='none') left alone: the plugin computes the tanh approximation only"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["erf.onnx"]  # nothing half-written


def test_only_the_tanh_gelu_of_a_mixed_graph_is_converted(tmp_path):
    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return nn.functional.gelu(self.fc(x), approximate="tanh") + nn.functional.gelu(x)

    torch.manual_seed(0)
    module = Both()
    src = _export_module(module, tmp_path / "both.onnx")
    report = apply_gelu_plugin(src, tmp_path / "both.plugin.onnx")
    assert (report.tanh_gelu, report.erf_gelu_left) == (1, 1)
    assert report.summary() == "plugin calls: 1 x andrea.TanhGelu, 1 erf Gelu(s) left alone"
    counts = op_counts(onnx.load(str(report.path)))
    assert (counts["TanhGelu"], counts["Gelu(none)"], counts["Gelu(tanh)"]) == (1, 1, 0)
    assert json.loads(ir.load(report.path).metadata_props[PLUGIN_KEY])["erf_gelu_left"] == 1
    x = np.random.default_rng(0).standard_normal((2, 8), dtype=np.float32)
    with torch.no_grad():
        want = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(_ort(report.path, {"x": x}), want, rtol=1e-6, atol=1e-6)


def test_decomposed_tanh_gelu_is_detected_and_reported(tmp_path):
    # opset 18 has no tanh Gelu: PyTorch spells it Pow/Mul/Add/Tanh/Mul
    src = _export_module(nn.Sequential(nn.Linear(8, 16), nn.GELU(approximate="tanh")), tmp_path / "o18.onnx", opset=18)
    assert "Tanh" in op_counts(onnx.load(str(src))) and "Gelu(tanh)" not in op_counts(onnx.load(str(src)))
    with pytest.raises(PluginError) as e:
        apply_gelu_plugin(src, tmp_path / "out.onnx")
    assert str(e.value) == (
        f"{src}: no Gelu(approximate='tanh') node to hand to the plugin; 1 decomposed tanh-GELU subgraph(s) (a "
        "Tanh fed by the GELU constants, e.g. node 'node_Tanh_7') are not converted: export with opset >= 20, "
        "where tanh-GELU is one Gelu node"
    )


def test_decomposed_tanh_gelu_beside_a_gelu_node_is_counted(tmp_path):
    # one Gelu(tanh) node and one hand-written x*(0.5 + 0.5*tanh(x*(0.0356774*x*x + 0.7978846))) (NVIDIA's form)
    model = onnx.parser.parse_model(
        """
        <ir_version: 10, opset_import: ["" : 20]>
        g (float[2, 4] x) => (float[2, 4] y, float[2, 4] z)
        <float b = {0.7978846}, float c = {0.0356774}, float half = {0.5}>
        {
            y = Gelu <approximate = "tanh"> (x)
            x2 = Mul(x, x)
            cx2 = Mul(c, x2)
            inner = Add(cx2, b)
            arg = Mul(x, inner)
            t = Tanh(arg)
            ht = Mul(half, t)
            s = Add(half, ht)
            z = Mul(x, s)
        }
        """
    )
    report = apply_gelu_plugin(model)
    assert (report.tanh_gelu, report.decomposed_tanh_gelu, report.path) == (1, 1, None)
    assert report.summary() == "plugin calls: 1 x andrea.TanhGelu, 1 decomposed tanh-GELU(s) NOT converted"
    assert isinstance(report.model, onnx.ModelProto)
    assert [n.op_type for n in model.graph.node][0] == "Gelu"  # the caller's ModelProto is left as it was
    assert [n.op_type for n in report.model.graph.node][0] == "TanhGelu"
    onnx.checker.check_model(report.model, full_check=True)
    x = np.linspace(-4, 4, 8, dtype=np.float32).reshape(2, 4)
    sess = ort.InferenceSession(report.model.SerializeToString(), providers=["CPUExecutionProvider"])
    y, z = sess.run(None, {"x": x})
    np.testing.assert_allclose(y, z, rtol=1e-6, atol=1e-6)


def test_bias_add_with_another_consumer_is_not_fused(tmp_path):
    model = onnx.parser.parse_model(
        """
        <ir_version: 10, opset_import: ["" : 20]>
        g (float[2, 4] x, float[4, 3] w) => (float[2, 3] y, float[2, 3] h)
        <float[3] bias = {0.1, -0.2, 0.3}>
        {
            m = MatMul(x, w)
            h = Add(m, bias)
            y = Gelu <approximate = "tanh"> (h)
        }
        """
    )
    report = apply_gelu_plugin(ir.from_proto(model), fuse_bias=True)
    assert (report.tanh_gelu, report.tanh_gelu_bias) == (1, 0)
    assert report.not_fused == {"y": "the Add output 'h' has other consumers"}  # keyed by node name, else output
    assert isinstance(report.model, ir.Model)  # an onnx_ir.Model is rewritten in place
    assert [n.op_type for n in report.model.graph] == ["MatMul", "Add", "TanhGelu"]


def test_bias_that_is_not_over_the_last_axis_is_not_fused():
    model = onnx.parser.parse_model(
        """
        <ir_version: 10, opset_import: ["" : 20]>
        g (float[2, 3] x) => (float[2, 3] y)
        <float[2, 1] bias = {0.1, -0.2}>
        {
            h = Add(x, bias)
            y = Gelu <approximate = "tanh"> (h)
        }
        """
    )
    report = apply_gelu_plugin(model, fuse_bias=True)
    assert (report.tanh_gelu, report.tanh_gelu_bias) == (1, 0)
    assert report.not_fused == {"y": "the bias 'bias' is not 1-D (shape [2, 1])"}


def test_aot_attribute_only_when_asked():
    model = onnx.parser.parse_model(
        """
        <ir_version: 10, opset_import: ["" : 20]>
        g (float[2, 3] x) => (float[2, 3] y)
        { y = Gelu <approximate = "tanh"> (x) }
        """
    )
    (call,) = apply_gelu_plugin(model, aot=True).model.graph.node
    aot = next(a for a in call.attribute if a.name == "aot")
    assert (aot.type, aot.i) == (onnx.AttributeProto.INT, 1)


def test_the_pass_refuses_to_run_twice(tiny):
    with pytest.raises(PluginError) as e:
        apply_gelu_plugin(tiny[2].path, tiny[2].path.with_name("twice.onnx"))
    assert str(e.value) == (
        f"{tiny[2].path}: no Gelu(approximate='tanh') node to hand to the plugin; it already has {L} andrea plugin "
        "call(s): the pass has run on it"
    )


def test_missing_file(tmp_path):
    with pytest.raises(PluginError) as e:
        apply_gelu_plugin(tmp_path / "nope.onnx")
    assert str(e.value) == f"{tmp_path / 'nope.onnx'}: no such ONNX file"


def test_external_weights_stay_external(tmp_path, tiny):
    src = tmp_path / "in" / "ext.onnx"
    src.parent.mkdir()
    ir.save(ir.load(tiny[1]), src, external_data="ext.onnx.data")  # the plain export, weights outside
    src_files = {p.name: p.stat().st_mtime_ns for p in src.parent.iterdir()}
    report = apply_gelu_plugin(src, tmp_path / "out" / "ext.plugin.onnx", fuse_bias=True)
    assert report.tanh_gelu_bias == L
    assert sorted(p.name for p in report.path.parent.iterdir()) == ["ext.plugin.onnx", "ext.plugin.onnx.data"]
    assert {p.name: p.stat().st_mtime_ns for p in src.parent.iterdir()} == src_files  # the input is untouched
    assert report.path.stat().st_size < 100_000  # the weights are in the .data file, not inline
    onnx.checker.check_model(str(report.path), full_check=True)
    ids = _ids(seed=3)
    np.testing.assert_allclose(_ort(report.path, {"input_ids": ids}), _ort(src, {"input_ids": ids}), rtol=0, atol=1e-6)


def test_tensorrt_rtx_parser_expands_the_function_into_native_layers(tiny):
    trt = pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'andrea-export[rtx]')")
    for path in (tiny[2].path, tiny[3].path):
        logger = trt.Logger(trt.Logger.ERROR)
        builder = trt.Builder(logger)
        network = builder.create_network(network_flags(trt))
        parser = trt.OnnxParser(network, logger)
        assert parser.parse_from_file(str(path)), [parser.get_error(i).desc() for i in range(parser.num_errors)]
        layers = [network.get_layer(i) for i in range(network.num_layers)]
        kinds = Counter(layer.type for layer in layers)
        assert not [t for t in kinds if "PLUGIN" in str(t)]  # no plugin is registered: no plugin layer
        activations = []
        for layer in layers:
            if layer.type == trt.LayerType.ACTIVATION:
                layer.__class__ = trt.IActivationLayer
                activations.append(layer.type)
        assert activations.count(trt.ActivationType.GELU_TANH) == L


@pytest.mark.slow
def test_full_size_andrea_120m(tmp_path):
    torch.manual_seed(0)
    src = export_onnx(Andrea(ANDREA_120M), tmp_path / "andrea-120m.onnx", quiet=True)
    t0 = time.perf_counter()
    report = apply_gelu_plugin(src, tmp_path / "andrea-120m.plugin.onnx")
    seconds = time.perf_counter() - t0
    assert (report.tanh_gelu, report.erf_gelu_left) == (ANDREA_120M.n_layer, 0) == (12, 0)
    assert _plugin_calls(onnx.load(str(report.path), load_external_data=False)) == Counter({"TanhGelu": 12})
    assert abs(report.path.stat().st_size - src.stat().st_size) < 100_000  # the weights once, as before
    print(f"gelu plugin pass on ANDREA-120M: {seconds:.1f} s")
