"""A weight-stripped engine at load time: its sidecar's name, and putting its weights back from the ONNX it was
built from (GPU hosts only; TensorRT-RTX's CPU builder cannot strip)."""

from __future__ import annotations

from pathlib import Path

from ..errors import BuildError, ExportError, require
from ..folder.reader import inside
from ..graphs.external_data import external_data_files


def sidecar_path(plan: str | Path) -> Path:
    return Path(str(plan) + ".json")


STRIP_REFUSED_RTX = (
    "weight-stripped engines (--strip-weights) need full TensorRT on a GPU host (--builder tensorrt): "
    "TensorRT-RTX's ahead-of-time CPU builder fails with BuilderFlag STRIP_PLAN or REFIT (its compiler needs "
    "CUDA: MyelinCheckException, checked with TensorRT-RTX 1.7); build without --strip-weights here"
)


def refit_stripped(trt, engine, plan_path: str | Path, info: dict, logger=None) -> bool:
    """Put the weights back into a weight-stripped `engine` (deserialized from `plan_path`, whose sidecar is
    `info`) from the ONNX it was built from, beside the plan; returns whether it had to. GPU hosts only.

    The sidecar is untrusted: its `onnx` must be a plain file name beside the plan, and that graph's
    weights files are checked (external_data_files) before TensorRT's parser reads them."""
    if not info.get("weights_stripped"):
        return False
    plan_path = Path(plan_path)
    graph = inside(plan_path.parent, info.get("onnx"), f"{plan_path}.json: 'onnx' (the graph to refit from)", flat=True)
    try:
        external_data_files(graph)
    except ExportError as e:
        raise BuildError(f"{plan_path}: cannot refit its weights: {e}") from None
    if info.get("plugin_layers"):
        require("andrea_export.plugin.register", "tensorrt", "Refitting a plugin engine").register_plugins()
    from .log import make_logger  # here: loading an engine that needs no refit imports no build logging

    logger = logger or make_logger(trt)
    refitter = trt.Refitter(engine, logger)
    parser = trt.OnnxParserRefitter(refitter, logger)
    if not parser.refit_from_file(str(graph)):
        errors = "; ".join(parser.get_error(i).desc() for i in range(parser.num_errors)) or "no reason given"
        raise BuildError(f"{plan_path}: refitting its weights from {graph.name} failed: {errors}")
    missing = refitter.get_missing_weights()
    if missing:
        raise BuildError(f"{plan_path}: {graph.name} does not give every weight the engine needs (missing: "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}): not the graph it was built from")
    if not refitter.refit_cuda_engine():
        raise BuildError(f"{plan_path}: TensorRT could not refit the engine from {graph.name} (see the log above)")
    return True
