"""A Triton Inference Server model repository from a build folder.

    write_triton_repo("build/", "models/")  ->  models/<name>/config.pbtxt
                                                models/<name>/1/model.plan         (TensorRT backend)
                                             or models/<name>/1/model.onnx         (ONNX Runtime backend)
                                             or models/<name>/1/model.onnx/model.onnx + its weight file(s)
                                                models/<name>/andrea-build.json    (the build's manifest, for provenance)

What is served is the stateless full-sequence model: `input_ids` int64 [batch, seq] -> `logits`
[batch, seq, vocab]. Names, data types and dims are read from the build's ONNX file (an engine has the
same I/O as the ONNX it was built from); the engine's batch limits come from the manifest's
optimization profiles.

Decisions, and why:
- `config.pbtxt` is printed from Triton's own `ModelConfig` protobuf message (tritonclient's
  `model_config_pb2`) with `google.protobuf.text_format`, so its field names, enums and nesting are
  valid by construction. A `#` comment header says where it came from and what the server needs.
- With `max_batch_size > 0` Triton owns the batch dimension: it is left out of `dims` (Triton's full
  shape is [-1] + dims), so `input_ids` is `dims: [-1]` (the sequence) and `logits` is
  `dims: [-1, vocab]`. `max_batch_size = 0` gives the full shapes and turns batching off.
- Dynamic batching is on by default, with no preferred batch sizes and no queue delay: Triton's own
  recommended starting point (docs/user_guide/batcher.md). A TensorRT engine with several profiles
  gets each profile's largest batch as a preferred size, and its instances are given all profiles
  (without `profile`, Triton's TensorRT backend uses profile 0 only).
- Triton forms a batch only from requests of the same shape, so requests of different lengths do not
  batch together. The model is causal and takes no attention mask: a client may right-pad ids to a
  few bucket lengths and read the logits of its real positions, which padding does not change.
- TensorRT-RTX engines are not packaged for the TensorRT backend: Triton's TensorRT backend links
  TensorRT (libnvinfer), which cannot deserialize a TensorRT-RTX plan. `backend="auto"` then serves
  the ONNX file with ONNX Runtime.
- The tanh-GELU plugin of a plugin engine is an ahead-of-time (AOT) plugin: its kernel is embedded in
  the plan, so Triton needs no plugin library (`--backend-config=tensorrt,plugins=...`) and no
  LD_PRELOAD. This is written in the config's header and in its `parameters`.
- The KV-cache decoder (`decoder_onnx`) is a model of its own, stateful: triton_decoder.py.
- Writing is atomic: the model folder is assembled under a temporary name (beside the repository when
  the file system allows, so a polling Triton never sees it half-made) and renamed into place. Files
  are hard-linked from the build when possible (the build's files are only ever replaced, never
  rewritten in place), else copied; their sha256 is checked against the manifest first. A graph's
  weights file (external data) is always copied: onnx.load, onnx.checker and onnx-ir refuse external
  data with several hard links (a guard against hard-link attacks), so a link would leave both the
  build folder and the package unreadable to them (ONNX Runtime, Triton's backend, would accept it).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path

import onnx
from onnx import TensorProto

from ... import __version__
from ...folder.atomic import locked_folder, sha256_file, swap_folders
from ...folder.reader import MANIFEST, graph_weights
from ...folder.reader import read_manifest as _read_manifest
from ...config import check_name
from ...errors import AndreaExportError, require
from ...progress import warn

BACKENDS = ("auto", "tensorrt", "onnxruntime")
KINDS = ("gpu", "cpu")
VERSION_DIR = "1"
PROVENANCE = "andrea-build.json"  # copy of the build's manifest inside the model folder
DEFAULT_ONNX_MAX_BATCH = 8  # ONNX Runtime has no profile limit; used when the manifest has no profiles
PLATFORM = {"tensorrt": "tensorrt_plan", "onnxruntime": "onnxruntime_onnx"}
ROLE = {"tensorrt": "engine", "onnxruntime": "onnx"}

# ONNX tensor type -> Triton DataType enum name (model_config.proto)
_TRITON_TYPE: dict[int, str] = {
    TensorProto.BOOL: "TYPE_BOOL",
    TensorProto.UINT8: "TYPE_UINT8",
    TensorProto.INT8: "TYPE_INT8",
    TensorProto.INT32: "TYPE_INT32",
    TensorProto.INT64: "TYPE_INT64",
    TensorProto.FLOAT16: "TYPE_FP16",
    TensorProto.BFLOAT16: "TYPE_BF16",
    TensorProto.FLOAT: "TYPE_FP32",
    TensorProto.DOUBLE: "TYPE_FP64",
}


TRITON_NAME = "a Triton model name"


class PackageError(AndreaExportError):
    """A build folder cannot be packaged as asked; the message says why and what to do."""


def model_config_pb2():
    """Triton's model configuration protobuf module (from tritonclient[grpc])."""
    return require("tritonclient.grpc.model_config_pb2", "triton", "Writing a Triton model configuration")


