"""The one script a GPU host runs for the tanh-GELU plugin and the TensorRT engines, section by section:

  kernel compile      NVRTC (the pinned wheel's, else the CUDA toolkit's) compiles the kernel for this GPU (sm_80
                      PTX without one)
  driver              the driver's CUDA version (cuDriverGetVersion) loads that PTX ISA (register.py's check)
  PTX load            CuPy loads the PTX through the driver, which JIT-compiles it
  <dtype> <variant>   correctness for float32 / float16 / bfloat16, plain and bias variants, odd lengths,
                      misaligned offsets, NaN-poisoned outputs: against the float64 reference with the GPU
                      error bound and against torch's gelu(approximate="tanh")
  speed fp16          64M fp16 elements: ours vs torch's GELU vs a device-to-device copy (goal >= 90 % of copy)
  speed fp32          the same in float32, whose tanh is the accurate one (ex2 and a reciprocal, not one MUFU.TANH)
  PyTorch eager       prefill of the model in fp16 with CUDA events (the baseline of the TensorRT goal)
  plugin engine       `andrea-export build` fp16 with TensorRT and the plugin, verified (Polygraphy's TensorRT
                      runner; the KV-cache decoder through the runtime's TensorRT session)
  bare TensorRT load  that build's plans deserialized in a fresh Python process that imports only tensorrt (nothing
                      of this package, no plugin creator registered: the AOT kernel must be in the engine), and run
                      by `trtexec --loadEngine` where trtexec is installed
  native engine       the native-GELU engine of the same graph
  plugin vs native    prefill of both engines, interleaved (bench harness, CUDA events); goal: within 10 %
  TensorRT vs PyTorch goal: TensorRT >= 3x faster than PyTorch eager
  session reload      20 load/close cycles of the runtime's TensorRT session: cudaMemGetInfo comes back
  quantized engines   int8 and int4 builds with full TensorRT (per-channel int8, positive int4 scales),
                      verified here; every build's decoder gate row by row (CUDA graph captured or why
                      not, the uncaptured path, the full-context boundary)
  slot engine         `build --max-slots 256` fp16 with TensorRT >= 10.15: the in-flight batching engine, verified
                      (its gate: greedy against PyTorch, four requests batched each equal to itself alone,
                      captured and not)
  slot mixed steps    a batcher's runs on it recorded and replayed on ONNX Runtime's cache of the same graph: the
                      logits of the steps whose prompt chunk lies among the decoding rows (the two groups' cache
                      inputs overlapping) and of every other step
  in-flight serving   1 / 8 / 64 / 256 streams of 128 + 128 tokens through the batcher on it: tokens/s, time to
                      first token, inter-token p50 / p99, against the batch-1 decoder engine and the memory floor
                      (issue 39's goals on an H200: 40,000 tok/s at 64, 80,000 at 256, 50x the batch-1 engine)

Every section is isolated: an exception gives a FAIL row with the error (traceback on stderr) and the next
section runs; a section that cannot run here (no GPU, no TensorRT, or a section it needs did not finish)
gives a SKIP row with the reason. Each row is printed when it finishes and appended to a JSON-lines file
(--jsonl), so a run cut short keeps what it measured. On a machine without a GPU every section runs as far
as the CPU allows (the kernel compiles, or says which NVRTC is missing; the rest says why it stops) and the
script exits 0.

A bare GPU host (the driver, the CUDA toolkit, PyTorch, CuPy, numpy, onnx, onnxruntime; no TensorRT, none of
the build's tools such as click or rich, this package not pip-installed) runs it from a plain checkout: nothing
of the package is imported before the first section, each section imports only what it uses, and the TensorRT
sections check for TensorRT before they import the build; see benchmarks/README.md ("GPU checks").

Time budget (--budget, default 540 s: a 10-minute window on one GPU, less a minute for start-up and copying
results): a section starts only when its estimated cost fits in what is left, else it is skipped with the
reason, and an alarm stops a section that overruns the budget. The order is by value per second: the kernel
sections (about a minute and a half together) first, then PyTorch, then the engines (about 6 minutes),
which are what a short window drops: the native engine and the engine timings go first, then the plugin
build. By the estimates the default budget runs every section but the quantized engines and the slot engine's
three (about 590 s with the session reload; the quantized builds need --budget 790, the slot engine's about 420 s
more, or --tiny, where everything fits). `--only` runs the sections named, e.g. the slot engine's in one window:

    PYTHONPATH=. python benchmarks/gpu_checks.py --only "kernel compile,PTX load,kernel speed,slot engine,slot mixed steps,in-flight serving"

(kernel speed gives in-flight serving its memory floor: the device-to-device copy rate). The estimates are
guesses for ANDREA-120M on one H100/H200-class GPU, not yet measured there; --tiny uses the tiny model.

Exit status: 0 when no row is FAIL (SKIP and SLOW rows do not fail the run), 1 otherwise.

    PYTHONPATH=. python benchmarks/gpu_checks.py [--budget 540] [--tiny] [--n 67108864]
        [--jsonl bench-out/gpu_checks.jsonl] [--only SECTION,...]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))  # a plain checkout: the package beside this folder

COPY_GOAL_PCT = 90.0
DEFAULT_BUDGET_S = 540
STATUSES = ("ok", "SLOW", "SKIP", "FAIL")


class Skip(Exception):
    """A section that cannot run here; the message says why."""


class BudgetExceeded(BaseException):
    """Raised by the alarm when the time budget runs out in the middle of a section."""


class Checks:
    """Runs sections in order under a time budget; records, prints and writes (JSON lines) every row."""

    def __init__(self, budget_s: float, jsonl: Path | None, out: Any = sys.stdout, only: set[str] | None = None):
        self.budget_s = budget_s
        self.only = only  # the sections to run (--only); None: every one
        self.t0 = time.monotonic()
        self.rows: list[dict[str, Any]] = []
        self.results: dict[str, Any] = {}  # section -> what it returned (only sections that finished)
        self.status: dict[str, str] = {}  # section -> worst status of its rows
        self.jsonl = jsonl
        self.out = out
        self._started = self.t0  # of the running section: a row's seconds count from it
        if jsonl is not None:
            jsonl.parent.mkdir(parents=True, exist_ok=True)
            jsonl.write_text("")

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def row(self, section: str, check: str, status: str, detail: str) -> None:
        assert status in STATUSES, status
        r = {"section": section, "check": check, "status": status, "detail": detail,
             "seconds": round(time.monotonic() - self._started, 2)}  # fmt: skip
        self.rows.append(r)
        order = STATUSES.index
        self.status[section] = max(self.status.get(section, "ok"), status, key=order)
        print(f"{check:<28}  {status:<4}  {detail}", file=self.out, flush=True)
        if self.jsonl is not None:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps(r) + "\n")

    def section(self, name: str, fn: Callable[["Checks"], Any], estimate_s: float, needs: tuple[str, ...] = ()) -> None:
        """Run fn(self), which adds its own rows and returns a result for later sections (None: no rows of
        its own beyond a plain ok). Exceptions become a FAIL row, Skip a SKIP row; the run goes on."""
        if self.only is not None and name not in self.only:
            self.row(name, name, "SKIP", "not asked for (--only)")
            return
        missing = [n for n in needs if n not in self.results]
        if missing:
            why = ", ".join(f"{n} ({self.status.get(n, 'not run')})" for n in missing)
            self.row(name, name, "SKIP", f"needs {why}")
            return
        left = self.left()
        if estimate_s > left:
            self.row(name, name, "SKIP", f"time budget: {max(left, 0):.0f} s of {self.budget_s:.0f} s left, this needs "
                                         f"about {estimate_s:.0f} s (raise --budget to run it)")  # fmt: skip
            return
        start = self._started = time.monotonic()
        n_rows = len(self.rows)
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, max(left, 0.01))
        try:
            self.results[name] = fn(self)
            if len(self.rows) == n_rows:  # a section without rows of its own
                self.row(name, name, "ok", "")
        except Skip as e:
            self.row(name, name, "SKIP", str(e))
        except (BudgetExceeded, KeyboardInterrupt) as e:  # TensorRT's progress monitor turns the alarm into a cancel
            if isinstance(e, KeyboardInterrupt) and self.left() > 0:
                raise
            self.row(name, name, "FAIL", f"stopped at the time budget of {self.budget_s:.0f} s after "
                                         f"{time.monotonic() - start:.0f} s")  # fmt: skip
        except Exception as e:  # noqa: BLE001: any failure of a section is a row, and the next section runs
            traceback.print_exc(file=sys.stderr)
            self.row(name, name, "FAIL", f"{type(e).__name__}: {e}".splitlines()[0])
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)

    def table(self) -> str:
        width = max((len(r["check"]) for r in self.rows), default=0)
        return "\n".join(f"{r['check']:<{width}}  {r['status']:<4}  {r['detail']}" for r in self.rows)

    @property
    def failed(self) -> bool:
        return any(r["status"] == "FAIL" for r in self.rows)


def _alarm(signum: int, frame: Any) -> None:
    raise BudgetExceeded


# ---- sections ------------------------------------------------------------------------------------------


def kernel_compile(c: Checks) -> Any:
    from andrea_export.errors import MissingDependency
    from andrea_export.plugin.compile import best_arch, compile_ptx, detect_compute_capability

    cc = detect_compute_capability()
    try:
        k = compile_ptx(best_arch(cc))
    except MissingDependency as e:  # no NVRTC: a CPU machine skips; a GPU host, there to check the kernel, fails
        if cc is None:
            raise Skip(str(e)) from None
        raise
    where = f"GPU sm_{cc[0]}{cc[1]}" if cc else "no GPU: the portable sm_80"
    c.row("kernel compile", "kernel compile", "ok", f"{k.arch} ({where}), PTX ISA {k.ptx_isa}, NVRTC {k.nvrtc_version}, "
          f"needs {k.driver_floor}; {len(k.entry_points)} entry points")  # fmt: skip
    return k


def driver(c: Checks) -> Any:
    from andrea_export.plugin.compile import check_driver, cuda_driver_version

    v = cuda_driver_version()
    if v is None:
        raise Skip("no NVIDIA driver here (libcuda.so.1 not found)")
    k = c.results["kernel compile"]
    check_driver(k, v)  # PluginError (a FAIL row) with what to do when the driver is too old
    c.row("driver", "driver", "ok", f"CUDA {v // 1000}.{v % 1000 // 10} driver loads PTX ISA {k.ptx_isa}")
    return v


def _gpu() -> tuple[Any, Any]:
    from gelu_kernel import NoGpu, require_gpu

    try:
        return require_gpu()
    except NoGpu as e:
        raise Skip(str(e)) from None


def _torch_gpu() -> Any:
    """torch with a CUDA GPU, or Skip: what PyTorch's own timings need (not CuPy, which only loads our PTX)."""
    try:
        import torch
    except ImportError as e:
        raise Skip(f"needs PyTorch ({e})") from None
    if not torch.cuda.is_available():
        raise Skip("no CUDA GPU visible (torch.cuda.is_available() is False); run this on a GPU host")
    return torch


