"""The ONNX parser picks our plugin: TensorRT-RTX's parser (onnx-tensorrt, as in TensorRT) with our
creators registered in its plugin registry imports an `andrea.TanhGelu` call as the plugin ("Found
registered plugin") and only then stops, because RTX takes V3 plugins from IPluginCreatorV3One creators
only; without them it imports the model-local function's body as a native GELU_TANH activation.
Each case runs in a subprocess (rtx_parse.py): registered creators stay for the life of a process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from trt_plugin_wheel import plugin_sources

from andrea_export.config import ANDREA_TINY
from andrea_export.graphs.gelu_plugin import apply_gelu_plugin

pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'andrea-export[rtx]')")
HERE = Path(__file__).resolve().parent
NEWEST = "11.4.0.106"  # the tensorrt.plugin whose classes run over tensorrt_rtx (RTX 1.7 is TensorRT 11-based)


def _parse(graph: Path, register: bool) -> dict:
    cmd = [sys.executable, str(HERE / "rtx_parse.py"), str(graph), str(plugin_sources(NEWEST))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd + (["--register"] if register else []), capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fuse_bias", [False, True], ids=["TanhGelu", "TanhGeluBias"])
def test_parser_imports_our_plugin_when_registered(tiny_onnx, tmp_path, fuse_bias):
    report = apply_gelu_plugin(tiny_onnx, tmp_path / "plugin.onnx", fuse_bias=fuse_bias)
    op = "TanhGeluBias" if fuse_bias else "TanhGelu"
    first = next(n.name for n in onnx.load(str(report.path), load_external_data=False).graph.node if n.op_type == op)
    r = _parse(report.path, register=True)
    assert r["registered"] == ["andrea::TanhGelu", "andrea::TanhGeluBias"]
    assert f"Found registered plugin: {op}. Importing this node as a plugin." in r["log"]
    assert f"Searching for plugin: {op}, plugin_version: 1, plugin_namespace: andrea" in r["log"]
    # ...and then RTX refuses quick (V3Quick) creators; the parser stops at the first call
    assert not r["parsed"] and r["errors"] == [
        f"{first}: Assertion failed: false: TensorRT-RTX imports IPluginV3 plugins registered with an "
        "IPluginCreatorV3One creator only."
    ]
    assert r["gelu_tanh_layers"] == 0  # the call was not expanded into its function body


def test_parser_expands_the_function_without_our_creators(tiny_onnx, tmp_path):
    report = apply_gelu_plugin(tiny_onnx, tmp_path / "plugin.onnx")
    r = _parse(report.path, register=False)
    assert r["registered"] == [] and r["parsed"] and r["errors"] == []
    assert not [line for line in r["log"] if line.startswith("Found registered plugin")]
    assert r["gelu_tanh_layers"] == ANDREA_TINY.n_layer and r["plugin_layers"] == 0
