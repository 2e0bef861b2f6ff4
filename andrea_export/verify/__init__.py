"""Verification against the PyTorch reference: Polygraphy comparisons (compare.py) and the language-model
figures and greedy agreement of the KV-cache decoders (agreement.py)."""
