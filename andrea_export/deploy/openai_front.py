"""The OpenAI-compatible front of `serve`, on FastAPI and uvicorn as vLLM's and `trtllm-serve`'s are: /v1/models,
/v1/models/{id}, /v1/completions and /v1/chat/completions (streamed as server-sent events), and /metrics, in front
of the Triton server's generate model, so the official `openai` client, LangChain and load tools talk to it unchanged. It is the one listener
`serve` puts beyond loopback; Triton's own ports stay on 127.0.0.1 (deploy/server.py).

Every limit comes before the work it guards, each refused with an OpenAI-shaped error: connections beyond
`max_connections` get 503 (uvicorn's limit); the API key, when one is set, on every route but /health; the body's
size, read within `read_timeout_s`, and its JSON depth before it is parsed; a text prompt's bytes against what the
context can hold at most (`prompt_byte_bound`) before it is tokenized, in a worker thread off the event loop; its
tokens and `max_tokens` against the context before Triton sees the request.

A thin layer, not a second engine: each completion is one request to the generate model, streamed over Triton's
gRPC (token ids, tokenized here; Triton's HTTP layer, which some bodies crash, need not listen), its tokens
passed on as they come; a client that leaves, or a stop string that matches, cancels that request, which frees
its slot at the next step. Honoured: prompt (one string or one list of
token ids), max_tokens (default 16), temperature (default 1; 0: greedy), top_p or top_k, seed, stop (strings,
matched in the text), stream, stream_options.include_usage (and vLLM's continuous_usage_stats: the usage so far
in every chunk), and vLLM's ignore_eos and return_token_ids (each
choice's token ids beside its text, the prompt's in the first; streamed, a chunk for every step, text or not).
Refused with a 400 naming the field: n > 1
and every other sampling field (SAMPLING_UNSUPPORTED, and echo, best_of, suffix).
"""

import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Annotated, Any, Literal

from .. import userfiles
from ..names import EOT, MAX_SEED
from .triton.served import INPUTS, REQUEST_FAILED, longest_token_bytes

# Sampling fields of OpenAI's API and of vLLM's extensions that this server does not honour: refused by name
# (a field set to its neutral value passes), never ignored
SAMPLING_UNSUPPORTED = ("logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
                        "min_p", "min_tokens", "use_beam_search", "length_penalty")
UNSUPPORTED = ("echo", "best_of", "suffix", *SAMPLING_UNSUPPORTED)
CHAT_UNSUPPORTED = ("top_logprobs", "tools", "tool_choice", "functions", "function_call", "response_format",
                    "parallel_tool_calls", *SAMPLING_UNSUPPORTED)
INT32_MAX = 2**31 - 1  # the generate model's INT32 inputs (served.INPUTS)
HEALTH_TIMEOUT_S = 2.0  # for Triton's answer to /health's readiness question
ACCESS_LOG = "andrea_export.front.access"  # one line a request: client, method, path, status (never a prompt)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one client may take of the front, each checked before the work it guards."""

    max_body_bytes: int = 1 << 20  # a request body; 413 beyond
    max_connections: int = 512  # open connections at once; 503 beyond
    read_timeout_s: float = 30.0  # to send the whole body; 408 after
    keep_alive_s: int = 5  # an idle connection between requests is closed after
    backlog: int = 2048  # connections the kernel queues before accept (a burst of clients)
    max_requests: int = 256  # completions in flight (decoding or waiting for a slot) a new one finds; 503 beyond


@dataclasses.dataclass(frozen=True)
class Model:
    """What the front must know of the served model to check a request before Triton sees it."""

    name: str  # the id clients ask for (--served-model-name)
    n_positions: int
    vocab_size: int
    tokenizer: Any = None  # a tokenizers.Tokenizer, or None: token-id prompts only
    eos_id: int | None = None  # the end-of-text token the generate model stops at (runtime.eos_id)
    chat_template: str | None = None  # Hugging Face's Jinja format: what /v1/chat/completions renders messages with

    @functools.cached_property
    def prompt_byte_bound(self) -> int:
        """The most UTF-8 bytes a prompt that fits the context can have: every token covers at most the bytes of
        the longest one, so a longer text cannot fit, and is refused before it is tokenized."""
        return self.n_positions * longest_token_bytes(self.tokenizer)


@dataclasses.dataclass(frozen=True)
class Upstream:
    """Where the front's completions go: Triton's gRPC port (host:port; its HTTP port need not listen) and the
    generate model's name there."""

    grpc: str
    model: str


