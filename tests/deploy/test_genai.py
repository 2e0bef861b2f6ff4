"""onnxruntime-genai runs the build folder's decoder as it is: its greedy tokens equal our runtime's,
token for token, on the lively tiny model (whose output varies), fp32 and fp16."""

import json

import numpy as np
import pytest

from andrea_export import runtime
from andrea_export.deploy.genai import GENAI_CONFIG, genai_config, write_genai_config
from andrea_export.errors import ExportError

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai (the 'genai' extra)")

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
    assert dec["filename"] == manifest["artifacts"]["decoder_onnx_inplace"]["path"]  # the in-place graph
    assert (conf["model"]["type"], conf["model"]["vocab_size"], conf["model"]["context_length"]) == ("decoder", 8449, 128)
    assert (dec["num_hidden_layers"], dec["num_attention_heads"], dec["head_size"], dec["hidden_size"]) == (2, 4, 16, 64)
    assert dec["inputs"] == {"input_ids": "input_ids", "attention_mask": "attention_mask",
                             "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    assert dec["outputs"] == {"logits": "logits", "present_key_names": "present.%d.key",
                              "present_value_names": "present.%d.value"}
    assert conf["search"]["past_present_share_buffer"] is True  # GroupQueryAttention writes the cache in place


def test_genai_greedy_equals_ours_from_the_build_folder(lively_build, lively_prompt):
    with runtime.load(lively_build, "onnxruntime") as sess:
        ours = sess.generate(lively_prompt, N)
    assert len(set(ours)) > 10  # the lively model's output varies: agreement is not trivial
    assert 8448 not in ours  # the default end token (last id) is not produced, so genai runs all N steps
    assert _genai_greedy(lively_build, lively_prompt, N) == ours


def test_genai_greedy_equals_ours_fp16(lively_decoder, tmp_path, lively_prompt):
    from andrea_export.graphs.precision import convert_precision

    dec = convert_precision(lively_decoder, tmp_path / "decoder.fp16.onnx", "fp16")
    write_genai_config(dec)
    with runtime.load(dec, "onnxruntime") as sess:
        ours = sess.generate(lively_prompt, N)
    assert len(set(ours)) > 10
    assert _genai_greedy(tmp_path, lively_prompt, N) == ours


def test_genai_takes_a_ragged_batch_padded_on_the_right(lively_build, lively_prompt):
    """The in-place graph's padding rule (GroupQueryAttention's): rows padded at the end with the pad id."""
    prompts = [lively_prompt + lively_prompt[:2], lively_prompt[:3]]  # ragged whatever the prompt's length
    with runtime.load(lively_build, "onnxruntime") as sess:
        ours = sess.generate(prompts, 16)
    model = og.Model(str(lively_build))
    pad = json.loads((lively_build / GENAI_CONFIG).read_text())["model"]["pad_token_id"]
    width = len(prompts[0])
    batch = np.full((2, width), pad, dtype=np.int32)
    for i, p in enumerate(prompts):
        batch[i, :len(p)] = p
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=width + 16, do_sample=False, batch_size=2)
    gen = og.Generator(model, params)
    gen.append_tokens(batch)
    while not gen.is_done():
        gen.generate_next_token()
    assert list(map(int, gen.get_sequence(0))) == prompts[0] + ours[0]
    # genai keeps the padding in the row's sequence and generates after it (it was never seen: the first lively
    # prompt is 3 tokens long, so prompts[0][:3] was not shorter and the batch was not ragged)
    assert list(map(int, gen.get_sequence(1))) == prompts[1] + [pad] * (width - len(prompts[1])) + ours[1]
    assert width > len(prompts[1]), "the batch must be ragged"


def test_genai_config_options_are_checked(lively_decoder):
    conf = genai_config(lively_decoder, eos_token_id=[3, 4], provider="NvTensorRtRtx")
    assert conf["model"]["eos_token_id"] == [3, 4] and conf["model"]["pad_token_id"] == 3
    # graph capture needs a shared past/present buffer, which a concatenating graph cannot have
    assert conf["model"]["decoder"]["session_options"]["provider_options"] == [{"NvTensorRtRtx": {"enable_cuda_graph": "0"}}]
    with pytest.raises(ExportError, match="outside the vocabulary"):
        genai_config(lively_decoder, eos_token_id=8449)
    with pytest.raises(ExportError, match="unknown onnxruntime-genai provider"):
        genai_config(lively_decoder, provider="tensorrt")


# The onnxruntime-genai C API functions the C example in docs/deploying.md uses, declared as in its
# header ort_genai_c.h (the PyPI wheel ships the library, not the header).
C_DECLARATIONS = """
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif
typedef struct OgaResult OgaResult;
typedef struct OgaModel OgaModel;
typedef struct OgaGeneratorParams OgaGeneratorParams;
typedef struct OgaGenerator OgaGenerator;
const char* OgaResultGetError(const OgaResult*);
void OgaDestroyResult(OgaResult*);
OgaResult* OgaCreateModel(const char* config_path, OgaModel** out);
OgaResult* OgaCreateGeneratorParams(const OgaModel*, OgaGeneratorParams** out);
OgaResult* OgaGeneratorParamsSetSearchNumber(OgaGeneratorParams*, const char* name, double value);
OgaResult* OgaCreateGenerator(const OgaModel*, const OgaGeneratorParams*, OgaGenerator** out);
OgaResult* OgaGenerator_AppendTokens(OgaGenerator*, const int32_t* input_ids, size_t count);
bool OgaGenerator_IsDone(OgaGenerator*);
OgaResult* OgaGenerator_GenerateNextToken(OgaGenerator*);
OgaResult* OgaGenerator_GetNextTokens(const OgaGenerator*, const int32_t** out, size_t* out_count);
void OgaDestroyGenerator(OgaGenerator*);
void OgaDestroyGeneratorParams(OgaGeneratorParams*);
void OgaDestroyModel(OgaModel*);
void OgaShutdown(void);
#ifdef __cplusplus
}
#endif
"""


def test_the_documented_c_program_generates_our_tokens(lively_build, tmp_path):
    """docs/deploying.md's C program and its build-and-run commands, as written (bash, g++ compiling it as
    C++ against the wheel's libonnxruntime-genai.so), run on the build; our declarations stand in for
    upstream's header, which the wheel does not ship."""
    import os
    import re
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler (g++) on this machine")
    doc = (Path(__file__).parents[2] / "docs" / "deploying.md").read_text()
    (tmp_path / "gen.c").write_text(re.search(r"```c\n(.*?)```", doc, re.S).group(1))
    steps = re.search(r"```bash\n(GENAI=.*?)```", doc, re.S).group(1)
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "ort_genai_c.h").write_text(C_DECLARATIONS)
    (tmp_path / "build").symlink_to(lively_build)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # `python`
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", steps], cwd=tmp_path, capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    prompt, n = [5, 17, 300], 16  # as the commands give them
    with runtime.load(lively_build, "onnxruntime") as sess:
        assert [int(t) for t in run.stdout.split()] == sess.generate(prompt, n)
