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
- The KV-cache decoder (`decoder_onnx`) is a model of its own, stateful: stateful.py.
- Writing is atomic: the model folder is assembled under a temporary name (beside the repository when
  the file system allows, so a polling Triton never sees it half-made) and renamed into place. Files
  are hard-linked from the build when possible (the build's files are only ever replaced, never
  rewritten in place), else copied; their sha256 is checked against the manifest first. A graph's
  weights file (external data) is always copied: onnx.load, onnx.checker and onnx-ir refuse external
  data with several hard links (a guard against hard-link attacks), so a link would leave both the
  build folder and the package unreadable to them (ONNX Runtime, Triton's backend, would accept it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ...catalog import Role
from ... import __version__
from ...config import check_name
from ...errors import PackageError
from ...folder.reader import MANIFEST
from ...progress import warn
from .common import (
    PLATFORM,
    TRITON_NAME,
    artifact_file,
    builder_of,
    check_status,
    check_triton_release,
    choose_backend,
    config_text,
    model_config_pb2,
    onnx_io,
    parameters,
    pin_lines,
    plugin_line,
    reading_build,
    triton_type,
    write_model_dir,
)

BACKENDS = ("auto", "tensorrt", "onnxruntime")
KINDS = ("gpu", "cpu")
DEFAULT_ONNX_MAX_BATCH = 8  # ONNX Runtime has no profile limit; used when the manifest has no profiles
ROLE = {"tensorrt": Role.ENGINE, "onnxruntime": Role.ONNX}


@reading_build
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
    triton_release: str | None = None,
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
        triton_release: the Triton release (YY.MM) that will serve it: recorded in the config, and for a plan
            refused when that release's container ships another TensorRT (one whose TensorRT is not known here
            is recorded as not checked).
        manifest: the build's manifest when the caller holds the folder's shared lock and has read it
            (see package); by default the folder is locked and its manifest read here.
    Returns:
        The model folder `<repo_dir>/<name>`.
    """
    build_dir, repo_dir = Path(build_dir), Path(repo_dir)
    _check_options(backend, kind, instances, max_batch_size, max_queue_delay_us)
    pb = model_config_pb2()  # first: a missing dependency is said before any work
    backend = _served_backend(build_dir, manifest, backend, kind, allow_failed, triton_release)
    role = ROLE[backend]
    artifact = artifact_file(build_dir, manifest, role)
    io_onnx = artifact if backend == "onnxruntime" else _io_onnx(build_dir, manifest)
    inputs, outputs = onnx_io(io_onnx)
    _check_vocab(io_onnx, outputs, manifest)
    profiles = manifest.get("profiles") or []
    batching = _batching(build_dir, io_onnx, backend, profiles, inputs, outputs, max_batch_size,
                         preferred_batch_sizes, dynamic_batching, max_queue_delay_us)  # fmt: skip
    name = name or f"{manifest['model'].get('name', 'andrea')}-{manifest.get('precision', 'fp32')}-" + (
        "trt" if backend == "tensorrt" else "onnx")  # fmt: skip
    check_name(name, TRITON_NAME, PackageError)  # a folder name: the model names' rule
    cfg = _model_config(pb, name, backend, io_onnx, inputs, outputs, batching, instances, kind, len(profiles))
    for k, v in parameters(manifest, role, backend, triton_release).items():
        cfg.parameters[k].string_value = v
    header = _header(build_dir, manifest, role, backend, inputs, profiles, batching.max_batch_size, triton_release)
    text = "".join(f"# {line}\n" if line else "#\n" for line in header) + "\n" + config_text(cfg)
    return write_model_dir(
        repo_dir, name, text, artifact, backend, build_dir / MANIFEST, manifest, overwrite=overwrite, hardlink=hardlink
    )


@dataclasses.dataclass(frozen=True)
class Batching:
    """How Triton batches the model: max_batch_size (0: no batching), and the dynamic batcher's settings."""

    max_batch_size: int
    preferred: list[int]
    dynamic: bool
    max_queue_delay_us: int


def _check_options(backend: str, kind: str, instances: int, max_batch_size: int | None, max_queue_delay_us: int) -> None:
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


def _served_backend(build_dir: Path, manifest: dict, backend: str, kind: str, allow_failed: bool,
                    triton_release: str | None) -> str:  # fmt: skip
    """The backend that serves the build ("tensorrt" or "onnxruntime"), once the build's verification
    status and the Triton release allow it; a build not fully verified is packaged with a warning."""
    status = check_status(build_dir, manifest, allow_failed, "it for serving")
    backend = choose_backend(build_dir, manifest, backend, kind)
    check_triton_release(build_dir, manifest, triton_release, plan=backend == "tensorrt")
    if status != "passed" and not (status == "engine-unverified" and backend == "onnxruntime"):
        warn(f"{build_dir}: packaging a build whose verification status is '{status}'")
    return backend