class FrontError(Exception):
    def __init__(self, message: str, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


def _unavailable(why: str) -> FrontError:
    """What a request gets once part of the server has died (Front.fail): `why` names it."""
    return FrontError(f"the server cannot serve: {why}", 503)


def _error(message: str, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _kind(status: int) -> str:
    """OpenAI's error type for an HTTP status: the server's fault (5xx), a key, or the request."""
    return "server_error" if status >= 500 else "authentication_error" if status == 401 else "invalid_request_error"


# -- the request -------------------------------------------------------------------------------------------
@functools.cache
def _completion_request():
    """The pydantic model of a completions request, strict (a string is not a number, "false" is not false);
    fields it does not name pass (`user`, ...), those in UNSUPPORTED are refused by `parse`."""
    from pydantic import BaseModel, ConfigDict, Field

    class StreamOptions(BaseModel):
        model_config = ConfigDict(strict=True, extra="allow")
        include_usage: bool = False
        continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far in every chunk

    class Sampled(BaseModel):
        model_config = ConfigDict(strict=True, extra="allow")
        model: str | None = None
        temperature: Annotated[float, Field(ge=0, le=1e4)] = 1.0  # past it every token is as likely already
        top_p: Annotated[float, Field(gt=0, le=1)] | None = None
        top_k: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None  # vLLM's extension; the model's INT32 input
        seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
        stop: str | list[str] | None = None
        stream: bool = False
        stream_options: StreamOptions | None = None
        n: int = 1
        ignore_eos: bool = False  # vLLM's extension: run on past the end-of-text token
        return_token_ids: bool = False  # vLLM's extension: each choice's token ids (and the prompt's) beside its text

    class CompletionRequest(Sampled):
        prompt: str | list[int] | list[str] | list[list[int]]
        max_tokens: Annotated[int, Field(ge=1)] = 16

    class Part(BaseModel):
        model_config = ConfigDict(strict=True, extra="allow")
        type: Literal["text"]
        text: str

    class Message(BaseModel):
        model_config = ConfigDict(strict=True, extra="allow")
        role: str
        content: str | list[Part] | None = None

    class ChatRequest(Sampled):
        messages: Annotated[list[Message], Field(min_length=1)]
        max_tokens: Annotated[int, Field(ge=1)] | None = None  # none: the rest of the context
        max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    return CompletionRequest, ChatRequest


@dataclasses.dataclass
class Completion:
    """A checked request: the prompt still as given (text is tokenized later, off the event loop), or a chat's
    messages (rendered by the chat template first)."""

    prompt: str | list[int]
    feed: dict  # the generate model's inputs but the prompt
    stops: list[str]
    stream: bool
    include_usage: bool
    usage_every_chunk: bool = False  # stream_options.continuous_usage_stats, with include_usage
    messages: list[dict] | None = None
    token_ids: bool = False  # return_token_ids: the ids beside the text, a chunk for every step's tokens

    @property
    def chat(self) -> bool:
        return self.messages is not None


def _validated(body: dict, model: Model, kind, unsupported: tuple[str, ...]):
    """`body` as the pydantic model `kind`, for this server's model (FrontError naming the field)."""
    from pydantic import ValidationError

    if body.get("model") not in (None, model.name):
        raise FrontError(f"model {str(body.get('model'))[:100]!r} is not served here; this server has {model.name!r}",
                         404, "model_not_found")
    for key in unsupported:
        if body.get(key) not in (None, False, 0, []):
            raise FrontError(f"{key} is not supported by this server")
    try:
        r = kind.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"][:3]) or "body"
        raise FrontError(f"{where}: {first['msg']}") from None
    if r.n != 1:
        raise FrontError("n: only 1 completion per request is supported")
    return r


def parse(body: dict, model: Model) -> Completion:
    """A completions request checked against what this server serves (FrontError naming the field)."""
    r = _validated(body, model, _completion_request()[0], UNSUPPORTED)
    prompt = r.prompt[0] if isinstance(r.prompt, list) and len(r.prompt) == 1 and isinstance(r.prompt[0], (str, list)) \
        else r.prompt
    if not (isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt))):
        raise FrontError("prompt: one string or one list of token ids")
    return _checked(r, prompt, r.max_tokens)


