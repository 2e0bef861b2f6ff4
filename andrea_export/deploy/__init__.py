"""What serving needs from a build folder: Triton Inference Server repositories (triton/), onnxruntime-genai's
`genai_config.json` (genai.py), a folder Hugging Face Optimum loads (optimum.py), and a GGUF file for llama.cpp
(gguf.py)."""

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "triton": ["package", "write_triton_decoder", "write_triton_repo"],
    "genai": ["genai_config", "write_genai_config"],
    "optimum": ["to_transformers", "write_hf_folder"],
    "gguf": ["write_gguf"],
})
