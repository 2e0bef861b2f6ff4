#!/usr/bin/env python
"""The slot decoder (standard TensorScatter + Attention over a static cache, the graph TensorRT's in-flight
batching takes) against the in-place decoder (ONNX Runtime's GroupQueryAttention) on ONNX Runtime's CPU
provider: the same weights, the same slot cache code (runtime/ort.py's OrtSlotCache, which the batcher
steps), paired rounds, in one run on one machine. Does one graph serve both runtimes, or must the CPU keep
its own?

    python benchmarks/slot_decoder.py                       # ANDREA-120M, seeded random weights, 2 threads
    python benchmarks/slot_decoder.py --out benchmarks/results/cpu-2core-slots.md

Each case is one OrtSlotCache.run: `rows` slots decoding one token each after `past` tokens, or those rows
and one prompt's chunk of `chunk` tokens beside them (the two-group graph, two_groups.py). The floor beside
each figure is the bytes the step must read (weights once, each row's cache: the filled part for
GroupQueryAttention, all n_positions for the slot graph, whose attention reads it under a mask) at the
bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = [(1, 128, 0), (1, 512, 0), (8, 128, 0), (8, 512, 0), (16, 256, 0), (8, 256, 64)]  # rows, past, chunk


def graphs(cache: Path, config: str, seed: int) -> dict[str, Path]:
    from andrea_export.config import load_config
    from andrea_export.graphs.inplace_decoder import export_inplace_decoder
    from andrea_export.graphs.slot_decoder import export_slot_decoder
    from andrea_export.model.checkpoint import random_init

    paths = {"inplace": cache / "decoder.inplace.onnx", "slots": cache / "decoder.slots.onnx"}
    if not all(p.exists() for p in paths.values()):
        cache.mkdir(parents=True, exist_ok=True)
        model = random_init(load_config(config), seed=seed, announce=False)
        export_inplace_decoder(model, paths["inplace"], quiet=True)
        export_slot_decoder(model, paths["slots"], quiet=True)
    return paths


def step(cache, rows: int, past: int, chunk: int, rng):
    """The run of one case, its inputs made once: rows decoding after `past`, and a chunk at slot `rows`."""
    vocab = cache.layout.vocab_size
    group = (0, rng.integers(0, vocab, (rows, 1)), np.full(rows, past + 1, dtype=np.int64))
    if not chunk:
        return lambda: cache.run(group)
    joining = (rows, rng.integers(0, vocab, (1, chunk)), np.asarray([chunk], dtype=np.int64))
    return lambda: cache.run(group, joining)


def floor_bytes(cfg, rows: int, past: int, chunk: int, static: bool) -> int:
    """The bytes a step must move at least once (bench/work.py's forward_bytes: weights once, the cache
    attention reads, the new rows written, the logits), with attention reading each row's whole static cache
    on the slot graph; a chunk adds its own cache read and write and its logits (the weights are shared)."""
    from andrea_export.bench.work import forward_bytes

    n = cfg.n_positions
    nbytes = forward_bytes(cfg, rows, 1, n - 1 if static else past)
    if chunk:
        row = 2 * cfg.n_layer * cfg.n_embd * 4  # one position's keys and values, every layer
        nbytes += row * ((n if static else chunk) + chunk) + chunk * cfg.vocab_size * 4
    return nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="andrea-120m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cases", default=",".join(f"{r}:{p}:{c}" for r, p, c in CASES),
                    help="rows:past:chunk,... (chunk 0: a decode step alone)")
    ap.add_argument("--rounds", type=int, default=15, help="paired rounds per case (median reported)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="where the two graphs are kept between runs")
    ap.add_argument("--out", type=Path, default=None, help="write the Markdown table here (and .json beside it)")
    args = ap.parse_args()

    from andrea_export import runtime
    from andrea_export.bench.machine import environment, loadavg, measure_machine
    from andrea_export.config import load_config
    from andrea_export.folder.atomic import cache_dir

    cfg = load_config(args.config)
    cache = args.cache_dir or cache_dir("bench") / f"slots-{args.config}-seed{args.seed}"
    paths = graphs(cache, args.config, args.seed)
    load_start = loadavg()
    machine = measure_machine(args.threads, quick=True)
    cases = [tuple(int(x) for x in case.split(":")) for case in args.cases.split(",")]
    slots = max(rows + (1 if chunk else 0) for rows, _, chunk in cases)
    caches = {name: runtime.load(p, "onnxruntime", providers=["CPUExecutionProvider"],
                                 intra_op_threads=args.threads).slot_cache(slots) for name, p in paths.items()}
    rng = np.random.default_rng(0)
    rows_out = []
    for rows, past, chunk in cases:
        if past + 1 > cfg.n_positions or chunk > cfg.n_positions:
            print(f"rows {rows} past {past} chunk {chunk}: beyond {cfg.name}'s context, left out")
            continue
        runs = {name: step(c, rows, past, chunk, rng) for name, c in caches.items()}
        for run in runs.values():
            run(), run()  # warm-up
        times: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(args.rounds):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):  # alternate who goes first
                t0 = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - t0)
        row = {"rows": rows, "past": past, "chunk": chunk}
        for name in runs:
            ms = statistics.median(times[name]) * 1e3
            nbytes = floor_bytes(cfg, rows, past, chunk, static=name == "slots")
            floor_ms = nbytes / (machine["bandwidth_GBps"] * 1e9) * 1e3
            row[name] = {"median_ms": ms, "bytes": nbytes, "floor_ms": floor_ms}
        row["slots_over_inplace"] = row["slots"]["median_ms"] / row["inplace"]["median_ms"]
        rows_out.append(row)
        print(f"rows {rows:3d} past {past:4d} chunk {chunk:3d}: in-place {row['inplace']['median_ms']:7.2f} ms "
              f"(floor {row['inplace']['floor_ms']:.2f}), slots {row['slots']['median_ms']:7.2f} ms "
              f"(floor {row['slots']['floor_ms']:.2f}): slots / in-place {row['slots_over_inplace']:.2f}", flush=True)

    env = environment()
    head = (f"ANDREA `{args.config}` fp32, seeded random weights, ONNX Runtime CPU, {args.threads} threads; "
            f"{env.get('cpu', {}).get('model', 'CPU')}; memory {machine['bandwidth_GBps']:.1f} GB/s, matmul "
            f"{machine['matmul_GFLOPs']:.0f} GFLOP/s ({machine['method']}); load {load_start} -> {loadavg()}; "
            f"{args.rounds} paired rounds per case, median")
    table = [head, "", "| rows | past | chunk | in-place ms (floor) | slots ms (floor) | slots / in-place |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows_out:
        table.append(f"| {r['rows']} | {r['past']} | {r['chunk'] or '-'} | {r['inplace']['median_ms']:.2f} "
                     f"({r['inplace']['floor_ms']:.2f}) | {r['slots']['median_ms']:.2f} ({r['slots']['floor_ms']:.2f}) "
                     f"| {r['slots_over_inplace']:.2f} |")
    print("\n".join(table))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(table) + "\n")
        args.out.with_suffix(".json").write_text(json.dumps({"machine": machine, "environment": env,
                                                             "cases": rows_out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