def parse_chat(body: dict, model: Model) -> Completion:
    """A chat completions request: its messages (text content: a string, or parts of type text) to render."""
    if model.chat_template is None:
        raise FrontError("this build's tokenizer has no chat template: start serve with --chat-template FILE "
                         "(Hugging Face's Jinja format), or use /v1/completions")
    r = _validated(body, model, _completion_request()[1], CHAT_UNSUPPORTED)
    messages = [{**m.model_dump(), "content": m.content if not isinstance(m.content, list) else
                 "".join(p.text for p in m.content)} for m in r.messages]
    return dataclasses.replace(_checked(r, "", r.max_completion_tokens or r.max_tokens), messages=messages)


def _checked(r, prompt, max_tokens: int | None) -> Completion:
    stops = [r.stop] if isinstance(r.stop, str) else (r.stop or [])
    if len(stops) > 4 or not all(stops):
        raise FrontError("stop: a string or up to 4 non-empty strings")
    feed: dict = {"max_tokens": max_tokens, "temperature": float(r.temperature), "stream": True}
    if r.top_k is not None and r.top_p is not None:
        raise FrontError("top_k and top_p: give one of them (the generate model samples with one)")
    feed.update({k: v for k, v in (("top_p", r.top_p), ("top_k", r.top_k), ("seed", r.seed)) if v is not None})
    if r.ignore_eos:
        feed["ignore_eos"] = True
    usage = bool(r.stream_options and r.stream_options.include_usage)
    return Completion(prompt, feed, stops, r.stream, usage,
                      usage_every_chunk=usage and r.stream_options.continuous_usage_stats, token_ids=r.return_token_ids)


@functools.cache
def _renderer(template: str):
    return chat_renderer(template)


RANGE_BUDGET = 100_000  # the items all of a render's range() calls may give together (Jinja bounds each at 100,000)


def chat_renderer(template: str):
    """`render(messages, max_chars=None) -> prompt text` for a Hugging Face chat template, in Jinja's sandbox as
    transformers renders it (the template comes from a build folder: it may not reach Python's internals); a
    template that does not compile is a ValueError here, at start. A render is bounded: it stops (FrontError) once
    its text passes `max_chars` (a prompt that long could not fit the context anyway), and its range() calls share
    RANGE_BUDGET items, so that a short message list cannot make a template render megabytes, or loop for
    minutes in nested ranges, in a worker thread nobody can stop."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

    def raise_exception(message):
        raise FrontError(f"the chat template refused the messages: {str(message)[:300]}")

    class Sandbox(ImmutableSandboxedEnvironment):
        """Jinja's sandbox, with `*` and `**` bounded too ("x" * 10**9 is a gigabyte before any check sees it)."""

        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            seq, n = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
            if operator == "*" and isinstance(seq, (str, list, tuple)) and isinstance(n, int) \
                    and len(seq) * n > RANGE_BUDGET:
                raise FrontError(f"the chat template repeated a value into more than {RANGE_BUDGET:,} items")
            if operator == "**" and isinstance(right, int) and abs(right) > 64:
                raise FrontError("the chat template raised a number to a power over 64")
            return super().call_binop(context, operator, left, right)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        compiled = env.from_string(template)
    except TemplateError as e:
        raise ValueError(f"the chat template does not compile: {e}") from None

    def render(messages: list[dict], max_chars: int | None = None) -> str:
        left = [RANGE_BUDGET]

        def bounded_range(*args):
            r = safe_range(*args)  # Jinja's own: refuses more than 100,000 items at once
            left[0] -= len(r)
            if left[0] < 0:
                raise FrontError(f"the chat template looped over more than {RANGE_BUDGET:,} items in range()")
            return r

        out, size = [], 0
        try:
            for piece in compiled.generate(messages=messages, add_generation_prompt=True, bos_token=EOT,
                                           eos_token=EOT, range=bounded_range):
                out.append(piece)
                size += len(piece)
                if max_chars is not None and size > max_chars:
                    raise FrontError(f"the chat template rendered these messages into more than {max_chars:,} "
                                     "characters, which cannot fit the model's context", code="context_length_exceeded")
        except TemplateError as e:
            raise FrontError(f"the chat template failed on these messages: {str(e)[:300]}") from None
        except (OverflowError, MemoryError) as e:  # Jinja's own range bound, or what Python could not hold
            raise FrontError(f"the chat template failed on these messages: {str(e)[:300] or type(e).__name__}") from None
        return "".join(out)

    return render


