"""Benchmark outputs: the JSON document (stable schema), CSV, a Markdown table, PNG plots, and
`compare()` of two runs. Pure functions of the result document; `run.py` produces it.

The document (schema_version 1):

    {
      "schema_version": 1, "kind": "andrea-export-bench", "created": ISO-8601,
      "config": ModelConfig dict, "weights": {"source", "fingerprint"},
      "settings": {"threads", "quick", "warmup", "min_repeats", "max_repeats", "budget_s", ...},
      "environment": {...}, "machine": {"bandwidth_GBps", "copy_GBps", "read_GBps", "matmul_GFLOPs", ...},
      "backends": {name: {"status": "ok" | "skipped" | "failed", "reason", ...}},
      "rows": [ROW, ...], "ratios": [RATIO, ...], "goals": [GOAL, ...],
      "peers": {"ours", "ratios": [PEER, ...], "skipped": [{"peer", "scenario", "reason"}, ...]},
      "inplace": [GAIN, ...],
      "warnings": [str, ...], "failed_cases": [{"case", "backends", "error"}, ...],
      "loadavg_end": [1, 5, 15-minute load averages]
    }

    ROW   = {"scenario": "prefill" | "decode" | "generate", "backend", "batch", "seq", "past", "new_tokens",
             "tokens", "n", "min_ms", "median_ms", "mean_ms", "p90_ms", "p99_ms", "cv", "precision",
             "flops", "bytes", "floor_ms", "bound", "x_floor", "gflops", "gbps", "tokens_per_s", "x_ours", "timer"}
            precision: "fp32", "int8" or "int4" (the weights), "bf16" (fp32 weights computed in bf16: OpenVINO's
            default on a bf16 CPU); non-fp32 rows have null bytes, floor_ms, bound,
            x_floor and gbps (the floor is fp32's: their speed is reported against ours instead)
            x_ours = median over rounds of t_backend / t_ours (OURS ran in the same rounds; else null)
    RATIO = {"scenario", "batch", "seq", "past", "new_tokens", "baseline", "backend", "speedup"}
            speedup = median over iterations of t_baseline / t_backend (> 1: backend is faster)
    GOAL  = {"name", "target", "value", "met" (bool or null when not measured), "detail"}
    PEER  = {"scenario", "batch", "seq", "past", "new_tokens", "peer", "precision", "ours", "peer_ms", "ours_ms",
             "time_ratio"}
            time_ratio = median over rounds of t_peer / t_ours, `ours` our backend at the peer's precision
            (> 1: ours is faster); peers are what users run instead
    GAIN  = {"scenario", "batch", "seq", "past", "new_tokens", "concat_ms", "inplace_ms", "time_ratio"}
            what the in-place cache gains: time_ratio = the CONCAT row's x_ours (ours on the standard,
            concatenating decoder over ours on the in-place one, paired by round; > 1: in-place is faster)

Rows are matched across runs by ROW_KEY.
"""

from __future__ import annotations

import csv
import importlib
import io
import json
from pathlib import Path

from ..errors import AndreaExportError
from ..folder.atomic import write_text_atomic

SCHEMA_VERSION = 1
KIND = "andrea-export-bench"
ROW_KEY = ("scenario", "backend", "batch", "seq", "past", "new_tokens")
CSV_FIELDS = (
    "scenario", "backend", "batch", "seq", "past", "new_tokens", "tokens", "n",
    "min_ms", "median_ms", "mean_ms", "p90_ms", "p99_ms", "cv", "precision",
    "floor_ms", "bound", "x_floor", "gflops", "gbps", "tokens_per_s", "x_ours", "timer",
)  # fmt: skip
OURS = "ort-cpu"  # our graph in ONNX Runtime: the peers run in the same runtime, so they are measured against it
CONCAT = "ort-cpu-concat"  # ours on the standard decoder (OURS runs the in-place one)
PEERS = ("optimum", "genai", "openvino", "openvino-f32", "openvino-int8", "openvino-int4", "ctranslate2",
         "ctranslate2-int8", "llama-cpp", "llama-cpp-q8_0", "llama-cpp-q4_0", "optimum-hf-folder")
