"""Graph pass: hand every tanh-GELU of an ONNX graph to the TensorRT plugin, in a file that still runs anywhere.

Each `Gelu(approximate="tanh")` becomes a call of the model-local ONNX function `andrea.TanhGelu`
(or, with `fuse_bias=True`, the `Add(x, bias)` feeding it becomes part of a call of `andrea.TanhGeluBias`):

    y = andrea.TanhGelu(x)            <plugin_namespace="andrea", plugin_version="1">
        body: y = Gelu<approximate="tanh">(x)
    y = andrea.TanhGeluBias(x, bias)  <plugin_namespace="andrea", plugin_version="1">
        body: y = Gelu<approximate="tanh">(Add(x, bias))

Who runs what (research/tensorrt-facts.md §1.3):
- ONNX Runtime, onnx.reference, any ONNX consumer: the function body, i.e. the standard ops. Same numbers as
  the plain graph.
- TensorRT >= 10.7 with the plugin `andrea::TanhGelu` v1 registered: the call node has a `plugin_namespace`
  attribute and the registry has the creator, so the parser imports it as ONE plugin layer.
- TensorRT without the plugin, TensorRT-RTX (no plugin layers at all): the local function is expanded into
  native layers (the body's `Gelu` is the native kGELU_TANH activation).
- TensorRT <= 10.6: the local function wins even when the plugin is registered, SILENTLY. Whoever builds a
  plugin engine must check that plugin layers exist, not only that the parse succeeded.

No `aot` attribute by default: TensorRT's Python quick-plugin creator picks the AOT path by itself when the
plugin defines only `aot_impl` (ours: the kernel is PTX embedded in the engine, facts §2.3), and an `aot=1`
attribute would turn a plugin registered with a JIT `impl` (a debugging/reference registration) into a hard
parse error. `aot=True/False` writes the attribute for a registration that defines both.

The rewrite is done with onnx-ir: weights are never touched (initializers stay the same tensor objects, and
external data is memory-mapped and streamed to the new file). An inline file is written one initializer at a
time, byte-identical to `onnx.save` (ANDREA-120M, 369 MB inline: peak RSS about 1.1 GB instead of 2.2 GB;
with external data about 0.35 GB). Files are written atomically (folder.atomic.staging) and fully checked first.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Union

import onnx
import onnx_ir as ir

from ..errors import ExportError, PluginError
from ..folder.atomic import staging
from ..names import PLUGIN_KEY
from ..plugin import GELU_BIAS_OP, GELU_OP, PLUGIN_NAMESPACE, PLUGIN_VERSION

FUNCTION_VERSION = 1  # opset version of the model-local domain "andrea"

# Constants that give a decomposed tanh-GELU away: 0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x^3))).
_GELU_CONSTANTS = (math.sqrt(2 / math.pi), 0.044715, 0.044715 * math.sqrt(2 / math.pi))

ModelLike = Union[str, Path, onnx.ModelProto, ir.Model]


@dataclasses.dataclass
class GeluPluginReport:
    """What the pass did.

    tanh_gelu / tanh_gelu_bias: plugin calls written (`andrea.TanhGelu` / `andrea.TanhGeluBias`).
    erf_gelu_left: exact GELUs (`Gelu`, approximate="none") left alone: the plugin computes tanh-GELU only.
    decomposed_tanh_gelu: tanh-GELUs spelled as Mul/Pow/Tanh subgraphs (older opsets), detected, NOT converted.
    not_fused: with fuse_bias, the Gelu nodes whose feeding Add could not be fused, and why.
    path: the file written (None when the model was returned in memory).
    model: the rewritten model when no file was written (same kind as given: ModelProto or onnx_ir.Model).
    """

    tanh_gelu: int = 0
    tanh_gelu_bias: int = 0
    erf_gelu_left: int = 0
    decomposed_tanh_gelu: int = 0
    fuse_bias: bool = False
    not_fused: dict[str, str] = dataclasses.field(default_factory=dict)
    path: Path | None = None
    model: onnx.ModelProto | ir.Model | None = dataclasses.field(default=None, repr=False)

    @property
    def replaced(self) -> int:
        """Plugin calls written in all."""
        return self.tanh_gelu + self.tanh_gelu_bias

    def metadata(self) -> dict:
        """What goes into the model's `andrea.plugin` metadata."""
        return {
            "plugins": {
                f"{PLUGIN_NAMESPACE}::{GELU_OP}": self.tanh_gelu,
                f"{PLUGIN_NAMESPACE}::{GELU_BIAS_OP}": self.tanh_gelu_bias,
            },
            "plugin_version": PLUGIN_VERSION,
            "fused_bias": self.fuse_bias,
            "erf_gelu_left": self.erf_gelu_left,
            "decomposed_tanh_gelu_left": self.decomposed_tanh_gelu,
        }

    def summary(self) -> str:
        parts = [f"{self.tanh_gelu} x {PLUGIN_NAMESPACE}.{GELU_OP}"]
        if self.fuse_bias:
            parts.append(f"{self.tanh_gelu_bias} x {PLUGIN_NAMESPACE}.{GELU_BIAS_OP}")
        if self.not_fused:
            parts.append(f"{len(self.not_fused)} Add(s) not fused")
        if self.erf_gelu_left:
            parts.append(f"{self.erf_gelu_left} erf Gelu(s) left alone")
        if self.decomposed_tanh_gelu:
            parts.append(f"{self.decomposed_tanh_gelu} decomposed tanh-GELU(s) NOT converted")
        return "plugin calls: " + ", ".join(parts)


