"""TensorRT's import rules for an ONNX graph that TensorRT-RTX (the builder that runs here) does not enforce.

Full TensorRT cannot run on these machines, and RTX's parser accepts graphs that TensorRT refuses (it took
int8 block dequantization and negative int4 scales, both of which TensorRT rejects). So every graph the
pipeline hands to full TensorRT is checked against TensorRT's documented rules before the build, and the
tests run the same check on every such graph. Each rule names the header line it comes from
(TensorRT's `include/NvInfer.h`, IDequantizeLayer / IQuantizeLayer, v10.9 and v11.1; onnx-tensorrt's
`docs/operators.md` for TensorRT 10.15 and the KVCacheUpdate operator page for the slot decoder's two ops).

TensorRT-RTX imports `TensorScatter` and `Attention` with the same importer code, so the parser runs here; what
these rules add is what it takes without a word: `nonpad_kv_seqlen` dropped, `is_causal` read as upper-left
(ONNX means lower-right when the lengths differ), and a cache write that is not in place.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ..errors import BuildError

# v10.9: "block quantization (supported for DataType::kINT4 only)"; v11.1: "Block dequantization is supported
# for input types DataType::kFP4, DataType::kFP8 and DataType::kINT4". The intersection, so both import it.
BLOCK_DTYPES = {TensorProto.INT4}
RULES = {
    "block": "NvInfer.h v10.9, IDequantizeLayer: block quantization (supported for DataType::kINT4 only)",
    "positive": "NvInfer.h v10.9/v11.1, IDequantizeLayer: All scale coefficients must have (strictly) positive values",
    "zero_point": "NvInfer.h, IDequantizeLayer: zeroPt must only contain zero-valued coefficients (symmetric only)",
    "scale_shape": "NvInfer.h, IDequantizeLayer: the size of the 1D scale tensor must match the size of the "
                   "quantization axis; for block quantization the shape of scale must match the input's but in "
                   "the blocked dimension",
    "per_channel": "NvInfer.h, IDequantizeLayer: Per-channel dequantization is supported only for input that is "
                   "rooted at an IConstantLayer (i.e. weights)",
    "domain": "onnx-tensorrt imports the standard ONNX domain and registered plugins; com.microsoft contrib ops "
              "(MatMulNBits, GroupQueryAttention) are ONNX Runtime's",
    "scatter": "operators.md (10.15), TensorScatter: past_cache and update must be 4D, axis must be -2; "
               "KVCacheUpdate: the cache must be a network input with a static sequence length, the output a "
               "network output (bound to the same address), mode linear",
    "attention": "operators.md (10.15), Attention: past_key, past_value and nonpad_kv_seqlen are unsupported "
                 "(nonpad_kv_seqlen is dropped silently), present_key/present_value/qk_matmul_output outputs are "
                 "unsupported, Q, K, V and attn_mask must be 4D; is_causal imports as upper-left (ONNX: "
                 "lower-right when the query is shorter), so a causal mask is given as attn_mask",
}
# The first TensorRT whose ONNX parser maps each op onto its layer (NvInfer.h across release branches).
SINCE = {"Attention": (10, 14), "TensorScatter": (10, 15)}


def tensorrt_import_problems(model: onnx.ModelProto) -> list[str]:
    """What in `model` full TensorRT would refuse to import, one line per problem with the rule it breaks;
    [] when nothing. Reads initializers and Constant nodes (load the graph with its external data)."""
    g = model.graph
    inits = _weights(g)
    constants = {o for n in g.node if n.op_type == "Constant" for o in n.output}
    shapes = {name: list(t.dims) for name, t in inits.items()}
    problems = _slot_problems(model)
    for n in g.node:
        where = f"node '{n.name or n.op_type}'"
        if n.domain == "com.microsoft":
            problems.append(f"{where}: {n.domain}.{n.op_type} [{RULES['domain']}]")
            continue
        if n.op_type not in ("DequantizeLinear", "QuantizeLinear"):
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        block = int(attrs.get("block_size", 0))
        axis = int(attrs.get("axis", 1))
        x, scale = n.input[0], n.input[1]
        zero = n.input[2] if len(n.input) > 2 and n.input[2] else None
        x_type = inits[x].data_type if x in inits else None
        if block and n.op_type == "DequantizeLinear" and x_type not in BLOCK_DTYPES:
            dtype = TensorProto.DataType.Name(x_type) if x_type is not None else "a computed tensor"
            problems.append(f"{where}: block_size {block} on {dtype} [{RULES['block']}]")
        if scale in inits:
            s = numpy_helper.to_array(inits[scale]).astype(np.float64)
            if not (np.isfinite(s).all() and (s > 0).all()):
                problems.append(f"{where}: {int((~(s > 0)).sum())} of {s.size} scales are not positive "
                                f"[{RULES['positive']}]")
        elif scale not in constants:
            problems.append(f"{where}: scale '{scale}' is not a constant [{RULES['positive']}]")
        if zero is not None:
            if zero not in inits or numpy_helper.to_array(inits[zero]).any():
                problems.append(f"{where}: a zero point that is not all zeros [{RULES['zero_point']}]")
        if x in shapes and scale in shapes:
            problems += [f"{where}: {p} [{RULES['scale_shape']}]"
                         for p in _scale_shape_problems(shapes[x], shapes[scale], axis, block)]
        # TensorRT quantizes an activation per tensor only (one scalar scale): per-channel scales are for weights
        # (blocks too, which RULES['block'] refuses on a computed tensor)
        per_channel = scale in shapes and len(shapes[scale]) == 1 and shapes[scale] != [1]
        if n.op_type == "DequantizeLinear" and per_channel and x not in inits and x not in constants:
            problems.append(f"{where}: per-channel scales on '{x}', which is not a weight [{RULES['per_channel']}]")
    return problems


def required_version(model: onnx.ModelProto) -> tuple[int, int] | None:
    """The oldest TensorRT whose parser imports every op of `model` that needs a recent one (SINCE), or None."""
    needed = [SINCE[n.op_type] for n in model.graph.node if n.domain in ("", "ai.onnx") and n.op_type in SINCE]
    return max(needed) if needed else None


def parse_version(version: str) -> tuple[int, ...]:
    """(major, minor) of a TensorRT version as tensorrt.__version__ gives it; BuildError if it is not one."""
    try:
        return tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        raise BuildError(f"TensorRT reports the version {version!r}, which is not major.minor...") from None


def check_tensorrt_version(model: onnx.ModelProto, version: str, source) -> None:
    """Refuse to build `model` with a TensorRT (`version`, as tensorrt.__version__ says it) older than the ops in it
    need: the slot decoder's TensorScatter imports from 10.15 on (the batch-1 decoder engine builds on older ones)."""
    need = required_version(model)
    have = parse_version(version)
    if need is not None and have < need:
        ops = sorted({n.op_type for n in model.graph.node if n.op_type in SINCE and SINCE[n.op_type] > have})
        raise BuildError(f"{Path(str(source)).name}: its {', '.join(ops)} import(s) from TensorRT {need[0]}.{need[1]} on, "
                         f"and this is TensorRT {version}: install tensorrt>={need[0]}.{need[1]} for this engine (the "
                         "batch-1 decoder engine builds with older ones)")


