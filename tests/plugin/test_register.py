"""TensorRT registration: importable without TensorRT, a clear error when it is missing, and mypy-clean."""

import importlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from andrea_export.errors import MissingDependency

ROOT = Path(__file__).resolve().parents[2]


def test_import_needs_no_tensorrt():
    code = (
        "import sys, andrea_export.plugin.register as r; "
        "assert 'tensorrt' not in sys.modules and 'tensorrt.plugin' not in sys.modules; "
        "print(r.PLUGIN_IDS)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "('andrea::TanhGelu', 'andrea::TanhGeluBias')"


def test_register_without_tensorrt_raises_missing_dependency():
    from andrea_export.plugin.register import register_plugins

    try:
        trt = importlib.import_module("tensorrt")
    except ImportError as e:
        why = str(e)
    else:  # tensorrt-stubs alone leaves a namespace package 'tensorrt' that imports but is empty
        if hasattr(trt, "__version__"):
            pytest.skip(f"TensorRT {trt.__version__} is installed here")
        why = f"'tensorrt' at {list(trt.__path__)} is not TensorRT (no __version__)"
    with pytest.raises(MissingDependency) as err:
        register_plugins()
    assert str(err.value) == (
        "Registering the tanh-GELU TensorRT plugins needs TensorRT >= 10.9, whose Python module 'tensorrt' "
        f"could not be imported ({why}). Install TensorRT on a GPU host (pip install 'andrea-export[tensorrt]'), "
        "or build the standard-Gelu engine instead"
    )


@pytest.mark.skipif(shutil.which("mypy") is None and importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (pip install 'andrea-export[dev]')")  # fmt: skip
def test_mypy_plugin_modules():
    # --ignore-missing-imports: tensorrt-stubs 10.13.0.35.1 ships no py.typed marker and its
    # tensorrt_bindings/tensorrt.pyi has syntax errors (a parameter named `in`, a non-default parameter
    # after defaults), so mypy cannot read it; tensorrt.plugin has no stubs at all.
    files = [str(ROOT / "andrea_export" / "plugin" / f) for f in
             ("register.py", "compile.py", "reference.py", "host_emulation.py")]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--python-version", "3.10", "--ignore-missing-imports",
         "--follow-imports=silent", "--check-untyped-defs", "--no-incremental", *files],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
