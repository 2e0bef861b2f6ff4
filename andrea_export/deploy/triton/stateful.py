"""The KV-cache decoder as a stateful Triton model: the sequence batcher keeps the cache inside Triton
(implicit state), so a client sends only token ids and a mask, and gets logits back.

    write_triton_decoder("build/", "models/")  ->  models/<name>/config.pbtxt
                                                  models/<name>/1/model.onnx   (ONNX Runtime backend)
                                               or models/<name>/1/model.plan   (TensorRT backend)

How Triton's implicit state meets our graph (Triton docs: implicit_state_management.md; core:
src/sequence_state.cc, src/sequence_batch_scheduler/sequence_batch_scheduler.cc):

- One `sequence_batching.state` per cache tensor: `input_name: past_key_values.{i}.key|value`,
  `output_name: present.{i}.key|value`, dims `[n_head, -1, head_dim]` (batch left to max_batch_size).
  The present of request k becomes the past of request k+1; a variable dim lets it grow by the
  request's new tokens each time, as our graph's present does.
- At a sequence's start Triton gives every state input the shape of its dims with each variable dim
  set to 1 (sequence_state.cc; an `initial_state`'s own shape is not used), never 0. So the cache
  starts with ONE slot, zeroed by `initial_state { zero_data: true, dims: [n_head, 1, head_dim] }`
  (without it the slot is uninitialised memory, and NaN there would leak through attention). The
  client masks that slot: `attention_mask` is `[0]` followed by a 1 per real token (past and new).
  Our graph treats a 0 in the mask as left padding: the slot is never attended to and takes no
  position, so the logits are those of the unpadded sequence (checked in the tests by running this
  protocol in ONNX Runtime).
- No control inputs: Triton's ONNX Runtime and TensorRT backends refuse a control tensor the model
  does not take as an input (onnxruntime_backend ValidateBooleanSequenceControl; and the config's
  inputs + controls + states must be all of the model's inputs). Sequence start and end are the
  request flags (`sequence_start`, `sequence_end` with a `sequence_id`): Triton resets the state at a
  start and frees the slot at an end; the graph needs nothing else.
- max_batch_size 1: each sequence's cache has its own length, and Triton batches only equal shapes,
  so sequences run one per model instance per execution; concurrency comes from `instances`.
- TensorRT backend (a TensorRT, not TensorRT-RTX, decoder engine): the engine's profiles are
  prefill (past exactly 0) and decode (one token after 1..n-1 past). Under Triton the past is never
  0 (the slot above), so requests must fit the decode profile: the client sends the prompt one token
  per request. The config lists both profiles; the header says this.

Triton server itself cannot run on the machine this was written on: what is checked is the config
(parsed back with Triton's ModelConfig protobuf), its names, types and dims against the graph, and the
protocol above replayed in ONNX Runtime.
"""

from __future__ import annotations

from pathlib import Path

from ...catalog import Role
from ... import __version__
from ...config import check_name
from ...errors import PackageError
from ...folder.reader import MANIFEST
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
    reading_build,
    triton_type,
    write_model_dir,
)

DEFAULT_IDLE_US = 60_000_000  # a sequence idle for a minute is ended and its cache slot freed


@reading_build
def write_triton_decoder(build_dir: str | Path, repo_dir: str | Path, *, name: str | None = None,
                         backend: str = "auto", instances: int = 1, kind: str = "gpu",
                         max_sequence_idle_us: int = DEFAULT_IDLE_US, overwrite: bool = False,
                         allow_failed: bool = False, hardlink: bool = True, triton_release: str | None = None,
                         manifest: dict) -> Path:
    """Write `<repo_dir>/<name>/` serving the build's KV-cache decoder with implicit state.

    Args:
        backend: "onnxruntime" (the decoder graph), "tensorrt" (the decoder engine; TensorRT builds only,
            GPU) or "auto" (the engine when it is a TensorRT plan and kind is "gpu", else the graph).
        name: default `<model>-<precision>-decoder-trt|onnx`.
        max_sequence_idle_us: Triton ends a sequence idle this long and frees its slot.
        triton_release: the Triton release (YY.MM) that will serve it; a plan is checked against its TensorRT.
    Other arguments as in triton.write_triton_repo (triton.package writes both). Returns the model folder.
    """
    build_dir, repo_dir = Path(build_dir), Path(repo_dir)
    if backend not in ("auto", "tensorrt", "onnxruntime") or kind not in ("gpu", "cpu"):
        raise PackageError(f"backend must be auto, tensorrt or onnxruntime and kind gpu or cpu; got {backend!r}, {kind!r}")
    if not isinstance(instances, int) or instances < 1:
        raise PackageError(f"instances must be a positive integer, got {instances!r}")
    pb = model_config_pb2()
    if Role.DECODER_ONNX not in manifest["artifacts"]:
        raise PackageError(f"{build_dir}: the build has no KV-cache decoder (built with --no-decoder); rebuild with it")
    check_status(build_dir, manifest, allow_failed, "its decoder")
    backend = choose_backend(build_dir, manifest, backend, kind, engine=Role.DECODER_ENGINE, graph=Role.DECODER_ONNX)
    role = Role.DECODER_ENGINE if backend == "tensorrt" else Role.DECODER_ONNX
    check_triton_release(build_dir, manifest, triton_release, plan=backend == "tensorrt")

    graph = artifact_file(build_dir, manifest, Role.DECODER_ONNX)
    artifact = artifact_file(build_dir, manifest, role) if backend == "tensorrt" else graph
    profiles = _engine_profiles(build_dir, manifest) if backend == "tensorrt" else []
    cfg = decoder_config(pb, graph, name or _default_name(manifest, backend), backend, instances, kind,
                         max_sequence_idle_us, profiles)
    for k, v in parameters(manifest, role, backend, triton_release).items():
        cfg.parameters[k].string_value = v
    header = _header(build_dir, manifest, backend, profiles, triton_release)
    text = "".join(f"# {line}\n" for line in header) + "\n" + config_text(cfg)
    return write_model_dir(repo_dir, cfg.name, text, artifact, backend, build_dir / MANIFEST, manifest,
                            overwrite=overwrite, hardlink=hardlink)