# ours at each precision a peer computes in (OpenVINO's default on a bf16 CPU is bf16)
OURS_BY_PRECISION = {"fp32": OURS, "int8": "ort-cpu-int8", "int4": "ort-cpu-int4", "bf16": "ours-openvino"}
REQUIRED_TOP = ("schema_version", "kind", "config", "settings", "environment", "machine", "backends", "rows")


class BenchSchemaError(AndreaExportError):
    """A file is not a benchmark result this version can read."""


# ---------------------------------------------------------------- JSON


def to_json(doc: dict) -> str:
    return json.dumps(doc, indent=2, sort_keys=False, allow_nan=False) + "\n"


def write_json(doc: dict, path: str | Path) -> Path:
    return write_text_atomic(path, to_json(doc))


def load_json(path: str | Path) -> dict:
    """Read and check a result document (schema version and required keys)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchSchemaError(f"{path}: no such benchmark result") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BenchSchemaError(f"{path}: not valid JSON ({e})") from None
    return validate(doc, source=str(path))


def validate(doc: dict, source: str = "result") -> dict:
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise BenchSchemaError(f"{source}: not an andrea-export benchmark result (kind != {KIND!r})")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise BenchSchemaError(
            f"{source}: schema_version {doc.get('schema_version')!r}; this andrea-export reads {SCHEMA_VERSION}"
        )
    missing = [k for k in REQUIRED_TOP if k not in doc]
    if missing:
        raise BenchSchemaError(f"{source}: missing key(s) {', '.join(missing)}")
    for i, row in enumerate(doc["rows"]):
        absent = [k for k in ROW_KEY + ("median_ms",) if k not in row]
        if absent:
            raise BenchSchemaError(f"{source}: row {i} lacks {', '.join(absent)}")
    return doc


# ---------------------------------------------------------------- the peers


def pair_ratio(doc: dict, baseline: str, backend: str, **key) -> dict | None:
    """The ratio row of `backend` over `baseline` for a case (speedup = t_baseline / t_backend, paired by
    round), whichever of the two ran first."""
    for x in doc.get("ratios", []):
        if all(x.get(k) == v for k, v in key.items()):
            if (x["baseline"], x["backend"]) == (baseline, backend):
                return x
            if (x["baseline"], x["backend"]) == (backend, baseline):
                return dict(x, baseline=baseline, backend=backend, speedup=1.0 / x["speedup"])
    return None


def ours_at(doc: dict, precision: str) -> str:
    """Our backend a peer of `precision` is held against: ours at the same precision where it ran (bf16:
    ours on OpenVINO, the same fp32 graph computed in bf16), else OURS (fp32)."""
    name = OURS_BY_PRECISION.get(precision, OURS)
    return name if doc["backends"].get(name, {}).get("status") == "ok" else OURS


def peers(doc: dict) -> dict:
    """Each peer's time as a multiple of ours at its precision (`ours_at`), per case (paired by round), and
    where a peer did not run: the whole backend (not installed, failed) or one scenario (no such call), with
    the reason."""
    case = ("scenario", "batch", "seq", "past", "new_tokens")
    rows = {(r["backend"], *(r[k] for k in case)): r for r in doc["rows"]}
    ratios = []
    for r in doc["rows"]:
        if r["backend"] not in PEERS:
            continue
        ours = ours_at(doc, r.get("precision", "fp32"))
        o = rows.get((ours, *(r[k] for k in case)))
        if ours == OURS:  # the row's own x_ours: median over rounds of t_peer / t_ours
            x = r.get("x_ours")
        else:
            pair = pair_ratio(doc, r["backend"], ours, **{k: r[k] for k in case})  # t_peer / t_ours
            x = pair["speedup"] if pair else None
        if o is not None and x is not None:
            ratios.append({**{k: r[k] for k in case}, "peer": r["backend"], "precision": r.get("precision", "fp32"),
                           "ours": ours, "peer_ms": r["median_ms"], "ours_ms": o["median_ms"],
                           "time_ratio": x})  # fmt: skip
    skipped = []
    for name in PEERS:
        b = doc["backends"].get(name)
        if b is None:
            continue
        if b.get("status") != "ok":
            skipped.append({"peer": name, "scenario": "all", "reason": f"{b.get('status')}: {b.get('reason')}"})
        for scen, reason in b.get("skipped_cases", {}).items():
            skipped.append({"peer": name, "scenario": scen, "reason": reason})
    return {"ours": OURS, "ratios": ratios, "skipped": skipped}


def inplace_gain(doc: dict) -> list[dict]:
    """Per case that both ran: ours on the standard (concatenating) decoder over ours on the in-place one."""
    case = ("scenario", "batch", "seq", "past", "new_tokens")
    ours = {tuple(r[k] for k in case): r for r in doc["rows"] if r["backend"] == OURS}
    out = []
    for r in doc["rows"]:
        o = ours.get(tuple(r[k] for k in case))
        if r["backend"] == CONCAT and o is not None and r.get("x_ours") is not None:
            out.append({**{k: r[k] for k in case}, "concat_ms": r["median_ms"], "inplace_ms": o["median_ms"],
                        "time_ratio": r["x_ours"]})  # fmt: skip
    return out


# ---------------------------------------------------------------- CSV and Markdown


def to_csv(doc: dict) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for row in doc["rows"]:
        w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_FIELDS})
    return buf.getvalue()


def _fmt(v, digits=3):
    if v is None:
        return "-"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.{digits}g}"
    return str(v)


def _shape(row: dict) -> str:
    if row["scenario"] == "prefill":
        return f"B={row['batch']} T={row['seq']}"
    if row["scenario"] == "decode":
        return f"B={row['batch']} P={row['past']}"
    return f"B={row['batch']} prompt={row['seq']} new={row['new_tokens']}"


def to_markdown(doc: dict) -> str:
    """Markdown: a header on the machine, one table per scenario, the speedups and the goals."""
    sections = (_md_header, _md_notes, _md_backends, _md_scenarios, _md_peers, _md_inplace, _md_speedups, _md_goals)
    return "\n".join(line for section in sections for line in section(doc))


def _md_header(doc: dict) -> list[str]:
    """The machine, its measured limits and the weights, and what x floor means."""
    m, s = doc["machine"], doc["settings"]
    cfg = doc["config"]
    env = doc["environment"]
    out = [
        f"# andrea-export benchmark: {cfg.get('name')}",
        "",
        (f"- created {doc.get('created', '?')}, git {env.get('git', {}).get('revision', '?')}"
        f"{' (dirty)' if env.get('git', {}).get('dirty') else ''}"),
        (f"- CPU: {env.get('cpu', {}).get('model', '?')}, {env.get('cpu', {}).get('logical_cores', '?')} logical cores; "
        f"threads used: {s.get('threads')}; load average at start {env.get('loadavg_start')}, end {doc.get('loadavg_end')}"),
        (f"- measured limits: memory bandwidth {_fmt(m.get('bandwidth_GBps'))} GB/s "
        f"(copy {_fmt(m.get('copy_GBps'))}, read {_fmt(m.get('read_GBps'))}), "
        f"fp32 matmul {_fmt(m.get('matmul_GFLOPs'))} GFLOP/s ({s.get('threads')} threads)"),
        f"- weights: {doc.get('weights', {}).get('source', '?')}; mode: {'quick' if s.get('quick') else 'full'}",
        "",
        ("`x floor` = median / floor, where floor = max(FLOPs / matmul rate, bytes / bandwidth): "
        "1.0 would be the machine's limit."),
        "",
    ]
    return out


def _md_notes(doc: dict) -> list[str]:
    """Warnings, failed cases and the backends that did not run."""
    out = []
    for w in doc.get("warnings", []):
        out.append(f"- **WARNING**: {w}")
    for f in doc.get("failed_cases", []):
        out.append(f"- **FAILED** {f['case']} ({', '.join(f['backends'])}): {f['error']}")
    for name, b in doc["backends"].items():
        if b.get("status") != "ok":
            out.append(f"- backend `{name}`: {b.get('status')}: {b.get('reason')}")
    return out + [""]


def _md_backends(doc: dict) -> list[str]:
    """What each backend computes in, where its runtime says."""
    out: list[str] = []
    ran = {name: b for name, b in doc["backends"].items() if b.get("status") == "ok"}
    if any("compute_precision" in b or "kv_cache_precision" in b for b in ran.values()):
        out += ["## Backends: what each computes in, as its runtime reports it once loaded", "",
                "| backend | computes in | KV cache kept in | version |", "|---|---|---|---|"]  # fmt: skip
        for name, b in ran.items():
            version = b.get("version") or b.get("versions") or "-"
            out.append(f"| {name} | {b.get('compute_precision') or '-'} | {b.get('kv_cache_precision') or '-'} | {version} |")
        out.append("")
    return out


def _md_scenarios(doc: dict) -> list[str]:
    """One table per scenario: the timings against the floors."""
    out: list[str] = []
    titles = {"prefill": "Prefill (whole prompt, logits for every token)",
              "decode": "One decode step with the KV cache", "generate": "Greedy generation end to end"}
    for scen, title in titles.items():
        rows = [r for r in doc["rows"] if r["scenario"] == scen]
        if not rows:
            continue
        out += [f"## {title}", "",
                "| backend | shape | median ms | min ms | p90 ms | p99 ms | CV | floor ms | bound | x floor | GFLOP/s | GB/s | tokens/s |",
                "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]  # fmt: skip
        for r in rows:
            out.append(
                f"| {r['backend']} | {_shape(r)} | {_fmt(r['median_ms'])} | {_fmt(r.get('min_ms'))} | "
                f"{_fmt(r.get('p90_ms'))} | {_fmt(r.get('p99_ms'))} | {_fmt(r.get('cv'), 2)} | {_fmt(r.get('floor_ms'))} | "
                f"{r.get('bound') or '-'} | {_fmt(r.get('x_floor'))} | {_fmt(r.get('gflops'))} | {_fmt(r.get('gbps'))} | "
                f"{_fmt(r.get('tokens_per_s'))} |"
            )
        out.append("")
    return out


def _md_peers(doc: dict) -> list[str]:
    """Each peer's time over ours at the same precision, and the peers not run."""
    out: list[str] = []
    pe = doc.get("peers") or peers(doc)
    if pe["ratios"] or pe["skipped"]:
        out += ["## Peers: time / ours at the same precision, paired by round; > 1 means ours is faster", ""]
        if pe["ratios"]:
            out += ["| scenario | shape | peer | precision | ours | peer ms | ours ms | peer / ours |",
                    "|---|---|---|---|---|---:|---:|---:|"]  # fmt: skip
            for q in pe["ratios"]:
                out.append(f"| {q['scenario']} | {_shape(q)} | {q['peer']} | {q.get('precision', 'fp32')} | "
                           f"{q.get('ours', pe['ours'])} | {_fmt(q['peer_ms'])} | {_fmt(q['ours_ms'])} | "
                           f"{_fmt(q['time_ratio'])} |")  # fmt: skip
            out.append("")
        for s in pe["skipped"]:
            out.append(f"- `{s['peer']}` not run ({s['scenario']}): {s['reason']}")
        out.append("")
    return out


