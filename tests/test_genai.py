"""onnxruntime-genai runs the build folder's decoder as it is: its greedy tokens equal our runtime's,
token for token, on the lively tiny model (whose output varies), fp32 and fp16."""

import json

import pytest

from andrea_export import runtime
from andrea_export.errors import ExportError
from andrea_export.genai import GENAI_CONFIG, genai_config, write_genai_config

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai (the 'genai' extra)")

PROMPT = [5, 17, 300, 42, 7, 99, 1000, 3]
N = 64


def _genai_greedy(folder, prompt, n):
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    out = []
    while not gen.is_done():
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out


def test_build_writes_genai_config_for_its_decoder(lively_build):
    manifest = json.loads((lively_build / "manifest.json").read_text())
    assert manifest["artifacts"]["genai_config"]["path"] == GENAI_CONFIG
    conf = json.loads((lively_build / GENAI_CONFIG).read_text())
    dec = conf["model"]["decoder"]
    assert dec["filename"] == manifest["artifacts"]["decoder_onnx"]["path"]
    assert (conf["model"]["type"], conf["model"]["vocab_size"], conf["model"]["context_length"]) == ("decoder", 8449, 128)
    assert (dec["num_hidden_layers"], dec["num_attention_heads"], dec["head_size"], dec["hidden_size"]) == (2, 4, 16, 64)
    assert dec["inputs"] == {"input_ids": "input_ids", "attention_mask": "attention_mask",
                             "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    assert dec["outputs"] == {"logits": "logits", "present_key_names": "present.%d.key",
                              "present_value_names": "present.%d.value"}
    assert conf["search"]["past_present_share_buffer"] is False


def test_genai_greedy_equals_ours_from_the_build_folder(lively_build):
    with runtime.load(lively_build, "onnxruntime") as sess:
        ours = sess.generate(PROMPT, N)
    assert len(set(ours)) > 10  # the lively model's output varies: agreement is not trivial
    assert 8448 not in ours  # the default end token (last id) is not produced, so genai runs all N steps
    assert _genai_greedy(lively_build, PROMPT, N) == ours


def test_genai_greedy_equals_ours_fp16(lively_decoder, tmp_path):
    from andrea_export.precision import convert_precision

    dec = convert_precision(lively_decoder, tmp_path / "decoder.fp16.onnx", "fp16")
    write_genai_config(dec)
    with runtime.load(dec, "onnxruntime") as sess:
        ours = sess.generate(PROMPT, N)
    assert len(set(ours)) > 10
    assert _genai_greedy(tmp_path, PROMPT, N) == ours


def test_genai_config_options_are_checked(lively_decoder):
    conf = genai_config(lively_decoder, eos_token_id=[3, 4], provider="NvTensorRtRtx")
    assert conf["model"]["eos_token_id"] == [3, 4] and conf["model"]["pad_token_id"] == 3
    # graph capture needs a shared past/present buffer, which a concatenating graph cannot have
    assert conf["model"]["decoder"]["session_options"]["provider_options"] == [{"NvTensorRtRtx": {"enable_cuda_graph": "0"}}]
    with pytest.raises(ExportError, match="outside the vocabulary"):
        genai_config(lively_decoder, eos_token_id=8449)
    with pytest.raises(ExportError, match="unknown onnxruntime-genai provider"):
        genai_config(lively_decoder, provider="tensorrt")
