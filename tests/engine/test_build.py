"""Engine builds: real TensorRT-RTX ahead-of-time builds of the tiny model on this CPU; TensorRT (GPU)
tests are skipped with their reason. Profile and builder validation need neither."""

from __future__ import annotations

import json
import sys
import time

import onnx
import pytest
import torch

from andrea_export.config import ANDREA_120M, ANDREA_TINY
from andrea_export.engine.builder import build_engine, layer_report_path
from andrea_export.engine.backends import resolve_builder, trt_module
from andrea_export.engine.compat import check_engine_compat
from andrea_export.engine.profiles import Bounds, Profile, Profiles, parse_profiles
from andrea_export.engine.refit import sidecar_path
from andrea_export.errors import BuildError, ConfigError, MissingDependency, gpu_compute_capability, installed
from andrea_export.graphs.export import export_onnx
from andrea_export.model.andrea import Andrea

HAVE_RTX = installed("tensorrt_rtx")
needs_rtx = pytest.mark.skipif(not HAVE_RTX, reason="TensorRT-RTX not installed: pip install 'andrea-export[rtx]'")
GPU = gpu_compute_capability()
try:
    import tensorrt

    HAVE_TRT = hasattr(tensorrt, "Builder")  # tensorrt-stubs alone gives an empty namespace package
except ImportError:
    HAVE_TRT = False
needs_trt_gpu = pytest.mark.skipif(
    not (HAVE_TRT and GPU), reason="needs full TensorRT and an NVIDIA GPU (not installable on the CPU machines)"
)


def _files(d):
    return sorted(p.name for p in d.iterdir())


# --- profiles ---------------------------------------------------------------------------------------


def test_profile_parse():
    p = Profile.parse("batch=1:4:16,seq=1:128:1024")
    assert p == Profile(Bounds(1, 4, 16), Bounds(1, 128, 1024))
    assert p.shapes() == ((1, 1), (4, 128), (16, 1024))
    assert Profile.parse("batch=4").batch == Bounds(4, 4, 4)
    assert Profile.parse("seq=1:8:64", base=Profile.for_model(ANDREA_TINY)) == Profile(Bounds(1, 1, 8), Bounds(1, 8, 64))
    assert parse_profiles("batch=1,seq=1;batch=1:4:16,seq=1:128:1024")[0].to_dict() == {"batch": "1:1:1", "seq": "1:1:1"}
    assert Profile.for_model(ANDREA_120M).to_dict() == {"batch": "1:1:8", "seq": "1:128:1024"}
    assert Profile.for_model(ANDREA_TINY).input_shapes() == {"input_ids": {"min": [1, 1], "opt": [1, 128], "max": [8, 128]}}
    assert Profiles is Profile  # the old name of one optimization profile still imports


@pytest.mark.parametrize(
    "text, message",
    [
        ("batch=4:2:8", "profile 'batch': expected min:opt:max with 1 <= min <= opt <= max, got 4:2:8"),
        ("seq=0:1:8", "profile 'seq': expected min:opt:max with 1 <= min <= opt <= max, got 0:1:8"),
        ("batch=1:x:8", "profile 'batch': '1:x:8' is not min:opt:max (or one size) of integers"),
        ("batch=1:2", "profile 'batch': '1:2' is not min:opt:max (or one size) of integers"),
        ("beam=1:1:1", "profile: unknown dimension 'beam'; known: batch, seq"),
        ("batch 1:1:1", "profile 'batch 1:1:1': expected entries like batch=1:4:16,seq=1:128:1024"),
    ],
)
def test_profile_errors(text, message):
    with pytest.raises(ConfigError) as e:
        Profile.parse(text)
    assert str(e.value) == message


def test_profile_beyond_context():
    with pytest.raises(ConfigError) as e:
        Profile.parse("seq=1:64:256").check(ANDREA_TINY.n_positions)
    assert str(e.value) == "profile 'seq': max 256 exceeds the model's context of 128 tokens"


# --- builder resolution -----------------------------------------------------------------------------


def test_resolve_unknown_builder():
    with pytest.raises(ConfigError) as e:
        resolve_builder("onnxruntime")
    assert str(e.value) == "builder must be one of auto, tensorrt, tensorrt-rtx; got 'onnxruntime'"


