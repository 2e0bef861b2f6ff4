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


def _dq_graph(q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None = None, constant: bool = False,
              **attrs) -> onnx.ModelProto:
    """x [1, K] @ DequantizeLinear(q [K, N], scale) -> y: a weight's dequantization. `constant`: the weight and
    its scale are Constant nodes instead of initializers (TensorRT takes both as weights)."""
    K, N = q.shape
    tensors = [numpy_helper.from_array(q, "w"), numpy_helper.from_array(scale.astype(np.float32), "s")]
    inputs = ["w", "s"]
    if zero is not None:
        tensors.append(numpy_helper.from_array(zero, "z"))
        inputs.append("z")
    nodes = [helper.make_node("DequantizeLinear", inputs, ["wd"], name="dq", **attrs),
             helper.make_node("MatMul", ["x", "wd"], ["y"], name="mm")]
    if constant:
        nodes = [helper.make_node("Constant", [], [t.name], value=t) for t in tensors] + nodes
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])], [] if constant else tensors)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def _activation_graph(scale: np.ndarray, constant: bool = False, scale_input: bool = False,
                      **attrs) -> onnx.ModelProto:
    """x [1, 8] -> QuantizeLinear (one scale) -> DequantizeLinear(scale) -> Relu -> y: a Q/DQ pair on an activation,
    where TensorRT takes only a per-tensor (scalar) scale. `constant`: the DequantizeLinear's scale is a Constant
    node; `scale_input`: a graph input (not a constant at all)."""
    s = numpy_helper.from_array(np.asarray(scale, dtype=np.float32), "ds")
    inits = [numpy_helper.from_array(np.array(0.05, dtype=np.float32), "qs")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])]
    nodes = [helper.make_node("QuantizeLinear", ["x", "qs"], ["xq"], name="q", output_dtype=TensorProto.INT8),
             helper.make_node("DequantizeLinear", ["xq", "ds"], ["xd"], name="dq", **attrs),
             helper.make_node("Relu", ["xd"], ["y"], name="relu")]
    if constant:
        nodes.insert(0, helper.make_node("Constant", [], ["ds"], value=s))
    elif scale_input:
        inputs.append(helper.make_tensor_value_info("ds", TensorProto.FLOAT, list(s.dims)))
    else:
        inits.append(s)
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def _problems(model) -> str:
    return "\n".join(tensorrt_import_problems(model))


def _int4(shape) -> np.ndarray:
    return np.random.default_rng(0).integers(-8, 8, shape).astype(ml_dtypes.int4)


def _int8(shape) -> np.ndarray:
    return np.random.default_rng(0).integers(-127, 128, shape).astype(np.int8)


def _signed_int4_blocks() -> onnx.ModelProto:
    s = np.full((2, 8), 0.01)
    s[0, 3], s[1, 0] = -0.02, 0.0
    return _dq_graph(_int4((64, 8)), s, axis=0, block_size=32)


def _contrib_matmul() -> onnx.ModelProto:
    m = _dq_graph(_int8((64, 8)), np.full(8, 0.01), axis=1)
    m.graph.node[1].domain, m.graph.node[1].op_type = "com.microsoft", "MatMulNBits"
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return m


def _constant_negative_scale() -> onnx.ModelProto:
    s = np.full(8, 0.01)
    s[5] = -0.01
    return _dq_graph(_int8((64, 8)), s, constant=True, axis=1)


