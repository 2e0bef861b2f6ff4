"""One benchmark run: the cases, every backend's calls in interleaved rounds, the rows with their
floors, the ratios of every pair, the goals, and the outputs (`run_benchmark`); plus the parsers the
command lines share."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import functools
import tempfile
from collections.abc import Callable, Iterable, Iterator
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
from .machine import combine_limits, environment, load_warnings, loadavg, measure_machine, usable_cpus
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
    scenarios = _known_scenarios(scenarios)
    settings = settings or (Settings.quick() if quick else Settings())
    threads = usable_cpus() if threads is None else threads
    env = environment()
    if model is None:
        model = _load_model(config, checkpoint, seed)
    cfg = model.cfg
    say = (lambda *a: None) if quiet else console.print
    cases = _cases(cfg, scenarios, quick, prefill_grid, decode_grid, generate_grid)
    notes = load_warnings(env.get("loadavg_start"), threads, at_start=True)
    machine = {"cpu": _announce(notes, cfg, threads, len(cases), quick, say)}
    with _workdir(workdir, out) as work:
        ctx = Context(model, threads, work, quiet=quiet)
        torch.set_num_threads(threads)
        active, info = _start_backends(make_backends(backends, trt_engines, ort_spin), ctx, scenarios, say)
        if any(b.spins for b in active):  # their threads spin on after a call: wait that out before the next one
            settings = dataclasses.replace(settings, gap_s=max(settings.gap_s, settings.spin_gap_s))
        if any(b.device == "cuda" for b in active) and torch.cuda.is_available():
            machine["cuda"] = measure_machine(threads, quick=quick, device="cuda")
        measured, ratios, failed = _measure_cases(cases, active, info, settings, cfg, seed, quiet, say)
    _measure_limits_again(machine, threads, quick, say)
    rows = [_row(m, machine.get(m.device, machine["cpu"])) for m in measured]  # GPU rows: GPU limits
    doc = {
        **_header(cfg, checkpoint, seed, ctx.fingerprint),
        "settings": {"threads": threads, "quick": quick, **dataclasses.asdict(settings),
                     "scenarios": list(scenarios), "seed": seed, "ort_spin": ort_spin, **_TIMING},
        "environment": env,
        "machine": {**machine["cpu"], **({"cuda": machine["cuda"]} if "cuda" in machine else {})},
        "backends": info,
        "rows": rows,
        "ratios": ratios,
        "failed_cases": failed,
        "loadavg_end": loadavg(),
    }
    _conclude(doc, notes, threads)
    if out is not None:
        files = write_outputs(doc, out, plots=plots)
        say("  wrote " + ", ".join(str(p) for p in files.values()))
    if not quiet:
        print_summary(doc)
    return doc


_TIMING = {"timer": "time.perf_counter_ns around a synchronous call (CUDA events for TensorRT)",
           "percentiles": "linear interpolation (numpy default); cv = sample std / mean"}


@dataclasses.dataclass(frozen=True)
class Case:
    """One timed call's shape: `seq` is the prompt length (1 for decode), `past` the cached tokens
    (decode only), `new_tokens` the tokens a generate call makes."""

    scenario: str
    batch: int
    seq: int
    past: int
    new_tokens: int

    @property
    def label(self) -> str:
        if self.scenario == "prefill":
            return f"prefill B={self.batch} T={self.seq}"
        if self.scenario == "decode":
            return f"decode B={self.batch} P={self.past}"
        return f"generate B={self.batch} prompt={self.seq} new={self.new_tokens}"


@dataclasses.dataclass(frozen=True)
class Measured:
    """One backend's samples of one case, with what its row needs beside the machine's limits."""

    case: Case
    backend: str
    stats: Stats
    flops: int
    nbytes: int
    device: str
    timer: str
    x_ours: float | None
    precision: str


def _known_scenarios(scenarios: Iterable[str]) -> tuple[str, ...]:
    scenarios = tuple(scenarios)
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        raise AndreaExportError(f"unknown scenario(s) {', '.join(bad)}; known: {', '.join(SCENARIOS)}")
    return scenarios


def _cases(cfg: ModelConfig, scenarios: tuple[str, ...], quick: bool, prefill_grid, decode_grid,
           generate_grid) -> list[Case]:  # fmt: skip
    """The grids (the given ones, else the quick or full defaults) as cases that fit the model's context."""
    grids = (prefill_grid or (QUICK_PREFILL_GRID if quick else PREFILL_GRID),
             decode_grid or (QUICK_DECODE_GRID if quick else DECODE_GRID),
             generate_grid or (QUICK_GENERATE_GRID if quick else GENERATE_GRID))  # fmt: skip
    return [Case(*c) for c in grid_cases(cfg, scenarios, *grids)]


