"""`andrea-export serve BUILD`: a real Triton Inference Server on a build folder, its generate model batching in
flight and streaming tokens (deploy/triton/served.py), with an OpenAI-compatible front (openai_front.py).

    from andrea_export.deploy.server import start
    with start("out/andrea-120m-fp32", openai_port=9000) as server:    # waits until the model is READY
        print(server.endpoints())

The server is the `tritonserver` binary and Python backend that the `nvidia-pytriton` wheel ships (the
same server as NVIDIA's containers, with the Python backend only). That wheel pins numpy < 2, so it lives
in a serving environment of its own, made by `make serve-env` (.venv-serve: nvidia-pytriton and the
runtime's packages, andrea-export itself without its build dependencies); `--env`, $ANDREA_EXPORT_SERVE_ENV
or ./.venv-serve says where. The Python-backend stub runs the model in that environment's Python.

The front (openai_front.py) is the one listener meant for clients, and it streams from Triton over gRPC. Triton's
HTTP and metrics ports listen only when asked (`http_port`, `metrics_port`): both are Triton's HTTP layer, which a
body it cannot parse (a 6 MB form body; on the HTTP port also JSON nested 50,000 deep) crashes before anything of
ours runs, and any local process can reach a loopback port. Triton's ports stay on 127.0.0.1 unless
`triton_host` says otherwise, and even there shared memory, model control, tracing and logging answer only a
request that carries the admin key (Triton's restricted APIs; `Server.admin_key`). Every port is
checked free before anything starts, so a port held by another server is one clear error, never that server's
readiness taken for ours.

On a GPU host, serve the repository that `package --triton` writes with NVIDIA's Triton container instead
(docs/deploying.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import AndreaExportError

ENV_VAR = "ANDREA_EXPORT_SERVE_ENV"
DEFAULT_ENV = ".venv-serve"
_PROBE = """import json, sys, pathlib, pytriton
root = pathlib.Path(pytriton.__file__).parent
def version(module):
    try:
        m = __import__(module, fromlist=["_"])
    except Exception:
        return None
    return getattr(m, "__version__", "?") if module != "tensorrt" or hasattr(m, "Runtime") else None
print(json.dumps({"dist": str(root / "tritonserver"), "libs": str(root.parent / "nvidia_pytriton.libs"),
                  "python": f"{sys.version_info[0]}.{sys.version_info[1]}", "numpy": __import__("numpy").__version__,
                  "tensorrt": version("tensorrt"), "cuda": version("cuda.bindings.runtime") is not None}))
