"""The in-place decoder for two groups of rows in one run: in-flight batching's mixed step.

In-flight batching (runtime/batcher.py) has, at most steps, a group of rows decoding one token each and a
joining request's prompt chunk of many tokens. With one group per run, every step with a chunk costs two
runs, each reading every weight. This pass takes an in-place decoder (inplace_decoder.py, any precision:
MatMul or MatMulNBits) and gives it a second set of inputs and outputs, named as the first with `PREFIX`
before them (`chunk.input_ids`, `chunk.attention_mask`, `chunk.past_key_values.{i}.key`, ...,
`chunk.logits`, `chunk.present.{i}.value`), each group with its own shapes [batch, new_tokens]:

  - every node that reads an input is cloned for the second group (the constants, such as the tied head's
    transposed table, stay shared);
  - each weight matmul and its clone become one: both groups' activations are flattened to rows and
    concatenated, multiplied once (the weights are read once), and split back;
  - GroupQueryAttention, LayerNorm, the GELU and the adds stay per group, so each row sees exactly the
    computation it sees alone: a group's logits equal the one-group graph's bit for bit (ONNX Runtime
    1.32 CPU; runtime/ort.py's tests hold it to that).

Measured on ANDREA-120M fp32, 2 threads (Intel Xeon, AVX-512), 16 decoding rows with a chunk: 8 tokens
67 ms in one run against 89 ms in two, 16 tokens 70-89 against 82-89; decode alone 51-58 ms.

Neither group may be empty: ONNX Runtime 1.32's CPU GroupQueryAttention dies of a floating point exception
on a batch of 0 rows (the whole process, not an error status), so a step with one group runs on the
one-group graph (runtime/ort.py's OrtSlotCache). The graph is made when a slot cache is (ONNX Runtime loads it
from memory, its weights from the build's file); it is not written into the build.
"""

from __future__ import annotations

import numpy as np

PREFIX = "chunk."
# the nodes whose second input is a weight: merged across the two groups
WEIGHT_MATMULS = {("", "MatMul"), ("com.microsoft", "MatMulNBits")}


def two_group_decoder(model, prefix: str = PREFIX):
    """`model` (an onnx_ir Model of an in-place decoder) changed in place to take a second group of rows
    whose inputs and outputs are named with `prefix`; returns it."""
    import onnx_ir as ir

    g = model.graph
    varying = set(g.inputs)  # values that depend on an input: one per group
    for node in g:  # topological order
        if any(v in varying for v in node.inputs if v is not None):
            varying.update(node.outputs)

    def renamed(shape):  # the second group's own symbolic axes ("chunk.batch", ...)
        if shape is None:
            return None
        return ir.Shape([prefix + d.value if isinstance(d, ir.SymbolicDim) and d.value else d for d in shape])

    twin: dict = {}
    for value in list(g.inputs):
        twin[value] = ir.Value(name=prefix + value.name, shape=renamed(value.shape), type=value.type)
    pairs = []
    for node in list(g):
        if not any(v in varying for v in node.outputs):
            continue
        clone = ir.Node(node.domain, node.op_type, [twin.get(v, v) for v in node.inputs],
                        attributes=list(node.attributes.values()), num_outputs=len(node.outputs),
                        name=prefix + (node.name or ""), version=node.version)
        for value, copy in zip(node.outputs, clone.outputs):
            copy.name = prefix + value.name if value.name else None
            copy.type = value.type  # no shape: the axes are the second group's
            twin[value] = copy
        pairs.append((node, clone))
    for _, clone in pairs:
        g.append(clone)
    for value in list(g.inputs):
        g.inputs.append(twin[value])
    for value in list(g.outputs):
        copy = twin[value]
        copy.shape = renamed(value.shape)
        g.outputs.append(copy)
    for node, clone in pairs:
        if (node.domain, node.op_type) in WEIGHT_MATMULS and node.inputs[1] not in varying:
            _merge(g, node, clone)
    g.sort()  # a merged matmul feeds both groups' nodes: order them so that each follows its inputs
    return model


def _merge(g, node, clone) -> None:
    """Replace the matmul `node` and its `clone` (same weights) by one: both inputs flattened to [1, rows,
    K] and concatenated, one matmul, its result split and shaped back to each group's [batch, T, N]."""
    import onnx_ir as ir

    def op(op_type, inputs, attributes=None, num_outputs=1, domain=""):
        n = ir.Node(domain, op_type, inputs, attributes=[ir.convenience.convert_attribute(k, v)
                                                         for k, v in (attributes or {}).items()],
                    num_outputs=num_outputs)
        made.append(n)
        return n.outputs if num_outputs > 1 else n.outputs[0]

    made: list = []
    x0, x1 = node.inputs[0], clone.inputs[0]
    const = ir.tensor(np.array([1, -1], dtype=np.int64))
    flat = op("Concat", [op("Constant", [], {"value": const}), op("Shape", [x0], {"start": -1})], {"axis": 0})
    rows = op("Concat", [op("Reshape", [x0, flat]), op("Reshape", [x1, flat])], {"axis": 1})
    both = ir.Node(node.domain, node.op_type, [rows, *node.inputs[1:]], attributes=list(node.attributes.values()),
                   version=node.version, name=node.name)
    made.append(both)
    width = op("Shape", [both.outputs[0]], {"start": -1})
    lead0, lead1 = op("Shape", [x0], {"end": -1}), op("Shape", [x1], {"end": -1})
    sizes = op("Concat", [op("ReduceProd", [lead0], {"keepdims": 1}), op("ReduceProd", [lead1], {"keepdims": 1})],
               {"axis": 0})
    y0, y1 = op("Split", [both.outputs[0], sizes], {"axis": 1}, num_outputs=2)
    # allowzero: a group's shape is copied as it is (0 would otherwise mean "keep the input's axis")
    y0 = op("Reshape", [y0, op("Concat", [lead0, width], {"axis": 0})], {"allowzero": 1})
    y1 = op("Reshape", [y1, op("Concat", [lead1, width], {"axis": 0})], {"allowzero": 1})
    g.insert_after(clone, made)
    for old, new in ((node.outputs[0], y0), (clone.outputs[0], y1)):
        name, shape, type_ = old.name, old.shape, old.type
        is_output = old.is_graph_output()
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        if is_output:  # the graph's output keeps its name (logits, chunk.logits)
            old.name = None
            new.name, new.shape, new.type = name, shape, type_
    g.remove([node, clone], safe=True)