def ptx_load(c: Checks) -> Any:
    from gelu_kernel import load

    torch, cupy = _gpu()
    kern = load(torch, cupy)
    c.row("PTX load", "PTX load", "ok", f"{kern.arch}, PTX ISA {kern.ptx_isa}; {torch.cuda.get_device_name()}")
    return kern


def correctness(c: Checks) -> Any:
    from gelu_kernel import check

    torch, cupy = _gpu()
    for r in check(torch, cupy, c.results["PTX load"]):
        c.row("kernel correctness", f"{r['dtype']} {r['variant']}", "ok" if r["failures"] == 0 else "FAIL",
              f"{r['cases']} cases, max err/bound {r['max_err_over_bound']:.3f}, "
              f"max |ours - torch| {r['max_abs_diff_vs_torch']:.3g}")  # fmt: skip
    return True


def speed(n: int) -> Callable[[Checks], Any]:
    def run(c: Checks) -> Any:
        from gelu_kernel import bench

        torch, cupy = _gpu()
        out = {}
        for dtype, label in (("float16", "fp16"), ("float32", "fp32")):
            b = out[label] = bench(torch, cupy, c.results["PTX load"], n=n, dtype=dtype)
            c.row("kernel speed", f"speed {label}", "ok" if b["pct_of_copy"] >= COPY_GOAL_PCT else "SLOW",
                  f"{b['n']} elems: ours {b['ours_us']:.1f} us ({b['ours_GBps']:.0f} GB/s), torch gelu "
                  f"{b['torch_gelu_us']:.1f} us, D2D copy {b['copy_us']:.1f} us; {b['pct_of_copy']:.0f}% of copy "
                  f"(goal >= {COPY_GOAL_PCT:.0f}%)")  # fmt: skip
        return out

    return run


