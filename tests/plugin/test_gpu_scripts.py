"""The GPU-side scripts at least compile here and say clearly why they cannot run without a GPU."""

import ast
import io
import json
import os
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["benchmarks/gpu_checks.py", "benchmarks/gelu_kernel.py"])
def test_scripts_compile(script):
    py_compile.compile(str(ROOT / script), doraise=True)


SECTIONS = ["kernel compile", "driver", "PTX load", "kernel correctness", "kernel speed", "PyTorch eager",
            "plugin engine", "bare TensorRT load", "native engine", "plugin vs native", "TensorRT vs PyTorch",
            "session reload", "quantized engines", "slot engine", "slot mixed steps", "in-flight serving"]  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: run benchmarks/gpu_checks.py itself")
def test_gpu_checks_dry_run_on_cpu(tmp_path):
    """Without a GPU every section runs as far as it can, prints its row with the reason it stopped, and the
    script exits 0 with the table; the same rows are in the JSON-lines file."""
    jsonl = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_checks.py"), "--tiny", "--jsonl", str(jsonl)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["section"] for r in rows] == SECTIONS  # one row per section, in order
    table = proc.stdout.split("\n\n")[-1].strip().splitlines()
    assert [line.split("  ")[0] for line in table] == SECTIONS
    status = {r["section"]: r["status"] for r in rows}
    assert status["kernel compile"] == "ok"  # NVRTC runs on a CPU
    assert rows[0]["detail"].startswith("sm_80 (no GPU: the portable sm_80), PTX ISA 9.0")
    assert all(status[s] == "SKIP" and r["detail"] for s, r in zip(SECTIONS[1:], rows[1:]))  # each says why
    why = {r["section"]: r["detail"] for r in rows}
    assert why["PTX load"] == "no CUDA GPU visible (torch.cuda.is_available() is False); run this on a GPU host"
    assert why["native engine"] == why["bare TensorRT load"] == "needs plugin engine (SKIP)"
    assert why["slot mixed steps"] == why["in-flight serving"] == "needs slot engine (SKIP)"
    if not __import__("andrea_export.errors", fromlist=["installed"]).installed("tensorrt"):
        assert why["plugin engine"].startswith("TensorRT is not installed (pip install 'andrea-export[tensorrt]')")


