#!/usr/bin/env python
"""Latency of ANDREA-120M: PyTorch eager vs ONNX Runtime vs TensorRT (native GELU, plugin GELU), beside the
peers (Optimum, onnxruntime-genai), on the harness in andrea_export/bench/. See benchmarks/README.md for
the method and what each number means.

    python benchmarks/latency.py                              # full grid, all backends this host has
    python benchmarks/latency.py --quick                      # about a minute on 2 cores
    python benchmarks/latency.py --scenarios decode --backends torch ort-cpu
    python benchmarks/latency.py --compare runs/a/bench.json runs/b/bench.json

On a GPU host, pass the engines the build stage made:
    python benchmarks/latency.py --trt-native-engine build/native/model.plan \\
        --trt-plugin-engine build/plugin/model.plan [--trt-*-decoder-engine ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _grid(text: str | None, n: int):
    """'1x128,4x512' -> [(1, 128), (4, 512)]; n numbers per item."""
    if not text:
        return None
    try:
        items = [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': expected items like {'x'.join(['N'] * n)}, comma-separated") from None
    if any(len(i) != n for i in items):
        raise argparse.ArgumentTypeError(f"'{text}': every item needs {n} numbers joined by 'x'")
    return items


def main(argv=None) -> int:
    from andrea_export import bench
    from andrea_export.bench import report as bench_report

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="preset name or JSON file (default: from the checkpoint, else andrea-120m)")
    p.add_argument("--checkpoint", default=None, help=".safetensors / .pt weights (default: seeded random init, announced)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small grids, few repeats (about a minute on 2 cores)")
    p.add_argument("--backends", nargs="+", default=list(bench.DEFAULT_BACKENDS), choices=bench.BACKENDS)
    p.add_argument("--scenarios", nargs="+", default=list(bench.SCENARIOS), choices=bench.SCENARIOS)
    p.add_argument("--threads", type=int, default=None, help="threads for every backend (default: usable CPUs)")
    p.add_argument("--prefill-grid", default=None, metavar="BxT,...", help="e.g. 1x128,4x512")
    p.add_argument("--decode-grid", default=None, metavar="BxP,...", help="batch x past length, e.g. 1x127,8x512")
    p.add_argument("--generate-grid", default=None, metavar="BxTxN,...", help="batch x prompt x new tokens")
    p.add_argument("--budget", type=float, default=None, help="timed seconds aimed at per case (all backends)")
    p.add_argument("--min-repeats", type=int, default=None)
    p.add_argument("--max-repeats", type=int, default=None)
    p.add_argument("--blocked", action="store_true", help="run each backend's rounds as one block instead of "
                   "interleaving them (to see whether the backends disturb each other)")
    p.add_argument("--gap", type=float, default=None, help="untimed busy pause before each call, seconds (default 0.005; "
                   "at least 0.05 when a backend spin-waits)")
    p.add_argument("--no-spin", action="store_true", help="ORT backends sleep between ops instead of spin-waiting "
                   "(ORT's default, and genai's always; on by default so the peers compare like with like)")
    for v in ("native", "plugin"):
        p.add_argument(f"--trt-{v}-engine", type=Path, default=None, help=f"TensorRT {v}-GELU engine (prefill profile)")
        p.add_argument(f"--trt-{v}-decoder-engine", type=Path, default=None, help=f"TensorRT {v}-GELU KV-cache engine")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for bench.json/.csv/.md and plots")
    p.add_argument("--cache-dir", type=Path, default=None, help="exported ONNX files, reused between runs "
                   "(default: $ANDREA_EXPORT_CACHE/bench or ~/.cache/andrea-export/bench)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A.json", "B.json"), help="only compare two results")
    a = p.parse_args(argv)

    if a.compare:
        rows = bench_report.compare(*a.compare)
        print(bench_report.compare_markdown(rows, a.compare[0].parent.name or "A", a.compare[1].parent.name or "B"))
        return 0

    base = bench.Settings.quick() if a.quick else bench.Settings()
    import dataclasses

    settings = dataclasses.replace(base, **{k: v for k, v in (("budget_s", a.budget), ("min_repeats", a.min_repeats),
                                                              ("max_repeats", a.max_repeats), ("gap_s", a.gap)) if v is not None})  # fmt: skip
    if a.blocked:
        settings = dataclasses.replace(settings, interleave=False)
    engines = {}
    for v in ("native", "plugin"):
        e = {role: path for role, path in (("prefill", getattr(a, f"trt_{v}_engine")),
                                           ("decode", getattr(a, f"trt_{v}_decoder_engine"))) if path}  # fmt: skip
        if e:
            engines[f"trt-{v}"] = e
    doc = bench.run_benchmark(
        a.config, a.checkpoint, backends=a.backends, scenarios=a.scenarios, quick=a.quick, threads=a.threads,
        settings=settings, prefill_grid=_grid(a.prefill_grid, 2), decode_grid=_grid(a.decode_grid, 2),
        generate_grid=_grid(a.generate_grid, 3), out=a.out, trt_engines=engines, ort_spin=not a.no_spin, seed=a.seed,
        plots=not a.no_plots, workdir=a.cache_dir,
    )  # fmt: skip
    print(bench_report.to_markdown(doc))
    return 0


if __name__ == "__main__":
    from andrea_export.errors import AndreaExportError

    try:
        sys.exit(main())
    except AndreaExportError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