async def prompt_ids(c: Completion, model: Model) -> list[int]:
    """The prompt's token ids, checked against the vocabulary and the context; a text prompt bounded in bytes
    before it is tokenized, and tokenized in a worker thread."""
    import anyio

    prompt = c.prompt
    if c.messages is not None:
        assert model.chat_template is not None  # parse_chat refused it otherwise
        render = _renderer(model.chat_template)
        prompt = await anyio.to_thread.run_sync(render, c.messages, model.prompt_byte_bound)
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise FrontError("prompt: this build has no tokenizer (build --tokenizer); send a list of token ids")
        size, bound = len(prompt.encode("utf-8", "surrogatepass")), model.prompt_byte_bound
        if size > bound:
            raise FrontError(f"prompt: {size:,} bytes cannot fit the model's context of {model.n_positions} tokens "
                             f"(at most {bound:,} bytes)", code="context_length_exceeded")
        ids = (await anyio.to_thread.run_sync(model.tokenizer.encode, prompt)).ids
    else:
        from ..errors import InputError
        from ..runtime import check_ids

        try:
            ids = check_ids(prompt, model.vocab_size, "prompt")
        except InputError as e:
            raise FrontError(str(e)) from None
    n = c.feed["max_tokens"]
    if n is None:  # a chat without a length: the rest of the context
        n = c.feed["max_tokens"] = max(1, model.n_positions - len(ids))
    if len(ids) + n > model.n_positions:
        raise FrontError(f"prompt ({len(ids)} tokens) + max_tokens ({n}) = {len(ids) + n} exceeds the model's context "
                         f"of {model.n_positions} tokens", code="context_length_exceeded")
    return ids


async def read_body(request, limits: Limits) -> dict:
    """The body as a JSON object: at most max_body_bytes (refused by its Content-Length before it is read, and
    counted as it comes when chunked), all of it within read_timeout_s, nested at most userfiles.MAX_JSON_DEPTH
    deep, in no Content-Encoding."""
    import anyio

    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":  # nothing here inflates a body: a gzip bomb stays the bytes it was sent as
        raise FrontError(f"Content-Encoding {encoding[:40]!r} is not accepted: send the JSON body as it is", 415)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise FrontError(f"request body of {int(declared):,} bytes is over the {limits.max_body_bytes:,} allowed", 413)
    data = bytearray()
    try:
        with anyio.fail_after(limits.read_timeout_s):
            async for piece in request.stream():
                data += piece
                if len(data) > limits.max_body_bytes:
                    raise FrontError(f"request body over the {limits.max_body_bytes:,} bytes allowed", 413)
    except TimeoutError:
        raise FrontError(f"the request body did not arrive within {limits.read_timeout_s:g} s", 408) from None
    if not data:
        raise FrontError("a JSON object body is needed")
    body = userfiles.loads_json(bytes(data), "request", "the body", FrontError)
    if not isinstance(body, dict):
        raise FrontError("the body must be a JSON object")
    return body


# -- the answer --------------------------------------------------------------------------------------------
async def pieces(client, triton_model: str, feed: dict, stops: list[str], eos_id: int | None = None,
                 every_step: bool = False, dead: Callable[[], str | None] = lambda: None,
                 ) -> AsyncGenerator[tuple[str, list[int], str | None], None]:
    """(new text, its token ids, finish_reason or None) from the generate model's stream over Triton's gRPC
    (`client`: tritonclient's asyncio client); ends at a stop string, which cancels the upstream request (its slot
    is freed at the next step), as does a client that leaves (this generator closed). The generate model ends a
    request at max_tokens ("length") or at the end-of-text token `eos_id`, which comes as its last token
    ("stop"). A token whose bytes end no character waits for the next piece of text, unless `every_step`
    (return_token_ids: the ids of each step come as they are made, with the text that is ready, maybe none).
    `dead()`: what of the server died, if anything: an upstream error is then said as that (503), not as a
    Triton that did not answer (502)."""
    from grpc.aio import AioRpcError
    from tritonclient.utils import InferenceServerException

    try:
        inputs = _tensors(feed)  # here, not in the stream's request iterator, where gRPC turns an error into a cancel
    except (OverflowError, ValueError) as e:
        raise FrontError(f"a field does not fit the generate model's input types: {str(e)[:200]}") from None

    async def request():  # one request; the stream half-closes after it and ends with its last response
        yield {"model_name": triton_model, "inputs": inputs}

    text, sent, keep = "", 0, max((len(s) for s in stops), default=1) - 1
    pending: list[int] = []  # ids not yet passed on
    last = None
    stream = client.stream_infer(request())
    try:
        async for result, error in stream:
            if error is not None:
                if (why := dead()) is not None:
                    raise _unavailable(why)
                message = error.message()
                raise FrontError(message, 502 if message.startswith(REQUEST_FAILED) else 400)
            out = result.as_numpy("output_ids")
            ids = [] if out is None else [int(t) for t in out]
            pending, last = pending + ids, ids[-1] if ids else last
            piece = result.as_numpy("text_output")
            text += "" if piece is None else piece[0].decode("utf-8")
            hit = min((i for s in stops if (i := text.find(s, max(0, sent - keep))) >= 0), default=-1)
            if hit >= 0:
                yield text[sent:hit], pending, "stop"
                return
            safe = max(sent, len(text) - keep if stops else len(text))  # hold back what could start a stop
            if safe > sent or (every_step and pending):
                yield text[sent:safe], pending, None
                sent, pending = safe, []
    except (AioRpcError, InferenceServerException) as e:
        if (why := dead()) is not None:
            raise _unavailable(why) from None
        raise FrontError(f"the Triton server did not answer: {_rpc_message(e)}", 502) from None
    finally:
        stream.cancel()  # ended already, or left early: then Triton cancels the request
    ended_at_eos = eos_id is not None and last == eos_id and not feed.get("ignore_eos")
    yield text[sent:], pending, "stop" if ended_at_eos else "length"


