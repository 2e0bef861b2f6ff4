"""The slot decoder: the in-place decoder in standard ONNX (opset 24), for in-flight batching on TensorRT.

TensorRT has no GroupQueryAttention. What it offers for a cache that stays where it lies (TensorRT 10.15:
IKVCacheUpdateLayer; shared/research/trt-batching.md has the sources) is the ONNX parser's mapping of
standard `TensorScatter` (axis -2) onto that layer, and of standard `Attention` onto IAttention (10.14). The
layer's rules shape this graph:

- the cache is a graph input with a STATIC length (n_positions: `KVLayout.static`), each `present.*` is a
  graph output straight from its TensorScatter, and the runtime binds the two to one address (TensorRT
  reports an API error otherwise; `ICudaEngine.get_aliased_input_tensor` names the pair);
- writes past the cache's end are dropped silently by TensorRT, so the runtime refuses them before a run;
- `Attention` gets 4-D Q/K/V and an explicit bool mask built here (position c is attended by the new token t
  of row b when c <= write_index[b] + t), never `is_causal` (TensorRT takes it as upper-left, ONNX as
  lower-right when the lengths differ), `nonpad_kv_seqlen` (ignored by TensorRT's parser), or `past_*` /
  `present_*` (refused). Every row attends at least its own new position, so no softmax row is empty.

Its inputs and outputs are the in-place decoder's (inplace_decoder.py), fed the same way: `attention_mask`
is 1 for each token a row holds after the step (the new ones too), then 0, and the runtimes bind each
`present.*` to its `past_key_values.*`. A row's new tokens are written from `write_index` = held - T (0 when
a right-padded prompt step holds fewer than T: its pad positions hold garbage that the next write replaces
and no real token attends). So the ONNX Runtime runtime, its slot cache and the two-group pass
(two_groups.py) run this graph unchanged, and verification checks it step by step against PyTorch like the
other decoders.

What it costs where GroupQueryAttention exists: attention reads the whole static cache (n_positions) every
step, masked, where GroupQueryAttention reads only the filled part; benchmarks/README.md has the CPU figures.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ..errors import ExportError
from .inplace_decoder import write_decoder
from ..names import MAX_SLOTS
from .layout import KVLayout

OPSET = 24  # TensorScatter and the 4-D Attention the parsers map to TensorRT's layers
WRITE_AXIS = -2  # the cache's sequence axis: the only one TensorRT's parser takes
CHUNK, MIXED = "chunk", "mixed"  # the engine's profiles beside DECODE (slot_profiles)


def slot_layout(layout: KVLayout) -> KVLayout:
    return dataclasses.replace(layout, cache="static")


def export_slot_decoder(model, out: str | Path, *, quiet: bool = False) -> Path:
    """Write `model` (an Andrea, float32) as the slot decoder graph to `out` and check it; weights inline
    (external_data.py shares them later)."""
    from .layout import kv_layout

    return write_decoder(model, out, slot_layout(kv_layout(model.cfg)), Scatter(), "slot decoder (TensorScatter, "
                         "Attention)", quiet=quiet)


class Scatter:
    """Attention over a static cache: the new keys and values written with TensorScatter, then standard
    Attention over the whole cache under a mask built from each row's write index."""

    opsets = {"": OPSET}
    name = "andrea_slot_decoder"

    def prepare(self, tape, int64, ids, mask, cfg):
        """The write index [B], the bool mask [B, 1, T, n_positions] and the new tokens' positions [B, T]."""
        n_positions = cfg.n_positions
        self.heads = int64("heads_shape", [0, 0, cfg.n_head, cfg.head_dim])
        self.merged = int64("merged_shape", [0, 0, cfg.n_embd])
        held = tape.op("ReduceSum", [mask, int64("axis_1", [1])], {"keepdims": 0})
        new = tape.op("Squeeze", [tape.op("Shape", [ids], {"start": 1, "end": 2})])
        self.write_index = tape.op("Max", [tape.op("Sub", [held, new]), int64("zero", 0)])
        steps = tape.op("Range", [int64("range_start", 0), new, int64("range_delta", 1)])
        positions = tape.op("Add", [tape.op("Unsqueeze", [self.write_index, int64("axis_last", [-1])]), steps])
        cache = int64("cache_positions", np.arange(n_positions).reshape(1, 1, 1, n_positions))
        self.mask = tape.op("LessOrEqual", [cache, tape.op("Unsqueeze", [positions, int64("axes_1_3", [1, 3])])])
        return positions

    def attend(self, tape, int64, q, k, v, past_k, past_v, n_head: int, head_dim: int):
        """(attention output [B, T, C], present key, present value) of one layer."""
        def split_heads(x):  # [B, T, C] -> [B, H, T, D]
            return tape.op("Transpose", [tape.op("Reshape", [x, self.heads])], {"perm": [0, 2, 1, 3]})

        present = [tape.op("TensorScatter", [past, split_heads(new), self.write_index], {"axis": WRITE_AXIS})
                   for past, new in ((past_k, k), (past_v, v))]
        y = tape.op("Attention", [split_heads(q), *present, self.mask], {"scale": 1.0 / float(np.sqrt(head_dim))})
        merged = tape.op("Reshape", [tape.op("Transpose", [y], {"perm": [0, 2, 1, 3]}), self.merged])
        return merged, present[0], present[1]


