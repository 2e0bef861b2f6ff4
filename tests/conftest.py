"""Shared fixtures, made once per session: the tiny model and its ONNX export; the "lively" tiny model,
whose output varies: andrea-tiny trained on the Python documentation (andrea_export/demo.py; trained
in about two CPU minutes on the first session, then cached under ~/.cache/andrea-export/demo, keyed by
a hash of the code and the corpus), its KV-cache decoder graph and a whole build folder of it."""

import json

import pytest
import torch

from andrea_export.config import ANDREA_TINY
from andrea_export.model.checkpoint import random_init

# Candidates for the lively prompt, the first that varies wins (lively_prompt). "Create a new" varied on the
# demo as trained on an AMD EPYC; on an Intel Xeon, whose float rounding differs, the demo trains to other
# weights (held-out perplexity 301.2 against 343.8) and that prompt settles into 7 distinct tokens.
LIVELY_PROMPTS = ("Create a new", "The default behavior for equal", 'If an "AttributeError" is rais',
                  "The return value is", "To use")  # cut words too: the model then continues mid-word


@pytest.fixture(scope="session")
def tiny_model():
    return random_init(ANDREA_TINY, seed=0, announce=False)


@pytest.fixture(scope="session")
def tiny_onnx(tiny_model, tmp_path_factory):
    from andrea_export.graphs.export import export_onnx

    return export_onnx(tiny_model, tmp_path_factory.mktemp("tiny") / "model.onnx", quiet=True)


@pytest.fixture(scope="session")
def demo_dir():
    """The trained demo: tokenizer.json, model.safetensors, heldout.txt, train.json, loss.png."""
    pytest.importorskip("tokenizers", reason="the 'text' extra (Hugging Face tokenizers) trains the tokenizer")
    from andrea_export.model.demo import demo_model

    return demo_model()


@pytest.fixture(scope="session")
def demo_log(demo_dir):
    return json.loads((demo_dir / "train.json").read_text())


@pytest.fixture(scope="session")
def lively_model(demo_dir):
    """andrea-tiny trained on real text (a GPT-2 init at tiny size only repeats the last token)."""
    from andrea_export.model.checkpoint import load_checkpoint

    return load_checkpoint(demo_dir / "model.safetensors")


@pytest.fixture(scope="session")
def lively_prompt(demo_dir, lively_model):
    """Token ids of words whose greedy continuation by the trained model varies: the first of LIVELY_PROMPTS
    with more than 10 distinct ids in 64 tokens (many prompts, random ids among them, fall into one repeated
    token). Chosen by the model, since its weights depend on the CPU."""
    from andrea_export.model.text import encode, load_tokenizer

    tok = load_tokenizer(demo_dir / "tokenizer.json")
    for words in LIVELY_PROMPTS:
        ids = encode(tok, words)
        seq = list(ids)
        with torch.inference_mode():
            for _ in range(64):
                seq.append(int(lively_model(torch.tensor([seq]))[0, -1].argmax()))
        if len(set(seq[len(ids):])) > 10:
            return ids
    pytest.fail(f"no prompt of {LIVELY_PROMPTS} makes the trained demo's greedy output vary")


@pytest.fixture(scope="session")
def lively_decoder(lively_model, tmp_path_factory):
    """decoder.onnx of the trained model, alone in its folder (a folder `runtime.load` accepts)."""
    from andrea_export.graphs.kvcache import export_decoder_onnx
    from andrea_export.names import DECODER_FILE

    return export_decoder_onnx(lively_model, tmp_path_factory.mktemp("decoder") / DECODER_FILE, quiet=True)


@pytest.fixture(scope="session")
def lively_build(lively_model, tmp_path_factory):
    """A real build folder of the lively model: its checkpoint in, TensorRT-RTX engines built on the CPU."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX (the 'rtx' extra) builds the engines on a CPU")
    from andrea_export.model.checkpoint import save_checkpoint
    from andrea_export.pipeline import BuildOptions, run_build

    ckpt = save_checkpoint(lively_model, tmp_path_factory.mktemp("ckpt") / "lively.safetensors")
    out = tmp_path_factory.mktemp("build") / "lively"
    run_build(BuildOptions(checkpoint=str(ckpt), builder="tensorrt-rtx", out=str(out), greedy_steps=4,
                           verify_shapes=[[1, 3]]))
    return out


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory):
    """A finished tiny build folder (TensorRT-RTX engines, decoder included) and its manifest. Tests that
    change a build work on a copy (`shutil.copytree`)."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX (the 'rtx' extra) builds the engines on a CPU")
    from andrea_export.pipeline import BuildOptions, run_build

    out = tmp_path_factory.mktemp("build") / "tiny"
    opts = BuildOptions(config="andrea-tiny", builder="tensorrt-rtx", out=str(out), greedy_steps=4,
                        verify_shapes=[[1, 3], [2, 128]])
    return out, run_build(opts)
