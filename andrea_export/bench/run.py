"""One benchmark run: the cases, every backend's calls in interleaved rounds, the rows with their
floors, the ratios of every pair, the goals, and the outputs (`run_benchmark`); plus the parsers the
command lines share."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from ..config import ModelConfig, load_config
from ..errors import AndreaExportError
from ..model.andrea import Andrea
from ..names import WEIGHT_ONLY
from ..progress import console, styled
from .backends import DEFAULT_BACKENDS, Backend, Context, Unavailable, default_cache_dir, make_backends
from .goals import goals, print_summary
from .harness import Settings, Stats, cuda_event_timer, ratio_median, run_interleaved
from .machine import combine_limits, environment, load_warnings, loadavg, measure_machine
from .report import KIND, OURS, SCHEMA_VERSION, inplace_gain, peers, write_outputs
from .work import (
    DECODE_GRID,
    DISTURBED_BELOW,
    GENERATE_GRID,
    PREFILL_GRID,
    QUICK_DECODE_GRID,
    QUICK_GENERATE_GRID,
    QUICK_PREFILL_GRID,
    SCENARIOS,
    case_inputs,
    floor_seconds,
    grid_cases,
    scenario_work,
)


def run_benchmark(
    config: str | Path | ModelConfig | None = None,
    checkpoint: str | Path | None = None,
    *,
    model: Andrea | None = None,
    backends: Iterable[str] = DEFAULT_BACKENDS,
    scenarios: Iterable[str] = SCENARIOS,
    quick: bool = False,
    threads: int | None = None,
    settings: Settings | None = None,
    prefill_grid: list[tuple[int, int]] | None = None,
    decode_grid: list[tuple[int, int]] | None = None,
    generate_grid: list[tuple[int, int, int]] | None = None,
    out: str | Path | None = None,
    workdir: str | Path | None = None,
    trt_engines: dict[str, dict] | None = None,
    ort_spin: bool = True,
    seed: int = 0,
    plots: bool = True,
    quiet: bool = False,
) -> dict:
    """Run the benchmark and return the result document (schema: `report`).

    Args:
        config, checkpoint, seed: the model (as `checkpoint.load_model`); or pass `model` directly.
        backends: names from BACKENDS; those that cannot run here are kept in the report as skipped, with why.
        scenarios: any of "prefill", "decode", "generate".
        quick: small grids and few repeats (about a minute for ANDREA-120M on 2 cores).
        threads: threads for every backend and for the limit measurements (default: usable CPUs).
        settings: warm-up / repeats / time budget per case (default: Settings() or Settings.quick()).
        *_grid: override the grids: prefill [(batch, seq)], decode [(batch, past)], generate [(batch, prompt, new)].
        out: folder for bench.json, bench.csv, bench.md and the plots. None: write nothing.
        workdir: where exported ONNX files are cached (default: default_cache_dir() when `out` is given,
            else a temporary folder removed at the end).
        trt_engines: {"trt-native": {"prefill": plan, "decode": plan}, "trt-plugin": {...}} on a GPU host.
        ort_spin: let ORT's threads spin-wait (ORT's own default, what runtime.load gives a user and what
            onnxruntime-genai always does). A run with any spinning backend waits settings.spin_gap_s
            before each call instead of gap_s, so that the spin of one call does not slow the next.
    """
    import tempfile

    scenarios = tuple(scenarios)
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        raise AndreaExportError(f"unknown scenario(s) {', '.join(bad)}; known: {', '.join(SCENARIOS)}")
    settings = settings or (Settings.quick() if quick else Settings())
    if threads is None:
        try:
            threads = len(os.sched_getaffinity(0))
        except AttributeError:
            threads = os.cpu_count() or 1
    env = environment()
    if model is None:
        from ..model.checkpoint import load_model

        cfg = load_config(config) if config is not None else None
        model = load_model(checkpoint, cfg, seed=seed)
    cfg = model.cfg
    tmp = None
    if workdir is None:
        if out is not None:  # not inside `out`: result folders get committed, 2 x 369 MB of ONNX must not
            workdir = default_cache_dir()
        else:
            tmp = tempfile.TemporaryDirectory(prefix="andrea-bench-")
            workdir = tmp.name
    ctx = Context(model, threads, Path(workdir), quiet=quiet)
    torch.set_num_threads(threads)

    prefill_grid = prefill_grid or (QUICK_PREFILL_GRID if quick else PREFILL_GRID)
    decode_grid = decode_grid or (QUICK_DECODE_GRID if quick else DECODE_GRID)
    generate_grid = generate_grid or (QUICK_GENERATE_GRID if quick else GENERATE_GRID)
    cases = grid_cases(cfg, scenarios, prefill_grid, decode_grid, generate_grid)

    say = (lambda *a: None) if quiet else console.print
    notes = load_warnings(env.get("loadavg_start"), threads, at_start=True)
    for n in notes:
        say(" ", styled("WARNING:", "bold yellow"), n)
    say(styled("benchmark", "bold"), f"{cfg.name} ({cfg.n_params:,} parameters), {threads} threads, "
        f"{len(cases)} cases, {'quick' if quick else 'full'} mode")  # fmt: skip
    machine = {"cpu": measure_machine(threads, quick=quick)}
    say(f"  measured limits: memory {machine['cpu']['bandwidth_GBps']:.1f} GB/s, "
        f"fp32 matmul {machine['cpu']['matmul_GFLOPs']:.0f} GFLOP/s")  # fmt: skip

    active: list[Backend] = []
    info: dict[str, dict] = {}
    for b in make_backends(backends, trt_engines, ort_spin):
        reason = b.check()
        if reason:
            info[b.name] = {"status": "skipped", "reason": reason}
            say(" ", styled("skip", "yellow"), f"{b.name}: {reason}")
            continue
        try:
            info[b.name] = {"status": "ok", "reason": None, "device": b.device, **b.setup(ctx)}
            b.prepare(scenarios)
            if getattr(b, "compute_precision", None):  # what the runtime says it computes in, known once loaded
                info[b.name]["compute_precision"] = b.compute_precision
            if hasattr(b, "kv_cache_precision"):  # OpenVINO's fused attention keeps its cache at its own precision
                info[b.name]["kv_cache_precision"] = b.kv_cache_precision
            active.append(b)
        except (AndreaExportError, ImportError, RuntimeError) as e:
            info[b.name] = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
            say(" ", styled("failed", "red"), f"{b.name}: {e}")
    if any(b.spins for b in active):  # their threads spin on after a call: wait that out before the next one
        settings = dataclasses.replace(settings, gap_s=max(settings.gap_s, settings.spin_gap_s))
    if any(b.device == "cuda" for b in active) and torch.cuda.is_available():
        machine["cuda"] = measure_machine(threads, quick=quick, device="cuda")

    devices = {b.name: b.device for b in active}
    precisions = {b.name: getattr(b, "precision", "fp32") for b in active}
    measured, ratios, failed = [], [], []
    progress = _progress(quiet)
    with progress:
        overall = progress.add_task("cases", total=len(cases))
        for scenario, batch, seq, past, new_tokens in cases:
            label = {"prefill": f"prefill B={batch} T={seq}", "decode": f"decode B={batch} P={past}",
                     "generate": f"generate B={batch} prompt={seq} new={new_tokens}"}[scenario]  # fmt: skip
            inputs = case_inputs(cfg, scenario, batch, seq, past, seed)
            fns, timers = {}, {}
            for b in active:
                try:
                    if scenario == "prefill":
                        fns[b.name] = b.prefill(*inputs)
                    elif scenario == "decode":
                        fns[b.name] = b.decode(*inputs)
                    else:
                        fns[b.name] = b.generate(inputs[0], new_tokens)
                    timers[b.name] = b.timer_for(scenario)
                except Unavailable as e:
                    info[b.name].setdefault("skipped_cases", {})[scenario] = str(e)
            if not fns:
                progress.advance(overall)
                continue
            task = progress.add_task(f"  {label} ({', '.join(fns)})", total=None)

            def on_round(done, total, task=task):
                progress.update(task, completed=done, total=total)

            try:
                samples = run_interleaved(fns, settings, timers, on_round)
            except (RuntimeError, MemoryError) as e:  # e.g. out of memory at a large shape: keep the other cases
                failed.append({"case": label, "backends": list(fns), "error": f"{type(e).__name__}: {e}"[:500]})
                say(" ", styled("failed", "red"), f"{label}: {type(e).__name__}: {e}")
                progress.remove_task(task)
                progress.advance(overall)
                continue
            progress.remove_task(task)
            for name, s in samples.items():
                x_ours = ratio_median(s, samples[OURS]) if OURS in samples else None  # t / t_ours, paired by round
                flops, nbytes = scenario_work(cfg, scenario, batch, seq, past, new_tokens, precisions[name])
                measured.append((scenario, name, batch, seq, past, new_tokens, Stats.from_ns(s), flops, nbytes,
                                 devices[name], "cuda-events" if timers[name] is cuda_event_timer else "perf_counter_ns",
                                 x_ours, precisions[name]))  # fmt: skip
            names = list(samples)
            for i, base in enumerate(names):  # every pair, the earlier backend as baseline
                for other in names[i + 1:]:
                    ratios.append({"scenario": scenario, "batch": batch, "seq": seq, "past": past,
                                   "new_tokens": new_tokens, "baseline": base, "backend": other,
                                   "speedup": ratio_median(samples[base], samples[other])})  # fmt: skip
            del fns, inputs
            progress.advance(overall)

    # the limits again at the end (the machine may have been busy at the start); each figure's best counts
    say("  measuring the limits again")
    machine["cpu"] = combine_limits(machine["cpu"], measure_machine(threads, quick=quick))
    if "cuda" in machine:
        machine["cuda"] = combine_limits(machine["cuda"], measure_machine(threads, quick=quick, device="cuda"))
    rows = [_row(*m[:9], machine.get(m[9], machine["cpu"]), *m[10:]) for m in measured]  # GPU rows: GPU limits
    doc = {
        "schema_version": SCHEMA_VERSION,
        "kind": KIND,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "config": cfg.to_dict(),
        "n_params": cfg.n_params,
        "weights": {"source": str(checkpoint) if checkpoint else f"random init (seed {seed})",
                    "fingerprint": ctx.fingerprint},
        "settings": {"threads": threads, "quick": quick, **dataclasses.asdict(settings),
                     "scenarios": list(scenarios), "seed": seed, "ort_spin": ort_spin,
                     "timer": "time.perf_counter_ns around a synchronous call (CUDA events for TensorRT)",
                     "percentiles": "linear interpolation (numpy default); cv = sample std / mean"},
        "environment": env,
        "machine": {**machine["cpu"], **({"cuda": machine["cuda"]} if "cuda" in machine else {})},
        "backends": info,
        "rows": rows,
        "ratios": ratios,
        "failed_cases": failed,
        "loadavg_end": loadavg(),
    }
    notes += load_warnings(doc["loadavg_end"], threads, at_start=False)
    below = [f"{r['scenario']} {r['backend']} B={r['batch']} T={r['seq']} P={r['past']} ({r['x_floor']:.2f})"
             for r in rows if r["x_floor"] is not None and r["x_floor"] < DISTURBED_BELOW]  # fmt: skip
    if below:
        notes.append(f"faster than the floor (x floor < {DISTURBED_BELOW}): " + ", ".join(below) + ". The limit measurements "
                     "were disturbed, or a large square matmul understates this machine's rate for these shapes")  # fmt: skip
    doc["warnings"] = notes
    doc["peers"] = peers(doc)
    doc["inplace"] = inplace_gain(doc)
    doc["goals"] = goals(doc)
    if tmp is not None:
        tmp.cleanup()
    if out is not None:
        files = write_outputs(doc, out, plots=plots)
        say("  wrote " + ", ".join(str(p) for p in files.values()))
    if not quiet:
        print_summary(doc)
    return doc


def _row(scenario, backend, batch, seq, past, new_tokens, st: Stats, flops, nbytes, machine, timer,
         x_ours: float | None = None, precision: str = "fp32") -> dict:  # fmt: skip
    """One result row. fp32's floor: max(bytes of fp32 weights / bandwidth, FLOPs / fp32 matmul rate). A
    weight-only quantized row's decode and generate floor is its memory floor (its own bytes: int8 / int4
    weights, scales, the float32 rest; work.forward_bytes), a lower bound, since its int8 products run at a
    rate this run does not measure; its prefill, and bf16 rows (OpenVINO's default), have no floor (null
    bytes, floor_ms, bound, x_floor, gbps): their speed is reported against ours instead."""
    med_s = st.median_ms / 1e3
    floored = precision == "fp32" or (precision in WEIGHT_ONLY and scenario != "prefill")
    if precision in WEIGHT_ONLY:
        floor_s, bound = nbytes / (machine["bandwidth_GBps"] * 1e9), "memory"
    else:
        floor_s, bound = floor_seconds(flops, nbytes, machine)
    tokens = batch * (seq if scenario == "prefill" else new_tokens)
    return {
        "scenario": scenario, "backend": backend, "batch": batch, "seq": seq, "past": past, "new_tokens": new_tokens,
        "tokens": tokens, **{k: v for k, v in dataclasses.asdict(st).items()},
        "precision": precision, "flops": flops, "bytes": nbytes if floored else None,
        "floor_ms": floor_s * 1e3 if floored else None, "bound": bound if floored else None,
        "x_floor": med_s / floor_s if (floor_s and floored) else None,
        "gflops": flops / med_s / 1e9 if med_s else None, "gbps": nbytes / med_s / 1e9 if (med_s and floored) else None,
        "tokens_per_s": tokens / med_s if med_s else None, "x_ours": x_ours, "timer": timer,
    }  # fmt: skip


def _progress(quiet: bool):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, disable=quiet, transient=False)  # fmt: skip


def parse_names(text: str | Iterable[str], known: tuple[str, ...], what: str) -> list[str]:
    """'a,b' (or a list) -> ['a', 'b'], every name checked against `known` (AndreaExportError otherwise)."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise AndreaExportError(f"unknown {what}(s) {', '.join(bad) or '(none given)'}; known: {', '.join(known)}")
    return names


def parse_engine_specs(specs: Iterable[str]) -> dict[str, dict[str, Path]]:
    """['native:prefill=a.plan', 'plugin:decode=b.plan'] -> {'trt-native': {'prefill': a.plan}, 'trt-plugin': {...}}."""
    out: dict[str, dict[str, Path]] = {}
    for spec in specs:
        head, sep, path = spec.partition("=")
        variant, _, role = head.partition(":")
        if not sep or variant not in ("native", "plugin") or role not in ("prefill", "decode") or not path:
            raise AndreaExportError(f"engine '{spec}': expected VARIANT:ROLE=PLAN with VARIANT native|plugin, "
                                    f"ROLE prefill|decode, e.g. native:prefill=build/model.plan")  # fmt: skip
        out.setdefault(f"trt-{variant}", {})[role] = Path(path)
    return out

