"""What both Triton writers share (the stateless model, stateless.py; the stateful decoder, stateful.py): Triton's
config schema, the build folder read under one shared lock, the backend choice, artifact checks, ONNX I/O as
Triton types, the config's `parameters`, and the atomic writing of a model folder."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import tempfile
from pathlib import Path

import onnx
from onnx import TensorProto

from ...catalog import Role
from ...errors import PackageError, require
from ...folder.atomic import locked_folder, sha256_file, swap_folders
from ...folder.reader import MANIFEST
from ...folder.reader import read_manifest as read_folder_manifest
from ...graphs.external_data import graph_weights

VERSION_DIR = "1"
PROVENANCE = "andrea-build.json"  # copy of the build's manifest inside the model folder
PLATFORM = {"tensorrt": "tensorrt_plan", "onnxruntime": "onnxruntime_onnx"}

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

# Triton release (YY.MM) -> the TensorRT version its nvcr.io/nvidia/tritonserver:<release>-py3 container ships, as
# NVIDIA writes it (major.minor.patch.build). A plan loads only under the TensorRT that built it, and the -py3
# container is the one with Triton's TensorRT backend (the -trtllm-python-py3 one has only the TensorRT-LLM and
# Python backends: triton-inference-server/server#7346). Only rows confirmed from NVIDIA's pages are here; a
# release not listed is unknown, never guessed. The source of truth is the Deep Learning Frameworks Support Matrix
# (SUPPORT_MATRIX below), which the Triton release notes name as the list of what each container holds.
# - 24.05: TensorRT 10.0.1.6, what NVIDIA lists for its 24.05 framework containers
#   (https://docs.nvidia.com/deeplearning/frameworks/mxnet-release-notes/rel-24-05.html); Triton's own QA builds
#   the plans of release YY.MM in nvcr.io/nvidia/tensorrt:YY.MM-py3 (qa/common/gen_qa_model_repository, r24.05).
# Triton's Release Compatibility Matrix
# (https://docs.nvidia.com/deeplearning/triton-inference-server/user-guide/docs/introduction/compatibility.html)
# lists a TensorRT per release up to 26.07, but for the -trtllm-python-py3 container only, whose TensorRT is not
# the -py3 one's: not copied here. Add releases from the support matrix's Triton column.
TRITON_RELEASE_TENSORRT: dict[str, str] = {
    "24.05": "10.0.1.6",
}
SUPPORT_MATRIX = "https://docs.nvidia.com/deeplearning/frameworks/support-matrix/index.html"
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:{}-py3"
_RELEASE = re.compile(r"\d{2}\.\d{2}")


def model_config_pb2():
    """Triton's model configuration protobuf module (from tritonclient[grpc])."""
    return require("tritonclient.grpc.model_config_pb2", "triton", "Writing a Triton model configuration")


def reading_build(fn):
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


def config_text(cfg) -> str:
    """A ModelConfig message as config.pbtxt text (protobuf text format)."""
    from google.protobuf import text_format

    return text_format.MessageToString(cfg)


def parse_config(text: str):
    """config.pbtxt text -> Triton's ModelConfig message (raises on anything Triton would not parse)."""
    from google.protobuf import text_format

    return text_format.Parse(text, model_config_pb2().ModelConfig())


def read_manifest(build_dir: str | Path) -> dict:
    """The build folder's manifest.json, validated (folder.reader.read_manifest) for what packaging needs."""
    return read_folder_manifest(build_dir, full=False, error=PackageError)


def check_status(build_dir: Path, manifest: dict, allow_failed: bool, what: str) -> str:
    """The build's verification status; a failed build is refused unless `allow_failed`."""
    status = manifest.get("status", "unverified")
    if status == "failed" and not allow_failed:
        raise PackageError(
            f"{build_dir}: this build failed verification (manifest status 'failed'); refusing to package "
            f"{what}. Fix the build, or package it anyway with --allow-failed (allow_failed=True from Python)"
        )
    return status


def choose_backend(build_dir: Path, manifest: dict, backend: str, kind: str, engine: Role = Role.ENGINE,
                    graph: Role = Role.ONNX) -> str:
    """The backend that serves artifact `engine` (TensorRT) or `graph` (ONNX Runtime): `backend` checked,
    or auto's choice (the engine when it is a TensorRT plan, not weight-stripped, and kind is gpu)."""
    artifacts = manifest["artifacts"]
    have = ", ".join(sorted(artifacts)) or "none"
    what = engine.replace("_", " ")  # "engine", "decoder engine"
    roles = {"tensorrt": engine, "onnxruntime": graph}
    rtx_engine = engine in artifacts and builder_of(manifest)[0] == "tensorrt-rtx"
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
    if graph == Role.ONNX and Role.DECODER_ONNX in artifacts:
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


