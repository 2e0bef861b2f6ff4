"""Run an exported decoder: `load(path, backend)` -> Session with `forward(ids)` and `generate(prompt, ...)`.

    from andrea_export import runtime
    sess = runtime.load("andrea-build/")              # a build folder, or a decoder .onnx file
    new_ids = sess.generate([1, 2, 3], max_new_tokens=32, strategy="top-p", top_p=0.9, seed=0)
    batch = sess.generate([[1, 2, 3], [4, 5]], max_new_tokens=32, seed=0)    # one list of new ids per prompt

Backends: `onnxruntime` (any machine; CUDA provider when present) and `tensorrt` (GPU hosts, an engine
built from the same graph). `auto` takes TensorRT when the folder has an engine and TensorRT imports,
else ONNX Runtime. The model config and the cache layout come from the ONNX metadata, so a folder needs
nothing but the graph (and the engine, for TensorRT, which takes the cache's element type from the engine:
a `.plan` given alone may lie beside the fp32 `decoder.onnx` of an fp16 or bf16 build).

A session may be shared by many threads (see base.py): ONNX Runtime sessions run their calls in parallel,
TensorRT sessions one after another. Loading and generating import neither torch nor the build machinery:
a service needs numpy, onnx and onnxruntime (plus TensorRT and cuda-python for the engine).
"""

from __future__ import annotations

from pathlib import Path

from ..buildfolder import MANIFEST
from ..errors import installed
from ..graphs import read_decoder
from ..names import DECODER_FILE, TOKENIZER_FILE
from .base import InputError, Request, SerialSession, Session, Steps, check_ids
from .sampling import STRATEGIES, Sampling, next_token

BACKENDS = ("auto", "onnxruntime", "tensorrt")
ENGINE_FILE = "decoder.plan"  # the decoder engine beside a decoder.onnx (a build folder's manifest names its own)

__all__ = ["BACKENDS", "STRATEGIES", "InputError", "Request", "Sampling", "SerialSession", "Session", "Steps", "check_ids",
           "load", "next_token", "tokenizer_path"]


def tokenizer_path(path: str | Path) -> Path | None:
    """The tokenizer a build folder carries (`build --tokenizer`), or None. Always the fixed name inside
    the folder: no path is taken from the manifest."""
    path = Path(path)
    candidate = path / TOKENIZER_FILE
    return candidate if path.is_dir() and candidate.is_file() else None


def _resolve(path: Path, backend: str) -> tuple[Path, Path | None]:
    """(decoder ONNX, engine or None) for a build folder or a direct file path. A build folder gives ONNX
    Runtime its in-place decoder where it has one (`backend` "onnxruntime")."""
    if path.is_dir():
        if (path / MANIFEST).is_file():  # a build folder: its manifest names the graphs (decoder.fp16.onnx, ...)
            return _from_build(path, backend)
        onnx_path = path / DECODER_FILE
        if not onnx_path.is_file():
            raise InputError(f"{path}: no KV-cache decoder graph in this folder (expected {DECODER_FILE} or a manifest.json)")
        engine = path / ENGINE_FILE
        return onnx_path, engine if engine.is_file() else None
    if path.is_file():
        if path.suffix in (".plan", ".engine"):
            onnx_path = path.parent / DECODER_FILE
            if not onnx_path.is_file():
                raise InputError(f"{path}: a TensorRT engine needs its {DECODER_FILE} beside it (for the model config and cache layout)")
            return onnx_path, path
        return path, None
    raise InputError(f"no such build folder or ONNX file: {path}")


