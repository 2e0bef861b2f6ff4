"""Run an exported decoder: `load(path, backend)` -> Session with `forward(ids)` and `generate(prompt, ...)`.

    from andrea_export import runtime
    sess = runtime.load("andrea-build/")              # a build folder, or a decoder .onnx file
    new_ids = sess.generate([1, 2, 3], max_new_tokens=32, strategy="top-p", top_p=0.9, seed=0)
    batch = sess.generate([[1, 2, 3], [4, 5]], max_new_tokens=32, seed=0)    # one list of new ids per prompt

Backends: `onnxruntime` (any machine; CUDA provider when present), `tensorrt` (GPU hosts, an engine
built from the same graph) and `openvino` (CPUs; the same fp32 graph computed in bf16 where the CPU has
bf16 instructions: see openvino.py). `auto` takes TensorRT when the folder has an engine and TensorRT imports,
else ONNX Runtime. The model config and the cache layout come from the ONNX metadata, so a folder needs
nothing but the graph (and the engine, for TensorRT, which takes the cache's element type from the engine:
a `.plan` given alone may lie beside the fp32 `decoder.onnx` of an fp16 or bf16 build).

A session may be shared by many threads (see base.py): ONNX Runtime sessions run their calls in parallel,
TensorRT sessions one after another. Loading and generating import neither torch nor the build machinery:
a service needs numpy, onnx and onnxruntime (plus TensorRT and cuda-python for the engine).

Generation stops at the end-of-text token where the build's tokenizer names one (`Session.eos_id`; `ignore_eos`
runs on to `max_new_tokens`), as transformers, vLLM and llama.cpp stop by default.
"""

from __future__ import annotations

from pathlib import Path

from ..catalog import TABLE, Role, decoder_graph
from ..errors import InputError, installed
from ..folder.reader import MANIFEST
from ..graphs.layout import read_decoder_meta
from ..names import DECODER_FILE, EOT, TOKENIZER_FILE
from .base import Request, SerialSession, Session, Steps, check_ids
from .sampling import STRATEGIES, Sampling, next_token

BACKENDS = ("auto", "onnxruntime", "tensorrt", "openvino")
ENGINE_FILE = TABLE[Role.DECODER_ENGINE].file  # the decoder engine beside a decoder.onnx (a build folder's manifest names its own)

__all__ = ["BACKENDS", "STRATEGIES", "InputError", "Request", "Sampling", "SerialSession", "Session", "Steps", "check_ids",
           "default_backend", "eos_id", "has_slot_engine", "load", "next_token", "read_tokenizer_config", "tokenizer_path"]


def tokenizer_path(path: str | Path) -> Path | None:
    """The tokenizer a build folder carries (`build --tokenizer`), or None. Always the fixed name inside the
    folder (no path is taken from the manifest), and in a build folder only as its manifest records it: a
    tokenizer changed, added or linked out of the folder after the build is refused (InputError), since it
    would silently change the prompt's ids."""
    path = Path(path)
    candidate = path / TOKENIZER_FILE
    if not path.is_dir() or not (candidate.exists() or candidate.is_symlink()):
        return None
    from ..folder.reader import changed_artifacts, inside

    manifest = _build_manifest(path)
    if manifest is None:  # a bare decoder folder: no record to check against, but no link out of it
        return inside(path, TOKENIZER_FILE, str(candidate), InputError, flat=True)
    recorded = manifest["artifacts"].get(Role.TOKENIZER)
    if recorded is None or recorded["path"] != TOKENIZER_FILE:
        raise InputError(f"{candidate}: not recorded in {path / MANIFEST} as the build's tokenizer: the folder was "
                         "changed after the build; rebuild it, or give the tokenizer with --tokenizer")
    if changed_artifacts(path, {"artifacts": {Role.TOKENIZER: recorded}}):
        raise InputError(f"{candidate}: changed since the build (sha256 differs from the manifest's); rebuild it, "
                         "or give the tokenizer with --tokenizer")
    return candidate