def _reading_build(fn):
    """Hold a shared lock on the build folder while it is read, so that no build replaces it meanwhile, and
    read its manifest once under it: `fn` gets it as `manifest`. A caller that holds the lock and has read
    the manifest (package) passes it and takes no second lock."""

    @functools.wraps(fn)
    def wrapper(build_dir, *args, manifest: dict | None = None, **kwargs):
        if manifest is not None:
            return fn(build_dir, *args, manifest=manifest, **kwargs)
        with locked_folder(build_dir, shared=True):
            return fn(build_dir, *args, manifest=read_manifest(build_dir), **kwargs)

    return wrapper


def package(build_dir: str | Path, repo_dir: str | Path, *, name: str | None = None, backend: str = "auto",
            instances: int = 1, kind: str = "gpu", overwrite: bool = False, allow_failed: bool = False,
            hardlink: bool = True, **options) -> list[Path]:
    """Every model of a build: the stateless one (write_triton_repo, which also takes `options`) and, when the
    build has the KV-cache decoder, the stateful one (`<name>-decoder`; triton_decoder.write_triton_decoder).
    One shared lock and one read of the manifest for both, so they always come from the same build.
    Returns the model folders."""
    from .stateful import write_triton_decoder

    common = dict(backend=backend, instances=instances, kind=kind, overwrite=overwrite, allow_failed=allow_failed,
                  hardlink=hardlink)
    with locked_folder(build_dir, shared=True):
        manifest = read_manifest(build_dir)
        models = [write_triton_repo(build_dir, repo_dir, name=name, manifest=manifest, **common, **options)]
        if "decoder_onnx" in manifest["artifacts"]:
            models.append(write_triton_decoder(build_dir, repo_dir, name=f"{name}-decoder" if name else None,
                                               manifest=manifest, **common))
    return models


