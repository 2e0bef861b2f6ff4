"""register_plugins() against the REAL tensorrt.plugin of TensorRT 10.9 (the oldest with aot_impl) and 11.4
(the newest), over a stand-in of the native core (trt_standin.py), driven the way TensorRT's builder drives
a quickly deployable AOT plugin: create it from the registry as the ONNX parser does, ask for the output
types and shapes, the supported type/format combinations, then, per combination, the launch parameters,
the extra arguments and the kernel, which are checked against compile.grid_size, the kernel's own
signature in the PTX, and what the manifest records."""

from __future__ import annotations

import hashlib
import re
import types

import pytest
import trt_standin as S

from andrea_export.errors import PluginError
from andrea_export.plugin import GELU_BIAS_OP, GELU_OP, PLUGIN_NAMESPACE, PLUGIN_VERSION, register
from andrea_export.plugin.compile import BLOCK_SIZE, grid_size, kernel_name

# NVIDIA's 10.9 sources have docstrings with "\s" in them, which Python 3.12 warns about on import
pytestmark = pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning")

DTYPES = {S.DataType.FLOAT: "float32", S.DataType.HALF: "float16", S.DataType.BF16: "bfloat16"}
INNER = 3072  # 4 * n_embd of ANDREA-120M; the runs below also use a width that is no multiple of anything
SHAPES = [(1, 1), (1, 7), (3, 129), (8, 1024)]  # (batch, seq) at run time


def _entry_params(ptx: str, name: str) -> list[str]:
    m = re.search(rf"\.visible\s+\.entry\s+{name}\s*\(([^)]*)\)", ptx)
    assert m, f"entry {name} is not in the PTX"
    return re.findall(r"\.param\s+\.(\w+)", m.group(1))


def _create(core, op: str):
    """What the ONNX parser does for an `andrea.<op>` node with plugin_namespace="andrea" and no `aot` attribute:
    for a quick plugin it passes the op type (not the node name) as the plugin name (importerUtils.cpp)."""
    creator = core.get_plugin_registry().get_creator(op, PLUGIN_VERSION, PLUGIN_NAMESPACE)
    assert creator is not None, f"{PLUGIN_NAMESPACE}::{op} v{PLUGIN_VERSION} is not registered"
    assert isinstance(creator, core.IPluginCreatorV3Quick) and list(creator.field_names) == []  # no attributes
    plugin = creator.create_plugin(op, PLUGIN_NAMESPACE, core.PluginFieldCollection([]), core.TensorRTPhase.BUILD,
                                   core.QuickPluginCreationRequest.UNKNOWN)  # fmt: skip
    assert isinstance(plugin, core.IPluginV3QuickAOTBuild)  # only aot_impl is defined: AOT, the kernel in the engine
    return plugin


def _build(core, op: str, inner: int = INNER) -> dict:
    """One plugin layer through a build: returns, per type combination, the kernel, launch and extra args."""
    plugin = _create(core, op)
    bias = op == GELU_BIAS_OP
    n_in = 2 if bias else 1
    eb = core.IExprBuilder()
    x_dims = [eb.dimension("batch"), eb.dimension("seq"), eb.constant(inner)]
    in_dims = [x_dims] + ([[eb.constant(inner)]] if bias else [])
    ranks = [len(d) for d in in_dims]

    assert plugin.get_num_outputs() == 1
    for t in DTYPES:  # network construction: the output type follows x
        assert list(plugin.get_output_data_types([t] * n_in, ranks)) == [t]
    inputs = []
    for dims in in_dims:
        e = core.DimsExprs(len(dims))
        for i, d in enumerate(dims):
            e[i] = d
        inputs.append(e)
    (out,) = plugin.get_output_shapes(inputs, [], eb)
    for b, s in SHAPES:  # y is shaped like x
        env = {"batch": b, "seq": s}
        assert [out[i].evaluate(env) for i in range(len(out))] == [d.evaluate(env) for d in x_dims] == [b, s, inner]

    run_dims = (-1, -1, inner)
    in_out = [S.dynamic_desc(S.DataType.FLOAT, run_dims)] + ([S.dynamic_desc(S.DataType.FLOAT, (inner,))] if bias else [])
    in_out.append(S.dynamic_desc(S.DataType.FLOAT, run_dims))
    flat = plugin.get_supported_format_combinations(in_out, n_in)
    combos = [flat[i : i + n_in + 1] for i in range(0, len(flat), n_in + 1)]
    assert [[d.type for d in c] for c in combos] == [[t] * (n_in + 1) for t in DTYPES]  # all tensors one type
    assert all(d.format == core.TensorFormat.LINEAR for d in flat)

    result = {}
    for combo in combos:
        dtype = combo[0].type
        io = [S.dynamic_desc(dtype, d.desc.dims) for d in in_out]
        plugin.configure_plugin(io[:n_in], io[n_in:])
        tactics = plugin.get_valid_tactics()
        assert tactics == []  # no tactics declared: TensorRT runs the default one, 0
        plugin.set_tactic(0)
        launch, extra = S.LaunchParams(), S.SymExprSetter()
        plugin.get_launch_params(inputs, io, n_in, launch, extra, eb)
        descs = [d.desc for d in io]
        name, ptx = plugin.get_kernel(descs[:n_in], descs[n_in:])
        result[DTYPES[dtype]] = types.SimpleNamespace(name=name, ptx=ptx, launch=launch, extra=extra.args)
    return result


