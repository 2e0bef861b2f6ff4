"""Latency benchmarks: PyTorch eager vs ONNX Runtime vs TensorRT engines, on the same weights and inputs,
each figure set beside the machine's own limits measured in the same run.

Method (benchmarks/README.md says it in prose):

* Every backend gets the same model weights and the same input arrays.
* Warm-up rounds, then timed rounds; backends are **interleaved** (A B A B ...), so slow drift of the
  machine (other load, clocks, thermal) hits all of them alike, and speedups are the **median of
  per-iteration ratios** t_baseline[i] / t_backend[i], in which such drift cancels.
* Times come from `time.perf_counter_ns` around a synchronous call (CUDA events for TensorRT on a GPU).
  Statistics: min, median, mean, p90, p99 (linear interpolation between order statistics, as numpy's
  default), coefficient of variation = sample std / mean.
* Threads are set explicitly: `torch.set_num_threads(n)`, ORT `intra_op_num_threads = n`,
  `inter_op_num_threads = 1`; n defaults to the CPUs this process may use.
* The physical limits are measured in the same run with the same threads: memory bandwidth (a large
  tensor copy, bytes read + written / time, and a large sum, bytes read / time; the higher counts) and
  fp32 matmul rate (a large square matmul). Each scenario's **floor** is the roofline bound
  max(FLOPs / matmul rate, bytes / bandwidth) of the work it cannot avoid (see `forward_flops` and
  `forward_bytes`); each result is reported as a multiple of its floor (`x_floor`) with its achieved
  GFLOP/s and GB/s.

Everything is usable from Python: `run_benchmark(...)` returns the result document (`bench_report`'s
schema) and writes JSON, CSV, Markdown and PNG plots when given `out`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

from .bench_report import KIND, SCHEMA_VERSION, write_outputs
from .config import ModelConfig, load_config
from .errors import AndreaExportError
from .model import Andrea
from .names import INPUT_IDS
from .progress import console, styled

BACKENDS = ("mem-read", "torch", "ort-cpu", "ort-cuda", "trt-native", "trt-plugin")
DEFAULT_BACKENDS = ("mem-read", "torch", "ort-cpu", "ort-cuda", "trt-native", "trt-plugin")
SCENARIOS = ("prefill", "decode", "generate")

# Full grids (clipped to the model's context). (batch, seq) / (batch, past) / (batch, prompt, new tokens).
PREFILL_GRID = [(b, t) for b in (1, 4, 16) for t in (32, 128, 512, 1024)]
DECODE_GRID = [(1, 127)] + [(b, p) for b in (1, 8, 32) for p in (128, 512, 1023)]  # (1, 127): the goal's case
GENERATE_GRID = [(1, 128, 64), (8, 128, 64)]
QUICK_PREFILL_GRID = [(1, 32), (1, 128)]
QUICK_DECODE_GRID = [(1, 127), (8, 128)]
QUICK_GENERATE_GRID = [(1, 32, 16)]


@dataclasses.dataclass(frozen=True)
class Settings:
    """How long to measure. `budget_s` is the timed wall time aimed at per case (all backends together);
    the number of timed rounds is budget / (time of one warm-up round), clamped to [min_repeats, max_repeats]."""

    warmup: int = 2  # warm-up rounds, at least
    warmup_s: float = 1.0  # and at least this long (lazy initialisation, caches, clocks), as trtexec's --warmUp
    long_round_s: float = 1.0  # a warm-up round longer than this is warm-up enough (large prefill cases)
    min_repeats: int = 5
    max_repeats: int = 50
    budget_s: float = 4.0
    # untimed pause before each call, so thread pools of the previous backend stop spin-waiting (PyTorch's
    # OpenMP threads spin after a parallel region and slowed the next ORT call 2x in a measured case)
    gap_s: float = 0.005
    interleave: bool = True  # False: each backend's rounds in one block (A A A B B B), to see interference

    @classmethod
    def quick(cls) -> Settings:
        return cls(warmup=2, warmup_s=0.3, min_repeats=5, max_repeats=15, budget_s=1.0)


# ============================================================================ statistics


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted values, linear interpolation between the two
    nearest order statistics (numpy's default, Excel's PERCENTILE.INC)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclasses.dataclass(frozen=True)
class Stats:
    """Summary of timed samples, in milliseconds; cv = sample standard deviation / mean (0 for one sample)."""

    n: int
    min_ms: float
    median_ms: float
    mean_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    std_ms: float
    cv: float

    @classmethod
    def from_ns(cls, samples_ns: Iterable[int | float]) -> Stats:
        ms = sorted(float(s) / 1e6 for s in samples_ns)
        if not ms:
            raise ValueError("no samples")
        n = len(ms)
        mean = sum(ms) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in ms) / (n - 1)) if n > 1 else 0.0
        return cls(n=n, min_ms=ms[0], median_ms=percentile(ms, 50), mean_ms=mean, p90_ms=percentile(ms, 90),
                   p99_ms=percentile(ms, 99), max_ms=ms[-1], std_ms=std, cv=std / mean if mean else 0.0)  # fmt: skip


def interleaved_order(names: list[str], rounds: int, interleave: bool = True) -> list[str]:
    """The order calls are made in: every round runs each backend once, in the same order (A B A B ...);
    with interleave=False each backend's rounds run as one block (A A A B B B)."""
    if not interleave:
        return [name for name in names for _ in range(rounds)]
    return [name for _ in range(rounds) for name in names]