@_reading_build
def write_triton_repo(
    build_dir: str | Path,
    repo_dir: str | Path,
    *,
    name: str | None = None,
    backend: str = "auto",
    max_batch_size: int | None = None,
    dynamic_batching: bool = True,
    preferred_batch_sizes: list[int] | None = None,
    max_queue_delay_us: int = 0,
    instances: int = 1,
    kind: str = "gpu",
    overwrite: bool = False,
    allow_failed: bool = False,
    hardlink: bool = True,
    manifest: dict,
) -> Path:
    """Write `<repo_dir>/<name>/` (config.pbtxt and version 1 of the model) from an andrea-export build.

    Args:
        build_dir: a build folder (has manifest.json).
        repo_dir: the Triton model repository (created if missing); other models in it are left alone.
        name: the Triton model name (= folder name). Default: `<model>-<precision>-trt|onnx`.
        backend: "tensorrt" (serves the engine), "onnxruntime" (serves the standard ONNX), or "auto":
            the engine if the build has a TensorRT (not TensorRT-RTX) engine and kind is "gpu", else ONNX.
        max_batch_size: Triton's max_batch_size; 0 turns batching off. Default: the largest batch of the
            manifest's optimization profiles, or 8 for ONNX when there are none. For an engine it may
            not exceed what the profiles allow.
        dynamic_batching: add a dynamic batcher (only when max_batch_size > 0).
        preferred_batch_sizes: the batcher's preferred sizes. Default: none, or, for an engine with
            several profiles, each profile's largest batch.
        max_queue_delay_us: how long the batcher may hold a request to grow a batch (default 0).
        instances: model instances (per GPU for "gpu").
        kind: "gpu" (KIND_GPU) or "cpu" (KIND_CPU; ONNX Runtime only).
        overwrite: replace `<repo_dir>/<name>` if it exists and is not empty.
        allow_failed: package a build whose verification failed (refused by default).
        hardlink: hard-link the artifact when on the same file system (else it is copied); a weights
            file is always copied (see the module doc).
        manifest: the build's manifest when the caller holds the folder's shared lock and has read it
            (see package); by default the folder is locked and its manifest read here.
    Returns:
        The model folder `<repo_dir>/<name>`.
    """
    build_dir, repo_dir = Path(build_dir), Path(repo_dir)
    if backend not in BACKENDS:
        raise PackageError(f"unknown backend '{backend}'; choose one of: {', '.join(BACKENDS)}")
    if kind not in KINDS:
        raise PackageError(f"unknown instance kind '{kind}'; choose one of: {', '.join(KINDS)}")
    if not isinstance(instances, int) or instances < 1:
        raise PackageError(f"instances must be a positive integer, got {instances!r}")
    if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 0):
        raise PackageError(f"max_batch_size must be an integer >= 0, got {max_batch_size!r}")
    if not isinstance(max_queue_delay_us, int) or max_queue_delay_us < 0:
        raise PackageError(f"max_queue_delay_us must be >= 0, got {max_queue_delay_us}")

    pb = model_config_pb2()  # first: a missing dependency is said before any work
    status = _check_status(build_dir, manifest, allow_failed, "it for serving")
    backend = _choose_backend(build_dir, manifest, backend, kind)
    if status != "passed" and not (status == "engine-unverified" and backend == "onnxruntime"):
        warn(f"{build_dir}: packaging a build whose verification status is '{status}'")
    role = ROLE[backend]
    artifact = _artifact_file(build_dir, manifest, role)
    io_onnx = artifact if backend == "onnxruntime" else _io_onnx(build_dir, manifest)
    inputs, outputs = _onnx_io(io_onnx)
    _check_vocab(io_onnx, outputs, manifest)

    profiles = manifest.get("profiles") or []
    bound = _engine_max_batch(build_dir, profiles, inputs) if backend == "tensorrt" else None
    if max_batch_size is None:
        max_batch_size = bound if bound is not None else _onnx_default_batch(profiles, inputs)
    if bound is not None and max_batch_size > bound:
        raise PackageError(
            f"max_batch_size {max_batch_size} is larger than the engine's optimization profiles allow "
            f"(largest batch {bound}); Triton would refuse to load the model. Use max_batch_size <= {bound} "
            "or rebuild the engine with a larger maximum batch"
        )
    if max_batch_size > 0:
        for n, (_, dims) in {**inputs, **outputs}.items():
            if dims and dims[0] != -1:
                raise PackageError(
                    f"{io_onnx}: the first dimension of '{n}' is fixed to {dims[0]}, so Triton cannot batch "
                    "along it; use max_batch_size=0"
                )

    if backend == "tensorrt" and len(profiles) > 1 and preferred_batch_sizes is None and max_batch_size > 0:
        preferred_batch_sizes = sorted({min(p[i]["max"][0], max_batch_size) for p in profiles for i in inputs if i in p})
    for size in preferred_batch_sizes or []:
        if not 1 <= size <= max_batch_size:
            raise PackageError(f"preferred batch size {size} is outside 1..max_batch_size ({max_batch_size})")

    precision = manifest.get("precision", "fp32")
    model_name = manifest["model"].get("name", "andrea")
    name = name or f"{model_name}-{precision}-{'trt' if backend == 'tensorrt' else 'onnx'}"
    check_name(name, TRITON_NAME, PackageError)  # a folder name: the model names' rule

    cfg = pb.ModelConfig(name=name, platform=PLATFORM[backend], max_batch_size=max_batch_size)
    batch_dims = 1 if max_batch_size > 0 else 0
    for n, (dtype, dims) in inputs.items():
        cfg.input.add(name=n, data_type=pb.DataType.Value(_triton_type(io_onnx, n, dtype)), dims=dims[batch_dims:])
    for n, (dtype, dims) in outputs.items():
        cfg.output.add(name=n, data_type=pb.DataType.Value(_triton_type(io_onnx, n, dtype)), dims=dims[batch_dims:])
    if dynamic_batching and max_batch_size > 0:
        cfg.dynamic_batching.SetInParent()
        cfg.dynamic_batching.preferred_batch_size.extend(preferred_batch_sizes or [])
        cfg.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_us
    group = cfg.instance_group.add(
        count=instances, kind=pb.ModelInstanceGroup.KIND_GPU if kind == "gpu" else pb.ModelInstanceGroup.KIND_CPU
    )
    if backend == "tensorrt" and len(profiles) > 1:
        group.profile.extend(str(i) for i in range(len(profiles)))
    params = _parameters(manifest, role, backend)
    for k, v in params.items():
        cfg.parameters[k].string_value = v

    header = _header(build_dir, manifest, role, backend, inputs, profiles, max_batch_size)
    text = "".join(f"# {line}\n" if line else "#\n" for line in header) + "\n" + config_text(cfg)
    return _write_model_dir(
        repo_dir, name, text, artifact, backend, build_dir / MANIFEST, manifest, overwrite=overwrite, hardlink=hardlink
    )