"""
# what the generate model steps (served.ENGINES, spelled here: importing the triton package pulls in onnx), or
# auto: serve_engine's choice
ENGINES = ("auto", "onnxruntime", "tensorrt")


ADMIN_HEADER = "andrea-admin-key"  # what Triton's restricted APIs ask of a request
RESTRICTED = "shared-memory,model-repository,trace,logging"  # Triton APIs no client of a model needs


class ServeError(AndreaExportError):
    """The server could not be started or did not become ready."""


@dataclasses.dataclass(frozen=True)
class FrontOptions:
    """The OpenAI-compatible front: where it listens, the key it asks for, the name it serves the model as, and
    what one client may take of it (openai_front.Limits)."""

    host: str = "127.0.0.1"
    port: int = 9000  # 0: a free one
    api_key: str | None = None
    served_model_name: str | None = None  # default: the Triton model's name
    limits: Any = None  # openai_front.Limits; None: its defaults
    allowed_origins: tuple[str, ...] = ()  # CORS, for browsers on those origins
    access_log: bool = False  # one line a request (no prompt text) on openai_front.ACCESS_LOG
    chat_template: str | None = None  # Hugging Face's Jinja format; None: the build tokenizer's, if it has one
    metrics_open: bool = False  # /metrics without the API key (a Prometheus scraper that sends none)


def serve_python(env: str | Path | None = None) -> Path:
    """The serving environment's Python: `env` (a venv folder or its python), $ANDREA_EXPORT_SERVE_ENV, else
    ./.venv-serve, else the .venv-serve of the checkout this package runs from (what `make serve-env` makes)."""
    chosen = env or os.environ.get(ENV_VAR)
    if chosen is None:
        checkout = Path(__file__).resolve().parents[2] / DEFAULT_ENV
        chosen = DEFAULT_ENV if Path(DEFAULT_ENV).exists() or not checkout.exists() else checkout
    path = Path(chosen)
    python = path if path.is_file() else path / "bin" / "python"
    if not python.is_file():
        raise ServeError(f"no serving environment at {path} (a Python with nvidia-pytriton, numpy < 2): make one with "
                         f"`make serve-env` in the project, or say where it is with --env or ${ENV_VAR}")
    return python


def triton_dist(python: Path) -> dict:
    """Where the serving environment's nvidia-pytriton keeps tritonserver, its libraries and stubs."""
    try:
        out = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True)
    except subprocess.CalledProcessError as e:
        last = (e.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise ServeError(f"{python}: nvidia-pytriton does not import there ({last[0]}); rerun `make serve-env`") from None
    info = json.loads(out.stdout)
    if int(info["numpy"].split(".")[0]) >= 2:
        raise ServeError(f"{python}: numpy {info['numpy']}; the Triton Python backend of nvidia-pytriton 0.7 needs "
                         "numpy < 2 (every response fails otherwise)")
    return info


def serve_engine(build_dir: str | Path, engine: str = "auto", env: str | Path | None = None) -> tuple[str, str]:
    """(what the generate model steps, why): `engine` checked (ServeError for what cannot run), or auto's choice:
    the build's slot engine (build --max-slots) when this host has a GPU and the serving Python (`env`, as
    serve_python finds it) has cuda-python and the TensorRT that built it; else ONNX Runtime on the CPU."""
    from ..catalog import Role
    from ..errors import gpu_compute_capability
    from .triton.common import builder_of, read_manifest  # a folder that is no build: PackageError, as packaging says

    if engine not in ENGINES:
        raise ServeError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    if engine == "onnxruntime":
        return engine, "ONNX Runtime on the CPU, as asked"
    manifest = read_manifest(build_dir)
    builder, built = builder_of(manifest)
    why, gpu = None, None
    if Role.SLOT_ENGINE not in manifest["artifacts"]:
        why = "the build has no in-flight batching engine (build --max-slots N on a GPU host, TensorRT >= 10.15)"
    elif builder != "tensorrt":
        why = f"its slot engine was built by {builder}, which the generate model does not run (TensorRT only)"
    elif (gpu := gpu_compute_capability()) is None:
        why = "this machine has no GPU (or no working driver) for its slot engine"
    else:
        dist = triton_dist(serve_python(env))
        have, fix = dist.get("tensorrt"), f"pip install tensorrt=={built} cuda-python into the serving environment"
        if have is None or not dist.get("cuda"):
            why = f"the serving Python has no {'TensorRT' if have is None else 'cuda-python'} for its slot engine ({fix})"
        elif have != built:
            why = (f"its slot engine was built by TensorRT {built} and the serving Python has {have}, which cannot "
                   f"load it ({fix})")
        else:
            return "tensorrt", f"TensorRT {have}: the build's slot engine on GPU 0 (compute capability {gpu})"
    if engine == "tensorrt":
        raise ServeError(f"{build_dir}: cannot serve on TensorRT: {why}")
    return "onnxruntime", f"ONNX Runtime on the CPU: {why}"


def free_ports(host: str, n: int, avoid: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """`n` ports free on `host`, none in `avoid` and no two the same: all bound at once, then let go. (Bound one at
    a time, each closed before the next, the system may hand out the port it just got back, and Triton given one
    port twice does not start.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < n:
            s = held.enter_context(socket.socket(family))
            s.bind((host, 0))
            if (port := s.getsockname()[1]) not in avoid:
                ports.append(port)
        return ports


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(host, 1)[0]


def triton_ports(host: str, http: int | None, grpc: int, metrics: int | None) -> dict[str, int]:
    """Triton's ports (HTTP and metrics only when not None): each one given checked free (ServeError in one line
    otherwise), each 0 a free one, all different (two the same are refused: Triton cannot listen twice on one
    port)."""
    asked = {k: p for k, p in (("http", http), ("grpc", grpc), ("metrics", metrics)) if p is not None}
    given = {kind: _check_free(host, p, f"Triton's {kind} port") for kind, p in asked.items() if p}
    if len(set(given.values())) < len(given):
        raise ServeError(f"Triton's ports must differ: {', '.join(f'{k} {p}' for k, p in given.items())}")
    picked = iter(free_ports(host, len(asked) - len(given), avoid=set(given.values())))
    return {kind: given[kind] if p else next(picked) for kind, p in asked.items()}


WORKSPACE_PREFIX = "andrea-serve-"
OWNER_FILE = "owner.pid"  # the pid of the process that made a workspace


def new_workspace() -> Path:
    """A new temporary folder for one server's model repository, backends and log, marked with our pid; the
    folders of servers whose process is gone (killed with -9: nothing could remove them) are removed first."""
    for stale in Path(tempfile.gettempdir()).glob(f"{WORKSPACE_PREFIX}*"):
        with contextlib.suppress(OSError, ValueError):
            pid = int((stale / OWNER_FILE).read_text())
            if pid != os.getpid() and not _alive(pid):
                shutil.rmtree(stale, ignore_errors=True)
    workspace = Path(tempfile.mkdtemp(prefix=WORKSPACE_PREFIX))
    (workspace / OWNER_FILE).write_text(str(os.getpid()))
    return workspace


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _check_free(host: str, port: int, what: str) -> int:
    """`port` on `host`, if nothing listens there (ServeError in one line otherwise, naming what wanted it).
    Port 0 checks the host alone."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is no listener
            s.bind((host, port))
    except socket.gaierror as e:
        raise ServeError(f"{what}: no such address {host!r} ({e.strerror})") from None
    except OSError as e:
        raise ServeError(f"{what}: cannot listen on {host}:{port} ({e.strerror}; another server? choose another "
                         "port, or 0 for a free one)") from None
    return port


STUB = "triton_python_backend_stub"  # the process the Python backend runs each model instance in
WATCH_EVERY_S = 0.2  # how often the watcher looks at tritonserver, the model's stubs and the front


class Server:
    """A running tritonserver (and its OpenAI front, when started with one), watched as one unit: when
    tritonserver, a Python-backend stub of its model or the front dies, `died` is set and `death` says what died
    and with what code; the front's /health fails from then on, new requests get 503, and the rest of Triton's
    process group is killed at once, so that the streams in flight end with an error event instead of hanging.
    `wait()` blocks until then, which is what `serve` does before it exits non-zero."""

    def __init__(self, process, workspace: Path, model: str, host: str, ports: dict, log: Path, admin_key: str):
        self.process, self.workspace, self.model, self.host, self.ports, self.log = process, workspace, model, host, ports, log
        self.admin_key = admin_key  # the ADMIN_HEADER value Triton's restricted APIs ask for (admin_headers)
        self.front: Any = None  # openai_front.Front, when started
        self.front_host = host
        self.served_model = model  # the name the front serves it as (--served-model-name)
        self.engine: tuple[str, str] | None = None  # (what the generate model steps, why), when start() chose it
        self.died = threading.Event()
        self.death: str | None = None  # what died, and with what code
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._stopped_code: int | None = None

    def admin_headers(self, kind: str = "http") -> dict[str, str]:
        """The header that opens Triton's restricted APIs to a request (gRPC prefixes its name, as Triton asks)."""
        return {("triton-grpc-protocol-" if kind == "grpc" else "") + ADMIN_HEADER: self.admin_key}

    def url(self, kind: str = "http") -> str:
        if kind not in self.ports:
            option = {"http": "--port", "metrics": "--metrics-port"}.get(kind, f"--{kind}-port")
            raise ServeError(f"Triton's {kind} port is not listening (start it with {kind}_port=N, `serve {option} N`)")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.ports[kind]}" if kind != "grpc" else f"{host}:{self.ports['grpc']}"

    def endpoints(self) -> dict[str, str]:
        out = {"grpc": self.url("grpc")}
        if "metrics" in self.ports:
            out["metrics"] = f"{self.url('metrics')}/metrics"
        if "http" in self.ports:
            out = {"http": self.url(), **out, "generate": f"{self.url()}/v2/models/{self.model}/generate",
                   "generate_stream": f"{self.url()}/v2/models/{self.model}/generate_stream"}
        if self.front is not None:
            host = f"[{self.front_host}]" if ":" in self.front_host else self.front_host
            out["openai"] = f"http://{host}:{self.ports['openai']}/v1"
            out["health"] = f"http://{host}:{self.ports['openai']}/health"  # ready to serve: a probe's route
        return out

    def log_tail(self, lines: int = 30) -> str:
        if not self.log.exists():
            return getattr(self, "final_log", "")
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait(self, timeout: float | None = None) -> str | None:
        """Until the server dies (then what died, as `death` says) or `timeout` seconds pass (then None)."""
        self.died.wait(timeout)
        return self.death

    def watch(self) -> None:
        """Start watching tritonserver and its model's stubs (those alive now: call it once the model is READY),
        and the front once it is set."""
        stubs = [pid for pid, name in group_members(self.process.pid) if name == STUB]
        self._watcher = threading.Thread(target=self._watch, args=(stubs,), name="andrea-serve-watcher", daemon=True)
        self._watcher.start()

    def _watch(self, stubs: list[int]) -> None:
        while not self._stopping.wait(WATCH_EVERY_S):
            if (why := self._what_died(stubs)) is not None and not self._stopping.is_set():
                self._die(why)
                return

    def _what_died(self, stubs: list[int]) -> str | None:
        if (code := self.process.poll()) is not None:
            return f"tritonserver exited with {_exit_words(code)}"
        for pid in stubs:
            if (status := _ended(pid)) is not False:
                how = "" if status is None else f" with {_exit_words(_wait_code(status))}"
                return f"the Python backend stub of {self.model} (pid {pid}) exited{how}"
        if self.front is not None and not self.front.thread.is_alive():
            return "the OpenAI front's server thread ended"
        return None

    def _die(self, why: str) -> None:
        """Fail /health and new requests first, then end Triton's whole group (what is left of it cannot serve):
        the streams in flight then fail at once and end with an error event."""
        self.death = why
        if self.front is not None:
            self.front.fail(why)
        end_group(self.process, grace=0)
        self.died.set()

    def stop(self, timeout: float = 60) -> int:
        """Stop accepting, let the requests in flight finish (Triton's own shutdown on SIGTERM, up to its
        exit timeout), end what is left of Triton's process group (a stub outlives a killed tritonserver
        otherwise), then remove the workspace. Returns tritonserver's exit code. Safe to call again."""
        self._stopping.set()
        if self._stopped_code is not None:
            return self._stopped_code
        if self.front is not None:  # first, while Triton still answers its streams
            self.front.stop(timeout if self.death is None else min(timeout, 2))
        code = end_group(self.process, grace=timeout)
        self.final_log = self.log_tail()  # the workspace (and the log in it) goes now
        shutil.rmtree(self.workspace, ignore_errors=True)
        self._stopped_code = code
        return code

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def group_members(pgid: int) -> list[tuple[int, str]]:
    """(pid, name) of the live processes of process group `pgid` (zombies, which hold nothing, left out), read
    from /proc: what Triton started (its stubs) is in its group, as it runs in a session of its own."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            name = Path((entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")).name
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append((int(entry.name), name))
    return members


def end_group(process, grace: float) -> int:
    """End `process` (a group leader: started in a session of its own) and its whole group: SIGTERM and up to
    `grace` seconds for its own shutdown (0: none), then SIGKILL for the group, and wait until no process of it
    is left (an orphaned stub that ignores SIGTERM included). Returns the leader's exit code."""
    if process.poll() is None and grace > 0:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
    deadline = time.monotonic() + 10
    while True:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        code = process.poll()
        if (code is not None and not group_members(process.pid)) or time.monotonic() > deadline:
            return code if code is not None else process.wait()
        time.sleep(0.05)


