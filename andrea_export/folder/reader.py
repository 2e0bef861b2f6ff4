"""A build folder read as untrusted input. Folders are downloaded and shared, so before anything in one
is read, run, replaced or deleted: every path its manifest or an engine sidecar names must be a file
inside the folder (`inside`), and every field a command uses must have the type it expects
(`read_manifest`, `read_engine_info`). One reader, used by every command, so none of them trusts a
field the others check.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from .. import userfiles
from ..errors import BuildError
from ..names import BUILDERS, MAX_SEED, PRECISIONS
from ..userfiles import MAX_JSON_BYTES

MANIFEST = "manifest.json"
SCHEMA_VERSION = 1
STATUSES = ("passed", "engine-unverified", "failed")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def inside(folder: str | Path, name: object, what: str, error: type[Exception] = BuildError, *,
           flat: bool = False, kind: str = "build folder", within: str | Path | None = None) -> Path:
    """`folder / name`, when `name` (read from an untrusted file) is a relative path that stays inside
    `folder` once symlinks are resolved, and with `flat` names a file directly in it; else `error`
    naming `what` (where the path was read) and the `kind` of folder. `within`: a folder containing
    `folder` inside which the resolved path may lie instead (anywhere in it, `flat` or not; `name` itself
    stays a name in `folder`). Never touches the file."""
    folder = Path(folder)
    if not isinstance(name, str) or not name or "\x00" in name:
        raise error(f"{what}: {name!r} is not a file name")
    path = Path(name)
    if path.is_absolute() or ".." in path.parts or path.name in ("", ".", "..") or (flat and len(path.parts) > 1):
        raise error(f"{what}: {name!r} is outside the {kind} {folder}; refused: it may name only its own files")
    full = folder / path
    try:
        resolved, root = full.resolve(), folder.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise error(f"{what}: cannot resolve {name!r} ({e})") from None
    if within is not None:
        root, flat = Path(within).resolve(), False
    if root not in resolved.parents or (flat and resolved.parent != root):
        raise error(f"{what}: {name!r} resolves to {resolved}, outside the {kind} {folder}; refused")
    return full


def read_json(path: Path, error: type[Exception] = BuildError):
    """A manifest or sidecar: a regular file of at most MAX_JSON_BYTES, JSON of bounded depth (userfiles)."""
    return userfiles.read_json(path, MAX_JSON_BYTES, "a manifest or sidecar", error)


# Types, by example: a type; a tuple of allowed values; [spec] a list of such; {key: spec} an object
# with those keys (a key ending in '?' may be left out; other keys are allowed and ignored).
_NUMBER = (int, float)
_BUILDER = {"name": BUILDERS, "version": str, "compute_capabilities": [str], "build_seconds?": _NUMBER,
            "plugin_layers?": int, "opt_level?": int, "weights_stripped?": bool}
_VERIFICATION = {"passed?": bool, "skipped": [{"artifact": str, "reason": str}]}
_ARTIFACT = {"path": str, "sha256": str, "bytes": int}
MANIFEST_SCHEMA = {
    "schema_version": int, "tool?": dict, "created?": str, "status": STATUSES, "model": dict, "weights": dict,
    "precision": PRECISIONS, "builder": _BUILDER, "profiles": [dict], "plugin": {"calls?": int},
    "verification": _VERIFICATION, "environment?": dict, "options": dict, "artifacts": dict,
}
# What packaging needs: the rest is read with defaults, but what is there must have its type.
_MINIMAL = ("schema_version", "model", "artifacts")
ENGINE_INFO_SCHEMA = {"builder": BUILDERS, "builder_version": str, "plan_bytes": int, "plan_sha256": str,
                      "compute_capabilities": [str], "compute_capabilities_default?": bool, "plugin_layers?": int,
                      "precision?": str, "onnx?": str, "weights_stripped?": bool,
                      "profiles?": [dict]}


def _check(value, spec, where: str) -> str | None:
    """None when `value` fits `spec`, else what is wrong (naming the field)."""
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return f"{repr(where) if where else 'it'} must be a JSON object, not {_kind(value)}"
        for key, sub in spec.items():
            optional = key.endswith("?")
            key = key.rstrip("?")
            if key not in value:
                if not optional:
                    return f"'{where}.{key}' is missing" if where else f"'{key}' is missing"
                continue
            if (why := _check(value[key], sub, f"{where}.{key}" if where else key)) is not None:
                return why
        return None
    if isinstance(spec, list):
        if not isinstance(value, list):
            return f"'{where}' must be a list, not {_kind(value)}"
        for i, v in enumerate(value):
            if (why := _check(v, spec[0], f"{where}[{i}]")) is not None:
                return why
        return None
    if isinstance(spec, tuple) and spec and isinstance(spec[0], str):  # allowed values
        return None if value in spec and isinstance(value, str) else f"'{where}' must be one of {', '.join(spec)}, not {value!r:.60}"
    types = spec if isinstance(spec, tuple) else (spec,)
    if isinstance(value, bool) and bool not in types:  # JSON true is not the number 1
        return f"'{where}' must be {_names(types)}, not a boolean"
    if not isinstance(value, types):
        return f"'{where}' must be {_names(types)}, not {_kind(value)}"
    return None


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _names(types) -> str:
    return " or ".join({str: "a string", int: "an integer", float: "a number", bool: "a boolean", dict: "an object",
                        list: "a list"}[t] for t in types)


def check_manifest(manifest, folder: str | Path, *, full: bool = True, error: type[Exception] = BuildError) -> dict:
    """Validate a manifest (already parsed) of `folder`; returns it. `full`: every field a build writes
    must be there (inspect, verify, generate, rebuild); else only what packaging needs, the others
    type-checked where present."""
    from ..config import ModelConfig
    from ..errors import AndreaExportError

    folder = Path(folder)
    path = folder / MANIFEST
    if not isinstance(manifest, dict):
        raise error(f"{path}: expected a JSON object, not {_kind(manifest)}")
    version = manifest.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise error(f"{path}: schema_version {version!r:.40} is not supported (this andrea-export reads {SCHEMA_VERSION})")
    required = MANIFEST_SCHEMA.keys() if full else _MINIMAL
    spec = {k.rstrip("?") + ("" if k.rstrip("?") in required else "?"): v for k, v in MANIFEST_SCHEMA.items()}
    present = {k: v for k, v in manifest.items() if v is not None or k in required}  # null: not recorded
    if (why := _check(present, spec, "")) is not None:
        raise error(f"{path}: {why}")
    for role, entry in manifest["artifacts"].items():
        if (why := _check(entry, _ARTIFACT, f"artifacts.{role}")) is not None:
            raise error(f"{path}: {why}")
        inside(folder, entry["path"], f"{path}: artifact '{role}'", error, flat=True)
        if not _SHA256.fullmatch(entry["sha256"]) or entry["bytes"] < 0:
            raise error(f"{path}: artifact '{role}' needs a sha256 (64 hex digits) and a size in bytes >= 0")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    if missing := sorted(fields - set(manifest["model"])):  # a manifest records the whole config
        raise error(f"{path}: 'model' lacks {', '.join(missing)}")
    try:
        ModelConfig.from_dict(manifest["model"], source=f"{path}: 'model'")
        if "weights" in manifest:
            check_weights_source(manifest["weights"], f"{path}: 'weights'")
    except AndreaExportError as e:
        raise error(str(e)) from None
    return manifest


def read_manifest(folder: str | Path, *, full: bool = True, error: type[Exception] = BuildError) -> dict:
    """The manifest of a build folder, validated (see check_manifest)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise error(f"{folder}: no such build folder")
    path = folder / MANIFEST
    if not path.is_file():
        raise error(f"{folder}: no {MANIFEST}; not an andrea-export build folder (make one with `andrea-export build`)")
    inside(folder, MANIFEST, str(path), error)  # a manifest that is a symlink to somewhere else
    return check_manifest(read_json(path, error), folder, full=full, error=error)