def artifact_file(build_dir: Path, manifest: dict, role: str) -> Path:
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


def builder_of(manifest: dict) -> tuple[str, str]:
    b = manifest.get("builder") or {}
    return str(b.get("name", "tensorrt")), str(b.get("version", "unknown"))


def onnx_io(path: Path) -> tuple[dict, dict]:
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


def triton_type(path: Path, name: str, elem_type: int) -> str:
    if elem_type not in _TRITON_TYPE:
        raise PackageError(f"{path}: tensor '{name}' has ONNX type {TensorProto.DataType.Name(elem_type)}, which has no Triton type here")
    return _TRITON_TYPE[elem_type]


def parameters(manifest: dict, role: str, backend: str, triton_release: str | None = None) -> dict[str, str]:
    """The config's `parameters`: where the model came from and, for a plan, what must serve it."""
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
        name, version = builder_of(manifest)
        ccs = (manifest.get("builder") or {}).get("compute_capabilities") or []
        params["andrea.builder"] = f"{name} {version}"
        params["andrea.compute_capabilities"] = ",".join(str(c) for c in ccs)
        params["andrea.plugin"] = plugin_line(manifest)
        params["andrea.tensorrt_version"] = version
        params["andrea.triton_releases"] = releases_line(version)
        params["andrea.driver_floor"] = driver_floor(manifest)
    if triton_release is not None:
        params["andrea.triton_release"] = triton_release
    return params


def _plugin_in_engine(manifest: dict) -> bool:
    plugin = manifest.get("plugin") or {}
    builder = manifest.get("builder") or {}
    return not (not plugin or not plugin.get("in_engine", True) or plugin.get("calls", 1) == 0
                or builder.get("plugin_layers", 1) == 0)


def plugin_line(manifest: dict) -> str:
    plugin = manifest.get("plugin") or {}
    if not _plugin_in_engine(manifest):
        return "none: native TensorRT GELU layers, nothing to load"
    pid, ver = plugin.get("id", "?"), plugin.get("version", "?")
    if plugin.get("embedded", False):
        return f"{pid} v{ver}: AOT plugin, kernel embedded in the engine; no plugin library to load"
    return f"{pid} v{ver}: NOT embedded; load its library with --backend-config=tensorrt,plugins=<lib.so>"


def driver_floor(manifest: dict) -> str:
    """The oldest GPU driver that loads the engine's plugin PTX (a driver JIT-compiles PTX only up to its own
    CUDA release's ISA), as the build recorded it (pipeline._plugin_info); never guessed."""
    if not _plugin_in_engine(manifest):
        return "no plugin PTX"
    kernel = (manifest.get("plugin") or {}).get("kernel")
    if isinstance(kernel, dict) and isinstance(kernel.get("driver_floor"), str) and kernel["driver_floor"]:
        isa = kernel.get("ptx_isa")
        floor = kernel["driver_floor"]
        return f"{floor} (plugin PTX ISA {isa})" if isinstance(isa, str) and isa else floor
    return "unknown: the build recorded no driver floor for the plugin's PTX"


def same_tensorrt(built: str, shipped: str) -> bool:
    """Whether TensorRT `built` is `shipped`, compared to the precision both give: NVIDIA writes
    major.minor.patch.build (10.0.1.6), and the build number counts (TensorRT 8.6.1.2 refuses a plan of 8.6.1.6:
    triton-inference-server/server#5975); a version given as major.minor.patch (10.0.1) matches on those three.
    Fewer than three: no match."""
    a, b = str(built).split("."), str(shipped).split(".")
    n = min(len(a), len(b))
    return n >= 3 and all(x.isdigit() for x in a + b) and a[:n] == b[:n]


def triton_releases(version: str) -> list[str]:
    """The Triton releases (TRITON_RELEASE_TENSORRT) whose -py3 container ships TensorRT `version`."""
    return sorted(r for r, shipped in TRITON_RELEASE_TENSORRT.items() if same_tensorrt(version, shipped))


def releases_line(version: str) -> str:
    """The releases that ship TensorRT `version`, or that none is known here (not a guess)."""
    return ", ".join(triton_releases(version)) or (
        f"no Triton release known to ship TensorRT {version}: check NVIDIA's support matrix ({SUPPORT_MATRIX})")


