"""mypy over the whole package, with pyproject.toml's [tool.mypy] settings, finds no error: the types editors
show (the face's TYPE_CHECKING block included) are the ones the code keeps, also where no test here can run
the code (the TensorRT paths of a GPU host)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install 'andrea-export[dev]')")
def test_mypy_passes_on_the_package():
    # the cache is the checkout's own .mypy_cache (git ignores it): a warm run takes seconds, a cold one about 40 s
    proc = subprocess.run([sys.executable, "-m", "mypy", "andrea_export", "--cache-dir", str(ROOT / ".mypy_cache")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no issues found" in proc.stdout
