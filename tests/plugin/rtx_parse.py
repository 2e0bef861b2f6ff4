"""Run in a subprocess by test_rtx_parser.py: parse a plugin graph with TensorRT-RTX's ONNX parser (the same
onnx-tensorrt code as TensorRT's), with or without our plugin creators in RTX's own plugin registry.

    python rtx_parse.py GRAPH.onnx PLUGIN_PACKAGE [--register]

With --register, register_plugins() runs the real tensorrt.plugin (PLUGIN_PACKAGE: the bindings wheel's
plugin folder) over `tensorrt_rtx` itself, which has the quick-plugin classes, the registry and the
expression builder; RTX lacks only the AOT-only names (QuickPluginCreationRequest, ISymExpr,
IPluginV3QuickAOTBuild), taken from trt_standin. So the creators in RTX's registry are real
IPluginCreatorV3Quick objects. A subprocess, because they stay registered for the life of the process.
Prints one JSON object: whether it parsed, the parser's errors, the log lines about plugins, the layers."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import tensorrt_rtx as rtx

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # trt_standin, trt_enums


def hybrid(package: Path, version: str) -> types.ModuleType:
    import trt_standin

    class Tensorrt(types.ModuleType):
        def __getattr__(self, name: str):
            return getattr(rtx, name)

    mod = Tensorrt("tensorrt")
    mod.__path__ = [str(package)]
    mod.__version__ = version  # register.py asks for TensorRT >= 10.9: the version of the plugin package in use
    for name in ("QuickPluginCreationRequest", "ISymExpr", "IPluginV3QuickAOTBuild"):
        assert not hasattr(rtx, name), f"tensorrt_rtx now has {name}: use it"
        setattr(mod, name, getattr(trt_standin, name))
    return mod


def main() -> None:
    graph, package = Path(sys.argv[1]), Path(sys.argv[2])
    registered: list[str] = []
    if "--register" in sys.argv:
        sys.modules["tensorrt"] = hybrid(package, package.parent.name)
        from andrea_export.plugin.register import register_plugins

        register_plugins()
        registered = sorted(f"{c.plugin_namespace}::{c.name}" for c in rtx.get_plugin_registry().all_creators
                            if c.plugin_namespace == "andrea")  # fmt: skip

    log: list[str] = []

    class Logger(rtx.ILogger):
        def __init__(self) -> None:
            rtx.ILogger.__init__(self)

        def log(self, severity, msg) -> None:  # noqa: ANN001
            if "plugin" in msg.lower():
                log.append(msg.strip())

    logger = Logger()
    builder = rtx.Builder(logger)
    network = builder.create_network(1 << int(rtx.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = rtx.OnnxParser(network, logger)
    parsed = parser.parse_from_file(str(graph))
    errors = [f"{parser.get_error(i).node_name()}: {parser.get_error(i).desc()}" for i in range(parser.num_errors)]
    gelu = 0
    layers = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        layers.append(str(layer.type))
        if layer.type == rtx.LayerType.ACTIVATION:
            layer.__class__ = rtx.IActivationLayer
            gelu += layer.type == rtx.ActivationType.GELU_TANH
    print(json.dumps({"registered": registered, "parsed": bool(parsed), "errors": errors, "log": log,
                      "gelu_tanh_layers": gelu, "plugin_layers": sum("PLUGIN" in t for t in layers)}))  # fmt: skip


if __name__ == "__main__":
    main()
