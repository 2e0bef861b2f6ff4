"""The in-place KV-cache decoder, for ONNX Runtime: the cache is one preallocated buffer per layer and
kind that every step updates where it lies, instead of a past that each step copies into a longer present.

Why: the standard decoder (kvcache.py) concatenates the past and the new token into a new `present.*` at
every step, so a decode step reads the whole cache twice and writes it once, and runs attention as
separate MatMul/Softmax nodes. Here attention is ONNX Runtime's `com.microsoft.GroupQueryAttention`
(with as many key/value heads as query heads: plain multi-head attention), whose `past_*` and `present_*`
may be the same buffer: it writes the new tokens' keys and values at each row's own length and reads
only the filled part. A decode step then moves the weights, the filled cache once and one new row.
This is how onnxruntime-genai runs its models (`past_present_share_buffer`).

    inputs   input_ids                 int64   [batch, new_tokens]
             attention_mask            int64   [batch, total]   per row: 1 for each token it holds
                                                                  (the new ones included), then 0s
             past_key_values.{i}.key   float   [batch, n_head, capacity, head_dim]   the buffer
             past_key_values.{i}.value float   [batch, n_head, capacity, head_dim]
    outputs  logits                    float32 [batch, new_tokens, vocab_size]
             present.{i}.key/.value    the same buffers (bind each to its past: same OrtValue)

Rows are padded on the RIGHT (GroupQueryAttention's rule): a prompt step passes every prompt, shorter
ones padded at the end (their padded positions compute garbage that nobody reads, and the next step
overwrites their cache rows); a decode step passes one token per row, and the mask's row sum says how
many tokens that row holds. Positions are derived from the mask like the standard graph's. The graph
needs the contrib op, so it is for ONNX Runtime (CPU and CUDA providers) and onnxruntime-genai; TensorRT
and Triton take the standard decoder.

Other fusions ONNX Runtime offers for GPT-2 were measured and left out: writing the residual adds and
LayerNorms as `SkipLayerNormalization` and bias + tanh-GELU as `FastGelu` changed ANDREA-120M's step by
-2 % to +3 % (prefill 1x128 and 4x128, decode 1x127 and 8x1023, 2 threads), within this machine's noise;
ONNX Runtime fuses bias + GELU into FastGelu at session load anyway. Adding packed QKV into
GroupQueryAttention (no Split) and the QKV projection as Gemm cut the small ops' kernel time from 1.6 to
1.1 ms of an 18 ms step (batch 8, past 128, ORT's profiler), but the step's wall time stayed within the
noise (+-10 % between processes): the step is the matmuls' (benchmarks/README.md). (Its offline optimizer,
`onnxruntime.transformers.optimizer` for "gpt2", turns our tanh GELU into `BiasGelu`, the erf form: a
different function, so it is not used on our graphs.)

The graph is written here node by node from the model's weights (torch's exporter cannot emit a
contrib op with several outputs); a build verifies it against PyTorch like the standard decoder
(`runtime/agreement.verify_decoder` step by step through the runtime's buffers, and greedy agreement).
Its weights stay inline here, so one graph must hold under protobuf's 2 GB (ANDREA-120M: 369 MB).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from ..errors import ExportError
from ..folder.atomic import staging
from ..names import ATTENTION_MASK, CONFIG_KEY, INPUT_IDS, KV_LAYOUT_KEY, LOGITS, WEIGHTS_KEY
from ..progress import step
from .export import OPSET
from .layout import BATCH, NEW, WIDTH, KVLayout, check_decoder_onnx


def inplace_layout(layout: KVLayout) -> KVLayout:
    return dataclasses.replace(layout, cache="shared")


def export_inplace_decoder(model, out: str | Path, *, quiet: bool = False) -> Path:
    """Write `model` (an Andrea, float32) as the in-place decoder graph to `out` and check it; written in a
    temporary folder and moved in when complete. Weights inline (external_data.py shares them later)."""
    from .layout import kv_layout

    layout = inplace_layout(kv_layout(model.cfg))
    return write_decoder(model, out, layout, GroupQuery(), "in-place KV-cache decoder", quiet=quiet)


def write_decoder(model, out: str | Path, layout: KVLayout, attention, what: str, *, quiet: bool = False) -> Path:
    """Write `model` as a decoder graph whose attention `attention` writes (GroupQuery here; the slot decoder's
    in slot_decoder.py), with the config, weight source and `layout` in its metadata, to `out`, checked."""
    import onnx_ir as ir

    cfg = model.cfg
    out = Path(out)
    with step(f"Writing the {what} of {cfg.name}", quiet):
        graph = _graph(model, layout, attention)
        ir_model = ir.Model(graph, ir_version=10, producer_name="andrea-export")
        ir_model.metadata_props.update({
            CONFIG_KEY: json.dumps(cfg.to_dict(), sort_keys=True),
            WEIGHTS_KEY: json.dumps(getattr(model, "weights_source", {}), sort_keys=True),
            KV_LAYOUT_KEY: json.dumps(layout.to_dict(), sort_keys=True),
        })
    with step(f"Writing and checking {out.name}", quiet), staging(out.parent) as tmp:
        ir.save(ir_model, tmp / out.name)
        check_decoder_onnx(tmp / out.name)
    return out


class GroupQuery:
    """Attention as ONNX Runtime's `com.microsoft.GroupQueryAttention` over a buffer of any capacity: it writes
    the new keys and values at each row's length and reads only the filled part."""

    opsets = {"": OPSET, "com.microsoft": 1}
    name = "andrea_inplace_decoder"

    def prepare(self, tape, int64, ids, mask, cfg):
        """What every layer's attention needs from the mask, and the new tokens' positions [B, T]."""
        import onnx_ir as ir

        # What GroupQueryAttention needs from the mask: each row's last index (tokens held - 1) and the width.
        one, axis1 = int64("one", [1]), int64("axis_1", [1])
        held = tape.op("ReduceSum", [mask, axis1], {"keepdims": 0})
        self.seqlens_k = tape.op("Cast", [tape.op("Sub", [held, one])], {"to": ir.DataType.INT32})
        width = tape.op("Shape", [mask], {"start": 1, "end": 2})
        self.total = tape.op("Cast", [tape.op("Squeeze", [width])], {"to": ir.DataType.INT32})
        # Positions: a token's index among its row's real tokens (as kvcache.py), for the new tokens (last T columns).
        positions = tape.op("Max", [tape.op("Sub", [tape.op("CumSum", [mask, int64("axis", 1)]), one]), int64("zero", 0)])
        new = tape.op("Shape", [ids], {"start": 1, "end": 2})
        return tape.op("Slice", [positions, tape.op("Neg", [new]), int64("end", [np.iinfo(np.int64).max]), axis1])

    def attend(self, tape, int64, q, k, v, past_k, past_v, n_head: int, head_dim: int):
        """(attention output [B, T, C], present key, present value) of one layer."""
        return tape.op_multi_out(
            "GroupQueryAttention", [q, k, v, past_k, past_v, self.seqlens_k, self.total],
            {"num_heads": n_head, "kv_num_heads": n_head, "scale": 1.0 / float(np.sqrt(head_dim))}, num_outputs=3,
            domain="com.microsoft")


