"""The pure-Python `tensorrt.plugin` of NVIDIA's TensorRT bindings wheels, for the tests: downloaded once with
pip into the user's cache (~/.cache/andrea-export/tensorrt-plugin, or $ANDREA_TRT_PLUGIN_CACHE), of which
only `tensorrt_bindings/plugin/*.py` is kept. Nothing of it is in this repository. Without PyPI the tests
that need it skip and say so."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

# The oldest is on the cu12 line only (the cu13 bindings start at 10.13); the newest on both.
TRT_PLUGIN_WHEELS = {"10.9.0.34": "tensorrt-cu12-bindings", "11.4.0.106": "tensorrt-cu13-bindings"}


def _cache_root() -> Path:
    from andrea_export.folder.atomic import cache_dir

    return cache_dir("tensorrt-plugin", override="ANDREA_TRT_PLUGIN_CACHE")


def plugin_sources(version: str) -> Path:
    """<cache>/<version>/tensorrt (holding plugin/*.py from the bindings wheel), downloaded when missing."""
    dist = TRT_PLUGIN_WHEELS[version]
    root = _cache_root() / version
    if (root / "tensorrt" / "plugin" / "_lib.py").is_file():
        return root / "tensorrt"
    with tempfile.TemporaryDirectory(prefix="andrea-trt-wheel-") as d:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-q", "-d", d, f"{dist}=={version}"]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.skip(f"pip download {dist}=={version} timed out (needs PyPI)")
        wheels = list(Path(d).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            why = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
            pytest.skip(f"pip could not download {dist}=={version}, whose tensorrt.plugin these tests run (needs PyPI): {why}")
        staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=_mkdir(_cache_root())))
        with zipfile.ZipFile(wheels[0]) as z:
            for name in z.namelist():
                if name.startswith("tensorrt_bindings/plugin/") and name.endswith(".py"):
                    out = staging / "tensorrt" / "plugin" / Path(name).name
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(z.read(name))
        try:
            staging.rename(root)
        except OSError:  # another process finished first
            shutil.rmtree(staging, ignore_errors=True)
    return root / "tensorrt"


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p