# rule -> graphs that break it, each with what the refusal says (the rule's citation is checked too): each graph
# breaks that rule only, so a rule whose check is removed leaves its graphs with no problem at all
BREAKS = {
    "block": [  # what quantize.py used to give TensorRT for int8 (blocks of 64): TensorRT block-dequantizes INT4 only
        ("int8 in blocks", lambda: _dq_graph(_int8((128, 8)), np.full((2, 8), 0.01), axis=0, block_size=64),
         "block_size 64 on INT8"),
        ("blocks on an activation", lambda: _activation_graph(np.full((1, 4), 0.01), axis=1, block_size=2),
         "block_size 2 on a computed tensor")],
    "positive": [  # ONNX Runtime's symmetric int4 writes negative scales (about 4 in 10 blocks)
        ("negative and zero int4 scales", _signed_int4_blocks, "2 of 16 scales are not positive"),
        ("a negative scale in a Constant node", _constant_negative_scale, "1 of 8 scales are not positive"),
        ("a scale that is a graph input", lambda: _activation_graph(np.array(0.05), scale_input=True),
         "scale 'ds' is not a constant")],
    "zero_point": [("a nonzero zero point", lambda: _dq_graph(_int8((64, 8)), np.full(8, 0.01),
                                                              np.ones(8, dtype=np.int8), axis=1),
                    "a zero point that is not all zeros")],
    "scale_shape": [
        ("a per-channel scale on the wrong axis", lambda: _dq_graph(_int8((64, 8)), np.full(8, 0.01), axis=0),
         "1-D scale of 8 for axis 0 of size 64"),
        ("int4 blocks of the wrong count", lambda: _dq_graph(_int4((64, 8)), np.full((3, 8), 0.01), axis=0,
                                                             block_size=32), "scale shape [3, 8]")],
    "per_channel": [  # TensorRT quantizes activations per tensor only: per-channel scales are for weights
        ("per-channel scales on an activation", lambda: _activation_graph(np.full(8, 0.01), axis=1),
         "per-channel scales on 'xq', which is not a weight"),
        ("per-channel scales from a Constant node on an activation",
         lambda: _activation_graph(np.full(8, 0.01), constant=True, axis=1),
         "per-channel scales on 'xq', which is not a weight")],
    "domain": [("an ONNX Runtime contrib op", _contrib_matmul, "com.microsoft.MatMulNBits")],
}
# rule -> graphs that keep it (and every other rule): what TensorRT imports
KEEPS = {
    "block": [("int4 in blocks of 32", lambda: _dq_graph(_int4((64, 8)), np.full((2, 8), 0.01), axis=0,
                                                         block_size=32))],
    "positive": [("positive scales in a Constant node", lambda: _dq_graph(_int8((64, 8)), np.full(8, 0.01),
                                                                          constant=True, axis=1))],
    "zero_point": [("an all-zero zero point", lambda: _dq_graph(_int8((64, 8)), np.full(8, 0.01),
                                                                np.zeros(8, dtype=np.int8), axis=1))],
    "scale_shape": [("a per-channel scale on the output axis", lambda: _dq_graph(_int8((64, 8)), np.full(8, 0.01),
                                                                                axis=1))],
    "per_channel": [
        ("per-channel scales on a weight", lambda: _dq_graph(_int8((64, 8)), np.full(8, 0.01), axis=1)),
        ("per-channel scales on a Constant weight", lambda: _dq_graph(_int8((64, 8)), np.full(8, 0.01),
                                                                      constant=True, axis=1)),
        ("a per-tensor scale on an activation", lambda: _activation_graph(np.array(0.05))),
        ("a per-tensor scale from a Constant node on an activation",
         lambda: _activation_graph(np.array(0.05), constant=True))],
    "domain": [("standard ONNX ops only", lambda: _dq_graph(_int8((64, 8)), np.full(8, 0.01), axis=1))],
}


def test_every_rule_has_a_graph_that_breaks_it_and_one_that_keeps_it():
    # the slot decoder's two: broken by SLOT_BREAKS below, kept by the exported slot graph itself
    assert set(BREAKS) == set(KEEPS) == set(RULES) - {rule for rule, _, _ in SLOT_BREAKS.values()}
    assert {rule for rule, _, _ in SLOT_BREAKS.values()} == {"scatter", "attention"}


@pytest.mark.parametrize("rule, make, says", [pytest.param(r, make, says, id=f"{r}: {name}")
                                               for r, cases in BREAKS.items() for name, make, says in cases])
def test_a_graph_that_breaks_a_rule_is_refused_with_the_rule(rule, make, says):
    (problem,) = tensorrt_import_problems(make())
    assert says in problem and problem.endswith(f"[{RULES[rule]}]"), problem


@pytest.mark.parametrize("make", [pytest.param(make, id=f"{r}: {name}") for r, cases in KEEPS.items()
                                  for name, make in cases])
def test_a_graph_that_keeps_a_rule_passes(make):
    assert tensorrt_import_problems(make()) == []


def test_check_tensorrt_import_names_the_file_and_the_rule(tmp_path):
    path = tmp_path / "model.int8.qdq.onnx"
    onnx.save(_dq_graph(np.zeros((128, 8), dtype=np.int8), np.full((2, 8), 0.01), axis=0, block_size=64), str(path))
    with pytest.raises(BuildError, match=r"model.int8.qdq.onnx: TensorRT would refuse this graph:\n  node 'dq': block_size"):
        check_tensorrt_import(path)


@pytest.fixture(scope="module", params=PRECISIONS)
def tensorrt_graphs(request, tiny_model, tmp_path_factory):
    """Every graph a `--builder tensorrt` build of `precision` exports, and the ones its engines are built from."""
    from andrea_export.catalog import Artifacts
    from andrea_export.pipeline import BuildOptions, _export_decoders, _export_graphs, engine_sources

    tmp = tmp_path_factory.mktemp(f"trt-{request.param}")
    made, opts = Artifacts(tmp, request.param), BuildOptions(config="andrea-tiny", precision=request.param)
    _export_graphs(made, tiny_model, opts, "tensorrt")
    _export_decoders(made, tiny_model, opts, "tensorrt")
    return request.param, tmp, made, engine_sources(made, "tensorrt", request.param)


