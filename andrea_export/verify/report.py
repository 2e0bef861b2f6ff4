"""The verification report: what was compared, at which tolerances, with what outcome (VerifyReport,
saved as verify.json), and its short human summary."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..folder.atomic import write_text_atomic
from ..progress import console, styled


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
