"""What TensorRT says while it builds: the one ILogger adapter (warnings and errors for our messages, the
builder's layer listing), rich progress bars for its build phases, and the engine's layer report."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
from typing import Any

from ..errors import gpu_compute_capability
from ..progress import console


def expected_warning(message: str) -> bool:
    """Parser warnings every build of our graphs gives, which tell the user nothing."""
    return (
        ("Make sure input " in message and "has Int64 binding" in message)  # our int64 inputs are by design
        # each expanded call of a model-local function (the plugin graph on RTX) reuses the body's node names
        or "already exists, the output tensors of this new instance will not be queryable" in message
    )


def make_logger(trt: Any):
    """A TensorRT logger that collects warnings and errors for messages, and the builder's layer listing."""

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []
            self.warnings: list[str] = []
            self.layers_text: str | None = None
            self._lock = threading.Lock()

        def log(self, severity, msg):
            S = trt.ILogger.Severity
            with self._lock:
                if severity in (S.INTERNAL_ERROR, S.ERROR):
                    self.errors.append(msg.strip())
                elif severity == S.WARNING:
                    self.warnings.append(msg.strip())
                elif msg.startswith("Layers:\n"):
                    self.layers_text = msg

    return Logger()


def progress_monitor(trt, show: bool, title: str):
    """A TensorRT IProgressMonitor drawing rich progress bars, one per running build phase."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.interrupted = False
            self._tasks: dict[str, tuple[TaskID, int]] = {}  # phase -> (task id, depth)
            self._lock = threading.Lock()
            self._progress = (
                Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                         console=console, transient=True)
                if show else None
            )

        def __enter__(self):
            if self._progress:
                self._progress.start()
                console.print(title)
            return self

        def __exit__(self, *exc):
            if self._progress:
                self._progress.stop()

        def phase_start(self, phase_name, parent_phase, num_steps):
            try:
                with self._lock:
                    depth = self._tasks[parent_phase][1] + 1 if parent_phase in self._tasks else 0
                    tid = self._progress.add_task("  " * depth + phase_name, total=num_steps) if self._progress else TaskID(-1)
                    self._tasks[phase_name] = (tid, depth)
            except BaseException:  # Ctrl-C lands in whichever Python code runs: cancel the build
                self.interrupted = True

        def step_complete(self, phase_name, step):
            try:
                with self._lock:
                    if self._progress and phase_name in self._tasks:
                        self._progress.update(self._tasks[phase_name][0], completed=step + 1)
            except BaseException:
                self.interrupted = True
            return not self.interrupted  # False asks TensorRT to cancel the build

        def phase_finish(self, phase_name):
            try:
                with self._lock:
                    tid, _ = self._tasks.pop(phase_name, (None, 0))
                    if self._progress and tid is not None:
                        self._progress.remove_task(tid)
            except BaseException:
                self.interrupted = True

    return Monitor()


@contextlib.contextmanager
def ctrl_c_cancels(monitor):
    """While TensorRT builds, Ctrl-C (SIGINT) only marks `monitor` interrupted, and the monitor's next
    callback asks TensorRT to cancel: raised inside a callback (the logger's, say), the KeyboardInterrupt
    would be swallowed by the C++ side or turn into a 'BuildCanceled' failure. The caller raises it after."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread; elsewhere Ctrl-C does not reach a build anyway
        return

    def handler(signum, frame):
        monitor.interrupted = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def layer_report(trt, builder: str, serialized, logger) -> tuple[dict | None, str]:
    """The engine inspector's JSON where the engine deserializes here, else the builder's layer log."""
    reason = None
    if gpu_compute_capability() is None:
        reason = "no GPU here (an engine deserializes only on a GPU it targets)"
    else:
        try:
            engine = trt.Runtime(logger).deserialize_cuda_engine(serialized)
            if engine is None:
                reason = "the engine does not deserialize on this GPU"
            else:
                inspector = engine.create_engine_inspector()
                info = json.loads(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
                return {"source": "engine inspector", "builder": builder, **info}, "engine inspector"
        except Exception as e:  # the inspector is a report, never a reason to fail a finished build
            reason = f"{type(e).__name__}: {e}"
    source = f"builder log (engine inspector not available: {reason})"
    if not logger.layers_text:
        return None, f"not available: {reason}; the builder logged no layer listing"
    layers = []
    for line in logger.layers_text.splitlines()[1:]:
        m = re.match(r"Name: (?P<name>.*?), LayerType: (?P<type>[^,]*),", line)
        if not m:
            continue
        tactic = re.search(r"TacticName: ([^,]*),", line)
        layers.append({
            "name": m["name"],
            "type": m["type"],
            "tactic": tactic.group(1).strip() if tactic else "",
            "onnx_nodes": re.findall(r"\[ONNX Layer: ([^\]]+)\]", line),
        })
    return {"source": source, "builder": builder, "layers": layers}, source