def config_text(cfg) -> str:
    """A ModelConfig message as config.pbtxt text (protobuf text format)."""
    from google.protobuf import text_format

    return text_format.MessageToString(cfg)


def parse_config(text: str):
    """config.pbtxt text -> Triton's ModelConfig message (raises on anything Triton would not parse)."""
    from google.protobuf import text_format

    return text_format.Parse(text, model_config_pb2().ModelConfig())


# --------------------------------------------------------------------------------------------- manifest


def read_manifest(build_dir: str | Path) -> dict:
    """The build folder's manifest.json, validated (buildfolder.read_manifest) for what packaging needs."""
    return _read_manifest(build_dir, full=False, error=PackageError)


def _check_status(build_dir: Path, manifest: dict, allow_failed: bool, what: str) -> str:
    """The build's verification status; a failed build is refused unless `allow_failed`."""
    status = manifest.get("status", "unverified")
    if status == "failed" and not allow_failed:
        raise PackageError(
            f"{build_dir}: this build failed verification (manifest status 'failed'); refusing to package "
            f"{what}. Fix the build, or pass allow_failed=True (--allow-failed) to package it anyway"
        )
    return status


def _choose_backend(build_dir: Path, manifest: dict, backend: str, kind: str, engine: str = "engine",
                    graph: str = "onnx") -> str:
    """The backend that serves artifact `engine` (TensorRT) or `graph` (ONNX Runtime): `backend` checked,
    or auto's choice (the engine when it is a TensorRT plan, not weight-stripped, and kind is gpu)."""
    artifacts = manifest["artifacts"]
    have = ", ".join(sorted(artifacts)) or "none"
    what = engine.replace("_", " ")  # "engine", "decoder engine"
    roles = {"tensorrt": engine, "onnxruntime": graph}
    rtx_engine = engine in artifacts and _builder(manifest)[0] == "tensorrt-rtx"
    stripped = engine in artifacts and bool((manifest.get("builder") or {}).get("weights_stripped"))
    if backend == "auto":
        if engine in artifacts and not rtx_engine and not stripped and kind == "gpu":
            return "tensorrt"
        if graph in artifacts:
            return "onnxruntime"
    elif backend == "tensorrt" and stripped:
        raise PackageError(
            f"{build_dir}: the {what} is weight-stripped (--strip-weights), and Triton's TensorRT backend does not "
            "refit engines at load; rebuild without --strip-weights to serve it, or serve the ONNX (--backend onnxruntime)"
        )
    elif backend == "tensorrt" and kind == "cpu":
        raise PackageError("a TensorRT engine runs on GPUs only: use kind='gpu' (--kind gpu) or backend='onnxruntime'")
    elif backend == "tensorrt" and rtx_engine:
        raise PackageError(
            f"{build_dir}: the {what} was built by TensorRT-RTX, which Triton's TensorRT backend (libnvinfer) "
            "cannot load; serve the ONNX file with backend='onnxruntime' (--backend onnxruntime) instead"
        )
    elif roles[backend] in artifacts:
        return backend
    if graph == "onnx" and "decoder_onnx" in artifacts:
        raise PackageError(
            f"{build_dir}: the build has only a KV-cache decoder ('decoder_onnx') for this backend; package it "
            "as a stateful model with andrea_export.deploy.triton.write_triton_decoder, or package a build "
            "with the full-sequence 'onnx' or 'engine' artifact"
        )
    if backend == "auto":
        why = (" (the engine is a TensorRT-RTX plan, which Triton's TensorRT backend cannot load)" if rtx_engine
               else " (an engine cannot serve kind 'cpu')" if engine in artifacts else "")
        raise PackageError(
            f"{build_dir / MANIFEST}: no artifact Triton can serve here: needs '{engine}' (TensorRT, GPU) or "
            f"'{graph}' (ONNX Runtime); artifacts: {have}{why}"
        )
    raise PackageError(f"{build_dir / MANIFEST}: no '{roles[backend]}' artifact, which backend '{backend}' needs; artifacts: {have}")