def _md_inplace(doc: dict) -> list[str]:
    """What the in-place cache gains over the standard decoder."""
    out: list[str] = []
    gain = doc.get("inplace") or inplace_gain(doc)
    if gain:
        out += [f"## The in-place cache: `{CONCAT}` (standard decoder) time / `{OURS}` (in-place decoder), "
                "paired by round; > 1 means in-place is faster", "",
                "| scenario | shape | concat ms | in-place ms | concat / in-place |", "|---|---|---:|---:|---:|"]  # fmt: skip
        for q in gain:
            out.append(f"| {q['scenario']} | {_shape(q)} | {_fmt(q['concat_ms'])} | {_fmt(q['inplace_ms'])} | "
                       f"{_fmt(q['time_ratio'])} |")  # fmt: skip
        out.append("")
    return out


def _md_speedups(doc: dict) -> list[str]:
    out: list[str] = []
    if doc.get("ratios"):
        out += ["## Speedups (per-iteration median of t_baseline / t_backend; > 1 means faster)", "",
                "| scenario | shape | backend | vs | speedup |", "|---|---|---|---|---:|"]  # fmt: skip
        for q in doc["ratios"]:
            out.append(f"| {q['scenario']} | {_shape(q)} | {q['backend']} | {q['baseline']} | {_fmt(q['speedup'])} |")
        out.append("")
    return out