def ratio_median(baseline_ns: list[int], other_ns: list[int]) -> float:
    """Median over iterations of baseline[i] / other[i] (> 1: `other` is faster). Samples pair up by round."""
    if len(baseline_ns) != len(other_ns) or not baseline_ns:
        raise ValueError("ratio_median needs two equally long, non-empty sample lists (one per round)")
    return percentile(sorted(b / o for b, o in zip(baseline_ns, other_ns)), 50)


Timer = Callable[[Callable[[], object]], int]


def cpu_timer(fn: Callable[[], object]) -> int:
    """Nanoseconds of one synchronous call."""
    t0 = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - t0


def cuda_event_timer(fn: Callable[[], object]) -> int:
    """Nanoseconds between two CUDA events recorded around `fn` on torch's current stream (GPU time)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return int(start.elapsed_time(end) * 1e6)


def run_interleaved(
    fns: dict[str, Callable[[], object]],
    settings: Settings,
    timers: dict[str, Timer] | None = None,
    on_round: Callable[[int, int], None] | None = None,
) -> dict[str, list[int]]:
    """Warm up, then time `fns` in interleaved rounds. Returns name -> one sample (ns) per timed round.

    The number of timed rounds: settings.budget_s / (slowest warm-up round), within [min_repeats, max_repeats].
    `on_round(done, total)` is called after each timed round (progress bars)."""
    names = list(fns)
    timers = timers or {}
    warm = {n: [] for n in names}
    t_end = time.perf_counter() + settings.warmup_s
    while True:
        t_round = time.perf_counter()
        for n in names:
            _settle(settings.gap_s, len(names))
            warm[n].append(timers.get(n, cpu_timer)(fns[n]))
        done = len(warm[names[0]])
        if time.perf_counter() - t_round > settings.long_round_s:
            break
        if (done >= max(1, settings.warmup) and time.perf_counter() >= t_end) or done >= 1000:
            break
    round_ns = max(1, sum(warm[n][-1] for n in names))
    rounds = int(min(settings.max_repeats, max(settings.min_repeats, settings.budget_s * 1e9 // round_ns)))
    samples = {n: [] for n in names}
    order = interleaved_order(names, rounds, settings.interleave)
    for i, n in enumerate(order):
        _settle(settings.gap_s, len(names))
        samples[n].append(timers.get(n, cpu_timer)(fns[n]))
        if on_round and (i + 1) % len(names) == 0:
            on_round((i + 1) // len(names), rounds)  # with interleave=False: calls done / backends
    return samples


def _settle(gap_s: float, n_backends: int) -> None:
    if gap_s > 0 and n_backends > 1:
        time.sleep(gap_s)


# ============================================================================ the machine's limits


def measure_machine(threads: int, quick: bool = False, device: str = "cpu") -> dict:
    """Memory bandwidth and fp32 matmul rate with `threads` threads, best of a few runs each.

    copy: dst.copy_(src) of a large tensor, (read + write) bytes / time; read: src.sum(), bytes / time.
    matmul: an n x n @ n x n fp32 product, 2 n^3 / time, in PyTorch and (CPU) in ONNX Runtime (one MatMul
    node, same threads): their GEMM libraries differ, and the faster one is what this machine can do.
    bandwidth_GBps and matmul_GFLOPs take the higher figure: a floor must not be beaten by a better
    access pattern or library."""
    torch.set_num_threads(threads)
    nbytes = (256 if quick else 1024) << 20
    n_mm = 2048 if quick else 3072
    reps = 3 if quick else 5
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def best(fn) -> float:
        fn()  # first touch / warm-up
        sync()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            fn()
            sync()
            ts.append(time.perf_counter_ns() - t0)
        return min(ts) / 1e9

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    t_copy = best(lambda: dst.copy_(src))
    t_read = best(lambda: src.sum())
    src = dst = None  # free 2 x nbytes before the matmul
    a = torch.randn(n_mm, n_mm, device=dev)
    b = torch.randn(n_mm, n_mm, device=dev)
    c = torch.empty(n_mm, n_mm, device=dev)
    torch_mm = 2 * n_mm**3 / best(lambda: torch.mm(a, b, out=c)) / 1e9
    ort_mm = None
    if dev.type == "cpu":
        with contextlib.suppress(ImportError):
            run = _ort_matmul(threads, a.numpy(), b.numpy())
            ort_mm = 2 * n_mm**3 / best(run) / 1e9
    copy_gbps = 2 * nbytes / t_copy / 1e9
    read_gbps = nbytes / t_read / 1e9
    return {
        "device": device,
        "threads": threads,
        "copy_GBps": copy_gbps,
        "read_GBps": read_gbps,
        "bandwidth_GBps": max(copy_gbps, read_gbps),
        "torch_matmul_GFLOPs": torch_mm,
        "ort_matmul_GFLOPs": ort_mm,
        "matmul_GFLOPs": max(torch_mm, ort_mm or 0.0),
        "method": f"best of {reps}: copy_ and sum of {nbytes >> 20} MiB fp32; {n_mm}x{n_mm} fp32 matmul "
                  f"(torch.mm{', ONNX Runtime MatMul' if ort_mm else ''})",
    }  # fmt: skip


def _ort_matmul(threads: int, a: np.ndarray, b: np.ndarray) -> Callable[[], object]:
    """A one-node ONNX Runtime MatMul on the CPU with `threads` intra-op threads, inputs bound once."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    n = a.shape[0]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "B"], ["C"])], "mm",
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [n, n]) for x in ("A", "B")],
        [helper.make_tensor_value_info("C", TensorProto.FLOAT, [n, n])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = min(model.ir_version, 9)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    binding = sess.io_binding()
    binding.bind_cpu_input("A", a)
    binding.bind_cpu_input("B", b)
    binding.bind_output("C", "cpu")
    return lambda: sess.run_with_iobinding(binding)


def combine_limits(*measurements: dict) -> dict:
    """Several measurements of the same device (start and end of a run) -> the best of each figure, with
    the individual measurements kept under "measurements"."""
    ms = [m for m in measurements if m]
    out = dict(ms[0])
    for key in ("copy_GBps", "read_GBps", "bandwidth_GBps", "torch_matmul_GFLOPs", "ort_matmul_GFLOPs", "matmul_GFLOPs"):
        vals = [m[key] for m in ms if m.get(key) is not None]
        out[key] = max(vals) if vals else None
    out["measurements"] = [{k: v for k, v in m.items() if k != "measurements"} for m in ms]
    return out


# ============================================================================ the work each scenario cannot avoid


def weight_bytes(cfg: ModelConfig, dtype_bytes: int = 4) -> int:
    """Bytes of all weights, the tied embedding counted once (ANDREA-120M fp32: 92,331,264 x 4)."""
    return cfg.n_params * dtype_bytes


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that multiply every token: the 4 projections of each block (12 C^2) and the tied output
    projection (V C). Embedding lookups, biases and LayerNorms are not matmul work."""
    return cfg.n_layer * 12 * cfg.n_embd**2 + cfg.vocab_size * cfg.n_embd


def attention_flops(cfg: ModelConfig, batch: int, new: int, past: int = 0) -> int:
    """Causal attention: query i (of `new`) sees past + i + 1 keys; QK^T and AV each cost 2 C flops per
    (query, key) pair per layer (summed over heads)."""
    pairs = new * past + new * (new + 1) // 2
    return 2 * 2 * cfg.n_embd * pairs * batch * cfg.n_layer


def forward_flops(cfg: ModelConfig, batch: int, new: int, past: int = 0) -> int:
    """2 * matmul weights * tokens + attention FLOPs."""
    return 2 * matmul_params(cfg) * batch * new + attention_flops(cfg, batch, new, past)


def forward_bytes(cfg: ModelConfig, batch: int, new: int, past: int = 0, write_kv: bool = True,
                  dtype_bytes: int = 4) -> int:  # fmt: skip
    """Bytes a forward pass must move at least once: every weight it uses (all of them, except the
    position rows it does not look up), the past KV cache read, the new tokens' K/V written (if the graph
    returns a cache) and the logits written."""
    C, L = cfg.n_embd, cfg.n_layer
    used_positions = min(past + new, cfg.n_positions)
    weights = (cfg.n_params - (cfg.n_positions - used_positions) * C) * dtype_bytes
    kv_read = 2 * L * batch * past * C * dtype_bytes
    kv_write = 2 * L * batch * new * C * dtype_bytes if write_kv else 0
    logits = batch * new * cfg.vocab_size * 4
    return weights + kv_read + kv_write + logits


def floor_seconds(flops: float, nbytes: float, machine: dict) -> tuple[float, str]:
    """Roofline floor: (max(flops / matmul rate, bytes / bandwidth), which one binds)."""
    t_c = flops / (machine["matmul_GFLOPs"] * 1e9)
    t_m = nbytes / (machine["bandwidth_GBps"] * 1e9)
    return (t_c, "compute") if t_c >= t_m else (t_m, "memory")


def scenario_work(cfg: ModelConfig, scenario: str, batch: int, seq: int, past: int, new_tokens: int) -> tuple[int, int]:
    """(FLOPs, bytes) of one timed call of a scenario."""
    if scenario == "prefill":
        return forward_flops(cfg, batch, seq), forward_bytes(cfg, batch, seq, write_kv=False)
    if scenario == "decode":
        return forward_flops(cfg, batch, 1, past), forward_bytes(cfg, batch, 1, past)
    if scenario == "generate":  # the prompt, then new_tokens - 1 single-token steps
        flops = forward_flops(cfg, batch, seq)
        nbytes = forward_bytes(cfg, batch, seq)
        for p in range(seq, seq + new_tokens - 1):
            flops += forward_flops(cfg, batch, 1, p)
            nbytes += forward_bytes(cfg, batch, 1, p)
        return flops, nbytes
    raise ValueError(f"unknown scenario {scenario!r}")


# ============================================================================ environment


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git() -> dict:
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=here, capture_output=True, text=True, timeout=10)
        if rev.returncode:
            return {"revision": None, "dirty": None}
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], check=False, cwd=here,
                               capture_output=True, text=True, timeout=10)  # fmt: skip
        return {"revision": rev.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"revision": None, "dirty": None}


def _gpus() -> list[dict]:
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_GiB": round(p.total_memory / 2**30, 1)})
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm", "--format=csv,noheader"],
                             check=False, capture_output=True, text=True, timeout=20)  # fmt: skip
        for i, line in enumerate(smi.stdout.strip().splitlines() if smi.returncode == 0 else []):
            name, driver, clock = (s.strip() for s in line.split(","))
            if i < len(gpus):
                gpus[i].update(driver=driver, max_sm_clock=clock)
            else:
                gpus.append({"name": name, "driver": driver, "max_sm_clock": clock})
    except (OSError, subprocess.SubprocessError):
        pass
    return gpus


def environment() -> dict:
    """Where the numbers come from: CPU, cores, memory, GPU and driver, library versions, git revision,
    thread-related environment variables, load average."""
    cpuinfo = _read("/proc/cpuinfo")
    model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), None)
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), [])
    meminfo = _read("/proc/meminfo")
    mem_kb = next((int(ln.split()[1]) for ln in meminfo.splitlines() if ln.startswith("MemTotal")), None)
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        import onnxruntime as ort

        providers = ort.get_available_providers()
    except ImportError:
        providers = []
    return {
        "cpu": {
            "model": model or platform.processor() or platform.machine(),
            "logical_cores": os.cpu_count(),
            "usable_cores": usable,
            "isa": [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "asimd") if f in flags],
            "governor": _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor").strip() or None,
        },
        "memory_GiB": round(mem_kb / 2**20, 1) if mem_kb else None,
        "gpus": _gpus(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "libraries": {d: _version(d) for d in ("andrea-export", "torch", "numpy", "onnx", "onnxruntime",
                                              "onnxruntime-gpu", "tensorrt", "tensorrt-rtx-cu13", "polygraphy")},
        "torch": {"num_threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
                  "mkldnn": torch.backends.mkldnn.is_available(), "cuda": torch.version.cuda},
        "onnxruntime_providers": providers,
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY",
                                           "CUDA_VISIBLE_DEVICES") if k in os.environ},
        "git": _git(),
        "loadavg_start": _loadavg(),
    }


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ============================================================================ backends


class Unavailable(AndreaExportError):
    """A backend (or one scenario of it) cannot run here; the message says why."""


class Context:
    """What every backend shares: the model, its config, the thread count, and the exported ONNX files
    (made once per weights fingerprint and cached under `workdir`)."""

    def __init__(self, model: Andrea, threads: int, workdir: Path, quiet: bool = True):
        self.model = model.float().cpu().eval()
        self.cfg = model.cfg
        self.threads = threads
        self.workdir = Path(workdir)
        self.quiet = quiet
        self.fingerprint = weights_fingerprint(self.model)

    def _cached(self, name: str, export: Callable[[Path], object]) -> Path:
        path = self.workdir / f"{self.cfg.name}-{self.fingerprint}-{_exporter_fingerprint()}" / name
        if not path.is_file():
            export(path)
        return path

    def prefill_onnx(self) -> Path:
        from .export import export_onnx

        return self._cached("model.onnx", lambda p: export_onnx(self.model, p, quiet=self.quiet))

    def decoder_onnx(self) -> Path:
        try:
            from .kvcache import export_decoder_onnx
        except ImportError as e:
            raise Unavailable(f"no KV-cache decoder export in this andrea-export ({e})") from None
        return self._cached("decoder.onnx", lambda p: export_decoder_onnx(self.model, p, quiet=self.quiet))


def _exporter_fingerprint() -> str:
    """sha256 (8 hex digits) of the sources that shape the exported graphs, so a changed exporter never
    reuses a stale cached file."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for f in ("model.py", "export.py", "kvcache.py"):
        with contextlib.suppress(OSError):
            h.update((here / f).read_bytes())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:8]


