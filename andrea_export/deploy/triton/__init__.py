"""Triton Inference Server model repositories from a build folder: the stateless model (stateless.py) and the
KV-cache decoder as a stateful model (stateful.py)."""
