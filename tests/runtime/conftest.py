"""Fixtures for the runtime tests: the lively tiny model's KV-cache decoder in a folder (tests/conftest.py),
and an ONNX Runtime session on it."""

import pytest


@pytest.fixture(scope="session")
def build_dir(lively_decoder):
    return lively_decoder.parent


@pytest.fixture(scope="session")
def session(build_dir):
    from andrea_export import runtime

    return runtime.load(build_dir, backend="onnxruntime")
