"""Everything that writes or reads an ONNX graph: export, the KV-cache and in-place decoders, precision,
quantization, the plugin graph pass, the shared weights file, and the torch-free graph readers (layout.py)."""

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "layout": ["KVLayout", "check_decoder_onnx", "check_onnx", "kv_layout", "read_decoder", "read_decoder_meta",
               "read_kv_layout"],
    "export": ["export_onnx", "op_counts"],
    "kvcache": ["export_decoder_onnx", "optimization_profiles"],
    "inplace_decoder": ["export_inplace_decoder"],
    "precision": ["PRECISIONS", "convert_precision", "graph_precision"],
    "quantize": ["Int4Weights", "choose_int4", "quantize_weights", "solve_int4", "write_qdq"],
    "gelu_plugin": ["GeluPluginReport", "apply_gelu_plugin"],
    "external_data": ["external_data_files", "graph_weights", "share_weights"],
})