def apply_gelu_plugin(
    model_or_path: ModelLike,
    out_path: str | Path | None = None,
    *,
    fuse_bias: bool = False,
    aot: bool | None = None,
) -> GeluPluginReport:
    """Turn each `Gelu(approximate="tanh")` into a call of the plugin's model-local function.

    Args:
        model_or_path: an ONNX file (inline or external weights), an `onnx.ModelProto` or an `onnx_ir.Model`.
        out_path: where to write the result (atomically; external weights stay external, in
            `<out_path>.data`). Default for a file input: `<stem>.plugin.onnx` beside it. For an in-memory
            input without `out_path`, nothing is written: `report.model` holds the result (an
            `onnx_ir.Model` input is rewritten in place; a `ModelProto` input is left as it was).
        fuse_bias: also fold an `Add(x, bias)` feeding the Gelu into `andrea.TanhGeluBias(x, bias)`, where
            bias is a 1-D constant over the last axis of x and the Add's output feeds nothing else.
        aot: None (default) writes no `aot` attribute; True/False writes aot=1/0 (TensorRT STRICT_AOT/JIT).
    Returns:
        A GeluPluginReport with the counts.
    Raises:
        PluginError: the graph has no `Gelu(approximate="tanh")` node (the message says what GELUs it has).
    """
    model, src_path = _load(model_or_path)
    report = GeluPluginReport(fuse_bias=fuse_bias)
    _rewrite(model, report, str(src_path or "the model"), fuse_bias=fuse_bias, aot=aot)

    if out_path is not None:
        out = Path(out_path)
    elif src_path is not None:
        out = src_path.with_name(src_path.stem + ".plugin.onnx")
    else:
        report.model = ir.to_proto(model) if isinstance(model_or_path, onnx.ModelProto) else model
        return report
    external = any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())
    with staging(out.parent) as tmp:
        staged = tmp / out.name
        if external:  # the memory-mapped weights are streamed to the new data file
            ir.save(model, staged, external_data=f"{out.name}.data")
        else:
            proto = ir.to_proto(model)
            del model  # our last hold on a loaded file's tensors: frees them before the write
            _save_streaming(proto, staged)
            del proto
        _check(staged)
    report.path = out
    return report


def _load(model_or_path: ModelLike) -> tuple[ir.Model, Path | None]:
    if isinstance(model_or_path, ir.Model):
        return model_or_path, None
    if isinstance(model_or_path, onnx.ModelProto):
        return ir.from_proto(model_or_path), None  # wraps the weight tensors, copies none
    path = Path(model_or_path)
    if not path.is_file():
        raise PluginError(f"{path}: no such ONNX file")
    try:
        return ir.load(path), path  # external weights are memory-mapped, not read
    except Exception as e:  # protobuf parse errors have no public type
        raise PluginError(f"{path}: not an ONNX model ({type(e).__name__}: {e})") from None


