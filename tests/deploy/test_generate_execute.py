"""The generate model's `execute` (deploy/triton/served.py) on a stand-in of Triton's Python backend that holds it
to the backend's contracts (python_backend.py): Triton may hand one `execute` several requests, and a bad one
among them must get its own error and leave the others their answers."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import python_backend

from andrea_export import runtime
from andrea_export.deploy.triton import parse_config, write_generate_model


@pytest.fixture
def served(tiny_build, tmp_path, monkeypatch):
    """The packaged generate model of the tiny build (ONNX Runtime), initialized as Triton does."""
    from andrea_export.deploy.triton.served import TritonPythonModel

    model = write_generate_model(tiny_build[0], tmp_path, slots=4)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", python_backend.module([]))
    params = parse_config((model / "config.pbtxt").read_text()).parameters
    m = TritonPythonModel()
    m.initialize({"model_config": json.dumps({"parameters": {k: {"string_value": v.string_value}
                                                             for k, v in params.items()}}),
                  "model_repository": str(model), "model_version": "1", "model_name": model.name})
    yield m
    m.finalize()


def _ask(ids, n, stream=False, **more):
    inputs = {"input_ids": np.asarray(ids, dtype=np.int64), "max_tokens": np.asarray([n], dtype=np.int32),
              "stream": np.asarray([stream]), "ignore_eos": np.asarray([True])}
    return python_backend.Request(**inputs, **more)


def test_a_bad_request_in_one_execute_gets_its_error_and_the_others_their_tokens(served, tiny_build):
    good = [_ask([1, 2, 3], 5), _ask([9, 8], 4, stream=True), _ask([4] * 10, 6)]
    bad = [_ask([1, 10**9], 4),  # outside the vocabulary
           python_backend.Request(max_tokens=np.asarray([4], dtype=np.int32)),  # no prompt
           _ask([1, 2], 4, seed=np.asarray([-1], dtype=np.int64)),  # a seed below 0
           _ask([1, 2], 4, top_k=np.asarray([1.5], dtype=np.float32))]  # not an integer
    requests = [good[0], bad[0], bad[1], good[1], bad[2], bad[3], good[2]]
    assert served.execute(requests) is None  # decoupled: every answer goes through the senders
    for r in requests:
        assert r.sender.closed.wait(120), "a request got no final response"
    ref = runtime.load(tiny_build[0], backend="onnxruntime")
    for r in good:
        assert r.sender.errors() == []
        ids = r.inputs["input_ids"].array.tolist()
        assert r.sender.tokens() == ref.generate(ids, int(r.inputs["max_tokens"].array[0]), ignore_eos=True)
    assert len(good[1].sender.responses) >= 4  # streamed: a response a token
    for r in bad:
        (error,) = r.sender.errors()
        assert error and "Traceback" not in error and r.sender.tokens() == []
    assert "vocab" in bad[0].sender.errors()[0] and "input_ids" in bad[1].sender.errors()[0]
