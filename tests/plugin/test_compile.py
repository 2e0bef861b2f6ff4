"""NVRTC compile of the tanh-GELU kernel, and what ptxas makes of it (SASS read with cuobjdump).

Needs the pinned NVRTC wheel (nvidia-cuda-nvrtc==13.0.88); the SASS checks need ptxas and cuobjdump, which
the dev extra installs (nvidia-cuda-nvcc, nvidia-cuda-cuobjdump wheels; a CUDA toolkit's are used without
them), and are skipped, with the reason, where neither is there."""

import glob
import importlib.util
import os
import re
import shutil
import subprocess

import pytest

from andrea_export.errors import MissingDependency, PluginError
from andrea_export.plugin.compile import (
    ENTRY_POINTS,
    TARGET_ARCHS,
    best_arch,
    compile_all,
    compile_ptx,
    driver_floor,
    grid_size,
    load_nvrtc,
)


def _tool(name: str) -> str | None:
    """The dev extra's pinned wheel first (nvidia/cu13/bin: the same on every machine), else a CUDA toolkit."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        hits = sorted(glob.glob(os.path.join(root, "*", "bin", name)))
        if hits:
            return hits[0]
    return shutil.which(name)


@pytest.fixture(scope="module")
def ptx_by_arch(tmp_path_factory):
    return compile_all(cache_dir=tmp_path_factory.mktemp("ptx"))


def test_ptx_for_every_target(ptx_by_arch):
    assert list(ptx_by_arch) == list(TARGET_ARCHS)
    for arch, k in ptx_by_arch.items():
        assert k.arch == arch
        assert re.search(rf"^\.target {arch}$", k.ptx, re.M)
        assert k.ptx_isa == "9.0"  # the pinned NVRTC 13.0.88
        assert k.driver_floor == "R580 (CUDA 13.0) or newer"
        assert k.nvrtc_version == "13.0 (nvidia-cuda-nvrtc 13.0.88)"
        assert k.entry_points == ENTRY_POINTS
        assert k.ptx.count("tanh.approx.f32") >= 4  # float16 / bfloat16 entry points
        assert k.ptx.count("ex2.approx.ftz.f32") >= 2  # float32 entry points: the accurate tanh
        assert "ld.global.v4.u32" in k.ptx and "st.global.v4.u32" in k.ptx
        assert set(k.manifest()) == {"arch", "ptx_isa", "nvrtc_version", "driver_floor", "options",
                                     "source_sha256", "ptx_sha256", "entry_points"}  # fmt: skip


def test_cache_hit_and_key(tmp_path):
    first = compile_ptx("sm_90", cache_dir=tmp_path)
    again = compile_ptx("sm_90", cache_dir=tmp_path)
    assert not first.from_cache and again.from_cache and again.ptx == first.ptx
    other = compile_ptx("sm_90", cache_dir=tmp_path, options=("-DANDREA_UNUSED=1",))
    assert not other.from_cache and other.cache_path != first.cache_path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.cache_path.name, other.cache_path.name])


def test_compile_failure_carries_the_log(tmp_path):
    with pytest.raises(PluginError) as e:
        compile_ptx("sm_80", source='extern "C" __global__ void k() { undeclared_thing(); }', cache_dir=tmp_path)
    assert e.value.log and "undeclared_thing" in e.value.log
    assert str(e.value).startswith(
        "NVRTC 13.0 (nvidia-cuda-nvrtc 13.0.88) could not compile the tanh-GELU kernel for sm_80 "
        "(options: --gpu-architecture=compute_80 --std=c++17 --fmad=true)\n--- compiler log ---\n"
    )
    assert e.value.log.strip() in str(e.value)
    assert list(tmp_path.iterdir()) == []  # nothing cached


def test_missing_nvrtc_message(tmp_path):
    missing = tmp_path / "libnvrtc.so.13"
    with pytest.raises(MissingDependency) as e:
        load_nvrtc(missing)
    assert str(e.value) == (
        f"Compiling the tanh-GELU plugin kernel needs NVRTC (libnvrtc), which could not be loaded from {missing} "
        "(no such file). Install it with: pip install 'nvidia-cuda-nvrtc==13.0.88' (PTX ISA 9.0, drivers R580+), "
        "or set ANDREA_NVRTC to a libnvrtc.so (e.g. from nvidia-cuda-nvrtc-cu12 for older drivers)"
    )


def test_missing_nvrtc_through_env(tmp_path, monkeypatch):
    monkeypatch.setenv("ANDREA_NVRTC", str(tmp_path))  # a folder without libnvrtc
    with pytest.raises(MissingDependency, match=r"from .* \(no libnvrtc.so\* in that folder\)"):
        compile_ptx("sm_80", cache_dir=tmp_path)


def test_invalid_arch():
    with pytest.raises(PluginError, match=r"^invalid GPU architecture 'hopper'; expected e.g. 'sm_90'$"):
        compile_ptx("hopper")


def test_arch_choice_and_grid():
    assert best_arch(None) == "sm_80"
    assert best_arch((9, 0)) == "sm_90"
    assert best_arch((8, 7)) == "sm_86"
    assert best_arch((10, 3)) == "sm_100"
    assert best_arch((12, 1)) == "sm_120"
    with pytest.raises(PluginError, match="below sm_80"):
        best_arch((7, 5))
    assert driver_floor((12, 2)) == "R535 (CUDA 12.2) or newer"
    assert driver_floor((13, 5)) == "a CUDA 13.5 driver or newer"
    assert grid_size(0, "float16") == 1
    assert grid_size(2047, "float16") == 1
    assert grid_size(2048, "float16") == 2
    assert grid_size(1024, "float32") == 2


# ---- SASS ---------------------------------------------------------------------------------------------

PTXAS, CUOBJDUMP = _tool("ptxas"), _tool("cuobjdump")


def _functions(sass: str) -> dict[str, list[str]]:
    """{kernel: [opcode, ...]} from cuobjdump -sass (predicates dropped)."""
    out: dict[str, list[str]] = {}
    cur = None
    for line in sass.splitlines():
        m = re.search(r"Function : (\w+)", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m and cur is not None:
            cur.append(m.group(1))
    return out


@pytest.mark.skipif(PTXAS is None or CUOBJDUMP is None,
                    reason="needs ptxas (CUDA toolkit / nvidia-cuda-nvcc) and cuobjdump (nvidia-cuda-cuobjdump)")  # fmt: skip
@pytest.mark.parametrize("arch", TARGET_ARCHS)
def test_sass(ptx_by_arch, arch, tmp_path, record_property):
    ptx = tmp_path / "k.ptx"
    ptx.write_text(ptx_by_arch[arch].ptx)
    cubin = tmp_path / "k.cubin"
    proc = subprocess.run([PTXAS, f"-arch={arch}", "-v", "-o", str(cubin), str(ptx)], capture_output=True, text=True)
    if proc.returncode != 0 and "Unsupported .version" in proc.stderr:
        pytest.skip(f"this ptxas is older than PTX ISA {ptx_by_arch[arch].ptx_isa}: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    # ptxas -v: per entry "Compiling entry function 'X'" ... "N bytes spill stores, M bytes spill loads" ... "Used R registers"
    regs = dict(re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", proc.stderr, re.S))
    assert set(regs) == set(ENTRY_POINTS)
    assert re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", proc.stderr) == [("0", "0", "0")] * 6
    record_property(f"registers_{arch}", regs)
    print(arch, "registers:", regs)
    sass = subprocess.run([CUOBJDUMP, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    funcs = _functions(sass)
    assert set(funcs) == set(ENTRY_POINTS)
    for name, ops in funcs.items():
        if name.endswith("f32"):  # float32: tanh to float32 accuracy (ex2 and a reciprocal), never tanh.approx
            assert "MUFU.TANH" not in ops and "MUFU.EX2" in ops, name
        else:  # float16 / bfloat16: tanh is one hardware instruction, not a software tanh (exp + reciprocal)
            assert "MUFU.EX2" not in ops, name
            assert ops.count("MUFU.TANH") >= 2 + 8, name  # head, tail, one vector
        assert not any(op.startswith(("LDL", "STL")) for op in ops), name  # no local memory
        loads128 = sum(op.startswith("LDG.E.128") for op in ops)
        assert loads128 >= (2 if "_bias_" in name else 1), name  # x (and bias) in 16-byte vectors
        assert any(op.startswith("STG.E.128") for op in ops), name


# --- the driver floor: PTX that the installed driver cannot JIT is refused before TensorRT sees it ----------


def _kernel(nvrtc: str, isa: str, floor: str):
    from andrea_export.plugin.compile import CompiledKernel

    return CompiledKernel(ptx="", arch="sm_80", ptx_isa=isa, nvrtc_version=nvrtc, driver_floor=floor, options=(),
                          source_sha256="", ptx_sha256="", entry_points=())  # fmt: skip


@pytest.mark.parametrize("driver", [None, 13000, 13020, 14000])
def test_driver_new_enough_passes(driver):
    from andrea_export.plugin.compile import check_driver

    check_driver(_kernel("13.0 (nvidia-cuda-nvrtc 13.0.88)", "9.0", "R580 (CUDA 13.0) or newer"), driver)
    check_driver(_kernel("12.8", "8.7", "R570 (CUDA 12.8) or newer"), 12080 if driver is None else driver)


def test_driver_too_old_is_refused_with_what_to_do():
    from andrea_export.plugin.compile import check_driver

    k = _kernel("13.0 (nvidia-cuda-nvrtc 13.0.88)", "9.0", "R580 (CUDA 13.0) or newer")
    with pytest.raises(PluginError) as e:
        check_driver(k, 12080)  # an R570 host
    assert str(e.value) == (
        "the tanh-GELU kernel is PTX ISA 9.0 (NVRTC 13.0 (nvidia-cuda-nvrtc 13.0.88)), which needs an R580 (CUDA 13.0) "
        "or newer driver; this host's driver supports CUDA 12.8 (cuDriverGetVersion 12080) and would refuse it when "
        "TensorRT loads the engine. Update the NVIDIA driver, or compile the kernel for this driver with its own NVRTC: "
        "pip install 'nvidia-cuda-nvrtc-cu12==12.8.*' and set ANDREA_NVRTC to that wheel's libnvrtc.so (PTX ISA of CUDA 12.8)"
    )
    with pytest.raises(PluginError) as e:
        check_driver(_kernel("12.8", "8.7", "R570 (CUDA 12.8) or newer"), 12040)
    assert "pip install 'nvidia-cuda-nvrtc-cu12==12.4.*'" in str(e.value)
    with pytest.raises(PluginError) as e:
        check_driver(_kernel("13.5", "9.5", "a CUDA 13.5 driver or newer"), 13000)  # NVRTC newer than an R580 driver
    assert "pip install 'nvidia-cuda-nvrtc==13.0.*'" in str(e.value)
    with pytest.raises(PluginError) as e:
        check_driver(k, 11080)  # no NVRTC of ours writes PTX that old: only the driver update is offered
    assert str(e.value).endswith("(cuDriverGetVersion 11080) and would refuse it when TensorRT loads the engine. Update the NVIDIA driver")


def test_driver_version_here():
    from andrea_export.plugin.compile import cuda_driver_version

    v = cuda_driver_version()
    assert v is None or v >= 11000  # None on a machine without libcuda, as here


def _entry_body(ptx: str, name: str) -> str:
    found = re.search(r"\.entry " + re.escape(name) + r"\((.*?)\n\}", ptx, re.S)
    assert found, f"no entry {name} in the PTX"
    return found.group(1)


@pytest.mark.parametrize("bias", [False, True])
def test_each_dtypes_entry_point_computes_in_that_dtype(ptx_by_arch, bias):
    """kernel_name's entry for a dtype is the kernel that reads and writes that dtype, judged from the PTX
    itself: float32 loads .f32 and converts nothing to half; float16 converts through .f16 and never
    bf16; bfloat16 through .bf16 and never f16. (The only earlier test compared kernel_name with itself,
    so swapping the f16 and bf16 names went unseen.)"""
    from andrea_export.plugin.compile import kernel_name

    half = {"float16": re.compile(r"\bcvt\.[a-z.]*(?<!b)f16"), "bfloat16": re.compile(r"\bcvt\.[a-z.]*bf16")}
    for k in ptx_by_arch.values():
        for dtype in ("float32", "float16", "bfloat16"):
            body = _entry_body(k.ptx, kernel_name(dtype, bias))
            for other, pattern in half.items():
                assert bool(pattern.search(body)) == (other == dtype), (k.arch, dtype, other)
            assert ("ld.global.f32" in body) == (dtype == "float32"), (k.arch, dtype)