class Plan:
    """What the model-level sections use: the model size and the prefill shape timed. The package is imported
    by the sections that read it, never before the first row (an import that fails is then a section's row)."""

    def __init__(self, tiny: bool):
        self.tiny = tiny
        self.batch, self.seq = (2, 64) if tiny else (8, 512)

    @functools.cached_property
    def cfg(self) -> Any:
        from andrea_export.config import ANDREA_120M, ANDREA_TINY

        return ANDREA_TINY if self.tiny else ANDREA_120M

    @property
    def profile(self) -> str:
        return f"batch=1:{self.batch}:{self.batch},seq=1:{self.seq}:{self.cfg.n_positions}"

    @property
    def name(self) -> str:
        return f"{self.cfg.name} fp16, prefill {self.batch}x{self.seq}"

    @property
    def slots(self) -> int:
        """The in-flight batching engine's decoding rows (build --max-slots): the most streams timed."""
        return self.levels[-1]

    @property
    def levels(self) -> tuple[int, ...]:
        """Concurrent streams the in-flight serving section times."""
        return (1, 4, 16) if self.tiny else (1, 8, 64, 256)

    @property
    def serving(self) -> tuple[int, int]:
        """(prompt, new tokens) of each stream: 128 and 128 (issue 39's goals), a quarter of the tiny context."""
        return (32, 32) if self.tiny else (128, 128)