def slot_profiles(layout: KVLayout, max_slots: int, prefill_chunk: int, two_groups: bool = True) -> list[dict]:
    """The optimization profiles of a slot decoder engine, as `kvcache.optimization_profiles` gives them
    ({"name", "shapes": {input: {"min", "opt", "max"}}}, every input named), for the graph of two groups
    (two_groups.py: decode rows, then `chunk.*`, one prompt's chunk of one row) or of one:

    - `decode`: rows 1..max_slots of one new token each (and, with two groups, a chunk of one token: a pad
      row, so that every step runs on the one engine and decode steps can be captured per row count);
    - `mixed` (two groups) or `chunk` (one): one row of 1..prefill_chunk prompt tokens, beside the decode rows.

    The cache is static: [rows, n_head, n_positions, head_dim]; the mask's width is the longest row's tokens,
    1..n_positions."""
    from .two_groups import PREFIX
    from ..names import ATTENTION_MASK, DECODE, INPUT_IDS

    n, H, D = layout.n_positions, layout.n_head, layout.head_dim
    if not 1 <= max_slots <= MAX_SLOTS:
        raise ExportError(f"slot profiles: max_slots must be in 1..{MAX_SLOTS}, got {max_slots}")
    if not 1 <= prefill_chunk <= n:
        raise ExportError(f"slot profiles: prefill_chunk must be in 1..{n} (n_positions), got {prefill_chunk}")

    def group(prefix: str, rows: tuple[int, int, int], tokens: tuple[int, int, int]) -> dict:
        shapes = {prefix + INPUT_IDS: [[r, t] for r, t in zip(rows, tokens)],
                  prefix + ATTENTION_MASK: [[r, w] for r, w in zip(rows, (tokens[0], max(tokens[1], n // 2), n))]}
        shapes.update({prefix + name: [[r, H, n, D] for r in rows] for name in layout.past_names})
        return {k: dict(zip(("min", "opt", "max"), v)) for k, v in shapes.items()}

    decoding = group("", (1, max_slots, max_slots), (1, 1, 1))
    if not two_groups:
        return [{"name": DECODE, "shapes": decoding},
                {"name": CHUNK, "shapes": group("", (1, 1, 1), (1, prefill_chunk, prefill_chunk))}]
    return [{"name": DECODE, "shapes": {**decoding, **group(PREFIX, (1, 1, 1), (1, 1, 1))}},
            {"name": MIXED, "shapes": {**decoding, **group(PREFIX, (1, 1, 1), (1, prefill_chunk, prefill_chunk))}}]
