"""The build folder's table (andrea_export/catalog.py): every role has its row, the file names a build of each
precision writes, what each engine is built from, and no artifact role spelled as a string outside the table."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import andrea_export
from andrea_export.catalog import TABLE, Artifacts, Kind, Role, decoder_graph, engine_source, planned
from andrea_export.names import PRECISIONS

ROOT = Path(andrea_export.__file__).parent
# Roles whose value is also an ordinary word of other schemas (a sidecar's "onnx", a manifest's "weights", a
# runner or report named "engine"): spelled as a string, they are a role only where an artifacts mapping is read.
COMMON_WORDS = {r.value for r in Role if "_" not in r.value}


def test_every_role_has_one_row_and_every_row_a_distinct_file():
    assert set(TABLE) == set(Role)
    for p in PRECISIONS:
        roles = planned(p, "tensorrt", tokenizer=True, eval_text=True)
        names = [TABLE[r].file_name(p) for r in roles]
        assert len(set(names)) == len(names), (p, names)


@pytest.mark.parametrize("precision, role, name", [
    ("fp32", Role.ONNX, "model.onnx"), ("fp16", Role.ONNX, "model.fp16.onnx"), ("fp16", Role.ONNX_FP32, "model.onnx"),
    ("int4", Role.ONNX_PLUGIN, "model.int4.qdq.plugin.onnx"), ("bf16", Role.ONNX_PLUGIN, "model.bf16.plugin.onnx"),
    ("int8", Role.DECODER_ONNX_QDQ, "decoder.int8.qdq.onnx"), ("fp16", Role.DECODER_ONNX_INPLACE,
                                                              "decoder.fp16.inplace.onnx"),
    ("fp32", Role.DECODER_ONNX_SLOTS, "decoder.slots.onnx"), ("bf16", Role.DECODER_ONNX_SLOTS, "decoder.bf16.slots.onnx"),
    ("int4", Role.DECODER_ONNX_SLOTS, "decoder.int4.qdq.slots.onnx"),
    ("fp32", Role.DECODER_ONNX_PLUGIN, "decoder.plugin.onnx"), ("int8", Role.WEIGHTS, "weights.int8.data"),
    ("int8", Role.WEIGHTS_FP32, "weights.fp32.data"), ("fp16", Role.DECODER_ENGINE_INFO, "decoder.plan.json"),
])
def test_file_names_are_the_folder_format(precision, role, name):
    assert TABLE[role].file_name(precision) == name


def test_what_each_engine_is_built_from():
    assert engine_source(Role.ENGINE, "tensorrt", "fp16") == Role.ONNX_PLUGIN
    assert engine_source(Role.DECODER_ENGINE, "tensorrt", "int4") == Role.DECODER_ONNX_PLUGIN
    assert engine_source(Role.ENGINE, "tensorrt-rtx", "fp32") == Role.ONNX
    assert engine_source(Role.DECODER_ENGINE, "tensorrt-rtx", "int8") == Role.DECODER_ONNX_QDQ
    with pytest.raises(ValueError):
        engine_source(Role.ONNX, "tensorrt", "fp32")


def test_decoder_graph_by_backend():
    have = {Role.DECODER_ONNX, Role.DECODER_ONNX_INPLACE}
    assert decoder_graph("onnxruntime", have) == Role.DECODER_ONNX_INPLACE
    assert decoder_graph("onnxruntime", {Role.DECODER_ONNX}) == Role.DECODER_ONNX  # a bf16 build has none
    assert decoder_graph("onnxruntime-cuda", have) == decoder_graph("tensorrt", have) == Role.DECODER_ONNX


def test_artifacts_refuse_a_file_the_table_does_not_name(tmp_path):
    made = Artifacts(tmp_path, "fp16")
    assert made.add(Role.ONNX, tmp_path / "model.fp16.onnx") == tmp_path / "model.fp16.onnx"
    with pytest.raises(ValueError, match="'model.fp16.onnx', not 'model.onnx'"):
        made.add(Role.ONNX, "model.onnx")
    made.add(Role.ONNX_FP32, "model.onnx")
    assert made.graphs_by_precision() == {"fp16": [tmp_path / "model.fp16.onnx"], "fp32": [tmp_path / "model.onnx"]}
    assert made.precision_of(Role.ONNX_FP32) == "fp32" and TABLE[Role.WEIGHTS].kind == Kind.WEIGHTS


def test_artifacts_of_a_manifest_keep_its_names_and_skip_unknown_roles(tmp_path):
    entry = {"sha256": "0" * 64, "bytes": 1}
    m = {"precision": "fp32", "artifacts": {"onnx": {"path": "model.onnx", **entry},
                                           "something_newer": {"path": "x.bin", **entry}}}
    made = Artifacts.of_manifest(tmp_path, m)
    assert dict(made) == {Role.ONNX: "model.onnx"} and made.path("onnx") == tmp_path / "model.onnx"


# Where a role's value names something else (module, file): why.
OTHER_MEANINGS = {
    ("deploy/__init__.py", "genai_config"): "the function genai.genai_config in the lazy export table",
    ("engine/builder.py", "layer_report"): "the engine sidecar's field",
    ("pipeline.py", "eval_text"): "the build option --eval-text",
}


def names_artifacts(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return any(word in text for word in ("artifact", "have", "made"))


def role_strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Artifact roles spelled as string constants: a role with an underscore anywhere; a role that is a common
    word where it indexes or is tested against an expression that names artifacts, or is handed to a function
    that reads one (artifact(), artifact_file(), ...)."""
    roles = {r.value for r in Role}

    def role(node) -> str | None:
        return node.value if isinstance(node, ast.Constant) and node.value in roles else None

    found = []
    for node in ast.walk(tree):
        if (value := role(node)) and value not in COMMON_WORDS:
            found.append((node.lineno, value))
        elif isinstance(node, ast.Subscript) and (value := role(node.slice)) and names_artifacts(node.value):
            found.append((node.lineno, value))
        elif isinstance(node, ast.Compare) and (value := role(node.left)) and any(
                isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(map(names_artifacts, node.comparators)):
            found.append((node.lineno, value))
        elif isinstance(node, ast.Call) and "artifact" in ast.unparse(node.func):
            found += [(node.lineno, value) for arg in node.args if (value := role(arg))]
        elif isinstance(node, ast.comprehension) and any(map(names_artifacts, node.ifs)):
            found += [(elt.lineno, value) for elt in getattr(node.iter, "elts", []) if (value := role(elt))]
    return found


def test_no_artifact_role_is_spelled_outside_the_table():
    spelled = [f"{p.relative_to(ROOT)}:{line}: {value!r}" for p in sorted(ROOT.rglob("*.py")) if p.name != "catalog.py"
               for line, value in role_strings(ast.parse(p.read_text(encoding="utf-8")))
               if (p.relative_to(ROOT).as_posix(), value) not in OTHER_MEANINGS]
    assert not spelled, "use catalog.Role:\n" + "\n".join(spelled)


@pytest.mark.parametrize("code", ['m["artifacts"]["decoder_engine_info"]', 'x = "onnx_plugin"',
                                  'if "engine" in manifest["artifacts"]: pass', 'artifacts["onnx"]',
                                  'r = [x for x in ("tokenizer",) if x in have]',
                                  'artifact(folder, m, "engine")'])
def test_the_role_finder_finds_a_spelled_role(code):
    assert role_strings(ast.parse(code))


@pytest.mark.parametrize("code", ['info["onnx"]', 'runners["engine"] = r', 'm["weights"]', 'artifacts[Role.ONNX]'])
def test_the_role_finder_leaves_other_schemas_alone(code):
    assert not role_strings(ast.parse(code))
