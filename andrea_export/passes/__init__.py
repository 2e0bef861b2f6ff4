"""Graph passes on exported ONNX files. Each pass is a function usable from Python; the CLI calls them."""

from .gelu_plugin import GeluPluginReport, apply_gelu_plugin

__all__ = ["GeluPluginReport", "apply_gelu_plugin"]
