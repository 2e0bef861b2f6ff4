"""`serve` watched as one unit: when tritonserver or its model's Python-backend stub dies, /health fails at once,
the streams in flight end with an OpenAI-shaped error event, and the server (Python API) says what died or
(`serve`) exits non-zero within 5 s for its service manager to restart it, leaving no process of Triton's behind.
A live server nobody can use is the one failure a load balancer cannot see."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from andrea_export.deploy import server as serve_module
from servers import alive, children, needs_serving_env  # tests/ is on the path


@pytest.fixture(autouse=True)
def _serving(long_build):
    needs_serving_env()


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _post(url: str, doc: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(doc).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _stream_until_first(url: str, events: list[bytes]) -> threading.Thread:
    """A 2000-token stream (a chunk a step: return_token_ids) whose events go into `events`; returns once the
    first has come."""
    doc = {"prompt": [1, 2], "max_tokens": 2000, "ignore_eos": True, "stream": True, "return_token_ids": True}

    def run():
        req = urllib.request.Request(f"{url}/completions", data=json.dumps(doc).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            events.extend(line for line in r if line.startswith(b"data: "))

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events, "the stream did not start"
    return t


def test_a_stub_that_dies_fails_health_ends_the_streams_with_an_error_and_leaves_nothing(long_build):
    s = serve_module.start(long_build, grpc_port=0, openai_port=0, slots=2)
    try:
        base = s.endpoints()["openai"]
        health = base.removesuffix("/v1") + "/health"
        assert _get(health) == (200, {"status": "ok"})
        events: list[bytes] = []
        t = _stream_until_first(base, events)
        (stub,) = [pid for pid, name in serve_module.group_members(s.process.pid) if name == serve_module.STUB]
        os.kill(stub, signal.SIGKILL)
        died = s.wait(5)
        assert died is not None and f"stub of {s.model} (pid {stub}) exited with code -9 (SIGKILL)" in died
        status, answer = _get(health)
        assert status == 503 and answer["reason"] == died
        t.join(30)
        assert not t.is_alive() and events[-1] == b"data: [DONE]\n"
        error = json.loads(events[-2][6:])["error"]
        assert died in error["message"] and error["type"] == "server_error"
        assert len(events) < 2000  # it ended there, not after its tokens
        status, answer = _post(f"{base}/completions", {"prompt": [1, 2], "max_tokens": 2})
        assert status == 503 and died in answer["error"]["message"]
        assert serve_module.group_members(s.process.pid) == []  # tritonserver went with its stub
    finally:
        code = s.stop(10)
    assert code == -signal.SIGKILL and not s.workspace.exists()


def test_serve_exits_1_within_5_s_when_tritonserver_crashes_and_says_what_died(long_build):
    """Triton's HTTP port, asked for, is crashed by a 6 MB form body (SIGSEGV, as `serve --help` warns): serve
    notices, says so in one line and exits 1, its whole process group gone, streams in flight ended."""
    port = serve_module.free_port()
    proc = subprocess.Popen([sys.executable, "-m", "andrea_export", "serve", str(long_build), "--port", str(port),
                             "--grpc-port", "0", "--openai-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Serving;"):
                break
        (front,) = [line.split()[1] for line in lines if line.split()[:1] == ["openai"]]
        triton = children(proc.pid)
        events: list[bytes] = []
        t = _stream_until_first(front, events)
        body = b"a=" + b"x" * 6_000_000
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(f"POST /v2/models/andrea-long-fp32-generate/generate HTTP/1.1\r\nHost: x\r\n"
                      f"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                      + body)
            with contextlib.suppress(OSError):  # the server dies under it
                assert c.recv(1024) == b""
        t0 = time.monotonic()
        rest, _ = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1 and took < 5, (took, rest)
    said = [line for line in rest.splitlines() if "tritonserver exited with code -11 (SIGSEGV)" in line]
    assert len(said) == 1 and "serve stops" in said[0] and "Traceback" not in rest, rest
    t.join(10)
    assert events[-1] == b"data: [DONE]\n" and "error" in json.loads(events[-2][6:])
    assert triton and not any(alive(pid) for pid in triton)