def _tensors(feed: dict) -> list:
    """The generate model's inputs (served.INPUTS: names, types) from a request's fields."""
    import numpy as np
    from tritonclient.grpc import InferInput
    from tritonclient.utils import triton_to_np_dtype

    out = []
    for name, value in feed.items():
        kind = INPUTS[name][0].removeprefix("TYPE_")
        array = np.asarray(value if isinstance(value, list) else [value], dtype=triton_to_np_dtype(kind))
        tensor = InferInput(name, list(array.shape), kind)
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def _rpc_message(e) -> str:
    return e.details() if hasattr(e, "details") else e.message()


class _Shape:
    """The objects of one answer, as OpenAI's API shapes them: a completion's text_completion (whole or each
    event of its stream), a chat's chat.completion or chat.completion.chunk (the first delta with the role)."""

    def __init__(self, model: str, chat: bool, prompt_ids: list[int] | None = None):
        self.chat, self.started = chat, False
        self.prompt_ids = prompt_ids  # return_token_ids: the prompt's ids in the first choice, each choice's own
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                     "model": model}

    def piece(self, text: str, ids: list[int], finish: str | None) -> dict:
        ids_of = self._ids(ids, first=not self.started)
        if not self.chat:
            self.started = True
            return self._doc("text_completion", {"text": text, "finish_reason": finish, **ids_of})
        delta = {"content": text} if self.started else {"role": "assistant", "content": text}
        self.started = True
        return self._doc("chat.completion.chunk", {"delta": delta, "finish_reason": finish, **ids_of})

    def whole(self, text: str, ids: list[int], finish: str | None, usage: dict) -> dict:
        choice = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {**self._doc("chat.completion" if self.chat else "text_completion",
                            {**choice, "finish_reason": finish, **self._ids(ids, first=True)}), "usage": usage}

    def _ids(self, ids: list[int], first: bool) -> dict:
        """vLLM's return_token_ids fields: the choice's token ids, and the prompt's in the first choice."""
        if self.prompt_ids is None:
            return {}
        return {"token_ids": ids, **({"prompt_token_ids": self.prompt_ids} if first else {})}

    def usage(self, usage: dict) -> dict:
        """The last event of a stream that asked for usage (stream_options.include_usage): no choices."""
        return {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion", "choices": [],
                "usage": usage}

    def _doc(self, kind: str, choice: dict) -> dict:
        return {**self.head, "object": kind, "choices": [{"index": 0, **choice, "logprobs": None}]}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _event(doc: dict) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


# -- what a person serving it reads -------------------------------------------------------------------------
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0)


