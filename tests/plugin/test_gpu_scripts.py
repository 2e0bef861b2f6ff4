"""The GPU-side scripts at least compile here and say clearly why they cannot run without a GPU."""

import io
import json
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
            "plugin engine", "native engine", "plugin vs native", "TensorRT vs PyTorch", "session reload",
            "quantized engines"]  # fmt: skip


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
    assert why["native engine"] == "needs plugin engine (SKIP)"
    if not __import__("andrea_export.errors", fromlist=["installed"]).installed("tensorrt"):
        assert why["plugin engine"].startswith("TensorRT is not installed (pip install 'andrea-export[tensorrt]')")


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