def _md_goals(doc: dict) -> list[str]:
    out: list[str] = []
    if doc.get("goals"):
        out += ["## Goals", "", "| goal | target | value | met | detail |", "|---|---|---:|---|---|"]
        for g in doc["goals"]:
            met = {True: "yes", False: "NO", None: "not measured"}[g.get("met")]
            out.append(f"| {g['name']} | {g['target']} | {_fmt(g.get('value'))} | {met} | {g.get('detail', '')} |")
        out.append("")
    return out


# ---------------------------------------------------------------- plots


def write_plots(doc: dict, out_dir: str | Path) -> list[Path]:
    """PNG plots: prefill latency vs sequence length (one panel per batch, floor dashed) and tokens/s vs
    batch (decode steps per past length; generation). Returns the files written."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    name = doc["config"].get("name", "model")
    threads = doc["settings"].get("threads")

    pre = [r for r in doc["rows"] if r["scenario"] == "prefill"]
    batches = [b for b in sorted({r["batch"] for r in pre}) if len({r["seq"] for r in pre if r["batch"] == b}) > 1]
    if batches:  # a panel per batch with at least two lengths (a curve over length is the point)
        fig, axes = plt.subplots(1, len(batches), figsize=(max(4.5 * len(batches), 9), 4.5), squeeze=False)
        for ax, b in zip(axes[0], batches):
            rows = [r for r in pre if r["batch"] == b]
            for backend in dict.fromkeys(r["backend"] for r in rows):
                pts = sorted((r["seq"], r["median_ms"], r["p90_ms"]) for r in rows if r["backend"] == backend)
                xs = [p[0] for p in pts]
                ax.plot(xs, [p[1] for p in pts], marker="o", label=f"{backend} (median)")
                ax.fill_between(xs, [p[1] for p in pts], [p[2] for p in pts], alpha=0.15)
            floor = sorted({(r["seq"], r["floor_ms"]) for r in rows if r.get("floor_ms")})
            if floor:
                ax.plot([f[0] for f in floor], [f[1] for f in floor], "k--", label="floor (measured limits)")
            _log2_ticks(ax, {r["seq"] for r in rows})
            _log_y(ax)
            ax.set_xlabel("sequence length (tokens)")
            ax.set_ylabel("latency (ms)")
            ax.set_title(f"prefill, batch {b}")
            ax.grid(True, which="both", alpha=0.3)
        fig.suptitle(f"{name}: prefill latency ({threads} threads)")
        _legend_below(fig, axes[0])
        written.append(_save(fig, out_dir / "prefill_latency.png", plt))

    dec = [r for r in doc["rows"] if r["scenario"] == "decode" and r.get("tokens_per_s")]
    gen = [r for r in doc["rows"] if r["scenario"] == "generate" and r.get("tokens_per_s")]
    # a panel per past length (and one for generation) that has at least two batch sizes: a curve over
    # batch is the point; single-batch cases are in bench.md and the peers plot
    pasts = [p for p in sorted({r["past"] for r in dec}) if len({r["batch"] for r in dec if r["past"] == p}) > 1]
    panels = [("decode", p) for p in pasts] + ([("generate", None)] if len({r["batch"] for r in gen}) > 1 else [])
    if panels:
        backends = list(dict.fromkeys(r["backend"] for r in dec + gen if not r["backend"].startswith("mem-read")))
        palette = plt.get_cmap("tab10" if len(backends) <= 10 else "tab20")  # a peers run has 13: no colour twice
        color = {b: palette(i % palette.N) for i, b in enumerate(backends)}
        fig, axes = plt.subplots(1, len(panels), figsize=(max(4.2 * len(panels), 9), 4.5), squeeze=False, sharey=True)
        for ax, (scen, past) in zip(axes[0], panels):
            rows = [r for r in (dec if scen == "decode" else gen) if past is None or r["past"] == past]
            for backend in dict.fromkeys(r["backend"] for r in rows if r["backend"] in color or r["backend"] == "mem-read"):
                curve = sorted((r["batch"], r["tokens_per_s"]) for r in rows if r["backend"] == backend)
                style = dict(color="0.5", linestyle=":", marker=".", label="reading the bytes once (same rounds)") \
                    if backend == "mem-read" else dict(color=color[backend], marker="o", label=backend)
                ax.plot([q[0] for q in curve], [q[1] for q in curve], **style)
            # fp32's floor: a quantized row has its own (fewer bytes), which would make one line zigzag
            ceil = sorted({(r["batch"], 1000.0 * r["batch"] / r["floor_ms"]) for r in rows
                           if r.get("floor_ms") and r.get("precision", "fp32") == "fp32"})
            if scen == "decode" and ceil:
                ax.plot([c[0] for c in ceil], [c[1] for c in ceil], "k--", linewidth=1, label="fp32 ceiling: batch / floor")
            _log2_ticks(ax, {r["batch"] for r in rows})
            _log_y(ax)
            ax.set_xlabel("batch")
            ax.set_title(f"one decode step, past {past}" if scen == "decode" else "greedy generation")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].set_ylabel("tokens/s")
        what = ("decode and generation" if pasts and gen and panels[-1][0] == "generate" else "decode" if pasts
                else "generation")
        fig.suptitle(f"{name}: {what} throughput by batch size ({threads} threads)")
        _legend_below(fig, axes[0])
        written.append(_save(fig, out_dir / "tokens_per_s.png", plt))
    pr = (doc.get("peers") or peers(doc))["ratios"]
    if pr:
        written.append(_peer_plot(pr, name, threads, out_dir / "peers.png", plt))
    return written


def _peer_plot(ratios: list[dict], name: str, threads, path: Path, plt) -> Path:
    """Bars: each peer's time / ours per case, one panel per scenario; the line at 1 is parity."""
    scens = list(dict.fromkeys(q["scenario"] for q in ratios))
    names = list(dict.fromkeys(q["peer"] for q in ratios))
    fig, axes = plt.subplots(1, len(scens), figsize=(4.5 * len(scens), 4), squeeze=False, sharey=True)
    for ax, scen in zip(axes[0], scens):
        rows = [q for q in ratios if q["scenario"] == scen]
        shapes = list(dict.fromkeys(_shape(q) for q in rows))
        width = 0.8 / len(names)
        for j, peer in enumerate(names):
            vals = {_shape(q): q["time_ratio"] for q in rows if q["peer"] == peer}
            xs = [i + j * width for i, s in enumerate(shapes) if s in vals]
            if not xs:  # this peer has no call for this scenario (listed as skipped in the report)
                continue
            ax.bar(xs, [vals[s] for s in shapes if s in vals], width, label=peer, color=f"C{j + 2}")
        ax.axhline(1.0, color="k", linewidth=1, linestyle="--")
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(shapes))], shapes, rotation=30, fontsize=7)
        ax.set_title(scen)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("peer time / ours at its precision (> 1: ours faster)")
    fig.suptitle(f"{name}: the peers on the same weights, same rounds ({threads} threads)")
    fig.tight_layout()
    return _save(fig, path, plt)


