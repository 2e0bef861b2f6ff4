"""The decoder graph with a KV cache: its export, and the two TensorRT optimization profiles (prefill,
decode) that engines built from it use. Its I/O layout (one place, as data: `KVLayout`) and its readers
are in layout.py, which runtimes import without torch; their names stay importable from here.

Prefill passes a past of length 0 (a tensor with an empty axis) and the whole prompt; decode passes the
previous step's `present.*` as `past_key_values.*` and one token. Positions are not an input: the graph
derives them from the mask (position = number of real tokens before it), so left-padded batches get the
positions an unpadded sequence would. The names are those of Hugging Face Optimum / onnxruntime-genai
exports, so their tooling and Triton configurations read the graph without a mapping table.

Why one graph with a dynamic past instead of two graphs: one set of weights (369 MB for ANDREA-120M, not
twice), one file to verify; TensorRT gets the two shape regimes as two optimization profiles of one
engine (`optimization_profiles`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import ExportError
from ..model.andrea import Andrea
from ..names import ATTENTION_MASK, DECODE, INPUT_IDS, KV_LAYOUT_KEY, PREFILL
from .export import OPSET, export_program
from .layout import BATCH, NEW, PAST, KVLayout, check_decoder_onnx, kv_layout  # the layout: layout.py (no torch)


class _DecoderStep(nn.Module):
    """forward(input_ids, attention_mask, *past) -> (logits, *present), flat in layout order.

    Registers the model's children under their own names, so initializer names match `export_onnx`'s
    (`wte.weight`, `h.0.attn.c_attn.weight`, ...)."""

    def __init__(self, model: Andrea):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        self._step = model.forward_with_cache
        self.cfg, self.weights_source = model.cfg, model.weights_source  # read by export_program

    def forward(self, input_ids, attention_mask, *past):
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        logits, present = self._step(input_ids, pairs, attention_mask)
        return (logits, *[t for kv in present for t in kv])


def export_decoder_onnx(
    model: Andrea,
    out: str | Path,
    *,
    opset: int = OPSET,
    external_data: bool | None = None,
    quiet: bool = False,
) -> Path:
    """Export `model` as the KV-cache decoder graph (layout above) to `out` and check the result.

    The graph is traced with past_len=4, new_tokens=3, batch=2 (torch.export specializes axes whose example
    size is 0 or 1); the tests run it with past_len 0 and 1 and new_tokens 1 in ONNX Runtime. Written in a
    temporary folder and moved in when complete; `andrea.config` and `andrea.kv_layout` go into the metadata.
    """
    cfg = model.cfg
    layout = kv_layout(cfg)
    if cfg.n_positions < 8:
        raise ExportError(f"model config '{cfg.name}': n_positions {cfg.n_positions} is too small to trace the decoder (needs 8)")
    B, T, P = 2, 3, 4
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.ones(B, P + T, dtype=torch.long)
    past = tuple(torch.zeros(B, cfg.n_head, P, cfg.head_dim) for _ in layout.past_names)
    batch = torch.export.Dim(BATCH, max=4096)
    new = torch.export.Dim(NEW, max=cfg.n_positions)
    plen = torch.export.Dim(PAST, max=cfg.n_positions)
    dynamic = (
        {0: batch, 1: new},
        {0: batch, 1: torch.export.Dim.DYNAMIC},  # = past_len + new_tokens; torch.export infers the relation
        tuple({0: batch, 2: plen} for _ in past),  # *past is one (varargs) entry
    )
    return export_program(
        _DecoderStep(model), (ids, mask, *past), out, input_names=[t.name for t in layout.inputs],
        output_names=[t.name for t in layout.outputs], dynamic_shapes=dynamic,
        title=f"Exporting {cfg.name} KV-cache decoder to ONNX (opset {opset})", opset=opset,
        external_data=external_data, metadata={KV_LAYOUT_KEY: json.dumps(layout.to_dict(), sort_keys=True)},
        edit=lambda m: _name_axes(m, layout), check=check_decoder_onnx, quiet=quiet,
    )


def _name_axes(ir_model, layout: KVLayout) -> None:
    """Give every axis of the graph I/O the layout's symbolic name (the exporter invents e.g. 's53' for the mask)."""
    import onnx_ir as ir

    specs = {t.name: t for t in layout.inputs + layout.outputs}
    renames: dict[str | None, str] = {}
    for v in list(ir_model.graph.inputs) + list(ir_model.graph.outputs):
        for got, want in zip(v.shape, specs[str(v.name)].shape):
            if isinstance(want, str) and isinstance(got, ir.SymbolicDim) and got.value != want:
                renames[got.value] = want
    if not renames:
        return
    for v in _all_values(ir_model.graph):
        if v.shape is not None and any(isinstance(d, ir.SymbolicDim) and d.value in renames for d in v.shape):
            v.shape = ir.Shape([renames.get(d.value, d.value) if isinstance(d, ir.SymbolicDim) else d for d in v.shape])