@pytest.mark.skipif(HAVE_TRT, reason="full TensorRT is installed here")
def test_resolve_tensorrt_missing():
    with pytest.raises(MissingDependency) as e:
        resolve_builder("tensorrt")
    assert str(e.value).startswith("Building engines with TensorRT needs the Python module 'tensorrt', which could not be imported (")
    assert "andrea-export[tensorrt]" in str(e.value)
    assert str(e.value).endswith("Install it with: pip install 'andrea-export[tensorrt]'")


@needs_rtx
@pytest.mark.skipif(HAVE_TRT and GPU is not None, reason="TensorRT and a GPU are here: auto picks TensorRT")
def test_resolve_auto_picks_rtx_without_gpu():
    assert resolve_builder("auto") == "tensorrt-rtx"
    assert trt_module("tensorrt-rtx").__name__ == "tensorrt_rtx"


def test_resolve_auto_without_any_builder(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # None in sys.modules: `import` raises ImportError
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)
    with pytest.raises(MissingDependency) as e:
        resolve_builder("auto")
    assert str(e.value) == (
        "no engine builder available: install TensorRT-RTX, which builds engines on any machine "
        "(pip install 'andrea-export[rtx]'), or, on a host with an NVIDIA GPU, TensorRT "
        "(pip install 'andrea-export[tensorrt]')"
    )


# --- TensorRT-RTX builds ----------------------------------------------------------------------------


@needs_rtx
def test_rtx_build(tiny_onnx, tmp_path):
    plan = tmp_path / "tiny.plan"
    r = build_engine(tiny_onnx, plan, builder="tensorrt-rtx", profiles=Profile.parse("batch=1:2:4,seq=1:16:128"), progress=False)
    assert plan.is_file() and plan.stat().st_size == r.plan_bytes > 1_000_000  # the weights alone are ~2.2 MB
    assert _files(tmp_path) == ["tiny.layers.json", "tiny.plan", "tiny.plan.json"]  # no temporary files left
    assert (r.builder, r.builder_version) == ("tensorrt-rtx", trt_module("tensorrt-rtx").__version__)
    assert r.profiles == [{"batch": "1:2:4", "seq": "1:16:128"}]
    assert (r.compute_capabilities, r.compute_capabilities_default) == (["8.0", "8.6", "8.9", "12.0"], True)
    assert r.precision == "fp32" and r.tf32 is False and r.plugin_layers == 0 and r.timing_cache is None
    assert r.warnings == []
    side = json.loads(sidecar_path(plan).read_text())
    assert side["plan_sha256"] == r.plan_sha256 and side["builder"] == "tensorrt-rtx"
    report = json.loads(layer_report_path(plan).read_text())
    if GPU is None:
        assert report["source"] == (
            "builder log (engine inspector not available: no GPU here (an engine deserializes only on a GPU it targets))"
        )
    assert report["layers"] and all({"name", "type"} <= set(layer) for layer in report["layers"])
    onnx_nodes = {n for layer in report["layers"] for n in layer.get("onnx_nodes", [])}
    ln = {n.name for n in onnx.load(str(tiny_onnx), load_external_data=False).graph.node if n.op_type == "LayerNormalization"}
    assert ln <= onnx_nodes  # every LayerNorm of the graph is accounted for in some engine layer

    assert check_engine_compat(plan, side)["checked"][:2] == ["sha256", "builder version"]
    with pytest.raises(BuildError) as e:
        check_engine_compat(plan, {**side, "builder_version": "0.9.0"})
    assert str(e.value) == (
        f"{plan}: built with TensorRT-RTX 0.9.0, but this environment has {r.builder_version}; engines do not load "
        f"across versions: rebuild it, or install tensorrt_rtx==0.9.0"
    )
    with pytest.raises(BuildError) as e:
        check_engine_compat(plan, {**side, "plan_sha256": "0" * 64})
    assert str(e.value) == f"{plan}: sha256 differs from its manifest: not the engine it describes"
    with pytest.raises(BuildError) as e:
        check_engine_compat(plan, {"builder": "tensorrt-rtx"})
    assert str(e.value) == f"{plan}: its manifest has no 'builder_version'; cannot tell what built it: rebuild it"

    # Rebuilding over an engine from "another version" says so, and replaces it.
    sidecar_path(plan).write_text(json.dumps({**side, "builder_version": "0.9.0"}))
    r2 = build_engine(tiny_onnx, plan, builder="tensorrt-rtx", profiles=Profile.parse("batch=1:2:4,seq=1:16:128"), progress=False)
    assert r2.warnings == [
        f"replacing tiny.plan: {plan}: built with TensorRT-RTX 0.9.0, but this environment has {r.builder_version}; "
        "engines do not load across versions: rebuild it, or install tensorrt_rtx==0.9.0"
    ]
    assert json.loads(sidecar_path(plan).read_text())["builder_version"] == r.builder_version


