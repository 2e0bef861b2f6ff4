"""Compile the tanh-GELU kernel (plugins/gelu_tanh/gelu_tanh.cu) to PTX in-process with NVRTC.

NVRTC comes from PyPI and is loaded with ctypes (no cuda-python needed): the pinned wheel is
`nvidia-cuda-nvrtc==13.0.88`, which writes **PTX ISA 9.0**; a driver JIT-compiles PTX only up to the ISA
of its own CUDA release, so this PTX needs an **R580 driver (CUDA 13.0) or newer**. That is also the
floor of the TensorRT cu13 stack, so it costs nothing there. NVRTC 13.5 would write ISA 9.5 (refused by
R580); for older drivers (TensorRT 10.x on R535..R575) point `ANDREA_NVRTC` (or `nvrtc=`) at the
libnvrtc of an `nvidia-cuda-nvrtc-cu12==12.x` wheel: the result records the ISA and driver floor of
whatever compiled it. See plugins/gelu_tanh/README.md ("PTX, NVRTC and drivers"). Without a wheel, a
CUDA toolkit's libnvrtc is used (find_nvrtc: a GPU host with the toolkit and no pip install).

Targets: one PTX per architecture in TARGET_ARCHS (`-arch=compute_XX`, `.target sm_XX`). The PTX is not
the same for all: NVRTC 13.0 generates sm_100/sm_120 PTX with its newer NVVM backend. An engine embeds
the PTX of the GPU it is built on (`best_arch(detect_compute_capability())`: the highest target not
above the device), and PLUGIN_ARCH (sm_80, which every GPU from sm_80 on JIT-compiles) when the device
cannot be asked.

Results are cached on disk by sha256(source, options, NVRTC version) under ANDREA_PTX_CACHE or
~/.cache/andrea-export/ptx (XDG_CACHE_HOME respected).
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import MissingDependency, PluginError
from ..errors import cuda_driver_version as cuda_driver_version  # the driver's answers, asked once (errors.py)
from ..errors import detect_compute_capability as detect_compute_capability
from ..folder.atomic import write_text_atomic

NVRTC_REQUIREMENT = "nvidia-cuda-nvrtc==13.0.88"
TARGET_ARCHS: tuple[str, ...] = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")
PLUGIN_ARCH = "sm_80"  # what engines embed: PTX for sm_80 loads on every GPU >= sm_80
BLOCK_SIZE = 256  # threads per block the plugin launches with
DTYPES = ("float32", "float16", "bfloat16")
_DTYPE_SUFFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
ELEMENT_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
ENTRY_POINTS: tuple[str, ...] = tuple(
    f"gelu_tanh{b}_{s}" for b in ("", "_bias") for s in ("f32", "f16", "bf16")
)

# CUDA release of the compiler -> the first driver branch of that release. A driver JIT-compiles PTX up
# to its own CUDA release's ISA (tensorrt-facts.md §3.2), so the compiler's release sets the floor.
_DRIVER_BRANCH = {
    (12, 0): "R525", (12, 1): "R530", (12, 2): "R535", (12, 3): "R545", (12, 4): "R550",
    (12, 5): "R555", (12, 6): "R560", (12, 8): "R570", (12, 9): "R575", (13, 0): "R580",
}  # fmt: skip


def kernel_name(dtype: str, bias: bool = False) -> str:
    """Entry point for a dtype ("float32" | "float16" | "bfloat16"), e.g. gelu_tanh_bias_f16."""
    if dtype not in _DTYPE_SUFFIX:
        raise PluginError(f"tanh-GELU kernel: unsupported dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    return f"gelu_tanh{'_bias' if bias else ''}_{_DTYPE_SUFFIX[dtype]}"


def vector_width(dtype: str) -> int:
    """Elements per 16-byte vector: 4 for float32, 8 for float16/bfloat16."""
    return 16 // ELEMENT_SIZE[dtype]


def grid_size(n: int, dtype: str, block: int = BLOCK_SIZE) -> int:
    """Blocks the plugin launches for n elements: n // (block * VEC) + 1, i.e. ceil((n + 1) / (block * VEC)).

    That is ceil(n / (block * VEC)) except for one spare (idle) block when n is a multiple, and never 0
    (an empty launch is an error): written this way because TensorRT's symbolic `cdiv(numel + 1, k)` is
    available in every tensorrt.plugin version that has aot_impl."""
    return n // (block * vector_width(dtype)) + 1


def driver_floor(nvrtc_version: tuple[int, int]) -> str:
    """The oldest driver that JIT-compiles PTX written by NVRTC of this CUDA version."""
    major, minor = nvrtc_version
    branch = _DRIVER_BRANCH.get((major, minor))
    if branch:
        return f"{branch} (CUDA {major}.{minor}) or newer"
    return f"a CUDA {major}.{minor} driver or newer"


def kernel_source_path() -> Path:
    """gelu_tanh.cu: plugins/gelu_tanh/ of a checkout (editable installs too), else the copy an installed wheel
    carries in andrea_export/_kernels/ (pyproject.toml maps it there). ANDREA_GELU_SOURCE overrides both."""
    env = os.environ.get("ANDREA_GELU_SOURCE")
    if env:
        return Path(env)
    package = Path(__file__).resolve().parents[1]
    checkout = package.parent / "plugins" / "gelu_tanh" / "gelu_tanh.cu"
    installed = package / "_kernels" / "gelu_tanh.cu"
    return installed if installed.is_file() and not checkout.is_file() else checkout


def default_cache_dir() -> Path:
    from ..folder.atomic import cache_dir

    return cache_dir("ptx", override="ANDREA_PTX_CACHE")


def best_arch(capability: tuple[int, int] | None) -> str:
    """The highest TARGET_ARCHS entry not above a device's compute capability (PLUGIN_ARCH if unknown)."""
    if capability is None:
        return PLUGIN_ARCH
    cc = capability[0] * 10 + capability[1]
    fitting = [a for a in TARGET_ARCHS if int(a[3:]) <= cc]
    if not fitting:
        raise PluginError(f"GPU compute capability {capability[0]}.{capability[1]} is below sm_80, the kernel's minimum")
    return max(fitting, key=lambda a: int(a[3:]))


