"""Shared fixtures, made once per session: the tiny model and its ONNX export; the "lively" tiny model,
whose output varies: andrea-tiny trained on the Python documentation, shipped in models/andrea-tiny-demo
(trained once by `andrea-export train-demo`; its folder's README says how), its KV-cache decoder graph
and a whole build folder of it.

The trained weights are a file, not a training run: training's float rounding differs from CPU to CPU
(the same recipe reached held-out perplexity 343.8, 301.2 and 294.6 on three CPUs of this machine kind),
and a test that trained its own model would read figures that the CPU chose."""

import json
from pathlib import Path

import pytest
import torch

from andrea_export.config import ANDREA_TINY
from andrea_export.model.checkpoint import random_init

DEMO_DIR = Path(__file__).resolve().parents[1] / "models" / "andrea-tiny-demo"
# The lively prompt: the shipped demo's greedy continuation of it varies (lively_prompt checks that it does).
LIVELY_WORDS = "Create a new"


@pytest.fixture(scope="session")
def tiny_model():
    return random_init(ANDREA_TINY, seed=0, announce=False)


@pytest.fixture(scope="session")
def tiny_onnx(tiny_model, tmp_path_factory):
    from andrea_export.graphs.export import export_onnx

    return export_onnx(tiny_model, tmp_path_factory.mktemp("tiny") / "model.onnx", quiet=True)


@pytest.fixture(scope="session")
def demo_dir():
    """The shipped trained demo: tokenizer.json, model.safetensors, heldout.txt, train.json, loss.png."""
    pytest.importorskip("tokenizers", reason="the 'text' extra (Hugging Face tokenizers) reads the tokenizer")
    return DEMO_DIR


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
    """Token ids of words whose greedy continuation by the trained model varies: more than 10 distinct ids
    in 64 tokens (many prompts, random ids among them, fall into one repeated token), so that a runtime
    that decodes wrongly cannot agree with PyTorch by luck."""
    from andrea_export.model.text import encode, load_tokenizer

    ids = encode(load_tokenizer(demo_dir / "tokenizer.json"), LIVELY_WORDS)
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(64):
            seq.append(int(lively_model(torch.tensor([seq]))[0, -1].argmax()))
    distinct = len(set(seq[len(ids):]))
    assert distinct > 10, f"the demo's greedy continuation of {LIVELY_WORDS!r} has {distinct} distinct ids"
    return ids


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