def read_tokenizer_config(path: str | Path) -> dict:
    """The tokenizer_config.json beside the tokenizer a build folder carries ({} without either), held to the
    tokenizer's rules: the fixed name inside the folder, and in a build folder as its manifest records it."""
    from .. import userfiles
    from ..folder.reader import changed_artifacts, inside
    from ..names import TOKENIZER_CONFIG_FILE

    path = Path(path)
    if tokenizer_path(path) is None or not (path / TOKENIZER_CONFIG_FILE).exists():
        return {}
    file = inside(path, TOKENIZER_CONFIG_FILE, str(path / TOKENIZER_CONFIG_FILE), InputError, flat=True)
    manifest = _build_manifest(path)
    if manifest is not None:
        recorded = manifest["artifacts"].get(Role.TOKENIZER_CONFIG)
        if recorded is None or recorded["path"] != TOKENIZER_CONFIG_FILE or changed_artifacts(
                path, {"artifacts": {Role.TOKENIZER_CONFIG: recorded}}):
            raise InputError(f"{file}: not the one {path / MANIFEST} records (changed after the build); rebuild it")
    config = userfiles.read_json(file, userfiles.MAX_JSON_BYTES, "a tokenizer_config.json", InputError)
    if not isinstance(config, dict):
        raise InputError(f"{file}: not a tokenizer_config.json (a JSON object)")
    return config


def eos_id(path: str | Path) -> int | None:
    """The end-of-text token of the tokenizer a build folder carries (tokenizer_config.json's `eos_token`,
    else EOT), or None: no tokenizer, or none of that name. Read as JSON (nothing of the tokenizers package)."""
    from .. import userfiles

    tok = tokenizer_path(path)
    if tok is None:
        return None
    name = read_tokenizer_config(path).get("eos_token", EOT)
    data = userfiles.read_json(tok, userfiles.MAX_TOKENIZER_BYTES, "a tokenizer.json", InputError)
    if not isinstance(name, str) or not isinstance(data, dict):
        return None
    for added in data.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == name and isinstance(added.get("id"), int):
            return added["id"]
    vocab = (data.get("model") or {}).get("vocab")
    found = vocab.get(name) if isinstance(vocab, dict) else None
    return found if isinstance(found, int) and not isinstance(found, bool) else None


def _resolve(path: Path, backend: str, manifest: dict | None) -> tuple[Path, Path | None]:
    """(decoder ONNX, engine or None) for a build folder (its validated `manifest`) or a direct file path.
    A build folder gives ONNX Runtime its in-place decoder where it has one (`backend` "onnxruntime")."""
    if manifest is not None:
        return _from_build(path, manifest, backend)
    if path.is_dir():
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


def _build_manifest(path: Path) -> dict | None:
    """The validated manifest of a build folder (what decoding needs, each field checked), or None for
    anything else; read once per load."""
    if not (path.is_dir() and (path / MANIFEST).is_file()):
        return None
    from ..folder.reader import read_manifest

    return read_manifest(path, full=False, error=InputError)


def _from_build(folder: Path, m: dict, backend: str) -> tuple[Path, Path | None]:
    """A build folder's decoder graph and engine, after checking that every file the chosen backend reads
    is still the one built (sha256): a changed file is refused, never run. ONNX Runtime reads its graph
    (in-place on the CPU where there is one) and the weights it points into, never the engine; TensorRT
    the standard graph (config, layout), the engine and its sidecar, and the weights (a stripped engine's refit)."""
    from ..folder.reader import artifact, changed_artifacts
    from ..graphs.external_data import graph_weights

    have = m["artifacts"]
    if Role.DECODER_ONNX not in have:
        raise InputError(f"{folder}: this build has no KV-cache decoder graph (it was built with --no-decoder); "
                         "rebuild it with the decoder to generate from it")
    graph = decoder_graph(backend, have)
    roles = [graph] + [r for r in (Role.DECODER_ENGINE, Role.DECODER_ENGINE_INFO) if backend == "tensorrt" and r in have]
    if changed := changed_artifacts(folder, {"artifacts": {r: have[r] for r in roles}}):
        raise InputError(f"{folder}: {', '.join(changed)} changed since the build (sha256 differs); rebuild it")
    decoder = artifact(folder, m, graph)
    graph_weights(folder, m, decoder, InputError)  # the weights it points into are run too
    return decoder, artifact(folder, m, Role.DECODER_ENGINE) if Role.DECODER_ENGINE in have else None


