"""The engines' checks at verification: whether an engine can run on this machine (GPU, TensorRT version,
compute capability), Polygraphy's TensorRT runner for it, and greedy decoding through the runtime's
TensorRT session against PyTorch."""

from __future__ import annotations

from pathlib import Path

from ..errors import AndreaExportError


def engine_greedy(folder: Path, model, artifacts: dict, steps: int, precision: str) -> dict:
    """Greedy decoding through the runtime's TrtSession against PyTorch; `passed` gates the build in every
    precision: a divergence fails unless every logit up to it is within the precision's tolerance (a tie)."""
    from ..graphs.layout import read_decoder
    from ..runtime.trt import TrtSession
    from .agreement import greedy_agreement
    from .thresholds import TOLERANCES

    graph = folder / artifacts["decoder_onnx"]  # named here: a staging folder has no manifest yet
    prompt = list(range(1, 9))
    cfg, layout = read_decoder(graph)  # one check of the graph
    with TrtSession(folder / artifacts["decoder_engine"], cfg, layout) as sess:
        greedy = greedy_agreement(model, sess, prompt, n_tokens=steps, **TOLERANCES[precision])
    greedy.pop("reference_tokens", None), greedy.pop("candidate_tokens", None)
    return greedy


def engine_blocker(plan: Path, info: dict) -> str | None:
    """Why the engine `plan` (described by its sidecar `info`) cannot run here, or None when it can."""
    from ..engine.compat import check_engine_compat
    from ..errors import gpu_compute_capability

    if gpu_compute_capability() is None:
        targets = ", ".join(info["compute_capabilities"])
        what = (f"an RTX-class GPU of compute capability {targets}" + (" or newer" if info.get("compute_capabilities_default") else "")
                if info["builder"] == "tensorrt-rtx" else "a GPU")
        return (f"no GPU on this machine: the {info['builder']} engine needs {what} to run; the exact ONNX that "
                "went into the builder was verified on ONNX Runtime instead")
    try:
        check_engine_compat(plan, info)
    except AndreaExportError as e:
        return str(e)
    return None


def engine_runner(plan: Path, info: dict):
    """Polygraphy's TensorRT runner for the engine, or (None, why it cannot run here)."""
    import os

    reason = engine_blocker(plan, info)
    if reason:
        return None, reason
    if info["builder"] == "tensorrt-rtx":
        os.environ["POLYGRAPHY_USE_TENSORRT_RTX"] = "1"  # read by Polygraphy at import; set before it loads TensorRT
    elif info.get("plugin_layers"):
        from ..plugin.register import register_plugins

        register_plugins()  # AOT plugins need no Python at run time, but Polygraphy deserializes in this process
    from polygraphy.backend.common import BytesFromPath
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    from ..engine.builders import trt_module
    from ..engine.refit import refit_stripped

    def engine():  # a weight-stripped engine gets its weights back from the ONNX beside it
        e = EngineFromBytes(BytesFromPath(str(plan)))()
        refit_stripped(trt_module(info["builder"]), e, plan, info)
        return e

    return TrtRunner(engine, name="engine"), ""