@needs_rtx
def test_rtx_builds_plugin_graph_natively(tiny_onnx, tmp_path):
    from andrea_export.graphs.gelu_plugin import apply_gelu_plugin

    apply_gelu_plugin(tiny_onnx, tmp_path / "plugin.onnx")
    r = build_engine(tmp_path / "plugin.onnx", tmp_path / "p.plan", builder="tensorrt-rtx",
                     profiles=Profile.parse("batch=1,seq=1:8:32"), progress=False)
    assert r.plugin_layers == 0 and r.plan_bytes > 0
    assert r.warnings == [
        f"{ANDREA_TINY.n_layer} plugin call(s) built as their ONNX function bodies: TensorRT-RTX has no plugin layers"
    ]


@needs_rtx
def test_rtx_compute_capabilities(tiny_onnx, tmp_path):
    r = build_engine(tiny_onnx, tmp_path / "a.plan", builder="tensorrt-rtx", compute_capabilities=["8.6", "sm_89", "SM120"],
                     profiles=Profile.parse("batch=1,seq=1:8:32"), opt_level=0, progress=False)
    assert (r.compute_capabilities, r.compute_capabilities_default, r.opt_level) == (["8.6", "8.9", "12.0"], False, 0)
    with pytest.raises(ConfigError) as e:
        build_engine(tiny_onnx, tmp_path / "b.plan", builder="tensorrt-rtx", compute_capabilities=["9.0"])
    assert str(e.value) == "compute capability '9.0' is not a TensorRT-RTX target; choose from 7.5, 8.0, 8.6, 8.9, 12.0, 12.1"
    with pytest.raises(ConfigError) as e:
        build_engine(tiny_onnx, tmp_path / "b.plan", builder="tensorrt-rtx", compute_capabilities=["7.5", "8.6"])
    assert str(e.value) == (
        "compute capability 7.5 (Turing) must be built alone: TensorRT-RTX makes no portable engines with Turing"
    )
    assert _files(tmp_path) == ["a.layers.json", "a.plan", "a.plan.json"]


@needs_rtx
def test_precision_the_target_cannot_run_is_refused_before_the_build(tiny_onnx, tmp_path):
    from andrea_export.graphs.precision import convert_precision

    with pytest.raises(ConfigError) as e:
        build_engine(tiny_onnx, tmp_path / "t.plan", builder="tensorrt-rtx", compute_capabilities=["7.5"])
    assert str(e.value) == ("TensorRT-RTX builds no fp32 matrix multiplies for compute capability 7.5 (Turing): "
                            "build an fp16 graph (--precision fp16) for it")
    bf16 = convert_precision(tiny_onnx, tmp_path / "bf16.onnx", "bf16")
    with pytest.raises(ConfigError) as e:
        build_engine(bf16, tmp_path / "t.plan", builder="tensorrt-rtx", compute_capabilities=["7.5"])
    assert str(e.value) == ("precision bf16 needs compute capability 8.0 or newer; the target 7.5 has no bf16: "
                            "build fp16 (--precision fp16)")
    assert _files(tmp_path) == ["bf16.onnx"]


@needs_rtx
def test_rtx_timing_cache_is_not_used(tiny_onnx, tmp_path):
    cache = tmp_path / "timing.cache"
    r = build_engine(tiny_onnx, tmp_path / "t.plan", builder="tensorrt-rtx", timing_cache=cache,
                     profiles=Profile.parse("batch=1,seq=1:8:32"), progress=False)
    assert r.timing_cache is None and not cache.exists()
    assert r.warnings == [
        f"timing cache {cache} not used: TensorRT-RTX has no autotuning and its timing-cache operations are no-ops "
        "(deprecated in TensorRT-RTX 1.2)"
    ]