def decoder_config(pb, graph: Path, name: str, backend: str = "onnxruntime", instances: int = 1, kind: str = "gpu",
                   max_sequence_idle_us: int = DEFAULT_IDLE_US, profiles: list | None = None):
    """The ModelConfig message for the decoder graph `graph` (names, types and dims read from it)."""
    from ...graphs.kvcache import check_decoder_onnx

    check_name(name, TRITON_NAME, PackageError)
    layout = check_decoder_onnx(graph)  # the graph's I/O is the recorded layout: names, order, ranks
    inputs, outputs = onnx_io(graph)
    cfg = pb.ModelConfig(name=name, platform=PLATFORM[backend], max_batch_size=1)
    plain_in = [t.name for t in layout.inputs if t.name not in layout.past_names]  # input_ids, attention_mask
    for n in plain_in:
        dtype, dims = inputs[n]
        cfg.input.add(name=n, data_type=pb.DataType.Value(triton_type(graph, n, dtype)), dims=dims[1:])
    logits = layout.outputs[0].name
    dtype, dims = outputs[logits]
    cfg.output.add(name=logits, data_type=pb.DataType.Value(triton_type(graph, logits, dtype)), dims=dims[1:])

    seq = cfg.sequence_batching
    seq.max_sequence_idle_microseconds = max_sequence_idle_us
    for present, past in layout.feedback.items():
        dtype, dims = inputs[past]
        if outputs[present][0] != dtype:
            raise PackageError(f"{graph}: '{present}' and '{past}' differ in type; a state must keep its type")
        ttype = pb.DataType.Value(triton_type(graph, past, dtype))
        state = seq.state.add(input_name=past, output_name=present, data_type=ttype, dims=dims[1:])
        state.initial_state.add(data_type=ttype, dims=[1 if d == -1 else d for d in dims[1:]], zero_data=True,
                                name=f"one masked zero slot for {past}")
    group = cfg.instance_group.add(count=instances, kind=pb.ModelInstanceGroup.KIND_GPU if kind == "gpu"
                                   else pb.ModelInstanceGroup.KIND_CPU)
    if profiles:
        group.profile.extend(str(i) for i in range(len(profiles)))
    return cfg


def _engine_profiles(build_dir: Path, manifest: dict) -> list:
    from ...folder.reader import read_engine_info

    info = artifact_file(build_dir, manifest, Role.DECODER_ENGINE_INFO) if Role.DECODER_ENGINE_INFO in manifest["artifacts"] else None
    if info is None:
        raise PackageError(f"{build_dir}: the decoder engine's sidecar (decoder_engine_info) with its profiles is missing")
    profiles = read_engine_info(info, PackageError).get("profiles") or []
    if len(profiles) != 2:
        raise PackageError(f"{info}: expected the decoder engine's two profiles (prefill, decode), found {len(profiles)}")
    for p in profiles:  # an untrusted sidecar: every shape the config is written from is checked first
        shapes = p.get("shapes")
        if not isinstance(shapes, dict) or not all(isinstance(v, dict) and isinstance(v.get("min"), list)
                                                   and isinstance(v.get("max"), list) for v in shapes.values()):
            raise PackageError(f"{info}: a profile without 'shapes' of min/max lists: not an andrea-export decoder engine")
    return profiles


def _default_name(manifest: dict, backend: str) -> str:
    return f"{manifest['model'].get('name', 'andrea')}-{manifest.get('precision', 'fp32')}-decoder-" \
           f"{'trt' if backend == 'tensorrt' else 'onnx'}"


def _header(build_dir: Path, manifest: dict, backend: str, profiles: list,
            triton_release: str | None = None) -> list[str]:
    lines = [
        f"Triton model configuration written by andrea-export {__version__}",
        f"from {build_dir.resolve() / MANIFEST}: the KV-cache decoder, model {manifest['model'].get('name', '?')}, "
        f"precision {manifest.get('precision', 'fp32')}, verification {manifest.get('status', 'unverified')}",
        "Stateful: Triton keeps past_key_values.* (implicit state, fed from present.*). Send requests of one",
        "sequence with the same sequence_id; sequence_start on the first, sequence_end on the last.",
        "The cache starts with one zeroed slot (Triton never starts a state at length 0): attention_mask is",
        "[0] + a 1 per real token so far, past and new. max_batch_size 1: one sequence per instance execution.",
    ]
    if backend == "tensorrt":
        name, version = builder_of(manifest)
        lines.append(f"TensorRT plan built by {name} {version}; the Triton release must ship that TensorRT.")
        for i, p in enumerate(profiles):
            shapes = "; ".join(f"{k} min {v['min']} max {v['max']}" for k, v in p["shapes"].items()
                               if k in ("input_ids", "past_key_values.0.key"))
            lines.append(f"profile {i} ({p.get('name', '?')}): {shapes}")
        lines.append("The past is never 0 here, so every request must fit the decode profile: one token per request.")
    return lines + pin_lines(manifest, backend, triton_release)