def _artifact_file(build_dir: Path, manifest: dict, role: str) -> Path:
    """The artifact's file, after checking it exists and matches the manifest's sha256 and size."""
    entry = manifest["artifacts"][role]  # validated: a path inside the folder, a sha256, a size
    path = build_dir / entry["path"]
    if not path.is_file():
        raise PackageError(f"{build_dir / MANIFEST}: artifact '{role}' is missing: {path}")
    if path.stat().st_size != entry["bytes"]:
        raise PackageError(
            f"{path}: {path.stat().st_size} bytes, but the manifest records {entry['bytes']}: the file changed after the build"
        )
    if sha256_file(path) != entry["sha256"]:
        raise PackageError(f"{path}: sha256 differs from the manifest's: the file changed after the build")
    return path


def _io_onnx(build_dir: Path, manifest: dict) -> Path:
    """The ONNX file that tells an engine's I/O names and types (the engine keeps the ONNX's I/O)."""
    for role in ("onnx", "onnx_plugin"):
        if role in manifest["artifacts"]:
            return _artifact_file(build_dir, manifest, role)
    raise PackageError(
        f"{build_dir / MANIFEST}: the engine's input/output types are read from the build's ONNX file, "
        "but it lists neither 'onnx' nor 'onnx_plugin'"
    )


def _builder(manifest: dict) -> tuple[str, str]:
    b = manifest.get("builder") or {}
    return str(b.get("name", "tensorrt")), str(b.get("version", "unknown"))


def _batch_limits(profiles: list, inputs: dict) -> tuple[int, int]:
    """(smallest min batch, largest max batch) of the profiles: per profile the max batch is the smallest
    over its inputs, then the largest over profiles is taken (as Triton's TensorRT backend computes it
    from the engine). Raises KeyError/IndexError/TypeError/ValueError on a malformed list."""
    best = max(min(p[i]["max"][0] for i in inputs if i in p) for p in profiles)
    smallest = min(p[i]["min"][0] for p in profiles for i in inputs if i in p)
    return int(smallest), int(best)


