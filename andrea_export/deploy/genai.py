"""onnxruntime-genai: the `genai_config.json` that lets `onnxruntime_genai.Model(build_dir)` run our
KV-cache decoder graph as it is (C, C++, C#, Java, Python; CPU, CUDA, DirectML, TensorRT-RTX).

Everything in the config is read from the decoder graph (its I/O and its `andrea.config` /
`andrea.kv_layout` metadata), never typed in by hand. The settings, and why (onnxruntime-genai 0.18,
src/config.h, src/models/model.cpp, kv_cache.cpp, position_inputs.cpp):

- `model.type` = "decoder": the generic decoder-only model (`ModelType::IsLLM`), which reads
  `past_key_values.%d.key|value` -> `present.%d.key|value` as separate tensors, exactly our layout.
  "gpt2" would be wrong despite the architecture: genai's `Gpt_Model` expects one combined cache
  tensor per layer (`past_%d`, [2, batch, heads, past, head_dim]).
- Inputs `input_ids`, `attention_mask` (int64, 1 = real token). No `position_ids`: genai feeds it only
  when the graph has that input (`HasInput`); our graphs derive positions from the mask.
- `search.past_present_share_buffer` follows the graph. The in-place decoder (graphs/inplace_decoder.py, what
  a build points genai at) writes its cache in place with GroupQueryAttention: true, and genai allocates
  the cache once at max_length, as for its own models. A batch of prompts of different lengths is then
  padded on the RIGHT (GroupQueryAttention's rule; left-padded rows decode wrongly). The standard decoder
  concatenates past + new, so present is one token longer than past each step: false, left padding.
  Graph capture (`enable_cuda_graph`) is turned off in the provider options written here: the build's
  in-place graph is float32, for which ONNX Runtime's CUDA GroupQueryAttention has no kernels.
- `eos/bos/pad_token_id`: genai requires an end token inside the vocabulary. A tokenizer, when the
  build has one, says which; without one the GPT-2 convention (the last id) is used (docs/deploying.md
  says so). A generation that produces it stops there, as in any genai model.
- Tokenizer: genai reads `tokenizer.json` / `tokenizer_config.json` from the folder of the config
  (`model.tokenizer_dir` empty); `tokenizer_files` below copies them in (hook for the text extra).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from ..catalog import TABLE, Role
from ..errors import ExportError
from ..folder.atomic import write_text_atomic

GENAI_CONFIG = TABLE[Role.GENAI_CONFIG].file
MODEL_TYPE = "decoder"
# genai provider names (config.cpp NormalizeProviderName) -> the options that fit our decoder graph.
PROVIDERS = {
    "cpu": None,
    "cuda": {"enable_cuda_graph": "0"},
    "NvTensorRtRtx": {"enable_cuda_graph": "0"},  # ONNX Runtime's TensorRT-RTX execution provider
    "dml": {"enable_graph_capture": "0"},
}


def genai_config(decoder_onnx: str | Path, *, eos_token_id: int | list[int] | None = None,
                 bos_token_id: int | None = None, pad_token_id: int | None = None,
                 provider: str = "cpu") -> dict:
    """The genai_config.json content for `decoder_onnx` (a graph made by kvcache.export_decoder_onnx or
    inplace_decoder.export_inplace_decoder, in any precision), which must lie in the folder the config
    is written to.

    Args:
        eos_token_id: end token id(s); default: the tokenizer's, else the last id (GPT-2's convention).
        bos_token_id, pad_token_id: default: the first end token.
        provider: "cpu" (none listed: genai's default), "cuda", "NvTensorRtRtx" or "dml".
    """
    from ..graphs.layout import read_decoder

    decoder_onnx = Path(decoder_onnx)
    cfg, layout = read_decoder(decoder_onnx)  # one check; the graph's I/O is exactly the recorded layout
    if provider not in PROVIDERS:
        raise ExportError(f"unknown onnxruntime-genai provider {provider!r}; choose one of {', '.join(PROVIDERS)}")
    if layout.shared and layout.cache_dtype == "float32" and provider != "cpu":
        raise ExportError(f"{decoder_onnx.name}: a float32 in-place decoder runs on genai's cpu provider only (ONNX "
                          f"Runtime's GPU GroupQueryAttention has no float32 kernels); for {provider} write the "
                          "config for the build's decoder.onnx")
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [cfg.vocab_size - 1])
    for name, ids in (("eos_token_id", eos), ("bos_token_id", [bos_token_id]), ("pad_token_id", [pad_token_id])):
        for i in ids:
            if i is not None and not (isinstance(i, int) and 0 <= i < cfg.vocab_size):
                raise ExportError(f"{name} {i!r} is outside the vocabulary [0, {cfg.vocab_size})")
    options = PROVIDERS[provider]
    return {
        "model": {
            "type": MODEL_TYPE,
            "vocab_size": cfg.vocab_size,
            "context_length": cfg.n_positions,
            "eos_token_id": eos if len(eos) > 1 else eos[0],
            "bos_token_id": eos[0] if bos_token_id is None else bos_token_id,
            "pad_token_id": eos[0] if pad_token_id is None else pad_token_id,
            "decoder": {
                "filename": decoder_onnx.name,
                "session_options": {"log_id": "onnxruntime-genai",
                                    "provider_options": [{provider: options}] if options is not None else []},
                "hidden_size": cfg.n_embd,
                "num_attention_heads": layout.n_head,
                "num_key_value_heads": layout.n_head,  # multi-head attention: one KV head per query head
                "head_size": layout.head_dim,
                "num_hidden_layers": layout.n_layer,
                "inputs": {
                    "input_ids": layout.inputs[0].name,
                    "attention_mask": layout.inputs[1].name,
                    "past_key_names": _template(layout.past_names[0]),
                    "past_value_names": _template(layout.past_names[1]),
                },
                "outputs": {
                    "logits": layout.outputs[0].name,
                    "present_key_names": _template(layout.present_names[0]),
                    "present_value_names": _template(layout.present_names[1]),
                },
            },
        },
        "search": {
            "max_length": cfg.n_positions,
            "min_length": 0,
            "do_sample": False,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": layout.shared,
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
            "repetition_penalty": 1.0,
            "length_penalty": 1.0,
            "early_stopping": True,
            "no_repeat_ngram_size": 0,
            "diversity_penalty": 0.0,
        },
    }


def _template(layer0_name: str) -> str:
    """`past_key_values.0.key` -> `past_key_values.%d.key` (genai's printf pattern over layers)."""
    head, sep, tail = layer0_name.partition(".0.")
    if not sep:
        raise ExportError(f"cache tensor name {layer0_name!r} has no layer index '.0.'")
    return f"{head}.%d.{tail}"


def write_genai_config(decoder_onnx: str | Path, *, tokenizer_files: Sequence[str | Path] = (), **kwargs) -> Path:
    """Write genai_config.json beside `decoder_onnx` (atomically) and copy `tokenizer_files`
    (tokenizer.json, tokenizer_config.json) into the same folder. Returns the config's path."""
    decoder_onnx = Path(decoder_onnx)
    config = genai_config(decoder_onnx, **kwargs)
    for f in tokenizer_files:
        f = Path(f)
        if f.resolve().parent != decoder_onnx.resolve().parent:
            shutil.copyfile(f, decoder_onnx.parent / f.name)
    path = decoder_onnx.parent / GENAI_CONFIG
    write_text_atomic(path, json.dumps(config, indent=2) + "\n")
    return path
