"""PyTorch -> ONNX: token ids [batch, seq] (int64) -> logits [batch, seq, vocab] (float32).

Opset 20, so each tanh-GELU is ONE `Gelu(approximate="tanh")` node (the graph pass and TensorRT's
native kGELU_TANH both key on it). The tied embedding stays one initializer, read by the token Gather
and, transposed, by the output projection. The model config travels in the ONNX metadata
(`andrea.config`), so later stages need only the file.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections import Counter
from pathlib import Path

import onnx
import torch

from ..errors import ExportError
from ..folder.atomic import staging
from ..model.andrea import Andrea
from ..names import CONFIG_KEY, INPUT_IDS, LOGITS, WEIGHTS_KEY
from ..progress import step
from .layout import check_onnx

OPSET = 20
INPUT_NAME = INPUT_IDS  # int64 [batch, seq]
OUTPUT_NAME = LOGITS  # float32 [batch, seq, vocab]
EXTERNAL_DATA_ABOVE = 1 << 30  # bytes of weights; above this the weights go to <name>.onnx.data
# An export's peak memory: the libraries, plus the weights held several times at once (the model, the traced
# program's constants, the ONNX proto): fitted with a margin to the peaks measured with /usr/bin/time -v on 2 Zen 4
# cores, andrea-tiny 0.42 GB and ANDREA-120M 2.56 GB (tests/test_careless_inputs.py keeps the fit to them)
EXPORT_BASE_BYTES = 512 << 20
EXPORT_BYTES_PER_PARAM = 28


def export_memory(cfg) -> int:
    """The bytes an export of `cfg` takes at its peak (an estimate from measured exports)."""
    return EXPORT_BASE_BYTES + EXPORT_BYTES_PER_PARAM * cfg.n_params


def check_export_memory(cfg, available: int | None = None) -> None:
    """ConfigError when exporting `cfg` would take more memory than this machine has free."""
    from ..errors import check_memory

    check_memory(cfg, export_memory(cfg), "exporting", available)


def export_onnx(
    model: Andrea,
    out: str | Path,
    *,
    opset: int = OPSET,
    external_data: bool | None = None,
    quiet: bool = False,
) -> Path:
    """Export `model` to `out` (a .onnx path) and check the result.

    Args:
        model: the reference model (float32, any device; exported on the CPU).
        out: where to write. Written in a temporary folder and moved in when complete.
        opset: ONNX opset; at least 20 (tanh `Gelu`).
        external_data: store weights in `<out>.data`. Default: only when the weights exceed 1 GiB
            (ANDREA-120M's 369 MB fit in one file, which every consumer reads without extra steps).
    Returns:
        The path written.
    """
    cfg = model.cfg
    example = torch.zeros(2, min(8, cfg.n_positions), dtype=torch.long)
    dynamic = {"idx": {0: torch.export.Dim("batch", max=4096), 1: torch.export.Dim("seq", max=cfg.n_positions)}}
    return export_program(model, (example,), out, input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                          dynamic_shapes=dynamic, title=f"Exporting {cfg.name} to ONNX (opset {opset})",
                          opset=opset, external_data=external_data, quiet=quiet)


def export_program(
    module: torch.nn.Module,
    args: tuple,
    out: str | Path,
    *,
    input_names: list[str],
    output_names: list[str],
    dynamic_shapes,
    title: str,
    opset: int = OPSET,
    external_data: bool | None = None,
    metadata: dict[str, str] | None = None,
    edit=None,
    check=None,
    quiet: bool = False,
) -> Path:
    """The export machinery every graph shares: torch's dynamo exporter, the model config and weight source
    in the metadata (plus `metadata`), `edit(onnx_ir_model)` before saving, weights inline unless they
    exceed 1 GiB, a check (`check(path)`, default check_onnx) and an atomic write. `module.cfg` and
    `module.weights_source` describe the model (Andrea has both)."""
    if opset < 20:
        raise ExportError(f"opset {opset} is too old: tanh-GELU is one ONNX Gelu node only from opset 20")
    out = Path(out)
    module = module.float().cpu().eval()
    if external_data is None:
        external_data = sum(p.numel() * 4 for p in module.parameters()) > EXTERNAL_DATA_ABOVE
    with step(title, quiet), _quiet_exporter():
        program = torch.onnx.export(
            module, args, dynamo=True, opset_version=opset, input_names=input_names, output_names=output_names,
            dynamic_shapes=dynamic_shapes, optimize=True, verbose=False,
        )
        assert program is not None  # None only from the TorchScript exporter (dynamo=False)
        if edit is not None:
            edit(program.model)
        _drop_stack_traces(program.model)
        # the reference model or a decoder wrapping it: each carries its ModelConfig as `cfg`
        meta = {CONFIG_KEY: json.dumps(getattr(module, "cfg").to_dict(), sort_keys=True),
                WEIGHTS_KEY: json.dumps(getattr(module, "weights_source", {}), sort_keys=True), **(metadata or {})}
        program.model.metadata_props.update(meta)
        program.model.producer_name = "andrea-export"
    with step(f"Writing and checking {out.name}", quiet), staging(out.parent) as tmp:
        program.save(tmp / out.name, external_data=external_data)
        (check or check_onnx)(tmp / out.name)
    return out


def _drop_stack_traces(ir_model) -> None:
    """The exporter records each node's Python stack trace, with the source paths of the machine that ran it:
    without them the same model gives the same bytes wherever it is exported, and a graph of the tiny model
    is half the size (the weights themselves are stored once per folder: external_data.py)."""
    import onnx_ir as ir

    for node in ir.traversal.RecursiveGraphIterator(ir_model.graph):
        node.metadata_props.pop("pkg.torch.onnx.stack_trace", None)


def op_counts(model: onnx.ModelProto) -> Counter:
    """Node counts by op type; `Gelu(tanh)` and `Gelu(none)` are counted apart."""
    counts: Counter[str] = Counter()
    for n in model.graph.node:
        if n.op_type == "Gelu":
            approx = next((a.s.decode() for a in n.attribute if a.name == "approximate"), "none")
            counts[f"Gelu({approx})"] += 1
        else:
            counts[n.op_type] += 1
    return counts


class _quiet_exporter:
    """The dynamo exporter warns about torchvision and deprecations that say nothing about our model."""

    def __enter__(self):
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        self._logger = logging.getLogger("torch.onnx")
        self._level = self._logger.level
        self._logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self._logger.setLevel(self._level)
        self._warnings.__exit__(*exc)
