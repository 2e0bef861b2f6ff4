"""An OpenAI-compatible front for `serve`: /v1/models and /v1/completions (streaming as server-sent events), in
front of the Triton server as Triton's own OpenAI frontend is, so the official `openai` client, LangChain and
load tools (aiperf, guidellm) talk to the generate model unchanged.

A thin layer, not a second engine: each completion is one request to the generate model's
/generate_stream, its tokens passed on as they come. Supported: prompt (one string, or one list of token
ids), max_tokens (default 16), temperature (default 1; 0: greedy), top_p, seed, stop (strings, matched in
the text; the upstream request is dropped there, which frees its slot), stream. n > 1, echo, logprobs,
best_of and suffix are refused with a 400 naming them.
"""

from __future__ import annotations

import functools
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_BODY = 1 << 20
UNSUPPORTED = ("echo", "logprobs", "best_of", "suffix", "logit_bias")


class FrontError(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def start_front(server, host: str, port: int, tokenizer=None) -> ThreadingHTTPServer:
    """Serve the front on host:port in a daemon thread; `server` is the running deploy.server.Server."""
    httpd = ThreadingHTTPServer((host, port), _handler(server, tokenizer))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="andrea-openai-front", daemon=True).start()
    return httpd


def _handler(server, tokenizer) -> type[CompletionsHandler]:
    """The handler class of one front: CompletionsHandler bound to the server's model and its upstream."""
    upstream = f"{server.url()}/v2/models/{server.model}/generate_stream"
    return type("Handler", (CompletionsHandler,), {"model": server.model, "upstream": upstream, "tokenizer": tokenizer})


class CompletionsHandler(BaseHTTPRequestHandler):
    """/health, /v1/models and /v1/completions, each completion one upstream request to the generate model."""

    protocol_version = "HTTP/1.1"
    model: str = ""
    upstream: str = ""  # the generate model's /generate_stream
    tokenizer = None

    def log_message(self, *args):  # quiet: Triton logs the requests
        pass

    def do_GET(self):
        if self.path in ("/health", "/v1/health"):
            return self._json(200, {"status": "ok"})
        if self.path == "/v1/models":
            return self._json(200, {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                                "owned_by": "andrea-export"}]})  # fmt: skip
        self._json(404, _error(f"no route {self.path}", "not_found"))

    def do_POST(self):
        try:
            body = self._body()  # read before any answer, so the connection stays in step
        except FrontError as e:
            self.close_connection = True
            return self._json(e.status, _error(str(e)))
        if self.path != "/v1/completions":
            return self._json(404, _error(f"no route {self.path}", "not_found"))
        try:
            feed, stops, stream = _translate(body, self.model)
        except FrontError as e:
            return self._json(e.status, _error(str(e)))
        chunk = functools.partial(_chunk, f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), self.model)
        pieces = _completion(self.upstream, feed, stops)
        try:
            first = next(pieces)  # an upstream error comes before any token: answer it as an error
        except FrontError as e:
            return self._json(e.status, _error(str(e)))
        if stream:
            self._stream(chunk, first, pieces)
        else:
            self._whole(chunk, first, pieces, feed)

    def _whole(self, chunk, first: tuple, pieces, feed: dict) -> None:
        """The completion in one JSON answer, with its token usage."""
        text, count, finish = first[0], first[1], first[2]
        for t, n, f in pieces:
            text, count, finish = text + t, count + n, f or finish
        doc = chunk(text, finish)
        doc["usage"] = _usage(self.tokenizer, feed, count)
        self._json(200, doc)

    def _stream(self, chunk, first: tuple, pieces) -> None:
        """The completion as server-sent events, each piece as it comes; a client that leaves drops the
        upstream request too."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            self._event(chunk(first[0], first[2]))
            if not first[2]:
                for text, _, finish in pieces:
                    self._event(chunk(text, finish))
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            pieces.close()
        except FrontError as e:
            self._event({"error": _error(str(e))["error"]})
        self.close_connection = True

    def _body(self) -> dict:
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") or length is None or not length.strip().isdigit():
            raise FrontError("a JSON body with a Content-Length is needed", 411)
        n = int(length)
        if n > MAX_BODY:
            raise FrontError(f"request body of {n} bytes is over the {MAX_BODY} allowed", 413)
        try:
            body = json.loads(self.rfile.read(n) or b"{}")
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise FrontError(f"the body is not JSON: {str(e)[:200]}") from None
        if not isinstance(body, dict):
            raise FrontError("the body must be a JSON object")
        return body

    def _event(self, doc):
        self.wfile.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
        self.wfile.flush()

    def _json(self, status: int, doc: dict):
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _chunk(cid: str, created: int, model: str, text: str, finish: str | None = None) -> dict:
    """One text_completion object: the whole answer, or one event of a stream."""
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}  # fmt: skip


def _error(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _translate(body: dict, model: str) -> tuple[dict, list[str], bool]:
    """The generate model's inputs for an OpenAI completions request, its stop strings and whether it streams."""
    if body.get("model") not in (None, model):
        raise FrontError(f"model {body.get('model')!r} is not served here; this server has {model!r}", 404)
    for key in UNSUPPORTED:
        if body.get(key) not in (None, False, 0):
            raise FrontError(f"{key} is not supported by this server")
    if body.get("n", 1) != 1:
        raise FrontError("n: only 1 completion per request is supported")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    feed: dict = {}
    if isinstance(prompt, str):
        feed["text_input"] = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        feed["input_ids"] = prompt
    else:
        raise FrontError("prompt: one string or one list of token ids")
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise FrontError("max_tokens: an integer")
    feed["max_tokens"] = max_tokens
    temperature = body.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
        raise FrontError("temperature: a number >= 0")
    feed["temperature"] = float(temperature)
    for key, kind in (("top_p", (int, float)), ("seed", int)):
        if body.get(key) is not None:
            if not isinstance(body[key], kind) or isinstance(body[key], bool):
                raise FrontError(f"{key}: a {'number' if key == 'top_p' else 'integer'}")
            feed[key] = body[key]
    stop = body.get("stop") or []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise FrontError("stop: a string or up to 4 non-empty strings")
    feed["stream"] = True
    return feed, stops, bool(body.get("stream", False))


