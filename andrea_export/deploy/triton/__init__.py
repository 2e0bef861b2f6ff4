"""Triton Inference Server model repositories from a build folder: the stateless model (stateless.py), the
KV-cache decoder as a stateful model (stateful.py) and the generate model for the Python backend, batching in
flight and streaming tokens (generate.py, served.py); `package` writes them from one read of the build.

    from andrea_export.deploy import triton
    triton.package("out/andrea-120m-fp32", "models/")   # models/<name>/, <name>-decoder/, <name>-generate/
"""

from __future__ import annotations

from pathlib import Path

from ...folder.atomic import locked_folder
from .common import config_text, parse_config, read_manifest
from .generate import write_generate_model
from .stateful import write_triton_decoder
from .stateless import write_triton_repo

__all__ = ["config_text", "package", "parse_config", "read_manifest", "write_generate_model", "write_triton_decoder",
           "write_triton_repo"]


def package(build_dir: str | Path, repo_dir: str | Path, *, name: str | None = None, backend: str = "auto",
            instances: int = 1, kind: str = "gpu", overwrite: bool = False, allow_failed: bool = False,
            hardlink: bool = True, generate: bool | None = None, generate_only: bool = False, **options) -> list[Path]:
    """Every model of a build: the stateless one (write_triton_repo, which also takes `options`), when the
    build has the KV-cache decoder the stateful one (`<name>-decoder`; write_triton_decoder), and when it has
    the in-place decoder the generate model (`<name>-generate`; write_generate_model; `generate` False: not,
    `generate_only`: that one alone). One shared lock and one read of the manifest for all, so they always
    come from the same build. Returns the model folders."""
    common = dict(backend=backend, instances=instances, kind=kind, overwrite=overwrite, allow_failed=allow_failed,
                  hardlink=hardlink)
    with locked_folder(build_dir, shared=True):
        manifest = read_manifest(build_dir)
        has_generate = "decoder_onnx_inplace" in manifest["artifacts"]
        models = []
        if not generate_only:
            models.append(write_triton_repo(build_dir, repo_dir, name=name, manifest=manifest, **common, **options))
            if "decoder_onnx" in manifest["artifacts"]:
                models.append(write_triton_decoder(build_dir, repo_dir, name=f"{name}-decoder" if name else None,
                                                   manifest=manifest, **common))
        if generate_only or generate or (generate is None and has_generate):
            models.append(write_generate_model(build_dir, repo_dir, name=f"{name}-generate" if name else None,
                                               manifest=manifest, overwrite=overwrite, allow_failed=allow_failed,
                                               hardlink=hardlink))
    return models
