"""The generate model for Triton's Python backend: `TritonPythonModel` around the runtime's in-flight batcher.

A model folder written by generate.py holds a three-line model.py that imports this class, and the build's
files the runtime reads (build/: manifest, in-place decoder, weights, tokenizer; or, for the `engine` parameter
tensorrt, the slot engine and its graph). The batcher steps ONNX Runtime's slot cache on the CPU, or the slot
engine's (runtime/trt_slots.py: TensorRT >= 10.15, a GPU, CUDA graphs per batch size). Shaped as vLLM's Triton
backend is: decoupled, `execute` parses each request and hands it to the batcher's engine thread, which
sends the tokens as they come (`stream`) or all at once; it returns at once. Nothing here imports torch.

    inputs   text_input BYTES [1] (needs the build's tokenizer) or input_ids INT64 [-1]; max_tokens INT32 [1];
             optional temperature FP32 [1] (0 or absent: greedy), top_k INT32 [1], top_p FP32 [1],
             seed INT64 [1], stop_ids INT64 [-1], stream BOOL [1], ignore_eos BOOL [1] (run on past the
             end-of-text token)
    outputs  output_ids INT64 [-1]; text_output BYTES [1] (with a tokenizer)

A bad request gets one error response naming the field, and nothing else in flight notices. A client that
disconnects (`is_cancelled()` on its sender) leaves at the next step and frees its slot.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

INPUTS = {  # name -> (Triton type, dims)
    "text_input": ("TYPE_STRING", [1]), "input_ids": ("TYPE_INT64", [-1]), "max_tokens": ("TYPE_INT32", [1]),
    "temperature": ("TYPE_FP32", [1]), "top_k": ("TYPE_INT32", [1]), "top_p": ("TYPE_FP32", [1]),
    "seed": ("TYPE_INT64", [1]), "stop_ids": ("TYPE_INT64", [-1]), "stream": ("TYPE_BOOL", [1]),
    "ignore_eos": ("TYPE_BOOL", [1]),
}
OUTPUTS = {"output_ids": ("TYPE_INT64", [-1]), "text_output": ("TYPE_STRING", [1])}
BUILD_DIR = "build"  # inside the version folder
REQUEST_FAILED = "the request failed"  # how an answer begins when the model, not the request, failed
ENGINES = ("onnxruntime", "tensorrt")  # what the batcher steps: the `engine` parameter of the model's config


def open_session(build: Path, engine: str):
    """The session whose slot cache the batcher steps: the build's in-place decoder on ONNX Runtime's CPU provider,
    or its in-flight batching engine on TensorRT (the GPU the process sees first)."""
    from ... import runtime
    from ...errors import InputError

    if engine == "tensorrt":
        return runtime.load(build, "tensorrt", in_flight=True)
    if engine == "onnxruntime":
        return runtime.load(build, backend="onnxruntime", providers=["CPUExecutionProvider"])
    raise InputError(f"the generate model's engine must be one of {', '.join(ENGINES)}, not {engine!r}")


class BadRequest(ValueError):
    """A request the model answers with an error response (its message names the field)."""


def longest_token_bytes(tokenizer) -> int:
    """The UTF-8 length of the tokenizer's longest token string, added tokens included: for a byte-level BPE (the
    demo's) each character of a token stands for one byte of text, so no token covers more bytes than this, and a
    text of more than n_positions times this many bytes cannot fit the context."""
    return max((len(t.encode("utf-8")) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)


def parse_request(get, vocab_size: int, encode=None, max_text_bytes: int | None = None):
    """A runtime Request from a request's inputs (`get(name)` -> numpy array or None), and whether it streams.
    A text longer than `max_text_bytes` (what the context can hold at most) is refused before it is tokenized."""
    from ...runtime import Request

    def scalar(name, kind):
        a = get(name)
        if a is None:
            return None
        if a.size != 1:
            raise BadRequest(f"{name}: one value expected, got shape {list(a.shape)}")
        v = a.reshape(-1)[0]
        if kind is int and not np.issubdtype(a.dtype, np.integer):
            raise BadRequest(f"{name}: an integer expected, got {a.dtype}")
        return kind(v)

    text, ids = get("text_input"), get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("give exactly one of text_input and input_ids")
    if text is not None:
        if encode is None:
            raise BadRequest("text_input: this build has no tokenizer (build --tokenizer); send input_ids")
        raw = text.reshape(-1)[0] if text.size == 1 else None
        if not isinstance(raw, (bytes, str)):
            raise BadRequest("text_input: one string expected")
        # a string has at least as many UTF-8 bytes as characters: one too long is refused before it is encoded
        size = len(raw) if isinstance(raw, bytes) or (max_text_bytes is not None and len(raw) > max_text_bytes) \
            else len(raw.encode("utf-8", "surrogatepass"))
        if max_text_bytes is not None and size > max_text_bytes:
            raise BadRequest(f"text_input: {size:,} bytes cannot fit the model's context (at most "
                             f"{max_text_bytes:,} bytes)")
        try:
            prompt = encode(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
        except UnicodeDecodeError as e:
            raise BadRequest(f"text_input: not UTF-8 ({e.reason} at byte {e.start})") from None
    else:
        if not np.issubdtype(ids.dtype, np.integer):
            raise BadRequest(f"input_ids: integers expected, got {ids.dtype}")
        prompt = ids.reshape(-1).tolist()
    max_tokens = scalar("max_tokens", int)
    if max_tokens is None:
        raise BadRequest("max_tokens: required")
    if max_tokens < 1:
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens}")
    temperature = scalar("temperature", float)
    top_k, top_p, seed = scalar("top_k", int), scalar("top_p", float), scalar("seed", int)
    stops = get("stop_ids")
    stream = scalar("stream", bool) or False
    ignore_eos = scalar("ignore_eos", bool) or False
    if not temperature:
        strategy, temperature = "greedy", 1.0
    else:
        strategy = "top-k" if top_k is not None and top_p is None else "top-p"
    return Request(prompt, max_tokens, strategy, temperature, top_k if top_k is not None else 50,
                   top_p if top_p is not None else 1.0, seed, [] if stops is None else stops.reshape(-1).tolist(),
                   ignore_eos), stream


class TritonPythonModel:
    def initialize(self, args):
        import triton_python_backend_utils as pb_utils

        from ... import runtime
        from ...runtime.batcher import Batcher

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        build = Path(args["model_repository"]) / args["model_version"] / BUILD_DIR  # in place: a link to the build
        engine = params.get("engine", "onnxruntime")
        self.session = open_session(build, engine)
        self.tokenizer = None
        if (tok := runtime.tokenizer_path(build)) is not None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(tok))
        self.max_text_bytes = self.session.cfg.n_positions * longest_token_bytes(self.tokenizer) if self.tokenizer \
            else None
        slots, chunk = int(params.get("slots", "8")), int(params.get("prefill_chunk", "64"))
        admit = params.get("admit", "in-flight")
        budget = int(params["step_tokens"]) if "step_tokens" in params else None
        self.metrics = _BatcherMetrics(pb_utils, args["model_name"])
        self.batcher = Batcher(self.session, slots=slots, prefill_chunk=chunk, admit=admit, step_tokens=budget,
                               on_admit=self.metrics.queued)
        self.metrics.batcher = self.batcher
        cfg = self.session.cfg
        pb_utils.Logger.log_info(
            f"andrea generate model '{args['model_name']}': {cfg.name} ({cfg.n_layer} layers, context "
            f"{cfg.n_positions}) from {build} on {_engine_line(self.session, engine)}, {admit} batching over {slots} "
            f"slots, prefill chunk {self.batcher.prefill_chunk}"
            f"{f', at most {budget} tokens a step' if budget else ''}, "
            f"tokenizer {'yes' if self.tokenizer else 'no (input_ids only)'}")

    def execute(self, requests):
        from ...errors import InputError

        pb = self.pb
        for request in requests:
            sender = request.get_response_sender()
            try:
                req, stream = parse_request(lambda n: _input(pb, request, n), self.session.cfg.vocab_size,
                                            self._encode if self.tokenizer else None, self.max_text_bytes)
                self.batcher.submit(req, self._responder(sender, stream))
                self.metrics.update()
            except (BadRequest, InputError, RuntimeError) as e:
                sender.send(pb.InferenceResponse(error=pb.TritonError(str(e))),
                            flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as e:  # noqa: BLE001 - one request's surprise must not take the others' answers
                pb.Logger.log_error(f"a request failed: {type(e).__name__}: {e}")
                sender.send(pb.InferenceResponse(error=pb.TritonError(f"{REQUEST_FAILED}: {type(e).__name__}")),
                            flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self):
        self.batcher.stop(drain=True)
        self.metrics.close()
        self.session.close()  # the slot engine's device memory and CUDA graphs go with it

    def _encode(self, text: str) -> list[int]:
        assert self.tokenizer is not None  # handed out only with a tokenizer
        return self.tokenizer.encode(text).ids

    def _responder(self, sender, stream: bool):
        """The batcher's callback for one request: it sends responses on the engine thread; raises once the
        client is gone (the batcher then cancels the request)."""
        pb, tok = self.pb, self.tokenizer
        tokens: list[int] = []
        sent_text = [""]

        def tensors(ids: list[int], text: str | None):
            out = [pb.Tensor("output_ids", np.asarray(ids, dtype=np.int64))]
            if text is not None:
                out.append(pb.Tensor("text_output", np.asarray([text.encode("utf-8")], dtype=np.object_)))
            return out

        def emit(event):
            if sender.is_cancelled() and not event.final:
                pb.Logger.log_info(f"a request was cancelled by its client after {len(tokens)} tokens: slot freed")
                raise ConnectionAbortedError("the client cancelled the request")
            final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if event.final else 0
            if event.final:
                self.metrics.update()
            if event.error:
                sender.send(pb.InferenceResponse(error=pb.TritonError(event.error)), flags=final)
                return
            if event.token is not None:
                tokens.append(event.token)
            if stream:
                new = [event.token] if event.token is not None else []
                text = None
                if tok is not None:  # the text so far less what was sent; a character still cut short
                    full = tok.decode(tokens)  # (U+FFFD at the end) waits for its next token
                    done = full if event.final else full.rstrip("\ufffd")
                    text, sent_text[0] = done[len(sent_text[0]):], done
                if new or text:
                    sender.send(pb.InferenceResponse(tensors(new, text)), flags=final)
                elif final:
                    sender.send(flags=final)
            elif event.final:
                sender.send(pb.InferenceResponse(tensors(tokens, tok.decode(tokens) if tok else None)), flags=final)

        return emit


QUEUE_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class _BatcherMetrics:
    """The batcher's state on Triton's metrics port (the Python backend's custom metrics), which Triton's own
    cannot see (a decoupled model's `execute` returns at once): requests waiting for a slot and in a slot, and
    each request's time in the queue."""

    def __init__(self, pb, model: str):
        self.batcher: Any = None  # the model's Batcher, once made (its metrics exist before it)
        labels, kind = {"model": model}, pb.MetricFamily
        self.families = [  # kept as long as their metrics (the backend refuses a metric whose family is gone)
            kind("andrea_batcher_requests_waiting", "Requests queued for a batch slot", kind.GAUGE),
            kind("andrea_batcher_requests_running", "Requests in a batch slot (prefilling or decoding)", kind.GAUGE),
            kind("andrea_batcher_queue_time_seconds", "From a request's arrival to its slot", kind.HISTOGRAM)]
        self.waiting = self.families[0].Metric(labels=labels)
        self.running = self.families[1].Metric(labels=labels)
        self.queue = self.families[2].Metric(labels=labels, buckets=QUEUE_BUCKETS)

    def queued(self, seconds: float) -> None:
        self.queue.observe(seconds)
        self.update()

    def update(self) -> None:
        if self.batcher is not None:
            self.waiting.set(self.batcher.waiting)
            self.running.set(self.batcher.running)

    def close(self) -> None:
        """The metrics before their families, as the backend asks."""
        self.batcher = None
        del self.waiting, self.running, self.queue
        self.families.clear()


def _engine_line(session, engine: str) -> str:
    if engine == "tensorrt":
        return (f"TensorRT {getattr(session.trt, '__version__', '?')} (the slot engine, up to {session.max_slots} "
                f"decoding rows, {'CUDA graphs per batch size' if session.capture else 'uncaptured'})")
    return "ONNX Runtime (CPU)"


def _input(pb, request, name: str):
    t = pb.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()
