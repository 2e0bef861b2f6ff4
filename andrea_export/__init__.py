"""andrea-export: ANDREA-120M from PyTorch to verified ONNX and TensorRT engines.

One package per pipeline stage, lowest first (no module imports a stage above its own):
  errors, names, progress, config   the bottom: no stage of its own
  folder/    the build folder: atomic writes and the folder swap; the manifest read as untrusted input
  model/     the PyTorch reference model, checkpoints, GPT-2's names and config, the text corpus, the demo
  plugin/    our tanh-GELU TensorRT plugin: kernel compile, registration, reference, host emulation
  graphs/    every ONNX graph: export, KV-cache and in-place decoders, precision, quantization, the plugin pass
  engine/    TensorRT / TensorRT-RTX engines: builder, profiles, compatibility, refit
  runtime/   running a build: `runtime.load(folder).generate(...)` (no torch)
  verify/    Polygraphy against PyTorch, language-model figures, greedy agreement, the engines' checks
  deploy/    Triton repositories, onnxruntime-genai's config, the Optimum folder
  bench/     latency against the machine's limits and the runtimes users pick instead
  pipeline, inspect, cli   the top: the build's order of stages and the manifest; the command line
Nothing heavy is imported here. The modules of the earlier flat layout (`andrea_export.triton`,
`andrea_export.build`, ...) still import, with a DeprecationWarning naming the new place.

The package is also the face a user imports (FACE, below):

    import andrea_export as ae
    manifest = ae.build(ae.BuildOptions(config="andrea-tiny", out="andrea-build"))
    ae.verify("andrea-build")                        # again, on this machine
    new_ids = ae.load("andrea-build").generate([1, 2, 3], max_new_tokens=8)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings
from typing import TYPE_CHECKING

from ._lazy import lazy_exports

__version__ = "0.1.0"

# The face: module -> the names it gives the package, imported on first use so that `import andrea_export` stays
# light (no torch, no onnx). The TYPE_CHECKING block names the same objects for editors and type checkers; it
# never runs, so the layout test does not count it as an import of the stages above this one (tests/test_face.py
# holds the two lists equal).
FACE = {
    "pipeline": ["BuildOptions", "run_build as build", "verify_build as verify"],
    "runtime": ["load"],
    "runtime.base": ["Request", "Session"],
    "runtime.batcher": ["Batcher"],
    "runtime.sampling": ["Sampling"],
    "errors": ["AndreaExportError", "BuildError", "CheckpointError", "ConfigError", "InputError", "MissingDependency"],
}
_face_getattr, _, __all__ = lazy_exports(__name__, FACE)

if TYPE_CHECKING:
    from .errors import AndreaExportError, BuildError, CheckpointError, ConfigError, InputError, MissingDependency
    from .pipeline import BuildOptions
    from .pipeline import run_build as build
    from .pipeline import verify_build as verify
    from .runtime import load
    from .runtime.base import Request, Session
    from .runtime.batcher import Batcher
    from .runtime.sampling import Sampling

# face names that are also the names of modules: the verify stage, and the flat layout's `build`
_CALLS = {"verify": "verify_build", "build": "run_build"}


def __getattr__(name: str):
    if name == "verify":  # the stage's package, callable as verify_build (_Face says why)
        return importlib.import_module(f"{__name__}.verify")
    return _face_getattr(name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _CallableModule(types.ModuleType):
    """A module that is also one of the face's functions: calling it calls the function (_Face says why)."""

    def __call__(self, *args, **kwargs):
        name = _CALLS[self.__name__.rpartition(".")[2]]
        return getattr(importlib.import_module(f"{__name__}.pipeline"), name)(*args, **kwargs)


class _Face(types.ModuleType):
    """The package's module type. `ae.verify` and `ae.build` are functions, and `andrea_export.verify` (a stage)
    and `andrea_export.build` (a module of the flat layout) are modules: Python sets a package's attribute to its
    submodule whenever that is imported (every build imports the verify stage), which would replace the function
    by a module that cannot be called. Such a module is made callable as the function instead, so that
    `ae.verify(folder)` and `andrea_export.verify.compare` both work, whatever was imported first."""

    def __setattr__(self, name, value):
        if name in _CALLS and isinstance(value, types.ModuleType) and not isinstance(value, _CallableModule):
            value.__class__ = _CallableModule
        super().__setattr__(name, value)

# module of the flat layout -> the modules its names now live in (searched in order)
MOVED = {
    "artifacts": ["folder.atomic"],
    "buildfolder": ["folder.reader", "graphs.external_data"],
    "checkpoint": ["model.checkpoint", "model.gpt2"],
    "text": ["model.text"],
    "demo": ["model.demo"],
    "hf": ["model.gpt2", "deploy.optimum"],
    "export": ["graphs.export"],
    "kvcache": ["graphs.kvcache", "graphs.layout"],
    "inplace_decoder": ["graphs.inplace_decoder"],
    "precision": ["graphs.precision", "verify.thresholds"],
    "quantize": ["graphs.quantize"],
    "external_data": ["graphs.external_data"],
    "passes": ["graphs.gelu_plugin"],
    "passes.gelu_plugin": ["graphs.gelu_plugin"],
    "build": ["engine.builder", "engine.backends", "engine.profiles", "engine.compat", "engine.log", "engine.refit"],
    "triton": ["deploy.triton", "deploy.triton.common", "deploy.triton.stateless"],
    "triton_decoder": ["deploy.triton.stateful"],
    "genai": ["deploy.genai"],
    "runtime.agreement": ["verify.agreement"],
    "engine.builders": ["engine.backends"],
    "deploy.serve": ["deploy.server"],
    "bench.serve": ["bench.load"],
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `andrea_export.<old>` for every module of MOVED: a module whose attributes are those of its new
    modules. Asked last (after the real modules), so it never shadows one."""

    def find_spec(self, name, path=None, target=None):
        old = name.removeprefix(f"{__name__}.")
        return importlib.util.spec_from_loader(name, self) if old != name and old in MOVED else None

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        new = [f"{__name__}.{m}" for m in MOVED[module.__name__.removeprefix(f"{__name__}.")]]
        warnings.warn(f"{module.__name__} has moved: import from {' or '.join(new)}", DeprecationWarning, stacklevel=2)
        targets = [importlib.import_module(m) for m in new]

        def __getattr__(attr):
            for t in targets:
                if hasattr(t, attr):
                    return getattr(t, attr)
            raise AttributeError(f"module {module.__name__!r} (moved to {', '.join(new)}) has no attribute {attr!r}")

        module.__getattr__ = __getattr__
        module.__doc__ = f"Moved to {', '.join(new)}."


sys.meta_path.append(_MovedModules())
sys.modules[__name__].__class__ = _Face
