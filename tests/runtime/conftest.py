"""Fixtures for the runtime tests: a tiny model whose greedy decoding varies (GPT-2 init at tiny size only
repeats the last token), its KV-cache decoder in a build folder, and an ONNX Runtime session on it."""

import pytest
import torch

from andrea_export.checkpoint import random_init
from andrea_export.config import ANDREA_TINY


@pytest.fixture(scope="session")
def lively_model():
    model = random_init(ANDREA_TINY, seed=0, announce=False)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (name.startswith("h.") and p.dim() == 2) or name == "wpe.weight":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


@pytest.fixture(scope="session")
def build_dir(lively_model, tmp_path_factory):
    from andrea_export.kvcache import DECODER_FILE, export_decoder_onnx

    folder = tmp_path_factory.mktemp("build")
    export_decoder_onnx(lively_model, folder / DECODER_FILE, quiet=True)
    return folder


@pytest.fixture(scope="session")
def session(build_dir):
    from andrea_export import runtime

    return runtime.load(build_dir, backend="onnxruntime")