def check_driver(kernel: "CompiledKernel", driver: int | None) -> None:
    """Refuse PTX the installed driver cannot JIT-compile: it loads PTX up to the ISA of its own CUDA release,
    so a driver for CUDA d can load what NVRTC of CUDA v wrote only when d >= v. driver: cuDriverGetVersion's
    value (12080 = CUDA 12.8); None (no driver here) checks nothing: TensorRT itself cannot run then."""
    if driver is None:
        return
    m = re.match(r"(\d+)\.(\d+)", kernel.nvrtc_version)
    if not m:
        raise PluginError(f"cannot tell the CUDA version of NVRTC {kernel.nvrtc_version!r}")
    needed = (int(m.group(1)), int(m.group(2)))
    have = (driver // 1000, driver % 1000 // 10)
    if have >= needed:
        return
    wheel = f"nvidia-cuda-nvrtc{'-cu12' if have[0] == 12 else ''}=={have[0]}.{have[1]}.*"
    older = (
        f", or compile the kernel for this driver with its own NVRTC: pip install '{wheel}' and set ANDREA_NVRTC "
        f"to that wheel's libnvrtc.so (PTX ISA of CUDA {have[0]}.{have[1]})"
        if have >= (12, 0) else ""
    )  # fmt: skip
    raise PluginError(
        f"the tanh-GELU kernel is PTX ISA {kernel.ptx_isa} (NVRTC {kernel.nvrtc_version}), which needs an "
        f"{kernel.driver_floor} driver; this host's driver supports CUDA {have[0]}.{have[1]} "
        f"(cuDriverGetVersion {driver}) and would refuse it when TensorRT loads the engine. "
        f"Update the NVIDIA driver{older}"
    )


# ---- NVRTC through ctypes -----------------------------------------------------------------------------


class Nvrtc:
    """A loaded libnvrtc: version, path, and compile(source, options) -> (rc, ptx, log)."""

    def __init__(self, library: Path):
        self.path = library
        try:
            self._lib = ctypes.CDLL(str(library))
        except OSError as e:
            raise MissingDependency(_missing_message(str(library), str(e))) from e
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self._lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)
        # libnvrtc dlopen()s libnvrtc-builtins.so.<major>.<minor> by bare name; a wheel's lib folder is
        # not on the loader's path (the rc=7 "failed to open libnvrtc-builtins" of tensorrt-facts.md
        # §3.1), so load the matching builtins from the same folder first: the later dlopen by name
        # then finds it already loaded.
        builtins = library.parent / f"libnvrtc-builtins.so.{major.value}.{minor.value}"
        if builtins.exists():
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        self.wheel_version = _wheel_version(library)

    @property
    def version_string(self) -> str:
        v = f"{self.version[0]}.{self.version[1]}"
        return f"{v} ({self.wheel_version})" if self.wheel_version else v

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            self._lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            msg = self._lib.nvrtcGetErrorString(rc).decode()
            raise PluginError(f"NVRTC {what} failed with code {rc} ({msg}), library {self.path}")

    def compile(self, source: str, name: str, options: tuple[str, ...]) -> tuple[int, str, str]:
        lib = self._lib
        prog = ctypes.c_void_p()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
                    "nvrtcCreateProgram")  # fmt: skip
        try:
            opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            rc = lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
            buf = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
            log = buf.value.decode(errors="replace")
            ptx = ""
            if rc == 0:
                self._check(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
                buf = ctypes.create_string_buffer(size.value)
                self._check(lib.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
                ptx = buf.value.decode()
            return rc, ptx, log
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _missing_message(where: str, why: str) -> str:
    return (
        f"Compiling the tanh-GELU plugin kernel needs NVRTC (libnvrtc), which could not be loaded "
        f"from {where} ({why}). Install it with: pip install '{NVRTC_REQUIREMENT}' "
        f"(PTX ISA 9.0, drivers R580+), or set ANDREA_NVRTC to a libnvrtc.so "
        f"(e.g. from nvidia-cuda-nvrtc-cu12 for older drivers)"
    )


def _wheel_version(library: Path) -> str:
    """'nvidia-cuda-nvrtc 13.0.88' when the library comes from a pip wheel, else ''."""
    from importlib import metadata

    for dist in ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12"):
        try:
            d = metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            continue
        root = Path(str(d.locate_file(""))).resolve()
        if any(root / str(f) == library.resolve() for f in (d.files or [])):
            return f"{dist} {d.version}"
    return ""


def find_nvrtc() -> Path | None:
    """libnvrtc from the pinned wheel (nvidia/cu13/lib), else from a cu12 wheel (nvidia/cuda_nvrtc/lib), else a CUDA
    toolkit's: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, the loader's cache (ldconfig -p), cuda-pathfinder (which
    cuda-bindings brings). A GPU host often has the toolkit and no NVRTC wheel."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    for pattern in ("cu13/lib/libnvrtc.so.13", "cuda_nvrtc/lib/libnvrtc.so.12"):
        for root in roots:
            hits = sorted(glob.glob(os.path.join(root, pattern)))
            if hits:
                return Path(hits[0])
    toolkits = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for toolkit in filter(None, toolkits):
        for lib in ("lib64", "lib", "targets/*/lib"):
            for folder in sorted(glob.glob(os.path.join(toolkit, lib))):
                found = _nvrtc_in(Path(folder).glob("libnvrtc.so*"))
                if found:
                    return found
    try:
        ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"  # /sbin is not on every user's PATH
        cache = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        cache = ""
    return _nvrtc_in_ldconfig(cache) or _nvrtc_of_pathfinder()


def _nvrtc_in(paths: Iterable[str | os.PathLike[str]]) -> Path | None:
    """The libnvrtc.so.<major> among `paths` (the highest major), else plain libnvrtc.so; never the .alt build nor
    libnvrtc-builtins."""
    named = {Path(p).name: Path(p) for p in paths}
    sonames = [n for n in named if re.fullmatch(r"libnvrtc\.so\.\d+", n)]
    if sonames:
        return named[max(sonames, key=lambda n: int(n.rsplit(".", 1)[1]))]
    return named.get("libnvrtc.so")


def _nvrtc_in_ldconfig(listing: str) -> Path | None:
    """libnvrtc in `ldconfig -p`'s listing, whose lines read "libnvrtc.so.13 (libc6,x86-64) => /path/libnvrtc.so.13"."""
    return _nvrtc_in(m.group(1) for m in re.finditer(r"^\s*libnvrtc\S*\s.*=>\s*(\S+)\s*$", listing, re.M))


def _nvrtc_of_pathfinder() -> Path | None:
    """Where cuda-pathfinder (cuda-bindings' library finder) loads libnvrtc from, if it is installed and finds one."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib  # type: ignore[import-not-found,unused-ignore]

        path = load_nvidia_dynamic_lib("nvrtc").abs_path
    except Exception:  # noqa: BLE001: not installed, or no NVRTC where it looks: not found
        return None
    return Path(path) if path else None


_LOADED: dict[Path, Nvrtc] = {}


def load_nvrtc(library: str | os.PathLike[str] | None = None) -> Nvrtc:
    """Load NVRTC: `library` (a libnvrtc.so file or its folder), else $ANDREA_NVRTC, else find_nvrtc's (a wheel's, else
    a CUDA toolkit's)."""
    chosen = library if library is not None else os.environ.get("ANDREA_NVRTC") or None
    if chosen is not None:
        path = Path(chosen)
        if path.is_dir():
            hits = sorted(p for p in path.glob("libnvrtc.so*") if "alt" not in p.name)
            if not hits:
                raise MissingDependency(_missing_message(str(path), "no libnvrtc.so* in that folder"))
            path = hits[0]
        elif not path.exists():
            raise MissingDependency(_missing_message(str(path), "no such file"))
    else:
        found = find_nvrtc()
        if found is None:
            where = "the nvidia-cuda-nvrtc wheel or a CUDA toolkit ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda, ldconfig)"
            raise MissingDependency(_missing_message(where, "not found"))
        path = found
    path = path.resolve()
    if path not in _LOADED:
        _LOADED[path] = Nvrtc(path)
    return _LOADED[path]


# ---- compile ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """PTX of gelu_tanh.cu for one architecture, with what a manifest needs to say about it."""

    ptx: str
    arch: str  # "sm_90": the PTX's .target
    ptx_isa: str  # "9.0": the PTX's .version; a driver older than this ISA refuses to load it
    nvrtc_version: str  # "13.0 (nvidia-cuda-nvrtc 13.0.88)"
    driver_floor: str  # "R580 (CUDA 13.0) or newer"
    options: tuple[str, ...]
    source_sha256: str
    ptx_sha256: str
    entry_points: tuple[str, ...]
    cache_path: Path | None = None
    from_cache: bool = False

    def manifest(self) -> dict[str, Any]:
        """JSON-ready description for manifest.json."""
        d = dataclasses.asdict(self)
        for k in ("ptx", "cache_path", "from_cache"):
            d.pop(k)
        d["options"] = list(self.options)
        d["entry_points"] = list(self.entry_points)
        return d


def normalize_arch(arch: str) -> tuple[str, str]:
    """'sm_90' | 'compute_90' | '90' -> ('sm_90', 'compute_90')."""
    m = re.fullmatch(r"(?:sm_|compute_)?(\d{2,3})", arch)
    if not m:
        raise PluginError(f"invalid GPU architecture {arch!r}; expected e.g. 'sm_90'")
    return f"sm_{m.group(1)}", f"compute_{m.group(1)}"


def ptx_isa(ptx: str) -> str:
    m = re.search(r"^\s*\.version\s+(\d+\.\d+)", ptx, re.M)
    if not m:
        raise PluginError("NVRTC output has no .version line; not PTX?")
    return m.group(1)


def _entry_points(ptx: str) -> tuple[str, ...]:
    return tuple(re.findall(r"^\s*\.visible\s+\.entry\s+(\w+)\s*\(", ptx, re.M))


def compile_ptx(
    arch: str = PLUGIN_ARCH,
    *,
    source: str | None = None,
    options: tuple[str, ...] = (),
    cache_dir: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
    nvrtc: str | os.PathLike[str] | None = None,
) -> CompiledKernel:
    """Compile gelu_tanh.cu (or `source`) to PTX for `arch`, through the on-disk cache.

    Raises MissingDependency without NVRTC and PluginError(log=compiler log) when compilation fails."""
    sm, compute = normalize_arch(arch)
    if source is None:
        path = kernel_source_path()
        if not path.is_file():
            raise PluginError(f"tanh-GELU kernel source not found: {path}")
        source = path.read_text(encoding="utf-8")
    lib = load_nvrtc(nvrtc)
    opts = (f"--gpu-architecture={compute}", "--std=c++17", "--fmad=true", *options)
    src_sha = hashlib.sha256(source.encode()).hexdigest()
    key = hashlib.sha256(
        json.dumps({"source": src_sha, "options": opts, "nvrtc": lib.version_string}).encode()
    ).hexdigest()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cached = cache / f"{key}.ptx"
    from_cache = False
    if use_cache and cached.is_file():
        ptx = cached.read_text(encoding="utf-8")
        from_cache = True
    else:
        rc, ptx, log = lib.compile(source, "gelu_tanh.cu", opts)
        if rc != 0:
            raise PluginError(
                f"NVRTC {lib.version_string} could not compile the tanh-GELU kernel for {sm} "
                f"(options: {' '.join(opts)})",
                log=log,
            )
        if use_cache:
            write_text_atomic(cached, ptx)
    return CompiledKernel(
        ptx=ptx,
        arch=sm,
        ptx_isa=ptx_isa(ptx),
        nvrtc_version=lib.version_string,
        driver_floor=driver_floor(lib.version),
        options=opts,
        source_sha256=src_sha,
        ptx_sha256=hashlib.sha256(ptx.encode()).hexdigest(),
        entry_points=_entry_points(ptx),
        cache_path=cached if use_cache else None,
        from_cache=from_cache,
    )


def compile_all(archs: tuple[str, ...] = TARGET_ARCHS, **kwargs: Any) -> dict[str, CompiledKernel]:
    """One PTX per target architecture."""
    return {normalize_arch(a)[0]: compile_ptx(a, **kwargs) for a in archs}