def _slot_problems(model: onnx.ModelProto) -> list[str]:
    """TensorScatter and Attention as TensorRT maps them (RULES['scatter'], RULES['attention'])."""
    g = model.graph
    ops = [n for n in g.node if n.domain in ("", "ai.onnx") and n.op_type in SINCE]
    if not ops:
        return []
    inferred = onnx.shape_inference.infer_shapes(_structure(model)).graph
    dims = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
            if v.type.tensor_type.HasField("shape") else None
            for v in [*inferred.input, *inferred.value_info, *inferred.output]}
    inputs, outputs = {v.name for v in g.input}, {v.name for v in g.output}
    problems = []
    for n in ops:
        where = f"node '{n.name or n.op_type}'"
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "TensorScatter":
            past, update = n.input[0], n.input[1]
            why = []
            if attrs.get("axis", -2) != -2:
                why.append(f"axis {attrs['axis']}")
            if attrs.get("mode", b"linear") not in (b"linear", "linear"):
                why.append(f"mode {attrs['mode']!r}")
            past_dims, update_dims = dims.get(past), dims.get(update)
            if past_dims is None or update_dims is None or len(past_dims) != 4 or len(update_dims) != 4:
                why.append("a cache or update that is not 4-D")
            elif past_dims[2] is None:
                why.append(f"'{past}' has no static sequence length")
            if past not in inputs:
                why.append(f"'{past}' is not a graph input")
            if n.output[0] not in outputs:
                why.append(f"'{n.output[0]}' is not a graph output")
            problems += [f"{where}: {w} [{RULES['scatter']}]" for w in why]
        else:
            why = []
            if len(n.input) > 4 and any(n.input[4:]):
                why.append("past_key/past_value/nonpad_kv_seqlen inputs")
            if len(n.output) > 1 and any(n.output[1:]):
                why.append("present/qk outputs")
            if any(a in attrs for a in ("softmax_precision", "qk_matmul_output_mode", "softcap")):
                why.append("attributes TensorRT refuses or ignores")
            if attrs.get("is_causal"):
                why.append("is_causal (give the causal mask as attn_mask)")
            if len(n.input) < 4 or any(not t or len(dims.get(t) or ()) != 4 for t in n.input[:4]):
                why.append("Q, K, V and attn_mask must all be given, 4-D")
            problems += [f"{where}: {w} [{RULES['attention']}]" for w in why]
    return problems


