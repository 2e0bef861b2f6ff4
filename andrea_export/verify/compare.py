"""Verification: Polygraphy runs the PyTorch reference and each artifact on the same token ids and
judges them with its comparator and explicit tolerances; we add the figures that matter for a language
model (top-1 / top-5 agreement, KL divergence of the next-token distributions, greedy agreement).

The PyTorch model is always the reference (runner 0): a plugin graph or an engine is never judged
against another artifact that could share its bug.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata

from ..folder.atomic import write_text_atomic
from ..graphs.export import INPUT_NAME, OUTPUT_NAME
from ..model.andrea import Andrea
from ..progress import console, step, styled

# Tolerances per precision live in thresholds.py (TOLERANCES, MIN_TOP1, MIN_TOP5, MAX_KL), with the measurements
# behind them. An element of the logits fails only if BOTH its absolute and relative error exceed the
# tolerances (Polygraphy's rule; relative error is taken against the reference).


class TorchRunner(BaseRunner):
    """A Polygraphy runner for the PyTorch reference (Polygraphy's own PytRunner wants CUDA and a tuple)."""

    def __init__(self, model: Andrea, name: str = "pytorch"):
        super().__init__(name=name)
        self.model = model.eval()

    def activate_impl(self):
        pass

    def deactivate_impl(self):
        pass

    def get_input_metadata_impl(self):
        return TensorMetadata().add(INPUT_NAME, np.int64, (None, None))

    def infer_impl(self, feed_dict):
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = self.model(torch.from_numpy(np.asarray(feed_dict[INPUT_NAME])))
        self.inference_time = time.perf_counter() - t0
        return OrderedDict([(OUTPUT_NAME, logits.float().numpy())])


def onnxrt_runner(onnx_path: str | Path, name: str | None = None):
    """Polygraphy's ONNX Runtime runner (the CUDA provider when onnxruntime-gpu has it, else the CPU).

    A bf16 graph runs on the CPU through `precision.emulate_in_fp32` (every op rounded to bf16), since
    ONNX Runtime's CPU provider has no bf16 kernels; the runner's name then says so."""
    import onnx
    import onnxruntime as ort
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    from ..graphs.precision import emulate_in_fp32, graph_precision
    from ..names import WEIGHT_ONLY

    ort.set_default_logger_severity(3)  # errors only: its constant-folding notes on fp16 graphs are noise
    providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()]
    name = name or f"onnxrt:{Path(onnx_path).name}"
    model = onnx.load(str(onnx_path), load_external_data=False)
    if graph_precision(model) == "bf16" and providers == ["CPUExecutionProvider"]:
        emulated = emulate_in_fp32(onnx.load(str(onnx_path)))
        return OnnxrtRunner(SessionFromOnnx(emulated.SerializeToString(), providers=providers), name=name + " (bf16 emulated)")
    if graph_precision(model) in WEIGHT_ONLY:
        return OnnxrtRunner(weight_only_session(str(onnx_path), providers), name=name)
    return OnnxrtRunner(SessionFromOnnx(str(onnx_path), providers=providers), name=name)


