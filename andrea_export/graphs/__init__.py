"""Everything that writes or reads an ONNX graph: export, the KV-cache and in-place decoders, precision,
quantization, the plugin graph pass, the shared weights file, and the torch-free graph readers (layout.py)."""