class Metrics:
    """The front's Prometheus metrics, by vLLM's names under `andrea:` (one registry per front): requests by how
    they ended (answered to the end, by finish reason; refused or failed, by HTTP status; left by their client),
    time to first token, inter-token latency and end-to-end latency as the client sees them, prompt and
    generated tokens, completions in flight."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.success = Counter("andrea:request_success", "Completions answered to their end, by finish reason",
                               ["finished_reason"], registry=r)
        self.errors = Counter("andrea:request_errors", "Requests refused or failed, by HTTP status", ["code"],
                              registry=r)
        self.cancelled = Counter("andrea:requests_cancelled", "Completions whose client left before the end",
                                 registry=r)
        self.running = Gauge("andrea:num_requests_running", "Completions in flight (decoding or waiting for a slot)",
                             registry=r)
        self.prompt_tokens = Counter("andrea:prompt_tokens", "Prompt tokens of the completions started", registry=r)
        self.generation_tokens = Counter("andrea:generation_tokens", "Tokens generated and sent", registry=r)
        self.ttft = Histogram("andrea:time_to_first_token_seconds", "From the request to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("andrea:inter_token_latency_seconds", "Between a completion's successive tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("andrea:e2e_request_latency_seconds", "From the request to its last token",
                             buckets=E2E_BUCKETS, registry=r)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


async def _metered(tokens, m: Metrics, t0: float, prompt_tokens: int, state: dict):
    """`tokens` (pieces()) passed on, measured: its first token, the gaps between tokens, how it ended. It gives
    back the place among the completions in flight (state["in_flight"]) that _answer took for it, however it
    ends (its first step runs inside the try: even a first step that fails or is cancelled gives it back)."""
    import asyncio

    m.running.inc()
    m.prompt_tokens.inc(prompt_tokens)
    last, ended = None, False
    try:
        async for text, ids, finish in tokens:
            now, n = time.monotonic(), len(ids)
            if n:
                if last is None:
                    m.ttft.observe(now - t0)
                else:
                    for _ in range(n):
                        m.itl.observe((now - last) / n)
                m.generation_tokens.inc(n)
                last = now
            if finish:
                ended = True
                m.success.labels(finish).inc()
                m.e2e.observe(now - t0)
            yield text, ids, finish
    except (GeneratorExit, asyncio.CancelledError):
        if not ended:  # closed before its end: its client left
            m.cancelled.inc()
        raise
    finally:
        state["in_flight"] -= 1
        m.running.dec()
        await tokens.aclose()


# -- the app -----------------------------------------------------------------------------------------------
def make_app(model: Model, upstream: Upstream, *, api_key: str | None = None, limits: Limits = Limits(),
             allowed_origins: tuple[str, ...] = (), access_log: bool = False, metrics_open: bool = False):
    """The FastAPI app of one front, streaming from the generate model at `upstream`. `metrics_open`: /metrics
    answers without the API key (for a Prometheus scraper that sends none; it tells counts and latencies, never
    a prompt)."""
    from fastapi import Depends, FastAPI, Request
    from tritonclient.grpc.aio import InferenceServerClient

    metrics = Metrics()
    # and the upstream client, while the app runs; "dead": what of the server died (Front.fail), once it has
    state: dict = {"in_flight": 0, "metrics": metrics, "dead": None}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        state["client"] = InferenceServerClient(upstream.grpc)  # one channel: every request a stream of its own on it
        try:
            yield
        finally:
            await state["client"].close()

    # /openapi.json: what a client generator or a schema fuzzer (schemathesis, in the suite) reads; no /docs page
    app = FastAPI(title="andrea-export", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.metrics, app.state.front = metrics, state
    if access_log:
        app.add_middleware(_AccessLog)
    if allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    _answer_errors_as_openai_does(app)
    authorized = _key_check(api_key)

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        """Ready to serve: nothing of the server has died, and Triton says the model is READY (asked over gRPC
        each time); 503 with the reason otherwise. What a load balancer's or Kubernetes' probe asks."""
        from fastapi.responses import JSONResponse
        from tritonclient.utils import InferenceServerException

        why = state["dead"]
        if why is None:
            try:
                if not await state["client"].is_model_ready(upstream.model, client_timeout=HEALTH_TIMEOUT_S):
                    why = f"Triton does not have {upstream.model} READY"
            except InferenceServerException as e:
                why = f"Triton did not answer: {str(e)[:200]}"
        if why is None:
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable", "reason": why}, 503)

    @app.get("/metrics", dependencies=[] if metrics_open else [Depends(authorized)])
    async def prometheus():
        from fastapi.responses import Response
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    card = {"id": model.name, "object": "model", "created": 0, "owned_by": "andrea-export",
            "max_model_len": model.n_positions}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}", dependencies=[Depends(authorized)])
    async def one_model(name: str):
        if name != model.name:
            raise FrontError(f"model {name[:100]!r} is not served here; this server has {model.name!r}", 404,
                             "model_not_found")
        return card

    completion, chat = _completion_request()

    @app.post("/v1/completions", dependencies=[Depends(authorized)], openapi_extra=_body_schema(completion, model.name))
    async def completions(request: Request):
        return await _answer(request, parse(await read_body(request, limits), model), model, upstream, limits, state)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)], openapi_extra=_body_schema(chat, model.name))
    async def chat_completions(request: Request):
        return await _answer(request, parse_chat(await read_body(request, limits), model), model, upstream,
                             limits, state)

    return app


def _body_schema(kind, served: str) -> dict:
    """The OpenAPI requestBody of a route that reads its body itself (read_body's limits come first): the pydantic
    model's JSON schema, its $defs inlined (they would resolve against the OpenAPI document's root), its `model`
    the one served here."""
    schema = kind.model_json_schema()
    defs = schema.pop("$defs", {})
    schema["properties"]["model"] = {"anyOf": [{"const": served}, {"type": "null"}], "title": "Model"}

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            return inline(defs[ref.rsplit("/", 1)[1]]) if ref.startswith("#/$defs/") else \
                {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


async def _answer(request, c: Completion, model: Model, upstream: Upstream, limits: Limits, state: dict):
    """One completion or chat: checked against the limits, its prompt tokenized, its tokens from the generate
    model, answered whole or streamed."""
    from fastapi.responses import StreamingResponse

    metrics = state["metrics"]
    t0 = time.monotonic()
    if state["dead"] is not None:
        raise _unavailable(state["dead"])
    if state["in_flight"] >= limits.max_requests:  # before the prompt is rendered or tokenized
        raise FrontError(f"the server is busy: {limits.max_requests} completions in flight; retry later", 503)
    state["in_flight"] += 1  # taken before the first await, so that requests arriving meanwhile count it
    try:
        ids = await prompt_ids(c, model)
    except BaseException:
        state["in_flight"] -= 1  # _metered, which gives it back otherwise, never started
        raise
    tokens = _metered(pieces(state["client"], upstream.model, {"input_ids": ids, **c.feed}, c.stops, model.eos_id,
                             every_step=c.token_ids, dead=lambda: state["dead"]), metrics, t0, len(ids), state)
    try:
        first = await anext(tokens)  # an upstream error comes before any token: answer it as an error
    except BaseException:
        await tokens.aclose()
        raise
    shape = _Shape(model.name, c.chat, ids if c.token_ids else None)
    if c.stream:
        return StreamingResponse(_events(shape, first, tokens, len(ids), c, metrics),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _whole(request, shape, first, tokens, len(ids))


def _answer_errors_as_openai_does(app) -> None:
    """Every refusal, ours or the framework's (no such route, wrong method), as an OpenAI-shaped JSON error."""
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(FrontError)
    async def front_error(request, e: FrontError):
        if e.status != 499:  # a client that left is counted as cancelled
            request.app.state.metrics.errors.labels(str(e.status)).inc()
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(_error(str(e), _kind(e.status), e.code), e.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        request.app.state.metrics.errors.labels(str(e.status_code)).inc()
        message = f"no route {request.url.path[:200]}" if e.status_code == 404 else str(e.detail)
        return JSONResponse(_error(message, "not_found" if e.status_code == 404 else "invalid_request_error"),
                            e.status_code)


def _key_check(api_key: str | None):
    """The dependency each route but /health runs: the request's bearer token against `api_key`, in constant
    time (none set: every request passes)."""
    from fastapi import Request

    def authorized(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise FrontError("a valid API key is needed: Authorization: Bearer <key>", 401, "invalid_api_key")

    return authorized


async def _whole(request, shape: _Shape, first: tuple, answer, prompt_tokens: int) -> dict:
    """The completion in one JSON answer, with its usage; a client that leaves first ends the upstream request."""
    text, ids, finish = first
    try:
        async for t, more, f in answer:
            text, ids, finish = text + t, ids + more, f or finish
            if await request.is_disconnected():
                raise FrontError("the client left", 499)
    finally:
        await answer.aclose()
    return shape.whole(text, ids, finish, _usage(prompt_tokens, len(ids)))


async def _events(shape: _Shape, first: tuple, answer, prompt_tokens: int, c: Completion,
                  metrics: Metrics) -> AsyncIterator[bytes]:
    """The completion as server-sent events: each piece as it comes (with the usage so far, when asked for every
    chunk), the finish reason on the last, usage after it when asked, then [DONE]; an error after the first
    token is one final error event."""
    count = 0

    def piece(text: str, ids: list[int], finish: str | None) -> bytes:
        nonlocal count
        count += len(ids)
        doc = shape.piece(text, ids, finish)
        return _event({**doc, "usage": _usage(prompt_tokens, count)} if c.usage_every_chunk else doc)

    try:
        yield piece(*first)
        if first[2] is None:
            async for text, ids, finish in answer:
                yield piece(text, ids, finish)
        if c.include_usage:
            yield _event(shape.usage(_usage(prompt_tokens, count)))
    except FrontError as e:
        metrics.errors.labels(str(e.status)).inc()
        yield _event(_error(str(e), _kind(e.status), e.code))
    finally:
        await answer.aclose()
    yield b"data: [DONE]\n\n"


# -- running it --------------------------------------------------------------------------------------------
class Front:
    """A running front: uvicorn in a thread of its own, on a socket bound before it starts (so a port in use or
    a bad host is an OSError here, not a log line in that thread)."""

    def __init__(self, app, host: str, port: int, limits: Limits, drain_timeout_s: float = 30):
        import uvicorn

        self.app = app
        self.socket = socket.create_server((host, port), backlog=limits.backlog,
                                           family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", backlog=limits.backlog,
                                limit_concurrency=limits.max_connections, timeout_keep_alive=limits.keep_alive_s,
                                timeout_graceful_shutdown=math.ceil(drain_timeout_s), server_header=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name="andrea-openai-front", daemon=True)
        self.refusals = _CapRefusals(app.state.metrics, self.thread)
        uvicorn_log = logging.getLogger(_CapRefusals.LOGGER)
        uvicorn_log.addFilter(self.refusals)
        if not uvicorn_log.isEnabledFor(logging.WARNING):  # the CLI quiets libraries at ERROR: it would never log
            uvicorn_log.setLevel(logging.WARNING)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            self.stop(1)
            raise OSError(f"the front did not start on {host}:{port}")

    def fail(self, why: str) -> None:
        """What of the server died: /health answers 503 with it from now on, as does each new completion, and an
        upstream error of a completion in flight is said as it (the streams end with an error event)."""
        self.app.state.front["dead"] = why

    def stop(self, timeout: float = 60) -> None:
        """Stop accepting; let the answers in flight finish (each stream to its end or its error event)."""
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(5)
        with contextlib.suppress(OSError):
            self.socket.close()
        logging.getLogger(_CapRefusals.LOGGER).removeFilter(self.refusals)


class _CapRefusals(logging.Filter):
    """Counts the connections uvicorn refuses beyond max_connections among the front's errors (503). uvicorn
    answers those itself, before any middleware of ours runs (a connection whose headers never end holds its
    place too), and says so only in a warning on its logger, which the front keeps at WARNING so that the
    warning is made (and printed: a refusal is worth a line, as uvicorn alone prints it); the warnings of
    this front's thread are its own."""

    LOGGER, MESSAGE = "uvicorn.error", "Exceeded concurrency limit."

    def __init__(self, metrics: Metrics, thread: threading.Thread):
        super().__init__()
        self.metrics, self.thread = metrics, thread

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread == self.thread.ident and record.getMessage() == self.MESSAGE:
            self.metrics.errors.labels("503").inc()
        return True


class _AccessLog:
    """ASGI middleware: one line a request on ACCESS_LOG, when it ends: client, method, path, status, seconds."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.monotonic(), [0]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            client = scope.get("client") or ("-", 0)
            logging.getLogger(ACCESS_LOG).info('%s:%s "%s %s" %s %.3f s', client[0], client[1], scope["method"],
                                               scope["path"][:200], status[0] or "-", time.monotonic() - t0)


def start_front(model: Model, upstream: Upstream, host: str, port: int, *, api_key: str | None = None,
                limits: Limits = Limits(), allowed_origins: tuple[str, ...] = (), access_log: bool = False,
                drain_timeout_s: float = 30, metrics_open: bool = False) -> Front:
    """Serve the front on host:port (0: a free one) in a thread; OSError if it cannot listen there."""
    app = make_app(model, upstream, api_key=api_key, limits=limits, allowed_origins=allowed_origins,
                   access_log=access_log, metrics_open=metrics_open)
    return Front(app, host, port, limits, drain_timeout_s)