def _announce(notes: list[str], cfg: ModelConfig, threads: int, n_cases: int, quick: bool,
              say: Callable[..., object]) -> dict:  # fmt: skip
    """Say what runs, and measure the CPU's limits (memory bandwidth, matmul rate) the floors come from."""
    for n in notes:
        say(" ", styled("WARNING:", "bold yellow"), n)
    say(styled("benchmark", "bold"), f"{cfg.name} ({cfg.n_params:,} parameters), {threads} threads, "
        f"{n_cases} cases, {'quick' if quick else 'full'} mode")  # fmt: skip
    limits = measure_machine(threads, quick=quick)
    say(f"  measured limits: memory {limits['bandwidth_GBps']:.1f} GB/s, "
        f"fp32 matmul {limits['matmul_GFLOPs']:.0f} GFLOP/s")  # fmt: skip
    return limits


def _conclude(doc: dict, notes: list[str], threads: int) -> None:
    """What the rows add up to: the warnings, the peer comparisons, the in-place gain and the goals."""
    doc["warnings"] = notes + load_warnings(doc["loadavg_end"], threads, at_start=False) + _below_floor(doc["rows"])
    doc["peers"] = peers(doc)
    doc["inplace"] = inplace_gain(doc)
    doc["goals"] = goals(doc)


def _header(cfg: ModelConfig, checkpoint: str | Path | None, seed: int, fingerprint: str) -> dict:
    """What the document is and what model it measured."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": KIND,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "config": cfg.to_dict(),
        "n_params": cfg.n_params,
        "weights": {"source": str(checkpoint) if checkpoint else f"random init (seed {seed})", "fingerprint": fingerprint},
    }


def _load_model(config: str | Path | ModelConfig | None, checkpoint: str | Path | None, seed: int) -> Andrea:
    from ..model.checkpoint import load_model

    return load_model(checkpoint, load_config(config) if config is not None else None, seed=seed)


@contextlib.contextmanager
def _workdir(workdir: str | Path | None, out: str | Path | None) -> Iterator[Path]:
    """Where the exported ONNX files go: `workdir`; else the shared cache when results are written
    (not inside `out`: result folders get committed, and 2 x 369 MB of ONNX must not be); else a
    temporary folder, removed after the run."""
    if workdir is not None:
        yield Path(workdir)
    elif out is not None:
        yield default_cache_dir()
    else:
        with tempfile.TemporaryDirectory(prefix="andrea-bench-") as tmp:
            yield Path(tmp)


def _start_backends(backends: Iterable[Backend], ctx: Context, scenarios: tuple[str, ...],
                    say: Callable[..., object]) -> tuple[list[Backend], dict[str, dict]]:  # fmt: skip
    """Set up every backend that can run here; the report keeps the others, with why they did not."""
    active: list[Backend] = []
    info: dict[str, dict] = {}
    for b in backends:
        reason = b.check()
        if reason:
            info[b.name] = {"status": "skipped", "reason": reason}
            say(" ", styled("skip", "yellow"), f"{b.name}: {reason}")
            continue
        try:
            info[b.name] = {"status": "ok", "reason": None, "device": b.device, **b.setup(ctx)}
            b.prepare(scenarios)
            if computes := getattr(b, "compute_precision", None):  # what the runtime says it computes in, once loaded
                info[b.name]["compute_precision"] = computes
            if hasattr(b, "kv_cache_precision"):  # OpenVINO's fused attention keeps its cache at its own precision
                info[b.name]["kv_cache_precision"] = b.kv_cache_precision
            active.append(b)
        except (AndreaExportError, ImportError, RuntimeError) as e:
            info[b.name] = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
            say(" ", styled("failed", "red"), f"{b.name}: {e}")
    return active, info


def _measure_cases(cases: list[Case], active: list[Backend], info: dict[str, dict], settings: Settings,
                   cfg: ModelConfig, seed: int, quiet: bool,
                   say: Callable[..., object]) -> tuple[list[Measured], list[dict], list[dict]]:  # fmt: skip
    """Every case in turn, its backends' calls in interleaved rounds: (measurements, ratios of every
    pair, failed cases). A case that fails (e.g. out of memory at a large shape) is recorded and the
    others go on."""
    measured: list[Measured] = []
    ratios: list[dict] = []
    failed: list[dict] = []
    progress = _progress(quiet)
    with progress:
        overall = progress.add_task("cases", total=len(cases))
        for case in cases:
            inputs = case_inputs(cfg, case.scenario, case.batch, case.seq, case.past, seed)
            fns, timers = _calls(case, inputs, active, info)
            if fns:
                task = progress.add_task(f"  {case.label} ({', '.join(fns)})", total=None)
                try:
                    samples = run_interleaved(fns, settings, timers, functools.partial(_on_round, progress, task))
                except (RuntimeError, MemoryError) as e:
                    failed.append({"case": case.label, "backends": list(fns), "error": f"{type(e).__name__}: {e}"[:500]})
                    say(" ", styled("failed", "red"), f"{case.label}: {type(e).__name__}: {e}")
                else:
                    measured += _measurements(case, samples, timers, active, cfg)
                    ratios += _pair_ratios(case, samples)
                finally:
                    progress.remove_task(task)
            del fns, inputs
            progress.advance(overall)
    return measured, ratios, failed


def _on_round(progress, task, done: int, total: int) -> None:
    progress.update(task, completed=done, total=total)


def _calls(case: Case, inputs: tuple, active: list[Backend],
           info: dict[str, dict]) -> tuple[dict[str, Callable[[], object]], dict[str, Callable]]:  # fmt: skip
    """Each backend's call of the case and the timer it is timed with; a backend that cannot run the
    case says why in its report entry."""
    fns, timers = {}, {}
    for b in active:
        try:
            if case.scenario == "prefill":
                fns[b.name] = b.prefill(*inputs)
            elif case.scenario == "decode":
                fns[b.name] = b.decode(*inputs)
            else:
                fns[b.name] = b.generate(inputs[0], case.new_tokens)
            timers[b.name] = b.timer_for(case.scenario)
        except Unavailable as e:
            info[b.name].setdefault("skipped_cases", {})[case.scenario] = str(e)
    return fns, timers


def _measurements(case: Case, samples: dict[str, list[int]], timers: dict[str, Callable], active: list[Backend],
                  cfg: ModelConfig) -> list[Measured]:  # fmt: skip
    backend = {b.name: b for b in active}
    out = []
    for name, s in samples.items():
        precision = getattr(backend[name], "precision", "fp32")
        flops, nbytes = scenario_work(cfg, case.scenario, case.batch, case.seq, case.past, case.new_tokens, precision)
        out.append(Measured(
            case, name, Stats.from_ns(s), flops, nbytes, backend[name].device,
            "cuda-events" if timers[name] is cuda_event_timer else "perf_counter_ns",
            ratio_median(s, samples[OURS]) if OURS in samples else None,  # t / t_ours, paired by round
            precision,
        ))  # fmt: skip
    return out


def _pair_ratios(case: Case, samples: dict[str, list[int]]) -> list[dict]:
    """The speedup of every pair of backends, the earlier one as baseline, paired by round."""
    names = list(samples)
    return [{"scenario": case.scenario, "batch": case.batch, "seq": case.seq, "past": case.past,
             "new_tokens": case.new_tokens, "baseline": base, "backend": other,
             "speedup": ratio_median(samples[base], samples[other])}
            for i, base in enumerate(names) for other in names[i + 1:]]  # fmt: skip


def _measure_limits_again(machine: dict[str, dict], threads: int, quick: bool, say: Callable[..., object]) -> None:
    """The limits again at the end (the machine may have been busy at the start); each figure's best counts."""
    say("  measuring the limits again")
    for device in list(machine):
        machine[device] = combine_limits(machine[device], measure_machine(threads, quick=quick, device=device))