def _all_values(graph):
    yield from graph.inputs
    for node in graph:
        yield from node.outputs


# ---------------------------------------------------------------------------------------------------------
# TensorRT optimization profiles
# ---------------------------------------------------------------------------------------------------------


def optimization_profiles(
    cfg: ModelConfig | KVLayout,
    *,
    max_batch: int = 1,
    opt_batch: int = 1,
    prefill_opt_tokens: int | None = None,
    decode_opt_past: int | None = None,
) -> list[dict]:
    """The two optimization profiles of a decoder engine, in this order (profile index 0, 1):

    - `prefill`: the prompt, no past. input_ids [b, 1..n_positions], past_len = 0 (empty past tensors).
    - `decode`: one new token after a past of 1..n_positions-1 tokens.

    Each profile is `{"name": str, "shapes": {input name: {"min": [...], "opt": [...], "max": [...]}}}`
    covering every graph input; the builder passes them to `IOptimizationProfile.set_shape` as they are.
    `opt` defaults: prefill at n_positions // 4 tokens (a typical prompt), decode at a past of
    n_positions // 2 (the middle of a long generation). A runtime selects the profile per phase
    (`IExecutionContext.set_optimization_profile_async`, or one execution context per profile).
    A prompt continued after a past (multi-turn, chunked prefill: new_tokens > 1 and past_len > 0) fits
    neither profile; such use needs a third profile or prefill of the whole conversation.
    """
    layout = cfg if isinstance(cfg, KVLayout) else kv_layout(cfg)
    n = layout.n_positions
    if not 1 <= opt_batch <= max_batch:
        raise ExportError(f"optimization profiles: need 1 <= opt_batch ({opt_batch}) <= max_batch ({max_batch})")
    t_opt = prefill_opt_tokens if prefill_opt_tokens is not None else max(1, n // 4)
    p_opt = decode_opt_past if decode_opt_past is not None else max(1, n // 2)
    if not 1 <= t_opt <= n:
        raise ExportError(f"optimization profiles: prefill_opt_tokens {t_opt} must be in 1..{n} (n_positions)")
    if not 1 <= p_opt <= n - 1:
        raise ExportError(f"optimization profiles: decode_opt_past {p_opt} must be in 1..{n - 1} (n_positions - 1)")
    H, D = layout.n_head, layout.head_dim

    def shapes(tok: tuple[int, int, int], past: tuple[int, int, int]) -> dict:
        batches = (1, opt_batch, max_batch)
        prof = {
            INPUT_IDS: [[b, t] for b, t in zip(batches, tok)],
            ATTENTION_MASK: [[b, p + t] for b, p, t in zip(batches, past, tok)],
        }
        for name in layout.past_names:
            prof[name] = [[b, H, p, D] for b, p in zip(batches, past)]
        return {k: dict(zip(("min", "opt", "max"), v)) for k, v in prof.items()}

    return [
        {"name": PREFILL, "shapes": shapes((1, t_opt, n), (0, 0, 0))},
        {"name": DECODE, "shapes": shapes((1, 1, 1), (1, p_opt, n - 1))},
    ]
