"""Lazy re-exports for a package's __init__ (PEP 562): each name is imported from its submodule on first use,
so importing one module of a stage never imports the rest (the runtime reads graphs/layout.py without torch)."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, table: dict[str, list[str]]):
    """(__getattr__, __dir__, __all__) for `package`, whose public names live in the submodules `table`
    names: {"submodule": ["name", ...]}."""
    where = {name: f"{package}.{module}" for module, names in table.items() for name in names}

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name]), name)

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__, sorted(where)
