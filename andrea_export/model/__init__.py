"""The PyTorch reference model (andrea.py), its checkpoints in both layouts (checkpoint.py), GPT-2's names and
config.json (gpt2.py), the text corpus and tokenizer (text.py) and the trained demo (demo.py)."""

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "andrea": ["Andrea"],
    "checkpoint": ["checkpoint_sha256", "load_checkpoint", "load_model", "model_for", "random_init", "save_checkpoint"],
    "gpt2": ["hf_config", "read_hf_config"],
})