def load(
    path: str | Path,
    backend: str = "auto",
    *,
    providers: list[str] | None = None,
    intra_op_threads: int | None = None,
    cuda_graph: bool = True,
    inference_precision: str = "default",
    kv_cache_precision: str = "default",
    in_flight: bool = False,
) -> Session:
    """A Session for the decoder in `path` (a build folder with `decoder.onnx`, or the .onnx file itself).

    Args:
        backend: "auto", "onnxruntime", "tensorrt" or "openvino" (never chosen by "auto").
        providers: ONNX Runtime execution providers (default: CUDA if available, then CPU).
        intra_op_threads: ONNX Runtime's (or OpenVINO's) threads (default: the runtime's choice).
        cuda_graph: TensorRT only: replay the decode step as a CUDA graph (see runtime/trt.py).
        inference_precision: OpenVINO only: "default" (bf16 where the CPU has it), "bf16" or "f32".
        kv_cache_precision: OpenVINO only: the fused attention's cache, "default" (OpenVINO's: u8 on x86; f32
            with inference_precision "f32"), "u8", "f16", "bf16" or "f32".
        in_flight: TensorRT only: the build's in-flight batching engine (decoder.slots.plan, `build --max-slots`):
            a TrtSlotSession, whose slot_cache the batcher steps (runtime/trt_slots.py).
    """
    if in_flight:
        if backend != "tensorrt":
            raise InputError(f"in_flight runs the TensorRT slot engine: backend 'tensorrt', not {backend!r}")
        return _load_slot_engine(Path(path))
    if backend not in BACKENDS:
        raise InputError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    path = Path(path)
    manifest = _build_manifest(path)
    if backend == "auto":
        backend = _auto(path, manifest)
    for setting, value in (("inference_precision", inference_precision), ("kv_cache_precision", kv_cache_precision)):
        if backend != "openvino" and value != "default":
            raise InputError(f"{setting} is an OpenVINO setting; backend {backend!r} computes in the graph's precision")
    if backend == "onnxruntime" and not _cpu_only(providers):
        backend_graph = "onnxruntime-cuda"  # ONNX Runtime's CUDA GroupQueryAttention has no float32 kernels
    else:
        backend_graph = backend
    onnx_path, engine = _resolve(path, backend_graph, manifest)
    # one check of the graph; ExportError with a clear message for a graph without the KV layout
    cfg, layout, meta = read_decoder_meta(onnx_path)
    if backend == "tensorrt":
        if engine is None:
            raise InputError(
                f"{path}: backend 'tensorrt' needs a decoder engine ({ENGINE_FILE}); "
                f"this has only the ONNX graph (build one with `andrea-export build`)"
            )
        from .trt import TrtSession

        sess: Session = TrtSession(engine, cfg, layout, cuda_graph=cuda_graph)
    elif backend == "openvino":
        from .openvino import OpenVinoSession

        sess = OpenVinoSession(onnx_path, cfg, layout, inference_precision=inference_precision, threads=intra_op_threads,
                               kv_cache_precision=kv_cache_precision)  # fmt: skip
    else:
        from .ort import OrtSession

        sess = OrtSession(onnx_path, cfg, layout, providers=providers, intra_op_threads=intra_op_threads)
    sess.weights_source = weights_source(meta, onnx_path)
    eos = eos_id(path) if path.is_dir() else None
    sess.eos_id = eos if eos is not None and 0 <= eos < cfg.vocab_size else None
    return sess


def _load_slot_engine(folder: Path) -> Session:
    """The TrtSlotSession of a build folder's slot engine, its files checked as every load checks them."""
    from ..folder.reader import artifact, changed_artifacts
    from ..graphs.external_data import graph_weights

    m = _build_manifest(folder)
    if m is None or Role.SLOT_ENGINE not in m["artifacts"]:
        raise InputError(f"{folder}: no in-flight batching engine ({TABLE[Role.SLOT_ENGINE].file}) in this build; "
                         "build it with `andrea-export build --max-slots N` on the GPU host (TensorRT >= 10.15)")
    have = m["artifacts"]
    roles = [r for r in (Role.DECODER_ONNX_SLOTS, Role.SLOT_ENGINE_ONNX, Role.SLOT_ENGINE, Role.SLOT_ENGINE_INFO)
             if r in have]
    if changed := changed_artifacts(folder, {"artifacts": {r: have[r] for r in roles}}):
        raise InputError(f"{folder}: {', '.join(changed)} changed since the build (sha256 differs); rebuild it")
    graph = artifact(folder, m, Role.DECODER_ONNX_SLOTS)
    graph_weights(folder, m, graph, InputError)
    cfg, layout, meta = read_decoder_meta(graph)
    from .trt_slots import TrtSlotSession

    sess = TrtSlotSession(artifact(folder, m, Role.SLOT_ENGINE), cfg, layout)
    sess.weights_source = weights_source(meta, graph)
    eos = eos_id(folder)
    sess.eos_id = eos if eos is not None and 0 <= eos < cfg.vocab_size else None
    return sess