def torch_eager(plan: Plan) -> Callable[[Checks], Any]:
    def run(c: Checks) -> Any:
        torch = _torch_gpu()  # first: the model's module imports torch, which a host may not have
        from andrea_export.model.andrea import Andrea

        # torch's own initialisation: the time does not depend on the weights, and checkpoint.random_init would
        # import the build's tools (rich), which a bare GPU host has not got
        model = Andrea(plan.cfg).half().cuda().eval()
        ids = torch.randint(0, plan.cfg.vocab_size, (plan.batch, plan.seq), device="cuda")
        times = []
        with torch.inference_mode():
            for i in range(25):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                model(ids)
                end.record()
                torch.cuda.synchronize()
                if i >= 5:  # warm-up
                    times.append(start.elapsed_time(end))
        ms = sorted(times)[len(times) // 2]
        c.row("PyTorch eager", "PyTorch eager", "ok", f"{plan.name}: median {ms:.2f} ms (CUDA events, 20 runs)")
        return ms

    return run


def _tensorrt_here() -> None:
    from andrea_export.errors import gpu_compute_capability, installed

    why = []
    if not installed("tensorrt"):
        why.append("TensorRT is not installed (pip install 'andrea-export[tensorrt]')")
    if gpu_compute_capability() is None:
        why.append("no NVIDIA GPU here (TensorRT builds engines on the GPU it targets)")
    if why:
        raise Skip("; ".join(why))


def plugin_engine(plan: Plan, workdir: Path) -> Callable[[Checks], Any]:
    def run(c: Checks) -> Any:
        from andrea_export.engine.profiles import Profile, parse_profiles

        for p in parse_profiles(plan.profile, Profile.for_model(plan.cfg)):  # a bad profile fails here, not on the GPU
            p.check(plan.cfg.n_positions)
        _tensorrt_here()  # before the build's own imports (rich, Polygraphy, ...), which a bare GPU host has not got
        from andrea_export.pipeline import BuildOptions, run_build

        opts = BuildOptions(config=plan.cfg.name, builder="tensorrt", precision="fp16", profiles=plan.profile,
                            out=str(workdir / "plugin-fp16"), greedy_steps=16)  # fmt: skip
        m = run_build(opts, force=True)
        b = m["builder"]
        c.row("plugin engine", "build+verify plugin fp16", "ok" if m["status"] == "passed" else "FAIL",
              f"status {m['status']}; TensorRT {b['version']}, {b['plugin_layers']} plugin layers, built in "
              f"{b['build_seconds']:.0f} s; engine {m['artifacts']['engine']['bytes'] / 1e6:.0f} MB; kernel "
              f"{m['plugin']['kernel']['arch'] if isinstance(m['plugin']['kernel'], dict) else m['plugin']['kernel']}")  # fmt: skip
        _gate_rows(c, "plugin engine", Path(opts.out or ""))
        return Path(opts.out or ""), m

    return run


# Run in a fresh interpreter: imports tensorrt and nothing else of ours, registers nothing, deserializes each plan
# given, and prints one JSON line: TensorRT's version, per plan whether an engine came back (TensorRT's errors, kept by
# its logger, when not) and each profile's opt input shapes (for trtexec), and which andrea_export modules the
# process holds (none, or the load proves nothing).
BARE_LOAD = r"""
import json, sys

result = {"plans": {}}
try:
    import tensorrt as trt

    class Log(trt.ILogger):  # TensorRT says why it returns no engine only to its logger
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors = []

        def log(self, severity, msg):
            S = trt.ILogger.Severity
            if severity in (S.INTERNAL_ERROR, S.ERROR):
                self.errors.append(msg)
            if severity in (S.INTERNAL_ERROR, S.ERROR, S.WARNING):
                print(f"[TRT] {severity.name}: {msg}", file=sys.stderr)

    log = Log()
    runtime = trt.Runtime(log)
    result["tensorrt"] = trt.__version__
    for path in sys.argv[1:]:
        entry = result["plans"][path] = {"ok": False}
        log.errors = []
        try:
            with open(path, "rb") as f:
                engine = runtime.deserialize_cuda_engine(f.read())
            if engine is not None:
                names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
                inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
                entry.update(ok=True, io_tensors=len(names))
                entry["profiles"] = [{n: [int(d) for d in engine.get_tensor_profile_shape(n, p)[1]] for n in inputs
                                      if -1 in tuple(engine.get_tensor_shape(n))}
                                     for p in range(engine.num_optimization_profiles)]
                del engine
        except Exception as e:
            entry["exception"] = f"{type(e).__name__}: {e}"
        entry["errors"] = list(log.errors)
except Exception as e:
    result["error"] = f"{type(e).__name__}: {e}"
result["imported"] = sorted(m for m in sys.modules if m.split(".")[0] == "andrea_export")
print("BARE-LOAD " + json.dumps(result), flush=True)
"""
TRTEXEC_ELSEWHERE = ("/usr/src/tensorrt/bin/trtexec",)  # where TensorRT's deb packages put it, off PATH


def bare_load_command(plans: list[Path]) -> list[str]:
    """The fresh process that loads `plans` with nothing but tensorrt imported (see BARE_LOAD)."""
    return [sys.executable, "-c", BARE_LOAD, *(str(p) for p in plans)]


def trtexec_command(trtexec: str, plan: Path, profiles: list[dict[str, list[int]]]) -> list[str]:
    """trtexec running `plan` once, on the first profile whose opt shapes have no empty tensor (the decoder's prefill
    profile has an empty past), at those shapes; dynamic inputs left unset would be 1 in every dimension."""
    index = next((i for i, shapes in enumerate(profiles) if all(0 not in s for s in shapes.values())), 0)
    cmd = [trtexec, f"--loadEngine={plan}", "--iterations=1", "--warmUp=0", "--duration=0"]
    if profiles:
        cmd.append(f"--profile={index}")
        if profiles[index]:
            cmd.append("--shapes=" + ",".join(f"{n}:{'x'.join(map(str, s))}" for n, s in profiles[index].items()))
    return cmd


def _trtexec() -> str | None:
    return shutil.which("trtexec") or next((p for p in TRTEXEC_ELSEWHERE if os.access(p, os.X_OK)), None)


def bare_load(c: Checks) -> Any:
    """The claim that a plugin engine runs without Python (register.py: the AOT kernel is in the engine), exercised:
    every plan of the plugin build, deserialized in a fresh process that imports only tensorrt, then run by trtexec
    (TensorRT's C++ tool) where it is installed. One row per plan and tool."""
    out, m = c.results["plugin engine"]
    plans = [out / a["path"] for a in m["artifacts"].values() if str(a["path"]).endswith(".plan")]
    if not plans:
        raise Skip("the build has no .plan files")
    proc = subprocess.run(bare_load_command(plans), capture_output=True, text=True, timeout=300, cwd=out,
                          check=False)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("BARE-LOAD ")), None)
    if line is None:
        raise RuntimeError(f"the loading process printed no result (exit {proc.returncode}): "
                           f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    result = json.loads(line.removeprefix("BARE-LOAD "))
    if "error" in result:
        raise RuntimeError(f"the loading process: {result['error']}")
    if result["imported"]:
        c.row("bare TensorRT load", "bare process", "FAIL", f"the loading process imported {', '.join(result['imported'])}: "
              "not a load without this package")  # fmt: skip
    where = f"TensorRT {result['tensorrt']}, in a process that imported only tensorrt (nothing registered),"
    for plan in plans:
        e = result["plans"][str(plan)]
        if e["ok"] and "exception" not in e:
            c.row("bare TensorRT load", f"bare load {plan.name}", "ok", f"{where} deserialized it: {e['io_tensors']} "
                  "I/O tensors")  # fmt: skip
        else:
            why = e.get("exception") if e["ok"] else "; ".join(e["errors"][:2]) or e.get("exception") or "no error logged"
            c.row("bare TensorRT load", f"bare load {plan.name}", "FAIL",
                  f"{where} {'deserialized it, then' if e['ok'] else 'returned no engine:'} {why}")
    trtexec = _trtexec()
    if trtexec is None:
        c.row("bare TensorRT load", "trtexec --loadEngine", "SKIP", "trtexec is neither on PATH nor in "
              f"{', '.join(TRTEXEC_ELSEWHERE)} (TensorRT's tar and deb packages have it in their bin folder)")  # fmt: skip
        return result
    for plan in plans:
        cmd = trtexec_command(trtexec, plan, result["plans"][str(plan)].get("profiles", []))
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=out, check=False)
        lines = (run.stdout + run.stderr).splitlines()
        said = next((ln for ln in lines if "[E]" in ln), None) or next((ln for ln in lines if ln.startswith("&&&&")),
                                                                         (lines or ["no output"])[-1])
        profile = next((a.removeprefix("--") for a in cmd if a.startswith("--profile=")), "no profile")
        c.row("bare TensorRT load", f"trtexec {plan.name}", "ok" if run.returncode == 0 else "FAIL",
              f"--loadEngine, one run ({profile}, its opt shapes): exit {run.returncode}; {said.strip()}")
    return result