def test_every_graph_handed_to_full_tensorrt_passes_its_import_rules(tensorrt_graphs):
    precision, tmp, artifacts, sources = tensorrt_graphs
    assert set(sources) == {"engine", "decoder_engine"}
    for role, name in sources.items():
        assert tensorrt_import_problems(onnx.load(str(tmp / name))) == [], (precision, role, name)
    if precision in ("int8", "int4"):  # the ONNX Runtime graphs beside them are what TensorRT must not get
        assert tensorrt_import_problems(onnx.load(str(tmp / artifacts["onnx"])))


@pytest.fixture(scope="module")
def slot_graph(tiny_model, tmp_path_factory):
    from andrea_export.graphs.slot_decoder import export_slot_decoder

    return onnx.load(str(export_slot_decoder(tiny_model, tmp_path_factory.mktemp("slots") / "d.onnx", quiet=True)))


def _edited(model, edit) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    edit(copy.graph)
    return copy


def _first(g, op_type):
    return next(n for n in g.node if n.op_type == op_type)


def _set(node, **attrs):
    for name, value in attrs.items():
        for a in list(node.attribute):
            if a.name == name:
                node.attribute.remove(a)
        node.attribute.append(helper.make_attribute(name, value))


def _cast_the_past(g):  # the cache reaches its TensorScatter through a Cast: not the network input itself
    scatter = _first(g, "TensorScatter")
    g.node.insert(0, helper.make_node("Identity", [scatter.input[0]], ["copied_past"], name="copy"))
    scatter.input[0] = "copied_past"


def _copy_the_present(g):  # the present output is a copy of the TensorScatter's result
    scatter = _first(g, "TensorScatter")
    produced = scatter.output[0]
    scatter.output[0] = "scattered"
    for n in g.node:
        n.input[:] = ["scattered" if i == produced else i for i in n.input]
    g.node.append(helper.make_node("Identity", ["scattered"], [produced], name="copy"))


def _dynamic_cache(g):
    for v in [*g.input, *g.output]:
        if v.name.startswith(("past_key_values.", "present.")):
            v.type.tensor_type.shape.dim[2].dim_param = "capacity"


def _nonpad(g):
    lengths = helper.make_tensor_value_info("lengths", TensorProto.INT64, ["batch"])
    g.input.append(lengths)
    node = _first(g, "Attention")
    node.input.extend(["", "", "lengths"])


SLOT_BREAKS = {  # name -> (rule, edit of the exported slot graph, what the problem says)
    "axis": ("scatter", lambda g: _set(_first(g, "TensorScatter"), axis=2), "axis 2"),
    "circular": ("scatter", lambda g: _set(_first(g, "TensorScatter"), mode="circular"), "mode"),
    "past-copied": ("scatter", _cast_the_past, "is not a graph input"),
    "present-copied": ("scatter", _copy_the_present, "is not a graph output"),
    "dynamic-cache": ("scatter", _dynamic_cache, "no static sequence length"),
    "is-causal": ("attention", lambda g: _set(_first(g, "Attention"), is_causal=1), "is_causal"),
    "softmax-precision": ("attention", lambda g: _set(_first(g, "Attention"), softmax_precision=1),
                          "attributes TensorRT refuses or ignores"),
    "nonpad": ("attention", _nonpad, "nonpad_kv_seqlen"),
    "no-mask": ("attention", lambda g: _first(g, "Attention").input.__setitem__(3, ""), "attn_mask must all be given"),
}


@pytest.mark.parametrize("case", SLOT_BREAKS)
def test_slot_graph_rules_refuse_what_tensorrt_would_ignore_or_refuse(slot_graph, case):
    rule, edit, says = SLOT_BREAKS[case]
    assert tensorrt_import_problems(slot_graph) == []
    problems = tensorrt_import_problems(_edited(slot_graph, edit))
    assert problems and says in problems[0] and problems[0].endswith(f"[{RULES[rule]}]"), problems


def test_slot_graph_needs_tensorrt_10_15(slot_graph, tiny_onnx):
    from andrea_export.engine.onnx_rules import required_version

    assert required_version(slot_graph) == (10, 15)
    assert required_version(onnx.load(str(tiny_onnx), load_external_data=False)) is None


@pytest.mark.parametrize("version, refused", [("10.9.0.34", True), ("10.14.1.48", True), ("10.15.0.1", False),
                                              ("11.1.0.106", False)])
def test_the_slot_graph_is_refused_by_a_tensorrt_older_than_10_15(slot_graph, version, refused):
    from andrea_export.engine.onnx_rules import check_tensorrt_version

    if refused:
        with pytest.raises(BuildError, match=r"d.onnx: its (Attention, )?TensorScatter import\(s\) from TensorRT 10.15 on, and this "
                                             rf"is TensorRT {version}"):
            check_tensorrt_version(slot_graph, version, "d.onnx")
    else:
        check_tensorrt_version(slot_graph, version, "d.onnx")