def _rewrite(model: ir.Model, report: GeluPluginReport, where: str, *, fuse_bias: bool, aot: bool | None) -> None:
    tanh: list[ir.Node] = []
    erf = calls = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type == "Gelu" and node.domain in ("", "ai.onnx"):
            approx = node.attributes.get_string("approximate", "none")
            if approx == "tanh":
                tanh.append(node)
            else:
                erf += 1
        elif node.domain == PLUGIN_NAMESPACE and node.op_type in (GELU_OP, GELU_BIAS_OP):
            calls += 1
    decomposed = _find_decomposed_tanh_gelu(model)
    report.erf_gelu_left, report.decomposed_tanh_gelu = erf, len(decomposed)
    if not tanh:
        raise PluginError(_nothing_to_do(where, erf, decomposed, calls))

    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    if opset is None or opset < 20:
        raise PluginError(f"{where}: default-domain opset is {opset}; Gelu needs opset >= 20")
    attrs = [ir.AttrString("plugin_namespace", PLUGIN_NAMESPACE), ir.AttrString("plugin_version", PLUGIN_VERSION)]
    if aot is not None:
        attrs.append(ir.AttrInt64("aot", int(aot)))

    for gelu in tanh:
        x, graph = gelu.inputs[0], gelu.graph
        if x is None or graph is None:
            raise PluginError(f"{where}: Gelu node '{gelu.name}' has no input or is in no graph")
        add, bias, why = _fusable_add(x) if fuse_bias else (None, None, "")
        if why:
            report.not_fused[gelu.name or gelu.outputs[0].name or "?"] = why
        if add is not None and bias is not None:
            x_in = add.inputs[0] if add.inputs[1] is bias else add.inputs[1]
            op, inputs, old = GELU_BIAS_OP, [x_in, bias], [add, gelu]
            report.tanh_gelu_bias += 1
        else:
            op, inputs, old = GELU_OP, [x], [gelu]
            report.tanh_gelu += 1
        call = ir.Node(
            PLUGIN_NAMESPACE, op, inputs, attributes=attrs, name=gelu.name, num_outputs=1,
            metadata_props=dict(gelu.metadata_props), doc_string=gelu.doc_string,
        )
        ir.convenience.replace_nodes_and_values(graph, gelu, old, [call], gelu.outputs, call.outputs)

    model.opset_imports[PLUGIN_NAMESPACE] = FUNCTION_VERSION
    if report.tanh_gelu:
        _add_function(model, GELU_OP, opset, with_bias=False)
    if report.tanh_gelu_bias:
        _add_function(model, GELU_BIAS_OP, opset, with_bias=True)
    model.metadata_props[PLUGIN_KEY] = json.dumps(report.metadata(), sort_keys=True)


def _fusable_add(x: ir.Value) -> tuple[ir.Node | None, ir.Value | None, str]:
    """The Add(x, bias) producing `x` if it may be folded into TanhGeluBias: (add, bias, "") or (None, None, why)."""
    add = x.producer()
    if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx"):
        return None, None, "the Gelu's input is not made by an Add"
    if x.is_graph_output() or len(x.uses()) != 1:
        return None, None, f"the Add output '{x.name}' has other consumers"
    for i in (1, 0):
        bias, other = add.inputs[i], add.inputs[1 - i]
        if bias is None or other is None:
            break
        tensor = _constant(bias)
        if tensor is None or bias.is_graph_input():
            continue
        if len(tensor.shape) != 1:
            return None, None, f"the bias '{bias.name}' is not 1-D (shape {list(tensor.shape)})"
        last = other.shape[-1] if other.shape is not None and len(other.shape) else None
        if not isinstance(last, int):
            return None, None, f"the last axis of '{other.name}' is not known"
        if last != tensor.shape[0]:
            return None, None, f"the bias '{bias.name}' has {tensor.shape[0]} values, the last axis of '{other.name}' {last}"
        if other.dtype is not None and other.dtype != tensor.dtype:
            return None, None, f"the bias '{bias.name}' is {tensor.dtype}, '{other.name}' is {other.dtype}"
        return add, bias, ""
    return None, None, "neither input of the Add is a constant"


def _constant(value: ir.Value):
    try:
        return ir.convenience.get_const_tensor(value)
    except ValueError:
        return None


def _add_function(model: ir.Model, op: str, opset: int, *, with_bias: bool) -> None:
    x = ir.Value(name="x")
    inputs = [x]
    if with_bias:
        bias = ir.Value(name="bias")
        inputs.append(bias)
        add = ir.node("Add", [x, bias], num_outputs=1, name=f"{op}/Add")  # TensorRT names its layers after these
        add.outputs[0].name = "x_plus_bias"
        nodes, gelu_in = [add], add.outputs[0]
    else:
        nodes, gelu_in = [], x
    gelu = ir.node("Gelu", [gelu_in], attributes={"approximate": "tanh"}, num_outputs=1, name=f"{op}/Gelu")
    gelu.outputs[0].name = "y"
    nodes.append(gelu)
    graph = ir.Graph(inputs, gelu.outputs, nodes=nodes, opset_imports={"": opset}, name=op)
    func = ir.Function(PLUGIN_NAMESPACE, op, graph=graph, attributes=[])
    func.doc_string = (
        f"tanh-GELU{' of x + bias (bias 1-D, over the last axis)' if with_bias else ''}; "
        f"TensorRT imports the call as the plugin {PLUGIN_NAMESPACE}::{op} v{PLUGIN_VERSION} when it is registered"
    )
    model.functions[func.identifier()] = func