def _structure(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` without its large weights' bytes: shape inference needs their shapes, and the values only of the
    small ones (the shapes a Reshape is given)."""
    light = onnx.ModelProto()
    light.CopyFrom(model)
    for t in light.graph.initializer:
        if int(np.prod(t.dims)) > 1024:
            for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "external_data"):
                t.ClearField(field)
            t.data_location = TensorProto.DEFAULT
    return light


def _weights(g: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """The graph's weights by name: its initializers and the tensors of its Constant nodes. TensorRT roots both at
    an IConstantLayer, so a Constant node's scale is read like an initializer's: reading only the initializers let
    per-channel scales held in a Constant node through on an activation (RULES['per_channel']), and a Constant's
    negative scales through (RULES['positive'])."""
    weights = {t.name: t for t in g.initializer}
    for n in g.node:
        if n.op_type != "Constant" or n.domain not in ("", "ai.onnx"):
            continue
        for a in n.attribute:
            if a.name == "value":
                weights[n.output[0]] = a.t
            elif a.name in ("value_float", "value_floats", "value_int", "value_ints"):
                dtype = np.float32 if "float" in a.name else np.int64
                weights[n.output[0]] = numpy_helper.from_array(np.asarray(onnx.helper.get_attribute_value(a), dtype))
    return weights


def _scale_shape_problems(x: list[int], s: list[int], axis: int, block: int) -> list[str]:
    axis = axis % len(x) if x else 0
    if not s or s == [1]:  # per tensor
        return [] if not block else [f"block_size {block} with a scalar scale"]
    if len(s) == 1:
        return [] if s[0] == x[axis] else [f"1-D scale of {s[0]} for axis {axis} of size {x[axis]}"]
    if len(s) != len(x):
        return [f"scale of rank {len(s)} for an input of rank {len(x)}"]
    want = [d if i != axis else -(-d // block) for i, d in enumerate(x)] if block else None
    return [] if s == want else [f"scale shape {s} for input {x}, axis {axis}, block {block} (wants {want})"]


def check_tensorrt_import(onnx_path: str | Path) -> None:
    """Refuse, before a build, a graph full TensorRT would not import (tensorrt_import_problems)."""
    problems = tensorrt_import_problems(onnx.load(str(onnx_path)))
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise BuildError(f"{Path(onnx_path).name}: TensorRT would refuse this graph:\n  " + "\n  ".join(problems[:5]) + more)
