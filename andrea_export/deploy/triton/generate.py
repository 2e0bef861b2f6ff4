"""The generate model of a build, for Triton's Python backend (served.py): in-flight batching and token streaming.

    from andrea_export.deploy.triton.generate import write_generate_model
    write_generate_model("out/andrea-120m-fp32", "models/")      # models/andrea-120m-fp32-generate/

    REPO/<name>-generate/config.pbtxt       backend "python", decoupled, the generate inputs and outputs
    REPO/<name>-generate/1/model.py         `from andrea_export.deploy.triton.served import TritonPythonModel`
    REPO/<name>-generate/1/build/           what the runtime reads: manifest, in-place decoder, weights,
                                            tokenizer (hard links where the file system allows)
    REPO/<name>-generate/andrea-build.json  the build's manifest (provenance, as the other models have)

`engine="tensorrt"`: the batcher steps the build's in-flight batching engine (`build --max-slots N`, TensorRT
>= 10.15) on GPU 0 instead of ONNX Runtime on the CPU: 1/build/ holds the slot engine, its sidecar and its
graphs in place of the in-place decoder, and the instance group is KIND_GPU. The serving Python then needs the
TensorRT that built the engine and cuda-python (docs/gpu-hosts.md).

The serving Python needs andrea-export and its runtime's packages (numpy, onnx, onnxruntime, tokenizers): the
`serve` environment (make serve-env) has them; in NVIDIA's Triton container, `pip install andrea-export` first.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ...catalog import Role
from ...errors import PackageError
from ...folder.reader import MANIFEST, artifact, changed_artifacts
from ...graphs.external_data import graph_weights
from ...runtime.batcher import ADMIT
from .common import (
    PROVENANCE,
    VERSION_DIR,
    check_status,
    config_text,
    model_config_pb2,
    place_file,
    reading_build,
    staged_model_dir,
)
from .served import BUILD_DIR, ENGINES, INPUTS, OUTPUTS

# ONNX Runtime on the CPU: a step's time grows with its rows, but slower than its tokens do, so 16 streams share
# steps for more tokens/s than 8 (bench --serve, benchmarks/README.md); each slot holds a context's cache
DEFAULT_SLOTS = 16
# what each engine reads of the build (runtime.load checks each against the manifest); the first is the graph
ENGINE_ROLES = {"onnxruntime": (Role.DECODER_ONNX_INPLACE,),
                "tensorrt": (Role.DECODER_ONNX_SLOTS, Role.SLOT_ENGINE_ONNX, Role.SLOT_ENGINE, Role.SLOT_ENGINE_INFO)}

MODEL_PY = '''"""Triton Python-backend model written by andrea-export (deploy/triton/generate.py)."""

from andrea_export.deploy.triton.served import TritonPythonModel  # noqa: F401
'''


@reading_build
def write_generate_model(build_dir: str | Path, repo_dir: str | Path, *, name: str | None = None, slots: int | None = None,
                         prefill_chunk: int = 64, step_tokens: int | None = None, instances: int = 1,
                         overwrite: bool = False, allow_failed: bool = False,
                         hardlink: bool = True, in_place: bool = False, admit: str = "in-flight",
                         engine: str = "onnxruntime", manifest: dict) -> Path:
    """Write REPO/<name> (default `<model>-<precision>-generate`) from the build folder; returns the model folder.
    `in_place`: the model reads the build folder where it is (1/build/ is a link to it, so the configuration
    Triton shows its clients names no path of this machine) instead of a copy: what `serve` does, for a
    repository that lives as long as the server. `engine`: what the batcher steps, onnxruntime (the in-place
    decoder, CPU instances) or tensorrt (the slot engine, a GPU instance). `slots` (the most requests decoding
    together): default DEFAULT_SLOTS on ONNX Runtime, and on TensorRT as many as the slot engine was built for."""
    build_dir, repo = Path(build_dir), Path(repo_dir)
    check_status(build_dir, manifest, allow_failed, "the generate model")
    have = manifest["artifacts"]
    if engine not in ENGINES:
        raise PackageError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "onnxruntime" and Role.DECODER_ONNX_INPLACE not in have:
        raise PackageError(f"{build_dir}: no in-place decoder (decoder.inplace.onnx), which the generate model batches "
                           "over; bf16 builds have none (ONNX Runtime's CPU provider has no bf16 kernels): build fp32, "
                           "fp16, int8 or int4 with the decoder")
    if engine == "tensorrt" and Role.SLOT_ENGINE not in have:
        raise PackageError(f"{build_dir}: no in-flight batching engine (decoder.slots.plan), which the generate model "
                           "steps on TensorRT: build it with `andrea-export build --max-slots N` on the GPU host "
                           "(TensorRT >= 10.15), or package the ONNX Runtime one")
    options = manifest.get("options")  # the record of the build's options, untrusted like the rest
    most = options.get("max_slots") if isinstance(options, dict) else None  # the engine's profiles say it at load
    most = most if type(most) is int and 1 <= most <= 256 else None
    if slots is None:
        slots = most if engine == "tensorrt" and most else DEFAULT_SLOTS
    if not 1 <= slots <= 256 or not 1 <= prefill_chunk <= manifest["model"]["n_positions"]:
        raise PackageError(f"slots must be 1..256 and prefill_chunk 1..n_positions, got {slots} and {prefill_chunk}")
    if engine == "tensorrt" and most is not None and slots > most:
        raise PackageError(f"{build_dir}: its slot engine was built for at most {most} decoding rows "
                           f"(build --max-slots {most}), not {slots}: serve fewer, or rebuild it with more")
    if step_tokens is not None and not slots < step_tokens <= slots + manifest["model"]["n_positions"]:
        raise PackageError(f"step_tokens must be more than slots ({slots}: the decoding rows come first) and at most "
                           f"slots + n_positions, got {step_tokens}")
    roles = [r for r in ENGINE_ROLES[engine] + (Role.TOKENIZER, Role.TOKENIZER_CONFIG) if r in have]
    if changed := changed_artifacts(build_dir, {"artifacts": {r: have[r] for r in roles}}):
        raise PackageError(f"{build_dir}: {', '.join(changed)} changed since the build (sha256 differs); rebuild it")
    decoder = artifact(build_dir, manifest, ENGINE_ROLES[engine][0])
    files = [have[r]["path"] for r in roles] + graph_weights(build_dir, manifest, decoder, PackageError)
    name = name or f"{manifest['model']['name']}-{manifest['precision']}-generate"

    pb = model_config_pb2()
    cfg = pb.ModelConfig(name=name, backend="python", max_batch_size=0)
    cfg.model_transaction_policy.decoupled = True
    for tensor_name, (dtype, dims) in INPUTS.items():
        cfg.input.add(name=tensor_name, data_type=pb.DataType.Value(dtype), dims=dims, optional=True)
    for tensor_name, (dtype, dims) in OUTPUTS.items():
        cfg.output.add(name=tensor_name, data_type=pb.DataType.Value(dtype), dims=dims)
    if engine == "tensorrt":  # the runtime drives the device the process sees first (CUDA_VISIBLE_DEVICES picks it)
        cfg.instance_group.add(kind=pb.ModelInstanceGroup.KIND_GPU, count=instances, gpus=[0])
    else:
        cfg.instance_group.add(kind=pb.ModelInstanceGroup.KIND_CPU, count=instances)
    if admit not in ADMIT:
        raise PackageError(f"admit must be one of {', '.join(ADMIT)}, got {admit!r}")
    for key, value in (("slots", slots), ("prefill_chunk", prefill_chunk), ("admit", admit), ("engine", engine)):
        cfg.parameters[key].string_value = str(value)
    if step_tokens is not None:
        cfg.parameters["step_tokens"].string_value = str(step_tokens)

    with staged_model_dir(repo, name, overwrite) as model_dir:
        version = model_dir / VERSION_DIR
        version.mkdir()
        if in_place:
            (version / BUILD_DIR).symlink_to(build_dir.resolve(), target_is_directory=True)
        else:
            (version / BUILD_DIR).mkdir()
            for f in files:  # weights copied: onnx refuses a weights file with several hard links
                place_file(build_dir / f, version / BUILD_DIR / f, hardlink=hardlink and not f.endswith(".data"))
            shutil.copyfile(build_dir / MANIFEST, version / BUILD_DIR / MANIFEST)
        (version / "model.py").write_text(MODEL_PY, encoding="utf-8")
        shutil.copyfile(build_dir / MANIFEST, model_dir / PROVENANCE)
        (model_dir / "config.pbtxt").write_text(config_text(cfg), encoding="utf-8")
    return repo / name
