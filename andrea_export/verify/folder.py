"""Every artifact of a build folder (staged or finished) against the PyTorch model: the graphs through
Polygraphy (compare.py), the KV-cache decoders step by step and by greedy decoding (agreement.py), the
engines where this machine can run them (engine.py); and the build status the report gives."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ..catalog import ENGINES, Role
from ..folder.reader import inside, read_engine_info
from ..names import EVAL_TEXT_FILE, TOKENIZER_FILE, WEIGHT_ONLY
from ..progress import step
from .engine import engine_blocker, engine_checks, engine_runner, quantized_weights_check, slot_engine_checks


def evaluation_windows(tok, path: Path | str, cfg) -> tuple:
    """(token windows, description) of the evaluation text in `path`, tokenized once."""
    from ..model.text import describe_text, encode, read_text, windows

    body = read_text(path)
    ids = encode(tok, body)
    return windows(ids, cfg.n_positions), describe_text(body, tok, len(ids))


def folder_evaluation(folder: Path, artifacts: Mapping, cfg):
    """(token windows, description) of the build's evaluation text, or (None, None) without one."""
    from ..model.text import load_tokenizer

    if Role.EVAL_TEXT not in artifacts:
        return None, None
    # fixed names: a manifest's path is never followed
    return evaluation_windows(load_tokenizer(folder / TOKENIZER_FILE), folder / EVAL_TEXT_FILE, cfg)