def weight_only_session(source, providers: list[str]):
    """An ONNX Runtime session for a weight-only graph (a path or its bytes). ORT rewrites a Q/DQ graph's
    DequantizeLinear -> MatMul into MatMulNBits that quantizes the activations to int8 too (accuracy level 4)
    unless told not to: not what TensorRT computes, so verification turns that off."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    return ort.InferenceSession(source, options, providers=providers)


def default_shapes(n_positions: int) -> list[tuple[int, int]]:
    """Batch x sequence shapes verified by default: one token, a short prompt, batch > 1, the full context."""
    shapes = [(1, 1), (1, min(17, n_positions)), (4, min(64, n_positions)), (2, n_positions)]
    return list(dict.fromkeys(shapes))


GREEDY_PROMPT = 8  # tokens of the prompt greedy decoding starts from (the KV-cache check uses 8 too)


def check_inputs(cfg, shapes=None, greedy_steps: int = 0) -> None:
    """Raise ConfigError when verification shapes or greedy steps do not fit the model (before any work)."""
    from ..errors import ConfigError

    for s in shapes or []:
        b, t = s
        if b < 1 or not 1 <= t <= cfg.n_positions:
            raise ConfigError(f"verify shape {b}x{t} does not fit {cfg.name}: batch >= 1 and 1 <= seq <= "
                              f"{cfg.n_positions} (the model's context of {cfg.n_positions} tokens)")
    room = cfg.n_positions - GREEDY_PROMPT
    if greedy_steps and greedy_steps > room:
        raise ConfigError(f"--greedy-steps {greedy_steps}: with a prompt of {GREEDY_PROMPT} tokens at most {room} "
                          f"tokens fit the model's context of {cfg.n_positions} tokens")


@dataclasses.dataclass
class VerifyReport:
    passed: bool
    precision: str
    tolerances: dict
    lm_thresholds: dict  # max_kl, and min_top1 or (int4) min_top5
    shapes: list
    comparisons: list  # one dict per (reference, artifact) pair
    skipped: list  # artifacts that could not run here, with the reason
    decoder: dict | None = None  # the KV-cache decoder: step-by-step comparison and greedy agreement
    perplexity: dict | None = None  # on real text (eval_text), per artifact beside PyTorch's; or why not computed
    runtimes: dict | None = None  # other runtimes on the build's graphs: {"openvino-bf16" | "openvino-f32": {...}}
    engine_weights: dict | None = None  # int8 / int4: whether each engine keeps its weights quantized, by its size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def load(cls, path: str | Path) -> "VerifyReport":
        from ..errors import BuildError
        from ..userfiles import MAX_JSON_BYTES, read_json

        data = read_json(path, MAX_JSON_BYTES, "a verification report", BuildError)
        try:
            return cls(**data)
        except TypeError as e:  # not the fields of a report
            raise BuildError(f"{path}: not a verification report written by this andrea-export ({e})") from None

    def save(self, path: str | Path) -> Path:
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")


def lm_thresholds(precision: str) -> dict:
    """The next-token thresholds of `precision` (thresholds.py): max_kl, and min_top1 (with its top1_tie, where
    the precision has one) or (int4) min_top5 (with its top5_tie)."""
    from .thresholds import MAX_KL, MIN_TOP1, MIN_TOP5, TOP1_TIE, TOP5_TIE

    floor = {"min_top1": MIN_TOP1[precision]} if precision in MIN_TOP1 else {"min_top5": MIN_TOP5[precision]}
    if precision in TOP1_TIE:
        floor["top1_tie"] = TOP1_TIE[precision]
    if precision in TOP5_TIE:
        floor["top5_tie"] = TOP5_TIE[precision]
    return {**floor, "max_kl": MAX_KL[precision]}


def lm_passed(lm: dict, thresholds: dict) -> bool:
    """Whether `lm` (lm_metrics, computed with the thresholds' ties) meets `thresholds` (lm_thresholds)."""
    return (lm.get("top1_beyond_ties", lm["top1_agreement"]) >= thresholds.get("min_top1", 0.0)
            and lm.get("top5_beyond_ties", lm["top5_overlap"]) >= thresholds.get("min_top5", 0.0)
            and lm["max_kl"] <= thresholds["max_kl"])


def lm_metrics(ref: np.ndarray, out: np.ndarray, tie: float = 0.0, top5_tie: float = 0.0) -> dict:
    """Top-1 / top-5 agreement and KL(ref || out) of next-token distributions over all positions;
    top1_beyond_ties: top-1 agreement where a position whose tokens differ but whose reference puts the
    artifact's token within `tie` logits of its own counts as agreeing (a tie the precision cannot resolve);
    top5_beyond_ties: top-5 overlap where a reference top-5 token the artifact dropped counts as kept when the
    reference puts it within `top5_tie` logits of the artifact's lowest pick."""
    ref = torch.from_numpy(ref.astype(np.float64)).flatten(0, -2)
    out = torch.from_numpy(out.astype(np.float64)).flatten(0, -2)
    want, got = ref.argmax(-1), out.argmax(-1)
    top1 = (want == got).double().mean().item()
    lead = ref.gather(-1, want[:, None]) - ref.gather(-1, got[:, None])  # the reference's margin over the pick
    beyond = ((want == got) | (lead[:, 0] <= tie)).double().mean().item()
    r5, o5 = ref.topk(5, dim=-1).indices, out.topk(5, dim=-1).indices
    kept = (r5[:, :, None] == o5[:, None, :]).any(-1)  # each reference top-5 token: among the artifact's?
    top5 = kept.double().mean().item()  # share of the top-5 sets
    lowest = ref.gather(-1, o5).min(-1, keepdim=True).values  # the artifact's lowest pick, by the reference
    top5_beyond = (kept | (ref.gather(-1, r5) - lowest <= top5_tie)).double().mean().item()
    lp, lq = ref.log_softmax(-1), out.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {"top1_agreement": top1, "top1_beyond_ties": beyond, "top5_overlap": top5,
            "top5_beyond_ties": top5_beyond, "max_kl": kl.max().item(),
            "mean_kl": kl.mean().item()}


def greedy_agreement_of_runners(runners, prompt: np.ndarray, steps: int) -> dict:
    """Greedy-decode `steps` tokens from `prompt` with each Polygraphy runner of the standard graph (full
    recompute each step, no cache); report where the artifacts first leave the reference. (The KV-cache
    decoder's counterpart, through a runtime Session, is agreement.greedy_agreement.)"""
    seqs = []
    for r in runners:
        ids = prompt.copy()
        for _ in range(steps):
            logits = r.infer({INPUT_NAME: ids})[OUTPUT_NAME]
            ids = np.concatenate([ids, logits[:, -1:].argmax(-1).astype(np.int64)], axis=1)
        seqs.append(ids[0, prompt.shape[1]:].tolist())
    ref = seqs[0]
    result = {}
    for r, seq in zip(runners[1:], seqs[1:]):
        first = next((i for i, (a, b) in enumerate(zip(ref, seq)) if a != b), None)
        result[r.name] = {"steps": steps, "agree": first is None, "first_divergence": first}
    return result


def verify(
    model: Andrea,
    artifacts: dict[str, object],
    *,
    precision: str = "fp32",
    shapes: list[tuple[int, int]] | None = None,
    greedy_steps: int = 32,
    seed: int = 0,
    skipped: list | None = None,
    eval_windows: np.ndarray | None = None,
    eval_text: dict | None = None,
    quiet: bool = False,
) -> VerifyReport:
    """Compare each artifact runner with the PyTorch reference.

    Args:
        model: the reference model.
        artifacts: name -> Polygraphy runner, or a path to an ONNX file (run with ONNX Runtime).
        precision: selects the tolerances (thresholds.TOLERANCES, MIN_TOP1 / MIN_TOP5, MAX_KL).
        shapes: (batch, seq) pairs; default `default_shapes(context)`.
        greedy_steps: greedy tokens decoded per artifact (0 to skip).
        skipped: artifacts that cannot run here, as {"artifact", "reason"} dicts, carried into the report.
        eval_windows: token windows of a real text ([n, T] int64, text.windows): the perplexity of every
            artifact is then measured beside PyTorch's and must be within thresholds.MAX_PPL_REL of it.
            Without them the report says why none was computed.
        eval_text: what the windows are (sha256, tokens, ...), carried into the report.
    """
    from polygraphy.comparator import Comparator, SimpleCompareFunc
    from polygraphy.logger import G_LOGGER

    from .thresholds import MAX_PPL_REL, TOLERANCES

    cfg = model.cfg
    check_inputs(cfg, shapes, greedy_steps)
    shapes = shapes or default_shapes(cfg.n_positions)
    tol, lm_tol = TOLERANCES[precision], lm_thresholds(precision)
    runners = [TorchRunner(model)]
    for name, a in artifacts.items():
        runners.append(onnxrt_runner(a, name=name) if isinstance(a, (str, Path)) else a)
    rng = np.random.default_rng(seed)
    feeds = [{INPUT_NAME: rng.integers(0, cfg.vocab_size, size=s, dtype=np.int64)} for s in shapes]

    severity = G_LOGGER.module_severity
    G_LOGGER.module_severity = G_LOGGER.ERROR  # our own summary replaces Polygraphy's per-output log
    try:
        with step(f"Running {', '.join(r.name for r in runners)} on {len(shapes)} input shapes", quiet):
            results = Comparator.run(runners, data_loader=feeds)
        compare = SimpleCompareFunc(rtol=tol["rtol"], atol=tol["atol"], check_error_stat="elemwise")
        pairs = [(0, i) for i in range(1, len(runners))]
        accuracy = Comparator.compare_accuracy(results, comparisons=pairs, compare_func=compare)[0]
        greedy = {}
        if greedy_steps:
            with step(f"Greedy decoding {greedy_steps} tokens with each runner", quiet):
                for r in runners:
                    r.activate()
                try:
                    prompt = rng.integers(0, cfg.vocab_size, size=(1, GREEDY_PROMPT))
                    greedy = greedy_agreement_of_runners(runners, prompt.astype(np.int64), greedy_steps)
                finally:
                    for r in runners:
                        r.deactivate()
        ppl = None
        if eval_windows is not None:
            with step(f"Perplexity on {eval_windows.size:,} tokens of text with each runner", quiet):
                ppl = {r.name: perplexity_of_runner(r, eval_windows) for r in runners}
    finally:
        G_LOGGER.module_severity = severity

    comparisons = []
    ref_name = runners[0].name
    for _, i in pairs:
        name = runners[i].name
        per_shape = []
        for it, shape in enumerate(shapes):
            ocr = accuracy[(ref_name, name)][it][OUTPUT_NAME]
            lm = lm_metrics(results[ref_name][it][OUTPUT_NAME], results[name][it][OUTPUT_NAME],
                            tie=lm_tol.get("top1_tie", 0.0), top5_tie=lm_tol.get("top5_tie", 0.0))
            lm_ok = lm_passed(lm, lm_tol)
            per_shape.append({
                "shape": list(shape), "passed": bool(ocr) and lm_ok, "logits_within_tolerance": bool(ocr),
                "max_abs": float(ocr.max_absdiff), "mean_abs": float(ocr.mean_absdiff),
                "median_abs": float(ocr.median_absdiff), "max_rel": float(ocr.max_reldiff),
                "mean_rel": float(ocr.mean_reldiff), "median_rel": float(ocr.median_reldiff), **lm,
            })
        g = greedy.get(name)
        passed = all(s["passed"] for s in per_shape) and (g is None or g["agree"] or precision != "fp32")
        p = None
        if ppl is not None:
            rel = ppl[name] / ppl[ref_name] - 1.0
            p = {"perplexity": ppl[name], "reference": ppl[ref_name], "rel_diff": rel,
                 "passed": abs(rel) <= MAX_PPL_REL[precision]}
            passed = passed and p["passed"]
        comparisons.append({"reference": ref_name, "artifact": name, "passed": passed, "shapes": per_shape,
                            "greedy": g, "perplexity": p})
    if ppl is None:
        summary = {"computed": False, "reason": "no evaluation text and tokenizer were given (build --tokenizer "
                   "--eval-text): perplexity is not computed; on random weights it would not mean anything"}
    else:
        summary = {"computed": True, "text": eval_text or {}, "windows": int(eval_windows.shape[0]),
                   "window": int(eval_windows.shape[1]), "predicted_tokens": int(eval_windows[:, 1:].size),
                   "max_rel_diff": MAX_PPL_REL[precision], "reference": {ref_name: ppl[ref_name]},
                   "artifacts": {name: ppl[name] for name in ppl if name != ref_name}}
    report = VerifyReport(
        passed=all(c["passed"] for c in comparisons), precision=precision, tolerances=tol, lm_thresholds=lm_tol,
        shapes=[list(s) for s in shapes], comparisons=comparisons, skipped=list(skipped or []), perplexity=summary,
    )
    return report


def perplexity_of_runner(runner, windows: np.ndarray) -> float:
    """Perplexity of a Polygraphy runner (PyTorch, an ONNX graph on ONNX Runtime, an engine) on token
    windows, a few thousand tokens per call."""
    from ..model.text import perplexity

    with runner:
        return perplexity(lambda ids: runner.infer({INPUT_NAME: ids})[OUTPUT_NAME], windows,
                          batch=max(1, 4096 // windows.shape[1]))


def print_summary(report: VerifyReport) -> None:
    """A short human summary of a report (rich table on stderr)."""
    from rich.table import Table

    t = Table(title=f"Verification against PyTorch ({report.precision}; rtol {report.tolerances['rtol']:g}, "
                    f"atol {report.tolerances['atol']:g})")
    for col in ("artifact", "batch x seq", "max abs", "mean abs", "max rel*", "top-1", "top-5", "max KL", "ok"):
        t.add_column(col, justify="right" if col not in ("artifact",) else "left")
    for c in report.comparisons:
        for s in c["shapes"]:
            t.add_row(c["artifact"], "x".join(map(str, s["shape"])), f"{s['max_abs']:.2e}", f"{s['mean_abs']:.2e}",
                      f"{s['max_rel']:.1e}", f"{s['top1_agreement']:.4f}", f"{s['top5_overlap']:.4f}",
                      f"{s['max_kl']:.1e}", styled("yes", "green") if s["passed"] else styled("NO", "bold red"))
    console.print(t)
    console.print("* relative error is against the reference and explodes near zero; an element fails only when "
                  "both its absolute and relative error exceed the tolerances.")
    for c in report.comparisons:
        g = c["greedy"]
        if g:
            where = "all tokens agree" if g["agree"] else f"first divergence at token {g['first_divergence']}"
            console.print(f"greedy {g['steps']} tokens, {c['artifact']}: {where}")
    decoder = report.decoder or {}
    for d in filter(None, [report.decoder, decoder.get("inplace"), decoder.get("qdq")]):  # standard, in-place, Q/DQ
        worst = max(s["max_abs_logits"] for s in d["steps"]["per_step"])
        console.print(f"KV-cache decoder {d['artifact']}: prefill + {d['steps']['steps']} decode steps vs PyTorch, "
                      f"max |logit diff| {worst:.2e}: ", styled("ok", "green") if d["steps"]["passed"]
                      else styled("FAILED", "bold red"), sep="")  # a str and a Text: two renderables, no '+'
        greedy = [("ONNX Runtime", d.get("greedy"))]
        greedy += [(f"engine, {path}", r["greedy"]) for path, r in (d.get("engine") or {}).get("paths", {}).items()]
        for label, g in greedy:
            if g and "agree" in g:
                where = "all tokens agree" if g["agree"] else (
                    f"first divergence at token {g['first_divergence']} (logits there: {g['at_divergence']})")
                console.print(f"greedy {g['steps']} tokens with the KV cache, {label}: {where}")
            elif g:
                console.print(f"greedy with the KV cache, {label}: {g['skipped']}")
        for path, r in (d.get("engine") or {}).get("paths", {}).items():  # CUDA graph, its fallback, growing
            bad = [k for k, b in r["boundary"].items() if not b["passed"]] + (["greedy"] if not r["greedy"]["passed"] else [])
            if r.get("captured") is False:
                bad.append(f"CUDA graph capture failed: {r['capture_error']}")
            console.print(f"engine, {path}: greedy + full-context boundary (past n-2, n-1; prefill of n): ",
                          styled("ok", "green") if r["passed"] else styled("FAILED " + "; ".join(bad), "bold red"), sep="")
    p = report.perplexity
    if p and p.get("computed"):
        (ref_name, ref), = p["reference"].items()
        console.print(f"perplexity on {p['predicted_tokens']:,} tokens of text: {ref_name} {ref:.4f}; " + ", ".join(
            f"{c['artifact']} {c['perplexity']['perplexity']:.4f} ({c['perplexity']['rel_diff']:+.2e})"
            for c in report.comparisons if c.get("perplexity")) + f" (bound {p['max_rel_diff']:.0e} relative)")
    elif p:
        console.print(f"perplexity: {p['reason']}")
    for name, r in (report.runtimes or {}).items():  # another runtime on the build's graphs (OpenVINO)
        c, g = r["comparison"], r.get("greedy")
        worst_kl, least_top1 = max(s["max_kl"] for s in c["shapes"]), min(s["top1_agreement"] for s in c["shapes"])
        ppl = f", perplexity {c['perplexity']['rel_diff']:+.2e} relative" if c.get("perplexity") else ""
        where = "" if not g else ("; greedy: all tokens agree" if g["agree"] else
                                  f"; greedy: first divergence at token {g['first_divergence']}")
        console.print(f"{name} ({r['graph']}, {r['thresholds']} thresholds): max KL {worst_kl:.1e}, top-1 "
                      f"{least_top1:.4f}{ppl}{where}: ", styled("ok", "green") if r["passed"] else
                      styled("FAILED", "bold red"), sep="")  # fmt: skip
    for role, c in (report.engine_weights or {}).items():  # int8 / int4 engines: weights kept quantized
        verdict = styled("ok", "green") if c["passed"] and c["judged"] else (
            styled("not judged", "yellow") if c["passed"] else styled("FAILED", "bold red"))
        console.print(f"{role} {c['plan']} keeps its weights quantized: {c['detail']}: ", verdict, sep="")
    for s in report.skipped:
        console.print(styled("not run here", "yellow"), f"{s['artifact']}: {s['reason']}")
    verdict = styled("PASSED", "bold green") if report.passed else styled("FAILED", "bold red")
    console.print("Verification", verdict)


def reference_model_for(onnx_path: str | Path, checkpoint: str | Path | None = None, config=None) -> Andrea:
    """The PyTorch model an ONNX file must match: the given checkpoint, or the seeded random init that the
    file's metadata records. Refuses to guess when the file came from a checkpoint that is not given."""
    from ..errors import ConfigError
    from ..folder.reader import metadata_json
    from ..graphs.layout import check_onnx, config_of, metadata_of
    from ..model.checkpoint import model_for
    from ..names import CONFIG_KEY, WEIGHTS_KEY

    proto = check_onnx(onnx_path)  # once: its metadata and its signature come from this one load
    meta = metadata_of(proto)
    recorded = config_of(meta, onnx_path) if CONFIG_KEY in meta else None
    if config is not None and recorded is not None and config != recorded:
        differ = [f"{k} {v} vs {getattr(recorded, k)}" for k, v in config.to_dict().items() if v != getattr(recorded, k)]
        raise ConfigError(f"--config {config.name} does not match {onnx_path}, which was exported from {recorded.name} "
                          f"({'; '.join(differ)}); leave out --config: the file records its own")
    cfg = config or recorded
    source = metadata_json(meta, WEIGHTS_KEY, onnx_path) if WEIGHTS_KEY in meta else {}
    model = model_for(source, cfg, checkpoint, what=str(onnx_path))
    check_model_io(onnx_path, model.cfg, proto.graph)
    return model


def check_model_io(onnx_path: str | Path, cfg, graph=None) -> None:
    """Refuse, before anything runs, an ONNX file whose inputs and outputs are not the model's: one input
    input_ids int64 [batch, seq], one output logits float [batch, seq, vocab]. Metadata can be copied
    onto any graph; the graph's own signature cannot lie about what it takes. `graph`: the file's graph,
    when already loaded."""
    import onnx

    from ..errors import ExportError

    if graph is None:
        graph = onnx.load(str(onnx_path), load_external_data=False).graph
    init = {t.name for t in graph.initializer}
    sig = {"inputs": [(v.name, v.type.tensor_type.elem_type, len(v.type.tensor_type.shape.dim)) for v in graph.input
                      if v.name not in init],
           "outputs": [(v.name, v.type.tensor_type.elem_type, len(v.type.tensor_type.shape.dim)) for v in graph.output]}
    want_in = [(INPUT_NAME, onnx.TensorProto.INT64, 2)]
    out = graph.output[0].type.tensor_type.shape.dim if len(graph.output) == 1 else []
    vocab = out[-1].dim_value if len(out) == 3 else None
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    ok_out = (len(sig["outputs"]) == 1 and sig["outputs"][0][0] == OUTPUT_NAME and sig["outputs"][0][1] in floats
              and sig["outputs"][0][2] == 3 and vocab in (0, cfg.vocab_size))  # 0: a symbolic dimension
    if sig["inputs"] != want_in or not ok_out:
        def show(vals):
            return ", ".join(f"{n} {onnx.TensorProto.DataType.Name(t).lower()} rank {r}" for n, t, r in vals) or "none"

        raise ExportError(f"{onnx_path}: takes {show(sig['inputs'])} and gives {show(sig['outputs'])}; an "
                          f"{cfg.name} graph takes input_ids int64 [batch, seq] and gives logits [batch, seq, "
                          f"{cfg.vocab_size}]: not this model's graph (its metadata may be copied)")