def test_only_runs_the_sections_asked_for_and_refuses_a_name_it_does_not_know(tmp_path):
    assert list(_gpu_checks().SECTION_NAMES) == SECTIONS  # what --only checks names against is what runs
    jsonl = tmp_path / "rows.jsonl"
    script = [sys.executable, str(ROOT / "benchmarks" / "gpu_checks.py"), "--tiny", "--jsonl", str(jsonl)]
    proc = subprocess.run([*script, "--only", "kernel compile, slot engine"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    why = {r["section"]: r["detail"] for r in map(json.loads, jsonl.read_text().splitlines())}
    assert list(why) == SECTIONS and why["kernel compile"].startswith("sm_80")
    assert all(why[s] == "not asked for (--only)" for s in SECTIONS if s not in ("kernel compile", "slot engine"))
    assert why["slot engine"] != "not asked for (--only)"  # it ran, as far as this machine lets it
    proc = subprocess.run([*script, "--only", "slot engines"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--only: no section 'slot engines'; the sections: kernel compile" in proc.stderr


def _gpu_checks():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_checks
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return gpu_checks


def _checks(tmp_path, budget=60.0):
    gpu_checks = _gpu_checks()
    return gpu_checks, gpu_checks.Checks(budget, tmp_path / "rows.jsonl", out=io.StringIO())


def test_a_failing_section_is_a_row_and_the_run_goes_on(tmp_path):
    gc, c = _checks(tmp_path)

    def boom(c):
        raise RuntimeError("cudaErrorInvalidPitchValue\nsecond line")

    def measured(c):
        c.row("b", "b rows", "ok", "measured")
        return 1

    c.section("a", boom, 1)
    c.section("needs a", lambda c: 2, 1, needs=("a",))
    c.section("b", measured, 1)
    c.section("skips", lambda c: (_ for _ in ()).throw(gc.Skip("no GPU")), 1)
    got = [(r["section"], r["status"], r["detail"]) for r in c.rows]
    assert got == [("a", "FAIL", "RuntimeError: cudaErrorInvalidPitchValue"), ("needs a", "SKIP", "needs a (FAIL)"),
                   ("b", "ok", "measured"), ("skips", "SKIP", "no GPU")]  # fmt: skip
    assert c.failed and c.results == {"b": 1}
    written = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [(r["section"], r["status"], r["detail"]) for r in written] == got  # each row written as it finished


def test_time_budget_skips_what_does_not_fit_and_stops_an_overrun(tmp_path, monkeypatch):
    """On a fake clock: a section that does not fit what is left of the budget is skipped; one that runs gets a
    timer (SIGALRM) for exactly what is left, and when it fires the section stops as a FAIL row; the timer is
    disarmed and the previous handler restored after each section. (No wall-clock assertion: the timer is
    the operating system's; what is checked is what the script asks of it and what it does when it fires.)"""
    import signal
    import types

    now = [100.0]
    timers: list[float] = []
    real = signal
    monkeypatch.setattr(_gpu_checks(), "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(_gpu_checks(), "signal", types.SimpleNamespace(
        signal=real.signal, SIGALRM=real.SIGALRM, ITIMER_REAL=real.ITIMER_REAL,
        setitimer=lambda which, seconds: timers.append(seconds)))  # fmt: skip
    gc, c = _checks(tmp_path, budget=10.0)
    before = real.getsignal(real.SIGALRM)

    def overrun(c):
        assert timers == [7.0]  # armed with what was left: 10 s budget, 3 s spent
        now[0] += 7.0  # the section runs to the end of the budget ...
        real.raise_signal(real.SIGALRM)  # ... where the timer fires
        raise AssertionError("the section went on after the alarm")

    now[0] += 3.0
    c.section("big", lambda c: 1, estimate_s=120)
    c.section("overrun", overrun, estimate_s=0)
    c.section("after", lambda c: 1, estimate_s=1)
    assert timers == [7.0, 0]  # the skipped sections arm nothing; the one that ran is disarmed after
    assert real.getsignal(real.SIGALRM) is before
    assert [(r["section"], r["status"]) for r in c.rows] == [("big", "SKIP"), ("overrun", "FAIL"), ("after", "SKIP")]
    assert c.rows[0]["detail"].startswith("time budget: 7 s of 10 s left, this needs about 120 s")
    assert c.rows[1]["detail"] == "stopped at the time budget of 10 s after 7 s"
    assert c.rows[2]["detail"].startswith("time budget: 0 s of 10 s left")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit)")
def test_kernel_lab_builds(tmp_path):
    src = ROOT / "plugins" / "gelu_tanh" / "gelu_tanh_lab.cu"
    proc = subprocess.run(["nvcc", "-O3", "-std=c++17", "-arch=sm_90", "-o", str(tmp_path / "lab"), str(src)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_session_reload_keeps_its_figures_when_memory_leaks(tmp_path, monkeypatch):
    """The reload section's row for a leak is a FAIL row (a status the script knows) with the figures; a steady
    run is ok. A fake session and cudaMemGetInfo: what is checked is the row, not TensorRT."""
    import contextlib

    from andrea_export import runtime
    from andrea_export.runtime import trt

    free = [1000 << 20]

    @contextlib.contextmanager
    def load(folder, backend):
        assert backend == "tensorrt"
        yield type("Session", (), {"generate": lambda self, ids, n: ids})()
        free[0] -= step  # what this cycle kept

    class Cudart:
        def cudaMemGetInfo(self):
            return 0, free[0], 80 << 30

    monkeypatch.setattr(runtime, "load", load)
    monkeypatch.setattr(trt, "_cudart", Cudart)
    rows = {}
    for step in (2 << 20, 0):  # 2 MiB a cycle: 38 MiB from cycle 1 to cycle 20; then none
        gc, c = _checks(tmp_path)
        c.results["plugin engine"] = (tmp_path, {})
        c.section("session reload", gc.session_reload, 1)
        assert len(c.rows) == 1
        rows[step] = c.rows[0]
    leak, steady = rows[2 << 20], rows[0]
    assert leak["status"] == "FAIL", leak
    assert leak["detail"].startswith("free device memory after cycle 1 998 MiB, after cycle 20 960 MiB "
                                     "(drift +38.0 MiB")  # fmt: skip
    assert steady["status"] == "ok" and "(drift +0.0 MiB; goal <= 16 MiB)" in steady["detail"]


def test_kernel_compile_without_nvrtc_skips_without_a_gpu_and_fails_with_one(tmp_path, monkeypatch):
    """No NVRTC anywhere: on a machine without a GPU the kernel compile is a SKIP row that says what to install;
    on a GPU host, where the kernel sections are what the run is for, a FAIL row."""
    from andrea_export.plugin import compile as compile_mod

    monkeypatch.delenv("ANDREA_NVRTC", raising=False)
    monkeypatch.setattr(compile_mod, "find_nvrtc", lambda: None)
    got = {}
    for cc in (None, (9, 0)):
        monkeypatch.setattr(compile_mod, "detect_compute_capability", lambda device=0, cc=cc: cc)
        gc, c = _checks(tmp_path)
        c.section("kernel compile", gc.kernel_compile, 10)
        got[cc] = c.rows[0]
    assert got[None]["status"] == "SKIP", got[None]
    assert got[None]["detail"].startswith("Compiling the tanh-GELU plugin kernel needs NVRTC (libnvrtc)")
    assert got[(9, 0)]["status"] == "FAIL" and "needs NVRTC" in got[(9, 0)]["detail"]


def test_pytorch_eager_needs_no_cupy(tmp_path, monkeypatch):
    """The PyTorch baseline times torch alone: without CuPy it still goes on to the GPU (here a CPU build of torch,
    told that a GPU is there, stops at moving the model onto it; on a GPU host it times the model)."""
    monkeypatch.setitem(sys.modules, "cupy", None)  # not installed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gc, c = _checks(tmp_path)
    c.section("PyTorch eager", gc.torch_eager(gc.Plan(tiny=True)), 30)
    r = c.rows[0]
    assert "CuPy" not in r["detail"] and r["status"] != "SKIP", r


def test_nvrtc_of_the_cuda_toolkit(tmp_path, monkeypatch):
    """Without an NVRTC wheel, the CUDA toolkit's libnvrtc: $CUDA_HOME, then $CUDA_PATH (lib64, lib or
    targets/<arch>/lib), then /usr/local/cuda, then the loader's cache (ldconfig -p)."""
    from andrea_export.plugin import compile as compile_mod

    monkeypatch.setitem(sys.modules, "nvidia", None)  # no nvidia-cuda-nvrtc wheel
    monkeypatch.setitem(sys.modules, "cuda", None)  # no cuda-pathfinder
    home, path = tmp_path / "home", tmp_path / "path"
    (home / "lib64").mkdir(parents=True)
    (path / "targets" / "x86_64-linux" / "lib").mkdir(parents=True)
    lib = path / "targets" / "x86_64-linux" / "lib" / "libnvrtc.so.13"
    lib.write_bytes(b"")
    for name in ("libnvrtc.so", "libnvrtc.alt.so.13", "libnvrtc-builtins.so.13.0"):  # not the library to load
        (path / "targets" / "x86_64-linux" / "lib" / name).write_bytes(b"")
    monkeypatch.setenv("CUDA_HOME", str(home))  # a toolkit without NVRTC: the search goes on
    monkeypatch.setenv("CUDA_PATH", str(path))
    assert compile_mod.find_nvrtc() == lib
    (home / "lib64" / "libnvrtc.so.12").write_bytes(b"")
    assert compile_mod.find_nvrtc() == home / "lib64" / "libnvrtc.so.12"
    ldconfig = ("1234 libs found in cache `/etc/ld.so.cache'\n"
                "\tlibnvrtc.so.13 (libc6,x86-64) => /opt/cuda-13/lib64/libnvrtc.so.13\n"
                "\tlibnvrtc.alt.so.13 (libc6,x86-64) => /opt/cuda-13/lib64/libnvrtc.alt.so.13\n"
                "\tlibnvrtc-builtins.so.13.0 (libc6,x86-64) => /opt/cuda-13/lib64/libnvrtc-builtins.so.13.0\n"
                "\tlibnvrtc.so (libc6,x86-64) => /opt/cuda-13/lib64/libnvrtc.so\n")  # fmt: skip
    assert compile_mod._nvrtc_in_ldconfig(ldconfig) == Path("/opt/cuda-13/lib64/libnvrtc.so.13")
    assert compile_mod._nvrtc_in_ldconfig("0 libs found in cache `/etc/ld.so.cache'\n") is None


def _bare_host_modules() -> list[str]:
    """The top-level modules a bare GPU host lacks: every installed one whose distribution is not numpy, torch,
    onnx, onnxruntime (or what they need), nor pip's own; plus TensorRT, CuPy and cuda-python, and the NVRTC wheel
    (`nvidia`: the host's NVRTC is its CUDA toolkit's), whether installed here or not."""
    import importlib.metadata
    import re

    from packaging.requirements import Requirement

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    keep, todo = set(), ["numpy", "torch", "onnx", "onnxruntime", "pip", "setuptools", "wheel"]
    while todo:
        name = norm(todo.pop())
        if name in keep:
            continue
        keep.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for r in map(Requirement, requires):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r.name)
    blocked = {m for m, dists in importlib.metadata.packages_distributions().items()
               if not keep & {norm(d) for d in dists} and m.isidentifier() and m != "andrea_export"}  # fmt: skip
    return sorted(blocked | {"tensorrt", "tensorrt_rtx", "cupy", "cuda", "nvidia", "pydantic", "jsonschema"})


BARE_HOST = r"""
import runpy, sys

for name in sys.argv[1].split(","):  # not installed: an import fails, importlib.util.find_spec answers None
    sys.modules[name] = None
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]  # not pip-installed
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: run benchmarks/gpu_checks.py itself")
@pytest.mark.parametrize("pythonpath", [True, False], ids=["PYTHONPATH=checkout", "no-PYTHONPATH"])
def test_gpu_checks_on_a_bare_host(tmp_path, pythonpath):
    """A bare GPU host has the driver, the CUDA toolkit (its NVRTC), PyTorch, CuPy, numpy, onnx and onnxruntime,
    none of the build's tools (click, rich, Polygraphy, TensorRT, ...), and a plain checkout, not pip-installed (the
    manual's command puts it on PYTHONPATH; the script finds it beside itself without). Here, without a GPU: the
    kernel compiles with the toolkit's NVRTC, every other section is a SKIP row with its reason (no missing module
    among them) and the run exits 0."""
    from andrea_export.plugin.compile import find_nvrtc

    blocked = _bare_host_modules()
    assert {"click", "rich", "polygraphy", "safetensors", "tokenizers", "matplotlib", "nvidia"} <= set(blocked)
    wheel = find_nvrtc()
    if wheel is None:
        pytest.skip("needs the NVRTC wheel, to stand in for a CUDA toolkit's")
    toolkit = tmp_path / "cuda" / "lib64"  # a toolkit's layout, holding the wheel's NVRTC
    toolkit.mkdir(parents=True)
    for lib in (wheel, *wheel.parent.glob("libnvrtc-builtins.so.*")):
        try:
            (toolkit / lib.name).hardlink_to(lib)  # not a symlink: the library's folder must be the toolkit's
        except OSError:
            shutil.copy(lib, toolkit / lib.name)
    jsonl = tmp_path / "rows.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("ANDREA_NVRTC", "CUDA_PATH", "PYTHONPATH")}
    env.update(CUDA_HOME=str(tmp_path / "cuda"), ANDREA_PTX_CACHE=str(tmp_path / "ptx"))
    if pythonpath:
        env["PYTHONPATH"] = str(ROOT)
    args = [str(ROOT / "benchmarks" / "gpu_checks.py"), "--tiny", "--jsonl", str(jsonl)]
    proc = subprocess.run([sys.executable, "-c", BARE_HOST, ",".join(blocked), *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["section"] for r in rows] == SECTIONS, proc.stdout
    status = {r["section"]: r["status"] for r in rows}
    why = {r["section"]: r["detail"] for r in rows}
    assert status["kernel compile"] == "ok", why["kernel compile"]
    assert "NVRTC 13.0, needs" in why["kernel compile"]  # the toolkit's library (a wheel's would name the wheel)
    assert all(status[s] == "SKIP" and why[s] for s in SECTIONS[1:]), proc.stdout
    assert not [r for r in rows if "No module named" in r["detail"]], proc.stdout
    assert why["PyTorch eager"] == "no CUDA GPU visible (torch.cuda.is_available() is False); run this on a GPU host"
    assert why["plugin engine"].startswith("TensorRT is not installed")
    assert why["quantized engines"].startswith("TensorRT is not installed")


# A `tensorrt` of the loading process's own: deserializes a JSON "plan" (its inputs' shapes and each profile's
# min/opt/max), else logs TensorRT's error and returns None; with STUB_TRT_IMPORTS_ANDREA set it imports the package
# on import, as a process where something registered the plugins would hold it.
STUB_TENSORRT = r"""
import enum, json, os

__version__ = "10.13.3.9"
if os.environ.get("STUB_TRT_IMPORTS_ANDREA"):
    import andrea_export.plugin


class TensorIOMode(enum.IntEnum):
    INPUT = 1
    OUTPUT = 2


class ILogger:
    class Severity(enum.IntEnum):
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

    def __init__(self):
        pass


class Engine:
    def __init__(self, spec):
        self.spec = spec
        self.names = [*spec, "logits"]
        self.num_io_tensors = len(self.names)
        self.num_optimization_profiles = len(next(iter(spec.values()))["profiles"])

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_mode(self, name):
        return TensorIOMode.INPUT if name in self.spec else TensorIOMode.OUTPUT

    def get_tensor_shape(self, name):
        return tuple(self.spec[name]["shape"])

    def get_tensor_profile_shape(self, name, profile):
        return [tuple(s) for s in self.spec[name]["profiles"][profile]]


class Runtime:
    def __init__(self, logger):
        self.logger = logger

    def deserialize_cuda_engine(self, data):
        try:
            return Engine(json.loads(data))
        except ValueError:
            self.logger.log(ILogger.Severity.ERROR, "1: Serialization (Magic tag does not match)")
            self.logger.log(ILogger.Severity.ERROR, "4: Internal Error (Engine deserialization failed.)")
            return None
"""

FAKE_TRTEXEC = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls.txt"
case "$1" in *bad.plan) echo "[E] [TRT] 1: Serialization (Magic tag does not match)"; exit 1;; esac
echo "&&&& PASSED TensorRT.trtexec [TensorRT v101303] # trtexec $*"
"""


def _bare_load_fixture(tmp_path, monkeypatch):
    """A plugin build's folder with a good decoder plan (prefill profile: empty past; decode profile) and a bad one,
    and the stub `tensorrt` on PYTHONPATH (the loading process inherits the environment)."""
    stub = tmp_path / "stub" / "tensorrt"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(STUB_TENSORRT)
    monkeypatch.setenv("PYTHONPATH", str(stub.parent))
    out = tmp_path / "build"
    out.mkdir()
    (out / "decoder.plan").write_text(json.dumps({
        "input_ids": {"shape": [1, -1], "profiles": [[[1, 1], [1, 16], [1, 64]], [[1, 1], [1, 1], [1, 1]]]},
        "past": {"shape": [1, 2, -1, 4], "profiles": [[[1, 2, 0, 4]] * 3, [[1, 2, 1, 4], [1, 2, 8, 4], [1, 2, 63, 4]]]},
    }))  # fmt: skip
    (out / "bad.plan").write_bytes(b"\x00 not an engine")
    artifacts = {"decoder_engine": {"path": "decoder.plan"}, "engine": {"path": "bad.plan"},
                 "decoder_onnx": {"path": "decoder.onnx"}}  # fmt: skip
    return out, {"artifacts": artifacts}


def test_bare_load_deserializes_each_plan_where_only_tensorrt_is_imported(tmp_path, monkeypatch):
    """The section's fresh process imports tensorrt and nothing of this package: each .plan of the build is a row (ok
    with its I/O count, FAIL with TensorRT's logged reason); without trtexec a SKIP row says where it looked. A
    process that holds the package (something could have registered the plugins there) is a FAIL row."""
    gc, c = _checks(tmp_path)
    out, manifest = _bare_load_fixture(tmp_path, monkeypatch)
    monkeypatch.setattr(gc.shutil, "which", lambda name: None)
    monkeypatch.setattr(gc, "TRTEXEC_ELSEWHERE", (str(tmp_path / "no-trtexec"),))
    cmd = gc.bare_load_command([out / "decoder.plan"])
    assert cmd[:2] == [sys.executable, "-c"] and cmd[3:] == [str(out / "decoder.plan")]
    imports = {a.name for n in ast.walk(ast.parse(cmd[2])) if isinstance(n, ast.Import) for a in n.names}
    assert imports == {"json", "sys", "tensorrt"} and not [n for n in ast.walk(ast.parse(cmd[2]))
                                                          if isinstance(n, ast.ImportFrom)]  # nothing of ours
    c.results["plugin engine"] = (out, manifest)
    c.section("bare TensorRT load", gc.bare_load, 20, needs=("plugin engine",))
    got = [(r["check"], r["status"], r["detail"]) for r in c.rows]
    where = "TensorRT 10.13.3.9, in a process that imported only tensorrt (nothing registered),"
    assert got == [
        ("bare load decoder.plan", "ok", f"{where} deserialized it: 3 I/O tensors"),
        ("bare load bad.plan", "FAIL", (f"{where} returned no engine: 1: Serialization (Magic tag does not match); "
                                        "4: Internal Error (Engine deserialization failed.)")),
        ("trtexec --loadEngine", "SKIP", (f"trtexec is neither on PATH nor in {tmp_path / 'no-trtexec'} (TensorRT's "
                                          "tar and deb packages have it in their bin folder)")),
    ], got  # fmt: skip
    monkeypatch.setenv("STUB_TRT_IMPORTS_ANDREA", "1")
    gc, c = _checks(tmp_path)
    c.results["plugin engine"] = (out, manifest)
    c.section("bare TensorRT load", gc.bare_load, 20)
    assert (c.rows[0]["check"], c.rows[0]["status"]) == ("bare process", "FAIL")
    detail = c.rows[0]["detail"]
    assert detail.startswith("the loading process imported andrea_export, ") and "andrea_export.plugin" in detail


def test_bare_load_runs_each_plan_in_trtexec_on_a_profile_without_empty_tensors(tmp_path, monkeypatch):
    """Where trtexec is installed, each plan runs once in it: on the first profile whose opt shapes have no empty
    tensor (the decoder's prefill profile has an empty past, so its decode profile), at those shapes (trtexec sets
    dynamic dimensions it is not given to 1). Its exit status is the row's."""
    gc, c = _checks(tmp_path)
    out, manifest = _bare_load_fixture(tmp_path, monkeypatch)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "trtexec").write_text(FAKE_TRTEXEC)
    (bin_dir / "trtexec").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    c.results["plugin engine"] = (out, manifest)
    c.section("bare TensorRT load", gc.bare_load, 20)
    rows = {r["check"]: r for r in c.rows}
    assert rows["trtexec decoder.plan"]["status"] == "ok", rows
    assert rows["trtexec decoder.plan"]["detail"].startswith("--loadEngine, one run (profile=1, its opt shapes): exit 0; "
                                                             "&&&& PASSED TensorRT.trtexec")  # fmt: skip
    assert rows["trtexec bad.plan"]["status"] == "FAIL"
    assert rows["trtexec bad.plan"]["detail"].endswith("exit 1; [E] [TRT] 1: Serialization (Magic tag does not match)")
    calls = (bin_dir / "calls.txt").read_text().splitlines()
    assert calls == [(f"--loadEngine={out / 'decoder.plan'} --iterations=1 --warmUp=0 --duration=0 --profile=1 "
                      "--shapes=input_ids:1x1,past:1x2x8x4"),
                     f"--loadEngine={out / 'bad.plan'} --iterations=1 --warmUp=0 --duration=0"]  # fmt: skip
    assert gc.trtexec_command("trtexec", out / "p.plan", [{"input_ids": [2, 64]}])[-2:] == [
        "--profile=0", "--shapes=input_ids:2x64"]  # the prefill engine: one profile


def test_the_slot_mixed_steps_section_passes_the_stand_in_engine_and_fails_one_whose_mixed_steps_are_off(
        slot_build, stand_ins, tmp_path, monkeypatch):
    """The section a GPU host runs on its slot engine, here on the stand-ins (tests/conftest.py's slot_build): a
    batcher's runs replayed on ONNX Runtime agree; an engine whose steps with the chunk among the decoding rows
    are off by 0.2 (every logit of the chunk, the top token unchanged) fails that row and only that one."""
    from andrea_export.runtime import trt_slots

    manifest = json.loads((slot_build / "manifest.json").read_text())

    def section():
        gpu_checks, c = _checks(tmp_path, budget=300)
        c.results["slot engine"] = (slot_build, manifest)
        c.section("slot mixed steps", gpu_checks.slot_mixed_steps, 1, needs=("slot engine",))
        return [(r["check"], r["status"]) for r in c.rows], c.rows

    got, rows = section()
    assert got == [("chunk among the rows", "ok"), ("every other run", "ok")], rows
    assert " 0 outside, 0 with another top token" in rows[0]["detail"]
    real = trt_slots.TrtSlotCache.run

    def off(self, group, chunk=None):
        logits, chunk_logits = real(self, group, chunk)
        if chunk is not None and group[0] <= chunk[0] < group[0] + len(group[1]):
            chunk_logits = chunk_logits + 0.2
        return logits, chunk_logits

    monkeypatch.setattr(trt_slots.TrtSlotCache, "run", off)
    got, rows = section()
    assert got == [("chunk among the rows", "FAIL"), ("every other run", "ok")], rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: run benchmarks/gpu_checks.py itself")
def test_gpu_checks_with_numpy_alone_skips_what_needs_pytorch(tmp_path):
    """A host with numpy but no PyTorch (nor onnx): each section that needs PyTorch is a SKIP row saying so, none a
    FAIL with a traceback (the model's module imports torch: a section asks for PyTorch before it)."""
    blocked = [*_bare_host_modules(), "torch", "onnx", "onnxruntime"]
    jsonl = tmp_path / "rows.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [str(ROOT / "benchmarks" / "gpu_checks.py"), "--tiny", "--jsonl", str(jsonl),
            "--only", "PTX load,PyTorch eager"]
    proc = subprocess.run([sys.executable, "-c", BARE_HOST, ",".join(blocked), *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr[-3000:]
    rows = {r["section"]: r for r in map(json.loads, jsonl.read_text().splitlines())}
    for section in ("PTX load", "PyTorch eager"):
        assert rows[section]["status"] == "SKIP" and rows[section]["detail"].startswith("needs PyTorch"), rows[section]