def decoder_checks(folder: Path, model, precision: str, artifacts: Mapping, greedy_steps: int, seed: int = 0) -> dict:
    """Polygraphy step by step (prefill of a left-padded batch, then one token at a time, every output),
    and greedy decoding through the runtime (ONNX Runtime, KV cache) against PyTorch recomputing all."""
    import numpy as np

    cfg = model.cfg
    path = folder / artifacts[Role.DECODER_ONNX]
    rng = np.random.default_rng(seed)
    n = min(16, cfg.n_positions // 4)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist(), rng.integers(0, cfg.vocab_size, n // 2).tolist()]
    result = decoder_graph_checks(model, path, precision, prompts, greedy_steps)
    if Role.DECODER_ONNX_QDQ in artifacts:  # the weights the decoder engine gets (quantized for TensorRT)
        qdq = folder / artifacts[Role.DECODER_ONNX_QDQ]
        with step(f"Verifying the engines' Q/DQ decoder {qdq.name} step by step"):
            result["qdq"] = _step_checks(model, qdq, precision, prompts)
        result["passed"] = result["passed"] and result["qdq"]["passed"]
    if Role.DECODER_ONNX_INPLACE in artifacts:  # the graph ONNX Runtime and genai run: the same checks
        with step("Verifying the in-place KV-cache decoder step by step"):
            result["inplace"] = decoder_graph_checks(model, folder / artifacts[Role.DECODER_ONNX_INPLACE], precision,
                                                      prompts, greedy_steps)
        result["passed"] = result["passed"] and result["inplace"]["passed"]
    if Role.DECODER_ONNX_SLOTS in artifacts:  # TensorRT's in-flight batching graph, run by ONNX Runtime in its place
        slots = folder / artifacts[Role.DECODER_ONNX_SLOTS]
        with step(f"Verifying the slot decoder {slots.name} step by step"):
            result["slots"] = _slot_checks(model, slots, precision, prompts, greedy_steps)
        result["passed"] = result["passed"] and result["slots"]["passed"]
    return result


def _slot_checks(model, path: Path, precision: str, prompts, greedy_steps: int) -> dict:
    """The in-place decoders' checks; an int8/int4 slot graph is the Q/DQ form, checked step by step only, as
    TensorRT computes it (the runtime's greedy decoding would let ONNX Runtime quantize its activations too)."""
    if precision in WEIGHT_ONLY:
        return _step_checks(model, path, precision, prompts)
    return decoder_graph_checks(model, path, precision, prompts, greedy_steps)


def _step_checks(model, path: Path, precision: str, prompts) -> dict:
    from .agreement import verify_decoder
    from .thresholds import TOLERANCES

    steps = verify_decoder(model, path, prompts, steps=8, **TOLERANCES[precision])
    return {"artifact": path.name, "steps": steps, "passed": steps["passed"]}


def decoder_graph_checks(model, path: Path, precision: str, prompts, greedy_steps: int) -> dict:
    from ..runtime import load
    from .agreement import greedy_agreement, verify_decoder
    from .thresholds import TOLERANCES

    steps = verify_decoder(model, path, prompts, steps=8, **TOLERANCES[precision])
    result = {"artifact": path.name, "steps": steps, "passed": steps["passed"]}
    if precision == "bf16":  # ONNX Runtime's CPU provider has no bf16 kernels for a whole-session decode
        result["greedy"] = {"skipped": "bf16 decoding needs a GPU runtime (ONNX Runtime CPU has no bf16 kernels)"}
        return result
    if greedy_steps:
        with step(f"Greedy decoding {greedy_steps} tokens with the KV cache (ONNX Runtime, {path.name}) and PyTorch"), \
                load(path, "onnxruntime", providers=["CPUExecutionProvider"]) as sess:
            greedy = greedy_agreement(model, sess, prompts[0][:8], n_tokens=greedy_steps)
        greedy.pop("reference_tokens", None), greedy.pop("candidate_tokens", None)
        result["greedy"] = greedy
        if precision == "fp32":  # lower precisions report the first divergence and its margin, and may diverge
            result["passed"] = result["passed"] and greedy["agree"]
    return result


def verify_folder(folder: Path, model, precision: str, artifacts: Mapping, engine_info: dict, shapes=None,
                  greedy_steps=32, evaluation: tuple | None = None):
    """Verify every artifact of a (staged or finished) build folder against the PyTorch model. `evaluation`:
    the evaluation text's (windows, description) when the caller has it, else read from the folder."""
    from .compare import verify

    runners: dict[str, object] = {"onnxrt": folder / artifacts[Role.ONNX],
                                  "onnxrt-plugin": folder / artifacts[Role.ONNX_PLUGIN]}
    skipped = []
    runner, reason = engine_runner(folder / artifacts[Role.ENGINE], engine_info)
    if runner is not None:
        runners["engine"] = runner
    else:
        skipped.append({"artifact": Role.ENGINE.value, "reason": reason})
    shapes = [tuple(s) for s in shapes] if shapes else None
    wins, described = evaluation or folder_evaluation(folder, artifacts, model.cfg)
    report = verify(model, runners, precision=precision, shapes=shapes, greedy_steps=greedy_steps, skipped=skipped,
                    eval_windows=wins, eval_text=described)
    if Role.DECODER_ONNX in artifacts:
        with step("Verifying the KV-cache decoder step by step"):
            report.decoder = decoder_checks(folder, model, precision, artifacts, greedy_steps)
        if Role.DECODER_ENGINE in artifacts:
            plan = folder / artifacts[Role.DECODER_ENGINE]
            reason = engine_blocker(plan, read_engine_info(folder / artifacts[Role.DECODER_ENGINE_INFO]))
            if reason:
                report.skipped.append({"artifact": Role.DECODER_ENGINE.value, "reason": reason})
            else:  # the runtime's TensorRT session (preallocated buffers, CUDA graph or not) decodes like PyTorch
                report.decoder["engine"] = engine_checks(folder, model, artifacts, greedy_steps or 32, precision)
                report.decoder["passed"] = report.decoder["passed"] and report.decoder["engine"]["passed"]
        if Role.SLOT_ENGINE in artifacts:
            plan = folder / artifacts[Role.SLOT_ENGINE]
            reason = engine_blocker(plan, read_engine_info(folder / artifacts[Role.SLOT_ENGINE_INFO]))
            if reason:
                report.skipped.append({"artifact": Role.SLOT_ENGINE.value, "reason": reason})
            else:  # the runtime's slot cache, alone and in-flight batched, decodes like PyTorch
                report.decoder["in_flight_engine"] = slot_engine_checks(folder, model, artifacts, greedy_steps or 32, precision)
                report.decoder["passed"] = report.decoder["passed"] and report.decoder["in_flight_engine"]["passed"]
        report.passed = report.passed and report.decoder["passed"]
    if precision in WEIGHT_ONLY:  # the engines must keep their weights quantized; TensorRT may fold them back
        report.engine_weights = engine_weights_checks(folder, artifacts, engine_info)
        report.passed = report.passed and all(c["passed"] for c in report.engine_weights.values())
    if precision == "fp32":  # OpenVINO runs these fp32 graphs too (in bf16 where the CPU has it): checked as it runs
        from ..errors import MissingDependency
        from .openvino import openvino_checks, openvino_precision, runtime_name

        try:
            computes_in = openvino_precision()
        except MissingDependency:
            report.skipped.append({"artifact": "openvino",
                                   "reason": "OpenVINO is not installed (pip install 'andrea-export[openvino]')"})
        else:
            name = runtime_name(computes_in)
            report.runtimes = {name: openvino_checks(folder, model, artifacts, shapes, greedy_steps, (wins, described),
                                                     inference_precision=computes_in)}  # fmt: skip
            report.passed = report.passed and report.runtimes[name]["passed"]
    return report


def engine_weights_checks(folder: Path, artifacts: Mapping, engine_info: dict) -> dict:
    """quantized_weights_check of each engine of the folder against the graph its sidecar says it was built from
    (a path read from the sidecar: it must stay inside the folder)."""
    infos = {Role.ENGINE: engine_info}
    if Role.DECODER_ENGINE_INFO in artifacts:
        infos[Role.DECODER_ENGINE] = read_engine_info(folder / artifacts[Role.DECODER_ENGINE_INFO])
    checks = {}
    for role, info in infos.items():
        if role in artifacts and info and "onnx" in info:  # the sidecar's field: the graph it was built from
            source = inside(folder, info["onnx"], f"{artifacts[role]}.json 'onnx'")
            checks[role] = quantized_weights_check(folder / artifacts[role], source)
    return checks


def build_status(report) -> str:
    engine_ran = not any(s["artifact"] in ENGINES for s in report.skipped)
    return "failed" if not report.passed else ("passed" if engine_ran else "engine-unverified")


def verification_record(report) -> dict:
    return {"passed": report.passed, "report": "verify.json",
            "engine_verified": not any(s["artifact"] in ENGINES for s in report.skipped),
            "skipped": report.skipped, "artifacts": {c["artifact"]: c["passed"] for c in report.comparisons},
            "perplexity": ({**p["reference"], **p["artifacts"], **_runtime_perplexities(report)}
                           if (p := report.perplexity) and p.get("computed") else None),
            "runtimes": {name: r["passed"] for name, r in (report.runtimes or {}).items()},
            "cpu_decode": next((r["decode"] for r in (report.runtimes or {}).values() if r.get("decode")), None)}


def _runtime_perplexities(report) -> dict:
    return {name: c["perplexity"]["perplexity"] for name, r in (report.runtimes or {}).items()
            if (c := r["comparison"]).get("perplexity")}  # fmt: skip