def _completion(upstream: str, feed: dict, stops: list[str]):
    """(new text, tokens, finish_reason or None) pieces from the generate model's stream; stops at a stop string
    (closing the upstream request, so its slot is freed at the next step)."""
    req = urllib.request.Request(upstream, data=json.dumps(feed).encode(), headers={"Content-Type": "application/json"})
    try:
        resp = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as e:
        raise FrontError(_upstream_error(e.read()), 400 if e.code < 500 else 502) from None
    except OSError as e:
        raise FrontError(f"the Triton server did not answer: {e}", 502) from None
    text, count, keep = "", 0, max((len(s) for s in stops), default=1) - 1
    sent = 0
    with resp:
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            doc = json.loads(line[6:])
            if "error" in doc:
                raise FrontError(str(doc["error"]))
            ids = doc.get("output_ids", [])
            count += len(ids) if isinstance(ids, list) else 1
            text += doc.get("text_output", "")
            hit = min((i for s in stops if (i := text.find(s, max(0, sent - keep))) >= 0), default=-1)
            if hit >= 0:
                yield text[sent:hit], count, "stop"
                return
            safe = len(text) - keep if stops else len(text)  # hold back what could start a stop string
            if safe > sent:
                yield text[sent:safe], count, None
                sent, count = safe, 0
    yield text[sent:], count, "length"  # the generate model ended it: max_tokens, or a stop id


def _upstream_error(body: bytes) -> str:
    """The message of Triton's error body (JSON, or one server-sent event of it from /generate_stream)."""
    text = body.decode(errors="replace").strip()
    try:
        return str(json.loads(text.removeprefix("data:").strip()).get("error", text))
    except (ValueError, AttributeError):
        return text


def _usage(tokenizer, feed: dict, completion_tokens: int) -> dict:
    prompt = len(feed["input_ids"]) if "input_ids" in feed else (
        len(tokenizer.encode(feed["text_input"]).ids) if tokenizer is not None else 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}