def _graph(model, layout: KVLayout, attention):
    import onnx_ir as ir

    cfg = model.cfg
    C, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
    weights = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    tape = ir.tape.Tape()

    def const(name: str, array) -> ir.Value:
        return tape.initializer(ir.tensor(np.ascontiguousarray(array), name=name))

    def matmul(x, prefix: str):  # nn.Linear's weight [out, in], stored transposed (as torch exports it)
        return tape.op("MatMul", [x, const(f"{prefix}.weight", weights[f"{prefix}.weight"].T)])

    def vector(name: str):
        return const(name, weights[name])

    def add_norm(x, skip, bias, ln: str):
        """(LayerNorm(x + bias + skip), x + bias + skip): the residual sum, and the next sublayer's pre-norm."""
        total = tape.op("Add", [skip, x if bias is None else tape.op("Add", [x, bias])])
        normed = tape.op("LayerNormalization", [total, vector(f"{ln}.weight"), vector(f"{ln}.bias")],
                         {"axis": -1, "epsilon": cfg.layer_norm_eps})
        return normed, total

    def int64(name: str, values) -> ir.Value:
        return const(name, np.array(values, dtype=np.int64))

    ids = ir.Value(name=INPUT_IDS, shape=ir.Shape([BATCH, NEW]), type=ir.TensorType(ir.DataType.INT64))
    mask = ir.Value(name=ATTENTION_MASK, shape=ir.Shape([BATCH, WIDTH]), type=ir.TensorType(ir.DataType.INT64))
    kv_shape = ir.Shape(list(layout.inputs[2].shape))
    past = [ir.Value(name=n, shape=kv_shape, type=ir.TensorType(ir.DataType.FLOAT)) for n in layout.past_names]
    positions = attention.prepare(tape, int64, ids, mask, cfg)

    wte = const("wte.weight", weights["wte.weight"])
    tokens, places = tape.op("Gather", [wte, ids]), tape.op("Gather", [vector("wpe.weight"), positions])
    h, x = add_norm(tokens, places, None, "h.0.ln_1")  # h: the normed input of the next sublayer; x: the residual
    presents = []
    split = int64("qkv_split", [C, C, C])
    for i in range(cfg.n_layer):
        p = f"h.{i}"
        qkv = tape.op("Add", [matmul(h, f"{p}.attn.c_attn"), vector(f"{p}.attn.c_attn.bias")])
        q, k, v = tape.op_multi_out("Split", [qkv, split], {"axis": -1}, num_outputs=3)
        attn, pk, pv = attention.attend(tape, int64, q, k, v, past[2 * i], past[2 * i + 1], H, D)
        presents += [pk, pv]
        h, x = add_norm(matmul(attn, f"{p}.attn.c_proj"), x, vector(f"{p}.attn.c_proj.bias"), f"{p}.ln_2")
        hidden = tape.op("Gelu", [tape.op("Add", [matmul(h, f"{p}.mlp.c_fc"), vector(f"{p}.mlp.c_fc.bias")])],
                         {"approximate": "tanh"})
        after = f"h.{i + 1}.ln_1" if i + 1 < cfg.n_layer else "ln_f"
        h, x = add_norm(matmul(hidden, f"{p}.mlp.c_proj"), x, vector(f"{p}.mlp.c_proj.bias"), after)
    logits = tape.op("MatMul", [h, tape.op("Transpose", [wte], {"perm": [1, 0]})])  # tied head
    logits.name, logits.shape, logits.type = LOGITS, ir.Shape([BATCH, NEW, cfg.vocab_size]), ir.TensorType(ir.DataType.FLOAT)
    for value, name in zip(presents, layout.present_names):
        value.name, value.shape, value.type = name, kv_shape, ir.TensorType(ir.DataType.FLOAT)
    if len({init.name for init in tape.initializers}) != len(tape.initializers):
        raise ExportError("decoder graph: two initializers share a name")  # a bug here, not in the input
    return ir.Graph([ids, mask, *past], [logits, *presents], nodes=tape.nodes, initializers=tape.initializers,
                    opset_imports=attention.opsets, name=attention.name)
