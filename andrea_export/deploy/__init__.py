"""Deployment artifacts: Triton Inference Server repositories (triton/), onnxruntime-genai's config (genai.py)."""