def _below_floor(rows: list[dict]) -> list[str]:
    """A row faster than its floor means the limits were measured wrong for it: warn."""
    below = [f"{r['scenario']} {r['backend']} B={r['batch']} T={r['seq']} P={r['past']} ({r['x_floor']:.2f})"
             for r in rows if r["x_floor"] is not None and r["x_floor"] < DISTURBED_BELOW]  # fmt: skip
    if not below:
        return []
    return [f"faster than the floor (x floor < {DISTURBED_BELOW}): " + ", ".join(below) + ". The limit measurements "
            "were disturbed, or a large square matmul understates this machine's rate for these shapes"]  # fmt: skip


def _row(m: Measured, machine: dict) -> dict:
    """One result row. fp32's floor: max(bytes of fp32 weights / bandwidth, FLOPs / fp32 matmul rate). A
    weight-only quantized row's decode and generate floor is its memory floor (its own bytes: int8 / int4
    weights, scales, the float32 rest; work.forward_bytes), a lower bound, since its int8 products run at a
    rate this run does not measure; its prefill, and bf16 rows (OpenVINO's default), have no floor (null
    bytes, floor_ms, bound, x_floor, gbps): their speed is reported against ours instead."""
    c, precision, flops, nbytes = m.case, m.precision, m.flops, m.nbytes
    med_s = m.stats.median_ms / 1e3
    floored = precision == "fp32" or (precision in WEIGHT_ONLY and c.scenario != "prefill")
    if precision in WEIGHT_ONLY:
        floor_s, bound = nbytes / (machine["bandwidth_GBps"] * 1e9), "memory"
    else:
        floor_s, bound = floor_seconds(flops, nbytes, machine)
    tokens = c.batch * (c.seq if c.scenario == "prefill" else c.new_tokens)
    return {
        "scenario": c.scenario, "backend": m.backend, "batch": c.batch, "seq": c.seq, "past": c.past,
        "new_tokens": c.new_tokens, "tokens": tokens, **dataclasses.asdict(m.stats),
        "precision": precision, "flops": flops, "bytes": nbytes if floored else None,
        "floor_ms": floor_s * 1e3 if floored else None, "bound": bound if floored else None,
        "x_floor": med_s / floor_s if (floor_s and floored) else None,
        "gflops": flops / med_s / 1e9 if med_s else None, "gbps": nbytes / med_s / 1e9 if (med_s and floored) else None,
        "tokens_per_s": tokens / med_s if med_s else None, "x_ours": m.x_ours, "timer": m.timer,
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

