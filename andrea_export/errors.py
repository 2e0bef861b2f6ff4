"""The toolkit's errors: user errors (bad input, missing dependency) that the CLI prints as one clear
line and exits non-zero. Anything else is a bug and keeps its traceback. Also the two checks for optional
modules (`require`, `installed`) and the driver's answers on the GPU (`gpu_compute_capability`,
`detect_compute_capability`, `cuda_driver_version`: the one libcuda probe) and the host's
(`available_memory`), so that every layer can use them."""

import ctypes
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


class InputError(AndreaExportError):
    """Bad input to a runtime session (token ids, lengths, sampling settings, a build folder without the
    graph a backend needs). Raised before anything runs."""


class CudaError(AndreaExportError):
    """A CUDA runtime call failed."""


class PackageError(AndreaExportError):
    """A build folder cannot be packaged as asked; the message says why and what to do."""


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


def gpu_compute_capability() -> str | None:
    """The compute capability of GPU 0 ("8.9"), or None without a GPU and a working driver (here, beside
    `installed`, so the runtime can ask without importing the builder)."""
    cc = detect_compute_capability(0)
    return None if cc is None else f"{cc[0]}.{cc[1]}"


def detect_compute_capability(device: int = 0) -> tuple[int, int] | None:
    """The compute capability of CUDA device `device` ((8, 9)), or None without it and a working driver.

    Asks the CUDA driver (libcuda) directly, so it needs neither torch's CUDA build nor cuda-python: a bare
    GPU host's check script can ask before anything else is installed."""
    cuda = _libcuda()
    if cuda is None:
        return None
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), device) != 0:
        return None
    # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76 (cuda.h)
    if cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) or cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev):
        return None
    return major.value, minor.value


def cuda_driver_version() -> int | None:
    """The CUDA version the installed driver supports (cuDriverGetVersion: 13000 = 13.0), or None without libcuda."""
    cuda = _libcuda()
    if cuda is None:
        return None
    version = ctypes.c_int()
    if cuda.cuDriverGetVersion(ctypes.byref(version)) != 0:  # needs no cuInit
        return None
    return version.value


def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def available_memory() -> int | None:
    """Bytes this process may still take: the kernel's MemAvailable, or less where a cgroup (a container, CI)
    caps memory below it; None where neither can be read (not Linux)."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            cap = f.read().strip()
        if cap != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                limits.append(int(cap) - int(f.read().strip()))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def check_memory(cfg, need: int, doing: str, available: int | None = None) -> None:
    """ConfigError when `doing` (a verb: "building") model config `cfg` takes `need` bytes at its peak and this
    machine has less free (`available`; default: available_memory()): said before the work, instead of the
    kernel's OOM kill minutes into it."""
    free = available_memory() if available is None else available
    if free is not None and need > free:
        raise ConfigError(f"model config '{cfg.name}': {cfg.n_params:,} parameters; {doing} it takes about "
                          f"{need / 1e9:.1f} GB of memory at its peak, and this machine has {free / 1e9:.1f} GB "
                          "available: run it on a machine with more memory, or choose a smaller model")
