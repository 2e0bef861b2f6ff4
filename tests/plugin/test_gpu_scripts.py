"""The GPU-side scripts at least compile here and say clearly why they cannot run without a GPU."""

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


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: run benchmarks/gpu_checks.py itself")
def test_gpu_checks_without_gpu_says_why():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_checks.py")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "gpu_checks: no CUDA GPU visible (torch.cuda.is_available() is False); run this on a GPU host"
    )


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit)")
def test_kernel_lab_builds(tmp_path):
    src = ROOT / "plugins" / "gelu_tanh" / "gelu_tanh_lab.cu"
    proc = subprocess.run(["nvcc", "-O3", "-std=c++17", "-arch=sm_90", "-o", str(tmp_path / "lab"), str(src)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