@needs_rtx
def test_failed_build_leaves_nothing(tiny_onnx, tmp_path):
    # A real builder failure: no kernel fits a 1 MiB workspace.
    with pytest.raises(BuildError) as e:
        build_engine(tiny_onnx, tmp_path / "w.plan", builder="tensorrt-rtx", workspace_mb=1, progress=False)
    assert str(e.value).startswith("TensorRT-RTX failed to build model.onnx: IBuilder::buildSerializedNetwork: Error Code")
    assert "workspace" in str(e.value)
    assert _files(tmp_path) == []


@needs_rtx
def test_profile_beyond_context_refused_before_build(tiny_onnx, tmp_path):
    with pytest.raises(ConfigError) as e:
        build_engine(tiny_onnx, tmp_path / "p.plan", builder="tensorrt-rtx", profiles=Profile.parse("seq=1:64:256"))
    assert str(e.value) == "profile 'seq': max 256 exceeds the model's context of 128 tokens"
    with pytest.raises(ConfigError) as e:
        build_engine(tiny_onnx, tmp_path / "p.plan", builder="tensorrt-rtx", opt_level=6)
    assert str(e.value) == "opt_level must be an integer from 0 to 5, got 6"
    with pytest.raises(ConfigError, match=r"profile 'batch': max 2000 .*fewer than 2\^31 per tensor: use a batch max of at most 1985"):
        build_engine(tiny_onnx, tmp_path / "p.plan", builder="tensorrt-rtx", profiles=Profile.parse("batch=1:1:2000,seq=1:64:128"))
    assert _files(tmp_path) == []


@needs_rtx
def test_wrong_input_name_refused(tiny_onnx, tmp_path):
    m = onnx.load(str(tiny_onnx))
    m.graph.input[0].name = "tokens"
    for n in m.graph.node:
        n.input[:] = ["tokens" if i == "input_ids" else i for i in n.input]
    bad = tmp_path / "tokens.onnx"
    onnx.save(m, str(bad))
    with pytest.raises(BuildError) as e:
        build_engine(bad, tmp_path / "x.plan", builder="tensorrt-rtx")
    assert str(e.value) == f"{bad}: the graph's input(s) are 'tokens'; expected one input 'input_ids' (an andrea-export ONNX)"
    assert _files(tmp_path) == ["tokens.onnx"]


@needs_rtx
def test_parse_error_names_the_node(tmp_path):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, None)
    g = helper.make_graph([helper.make_node("Unique", ["input_ids"], ["y"], name="my_unique")], "g", [x], [y])
    bad = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]), str(bad))
    with pytest.raises(BuildError) as e:
        build_engine(bad, tmp_path / "bad.plan", builder="tensorrt-rtx", progress=False)
    assert str(e.value) == "TensorRT-RTX could not parse bad.onnx: node 'my_unique' (Unique): unsupported node"
    assert _files(tmp_path) == ["bad.onnx"]


def test_missing_onnx(tmp_path):
    if not HAVE_RTX:
        pytest.skip("TensorRT-RTX not installed: pip install 'andrea-export[rtx]'")
    with pytest.raises(BuildError) as e:
        build_engine(tmp_path / "none.onnx", tmp_path / "x.plan", builder="tensorrt-rtx")
    assert str(e.value) == f"{tmp_path / 'none.onnx'}: no such ONNX file"


# --- TensorRT (GPU hosts) ---------------------------------------------------------------------------


@needs_trt_gpu
def test_tensorrt_timing_cache_written_and_reused(tiny_onnx, tmp_path):
    cache = tmp_path / "timing.cache"
    r1 = build_engine(tiny_onnx, tmp_path / "a.plan", builder="tensorrt", timing_cache=cache, progress=False)
    assert r1.timing_cache == cache and cache.stat().st_size > 0 and sidecar_path(cache).is_file()
    r2 = build_engine(tiny_onnx, tmp_path / "b.plan", builder="tensorrt", timing_cache=cache, progress=False)
    assert not any("timing cache" in w for w in r2.warnings)
    assert r2.build_seconds <= r1.build_seconds * 1.5
    assert json.loads(layer_report_path(tmp_path / "a.plan").read_text())["source"] == "engine inspector"


@needs_trt_gpu
def test_tensorrt_plugin_graph_has_plugin_layers(tiny_onnx, tmp_path):
    from andrea_export.graphs.gelu_plugin import apply_gelu_plugin

    plugin_onnx = tmp_path / "plugin.onnx"
    apply_gelu_plugin(tiny_onnx, plugin_onnx)
    r = build_engine(plugin_onnx, tmp_path / "p.plan", builder="tensorrt", progress=False)
    assert r.plugin_layers == ANDREA_TINY.n_layer