def _gate_rows(c: Checks, section: str, folder: Path) -> None:
    """One row per path of the decoder engine's gate (verify/engine.py) as verify.json records it: the CUDA-graph
    session (captured or not, and why), its capture fallback and the growing cache, each with its greedy run and
    full-context boundary."""
    report = json.loads((folder / "verify.json").read_text())
    gate = (report.get("decoder") or {}).get("engine")
    if not gate:
        c.row(section, "decoder engine gate", "FAIL", "verify.json has no decoder engine check (was it skipped?)")
        return
    for path, r in gate["paths"].items():
        g, b = r["greedy"], r["boundary"]
        detail = (f"greedy {g['steps']} tokens: {'agree' if g['agree'] else 'diverge at ' + str(g['first_divergence'])}, "
                  f"max KL {g['max_kl']:.1e}; prefill of n max|err| {b['prefill_n']['max_abs']:.2e}, decode at past n-2/n-1 "
                  f"max|err| {b['past_n-2_n-1']['max_abs']:.2e}")
        if "captured" in r:
            detail += "; captured" if r["captured"] else f"; capture FAILED: {r['capture_error']}"
        c.row(section, f"gate: {path}", "ok" if r["passed"] else "FAIL", detail)


def quantized_engines(plan: Plan, workdir: Path) -> Callable[[Checks], Any]:
    """int8 and int4 builds with full TensorRT: the Q/DQ graphs TensorRT must import (per-channel int8,
    positive int4 scales; engine/onnx_rules.py checks them on the CPU, this proves TensorRT takes them) and
    the engines verified on this GPU, the decoder's gate included."""
    def run(c: Checks) -> Any:
        _tensorrt_here()  # before the build's own imports, as plugin_engine
        from andrea_export.pipeline import BuildOptions, run_build

        out = {}
        for precision in ("int8", "int4"):
            opts = BuildOptions(config=plan.cfg.name, builder="tensorrt", precision=precision, profiles=plan.profile,
                                out=str(workdir / f"plugin-{precision}"), greedy_steps=16)  # fmt: skip
            m = run_build(opts, force=True)
            ppl = (m.get("verification") or {}).get("perplexity")
            c.row("quantized engines", f"build+verify {precision}", "ok" if m["status"] == "passed" else "FAIL",
                  f"status {m['status']}; built in {m['builder']['build_seconds']:.0f} s; engine "
                  f"{m['artifacts']['engine']['bytes'] / 1e6:.0f} MB" + (f"; perplexity {ppl}" if ppl else ""))
            _gate_rows(c, "quantized engines", Path(opts.out))
            out[precision] = m["status"]
        return out

    return run