def _ended(pid: int) -> bool | int | None:
    """False while process `pid` lives; once it has ended, its wait status while it is a zombie (Linux 3.5+),
    else None (reaped: its code is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] != "Z":
        return False
    return int(fields[49]) if len(fields) > 49 else None  # field 52 of proc(5): exit_code


def _wait_code(status: int) -> int:
    """A wait status as Popen.returncode says it: the exit code, or minus the signal that ended it."""
    return -(status & 0x7F) if status & 0x7F else status >> 8


def _exit_words(code: int) -> str:
    if code >= 0:
        return f"code {code}"
    try:
        return f"code {code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"code {code}"


def start(build_dir: str | Path, *, host: str = "127.0.0.1", http_port: int | None = None, grpc_port: int = 8001,
          metrics_port: int | None = None, openai_port: int | None = None, front: FrontOptions | None = None,
          slots: int | None = None,
          prefill_chunk: int = 64, step_tokens: int | None = None, admit: str = "in-flight",
          env: str | Path | None = None, ready_timeout: float = 180, exit_timeout: int = 30,
          admin_key: str | None = None, engine: str = "auto") -> Server:
    """Start tritonserver on `build_dir`'s generate model (read where it is) and wait until it is READY
    (ServeError with the server's log when it does not get there), then the OpenAI front when `front` is given
    (or `openai_port`: the front with its defaults on that port). `host`: where Triton's ports listen. Port 0:
    a free one; `http_port`, `metrics_port` None: that port of Triton's does not listen (the front needs only
    its gRPC). `engine`: what the generate model steps (serve_engine; Server.engine says which, and why)."""
    from .triton.generate import write_generate_model

    if front is None and openai_port is not None:
        front = FrontOptions(port=openai_port)
    if front is not None:  # before anything is written or started
        if front.api_key is not None and not front.api_key.strip():
            raise ServeError("the API key is empty: give one (--api-key, $ANDREA_EXPORT_API_KEY) or none")
        _check_front_packages()
        _check_free(front.host, front.port, "the OpenAI front")

    chosen, why = serve_engine(build_dir, engine, env)
    workspace = new_workspace()
    try:
        model = write_generate_model(build_dir, workspace / "models", slots=slots, prefill_chunk=prefill_chunk,
                                     step_tokens=step_tokens, admit=admit, in_place=True, engine=chosen).name
    except BaseException:
        shutil.rmtree(workspace, ignore_errors=True)
        raise
    server = start_repository(workspace / "models", model, host=host, http_port=http_port, grpc_port=grpc_port,
                              metrics_port=metrics_port, env=env, ready_timeout=ready_timeout,
                              exit_timeout=exit_timeout, workspace=workspace, admin_key=admin_key)
    server.engine = (chosen, why)
    if front is not None:
        try:
            _start_front(server, build_dir, front, exit_timeout)
        except BaseException:
            server.stop(timeout=10)
            raise
    return server


def _check_front_packages() -> None:
    import importlib.util

    if missing := [m for m in ("fastapi", "uvicorn", "tritonclient") if importlib.util.find_spec(m) is None]:
        raise ServeError(f"the OpenAI front needs {', '.join(missing)}: pip install 'andrea-export[serve]' "
                         "(or serve without it: --no-openai)")


def _start_front(server: Server, build_dir, opts: FrontOptions, drain_timeout: float) -> None:
    from ..folder.reader import read_manifest
    from .openai_front import Limits, Model, Upstream, start_front

    cfg = read_manifest(build_dir, full=False)["model"]
    from ..runtime import eos_id

    from .openai_front import chat_renderer

    template = opts.chat_template or _chat_template(build_dir)
    try:
        if template is not None:
            chat_renderer(template)
    except ValueError as e:
        raise ServeError(str(e)) from None
    model = Model(opts.served_model_name or server.model, cfg["n_positions"], cfg["vocab_size"], _tokenizer(build_dir),
                  eos_id(build_dir), template)
    upstream = Upstream(server.url("grpc"), server.model)
    try:
        server.front = start_front(model, upstream, opts.host, opts.port, api_key=opts.api_key,
                                   limits=opts.limits or Limits(), allowed_origins=opts.allowed_origins,
                                   access_log=opts.access_log, drain_timeout_s=drain_timeout,
                                   metrics_open=opts.metrics_open)
    except OSError as e:
        raise ServeError(f"the OpenAI front cannot listen on {opts.host}:{opts.port}: {e.strerror or e}") from None
    server.ports["openai"], server.front_host, server.served_model = server.front.port, opts.host, model.name


def start_repository(repo: str | Path, model: str, *, host: str = "127.0.0.1", http_port: int | None = None,
                     grpc_port: int = 8001, metrics_port: int | None = None, env: str | Path | None = None,
                     ready_timeout: float = 180, exit_timeout: int = 30, workspace: Path | None = None,
                     admin_key: str | None = None) -> Server:
    """Start tritonserver on a model repository (`package --triton` writes one) and wait until `model` is READY.
    The server's backends and log go to `workspace` (a new temporary folder by default), removed by stop().
    `http_port`, `metrics_port` None: that port does not listen.
    `admin_key`: what Triton's restricted APIs ask for (default: a new random one, Server.admin_key)."""
    workspace = workspace or new_workspace()
    try:
        python = serve_python(env)
        dist = triton_dist(python)
        ports = triton_ports(host, http_port, grpc_port, metrics_port)
        admin_key = admin_key or secrets.token_urlsafe(24)
        guard = f"{RESTRICTED}:{ADMIN_HEADER}={admin_key}"
        backends = workspace / "backends"
        shutil.copytree(Path(dist["dist"]) / "backends", backends)  # the stub for this Python goes beside the backend
        shutil.copy(Path(dist["dist"]) / "python_backend_stubs" / dist["python"] / "triton_python_backend_stub",
                    backends / "python" / "triton_python_backend_stub")
        cmd = [str(Path(dist["dist"]) / "bin" / "tritonserver"), f"--model-repository={Path(repo).resolve()}",
               f"--backend-directory={backends}", f"--cache-directory={Path(dist['dist']) / 'caches'}",
               *([f"--http-address={host}", f"--http-port={ports['http']}", f"--http-restricted-api={guard}"]
                 if "http" in ports else ["--allow-http=false"]),
               f"--grpc-address={host}", f"--grpc-port={ports['grpc']}", f"--grpc-restricted-protocol={guard}",
               *([f"--metrics-address={host}", f"--metrics-port={ports['metrics']}", "--allow-gpu-metrics=false"]
                 if "metrics" in ports else ["--allow-metrics=false"]),
               f"--exit-timeout-secs={exit_timeout}", "--strict-readiness=true"]
        child_env = dict(os.environ, PATH=f"{python.parent}:{os.environ.get('PATH', '')}",
                         LD_LIBRARY_PATH=":".join(filter(None, [os.environ.get("LD_LIBRARY_PATH"), dist["libs"]])))
        log = workspace / "tritonserver.log"
        with open(log, "wb") as out:
            # its own session (a Ctrl-C reaches us, and we drain it), but it dies with us, kill -9 included
            process = subprocess.Popen(_die_with_parent(cmd), stdout=out, stderr=subprocess.STDOUT, env=child_env,
                                       start_new_session=True)
    except BaseException:
        shutil.rmtree(workspace, ignore_errors=True)
        raise
    server = Server(process, workspace, model, host, ports, log, admin_key)
    try:
        _wait_ready(server, ready_timeout)
    except KeyboardInterrupt:
        server.stop(timeout=10)
        raise
    except Exception as e:
        tail = server.log_tail()
        server.stop(timeout=10)
        raise ServeError(f"{e}; the server's log ends:\n{tail}") from None
    server.watch()
    return server


