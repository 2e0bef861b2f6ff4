"""A wheel of this project carries the kernel sources: built with pip from a copy of the checkout, installed
with --no-deps into a fresh venv (no andrea-export on its path but the wheel's), where the kernel must
compile from the installed package. NVRTC is the one compile dependency; the fresh venv borrows this
environment's libnvrtc through ANDREA_NVRTC instead of downloading the wheel again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import numpy as np
import pytest

from andrea_export.plugin.compile import find_nvrtc

ROOT = Path(__file__).resolve().parents[2]
KERNEL_FILES = sorted(p.name for p in (ROOT / "plugins" / "gelu_tanh").iterdir() if p.is_file())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel` of a copy of the checkout (the build writes build/ and *.egg-info into its source tree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", ".pytest_cache", ".mypy_cache")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name if src.exists() else _mk(src) / name)
    for name in ("andrea_export", "plugins"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-q", "-w", str(tmp / "dist"), str(src)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = (tmp / "dist").glob("andrea_export-*.whl")
    return whl


def _mk(p: Path) -> Path:
    p.mkdir(parents=True)
    return p


def test_wheel_holds_every_module_and_the_kernel_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "andrea_export").rglob("*.py")}
    assert modules <= names, sorted(modules - names)  # the explicit package list in pyproject.toml is complete
    assert {f"andrea_export/_kernels/{f}" for f in KERNEL_FILES} <= names


def test_kernel_compiles_from_the_installed_wheel(wheel, tmp_path):
    nvrtc = find_nvrtc()
    if nvrtc is None:
        pytest.skip("NVRTC is not installed here (pip install 'nvidia-cuda-nvrtc==13.0.88')")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "--disable-pip-version-check", "-q", str(wheel)], capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    code = (
        f"import sys; sys.path.append({str(Path(np.__file__).parents[1])!r}); "  # numpy, after the wheel's site
        "import json; from andrea_export.plugin.compile import compile_ptx, kernel_source_path; "
        "from andrea_export.plugin.host_emulation import _harness; "
        "k = compile_ptx('sm_80', use_cache=False); "
        "print(json.dumps({'source': str(kernel_source_path()), 'harness': str(_harness()), "
        "'entries': list(k.entry_points), 'isa': k.ptx_isa}))"
    )
    env = {"PATH": "/usr/bin:/bin", "ANDREA_NVRTC": str(nvrtc), "HOME": str(tmp_path)}  # no PYTHONPATH: the wheel only
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    site = next((env_dir / "lib").glob("python3*/site-packages"))
    assert Path(out["source"]) == site / "andrea_export" / "_kernels" / "gelu_tanh.cu"
    assert Path(out["harness"]) == site / "andrea_export" / "_kernels" / "host_emulation.cpp"  # as host_emulation finds it
    assert Path(out["harness"]).is_file()
    assert out["entries"] == ["gelu_tanh_f32", "gelu_tanh_f16", "gelu_tanh_bf16",
                              "gelu_tanh_bias_f32", "gelu_tanh_bias_f16", "gelu_tanh_bias_bf16"]  # fmt: skip
