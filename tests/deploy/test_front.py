"""The OpenAI front on its own (deploy/openai_front.py), with no Triton behind it: what it refuses before any work
reaches the model, and what /health and /metrics answer. Quick: a front starts in a blink; the heavy tier's
test_serve.py serves real completions through it."""

from __future__ import annotations

import gzip
import http.client
import json

import pytest

pytest.importorskip("fastapi", reason="the 'serve' extra runs the front")

from andrea_export.deploy.openai_front import Limits, Model, Upstream, chat_renderer, start_front  # noqa: E402
from andrea_export.deploy.server import free_port  # noqa: E402
from andrea_export.model.text import PLAIN_CHAT_TEMPLATE  # noqa: E402

N_POSITIONS = 128


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(demo_dir / "tokenizer.json"))


def _front(tokenizer, template: str = PLAIN_CHAT_TEMPLATE, **kw):
    """A front whose upstream is a port nothing listens on: every request that passes its checks gets 502."""
    model = Model("andrea", N_POSITIONS, 8449, tokenizer, eos_id=0, chat_template=template)
    return start_front(model, Upstream(f"127.0.0.1:{free_port()}", "andrea-generate"), "127.0.0.1", 0,
                       limits=Limits(max_body_bytes=4096, read_timeout_s=5), **kw)


@pytest.fixture(scope="module")
def front(tokenizer):
    f = _front(tokenizer)
    yield f
    f.stop(5)


def _send(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None,
          chunks: list[bytes] | None = None) -> tuple[int, dict]:
    """One request as given (`chunks`: the body in Transfer-Encoding chunked, no Content-Length)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.putrequest(method, path)
        head = dict(headers or {})
        if chunks is None:
            head.setdefault("Content-Length", str(len(body)))
        else:
            head["Transfer-Encoding"] = "chunked"
        for k, v in head.items():
            c.putheader(k, v)
        c.endheaders()
        if chunks is not None:
            for piece in chunks:
                c.send(b"%x\r\n%s\r\n" % (len(piece), piece))
            c.send(b"0\r\n\r\n")
        elif body:
            c.send(body)
        r = c.getresponse()
        data = r.read()
        return r.status, json.loads(data or b"{}") if r.getheader("content-type", "").endswith("json") else {}
    finally:
        c.close()


def _chat(messages, **fields) -> bytes:
    return json.dumps({"messages": messages, **fields}).encode()


def test_health_is_ready_to_serve_not_the_front_is_up(tokenizer):
    """/health asks Triton whether the model is READY: with no Triton behind the front it is a 503 saying so, and
    once the server has said what died (Front.fail), that reason."""
    f = _front(tokenizer)
    try:
        status, answer = _send(f.port, "GET", "/health")
        assert status == 503 and answer["reason"].startswith("Triton did not answer"), answer
        f.fail("tritonserver exited with code -11 (SIGSEGV)")
        assert _send(f.port, "GET", "/health") == (503, {"status": "unavailable",
                                                         "reason": "tritonserver exited with code -11 (SIGSEGV)"})
        status, answer = _send(f.port, "POST", "/v1/completions", json.dumps({"prompt": [1], "max_tokens": 1}).encode())
        assert status == 503 and answer["error"]["type"] == "server_error" and "SIGSEGV" in answer["error"]["message"]
    finally:
        f.stop(5)


@pytest.mark.parametrize("metrics_open", [False, True], ids=["metrics-behind-the-key", "open-metrics"])
def test_metrics_asks_the_key_unless_opened(tokenizer, metrics_open):
    f = _front(tokenizer, api_key="sesame", metrics_open=metrics_open)
    try:
        status, _ = _send(f.port, "GET", "/metrics")
        assert status == (200 if metrics_open else 401)
        assert _send(f.port, "GET", "/metrics", headers={"Authorization": "Bearer sesame"})[0] == 200
        assert _send(f.port, "GET", "/v1/models")[0] == 401  # the rest stays behind the key
    finally:
        f.stop(5)


def test_a_chunked_body_is_counted_as_it_comes(front):
    """No Content-Length to refuse it by: the bytes are counted as they arrive, 413 past --max-body-bytes."""
    status, answer = _send(front.port, "POST", "/v1/completions", chunks=[b'{"prompt": "' + b"a" * 1000] * 8)
    assert status == 413 and "over the 4,096 bytes" in answer["error"]["message"]
    status, _ = _send(front.port, "POST", "/v1/completions", chunks=[b'{"prompt": [1, 2], ', b'"max_tokens": 2}'])
    assert status == 502  # within the limit: checked, then sent on (nothing listens upstream here)


def test_a_compressed_body_is_refused_unread(front):
    """A gzip body of 1 KB that inflates to 1 GB: the front inflates nothing, and says so."""
    bomb = gzip.compress(b'{"prompt": "' + b"a" * (1 << 20), compresslevel=9)
    status, answer = _send(front.port, "POST", "/v1/completions", bomb, {"Content-Encoding": "gzip"})
    assert status == 415 and "Content-Encoding 'gzip' is not accepted" in answer["error"]["message"]


@pytest.mark.parametrize("messages, fields, message", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}], {}, "messages.0.content"),
    ([{"role": "user", "content": {"text": "x"}}], {}, "messages.0.content"),
    ([{"content": "x"}], {}, "messages.0.role"),
    ([{"role": 5, "content": "x"}], {}, "messages.0.role"),
    ([], {}, "messages"),
    ("x", {}, "messages"),
    ([{"role": "user", "content": "x"}], {"max_completion_tokens": 0}, "max_completion_tokens"),
], ids=["image-part", "content-object", "no-role", "role-number", "no-messages", "messages-string", "zero-tokens"])
def test_odd_messages_are_refused_naming_the_field(front, messages, fields, message):
    status, answer = _send(front.port, "POST", "/v1/chat/completions", _chat(messages, **fields))
    assert status == 400 and answer["error"]["message"].startswith(message), answer


@pytest.mark.parametrize("field, value", [("top_k", 2**31), ("top_k", 386244569107484), ("max_tokens", 2**40)])
def test_numbers_past_the_generate_models_input_types_are_refused(front, field, value):
    """Each number is bounded by the type of the generate model's input before Triton sees it: past INT32 the
    tensor cannot be built, and inside gRPC's request iterator that error becomes a cancel (a 500)."""
    status, answer = _send(front.port, "POST", "/v1/completions",
                           json.dumps({"prompt": [1, 2], "max_tokens": 2, field: value}).encode())
    assert status == 400 and field in answer["error"]["message"], answer