def native_engine(plan: Plan, workdir: Path) -> Callable[[Checks], Any]:
    def run(c: Checks) -> Any:
        from andrea_export.engine.builder import build_engine
        from andrea_export.engine.profiles import Profile

        out, m = c.results["plugin engine"]
        native = build_engine(out / m["artifacts"]["onnx"]["path"], workdir / "native-fp16.plan", builder="tensorrt",
                              profiles=Profile.parse(plan.profile), progress=False)  # fmt: skip
        c.row("native engine", "build native fp16", "ok", f"{native.plugin_layers} plugin layers (native GELU), built "
              f"in {native.build_seconds:.0f} s")  # fmt: skip
        return native.plan

    return run


def plugin_vs_native(plan: Plan, workdir: Path) -> Callable[[Checks], Any]:
    def run(c: Checks) -> Any:
        from andrea_export import bench

        out, _ = c.results["plugin engine"]
        engines = {"trt-native": {"prefill": c.results["native engine"]}, "trt-plugin": {"prefill": out / "model.plan"}}
        doc = bench.run_benchmark(plan.cfg, backends=["trt-native", "trt-plugin"], scenarios=["prefill"],
                                  prefill_grid=[(plan.batch, plan.seq)], trt_engines=engines, out=workdir / "bench",
                                  quiet=True)  # fmt: skip
        med = {r["backend"]: r["median_ms"] for r in doc["rows"]}
        ratio = next((r["speedup"] for r in doc["ratios"] if r["backend"] == "trt-plugin"), None)
        ok = ratio is not None and ratio >= 1 / 1.10
        c.row("plugin vs native", f"prefill {plan.batch}x{plan.seq} plugin/native", "ok" if ok else "SLOW",
              f"native {med.get('trt-native', float('nan')):.2f} ms, plugin {med.get('trt-plugin', float('nan')):.2f} ms; "
              f"plugin speedup over native {ratio if ratio is not None else float('nan'):.3f} (goal >= 0.91)")  # fmt: skip
        return med

    return run


def trt_vs_torch(plan: Plan) -> Callable[[Checks], Any]:
    def run(c: Checks) -> Any:
        torch_ms, med = c.results["PyTorch eager"], c.results["plugin vs native"]
        if not med:
            raise Skip("the benchmark timed no engine")
        best = min(med.values())
        c.row("TensorRT vs PyTorch", f"prefill {plan.batch}x{plan.seq} vs torch", "ok" if torch_ms / best >= 3 else "SLOW",
              f"PyTorch eager fp16 {torch_ms:.2f} ms; TensorRT {best:.2f} ms, {torch_ms / best:.1f}x faster (goal >= 3x)")
        return torch_ms / best

    return run


def session_reload(c: Checks) -> Any:
    """20 load / generate / close cycles of the runtime's TensorRT session on the plugin build: device memory
    (cudaMemGetInfo) must come back each time (a service that reloads sessions must not grow)."""
    from andrea_export import runtime
    from andrea_export.runtime.trt import _cudart

    out, _ = c.results["plugin engine"]
    rt = _cudart()

    def free_bytes() -> int:
        err, free, _total = rt.cudaMemGetInfo()
        return int(free)

    frees = []
    for _ in range(20):
        with runtime.load(out, backend="tensorrt") as sess:
            sess.generate([1, 2, 3], 4)
        frees.append(free_bytes())
    drift = frees[0] - frees[-1]
    c.row("session reload", "20 TensorRT session load/close cycles", "ok" if drift <= 16 << 20 else "FAIL",
          f"free device memory after cycle 1 {frees[0] / 2**20:,.0f} MiB, after cycle 20 {frees[-1] / 2**20:,.0f} MiB "
          f"(drift {drift / 2**20:+.1f} MiB; goal <= 16 MiB)")
    return drift


# Issue 39's goals for the in-flight batching engine on an H200, fp16, 128-token prompts and outputs: generated
# tokens/s at 64 and 256 streams, and the gain at 64 over the batch-1 engine decoding one stream at a time.
SLOT_TOKENS_GOAL = {64: 40_000, 256: 80_000}
SLOT_GAIN_GOAL = (64, 50.0)
ITL_SPREAD_GOAL = 2.0  # inter-token p99 / p50


def _tensorrt_for_slots() -> str:
    """TensorRT's version, or Skip when it is older than the KV-cache-update layer the slot engine is built on."""
    import tensorrt

    have = tuple(int(x) for x in tensorrt.__version__.split(".")[:2] if x.isdigit())
    if have < (10, 15):
        raise Skip(f"TensorRT {tensorrt.__version__} has no KV-cache-update layer: the slot engine needs >= 10.15")
    return tensorrt.__version__


