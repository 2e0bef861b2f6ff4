"""A folder Hugging Face Optimum's `ORTModelForCausalLM` loads and generates from, and transformers' GPT-2
of our weights.

`write_hf_folder`: the KV-cache decoder graph as `model.onnx` (its I/O is Optimum's GPT-2 I/O:
input_ids, attention_mask, past_key_values.{i}.key/value -> logits, present.{i}.key/value), a GPT-2
`config.json` and `generation_config.json`. The graph has no `position_ids` input (positions come from the
attention mask inside it), which Optimum accepts with a "legacy model" warning and which keeps
left-padded batches right.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ExportError
from ..model.gpt2 import CONV1D, GENERATION_CONFIG, HF_CONFIG, hf_config


def write_hf_folder(model, out: str | Path, *, eos_token_id: int | None = None, tokenizer: str | Path | None = None,
                    quiet: bool = False) -> Path:
    """`out/` with model.onnx (the KV-cache decoder graph), config.json and generation_config.json:
    `optimum.onnxruntime.ORTModelForCausalLM.from_pretrained(out)` loads it and generates. With `tokenizer`
    (a tokenizer.json) also tokenizer.json and tokenizer_config.json: `AutoTokenizer.from_pretrained(out)`.
    Assembled in a staging folder and moved in whole."""
    from ..folder.atomic import staging
    from ..graphs.kvcache import export_decoder_onnx

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty folder; choose another --hf-folder")
    conf = hf_config(model.cfg, eos_token_id)
    gen = {"bos_token_id": conf["bos_token_id"], "eos_token_id": conf["eos_token_id"],
           "pad_token_id": conf["eos_token_id"], "do_sample": False, "max_length": model.cfg.n_positions}
    with staging(out, marker_suffix=HF_CONFIG) as tmp:
        export_decoder_onnx(model, tmp / "model.onnx", quiet=quiet)
        (tmp / HF_CONFIG).write_text(json.dumps(conf, indent=2) + "\n", encoding="utf-8")
        (tmp / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
        if tokenizer is not None:
            from ..model.text import write_tokenizer_files

            write_tokenizer_files(tokenizer, tmp, model.cfg.n_positions)
    return out


def to_transformers(model):
    """transformers' GPT2LMHeadModel holding `model`'s weights (config from `hf_config`): the model a
    Hugging Face user would export with Optimum. Our Linear weights are [out, in]; GPT-2's Conv1D is
    [in, out]."""
    from ..errors import require

    transformers = require("transformers", "hf", "a Hugging Face GPT-2 of these weights")
    conf = {k: v for k, v in hf_config(model.cfg).items() if k != "architectures"}
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**conf)).eval()
    state = {f"transformer.{k}": (v.t() if k.endswith(CONV1D) else v).contiguous()
             for k, v in model.state_dict().items()}  # fmt: skip
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:  # the head is tied to wte
        raise ExportError(f"GPT-2 layout mismatch: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf
