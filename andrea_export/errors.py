"""The toolkit's errors: user errors (bad input, missing dependency) that the CLI prints as one clear
line and exits non-zero. Anything else is a bug and keeps its traceback. Also the two checks for optional
modules (`require`, `installed`), so that every layer can use them."""

import importlib
import importlib.util


class AndreaExportError(Exception):
    """Base of every error the toolkit raises on purpose."""


class ConfigError(AndreaExportError):
    """A model or build configuration is invalid; the message names the field."""


class CheckpointError(AndreaExportError):
    """A checkpoint is missing, corrupt, or does not fit the model; the message names the tensor."""


class ExportError(AndreaExportError):
    """ONNX export or an ONNX file is not what it should be."""


class PluginError(AndreaExportError):
    """The tanh-GELU plugin kernel or graph pass failed. `log` holds the compiler output, if any."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message + (f"\n--- compiler log ---\n{log.rstrip()}" if log else ""))
        self.log = log


class BuildError(AndreaExportError):
    """An engine build failed or was refused."""


class MissingDependency(AndreaExportError):
    """An optional package is needed for this step; the message says what to install."""


def require(module: str, extra: str, why: str):
    """Import `module` or raise MissingDependency naming the pip extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(
            f"{why} needs the Python module '{module}', which could not be imported ({e}). "
            f"Install it with: pip install 'andrea-export[{extra}]'"
        ) from e


def installed(module: str) -> bool:
    """Whether `tensorrt` / `tensorrt_rtx` is really there: tensorrt-stubs alone makes `import tensorrt`
    succeed as an empty namespace package, so the check is for a Builder."""
    try:
        return importlib.util.find_spec(module) is not None and hasattr(importlib.import_module(module), "Builder")
    except (ImportError, ValueError):  # ValueError: a None entry in sys.modules
        return False