def _engine_max_batch(build_dir: Path, profiles: list, inputs: dict) -> int:
    if not profiles:
        raise PackageError(f"{build_dir / MANIFEST}: no 'profiles', so the engine's batch limit is unknown")
    try:
        smallest, best = _batch_limits(profiles, inputs)
    except (KeyError, IndexError, TypeError, ValueError):
        raise PackageError(
            f"{build_dir / MANIFEST}: 'profiles' must give min/opt/max shapes of {', '.join(inputs)} in every profile"
        ) from None
    if smallest > 1:
        raise PackageError(
            f"{build_dir / MANIFEST}: the engine's profiles start at batch {smallest}, but Triton sends batches "
            "from 1; rebuild with a minimum batch of 1"
        )
    return best


def _onnx_default_batch(profiles: list, inputs: dict) -> int:
    """ONNX Runtime has no batch limit: take the build's profiles' largest batch if any, else 8."""
    try:
        return _batch_limits(profiles, inputs)[1] if profiles else DEFAULT_ONNX_MAX_BATCH
    except (KeyError, IndexError, TypeError, ValueError):
        return DEFAULT_ONNX_MAX_BATCH


# -------------------------------------------------------------------------------------------- ONNX I/O


def _onnx_io(path: Path) -> tuple[dict, dict]:
    """{name: (onnx elem type, dims with -1 for symbolic)} for the graph's inputs and outputs."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf parse errors have no public type
        raise PackageError(f"{path}: not an ONNX model ({type(e).__name__}: {e})") from None
    init = {t.name for t in model.graph.initializer}

    def spec(values):
        out = {}
        for v in values:
            if v.name in init:
                continue
            t = v.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
            out[v.name] = (t.elem_type, dims)
        return out

    return spec(model.graph.input), spec(model.graph.output)


def _triton_type(path: Path, name: str, elem_type: int) -> str:
    if elem_type not in _TRITON_TYPE:
        raise PackageError(f"{path}: tensor '{name}' has ONNX type {TensorProto.DataType.Name(elem_type)}, which has no Triton type here")
    return _TRITON_TYPE[elem_type]


def _check_vocab(path: Path, outputs: dict, manifest: dict) -> None:
    vocab = manifest["model"].get("vocab_size")
    logits = outputs.get("logits")
    if vocab is not None and logits is not None and logits[1] and logits[1][-1] not in (-1, vocab):
        raise PackageError(
            f"{path}: 'logits' ends in {logits[1][-1]}, but the manifest's model has vocab_size {vocab}: "
            "the ONNX file is not from this build"
        )


# ------------------------------------------------------------------------------------ config contents


def _parameters(manifest: dict, role: str, backend: str) -> dict[str, str]:
    model = manifest["model"]
    params = {
        "andrea.tool": f"{(manifest.get('tool') or {}).get('name', 'andrea-export')} "
        f"{(manifest.get('tool') or {}).get('version', '?')}",
        "andrea.model": str(model.get("name", "?")),
        "andrea.precision": str(manifest.get("precision", "fp32")),
        "andrea.verification": str(manifest.get("status", "unverified")),
        "andrea.artifact": role,
        "andrea.sha256": str(manifest["artifacts"][role].get("sha256", "")),
    }
    if backend == "tensorrt":
        name, version = _builder(manifest)
        ccs = (manifest.get("builder") or {}).get("compute_capabilities") or []
        params["andrea.builder"] = f"{name} {version}"
        params["andrea.compute_capabilities"] = ",".join(str(c) for c in ccs)
        params["andrea.plugin"] = _plugin_line(manifest)
    return params


def _plugin_line(manifest: dict) -> str:
    plugin = manifest.get("plugin") or {}
    builder = manifest.get("builder") or {}
    if (not plugin or not plugin.get("in_engine", True) or plugin.get("calls", 1) == 0
            or builder.get("plugin_layers", 1) == 0):
        return "none: native TensorRT GELU layers, nothing to load"
    pid, ver = plugin.get("id", "?"), plugin.get("version", "?")
    if plugin.get("embedded", False):
        return f"{pid} v{ver}: AOT plugin, kernel embedded in the engine; no plugin library to load"
    return f"{pid} v{ver}: NOT embedded; load its library with --backend-config=tensorrt,plugins=<lib.so>"


def _header(build_dir, manifest, role, backend, inputs, profiles, max_batch_size) -> list[str]:
    model = manifest["model"]
    lines = [
        f"Triton model configuration written by andrea-export {__version__}",
        f"from {build_dir.resolve() / MANIFEST}",
        f"model {model.get('name', '?')}, precision {manifest.get('precision', 'fp32')}, "
        f"verification {manifest.get('status', 'unverified')}, artifact '{role}'",
    ]
    if backend == "tensorrt":
        name, version = _builder(manifest)
        ccs = ", ".join(str(c) for c in (manifest.get("builder") or {}).get("compute_capabilities") or []) or "?"
        lines += [
            f"TensorRT plan built by {name} {version} for compute capability {ccs}: the Triton release must",
            f"ship TensorRT {version} and run on such a GPU (plans are not portable across either).",
            f"Plugin: {_plugin_line(manifest)}.",
        ]
        for i, p in enumerate(profiles):
            shapes = "; ".join(f"{n} min {p[n]['min']} opt {p[n]['opt']} max {p[n]['max']}" for n in inputs if n in p)
            lines.append(f"optimization profile {i}: {shapes}")
    if max_batch_size > 0:
        lines += [
            f"max_batch_size {max_batch_size}: dims leave out the batch dimension (Triton's full shape is [-1] + dims).",
            "Triton batches only requests of equal length; right-padding ids is safe (causal model, no mask).",
        ]
    return lines


# -------------------------------------------------------------------------------------------- writing


def _write_model_dir(repo: Path, name: str, config: str, artifact: Path, backend: str, manifest_path: Path,
                     manifest: dict, *, overwrite: bool, hardlink: bool) -> Path:
    final = repo / name
    if final.is_symlink() or final.is_file():
        raise PackageError(f"{final} exists and is not a folder; remove it or choose another name")
    if final.is_dir() and any(final.iterdir()) and not overwrite:
        raise PackageError(f"{final} already exists and is not empty; pass overwrite=True (--overwrite) to replace it")
    repo.mkdir(parents=True, exist_ok=True)
    tmp_root = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=_staging_parent(repo)))
    try:
        model_dir = tmp_root / name
        version = model_dir / VERSION_DIR
        version.mkdir(parents=True)
        if backend == "tensorrt":
            _place(artifact, version / "model.plan", hardlink)
        else:
            locations = graph_weights(manifest_path.parent, manifest, artifact, PackageError)
            if locations:  # Triton: a multi-file ONNX model is a folder named model.onnx holding model.onnx
                (version / "model.onnx").mkdir()
                _place(artifact, version / "model.onnx" / "model.onnx", hardlink)
                for loc in locations:  # copied: onnx refuses a weights file with several hard links
                    _place(artifact.parent / loc, version / "model.onnx" / loc, hardlink=False)
            else:
                _place(artifact, version / "model.onnx", hardlink)
        shutil.copyfile(manifest_path, model_dir / PROVENANCE)
        (model_dir / "config.pbtxt").write_text(config)
        if final.exists():  # empty, or overwrite=True: one swap; the old one is removed with tmp_root
            swap_folders(model_dir, final)
        else:
            os.replace(model_dir, final)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    return final


def _staging_parent(repo: Path) -> Path:
    """Where to assemble the model folder: beside the repository (a polling Triton never sees it) when
    that is on the same file system and writable, else inside it."""
    parent = repo.resolve().parent
    try:
        if os.stat(parent).st_dev == os.stat(repo).st_dev and os.access(parent, os.W_OK | os.X_OK):
            return parent
    except OSError:
        pass
    return repo


def _place(src: Path, dst: Path, hardlink: bool) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if hardlink:
        try:
            os.link(src, dst)
            return
        except OSError:  # another file system, or links not allowed: copy
            pass
    shutil.copyfile(src, dst)