def artifact(folder: str | Path, manifest: dict, role: str) -> Path:
    """The file of artifact `role` of a validated manifest."""
    return Path(folder) / manifest["artifacts"][role]["path"]


def changed_artifacts(folder: str | Path, manifest: dict) -> list[str]:
    """Names of the artifacts whose bytes no longer match a validated manifest (size, then sha256)."""
    from .atomic import sha256_file

    bad = []
    for a in manifest["artifacts"].values():
        p = Path(folder) / a["path"]
        if not p.is_file() or p.stat().st_size != a["bytes"] or sha256_file(p) != a["sha256"]:
            bad.append(a["path"])
    return bad


def read_engine_info(path: str | Path, error: type[Exception] = BuildError) -> dict:
    """An engine's `.plan.json` sidecar (what built it, for what), validated."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: no such engine description")
    info = read_json(path, error)
    if (why := _check(info, ENGINE_INFO_SCHEMA, "")) is not None:
        raise error(f"{path}: not an andrea-export engine description: {why}")
    if not _SHA256.fullmatch(info["plan_sha256"]) or info["plan_bytes"] < 0:
        raise error(f"{path}: 'plan_sha256' must be 64 hex digits and 'plan_bytes' >= 0")
    return info


def metadata_json(meta: dict[str, str], key: str, path) -> Any:
    """The JSON value of ONNX/safetensors metadata entry `key` (written by whoever made the file), or
    ExportError naming the file and the key. Any JSON value: each caller checks the shape it needs."""
    from ..errors import ExportError

    return userfiles.loads_json(meta[key], str(path), f"metadata '{key}'", ExportError)


def check_weights_source(source, where: str) -> dict:
    """Where an artifact's weights came from, as recorded (manifest 'weights', ONNX 'andrea.weights'):
    {"kind": "random-init", "seed": int} or {"kind": "checkpoint", "sha256": hex}."""
    from ..errors import CheckpointError

    spec = {"random-init": {"kind": str, "seed": int}, "checkpoint": {"kind": str, "sha256": str}}
    kind = source.get("kind") if isinstance(source, dict) else None
    why = (_check(source, spec[kind], "") if isinstance(kind, str) and kind in spec
           else f"'kind' must be random-init or checkpoint, not {kind!r:.40}")
    if why is None and kind == "checkpoint" and not _SHA256.fullmatch(source["sha256"]):
        why = "'sha256' must be 64 hex digits"
    if why is None and kind == "random-init" and not 0 <= source["seed"] <= MAX_SEED:
        why = f"'seed' must be in 0..2**63-1, not {str(source['seed'])[:40]}"
    if why is not None:
        raise CheckpointError(f"{where}: not a weight source andrea-export wrote: {why}")
    return source
