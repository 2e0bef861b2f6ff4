"""Lazy re-exports for a package's __init__ (PEP 562): each name is imported from its submodule on first use,
so importing one module of a stage never imports the rest (the runtime reads graphs/layout.py without torch)."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, table: dict[str, list[str]]):
    """(__getattr__, __dir__, __all__) for `package`, whose public names live in the submodules `table`
    names: {"submodule": ["name", ...]}. An entry "attr as name" exports the submodule's `attr` as `name`, spelled
    as the `from submodule import attr as name` that a TYPE_CHECKING block beside it writes."""
    where: dict[str, tuple[str, str]] = {}
    for module, names in table.items():
        for entry in names:
            attr, _, name = entry.partition(" as ")
            where[name or attr] = (f"{package}.{module}", attr)

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attr = where[name]
        return getattr(importlib.import_module(module), attr)

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__, sorted(where)
