"""fp16 / bf16 ONNX graphs from the fp32 export, and the names of every precision (the weight-only int8 / int4
graphs are quantize.py's, through ONNX Runtime's quantizer; what verification allows each precision is
verify/thresholds.py's).

TensorRT 11 and TensorRT-RTX are strongly typed: an engine computes in the types its ONNX graph
declares (there are no FP16/BF16 builder flags any more), so a half-precision engine starts from a
half-precision graph. `convert_precision` writes one:

- every float32 weight and activation becomes fp16 or bf16, the tied embedding included (still ONE
  initializer, read by the token Gather and, transposed, by the output projection);
- LayerNormalization and Softmax stay float32, with their scale/bias in float32 and a Cast on each
  side: their statistics (mean, variance, the exp-sum over the keys) are where half precision loses
  accuracy or overflows (NVIDIA/TensorRT#2781);
- the input stays int64 token ids; the `logits` output stays **float32** (one Cast after the last
  MatMul, which TensorRT fuses into that GEMM's epilogue). Why: every consumer (Polygraphy, numpy,
  Triton clients, a sampler's softmax over 8449 logits) then sees the same output type whatever the
  engine's precision; numpy has no bf16 type, and the extra output bytes are small beside the weights.

Why our own pass, and not the alternatives (measured on this project's graphs):
- NVIDIA ModelOpt AutoCast (`nvidia-modelopt[onnx]` 0.47): its onnx extra pins onnx~=1.21 (we use
  1.23), onnxruntime-gpu~=1.24 on Linux (clashes with the CPU onnxruntime), cupy-cuda12x and lief:
  far more weight and conflict than a short pass, for a graph this regular.
- onnxconverter-common 1.16 `convert_float_to_float16(keep_io_types=True, op_block_list=[...])`:
  fp16 only (no bf16); same accuracy as this pass (see verify/thresholds.py), but it stores LayerNorm's scale
  and bias in fp16 and casts them up at run time (125 Casts in the 120M graph against our 75), so
  it buys nothing.

The pass works on the ONNX protobuf directly, on any graph of standard ops; nodes that call model-local
functions (the plugin graph's `andrea::TanhGelu`) are type-polymorphic and are left as they are.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import ConfigError, ExportError
from ..folder.atomic import staging
from ..folder.reader import metadata_json
from ..names import KV_LAYOUT_KEY, LOGITS, PRECISION_KEY, PRECISIONS, WEIGHT_ONLY

ONNX_TYPE = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
KEEP_FP32 = ("LayerNormalization", "Softmax")  # ops whose statistics stay float32
FP32_OUTPUTS = (LOGITS,)  # stays float32 whatever the precision; other float I/O (the KV cache) follows it



def convert_precision(onnx_in: str | Path, onnx_out: str | Path, precision: str, head_bits: int | None = None,
                      solved=None) -> Path:
    """Write `onnx_out`: the graph of `onnx_in` (an fp32 export) computing in `precision` (int4: its tied head at
    `head_bits`, quantize.choose_head_bits, and its weights `solved`, quantize.solve_int4).

    precision: "fp16" or "bf16" ("fp32" copies the graph unchanged, with the metadata set).
    Weights go to `<onnx_out>.data` when the input kept them externally. Written atomically.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision in WEIGHT_ONLY:  # not a float type: ONNX Runtime's quantizer writes those graphs
        from .quantize import quantize_weights

        return quantize_weights(onnx_in, onnx_out, precision, head_bits, solved)
    onnx_in, onnx_out = Path(onnx_in), Path(onnx_out)
    if not onnx_in.is_file():
        raise ExportError(f"{onnx_in}: no such ONNX file")
    model = onnx.load(str(onnx_in))  # weights included (external data too)
    external = any(
        t.data_location == TensorProto.EXTERNAL for t in onnx.load(str(onnx_in), load_external_data=False).graph.initializer
    )
    meta = {p.key: p.value for p in model.metadata_props}
    if meta.get(PRECISION_KEY, "fp32") != "fp32":
        raise ExportError(f"{onnx_in}: is already a {meta[PRECISION_KEY]} graph; convert from the fp32 export")
    if precision != "fp32":
        model = _lower(model, ONNX_TYPE[precision])
        if KV_LAYOUT_KEY in meta:  # a KV-cache decoder: its cache inputs/outputs are now half precision
            from .kvcache import KVLayout

            layout = KVLayout.from_dict(metadata_json(meta, KV_LAYOUT_KEY, onnx_in), source=f"{onnx_in} metadata")
            layout = dataclasses.replace(layout, cache_dtype={"fp16": "float16", "bf16": "bfloat16"}[precision])
            _set_meta(model, KV_LAYOUT_KEY, json.dumps(layout.to_dict(), sort_keys=True))
    _set_meta(model, PRECISION_KEY, precision)
    with staging(onnx_out.parent) as tmp:
        kw: dict[str, Any] = dict(save_as_external_data=True, location=onnx_out.name + ".data") if external else {}
        onnx.save(model, str(tmp / onnx_out.name), **kw)
        try:
            onnx.checker.check_model(str(tmp / onnx_out.name), full_check=True)
        except Exception as e:  # a bug in this pass, not a user error: say what broke
            raise ExportError(f"{precision} graph of {onnx_in.name} does not check: {str(e).splitlines()[0]}") from e
    return onnx_out


