"""`andrea-export inspect`: a readable summary of a build folder, an ONNX file or an engine."""

from __future__ import annotations

from pathlib import Path

from .catalog import Role
from .errors import AndreaExportError


def describe(path: str | Path) -> dict:
    """What a build folder, ONNX file or engine (.plan) is, as a JSON-ready dict."""
    path = Path(path)
    if path.is_dir():
        return _describe_build(path)
    if not path.is_file():
        raise AndreaExportError(f"{path}: no such file or folder")
    if path.suffix == ".onnx":
        return _describe_onnx(path)
    if path.suffix in (".plan", ".engine", ".trt"):
        return _describe_engine(path)
    raise AndreaExportError(f"{path}: cannot inspect a '{path.suffix}' file; expected a build folder, .onnx or .plan")


def _describe_build(folder: Path) -> dict:
    from .folder.reader import changed_artifacts, read_manifest
    from .graphs.external_data import check_folder_weights

    m = read_manifest(folder)
    altered = changed_artifacts(folder, m)
    refused = None
    if not altered:
        try:
            check_folder_weights(folder, m, AndreaExportError)  # links and unrecorded weights files
        except AndreaExportError as e:
            refused = str(e)
    return {"kind": "build", "path": str(folder), "status": m["status"], "model": m["model"]["name"],
            "precision": m["precision"], "weights": m["weights"], "builder": m["builder"], "profiles": m["profiles"],
            "decoder_profiles": None if altered else _decoder_profiles(folder, m),  # a changed sidecar is not read
            "plugin": m["plugin"], "verification": m["verification"],
            "artifacts": {r: f"{a['path']} ({a['bytes'] / 1e6:,.1f} MB)" for r, a in m["artifacts"].items()},
            "integrity": (f"CHANGED since the build: {', '.join(altered)}" if altered else f"REFUSED: {refused}" if refused
                          else "every artifact matches its sha256"),
            "intact": not altered and not refused}


def _decoder_profiles(folder: Path, m: dict) -> dict | None:
    """The decoder engine's profiles (prefill, decode), from its sidecar; None without a decoder engine."""
    from .folder.reader import read_engine_info

    if Role.DECODER_ENGINE_INFO not in m["artifacts"]:
        return None
    profiles = read_engine_info(folder / m["artifacts"][Role.DECODER_ENGINE_INFO]["path"]).get("profiles") or []
    return {p.get("name", str(i)): {t: f"min {s['min']} opt {s['opt']} max {s['max']}" for t, s in p["shapes"].items()}
            for i, p in enumerate(profiles) if isinstance(p, dict) and isinstance(p.get("shapes"), dict)}


def _describe_onnx(path: Path) -> dict:
    import onnx

    from .graphs.export import op_counts
    from .graphs.external_data import external_data_files
    from .graphs.layout import check_onnx

    model = check_onnx(path)

    def io(values):
        out = {}
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_param or d.dim_value for d in t.shape.dim]
            out[v.name] = f"{onnx.TensorProto.DataType.Name(t.elem_type).lower()} {dims}"
        return out

    meta = {p.key: p.value for p in model.metadata_props}
    weights = external_data_files(path, model)
    return {"kind": "onnx", "path": str(path),
            "bytes": path.stat().st_size + sum(weights.values()),
            "weights_files": weights,
            "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
            "inputs": io(model.graph.input), "outputs": io(model.graph.output),
            "nodes": dict(sorted(op_counts(model).items(), key=lambda kv: -kv[1])),
            "local_functions": [f"{f.domain}.{f.name}" for f in model.functions], "metadata": meta}


def _describe_engine(path: Path) -> dict:
    from .engine.refit import sidecar_path
    from .folder.atomic import sha256_file
    from .folder.reader import read_engine_info

    info = {"kind": "engine", "path": str(path), "bytes": path.stat().st_size}
    side = sidecar_path(path)
    if side.is_file():
        built = read_engine_info(side)
        info["built"] = built
        same = built["plan_bytes"] == info["bytes"] and sha256_file(path) == built["plan_sha256"]
        info["integrity"] = (f"matches the sha256 in {side.name}" if same else
                             f"CHANGED: not the engine {side.name} describes (its sha256 differs)")
        info["intact"] = same
    else:
        info["built"] = f"unknown: no {side.name} beside it (not built by andrea-export?)"
    return info


def print_description(d: dict) -> None:
    """`d` as a person reads it: one `key: value` line each, nested values indented below their key, lists
    of plain values on one line (`--json` gives the dict itself)."""
    from .progress import console, styled

    title = {"build": "Build folder", "onnx": "ONNX model", "engine": "TensorRT engine"}[d["kind"]]
    console.print(styled(title, "bold"), d["path"])
    for k, v in d.items():
        if k not in ("kind", "path", "intact"):
            _print_field(console, styled, k, v, 0)


def _print_field(console, styled, key, value, depth: int) -> None:
    pad = "  " * depth
    plain = (str, int, float, bool, type(None))
    if isinstance(value, dict) and value:
        console.print(styled(f"{pad}{key}:", "cyan"))
        for k, v in value.items():
            _print_field(console, styled, k, v, depth + 1)
    elif isinstance(value, list) and value and not all(isinstance(x, plain) for x in value):
        console.print(styled(f"{pad}{key}:", "cyan"))
        for i, v in enumerate(value):
            _print_field(console, styled, f"[{i}]", v, depth + 1)
    else:
        if value in ({}, [], None):
            shown = "none"
        elif isinstance(value, list):  # a shape stays a shape; names are listed
            shown = str(value) if all(isinstance(x, int) for x in value) else ", ".join(map(str, value))
        else:
            shown = str(value)
        console.print(styled(f"{pad}{key}:", "cyan"), shown)