def slot_engine(plan: Plan, workdir: Path) -> Callable[[Checks], Any]:
    """`build --max-slots` fp16 with TensorRT >= 10.15: the in-flight batching engine built and verified, its
    gate row by row (greedy against PyTorch, four requests batched each equal to itself alone; captured and
    not)."""
    def run(c: Checks) -> Any:
        _tensorrt_here()  # before the build's own imports, as plugin_engine
        version = _tensorrt_for_slots()
        from andrea_export.pipeline import BuildOptions, run_build

        opts = BuildOptions(config=plan.cfg.name, builder="tensorrt", precision="fp16", max_slots=plan.slots,
                            out=str(workdir / "slots-fp16"), greedy_steps=16)  # fmt: skip
        m = run_build(opts, force=True)
        engine = m["artifacts"]["slot_engine"]
        c.row("slot engine", "build+verify slots fp16", "ok" if m["status"] == "passed" else "FAIL",
              f"status {m['status']}; TensorRT {version}, {plan.slots} decoding rows; slot engine "
              f"{engine['bytes'] / 1e6:.0f} MB; whole build {m['builder']['build_seconds']:.0f} s")  # fmt: skip
        out = Path(opts.out or "")
        gate = (json.loads((out / "verify.json").read_text()).get("decoder") or {}).get("in_flight_engine")
        if not gate:
            c.row("slot engine", "in-flight engine gate", "FAIL", "verify.json has no in-flight engine check (skipped?)")
        for path, r in (gate or {}).get("paths", {}).items():
            g = r["greedy"]
            detail = (f"greedy {g['steps']} tokens: {'agree' if g['agree'] else 'diverge at ' + str(g['first_divergence'])}, "
                      f"max KL {g['max_kl']:.1e}; four requests batched {'equal' if r['batched_equals_alone'] else 'UNEQUAL'} "
                      f"to each alone")  # fmt: skip
            if "capture_error" in r:
                detail += "; captured" if r["capture_error"] is None else f"; capture FAILED: {r['capture_error']}"
            c.row("slot engine", f"gate: {path}", "ok" if r["passed"] else "FAIL", detail)
        return out, m

    return run


def slot_mixed_steps(c: Checks) -> Any:
    """A batcher's runs on the slot engine, recorded, replayed on ONNX Runtime's cache of the graph the engine was
    built from: every run's logits within twice the fp16 tolerance (each side within it of float32) and the same
    top token, the runs whose chunk lies among the decoding rows (the two groups' cache inputs overlapping, which
    TensorRT's documentation does not cover) counted apart."""
    import numpy as np

    from andrea_export import runtime
    from andrea_export.bench.inflight import record_batched, replay
    from andrea_export.catalog import Role
    from andrea_export.runtime import Request
    from andrea_export.verify.thresholds import TOLERANCES

    out, m = c.results["slot engine"]
    rng = np.random.default_rng(0)
    # five requests on four slots: the first ends first and the fifth joins its slot, below three decoding rows
    lengths = [(3, 2), (100, 24), (9, 24), (70, 24), (90, 12)]
    with runtime.load(out, "tensorrt", in_flight=True) as session:
        vocab = session.cfg.vocab_size
        requests = [Request(rng.integers(1, vocab, p).tolist(), n, ignore_eos=True) for p, n in lengths]
        _, runs = record_batched(session, requests, slots=4, prefill_chunk=session.prefill_chunk)
    tol = {k: 2 * v for k, v in TOLERANCES["fp16"].items()}
    with runtime.load(out / m["artifacts"][Role.DECODER_ONNX_SLOTS]["path"], backend="onnxruntime") as ref:
        rows = replay(runs, ref.slot_cache(4), **tol)
    for label, part in (("chunk among the rows", [r for r in rows if r["chunk_inside"]]),
                        ("every other run", [r for r in rows if not r["chunk_inside"]])):
        good = bool(part) and all(r["within"] and r["same_top"] for r in part)
        c.row("slot mixed steps", label, "ok" if good else "FAIL",
              f"{len(part)} runs vs ONNX Runtime: max|diff| {max((r['max_abs'] for r in part), default=float('nan')):.3g} "
              f"(bound {tol['atol']:g} + {tol['rtol']:g}|x|), {sum(not r['within'] for r in part)} outside, "
              f"{sum(not r['same_top'] for r in part)} with another top token")  # fmt: skip
    return rows


def inflight_serving(plan: Plan) -> Callable[[Checks], Any]:
    """Streams of `plan.serving` tokens through the batcher on the slot engine at each of `plan.levels`, all
    arriving at once: tokens/s, time to first token and inter-token p50 / p99, against the batch-1 decoder
    engine decoding one stream alone and the memory floor (every weight plus the cache each step's attention
    reads, over the whole static context, at the device-to-device copy rate of kernel speed)."""
    def run(c: Checks) -> Any:
        from andrea_export import runtime
        from andrea_export.bench.inflight import serve_streams

        out, _ = c.results["slot engine"]
        cfg, (prompt, new) = plan.cfg, plan.serving
        with runtime.load(out, backend="tensorrt") as one:  # the batch-1 decoder engine, CUDA graph and all
            ids = list(range(1, prompt + 1))
            one.generate(ids, 8, ignore_eos=True)  # warm
            t0 = time.perf_counter()
            one.generate(ids, new, ignore_eos=True)
            alone = new / (time.perf_counter() - t0)
        copy = ((c.results.get("kernel speed") or {}).get("fp16") or {}).get("copy_GBps")
        weights = cfg.n_params * 2  # fp16
        row_cache = cfg.n_layer * 2 * cfg.n_positions * cfg.n_embd * 2  # keys and values of every layer, fp16
        figures = {"alone_tokens_per_s": alone, "copy_GBps": copy, "levels": []}
        with runtime.load(out, "tensorrt", in_flight=True) as session:
            for n in plan.levels:
                f = serve_streams(session, n, prompt, new, slots=n, prefill_chunk=session.prefill_chunk)
                figures["levels"].append(f)
                rate, ttft, itl = f["tokens_per_s"], f["ttft_ms"], f["itl_ms"]
                spread = itl["p99"] / itl["p50"]
                slow = spread > ITL_SPREAD_GOAL
                goals = [f"ITL p99/p50 {spread:.1f} (goal <= {ITL_SPREAD_GOAL:g})"]
                if not plan.tiny and n in SLOT_TOKENS_GOAL:
                    slow |= rate < SLOT_TOKENS_GOAL[n]
                    goals.append(f"goal >= {SLOT_TOKENS_GOAL[n]:,} tok/s on an H200")
                if not plan.tiny and n == SLOT_GAIN_GOAL[0]:
                    slow |= rate / alone < SLOT_GAIN_GOAL[1]
                    goals.append(f"goal >= {SLOT_GAIN_GOAL[1]:g}x the batch-1 engine")
                floor = (f"memory floor {n / ((weights + n * row_cache) / (copy * 1e9)):,.0f} tok/s at "
                         f"{copy:.0f} GB/s" if copy else "no memory floor (kernel speed did not run)")  # fmt: skip
                c.row("in-flight serving", f"{n} streams {prompt}+{new}", "SLOW" if slow else "ok",
                      f"{rate:,.0f} tok/s, {rate / alone:.1f}x the batch-1 engine's {alone:,.0f}; {floor}; TTFT "
                      f"p50/p99 {ttft['p50']:.1f}/{ttft['p99']:.1f} ms; ITL p50/p99 {itl['p50']:.2f}/{itl['p99']:.2f} "
                      f"ms; {f['steps']} steps of {f['mean_rows']:.1f} rows; " + "; ".join(goals))  # fmt: skip
        return figures

    return run