def graph_precision(model: onnx.ModelProto) -> str:
    """The precision recorded by convert_precision ("fp32" for a plain export)."""
    return {p.key: p.value for p in model.metadata_props}.get(PRECISION_KEY, "fp32")


def _lower(model: onnx.ModelProto, dtype: int) -> onnx.ModelProto:
    g = model.graph
    fp32 = _float_tensors(model)
    inits = {t.name: t for t in g.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    # Float initializers: converted unless every reader keeps float32; a mixed one keeps its float32
    # original for the float32 readers and gets a converted twin for the others.
    twin: dict[str, str] = {}
    new_inits = []
    for t in g.initializer:
        if t.data_type != TensorProto.FLOAT:
            new_inits.append(t)
            continue
        keep = [n.op_type in KEEP_FP32 for n in consumers.get(t.name, [])]
        if keep and all(keep):
            new_inits.append(t)
        elif any(keep):
            new_inits.append(t)
            twin[t.name] = f"{t.name}__{_suffix(dtype)}"
            new_inits.append(_convert_tensor(t, dtype, twin[t.name]))
        else:
            new_inits.append(_convert_tensor(t, dtype, t.name))
    kept32 = {t.name for t in new_inits if t.data_type == TensorProto.FLOAT}

    nodes = []
    # float32 outputs that stay float32 (logits); the others (a KV cache's present.*) take the new type
    outputs = {o.name for o in g.output if o.type.tensor_type.elem_type == TensorProto.FLOAT and o.name in FP32_OUTPUTS}
    for n in g.node:
        if n.op_type in KEEP_FP32 and n.domain in ("", "ai.onnx"):
            for k, name in enumerate(n.input):
                if name and name in fp32 and name not in kept32:
                    cast = f"{name}__to_fp32_{n.name or id(n)}"
                    nodes.append(helper.make_node("Cast", [name], [cast], to=TensorProto.FLOAT, name=f"{cast}_cast"))
                    n.input[k] = cast
            nodes.append(n)
            for k, name in enumerate(n.output):
                if name and name in fp32 and name not in outputs:
                    n.output[k] = f"{name}__fp32"
                    nodes.append(helper.make_node("Cast", [n.output[k]], [name], to=dtype, name=f"{name}__from_fp32"))
            continue
        for k, name in enumerate(n.input):
            if name in twin:
                n.input[k] = twin[name]
        _retype_attributes(n, dtype)
        nodes.append(n)
        for k, name in enumerate(n.output):  # a float32 graph output: computed in dtype, cast back
            if name in outputs:
                n.output[k] = f"{name}__{_suffix(dtype)}"
                nodes.append(helper.make_node("Cast", [n.output[k]], [name], to=TensorProto.FLOAT, name=f"{name}__to_fp32"))
    for v in list(g.input) + list(g.output):  # float I/O but logits (a KV cache) is stored in the new type
        tt = v.type.tensor_type
        if tt.elem_type == TensorProto.FLOAT and v.name not in inits and v.name not in FP32_OUTPUTS:
            tt.elem_type = dtype
    del g.node[:]
    g.node.extend(nodes)
    del g.initializer[:]
    g.initializer.extend(new_inits)
    del g.value_info[:]  # re-derived by shape inference at the check
    return model


def _float_tensors(model: onnx.ModelProto) -> set[str]:
    """Names of all float32 tensors of the (fp32) graph, by shape inference on its structure."""
    light = onnx.ModelProto()
    light.CopyFrom(model)
    for t in light.graph.initializer:  # types and shapes only: don't copy 369 MB of weights around
        t.ClearField("raw_data")
        t.ClearField("float_data")
        t.ClearField("int64_data")
        t.ClearField("int32_data")
        t.ClearField("double_data")
        t.ClearField("external_data")
        t.data_location = TensorProto.DEFAULT
    inferred = onnx.shape_inference.infer_shapes(light, strict_mode=False)
    g = inferred.graph
    out = {t.name for t in g.initializer if t.data_type == TensorProto.FLOAT}
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            out.add(vi.name)
    return out


def _retype_attributes(n: onnx.NodeProto, dtype: int) -> None:
    """float32 inside a node's attributes: Cast(to=FLOAT), Constant/ConstantOfShape float values, dtype=FLOAT."""
    for a in n.attribute:
        if a.name in ("to", "dtype") and a.type == onnx.AttributeProto.INT and a.i == TensorProto.FLOAT:
            a.i = dtype
        elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
            a.t.CopyFrom(_convert_tensor(a.t, dtype, a.t.name))
        elif n.op_type == "Constant" and a.name in ("value_float", "value_floats"):
            raise ExportError(f"node '{n.name}': Constant {a.name} cannot be lowered; export with tensor constants")


def _convert_tensor(t: TensorProto, dtype: int, name: str) -> TensorProto:
    a = numpy_helper.to_array(t).astype(np.float32)
    import ml_dtypes  # a dependency of onnx itself

    with np.errstate(over="ignore"):  # overflow is reported below, by name
        b = a.astype(np.float16 if dtype == TensorProto.FLOAT16 else ml_dtypes.bfloat16)
    overflow = np.isinf(b.astype(np.float32)) & np.isfinite(a)
    if overflow.any():
        raise ExportError(
            f"initializer '{t.name}': {int(overflow.sum())} value(s) exceed the {_suffix(dtype)} range "
            f"(max |x| = {float(np.abs(a[np.isfinite(a)]).max()):.4g}); keep this model in fp32"
        )
    return numpy_helper.from_array(b, name)


def _suffix(dtype: int) -> str:
    names: dict[int, str] = {TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16", TensorProto.FLOAT: "fp32"}
    return names[dtype]


def _set_meta(model: onnx.ModelProto, key: str, value: str) -> None:
    for p in model.metadata_props:
        if p.key == key:
            p.value = value
            return
    model.metadata_props.add(key=key, value=value)


def emulate_in_fp32(model: onnx.ModelProto) -> onnx.ModelProto:
    """A float32 graph that reproduces a fp16/bf16 graph's rounding, for CPUs without such kernels.

    ONNX Runtime's CPU provider has fp16 kernels for this graph but no bf16 kernels at all (its first
    bf16 Add fails with NOT_IMPLEMENTED). This rewrite computes every half-precision op in float32 and
    rounds each result to the half type and back (Cast, Cast), the weights being exact in float32:
    the arithmetic of a GPU GEMM with float32 accumulation and a half-precision output. Used by the
    tests and verification to measure bf16 graphs on a CPU; it is not an export format.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    half = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
    low = {}  # tensor name -> its half type
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    for vi in list(inferred.value_info) + list(inferred.output):
        if vi.type.tensor_type.elem_type in half:
            low[vi.name] = vi.type.tensor_type.elem_type
    inits = []
    for t in g.initializer:
        inits.append(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name) if t.data_type in half else t)
    del g.initializer[:]
    g.initializer.extend(inits)
    nodes = []
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type in half:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32), a.t.name))
        if n.op_type == "Cast":  # Cast(to=half) -> rounds; emitted below as Cast(to=half), Cast(to=float)
            for a in n.attribute:
                if a.name == "to" and a.i in half:
                    a.i = TensorProto.FLOAT
                    n.op_type = "Identity"
                    del n.attribute[:]
                    break
        nodes.append(n)
        for k, name in enumerate(n.output):
            if name in low:
                n.output[k] = f"{name}__unrounded"
                nodes.append(helper.make_node("Cast", [n.output[k]], [f"{name}__half"], to=low[name]))
                nodes.append(helper.make_node("Cast", [f"{name}__half"], [name], to=TensorProto.FLOAT))
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]
    for i in g.input:  # a half-precision input (a KV cache) is fed widened to float32: exact, the values being half
        if i.type.tensor_type.elem_type in half:
            i.type.tensor_type.elem_type = TensorProto.FLOAT
    for o in g.output:
        if o.type.tensor_type.elem_type in half:
            o.type.tensor_type.elem_type = TensorProto.FLOAT
    return out