def _log2_ticks(ax, values) -> None:
    """A log2 axis labelled with the measured values themselves (8, 32, not 2^3, 2^5)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(values), [str(v) for v in sorted(values)])
    ax.minorticks_off()


def _log_y(ax) -> None:
    """A log y axis labelled 20, 50, 100 (not 2 x 10^1)."""
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))  # 20, 50


def _legend_below(fig, axes) -> None:
    """One legend for all panels, below them, where it covers no curve."""
    entries: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    ncol = max(1, min(len(entries), int(fig.get_figwidth() // 2.2)))  # about 2.2 inches an entry
    rows = -(-len(entries) // ncol)
    fig.legend(list(entries.values()), list(entries), loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, min(0.05 * rows + 0.03, 0.4), 1, 1))


def _save(fig, path: Path, plt) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    from ..folder.atomic import write_bytes_atomic

    return write_bytes_atomic(path, buf.getvalue())


# ---------------------------------------------------------------- all outputs


def write_outputs(doc: dict, out_dir: str | Path, plots: bool = True) -> dict[str, Path]:
    """bench.json, bench.csv, bench.md and the PNG plots into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "json": write_json(doc, out_dir / "bench.json"),
        "csv": write_text_atomic(out_dir / "bench.csv", to_csv(doc)),
        "markdown": write_text_atomic(out_dir / "bench.md", to_markdown(doc)),
    }
    if plots:
        try:
            importlib.import_module("matplotlib")  # plots are optional: say so and write the rest
        except ImportError:
            from ..progress import warn

            warn("matplotlib is not installed: no PNG plots (pip install matplotlib); JSON, CSV and Markdown written")
            return files
        for p in write_plots(doc, out_dir):
            files[p.stem] = p
    return files


