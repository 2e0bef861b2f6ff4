"""The package's face: `import andrea_export as ae` gives the user's API (ae.build, ae.verify, ae.load, the
options, requests, sessions and errors), each name the very object of its stage, imported on first use (so the
import stays light), and the same names in the TYPE_CHECKING block that editors and type checkers read."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys

import pytest

import andrea_export as ae
from andrea_export import FACE

# face name -> (module, attribute): what the user's API promises
EXPECTED = {
    "build": ("pipeline", "run_build"), "verify": ("pipeline", "verify_build"), "BuildOptions": ("pipeline", "BuildOptions"),
    "load": ("runtime", "load"), "Session": ("runtime.base", "Session"), "Request": ("runtime.base", "Request"),
    "Batcher": ("runtime.batcher", "Batcher"), "Sampling": ("runtime.sampling", "Sampling"),
    **{e: ("errors", e) for e in ["AndreaExportError", "BuildError", "CheckpointError", "ConfigError", "InputError",
                                  "MissingDependency"]},
}


def face_table() -> dict[str, tuple[str, str]]:
    return {(entry.partition(" as ")[2] or entry): (module, entry.partition(" as ")[0])
            for module, entries in FACE.items() for entry in entries}


def type_checking_names() -> dict[str, tuple[str, str]]:
    """name -> (module, attribute) of the imports in the face's `if TYPE_CHECKING:` block."""
    tree = ast.parse(open(ae.__file__, encoding="utf-8").read())
    blocks = [n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING"]
    assert len(blocks) == 1
    return {a.asname or a.name: (node.module, a.name) for node in blocks[0].body if isinstance(node, ast.ImportFrom)
            for a in node.names}


def test_the_face_is_the_api_promised():
    assert face_table() == EXPECTED
    assert sorted(ae.__all__) == sorted(EXPECTED)


def test_type_checkers_see_the_same_names():
    assert type_checking_names() == face_table()


@pytest.mark.parametrize("name", sorted(set(EXPECTED) - {"verify"}))
def test_every_face_name_is_the_object_of_its_stage(name, monkeypatch):
    module, attr = EXPECTED[name]
    if name == "build":  # another test may have imported the flat layout's `andrea_export.build`: see the next tests
        if "build" in vars(ae):
            monkeypatch.delitem(vars(ae), "build")
    assert getattr(ae, name) is getattr(importlib.import_module(f"andrea_export.{module}"), attr)


def test_verify_is_the_verify_stage_and_verifies_a_build(monkeypatch):
    """`andrea_export.verify` is a stage package too: Python sets it on the package whenever it is imported, so the
    package itself answers the call, and both uses work whatever was imported first."""
    from andrea_export import pipeline
    from andrea_export.verify import compare

    calls = []
    monkeypatch.setattr(pipeline, "verify_build", lambda *a, **k: calls.append((a, k)) or "report")
    assert ae.verify is importlib.import_module("andrea_export.verify")
    assert ae.verify.compare is compare
    assert ae.verify("out/build", greedy_steps=3) == "report"
    assert calls == [(("out/build",), {"greedy_steps": 3})]


def test_build_calls_run_build_after_the_flat_module_is_imported(monkeypatch):
    from andrea_export import pipeline

    calls = []
    monkeypatch.setattr(pipeline, "run_build", lambda *a, **k: calls.append((a, k)) or "manifest")
    monkeypatch.delitem(sys.modules, "andrea_export.build", raising=False)  # the warning comes on the first import only
    with pytest.warns(DeprecationWarning, match="andrea_export.build has moved"):
        old = importlib.import_module("andrea_export.build")
    assert ae.build is old and old.build_engine is importlib.import_module("andrea_export.engine.builder").build_engine
    assert ae.build("opts", force=True) == "manifest"
    assert calls == [(("opts",), {"force": True})]


def test_dir_lists_the_face():
    assert set(EXPECTED) <= set(dir(ae))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        ae.nothing_here


def test_importing_the_package_is_light():
    """A service or a CLI's `--help` pays for what it uses: the face imports nothing until a name is used."""
    code = "import sys, andrea_export as ae; ae.__all__; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "onnx", "onnxruntime", "numpy", "tensorrt_rtx")]
    assert not heavy, heavy
    assert [m for m in loaded if m.startswith("andrea_export")] == ["andrea_export", "andrea_export._lazy"]


def test_a_decoder_through_the_face(lively_decoder):
    from andrea_export import runtime

    session = ae.load(lively_decoder.parent)
    assert isinstance(session, ae.Session)
    ids = session.generate([1, 2, 3], max_new_tokens=6)
    assert ids == runtime.load(lively_decoder.parent).generate([1, 2, 3], max_new_tokens=6) and len(ids) == 6
    with pytest.raises(ae.InputError, match="outside the vocabulary") as e:
        session.generate([10**9], max_new_tokens=2)
    assert isinstance(e.value, ae.AndreaExportError)