def _find_decomposed_tanh_gelu(model: ir.Model) -> list[str]:
    """Names of Tanh nodes fed, within a few nodes upstream, by a GELU constant (sqrt(2/pi), 0.044715 or
    their product): PyTorch's and others' Mul/Pow/Tanh spelling of tanh-GELU."""
    found: list[str] = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type == "Tanh" and node.domain in ("", "ai.onnx") and _gelu_constant_upstream(node, hops=4):
            found.append(node.name or node.outputs[0].name or "?")
    return found


def _gelu_constant_upstream(node: ir.Node, hops: int) -> bool:
    frontier, seen = [node], set()
    for _ in range(hops):
        producers = []
        for n in frontier:
            for v in n.inputs:
                if v is None or id(v) in seen:
                    continue
                seen.add(id(v))
                t = _constant(v)
                if t is not None and t.size == 1 and _is_gelu_constant(t):
                    return True
                if t is None and (p := v.producer()) is not None:
                    producers.append(p)
        frontier = producers
    return False


def _is_gelu_constant(t) -> bool:
    try:
        c = float(t.numpy().reshape(-1)[0])
    except Exception:
        return False
    return any(math.isclose(c, k, rel_tol=1e-3) for k in _GELU_CONSTANTS)


def _nothing_to_do(where: str, erf: int, decomposed: list[str], calls: int) -> str:
    msg = f"{where}: no Gelu(approximate='tanh') node to hand to the plugin"
    parts = []
    if calls:
        parts.append(f"it already has {calls} {PLUGIN_NAMESPACE} plugin call(s): the pass has run on it")
    if erf:
        parts.append(
            f"{erf} erf GELU node(s) (Gelu, approximate='none') left alone: the plugin computes the tanh approximation only"
        )
    if decomposed:
        parts.append(
            f"{len(decomposed)} decomposed tanh-GELU subgraph(s) (a Tanh fed by the GELU constants, e.g. node "
            f"'{decomposed[0]}') are not converted: export with opset >= 20, where tanh-GELU is one Gelu node"
        )
    return msg + ("; " + "; ".join(parts) if parts else "")


def _save_streaming(model: onnx.ModelProto, path: Path) -> None:
    """Write `model` as `onnx.save` would (the same bytes), one initializer at a time.

    `SerializeToString` of a 369 MB model peaks near 4x its size (the encoder's growing buffer, then the
    bytes object); here the peak is the largest tensor. Protobuf writes fields in field-number order, so
    the message is written as: model fields before `graph`, then `graph` as graph fields before
    `initializer`, each initializer, graph fields after it; then model fields after `graph`."""
    graph_no = onnx.ModelProto.DESCRIPTOR.fields_by_name["graph"].number
    init_no = onnx.GraphProto.DESCRIPTOR.fields_by_name["initializer"].number
    model_head, model_tail = _split(model, graph_no)
    graph_head, graph_tail = _split(model.graph, init_no)
    inits = model.graph.initializer
    graph_size = graph_head.ByteSize() + graph_tail.ByteSize()
    graph_size += sum(len(_key(init_no)) + len(_varint(t.ByteSize())) + t.ByteSize() for t in inits)
    with open(path, "wb") as f:
        f.write(model_head.SerializeToString())
        if model.HasField("graph"):
            f.write(_key(graph_no) + _varint(graph_size) + graph_head.SerializeToString())
            for t in inits:
                f.write(_key(init_no) + _varint(t.ByteSize()) + t.SerializeToString())
            f.write(graph_tail.SerializeToString())
        f.write(model_tail.SerializeToString())


def _split(message, number: int):
    """Two new messages of `message`'s type, with its fields numbered below / above `number` (that one left out)."""
    head, tail = type(message)(), type(message)()
    for field, value in message.ListFields():
        if field.number == number:
            continue
        dest = head if field.number < number else tail
        # `is_repeated` is new in protobuf 6; `label` is deprecated there
        if field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED:
            getattr(dest, field.name).extend(value)
        elif field.message_type is not None:
            getattr(dest, field.name).CopyFrom(value)
        else:
            setattr(dest, field.name, value)
    return head, tail


def _key(number: int) -> bytes:  # a length-delimited field's tag
    return _varint(number << 3 | 2)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _check(path: Path) -> None:
    from .layout import check_onnx

    try:
        check_onnx(path)
    except ExportError as e:
        raise PluginError(f"the plugin graph is not valid ONNX (a bug in the pass): {e}") from None