SECTION_NAMES = ("kernel compile", "driver", "PTX load", "kernel correctness", "kernel speed", "PyTorch eager",
                 "plugin engine", "bare TensorRT load", "native engine", "plugin vs native", "TensorRT vs PyTorch",
                 "session reload", "quantized engines", "slot engine", "slot mixed steps", "in-flight serving")


def run_all(c: Checks, n: int, tiny: bool, workdir: Path) -> None:
    plan = Plan(tiny)
    big = 0.1 if tiny else 1.0  # the engine sections scale with the model
    c.section("kernel compile", kernel_compile, 10)
    c.section("driver", driver, 1, needs=("kernel compile",))
    c.section("PTX load", ptx_load, 15)
    c.section("kernel correctness", correctness, 45, needs=("PTX load",))
    c.section("kernel speed", speed(n), 30, needs=("PTX load",))
    c.section("PyTorch eager", torch_eager(plan), 30 * big)
    c.section("plugin engine", plugin_engine(plan, workdir), 240 * big)  # two TensorRT builds + verification
    c.section("bare TensorRT load", bare_load, 20, needs=("plugin engine",))  # starting Python and trtexec, mostly
    c.section("native engine", native_engine(plan, workdir), 90 * big, needs=("plugin engine",))
    c.section("plugin vs native", plugin_vs_native(plan, workdir), 45 * big, needs=("plugin engine", "native engine"))
    c.section("TensorRT vs PyTorch", trt_vs_torch(plan), 1, needs=("PyTorch eager", "plugin vs native"))
    c.section("session reload", session_reload, 60 * big, needs=("plugin engine",))
    c.section("quantized engines", quantized_engines(plan, workdir), 200 * big)  # two builds + verification
    c.section("slot engine", slot_engine(plan, workdir), 300 * big)  # every engine of a build, the slot one too
    c.section("slot mixed steps", slot_mixed_steps, 60 * big, needs=("slot engine",))  # ONNX Runtime on the CPU
    c.section("in-flight serving", inflight_serving(plan), 60 * big, needs=("slot engine",))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                    help=f"seconds for the whole run (default {DEFAULT_BUDGET_S}: a 10-minute GPU window)")
    ap.add_argument("--tiny", action="store_true", help="the tiny model for the engine sections (a quick run)")
    ap.add_argument("--n", type=int, default=64 << 20, help="elements for the timing run (fp16)")
    ap.add_argument("--workdir", default=None, help="keep the TensorRT builds here (default: a temporary folder)")
    ap.add_argument("--jsonl", default="bench-out/gpu_checks.jsonl", help="one JSON row per line, written as it finishes")
    ap.add_argument("--only", default=None, metavar="SECTION,...",
                    help="run only these sections (by name, comma-separated), e.g. 'kernel speed,slot engine,slot "
                         "mixed steps,in-flight serving'; the others are SKIP rows")
    args = ap.parse_args(argv)
    only = None if args.only is None else {s.strip() for s in args.only.split(",") if s.strip()}
    known = set(SECTION_NAMES)
    if only is not None and (unknown := sorted(only - known)):
        ap.error(f"--only: no section {', '.join(map(repr, unknown))}; the sections: {', '.join(SECTION_NAMES)}")
    c = Checks(args.budget, Path(args.jsonl) if args.jsonl else None, only=only)
    print(f"gpu_checks: budget {args.budget:.0f} s, rows also in {args.jsonl}", flush=True)
    with tempfile.TemporaryDirectory(prefix="andrea-gpu-checks-") as tmp:
        run_all(c, args.n, args.tiny, Path(args.workdir) if args.workdir else Path(tmp))
    print()
    print(c.table())
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
