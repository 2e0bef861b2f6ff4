"""Triton Inference Server model repositories from a build folder: the stateless model (stateless.py), the
KV-cache decoder as a stateful model (stateful.py) and the generate model for the Python backend, batching in
flight and streaming tokens (generate.py, served.py); `package` writes them from one read of the build.

    from andrea_export.deploy import triton
    triton.package("out/andrea-120m-fp32", "models/")   # models/<name>/, <name>-decoder/, <name>-generate/
"""

from __future__ import annotations

from pathlib import Path

from ...catalog import Role
from ...errors import PackageError
from ...folder.atomic import locked_folder
from .common import builder_of, check_triton_release, choose_backend, config_text, parse_config, read_manifest
from .generate import ENGINE_ROLES, write_generate_model
from .stateful import write_triton_decoder
from .stateless import write_triton_repo

__all__ = ["config_text", "generate_engine", "package", "parse_config", "pin_summary", "read_manifest",
           "write_generate_model", "write_triton_decoder", "write_triton_repo"]


def package(build_dir: str | Path, repo_dir: str | Path, *, name: str | None = None, backend: str = "auto",
            instances: int = 1, kind: str = "gpu", overwrite: bool = False, allow_failed: bool = False,
            hardlink: bool = True, generate: bool | None = None, generate_only: bool = False,
            triton_release: str | None = None, **options) -> list[Path]:
    """Every model of a build: the stateless one (write_triton_repo, which also takes `options`), when the
    build has the KV-cache decoder the stateful one (`<name>-decoder`; write_triton_decoder), and when it has
    what generate_engine says it steps the generate model (`<name>-generate`; write_generate_model; `generate`
    False: not, `generate_only`: that one alone). One shared lock and one read of the manifest for all, so they always
    come from the same build. `triton_release` (YY.MM): the Triton release that will serve them, checked against
    every plan before any model is written (see write_triton_repo). Returns the model folders."""
    common = dict(backend=backend, instances=instances, kind=kind, overwrite=overwrite, allow_failed=allow_failed,
                  hardlink=hardlink, triton_release=triton_release)
    with locked_folder(build_dir, shared=True):
        manifest = read_manifest(build_dir)
        engine = generate_engine(manifest, backend, kind)
        has_generate = ENGINE_ROLES[engine][0] in manifest["artifacts"]
        plan = not generate_only and _serves_plan(Path(build_dir), manifest, backend, kind)
        check_triton_release(Path(build_dir), manifest, triton_release, plan=plan)  # before the first model
        models = []
        if not generate_only:
            models.append(write_triton_repo(build_dir, repo_dir, name=name, manifest=manifest, **common, **options))
            if Role.DECODER_ONNX in manifest["artifacts"]:
                models.append(write_triton_decoder(build_dir, repo_dir, name=f"{name}-decoder" if name else None,
                                                   manifest=manifest, **common))
        if generate_only or generate or (generate is None and has_generate):
            models.append(write_generate_model(build_dir, repo_dir, name=f"{name}-generate" if name else None,
                                               manifest=manifest, overwrite=overwrite, allow_failed=allow_failed,
                                               hardlink=hardlink, engine=engine))
    return models


def generate_engine(manifest: dict, backend: str, kind: str) -> str:
    """What the generate model steps: the build's slot engine when it has one that TensorRT (not TensorRT-RTX)
    built, for GPU instances, unless `backend` is onnxruntime; else ONNX Runtime on the CPU."""
    slot = Role.SLOT_ENGINE in manifest["artifacts"] and builder_of(manifest)[0] == "tensorrt"
    return "tensorrt" if slot and kind == "gpu" and backend != "onnxruntime" else "onnxruntime"


def _serves_plan(build_dir: Path, manifest: dict, backend: str, kind: str) -> bool:
    """Whether the stateless or the stateful model would be a TensorRT plan (the writers choose the same way;
    what they would refuse, they say themselves)."""
    roles = [(Role.ENGINE, Role.ONNX)]
    if Role.DECODER_ONNX in manifest["artifacts"]:
        roles.append((Role.DECODER_ENGINE, Role.DECODER_ONNX))
    for engine, graph in roles:
        try:
            if choose_backend(build_dir, manifest, backend, kind, engine=engine, graph=graph) == "tensorrt":
                return True
        except (PackageError, KeyError):  # KeyError: an unknown backend, which the writer names
            continue
    return False


def pin_summary(model_dir: str | Path) -> str | None:
    """One line on what a packaged TensorRT plan needs (its config's parameters): the TensorRT version, the Triton
    releases that ship it and the GPU driver floor; None for a model that is not a plan."""
    cfg = parse_config((Path(model_dir) / "config.pbtxt").read_text())
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    if "andrea.tensorrt_version" not in params:
        return None
    return (f"{Path(model_dir).name}: TensorRT {params['andrea.tensorrt_version']} plan; Triton releases that ship it: "
            f"{params['andrea.triton_releases']}; GPU driver: {params['andrea.driver_floor']}")