def default_cache_dir() -> Path:
    """Where exported ONNX files are cached between runs: $ANDREA_EXPORT_CACHE, else ~/.cache/andrea-export/bench."""
    if os.environ.get("ANDREA_EXPORT_CACHE"):
        return Path(os.environ["ANDREA_EXPORT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "andrea-export" / "bench"


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 (16 hex digits) of the config and every tensor of the state dict: names the cached exports."""
    h = hashlib.sha256(json.dumps(model.cfg.to_dict(), sort_keys=True).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class Backend:
    """One way to run the model. Each scenario method returns a zero-argument callable that runs one
    iteration synchronously (inputs bound once, outside the timed call)."""

    name = "?"
    device = "cpu"
    timer: Timer = staticmethod(cpu_timer)

    def check(self) -> str | None:
        """None when the backend can run here, else the reason it cannot."""
        return None

    def setup(self, ctx: Context) -> dict:
        """Prepare (sessions, engines). Returns facts for the report (threads, providers, ...)."""
        return {}

    def prepare(self, scenarios: Iterable[str]) -> None:
        """Do the slow one-off work (exports, session loads) before the timed cases; Unavailable if impossible."""

    def timer_for(self, scenario: str) -> Timer:
        """The clock for a scenario's calls (CUDA events for device work; wall clock for host loops)."""
        return self.timer

    def prefill(self, ids: np.ndarray) -> Callable[[], object]:
        raise Unavailable(f"{self.name}: prefill not implemented")

    def decode(self, ids: np.ndarray, mask: np.ndarray, past: list[np.ndarray]) -> Callable[[], object]:
        raise Unavailable(f"{self.name}: decode not implemented")

    def generate(self, prompt: np.ndarray, new_tokens: int) -> Callable[[], object]:
        raise Unavailable(f"{self.name}: generate not implemented")


class MemReadBackend(Backend):
    """The decode floor, measured in the same interleaved rounds as the backends: a decode step must read
    every weight and the KV cache once, so this reads that many bytes (torch.sum over a float32 buffer
    of the step's `forward_bytes`, same threads). On a shared machine the bandwidth drifts by 1.5x
    within minutes; paired per iteration with a backend, median(t_backend / t_read) is that backend's
    multiple of the floor with the drift cancelled (`goals` reports it beside the start/end floor)."""

    name = "mem-read"

    def setup(self, ctx: Context) -> dict:
        self.cfg, self.threads = ctx.cfg, ctx.threads
        return {"method": "torch.sum over a float32 buffer of the decode step's bytes (weights + KV cache)"}

    def decode(self, ids, mask, past):
        torch.set_num_threads(self.threads)
        buf = torch.ones(forward_bytes(self.cfg, ids.shape[0], 1, past[0].shape[2]) // 4)
        return lambda: buf.sum()


class TorchBackend(Backend):
    """PyTorch eager, float32, inference mode, torch.set_num_threads(threads)."""

    name = "torch"

    def setup(self, ctx: Context) -> dict:
        self.model = ctx.model
        torch.set_num_threads(ctx.threads)
        return {"threads": torch.get_num_threads(), "mode": "eager, float32, torch.inference_mode"}

    def prefill(self, ids):
        x = torch.from_numpy(ids)

        def run():
            with torch.inference_mode():
                return self.model(x)

        return run

    def decode(self, ids, mask, past):
        x, m = torch.from_numpy(ids), torch.from_numpy(mask)
        pairs = [(torch.from_numpy(past[2 * i]), torch.from_numpy(past[2 * i + 1])) for i in range(len(past) // 2)]

        def run():
            with torch.inference_mode():
                return self.model.forward_with_cache(x, pairs, m)

        return run

    def generate(self, prompt, new_tokens):
        x = torch.from_numpy(prompt)

        def run():
            with torch.inference_mode():
                return torch_greedy(self.model, x, new_tokens)

        return run


def torch_greedy(model: Andrea, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding with the KV cache: [B, T] prompt -> [B, new_tokens] token ids."""
    logits, past = model.forward_with_cache(prompt)
    tok = logits[:, -1].argmax(-1, keepdim=True)
    out = [tok]
    for _ in range(new_tokens - 1):
        logits, past = model.forward_with_cache(tok, past)
        tok = logits[:, -1].argmax(-1, keepdim=True)
        out.append(tok)
    return torch.cat(out, dim=1)


class OrtBackend(Backend):
    """ONNX Runtime with IO binding: CPU EP (intra_op_num_threads = threads, inter_op 1, sequential) or CUDA EP.

    `spin`: whether ORT's pool threads spin-wait between ops (ORT's default is to spin). Off by default
    here, because spinning threads left over from one backend's call steal the cores of the next one in
    an interleaved run; the setting is recorded."""

    def __init__(self, provider: str = "CPUExecutionProvider", spin: bool = False):
        self.provider = provider
        self.spin = spin
        self.cuda = provider == "CUDAExecutionProvider"
        self.name = "ort-cuda" if self.cuda else "ort-cpu"
        self.device = "cuda" if self.cuda else "cpu"
        self._sessions = {}

    def check(self):
        try:
            import onnxruntime as ort
        except ImportError:
            return "onnxruntime is not installed"
        if self.provider not in ort.get_available_providers():
            return f"{self.provider} is not available in this onnxruntime (providers: {', '.join(ort.get_available_providers())})"
        if self.cuda and not torch.cuda.is_available():
            return "no NVIDIA GPU visible"
        return None

    def setup(self, ctx):
        import onnxruntime as ort

        self.ctx = ctx
        so = ort.SessionOptions()
        so.intra_op_num_threads = ctx.threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spin else "0")
        so.log_severity_level = 3
        self.options = so
        return {"threads": ctx.threads, "inter_op_threads": 1, "provider": self.provider, "spin_wait": self.spin,
                "graph_optimization": "ORT_ENABLE_ALL", "io_binding": True}  # fmt: skip

    def prepare(self, scenarios):
        if "prefill" in scenarios:
            self.session("prefill")
        if "decode" in scenarios or "generate" in scenarios:
            try:
                self.session("decode")
            except Unavailable as e:  # prefill can still run; decode/generate cases say why they are missing
                self._missing = str(e)

    def session(self, role: str):
        import onnxruntime as ort

        if role == "decode" and getattr(self, "_missing", None):
            raise Unavailable(self._missing)
        if role not in self._sessions:
            path = self.ctx.prefill_onnx() if role == "prefill" else self.ctx.decoder_onnx()
            self._sessions[role] = ort.InferenceSession(str(path), self.options, providers=[self.provider])
        return self._sessions[role]

    def _bound(self, sess, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
        import onnxruntime as ort

        binding = sess.io_binding()
        dev = "cuda" if self.cuda else "cpu"
        keep = []
        for name, arr in feeds.items():
            v = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr), dev, 0)
            keep.append(v)
            binding.bind_ortvalue_input(name, v)
        for o in sess.get_outputs():
            binding.bind_output(o.name, dev)

        def run():  # returns the binding: .copy_outputs_to_cpu() gives the outputs (not done in the timed call)
            sess.run_with_iobinding(binding)
            if self.cuda:
                binding.synchronize_outputs()
            return binding if keep else None

        return run

    def prefill(self, ids):
        sess = self.session("prefill")
        return self._bound(sess, {sess.get_inputs()[0].name: ids})

    def decode(self, ids, mask, past):
        from .kvcache import ATTENTION_MASK, INPUT_IDS, kv_layout

        sess = self.session("decode")
        layout = kv_layout(self.ctx.cfg)
        feeds = {INPUT_IDS: ids, ATTENTION_MASK: mask, **dict(zip(layout.past_names, past))}
        return self._bound(sess, feeds)

    def generate(self, prompt, new_tokens):
        """Greedy, through the product's own loop (runtime.OrtSession: one batched call for all rows) on this
        harness's session and threads."""
        rs, prompts = self._runtime_session(self.session("decode")), prompt.tolist()
        return lambda: rs.generate(prompts, new_tokens)

    def _runtime_session(self, sess):
        """andrea_export.runtime's OrtSession wrapped around our session (same file, same options)."""
        if not hasattr(self, "_rs"):
            from .graphs import kv_layout
            from .runtime.ort import OrtSession

            # the runtime loads the graph with its own options; swap in ours (threads, no spinning)
            self._rs = OrtSession(self.ctx.decoder_onnx(), self.ctx.cfg, kv_layout(self.ctx.cfg),
                                  providers=[self.provider], intra_op_threads=self.ctx.threads)  # fmt: skip
            self._rs.session = sess
        return self._rs


class TrtBackend(Backend):
    """A TensorRT engine (GPU host only): `variant` "native" (ONNX Gelu -> TensorRT's own layers) or
    "plugin" (tanh-GELU as the project's plugin). Engines are built by the build stage and passed in as
    paths ({"prefill": plan, "decode": plan}); timing uses CUDA events on one stream.

    Thin hook: it needs `tensorrt` and a GPU, neither of which the CPU development machines have."""

    device = "cuda"
    timer = staticmethod(cuda_event_timer)

    def __init__(self, variant: str, engines: dict[str, str | Path] | None = None):
        if variant not in ("native", "plugin"):
            raise ValueError(f"TensorRT variant must be 'native' or 'plugin', not {variant!r}")
        self.variant = variant
        self.name = f"trt-{variant}"
        self.engines = {k: Path(v) for k, v in (engines or {}).items()}

    def timer_for(self, scenario):
        # generation runs through runtime.TrtSession, which syncs every step to return host logits: wall time
        return cpu_timer if scenario == "generate" else cuda_event_timer

    def check(self):
        if not torch.cuda.is_available():
            return "no NVIDIA GPU visible (torch.cuda.is_available() is False); TensorRT engines run on GPU hosts only"
        if importlib.util.find_spec("tensorrt") is None:
            return "the 'tensorrt' module is not installed (pip install 'andrea-export[tensorrt]')"
        if not self.engines:
            return f"no {self.variant}-GELU engine given (build one with `andrea-export build`, pass it as trt_engines)"
        missing = [str(p) for p in self.engines.values() if not p.is_file()]
        if missing:
            return f"engine file(s) not found: {', '.join(missing)}"
        return None

    def setup(self, ctx):
        import tensorrt as trt

        self.trt = trt
        self.cfg = ctx.cfg
        # A plugin engine needs no registration here: the AOT plugin's kernel is embedded in the plan.
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engines = {}
        self.stream = torch.cuda.Stream()
        return {"tensorrt": trt.__version__, "engines": {k: str(v) for k, v in self.engines.items()}}

    def _context(self, role: str):
        if role not in self.engines:
            raise Unavailable(f"{self.name}: no '{role}' engine given")
        if role not in self._engines:
            engine = self.runtime.deserialize_cuda_engine(self.engines[role].read_bytes())
            context = engine.create_execution_context()
            if role == "decode" and engine.num_optimization_profiles > 1:
                # a decoder engine carries kvcache.optimization_profiles: [prefill, decode]
                context.set_optimization_profile_async(1, self.stream.cuda_stream)
                self.stream.synchronize()
            self._engines[role] = (engine, context)
        return self._engines[role]

    def _bound(self, role: str, feeds: dict[str, np.ndarray]):
        engine, ctx = self._context(role)
        trt = self.trt
        tensors = {}
        for name, arr in feeds.items():
            tensors[name] = torch.from_numpy(np.ascontiguousarray(arr)).cuda()
            ctx.set_input_shape(name, tuple(arr.shape))
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT:
                shape = tuple(ctx.get_tensor_shape(name))
                dtype = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                         trt.int64: torch.int64}[engine.get_tensor_dtype(name)]
                tensors[name] = torch.empty(shape, dtype=dtype, device="cuda")
        for name, t in tensors.items():
            ctx.set_tensor_address(name, t.data_ptr())
        stream = self.stream

        def run():
            with torch.cuda.stream(stream):
                ctx.execute_async_v3(stream.cuda_stream)
            return tensors

        return run

    def prefill(self, ids):
        return self._bound("prefill", {INPUT_IDS: ids})

    def decode(self, ids, mask, past):
        from .kvcache import ATTENTION_MASK, INPUT_IDS, kv_layout

        names = kv_layout(self.cfg).past_names
        return self._bound("decode", {INPUT_IDS: ids, ATTENTION_MASK: mask, **dict(zip(names, past))})

    def generate(self, prompt, new_tokens):
        """Batch 1 only, through andrea_export.runtime's TrtSession (needs decoder.onnx beside the engine)."""
        if prompt.shape[0] != 1 or "decode" not in self.engines:
            raise Unavailable(f"{self.name}: generation needs a decoder engine and batch 1 (runtime.TrtSession)")
        from . import runtime

        if not hasattr(self, "_session"):
            self._session = runtime.load(self.engines["decode"], backend="tensorrt")
        ids = prompt[0].tolist()
        return lambda: self._session.generate(ids, new_tokens)


def make_backends(names: Iterable[str], trt_engines: dict[str, dict] | None = None, ort_spin: bool = False) -> list[Backend]:
    out = []
    for n in names:
        if n == "mem-read":
            out.append(MemReadBackend())
        elif n == "torch":
            out.append(TorchBackend())
        elif n == "ort-cpu":
            out.append(OrtBackend("CPUExecutionProvider", spin=ort_spin))
        elif n == "ort-cuda":
            out.append(OrtBackend("CUDAExecutionProvider", spin=ort_spin))
        elif n in ("trt-native", "trt-plugin"):
            out.append(TrtBackend(n.split("-", 1)[1], (trt_engines or {}).get(n)))
        else:
            raise AndreaExportError(f"unknown backend {n!r}; known: {', '.join(BACKENDS)}")
    return out


# ============================================================================ the run


def _clip(cfg: ModelConfig, scenario: str, grid):
    n = cfg.n_positions
    if scenario == "prefill":
        return [(b, min(t, n)) for b, t in dict.fromkeys(grid) if t <= n] or [(b, n) for b, _ in grid[:1]]
    if scenario == "decode":
        return [(b, p) for b, p in dict.fromkeys(grid) if p + 1 <= n]
    return [(b, t, k) for b, t, k in dict.fromkeys(grid) if t + k <= n]


def _cases(cfg, scenarios, prefill_grid, decode_grid, generate_grid):
    cases = []
    if "prefill" in scenarios:
        cases += [("prefill", b, t, 0, 0) for b, t in _clip(cfg, "prefill", prefill_grid)]
    if "decode" in scenarios:
        cases += [("decode", b, 1, p, 1) for b, p in _clip(cfg, "decode", decode_grid)]
    if "generate" in scenarios:
        cases += [("generate", b, t, 0, k) for b, t, k in _clip(cfg, "generate", generate_grid)]
    return cases


def _inputs(cfg: ModelConfig, scenario: str, batch: int, seq: int, past: int, seed: int):
    """The same arrays for every backend: random token ids; for decode a random past KV cache."""
    rng = np.random.default_rng([seed, batch, seq, past, SCENARIOS.index(scenario)])
    ids = rng.integers(0, cfg.vocab_size, size=(batch, seq), dtype=np.int64)
    if scenario != "decode":
        return (ids,)
    shape = (batch, cfg.n_head, past, cfg.head_dim)
    kv = [rng.random(shape, dtype=np.float32) for _ in range(2 * cfg.n_layer)]  # uniform: cheaper, times the same
    return ids, np.ones((batch, past + 1), np.int64), kv


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
    ort_spin: bool = False,
    seed: int = 0,
    plots: bool = True,
    quiet: bool = False,
) -> dict:
    """Run the benchmark and return the result document (schema: `bench_report`).

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
        ort_spin: let ORT's threads spin-wait (ORT's own default; off here for fair interleaving).
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
        from .checkpoint import load_model

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
    cases = _cases(cfg, scenarios, prefill_grid, decode_grid, generate_grid)

    say = (lambda *a: None) if quiet else console.print
    notes = _load_warnings(env.get("loadavg_start"), threads, at_start=True)
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
            active.append(b)
        except (AndreaExportError, ImportError, RuntimeError) as e:
            info[b.name] = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
            say(" ", styled("failed", "red"), f"{b.name}: {e}")
    if any(b.device == "cuda" for b in active) and torch.cuda.is_available():
        machine["cuda"] = measure_machine(threads, quick=quick, device="cuda")

    devices = {b.name: b.device for b in active}
    measured, ratios, failed = [], [], []
    progress = _progress(quiet)
    with progress:
        overall = progress.add_task("cases", total=len(cases))
        for scenario, batch, seq, past, new_tokens in cases:
            label = {"prefill": f"prefill B={batch} T={seq}", "decode": f"decode B={batch} P={past}",
                     "generate": f"generate B={batch} prompt={seq} new={new_tokens}"}[scenario]  # fmt: skip
            inputs = _inputs(cfg, scenario, batch, seq, past, seed)
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
            flops, nbytes = scenario_work(cfg, scenario, batch, seq, past, new_tokens)
            for name, s in samples.items():
                measured.append((scenario, name, batch, seq, past, new_tokens, Stats.from_ns(s), flops, nbytes,
                                 devices[name], "cuda-events" if timers[name] is cuda_event_timer else "perf_counter_ns"))  # fmt: skip
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
    rows = [_row(*m[:9], machine.get(m[9], machine["cpu"]), m[10]) for m in measured]  # GPU rows: GPU limits
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
        "loadavg_end": _loadavg(),
    }
    notes += _load_warnings(doc["loadavg_end"], threads, at_start=False)
    below = [f"{r['scenario']} {r['backend']} B={r['batch']} T={r['seq']} P={r['past']} ({r['x_floor']:.2f})"
             for r in rows if r["x_floor"] is not None and r["x_floor"] < 0.95]  # fmt: skip
    if below:
        notes.append("faster than the floor (x floor < 0.95): " + ", ".join(below) + ". The limit measurements "
                     "were disturbed, or a large square matmul understates this machine's rate for these shapes")  # fmt: skip
    doc["warnings"] = notes
    doc["goals"] = goals(doc)
    if tmp is not None:
        tmp.cleanup()
    if out is not None:
        files = write_outputs(doc, out, plots=plots)
        say("  wrote " + ", ".join(str(p) for p in files.values()))
    if not quiet:
        print_summary(doc)
    return doc


def _load_warnings(load: list[float] | None, threads: int, at_start: bool) -> list[str]:
    """Timings taken while other processes share the cores are not worth much (PyTorch's OpenMP threads
    slow down 10x when one of them is descheduled at a barrier); say so in the report."""
    if not load:
        return []
    cores = os.cpu_count() or 1
    if at_start and load[0] > max(1.0, 0.5 * cores):
        return [(f"the machine was busy when the run started (1-min load average {load[0]} on {cores} cores): "
                f"timings will be noisy and PyTorch's multi-threaded figures especially so; rerun on a quiet machine")]
    if not at_start and load[0] > threads + 0.75:
        return [(f"other processes shared the cores during the run (1-min load average {load[0]} at the end, "
                f"this run uses {threads} threads): treat the timings as noisy")]
    return []


def _row(scenario, backend, batch, seq, past, new_tokens, st: Stats, flops, nbytes, machine, timer) -> dict:
    floor_s, bound = floor_seconds(flops, nbytes, machine)
    med_s = st.median_ms / 1e3
    tokens = batch * (seq if scenario == "prefill" else new_tokens)
    return {
        "scenario": scenario, "backend": backend, "batch": batch, "seq": seq, "past": past, "new_tokens": new_tokens,
        "tokens": tokens, **{k: v for k, v in dataclasses.asdict(st).items()},
        "flops": flops, "bytes": nbytes, "floor_ms": floor_s * 1e3, "bound": bound,
        "x_floor": med_s / floor_s if floor_s else None,
        "gflops": flops / med_s / 1e9 if med_s else None, "gbps": nbytes / med_s / 1e9 if med_s else None,
        "tokens_per_s": tokens / med_s if med_s else None, "timer": timer,
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


# ============================================================================ goals


def _find(doc, **key):
    return next((r for r in doc["rows"] if all(r.get(k) == v for k, v in key.items())), None)


def _speedup(doc: dict, baseline: str, backend: str, **key) -> dict | None:
    """The ratio row of `backend` over `baseline` for a case, whichever of the two ran first."""
    for x in doc.get("ratios", []):
        if all(x.get(k) == v for k, v in key.items()):
            if (x["baseline"], x["backend"]) == (baseline, backend):
                return x
            if (x["baseline"], x["backend"]) == (backend, baseline):
                return dict(x, baseline=baseline, backend=backend, speedup=1.0 / x["speedup"])
    return None


def goals(doc: dict) -> list[dict]:
    """Where we stand against the project's performance goals (reported, never asserted)."""
    out = []
    r = _find(doc, scenario="decode", backend="ort-cpu", batch=1, past=127)
    out.append({
        "name": "ORT CPU fp32 decode step, batch 1, past 127",
        "target": "<= 1.5 x memory-bandwidth floor",
        "value": r["x_floor"] if r else None,
        "met": (r["x_floor"] <= 1.5) if r else None,
        "detail": (f"{r['median_ms']:.2f} ms vs floor {r['floor_ms']:.2f} ms ({r['bound']}-bound), "
                   f"{r['gbps']:.1f} GB/s achieved of {doc['machine']['bandwidth_GBps']:.1f}") if r else "not run",
    })  # fmt: skip
    paired = _speedup(doc, "mem-read", "ort-cpu", scenario="decode", batch=1, past=127)
    if paired:  # the floor read in the same rounds: drift cancels
        x = 1 / paired["speedup"]
        m = _find(doc, scenario="decode", backend="mem-read", batch=1, past=127)
        out.append({
            "name": "ORT CPU fp32 decode step, batch 1, past 127 (floor read in the same rounds)",
            "target": "<= 1.5 x memory-bandwidth floor",
            "value": x, "met": x <= 1.5,
            "detail": f"median of per-round t_ORT / t_read; reading the step's bytes took {m['median_ms']:.2f} ms "
                      f"({m['gbps']:.1f} GB/s) in those rounds" if m else "",
        })  # fmt: skip
    t = _find(doc, scenario="prefill", backend="torch", batch=1, seq=128)
    o = _find(doc, scenario="prefill", backend="ort-cpu", batch=1, seq=128)
    q = _speedup(doc, "torch", "ort-cpu", scenario="prefill", batch=1, seq=128)
    mm = doc["machine"]["matmul_GFLOPs"]
    out.append({
        "name": "prefill 128 tokens (batch 1): ONNX Runtime CPU vs PyTorch eager",
        "target": ">= 1.3 x faster",
        "value": q["speedup"] if q else None,
        "met": (q["speedup"] >= 1.3) if q else None,
        "detail": (f"torch {t['median_ms']:.1f} ms ({t['gflops']:.0f} GFLOP/s), ORT {o['median_ms']:.1f} ms "
                   f"({o['gflops']:.0f} GFLOP/s = {o['gflops'] / mm:.0%} of the {mm:.0f} GFLOP/s matmul rate)")
        if (t and o) else "not run",
    })  # fmt: skip
    return out


def print_summary(doc: dict) -> None:
    """The goals, and where the first rows stand, on the console (stderr)."""
    from rich.table import Table

    table = Table(title="goals (reported, not asserted)", show_lines=False)
    for col in ("goal", "target", "value", "met", "detail"):
        table.add_column(col, overflow="fold")
    for g in doc["goals"]:
        met = {True: styled("yes", "green"), False: styled("NO", "red"), None: styled("not measured", "yellow")}[g["met"]]
        val = f"{g['value']:.2f}" if isinstance(g["value"], float) else "-"
        table.add_row(g["name"], g["target"], val, met, g["detail"])
    console.print(table)


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


__all__ = [
    "BACKENDS",
    "Settings",
    "Stats",
    "attention_flops",
    "environment",
    "floor_seconds",
    "forward_bytes",
    "forward_flops",
    "goals",
    "interleaved_order",
    "matmul_params",
    "measure_machine",
    "percentile",
    "ratio_median",
    "run_benchmark",
    "run_interleaved",
    "scenario_work",
    "weight_bytes",
]  # fmt: skip
