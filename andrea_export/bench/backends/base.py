"""What every backend shares: the Backend interface, the Unavailable error, and the Context (model,
threads, exported ONNX files cached per weights fingerprint)."""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

from ...errors import AndreaExportError
from ...model.andrea import Andrea
from ...names import DECODER_FILE, INPLACE_DECODER_FILE
from ..harness import Timer, cpu_timer


class Unavailable(AndreaExportError):
    """A backend (or one scenario of it) cannot run here; the message says why."""


class Context:
    """What every backend shares: the model, its config, the thread count, and the exported ONNX files
    (made once per weights fingerprint and cached under `workdir`)."""

    def __init__(self, model: Andrea, threads: int, workdir: Path, quiet: bool = True):
        self.model = model.float().cpu().eval()
        self.cfg = model.cfg
        self.threads = threads
        self.workdir = Path(workdir)
        self.quiet = quiet
        self.fingerprint = weights_fingerprint(self.model)
        self._ones = torch.ones(0)

    def ones(self, n: int) -> torch.Tensor:
        """n float32 ones, a view of one buffer that every caller of this run shares (grown when a caller
        needs more): the memory readers of a case each held 2.4 GB of their own at batch 32 past 1023."""
        if self._ones.numel() < n:
            self._ones = torch.ones(n)
        return self._ones[:n]

    def cached(self, name: str, export: Callable[[Path], object]) -> Path:
        """workdir/<model>-<weights>-<exporter>/name, made by export(path) when it is not there yet."""
        path = self.workdir / f"{self.cfg.name}-{self.fingerprint}-{_exporter_fingerprint()}" / name
        if not path.is_file():
            export(path)
        return path

    def prefill_onnx(self) -> Path:
        from ...graphs.export import export_onnx

        return self.cached("model.onnx", lambda p: export_onnx(self.model, p, quiet=self.quiet))

    def decoder_onnx(self) -> Path:
        try:
            from ...graphs.kvcache import export_decoder_onnx
        except ImportError as e:
            raise Unavailable(f"no KV-cache decoder export in this andrea-export ({e})") from None
        return self.cached(DECODER_FILE, lambda p: export_decoder_onnx(self.model, p, quiet=self.quiet))

    def inplace_decoder_onnx(self) -> Path:
        """The in-place KV-cache decoder (graphs/inplace_decoder.py), beside decoder.onnx under the name a build
        gives it: what ONNX Runtime's CPU provider and onnxruntime-genai run."""
        try:
            from ...graphs.inplace_decoder import export_inplace_decoder
        except ImportError as e:
            raise Unavailable(f"no in-place decoder export in this andrea-export ({e})") from None
        return self.cached(INPLACE_DECODER_FILE, lambda p: export_inplace_decoder(self.model, p, quiet=self.quiet))

    def quantized(self, fp32: Path, precision: str) -> Path:
        """The weight-only `precision` ("int8" / "int4") graph of the fp32 export `fp32` (graphs/quantize.py),
        cached beside it as <stem>.<precision>.onnx: int4's weights solved on the standard graph as a build's are,
        its head at 4 bits whatever choose_head_bits would say (the bytes the bench's rows count)."""
        from ...graphs.quantize import quantize_weights, solve_int4

        def write(path: Path) -> Path:
            solved = solve_int4(self.prefill_onnx()) if precision == "int4" else None
            return quantize_weights(fp32, path, precision, solved=solved)

        return self.cached(f"{fp32.stem}.{precision}.onnx", write)


def _exporter_fingerprint() -> str:
    """sha256 (8 hex digits) of the sources that shape the exported graphs, so a changed exporter never
    reuses a stale cached file."""
    from ...graphs import export, inplace_decoder, kvcache, layout, precision, quantize
    from ...model import andrea

    h = hashlib.sha256()
    for module in (andrea, export, kvcache, inplace_decoder, layout, quantize, precision):
        h.update(Path(inspect.getfile(module)).read_bytes())  # by module, not by file name: a moved file still counts
    h.update(torch.__version__.encode())
    return h.hexdigest()[:8]


def default_cache_dir() -> Path:
    """Where exported ONNX files are cached between runs: $ANDREA_EXPORT_CACHE/bench, else ~/.cache/andrea-export/bench."""
    from ...folder.atomic import cache_dir

    return cache_dir("bench")


def weights_fingerprint(model: Andrea) -> str:
    """sha256 (16 hex digits) of the config and every tensor of the state dict: names the cached exports."""
    h = hashlib.sha256(json.dumps(model.cfg.to_dict(), sort_keys=True).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class Backend:
    """One way to run the model. Each scenario method returns a zero-argument callable that runs one
    iteration synchronously (inputs bound once, outside the timed call)."""

    name = "?"
    device = "cpu"
    timer: Timer = staticmethod(cpu_timer)
    spins = False  # its threads spin-wait after a call (the harness then waits longer before the next call)

    def check(self) -> str | None:
        """None when the backend can run here, else the reason it cannot."""
        return None

    def setup(self, ctx: Context) -> dict:
        """Prepare (sessions, engines). Returns facts for the report (threads, providers, ...)."""
        return {}

    def prepare(self, scenarios: Iterable[str]) -> None:
        """Do the slow one-off work (exports, session loads) before the timed cases; Unavailable if impossible."""

    def timer_for(self, scenario: str) -> Timer:
        """The clock for a scenario's calls (CUDA events for device work; wall clock for host loops)."""
        return self.timer

    def prefill(self, ids: np.ndarray) -> Callable[[], object]:
        raise Unavailable(f"{self.name}: prefill not implemented")

    def decode(self, ids: np.ndarray, mask: np.ndarray, past: list[np.ndarray]) -> Callable[[], object]:
        raise Unavailable(f"{self.name}: decode not implemented")

    def generate(self, prompt: np.ndarray, new_tokens: int) -> Callable[[], object]:
        raise Unavailable(f"{self.name}: generate not implemented")