def pin_lines(manifest: dict, backend: str, triton_release: str | None) -> list[str]:
    """config.pbtxt header lines: for a plan, the Triton releases that can load it and the driver its PTX needs;
    the release it was packaged for (--triton-release), if one was given."""
    lines = []
    version = builder_of(manifest)[1]
    if backend == "tensorrt":
        releases = triton_releases(version)
        image = TRITON_IMAGE.format("<release>")
        lines.append(f"Triton releases that ship TensorRT {version}: {', '.join(releases)} ({image})"
                     if releases else releases_line(version))
        lines.append(f"GPU driver: {driver_floor(manifest)}")
    if triton_release is not None:
        shipped = ""
        if backend == "tensorrt":
            shipped = (f", which ships TensorRT {TRITON_RELEASE_TENSORRT[triton_release]}"
                       if triton_release in TRITON_RELEASE_TENSORRT else
                       f": NOT checked, no TensorRT version is known here for it (NVIDIA's support matrix: {SUPPORT_MATRIX})")
        lines.append(f"Packaged for Triton release {triton_release} ({TRITON_IMAGE.format(triton_release)}){shipped}.")
    return lines


def check_triton_release(build_dir: Path, manifest: dict, triton_release: str | None, plan: bool) -> None:
    """Refuse a Triton release (--triton-release) that cannot load the plan: its container ships another TensorRT.
    A release whose TensorRT is not known here (TRITON_RELEASE_TENSORRT lists only confirmed ones) contradicts
    nothing: it is recorded, and the config's header says it was not checked. Without a plan (ONNX Runtime) there
    is nothing to contradict either: any release written YY.MM is recorded."""
    if triton_release is None:
        return
    if not isinstance(triton_release, str) or not _RELEASE.fullmatch(triton_release):
        raise PackageError(f"a Triton release is written YY.MM (e.g. 24.05), got {triton_release!r}")
    if not plan or triton_release not in TRITON_RELEASE_TENSORRT:
        return
    built, shipped = builder_of(manifest)[1], TRITON_RELEASE_TENSORRT[triton_release]
    if not same_tensorrt(built, shipped):
        fits = triton_releases(built)
        fit = f"Triton releases that ship TensorRT {built}: {', '.join(fits)}" if fits else releases_line(built)
        raise PackageError(
            f"{build_dir}: the TensorRT plan was built by TensorRT {built}, but Triton release {triton_release} ships "
            f"TensorRT {shipped}, which cannot load it; {fit}. Package for a release that ships {built}, or rebuild "
            f"the engine with TensorRT {shipped}"
        )


def write_model_dir(repo: Path, name: str, config: str, artifact: Path, backend: str, manifest_path: Path,
                    manifest: dict, *, overwrite: bool, hardlink: bool) -> Path:
    with staged_model_dir(repo, name, overwrite) as model_dir:
        version = model_dir / VERSION_DIR
        version.mkdir(parents=True)
        if backend == "tensorrt":
            place_file(artifact, version / "model.plan", hardlink)
        else:
            locations = graph_weights(manifest_path.parent, manifest, artifact, PackageError)
            if locations:  # Triton: a multi-file ONNX model is a folder named model.onnx holding model.onnx
                (version / "model.onnx").mkdir()
                place_file(artifact, version / "model.onnx" / "model.onnx", hardlink)
                for loc in locations:  # copied: onnx refuses a weights file with several hard links
                    place_file(artifact.parent / loc, version / "model.onnx" / loc, hardlink=False)
            else:
                place_file(artifact, version / "model.onnx", hardlink)
        shutil.copyfile(manifest_path, model_dir / PROVENANCE)
        (model_dir / "config.pbtxt").write_text(config, encoding="utf-8")
    return repo / name


@contextlib.contextmanager
def staged_model_dir(repo: Path, name: str, overwrite: bool):
    """Yield an empty folder to assemble the model `name` in, beside the repository; on success it replaces
    REPO/name in one rename (a polling Triton never sees half a model), on failure it is removed."""
    final = repo / name
    if final.is_symlink() or final.is_file():
        raise PackageError(f"{final} exists and is not a folder; remove it or choose another name")
    if final.is_dir() and any(final.iterdir()) and not overwrite:
        raise PackageError(f"{final} already exists and is not empty; replace it with --overwrite (overwrite=True from Python)")
    repo.mkdir(parents=True, exist_ok=True)
    tmp_root = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=_staging_parent(repo)))
    try:
        model_dir = tmp_root / name
        model_dir.mkdir()
        yield model_dir
        if final.exists():  # empty, or overwrite=True: one swap; the old one is removed with tmp_root
            swap_folders(model_dir, final)
        else:
            os.replace(model_dir, final)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)


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


def place_file(src: Path, dst: Path, hardlink: bool) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if hardlink:
        try:
            os.link(src, dst)
            return
        except OSError:  # another file system, or links not allowed: copy
            pass
    shutil.copyfile(src, dst)