def _die_with_parent(cmd: list[str]) -> list[str]:
    """`cmd` run so that it gets SIGTERM when the process that started it ends (PR_SET_PDEATHSIG, which
    survives the exec), so a `serve` killed with -9 leaves no tritonserver behind: through util-linux's
    setpriv where there is one (a preexec_fn would be unsafe beside the front's threads)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *cmd] if setpriv else cmd


def _tokenizer(build_dir):
    """The build's tokenizer (the OpenAI front tokenizes text prompts), or None."""
    from ..runtime import tokenizer_path

    path = tokenizer_path(build_dir)
    if path is None:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def _chat_template(build_dir) -> str | None:
    """The chat template of the build's tokenizer (tokenizer_config.json's `chat_template`), or None."""
    from ..runtime import read_tokenizer_config

    template = read_tokenizer_config(build_dir).get("chat_template")
    return template if isinstance(template, str) and template.strip() else None


def _wait_ready(server: Server, timeout: float) -> None:
    """Until Triton says our model is READY over gRPC (the port every server has), or ServeError."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    deadline = time.monotonic() + timeout
    client = grpcclient.InferenceServerClient(server.url("grpc"))
    try:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise ServeError(f"tritonserver exited with code {server.process.returncode}")
            with contextlib.suppress(InferenceServerException):
                if client.is_model_ready(server.model, client_timeout=2) and server.process.poll() is None:
                    return  # ours: its ports were free before it
            time.sleep(0.25)
    finally:
        client.close()
    raise ServeError(f"the model was not READY after {timeout:.0f} s")
