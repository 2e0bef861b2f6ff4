"""Shared fixtures: the tiny model and its ONNX export, made once per session."""

import pytest
import torch

from andrea_export.checkpoint import random_init
from andrea_export.config import ANDREA_TINY


@pytest.fixture(scope="session")
def tiny_model():
    return random_init(ANDREA_TINY, seed=0, announce=False)


@pytest.fixture(scope="session")
def tiny_onnx(tiny_model, tmp_path_factory):
    from andrea_export.export import export_onnx

    return export_onnx(tiny_model, tmp_path_factory.mktemp("tiny") / "model.onnx", quiet=True)


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