# ---------------------------------------------------------------- compare


def compare(a: str | Path | dict, b: str | Path | dict) -> list[dict]:
    """Rows present in both runs, matched by ROW_KEY: {key..., "a_ms", "b_ms", "ratio"} with
    ratio = b_median / a_median (< 1: b is faster). Rows in only one run are left out."""
    da = a if isinstance(a, dict) else load_json(a)
    db = b if isinstance(b, dict) else load_json(b)
    validate(da, "first result")
    validate(db, "second result")
    index = {tuple(r[k] for k in ROW_KEY): r for r in db["rows"]}
    out = []
    for ra in da["rows"]:
        key = tuple(ra[k] for k in ROW_KEY)
        rb = index.get(key)
        if rb is None:
            continue
        row = dict(zip(ROW_KEY, key))
        row.update(a_ms=ra["median_ms"], b_ms=rb["median_ms"],
                   ratio=rb["median_ms"] / ra["median_ms"] if ra["median_ms"] else None)  # fmt: skip
        row.update(a_x_floor=ra.get("x_floor"), b_x_floor=rb.get("x_floor"))
        out.append(row)
    return out


def compare_markdown(rows: list[dict], a_name: str = "A", b_name: str = "B") -> str:
    lines = [f"| scenario | backend | shape | {a_name} ms | {b_name} ms | {b_name}/{a_name} |",
             "|---|---|---|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['backend']} | {_shape(r)} | {_fmt(r['a_ms'])} | {_fmt(r['b_ms'])} | "
                     f"{_fmt(r['ratio'])} |")  # fmt: skip
    if not rows:
        lines.append("| (no matching rows) | | | | | |")
    return "\n".join(lines) + "\n"