def test_odd_roles_and_text_parts_are_rendered_not_refused(front):
    """A role the template does not know is its business (the plain template prints the text), and content parts
    of type text are joined: such a chat passes the front's checks (and meets the missing upstream)."""
    messages = [{"role": "🙂", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "", "content": None}, {"role": "tool", "content": "c", "name": "x"}]
    assert _send(front.port, "POST", "/v1/chat/completions", _chat(messages, max_tokens=2))[0] == 502


def test_ten_thousand_messages_are_refused_by_the_context_before_tokenizing(tokenizer):
    """300 KB of short messages, under a body limit that lets them in: the rendered prompt is refused by its
    length against the context, before the tokenizer sees it."""
    body = _chat([{"role": "user", "content": "a"}] * 10_000)
    f = start_front(Model("andrea", N_POSITIONS, 8449, tokenizer, chat_template=PLAIN_CHAT_TEMPLATE),
                    Upstream(f"127.0.0.1:{free_port()}", "m"), "127.0.0.1", 0,
                    limits=Limits(max_body_bytes=len(body) + 1))
    try:
        status, answer = _send(f.port, "POST", "/v1/chat/completions", body)
    finally:
        f.stop(5)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}{% for i in range(99999) %}{{ m.content }}{% endfor %}{% endfor %}",
     "rendered these messages into more than"),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "more than 100,000 items"),
    ("{{ 'x' * 1000000000 }}", "repeated a value into more than 100,000 items"),
    ("{{ messages * 1000000000 }}", "repeated a value"),
], ids=["megabytes-of-text", "nested-ranges", "string-times-a-billion", "list-times-a-billion"])
def test_a_chat_template_that_would_render_megabytes_is_stopped(tokenizer, template, message):
    """A short message list, a template that would render a gigabyte or loop 10^10 times: the render stops at
    what the context can hold (or the range budget), a 400, and the front goes on."""
    f = _front(tokenizer, template=template)
    try:
        status, answer = _send(f.port, "POST", "/v1/chat/completions", _chat([{"role": "user", "content": "hello"}]))
        assert status == 400 and message in answer["error"]["message"], answer
        assert _send(f.port, "GET", "/health")[0] == 503  # still answering
    finally:
        f.stop(5)


def test_the_renderer_bounds_each_render_not_the_template():
    """The range budget is a render's own: a template that ranges 60,000 renders twice in a row."""
    render = chat_renderer("{% for i in range(60000) %}{% endfor %}{{ messages[0].content }}")
    assert render([{"role": "user", "content": "a"}]) == render([{"role": "user", "content": "a"}]) == "a"


def test_the_openapi_schema_describes_what_the_front_checks(front):
    """/openapi.json (what a client generator or schemathesis reads) gives each POST route its request body, the
    pydantic model the front checks it with, and the one model served here."""
    status, doc = _send(front.port, "GET", "/openapi.json")
    assert status == 200 and {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(doc["paths"])
    for path, required in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert required in schema["required"] and "$ref" not in json.dumps(schema)
        assert schema["properties"]["model"]["anyOf"][0] == {"const": "andrea"}
        assert schema["properties"]["top_k"]["anyOf"][0]["maximum"] == 2**31 - 1
