"""Whether an engine can run here, and which GPUs a build may target: the recorded builder version, the plan's
sha256, this GPU's compute capability against the engine's targets, and precisions the targets cannot run."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from ..errors import BuildError, ConfigError, gpu_compute_capability
from ..folder.atomic import sha256_file
from .backends import BUILDER_MODULES, BUILDER_NAMES, trt_module
from .log import make_logger

# TensorRT-RTX's own default targets, documented: "an engine built by TensorRT-RTX can be run on GPU
# devices with compute capability 8.0, 8.6, 8.9, 12.0, and later" (cpu-engines.html). We keep that
# default (it builds fastest: listing the same four explicitly doubles the AOT time for the same plan).
RTX_DEFAULT_CCS = ("8.0", "8.6", "8.9", "12.0")


RTX_CCS = ("7.5", "8.0", "8.6", "8.9", "12.0", "12.1")  # what tensorrt_rtx.ComputeCapability names


def check_engine_compat(plan_path: str | Path, manifest: dict) -> dict:
    """Check that the engine `plan_path`, described by `manifest` (its `.plan.json` sidecar or the
    package manifest's engine entry), can run here. Raises BuildError saying what differs and to rebuild.

    Checked: the file is the one recorded (size, sha256 when recorded); the builder is installed at the
    recorded version (engines are not portable across TensorRT versions); and, where a GPU is present,
    its compute capability is a recorded target, and the runtime's own header check (RTX
    `get_engine_validity`) agrees. Returns {"checked": [...], "skipped": [...]}."""
    plan_path = Path(plan_path)
    checked, skipped = [], []
    if not plan_path.is_file():
        raise BuildError(f"{plan_path}: no such engine file")
    for key in ("builder", "builder_version"):
        if key not in manifest:
            raise BuildError(f"{plan_path}: its manifest has no '{key}'; cannot tell what built it: rebuild it")
    size = plan_path.stat().st_size
    if "plan_bytes" in manifest and manifest["plan_bytes"] != size:
        raise BuildError(f"{plan_path}: {size} bytes, but its manifest records {manifest['plan_bytes']}: not the engine it describes")
    if "plan_sha256" in manifest:
        if sha256_file(plan_path) != manifest["plan_sha256"]:
            raise BuildError(f"{plan_path}: sha256 differs from its manifest: not the engine it describes")
        checked.append("sha256")
    builder, recorded = manifest["builder"], manifest["builder_version"]
    trt = trt_module(builder)
    if trt.__version__ != recorded:
        raise BuildError(
            f"{plan_path}: built with {BUILDER_NAMES[builder]} {recorded}, but this environment has {trt.__version__}; "
            f"engines do not load across versions: rebuild it, or install {BUILDER_MODULES[builder][0]}=={recorded}"
        )
    checked.append("builder version")
    cc = gpu_compute_capability()
    targets = list(manifest.get("compute_capabilities") or [])
    if cc is None:
        skipped.append("compute capability (no GPU here)")
    else:
        default = manifest.get("compute_capabilities_default", False)
        ok = cc in targets or (default and int(cc.split(".")[0]) >= 12)
        if not ok:
            raise BuildError(
                f"{plan_path}: built for compute capability {', '.join(targets) or '?'}, but this GPU is {cc}: rebuild it here"
                + (" (with --compute-capability " + cc + ")" if builder == "tensorrt-rtx" else "")
            )
        checked.append("compute capability")
        runtime = trt.Runtime(make_logger(trt))
        if hasattr(runtime, "get_engine_validity") and hasattr(runtime, "engine_header_size"):
            with open(plan_path, "rb") as f:
                header = f.read(runtime.engine_header_size)
            validity, diagnostics = runtime.get_engine_validity(header)
            if validity != trt.EngineValidity.VALID:
                raise BuildError(f"{plan_path}: {BUILDER_NAMES[builder]} says the engine is {validity.name} here (diagnostics {diagnostics}): rebuild it")
            checked.append("engine header")
    return {"checked": checked, "skipped": skipped}


def build_targets(trt, builder: str, requested: Sequence[str] | None) -> tuple[list[str], bool]:
    if builder == "tensorrt":
        if requested:
            raise ConfigError("compute capabilities apply to TensorRT-RTX only: TensorRT builds for the GPU it runs on")
        return [gpu_compute_capability() or "?"], False
    if not requested:
        return list(RTX_DEFAULT_CCS), True
    out = normalize_compute_capabilities(requested)
    for cc in out:
        if not hasattr(trt.ComputeCapability, "SM" + cc.replace(".", "")):
            raise ConfigError(f"compute capability {cc!r} is not a target of this TensorRT-RTX {trt.__version__}")
    return out, False


def normalize_compute_capabilities(requested: Sequence[str]) -> list[str]:
    """TensorRT-RTX targets as "8.6" (also accepted: "86", "sm_86"), checked without TensorRT-RTX."""
    out = []
    for cc in requested:
        norm = str(cc).strip().lower().removeprefix("sm_").removeprefix("sm")
        if re.fullmatch(r"\d{2,3}", norm):
            norm = f"{norm[:-1]}.{norm[-1]}"
        if norm not in RTX_CCS:
            raise ConfigError(f"compute capability {cc!r} is not a TensorRT-RTX target; choose from {', '.join(RTX_CCS)}")
        if norm not in out:
            out.append(norm)
    if "7.5" in out and len(out) > 1:
        raise ConfigError("compute capability 7.5 (Turing) must be built alone: TensorRT-RTX makes no portable engines with Turing")
    return out


def check_targets(builder: str, requested: Sequence[str] | None, precision: str) -> None:
    """The target GPUs against the builder and the precision, before anything is built."""
    if builder == "tensorrt":
        if requested:
            raise ConfigError("compute capabilities apply to TensorRT-RTX only: TensorRT builds for the GPU it runs on")
        return
    check_precision(BUILDER_NAMES[builder], precision, normalize_compute_capabilities(requested) if requested else [])


def check_precision(name: str, precision: str, ccs: list[str]) -> None:
    """Refuse, before the builder starts, a precision the target GPUs cannot run (TensorRT would fail
    late and obscurely). Turing (7.5) has no bf16, and TensorRT-RTX builds no fp32 GEMMs for it."""
    old = [cc for cc in ccs if cc != "?" and tuple(map(int, cc.split("."))) < (8, 0)]
    if not old:
        return
    if precision == "bf16":
        raise ConfigError(f"precision bf16 needs compute capability 8.0 or newer; the target {', '.join(old)} has "
                          "no bf16: build fp16 (--precision fp16)")
    if precision in ("fp32", "int8", "int4") and name == "TensorRT-RTX":  # weight-only: float32 activations
        raise ConfigError("TensorRT-RTX builds no fp32 matrix multiplies for compute capability 7.5 (Turing): "
                          "build an fp16 graph (--precision fp16) for it")