# --- full size, by hand -----------------------------------------------------------------------------


@pytest.mark.slow
@needs_rtx
def test_rtx_build_full_size(tmp_path):
    from andrea_export.graphs.precision import convert_precision

    torch.manual_seed(0)
    fp32 = export_onnx(Andrea(ANDREA_120M), tmp_path / "andrea.onnx", quiet=True)
    for precision in ("fp32", "fp16"):
        src = fp32 if precision == "fp32" else convert_precision(fp32, tmp_path / f"andrea_{precision}.onnx", precision)
        t0 = time.perf_counter()
        r = build_engine(src, tmp_path / f"{precision}.plan", builder="tensorrt-rtx", progress=False)
        print(f"ANDREA-120M {precision}: RTX AOT build {time.perf_counter() - t0:.1f} s, plan {r.plan_bytes / 1e6:.0f} MB")
        assert r.precision == precision and r.plan_bytes > 92_331_264 * (4 if precision == "fp32" else 2) * 0.9


# --- strongly typed networks ------------------------------------------------------------------------
# STRONGLY_TYPED is opt-in on TensorRT 10.x (enum value 1) and always on in 11 and RTX (value 0), so the
# flag must be set through the enum: the number that works on one version is another flag on the other.

_ENUMS = {"10.16": {"EXPLICIT_BATCH": 0, "STRONGLY_TYPED": 1, "PREFER_JIT_PYTHON_PLUGINS": 2,
                    "PREFER_AOT_PYTHON_PLUGINS": 3},
          "11.4": {"STRONGLY_TYPED": 0, "PREFER_JIT_PYTHON_PLUGINS": 1, "PREFER_AOT_PYTHON_PLUGINS": 2}}  # fmt: skip


class _NetworkCreated(Exception):
    """Stops the stand-in build once the network exists: the flags are what this test is about."""


def _trt_standin(version: str, calls: list[int]):
    """The part of the `tensorrt` module build_engine touches before it parses, with `version`'s enum."""
    import enum
    import types

    flag = enum.IntEnum("NetworkDefinitionCreationFlag", _ENUMS[version])

    class ILogger:
        Severity = enum.IntEnum("Severity", "INTERNAL_ERROR ERROR WARNING INFO VERBOSE")

        def __init__(self):
            pass

    class Builder:
        def __init__(self, logger):
            assert isinstance(logger, ILogger)

        def create_network(self, flags: int = 0):
            assert isinstance(flags, int) and flags >= 0 and flags >> len(flag) == 0, f"unknown flag bits {flags:#x}"
            calls.append(flags)
            raise _NetworkCreated

    return types.SimpleNamespace(__version__=version, NetworkDefinitionCreationFlag=flag, ILogger=ILogger, Builder=Builder)


@pytest.mark.parametrize("version", sorted(_ENUMS))
def test_network_is_strongly_typed_on_every_tensorrt(monkeypatch, tiny_onnx, tmp_path, version):
    import andrea_export.engine.builder as build

    calls: list[int] = []
    trt = _trt_standin(version, calls)
    monkeypatch.setattr(build, "resolve_builder", lambda choice: "tensorrt")
    monkeypatch.setattr(build, "trt_module", lambda builder: trt)
    with pytest.raises(_NetworkCreated):
        build_engine(tiny_onnx, tmp_path / "t.plan", builder="tensorrt", progress=False)
    strongly_typed = 1 << _ENUMS[version]["STRONGLY_TYPED"]
    assert calls == [strongly_typed]  # that flag alone: on 10.x bit 1, on 11 bit 0
    assert _files(tmp_path) == []


@needs_rtx
def test_rtx_network_is_created_strongly_typed(monkeypatch, tiny_onnx, tmp_path):
    import tensorrt_rtx as trt

    flags: list[int] = []
    create_network = trt.Builder.create_network

    def watched(self, f=0):  # the real builder's method, watched
        flags.append(f)
        network = create_network(self, f)
        assert network.get_flag(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        return network

    monkeypatch.setattr(trt.Builder, "create_network", watched)
    build_engine(tiny_onnx, tmp_path / "t.plan", builder="tensorrt-rtx", profiles=Profile.parse("batch=1,seq=1:8:32"),
                 opt_level=0, progress=False)
    assert flags == [1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)]
