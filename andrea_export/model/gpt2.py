"""GPT-2's side of the model: its tensor names and Conv1D layout, and its `config.json` read into a
ModelConfig (read, not guessed, and refused where it describes another function) or written from one.

refused where it describes another function), and write a folder Optimum's `ORTModelForCausalLM` loads.

Reading: every GPT2Config field that changes what the model computes is either mapped or checked.
ANDREA is GPT-2's computation with tanh-GELU and a tied head, so:
  - n_head, n_positions, n_embd, n_layer, vocab_size, layer_norm_epsilon are mapped;
  - activation_function must be a tanh-GELU (`gelu_new`, `gelu_pytorch_tanh`); erf `gelu` and the rest
    are refused: exporting them as tanh would change every output without a word;
  - n_inner must be 4 * n_embd (or null), scale_attn_weights true, scale_attn_by_inverse_layer_idx and
    add_cross_attention false;
  - an untied head (`tie_word_embeddings: false`) is refused unless its weights equal the embedding
    (checked in checkpoint.py): ANDREA's output projection *is* the token embedding (spec), every graph,
    engine and the plugin's fused GEMMs are built that way, and an untied head would add a second
    vocab x width matrix (6.5 M parameters at full size) to a model defined without one.
"""


from __future__ import annotations

import json
import re
from pathlib import Path

from ..config import ModelConfig, safe_name
from ..errors import CheckpointError
from ..userfiles import MAX_CONFIG_BYTES, read_json

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")  # [in, out] in GPT-2
HF_IGNORED = re.compile(r"^h\.\d+\.attn\.(masked_)?bias$")  # causal-mask buffers in old GPT-2 files
HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")


def read_hf_config(path: str | Path, name: str | None = None) -> tuple[ModelConfig, bool]:
    """(ModelConfig, tied) from a GPT-2 `config.json`; CheckpointError for anything ANDREA cannot compute."""
    path = Path(path)
    data = read_json(path, MAX_CONFIG_BYTES, "a model config.json", CheckpointError)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    model_type = data.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise CheckpointError(f"{path}: model_type {model_type!r}; ANDREA reads GPT-2 checkpoints only (model_type 'gpt2')")
    act = data.get("activation_function", "gelu_new")
    if act not in TANH_GELU:
        raise CheckpointError(
            f"{path}: activation_function {act!r} is not the tanh-GELU ANDREA computes ({', '.join(TANH_GELU)}); "
            "exporting it as tanh-GELU would silently change the model, so it is refused"
        )
    n_embd = data.get("n_embd", 768)
    checks = [
        ("n_inner", data.get("n_inner"), (None, 4 * n_embd) if isinstance(n_embd, int) else (None,)),
        ("scale_attn_weights", data.get("scale_attn_weights", True), (True,)),
        ("scale_attn_by_inverse_layer_idx", data.get("scale_attn_by_inverse_layer_idx", False), (False,)),
        ("add_cross_attention", data.get("add_cross_attention", False), (False,)),
    ]
    for key, value, allowed in checks:
        if value not in allowed:
            raise CheckpointError(f"{path}: {key} = {json.dumps(value)} is not supported by ANDREA's GPT-2 block "
                                  f"(it computes {' or '.join(json.dumps(a) for a in allowed)})")
    fields = {"vocab_size": data.get("vocab_size", 50257), "n_embd": n_embd, "n_layer": data.get("n_layer", 12),
              "n_head": data.get("n_head", 12), "n_positions": data.get("n_positions", 1024),
              "layer_norm_eps": data.get("layer_norm_epsilon", 1e-5)}
    tied = data.get("tie_word_embeddings", True)
    if not isinstance(tied, bool):
        raise CheckpointError(f"{path}: tie_word_embeddings must be true or false, got {tied!r}")
    try:
        return ModelConfig(name=safe_name(name or path.parent.name or "gpt2"), **fields), tied
    except Exception as e:  # ConfigError (bad value) or TypeError (a string where a number belongs)
        raise CheckpointError(f"{path}: {e}") from None


def hf_config(cfg: ModelConfig, eos_token_id: int | None = None) -> dict:
    """A GPT-2 `config.json` describing `cfg` (transformers' GPT2Config fields)."""
    eos = cfg.vocab_size - 1 if eos_token_id is None else eos_token_id  # GPT-2's convention: the last id
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.n_positions,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,  # inference graph: no dropout
    }
