"""A stand-in of Triton's Python backend (`triton_python_backend_utils`) for what the generate model uses of it
(deploy/triton/served.py), holding it to the backend's contracts (triton-inference-server/python_backend: its
README's decoupled mode, src/pb_stub.cc, src/response_sender.cc):

- a request's response sender is one object, `get_response_sender()` the same each call; once a response with
  TRITONSERVER_RESPONSE_COMPLETE_FINAL is sent, the sender is closed and any further send raises
  ("Unable to send response. Response sender has been closed."); `flags` is 0 or that flag; a send without a
  response must carry the final flag;
- an output Tensor's name is one of the model's outputs, its array a numpy array of the output's dtype
  (int64 for output_ids, bytes objects for text_output); an InferenceResponse holds tensors or an error, a
  TritonError holds a str;
- `get_input_tensor_by_name(request, name)` gives a Tensor (`as_numpy()`) or None for an input not sent.

Metrics and the logger are the same as initialize needs; every log line is kept."""

from __future__ import annotations

import threading
import types

import numpy as np

FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL
OUTPUT_DTYPES = {"output_ids": np.int64, "text_output": np.object_}


class Tensor:
    def __init__(self, name: str, array):
        assert isinstance(name, str) and isinstance(array, np.ndarray), (name, type(array))
        self.name, self.array = name, array

    def as_numpy(self) -> np.ndarray:
        return self.array


class TritonError:
    def __init__(self, message):
        assert isinstance(message, str), type(message)
        self.msg = message

    def message(self) -> str:
        return self.msg


class InferenceResponse:
    def __init__(self, output_tensors=None, error=None):
        assert not (output_tensors and error is not None), "tensors or an error, not both"
        assert output_tensors is None or isinstance(output_tensors, list)
        for t in output_tensors or ():
            assert t.name in OUTPUT_DTYPES and t.array.dtype == OUTPUT_DTYPES[t.name], (t.name, t.array.dtype)
            if t.name == "text_output":
                assert all(isinstance(x, bytes) for x in t.array.reshape(-1)), "text_output holds bytes"
        assert error is None or isinstance(error, TritonError)
        self.tensors = {t.name: t.array for t in output_tensors or ()}
        self.error = error


class ResponseSender:
    def __init__(self):
        self.responses: list[InferenceResponse] = []
        self.closed = threading.Event()
        self.cancelled = False

    def send(self, response=None, flags=0):
        if self.closed.is_set():
            raise RuntimeError("Unable to send response. Response sender has been closed.")
        assert flags in (0, FINAL), flags
        assert response is not None or flags == FINAL, "a send without a response must be the final one"
        assert response is None or isinstance(response, InferenceResponse)
        if response is not None:
            self.responses.append(response)
        if flags == FINAL:
            self.closed.set()

    def is_cancelled(self) -> bool:
        return self.cancelled

    def tokens(self) -> list[int]:
        return [int(x) for r in self.responses if "output_ids" in r.tensors for x in r.tensors["output_ids"]]

    def errors(self) -> list[str]:
        return [r.error.message() for r in self.responses if r.error is not None]


class Request:
    """An InferenceRequest as the model sees it: its inputs by name, and its one response sender."""

    def __init__(self, **inputs):
        self.inputs = {k: Tensor(k, np.asarray(v)) for k, v in inputs.items()}
        self.sender = ResponseSender()

    def get_response_sender(self) -> ResponseSender:
        return self.sender


class _Metric:
    def __init__(self, labels, buckets=None):
        assert isinstance(labels, dict) and all(isinstance(v, str) for v in labels.values())
        self.value = 0.0

    def set(self, value):
        self.value = float(value)

    def observe(self, value):
        assert value >= 0


class _MetricFamily:
    GAUGE, HISTOGRAM = "gauge", "histogram"

    def __init__(self, name, description, kind):
        assert kind in (self.GAUGE, self.HISTOGRAM)
        self.Metric = _Metric


def module(log: list[str]) -> types.ModuleType:
    """The stand-in `triton_python_backend_utils`; its logger appends to `log`."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.Logger = types.SimpleNamespace(log_info=log.append, log_error=log.append, log_warn=log.append)  # type: ignore[attr-defined]
    pb.MetricFamily = _MetricFamily  # type: ignore[attr-defined]
    pb.Tensor, pb.InferenceResponse, pb.TritonError = Tensor, InferenceResponse, TritonError  # type: ignore[attr-defined]
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL  # type: ignore[attr-defined]
    pb.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)  # type: ignore[attr-defined]
    return pb
