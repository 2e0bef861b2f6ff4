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
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__version__ = "0.1.0"

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
    "build": ["engine.builder", "engine.builders", "engine.profiles", "engine.compat", "engine.log", "engine.refit"],
    "triton": ["deploy.triton", "deploy.triton.common", "deploy.triton.stateless"],
    "triton_decoder": ["deploy.triton.stateful"],
    "genai": ["deploy.genai"],
    "runtime.agreement": ["verify.agreement"],
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