def _batching(build_dir: Path, io_onnx: Path, backend: str, profiles: list, inputs: dict, outputs: dict,
              max_batch_size: int | None, preferred: list[int] | None, dynamic: bool,
              max_queue_delay_us: int) -> Batching:  # fmt: skip
    """max_batch_size (default: what the engine's profiles allow, or the ONNX default) checked against the
    engine's profiles and the graph's first dimensions; an engine of several profiles prefers each
    profile's largest batch."""
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
    if backend == "tensorrt" and len(profiles) > 1 and preferred is None and max_batch_size > 0:
        preferred = sorted({min(p[i]["max"][0], max_batch_size) for p in profiles for i in inputs if i in p})
    for size in preferred or []:
        if not 1 <= size <= max_batch_size:
            raise PackageError(f"preferred batch size {size} is outside 1..max_batch_size ({max_batch_size})")
    return Batching(max_batch_size, list(preferred or []), dynamic and max_batch_size > 0, max_queue_delay_us)


def _model_config(pb, name: str, backend: str, io_onnx: Path, inputs: dict, outputs: dict, batching: Batching,
                  instances: int, kind: str, n_profiles: int):  # fmt: skip
    """Triton's ModelConfig message: I/O (without the batch dimension when Triton batches), the batcher, the
    instance group (given every profile of an engine: without `profile` Triton uses profile 0 only)."""
    cfg = pb.ModelConfig(name=name, platform=PLATFORM[backend], max_batch_size=batching.max_batch_size)
    batch_dims = 1 if batching.max_batch_size > 0 else 0
    for n, (dtype, dims) in inputs.items():
        cfg.input.add(name=n, data_type=pb.DataType.Value(triton_type(io_onnx, n, dtype)), dims=dims[batch_dims:])
    for n, (dtype, dims) in outputs.items():
        cfg.output.add(name=n, data_type=pb.DataType.Value(triton_type(io_onnx, n, dtype)), dims=dims[batch_dims:])
    if batching.dynamic:
        cfg.dynamic_batching.SetInParent()
        cfg.dynamic_batching.preferred_batch_size.extend(batching.preferred)
        cfg.dynamic_batching.max_queue_delay_microseconds = batching.max_queue_delay_us
    group = cfg.instance_group.add(
        count=instances, kind=pb.ModelInstanceGroup.KIND_GPU if kind == "gpu" else pb.ModelInstanceGroup.KIND_CPU
    )
    if backend == "tensorrt" and n_profiles > 1:
        group.profile.extend(str(i) for i in range(n_profiles))
    return cfg


# --------------------------------------------------------------------------------------------- manifest


def _io_onnx(build_dir: Path, manifest: dict) -> Path:
    """The ONNX file that tells an engine's I/O names and types (the engine keeps the ONNX's I/O)."""
    for role in (Role.ONNX, Role.ONNX_PLUGIN):
        if role in manifest["artifacts"]:
            return artifact_file(build_dir, manifest, role)
    raise PackageError(
        f"{build_dir / MANIFEST}: the engine's input/output types are read from the build's ONNX file, "
        "but it lists neither 'onnx' nor 'onnx_plugin'"
    )


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


def _check_vocab(path: Path, outputs: dict, manifest: dict) -> None:
    vocab = manifest["model"].get("vocab_size")
    logits = outputs.get("logits")
    if vocab is not None and logits is not None and logits[1] and logits[1][-1] not in (-1, vocab):
        raise PackageError(
            f"{path}: 'logits' ends in {logits[1][-1]}, but the manifest's model has vocab_size {vocab}: "
            "the ONNX file is not from this build"
        )


# ------------------------------------------------------------------------------------ config contents


def _header(build_dir, manifest, role, backend, inputs, profiles, max_batch_size, triton_release=None) -> list[str]:
    model = manifest["model"]
    lines = [
        f"Triton model configuration written by andrea-export {__version__}",
        f"from {build_dir.resolve() / MANIFEST}",
        f"model {model.get('name', '?')}, precision {manifest.get('precision', 'fp32')}, "
        f"verification {manifest.get('status', 'unverified')}, artifact '{role}'",
    ]
    if backend == "tensorrt":
        name, version = builder_of(manifest)
        ccs = ", ".join(str(c) for c in (manifest.get("builder") or {}).get("compute_capabilities") or []) or "?"
        lines += [
            f"TensorRT plan built by {name} {version} for compute capability {ccs}: the Triton release must",
            f"ship TensorRT {version} and run on such a GPU (plans are not portable across either).",
            f"Plugin: {plugin_line(manifest)}.",
        ]
        for i, p in enumerate(profiles):
            shapes = "; ".join(f"{n} min {p[n]['min']} opt {p[n]['opt']} max {p[n]['max']}" for n in inputs if n in p)
            lines.append(f"optimization profile {i}: {shapes}")
    lines += pin_lines(manifest, backend, triton_release)
    if max_batch_size > 0:
        lines += [
            f"max_batch_size {max_batch_size}: dims leave out the batch dimension (Triton's full shape is [-1] + dims).",
            "Triton batches only requests of equal length; right-padding ids is safe (causal model, no mask).",
        ]
    return lines


# -------------------------------------------------------------------------------------------- writing


