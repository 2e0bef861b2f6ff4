"""The engines' checks at verification: whether an engine can run on this machine (GPU, TensorRT version,
compute capability), Polygraphy's TensorRT runner for it, and greedy decoding through the runtime's
TensorRT session against PyTorch."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..catalog import Role
from ..errors import AndreaExportError


def engine_checks(folder: Path, model, artifacts: Mapping, steps: int, precision: str) -> dict:
    """The decoder engine through the runtime's TrtSession against PyTorch, on every path the runtime takes:
    the CUDA-graph session, its fallback when a capture fails (the same fixed-shape step through
    execute_async_v3, taken on purpose with capture=False) and the growing-cache session (cuda_graph=False).
    On each: greedy decoding of an 8-token prompt for `steps` tokens (tokens agree, or diverge at a tie within
    the precision's tolerance; every distribution within MAX_KL), and the full-context boundary: a prompt of
    n_positions - 2 decoded at past n - 2 and n - 1, and a prefill of n, both against PyTorch's logits of the
    same n tokens. A CUDA-graph session whose capture failed fails the gate (its error is in the report):
    the runtime would fall back silently, so an engine that cannot be captured must not read `passed`."""
    import numpy as np
    import torch

    from ..graphs.layout import read_decoder
    from ..runtime.trt import TrtSession
    from .agreement import greedy_agreement
    from .metrics import lm_metrics
    from .thresholds import MAX_KL, TOLERANCES

    graph = folder / artifacts[Role.DECODER_ONNX]  # named here: a staging folder has no manifest yet
    cfg, layout = read_decoder(graph)  # one check of the graph
    n, tol = cfg.n_positions, TOLERANCES[precision]
    prompt = list(range(1, 9))
    full = np.random.default_rng(0).integers(0, cfg.vocab_size, n).tolist()
    with torch.inference_mode():
        ref = model.eval()(torch.tensor([full]))[0].double().numpy()

    def boundary(sess) -> dict:
        out = {}
        for name, logits in (("prefill_n", sess.forward(full)), ("past_n-2_n-1", sess.forward_stepwise(full, n - 2))):
            rows = slice(n - 2, n)  # the two last positions: where the two decode steps land
            got, want = logits[rows].astype(np.float64), ref[rows]
            kl = lm_metrics(want, got)["max_kl"]
            out[name] = {"max_abs": float(np.abs(got - want).max()), "max_kl": kl,
                         "passed": bool(np.allclose(got, want, **tol)) and kl <= MAX_KL[precision]}
        return out

    paths = {}
    for path, cuda_graph, capture in (("cuda_graph", True, True), ("capture_fallback", True, False),
                                      ("uncaptured", False, False)):
        plan = folder / artifacts[Role.DECODER_ENGINE]
        with TrtSession(plan, cfg, layout, cuda_graph=cuda_graph, capture=capture) as sess:
            greedy = greedy_agreement(model, sess, prompt, n_tokens=steps, **tol, max_kl=MAX_KL[precision])
            greedy.pop("reference_tokens", None), greedy.pop("candidate_tokens", None)
            r: dict[str, Any] = {"greedy": greedy, "boundary": boundary(sess)}
            if capture:
                r["captured"], r["capture_error"] = sess.cuda_graph_active, sess.cuda_graph_error
        r["passed"] = greedy["passed"] and all(b["passed"] for b in r["boundary"].values()) and r.get("captured", True)
        paths[path] = r
    return {"passed": all(r["passed"] for r in paths.values()), "paths": paths}


def slot_engine_checks(folder: Path, model, artifacts: Mapping, steps: int, precision: str) -> dict:
    """The slot engine through the runtime's TrtSlotSession against PyTorch, captured and not: greedy decoding of
    an 8-token prompt (a chunk, then decode steps), as engine_checks; and in-flight batching itself: four requests
    of different lengths through the Batcher at once (chunks joining below and above decoding rows), each
    request's tokens equal to those the session's generate gives it alone. A capture that failed fails the gate."""
    from ..graphs.layout import read_decoder
    from ..runtime.base import Request
    from ..runtime.batcher import Batcher
    from ..runtime.trt_slots import TrtSlotSession
    from .agreement import greedy_agreement
    from .thresholds import MAX_KL, TOLERANCES

    cfg, layout = read_decoder(folder / artifacts[Role.DECODER_ONNX_SLOTS])  # named: a staging folder has no manifest
    tol, plan = TOLERANCES[precision], folder / artifacts[Role.SLOT_ENGINE]
    requests = [Request(list(range(1 + i, 1 + i + length)), steps, seed=i) for i, length in enumerate((3, 40, 9, 70))]
    paths = {}
    for path, capture in (("cuda_graph", True), ("uncaptured", False)):
        with TrtSlotSession(plan, cfg, layout, capture=capture) as sess:
            greedy = greedy_agreement(model, sess, list(range(1, 9)), n_tokens=steps, **tol, max_kl=MAX_KL[precision])
            greedy.pop("reference_tokens", None), greedy.pop("candidate_tokens", None)
            alone = [sess.generate_batch([r])[0] for r in requests]
            got: list[list[int]] = [[] for _ in requests]
            with Batcher(sess, slots=min(4, sess.max_slots), prefill_chunk=16) as batcher:
                tickets = [batcher.submit(r, lambda e, out=out: out.append(e.token) if e.token is not None else None)
                           for r, out in zip(requests, got)]
                for t in tickets:
                    t.wait(600)
                error = next((c.cuda_graph_error for c in sess._caches), None) if capture else None
        r: dict[str, Any] = {"greedy": greedy, "batched_equals_alone": got == alone}
        if capture:
            r["capture_error"] = error
        r["passed"] = greedy["passed"] and r["batched_equals_alone"] and error is None
        paths[path] = r
    return {"passed": all(r["passed"] for r in paths.values()), "paths": paths}


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

    from ..engine.backends import trt_module
    from ..engine.refit import refit_stripped

    def engine():  # a weight-stripped engine gets its weights back from the ONNX beside it
        e = EngineFromBytes(BytesFromPath(str(plan)))()
        refit_stripped(trt_module(info["builder"]), e, plan, info)
        return e

    return TrtRunner(engine, name="engine"), ""


# A plan's kernels, tactics and metadata beside its weights: 5-7 MB for andrea-tiny's int4 engines (TensorRT-RTX
# 1.7), whose weights are 0.3 MB quantized; below 4x this in float32 weights the size cannot tell.
KERNELS_ALLOWANCE = 16 << 20
FOLDED_SHARE = 0.9  # a plan this close to its weights' float32 size holds them as floats


def quantized_weights_check(plan: Path, source: Path) -> dict:
    """Whether an int8 / int4 engine keeps the Q/DQ graph's weights quantized. TensorRT may fold a
    DequantizeLinear of constant weights back into float weights (NVIDIA/TensorRT#4833 reports it for 4-bit
    weights): such an engine computes the right logits, so no numeric check sees it, at full size and speed.
    Judged by the plan's size (read from the file) against the weights of the graph it was built from: it must
    stay under FOLDED_SHARE of what they take as float32, after KERNELS_ALLOWANCE. ANDREA-120M int4 with
    TensorRT-RTX 1.7: plans of 95.7 / 99.5 MB (model / decoder, its two profiles sharing the weights) against 86.5
    MB quantized and 406 MB as float32. Too small a model to tell is said so, not passed off as checked."""
    import onnx

    graph = onnx.load(str(source), load_external_data=False)  # the initializers' shapes and types: no weights read
    T = onnx.TensorProto
    quantized, floats = {T.INT8: 8, T.UINT8: 8, T.INT4: 4, T.UINT4: 4}, {T.FLOAT: 4, T.FLOAT16: 2, T.BFLOAT16: 2}
    q_elements = q_bytes = float_bytes = 0
    for t in graph.graph.initializer:
        n = 1
        for d in t.dims:
            n *= d
        if t.data_type in quantized:
            q_elements += n
            q_bytes += n * quantized[t.data_type] // 8
        else:
            float_bytes += n * floats.get(t.data_type, 8)
    plan_bytes = plan.stat().st_size
    as_float32, as_quantized = 4 * q_elements + float_bytes, q_bytes + float_bytes
    out = {"plan": plan.name, "graph": source.name, "plan_bytes": plan_bytes, "quantized_weights": q_elements,
           "weights_quantized_bytes": as_quantized, "weights_as_float32_bytes": as_float32}
    if q_elements == 0:
        return {**out, "judged": True, "passed": False, "detail": f"{source.name} has no quantized weights"}
    if 4 * q_elements < 4 * KERNELS_ALLOWANCE:
        return {**out, "judged": False, "passed": True,
                "detail": f"not judged: {4 * q_elements / 1e6:.1f} MB of weights as float32 are too few beside a "
                          f"plan's kernels (allowance {KERNELS_ALLOWANCE >> 20} MB) to tell them from quantized ones"}
    passed = plan_bytes - KERNELS_ALLOWANCE < FOLDED_SHARE * as_float32
    detail = (f"{plan_bytes / 1e6:.1f} MB plan; its graph's weights take {as_quantized / 1e6:.1f} MB quantized, "
              f"{as_float32 / 1e6:.1f} MB as float32")
    if not passed:
        detail += ": the engine holds them as floats (TensorRT folded the Q/DQ weights back): not a quantized engine"
    return {**out, "judged": True, "passed": passed, "detail": detail}