@pytest.mark.parametrize("op", [GELU_OP, GELU_BIAS_OP])
def test_builder_gets_our_kernel_launch_and_arguments(trt_plugin, op):
    core, trtp = trt_plugin
    assert register.register_plugins() == (f"andrea::{GELU_OP}", f"andrea::{GELU_BIAS_OP}")
    kernel = register.plugin_kernel()
    bias = op == GELU_BIAS_OP
    for inner in (INNER, 1001):
        for dtype, r in _build(core, op, inner).items():
            name = r.name if isinstance(r.name, str) else r.name.decode()
            assert name == kernel_name(dtype, bias)
            assert r.ptx == kernel.ptx.encode()  # the PTX register_plugins compiled is what the engine embeds
            # The calling convention of tensorrt.plugin: input pointers, the int32 extra args, output pointers.
            assert _entry_params(kernel.ptx, name) == (["u64", "u64", "u32", "u32", "u64"] if bias else ["u64", "u32", "u64"])
            assert len(r.extra) == (2 if bias else 1)
            for b, s in SHAPES:
                env = {"batch": b, "seq": s}
                n = b * s * inner
                assert r.launch.grid_x.expr.evaluate(env) == grid_size(n, dtype), (dtype, b, s, inner)
                assert [getattr(r.launch, f).expr.evaluate(env) for f in ("grid_y", "grid_z", "block_x", "block_y",
                        "block_z", "shared_mem")] == [1, 1, BLOCK_SIZE, 1, 1, 0]  # fmt: skip
                assert [a.expr.evaluate(env) for a in r.extra] == ([n, inner] if bias else [n])


def test_registering_twice_is_a_no_op(trt_plugin):
    core, _ = trt_plugin
    first = register.register_plugins()
    assert register.register_plugins() == first
    assert sorted(k for k in core.get_plugin_registry().creators) == [
        (GELU_OP, "1", "andrea"), (GELU_BIAS_OP, "1", "andrea")]  # fmt: skip


def test_manifest_records_the_kernel_the_engine_embeds(trt_plugin, monkeypatch):
    """On a Hopper host register_plugins embeds sm_90 PTX; the manifest must describe that kernel."""
    from andrea_export import pipeline

    core, _ = trt_plugin
    monkeypatch.setattr(register, "detect_compute_capability", lambda device=0: (9, 0))
    register.register_plugins()
    embedded = _build(core, GELU_OP)["float16"].ptx
    info = pipeline._plugin_info(types.SimpleNamespace(fuse_bias=False, replaced=2), "tensorrt")
    assert info["embedded"] is True
    assert info["kernel"]["ptx_sha256"] == hashlib.sha256(embedded).hexdigest()
    assert info["kernel"]["arch"] == "sm_90"


def test_old_driver_is_refused_before_the_build(trt_plugin, monkeypatch):
    """PTX ISA 9.0 (NVRTC 13.0) on an R570 host (CUDA 12.8): refused in register_plugins, nothing registered."""
    core, _ = trt_plugin
    monkeypatch.setattr(register, "cuda_driver_version", lambda: 12080)
    with pytest.raises(PluginError) as e:
        register.register_plugins()
    assert "needs an R580 (CUDA 13.0) or newer driver" in str(e.value) and "CUDA 12.8" in str(e.value)
    assert core.get_plugin_registry().creators == {}
