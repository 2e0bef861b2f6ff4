"""What the numbers are measured against and where they come from: the machine's own limits (memory
bandwidth, fp32 matmul rate) measured with the benchmark's threads, and the environment (CPU, GPUs,
library versions, git revision, load average)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch


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
    del src, dst  # free 2 x nbytes before the matmul
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


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
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
    usable = usable_cpus()
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
        "loadavg_start": loadavg(),
    }


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask where the OS has one), which is what its
    threads can use; os.cpu_count() counts cores a container or taskset keeps it off."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def load_warnings(load: list[float] | None, threads: int, at_start: bool) -> list[str]:
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
