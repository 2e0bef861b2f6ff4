"""The package's layout, computed from its sources with `ast`: one package per pipeline stage, no module
importing a stage above its own, no import circle (lazy imports inside functions count too), and every
module saying in its first docstring line what it is for.

An `if TYPE_CHECKING:` block never runs, so its imports are not edges of the graph; only the face (the root
package, which names the user's API for type checkers) may use one to name a stage above its own, and its
runtime imports obey the rule like every module's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import andrea_export

ROOT = Path(andrea_export.__file__).parent
# Lowest first. A module may import its own stage and those below it, never one above.
STAGES = ["base", "folder", "model", "plugin", "graphs", "engine", "runtime", "verify", "deploy", "bench", "top"]
BASE = {"andrea_export", "catalog", "errors", "names", "progress", "config", "userfiles", "_lazy"}  # flat modules at the bottom
TOP = {"pipeline", "cli", "inspect", "__main__"}  # orchestration and the user's commands


def module_name(path: Path) -> str:
    parts = ["andrea_export", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def stage(module: str) -> str:
    first = module.split(".")[1] if "." in module else module
    if first in BASE:
        return "base"
    if first in TOP:
        return "top"
    assert first in STAGES, f"{module}: in no stage of the layout (add it to STAGES, BASE or TOP)"
    return first


def is_type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`"""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def split_nodes(tree: ast.AST) -> tuple[list[ast.AST], list[ast.AST]]:
    """(the nodes that can run, the nodes inside `if TYPE_CHECKING:` bodies, which never do)."""
    run, typing_only, todo = [], [], [(tree, False)]
    while todo:
        node, typed = todo.pop()
        (typing_only if typed else run).append(node)
        if is_type_checking(node):
            todo += [(n, True) for n in node.body] + [(n, typed) for n in node.orelse] + [(node.test, typed)]
        else:
            todo += [(n, typed) for n in ast.iter_child_nodes(node)]
    return run, typing_only


def imports(module: str, typing_only: bool = False) -> set[str]:
    """Every andrea_export module `module` imports, wherever the import stands (top level or in a function);
    with `typing_only`, those its `if TYPE_CHECKING:` blocks import instead."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in split_nodes(ast.parse(path.read_text(encoding="utf-8")))[typing_only]:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "andrea_export"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                target = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "andrea_export":
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target)
    unknown = found - MODULES.keys()
    assert not unknown, f"{module} imports modules that do not exist: {sorted(unknown)}"
    return found - {module}


GRAPH = {m: imports(m) for m in MODULES}
TYPING_GRAPH = {m: imports(m, typing_only=True) for m in MODULES}
FACE = "andrea_export"


def test_every_module_is_in_a_stage():
    assert {stage(m) for m in MODULES} == set(STAGES)


def test_no_module_imports_a_stage_above_its_own():
    upward = [f"{m} ({stage(m)}) imports {d} ({stage(d)})" for m, deps in GRAPH.items() for d in sorted(deps)
              if STAGES.index(stage(d)) > STAGES.index(stage(m))]
    assert not upward, "\n".join(upward)


def test_only_the_face_imports_upward_for_type_checkers():
    upward = [f"{m} ({stage(m)}) imports {d} ({stage(d)}) for type checkers" for m, deps in TYPING_GRAPH.items()
              for d in sorted(deps) if m != FACE and STAGES.index(stage(d)) > STAGES.index(stage(m))]
    assert not upward, "\n".join(upward)
    assert {stage(d) for d in TYPING_GRAPH[FACE]} >= {"top", "runtime"}, "the face names the user's API for editors"


def test_a_type_checking_import_is_not_a_runtime_import():
    source = ("import typing\nfrom typing import TYPE_CHECKING\nimport a\nif TYPE_CHECKING:\n    import b\n"
              "else:\n    import c\nif typing.TYPE_CHECKING:\n    import d\ndef f():\n    import e\n")
    run, typed = split_nodes(ast.parse(source))
    names = lambda nodes: {a.name for n in nodes if isinstance(n, ast.Import) for a in n.names}  # noqa: E731
    assert (names(run), names(typed)) == ({"typing", "a", "c", "e"}, {"b", "d"})


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert cycles(GRAPH) == []


def test_the_circle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_says_what_it_is_for(module):
    doc = ast.get_docstring(ast.parse(MODULES[module].read_text(encoding="utf-8")))
    assert doc and doc.splitlines()[0].strip(), f"{MODULES[module]}: no docstring saying what the module is for"


PACKAGES = sorted(m for m, p in MODULES.items() if m != FACE and p.name == "__init__.py" and "lazy_exports" in p.read_text())


def test_the_stages_re_export_lazily():
    assert {p.split(".")[1] for p in PACKAGES} == {"folder", "model", "graphs", "engine", "verify", "deploy"}


@pytest.mark.parametrize("package", PACKAGES)
def test_every_name_a_stage_exports_is_there(package):
    import importlib

    module = importlib.import_module(package)
    assert module.__all__ and all(getattr(module, name) is not None for name in module.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        module.nothing_here


def test_a_runtime_import_pulls_in_no_other_stage():
    """The runtime is what a service imports: it reads graphs and folders, but none of the build's stages."""
    import subprocess
    import sys

    code = ("import sys, andrea_export.runtime; "
            "print(' '.join(m for m in sys.modules if m.startswith('andrea_export.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    stages = {stage(m) for m in loaded}
    assert stages <= {"base", "folder", "graphs", "runtime"}, loaded
    assert not [m for m in loaded if stage(m) == "graphs" and m not in
                ("andrea_export.graphs", "andrea_export.graphs.layout", "andrea_export.graphs.external_data")], loaded


@pytest.mark.parametrize("old, name", [("triton", "package"), ("build", "build_engine"), ("build", "sidecar_path"),
                                       ("hf", "write_hf_folder"), ("hf", "read_hf_config"), ("checkpoint", "load_model"),
                                       ("precision", "TOLERANCES"), ("runtime.agreement", "greedy_agreement"),
                                       ("buildfolder", "read_manifest"), ("triton_decoder", "write_triton_decoder"),
                                       ("engine.builders", "network_flags"), ("deploy.serve", "start"),
                                       ("bench.serve", "run_serve_benchmark")])
def test_modules_of_the_flat_layout_still_import_with_a_warning(old, name):
    import importlib
    import sys

    from andrea_export import MOVED

    sys.modules.pop(f"andrea_export.{old}", None)
    with pytest.warns(DeprecationWarning, match=f"andrea_export.{old} has moved"):
        module = importlib.import_module(f"andrea_export.{old}")
    new = [importlib.import_module(f"andrea_export.{m}") for m in MOVED[old]]
    assert getattr(module, name) is next(getattr(m, name) for m in new if hasattr(m, name))
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        module.nothing_here


def test_no_old_name_shadows_a_real_module():
    from andrea_export import MOVED

    assert not [old for old in MOVED if f"andrea_export.{old}" in MODULES]
