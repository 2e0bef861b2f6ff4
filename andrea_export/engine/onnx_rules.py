"""TensorRT's import rules for an ONNX graph that TensorRT-RTX (the builder that runs here) does not enforce.

Full TensorRT cannot run on these machines, and RTX's parser accepts graphs that TensorRT refuses (it took
int8 block dequantization and negative int4 scales, both of which TensorRT rejects). So every graph the
pipeline hands to full TensorRT is checked against TensorRT's documented rules before the build, and the
tests run the same check on every such graph. Each rule names the header line it comes from
(TensorRT's `include/NvInfer.h`, IDequantizeLayer / IQuantizeLayer, v10.9 and v11.1).
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
}


def tensorrt_import_problems(model: onnx.ModelProto) -> list[str]:
    """What in `model` full TensorRT would refuse to import, one line per problem with the rule it breaks;
    [] when nothing. Reads initializers and Constant nodes (load the graph with its external data)."""
    g = model.graph
    inits = _weights(g)
    constants = {o for n in g.node if n.op_type == "Constant" for o in n.output}
    shapes = {name: list(t.dims) for name, t in inits.items()}
    problems = []
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