def _from_build(folder: Path, backend: str) -> tuple[Path, Path | None]:
    """A build folder's decoder graph and engine, after checking the manifest and that the files the chosen
    backend runs are still the ones built (sha256): a changed file is refused, never run."""
    from ..buildfolder import artifact, changed_artifacts, graph_weights, read_manifest

    m = read_manifest(folder, full=False, error=InputError)  # what decoding needs, each field checked
    roles = [r for r in ("decoder_onnx", "decoder_onnx_inplace", "decoder_engine", "decoder_engine_info")
             if r in m["artifacts"]]
    if "decoder_onnx" not in roles:
        raise InputError(f"{folder}: this build has no KV-cache decoder graph (it was built with --no-decoder); "
                         "rebuild it with the decoder to generate from it")
    if backend == "onnxruntime" and "decoder_onnx_inplace" in roles:  # the standard graph is not read then
        roles = [r for r in roles if r != "decoder_onnx"]
    if changed := changed_artifacts(folder, {"artifacts": {r: m["artifacts"][r] for r in roles}}):
        raise InputError(f"{folder}: {', '.join(changed)} changed since the build (sha256 differs); rebuild it")
    decoder = artifact(folder, m, "decoder_onnx_inplace" if "decoder_onnx_inplace" in roles and backend == "onnxruntime"
                       else "decoder_onnx")
    graph_weights(folder, m, decoder, InputError)  # the weights it points into are run too
    return decoder, artifact(folder, m, "decoder_engine") if "decoder_engine" in roles else None


def load(
    path: str | Path,
    backend: str = "auto",
    *,
    providers: list[str] | None = None,
    intra_op_threads: int | None = None,
    cuda_graph: bool = True,
) -> Session:
    """A Session for the decoder in `path` (a build folder with `decoder.onnx`, or the .onnx file itself).

    Args:
        backend: "auto", "onnxruntime" or "tensorrt".
        providers: ONNX Runtime execution providers (default: CUDA if available, then CPU).
        intra_op_threads: ONNX Runtime threads (default: ONNX Runtime's choice).
        cuda_graph: TensorRT only: replay the decode step as a CUDA graph (see runtime/trt.py).
    """
    if backend not in BACKENDS:
        raise InputError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "tensorrt" if _has_engine(Path(path)) and installed("tensorrt") else "onnxruntime"
    if backend == "onnxruntime" and not _cpu_only(providers):
        backend_graph = "onnxruntime-cuda"  # ONNX Runtime's CUDA GroupQueryAttention has no float32 kernels
    else:
        backend_graph = backend
    onnx_path, engine = _resolve(Path(path), backend_graph)
    cfg, layout = read_decoder(onnx_path)  # ExportError with a clear message for a graph without the KV layout
    if backend == "tensorrt":
        if engine is None:
            raise InputError(
                f"{path}: backend 'tensorrt' needs a decoder engine ({ENGINE_FILE}); "
                f"this has only the ONNX graph (build one with `andrea-export build`)"
            )
        from .trt import TrtSession

        sess = TrtSession(engine, cfg, layout, cuda_graph=cuda_graph)
    else:
        from .ort import OrtSession

        sess = OrtSession(onnx_path, cfg, layout, providers=providers, intra_op_threads=intra_op_threads)
    sess.weights_source = weights_source(onnx_path)
    return sess


def _has_engine(path: Path) -> bool:
    """Whether `path` names or holds a decoder engine (what `auto` needs before choosing a graph)."""
    if path.is_file():
        return path.suffix in (".plan", ".engine")
    if (path / MANIFEST).is_file():
        from ..buildfolder import read_manifest

        return "decoder_engine" in read_manifest(path, full=False, error=InputError)["artifacts"]
    return (path / ENGINE_FILE).is_file()


def _cpu_only(providers: list[str] | None) -> bool:
    """Whether ONNX Runtime will run on the CPU provider only (the providers given, else what is installed)."""
    import onnxruntime as ort

    chosen = providers or [p for p in ort.get_available_providers() if p in ("CUDAExecutionProvider", "CPUExecutionProvider")]
    return all(p == "CPUExecutionProvider" for p in chosen)


def weights_source(onnx_path: Path) -> dict:
    """What the graph's metadata records about its weights, checked ({} when nothing is recorded);
    {"kind": "random-init", ...} means the tokens are meaningless (the CLI says so)."""
    from ..buildfolder import check_weights_source, metadata_json
    from ..graphs import read_metadata
    from ..names import WEIGHTS_KEY

    meta = read_metadata(onnx_path)
    source = metadata_json(meta, WEIGHTS_KEY, onnx_path) if WEIGHTS_KEY in meta else {}
    if source != {}:
        check_weights_source(source, f"{onnx_path}: metadata '{WEIGHTS_KEY}'")
    return source