def has_slot_engine(path: str | Path) -> bool:
    """Whether `path` is a build folder holding the in-flight batching engine."""
    m = _build_manifest(Path(path))
    return m is not None and Role.SLOT_ENGINE in m["artifacts"]


def default_backend(path: str | Path) -> tuple[str, str | None]:
    """(the backend `generate` runs `path` on, a line saying why when it computes otherwise than the build): TensorRT
    where `load`'s "auto" takes it; else OpenVINO for a build that verified OpenVINO in bf16 and measured it
    decoding faster than ONNX Runtime (the manifest's "cpu_decode", verify/openvino.py's decode_race), on a CPU
    that computes in bf16 too, with ONNX Runtime on the CPU only; else ONNX Runtime. `load(path, "auto")` itself
    never takes OpenVINO: bf16 is not the fp32 build's arithmetic, so a program asks for it by name."""
    import importlib.util

    path = Path(path)
    manifest = _build_manifest(path)
    if _auto(path, manifest) == "tensorrt":
        return "tensorrt", None
    verification = (manifest or {}).get("verification") or {}
    race, runtimes = verification.get("cpu_decode"), verification.get("runtimes")
    from .openvino import check_name

    name = check_name("bf16")
    race = race if isinstance(race, dict) else {}
    speeds = race.get("tokens_per_s")
    if (not isinstance(speeds, dict) or race.get("faster") != name or not isinstance(runtimes, dict)
            or runtimes.get(name) is not True or not _cpu_only(None) or importlib.util.find_spec("openvino") is None):
        return "onnxruntime", None
    from .openvino import cpu_has_bf16

    ours, theirs = speeds.get(name), speeds.get("onnxruntime")
    if not cpu_has_bf16() or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (ours, theirs)):
        return "onnxruntime", None
    return "openvino", (f"running on OpenVINO in bf16: the build verified it ({name}) and measured it decoding "
                        f"{ours:.0f} tokens/s against ONNX Runtime's {theirs:.0f} in fp32; --backend onnxruntime "
                        "computes in fp32")


def _auto(path: Path, manifest: dict | None) -> str:
    """`load`'s "auto": TensorRT where `path` holds a decoder engine and TensorRT imports, else ONNX Runtime."""
    return "tensorrt" if _has_engine(path, manifest) and installed("tensorrt") else "onnxruntime"


def _has_engine(path: Path, manifest: dict | None) -> bool:
    """Whether `path` names or holds a decoder engine (what `auto` needs before choosing a graph)."""
    if path.is_file():
        return path.suffix in (".plan", ".engine")
    if manifest is not None:
        return Role.DECODER_ENGINE in manifest["artifacts"]
    return (path / ENGINE_FILE).is_file()


def _cpu_only(providers: list[str] | None) -> bool:
    """Whether ONNX Runtime will run on the CPU provider only (the providers given, else what is installed)."""
    import onnxruntime as ort

    chosen = providers or [p for p in ort.get_available_providers() if p in ("CUDAExecutionProvider", "CPUExecutionProvider")]
    return all(p == "CPUExecutionProvider" for p in chosen)


def weights_source(meta: dict[str, str], onnx_path: Path) -> dict:
    """What a graph's metadata records about its weights, checked ({} when nothing is recorded);
    {"kind": "random-init", ...} means the tokens are meaningless (the CLI says so)."""
    from ..folder.reader import check_weights_source, metadata_json
    from ..names import WEIGHTS_KEY

    source = metadata_json(meta, WEIGHTS_KEY, onnx_path) if WEIGHTS_KEY in meta else {}
    if source != {}:
        check_weights_source(source, f"{onnx_path}: metadata '{WEIGHTS_KEY}'")
    return source
