"""TrtSession on the CPU, over the strict CUDA / TensorRT stand-ins of fake_cuda.py: everything a GPU cannot
be asked here (buffer sizes and element sizes from the engine's dtypes, addresses, pitches, the alternating
cache sets, the fixed-length past with its mask and slot copies, graph capture and replay, nothing leaked),
for every precision, both decode modes, and prompts up to the full context, token for token against ONNX
Runtime on the same graph."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import shutil

import numpy as np
import onnx
import pytest
from fake_cuda import DataType, FakeCudart, _Fault, cudaError_t, fake_tensorrt, write_plan

from andrea_export import runtime
from andrea_export.config import ANDREA_TINY
from andrea_export.errors import CudaError, MissingDependency
from andrea_export.folder.atomic import sha256_file
from andrea_export.graphs.kvcache import optimization_profiles
from andrea_export.graphs.layout import read_config, read_kv_layout
from andrea_export.graphs.precision import convert_precision, emulate_in_fp32
from andrea_export.names import FLOAT_PRECISIONS
from andrea_export.runtime.ort import OrtSession

N = ANDREA_TINY.n_positions
LENGTHS = [1, 64, N - 1, N]  # one token, a middle prompt, the longest that still decodes, the full context
NOTHING_LIVE = {"allocations": 0, "pinned": 0, "streams": 0, "graphs": 0, "graph_execs": 0}


def _prompt(length: int) -> list[int]:
    return np.random.default_rng(length).integers(0, ANDREA_TINY.vocab_size, length).tolist()


@pytest.fixture(scope="module")
def graphs(build_dir, tmp_path_factory):
    """The lively decoder in each precision (what a build's `decoder_onnx` is)."""
    d = tmp_path_factory.mktemp("precisions")
    out = {"fp32": build_dir / "decoder.onnx"}
    for p in ("fp16", "bf16"):
        out[p] = convert_precision(out["fp32"], d / f"decoder.{p}.onnx", p)
    return out


@pytest.fixture(scope="module")
def references(graphs, tmp_path_factory):
    """ONNX Runtime on the same graphs. bf16: ONNX Runtime's CPU provider has no bf16 kernels, so the reference
    is the graph's emulate_in_fp32 twin (every op rounded to bf16; its float32 cache holds bf16 values), which
    is also what the fake engine computes with; the engine keeps its cache in 2-byte bf16 buffers."""
    out = {}
    for p, g in graphs.items():
        layout, cfg = read_kv_layout(g), read_config(g)
        if p == "bf16":
            path = tmp_path_factory.mktemp("emulated") / "decoder.bf16-emulated.onnx"
            onnx.save(emulate_in_fp32(onnx.load(str(g))), str(path))
            g, layout = path, dataclasses.replace(layout, cache_dtype="float32")
        out[p] = OrtSession(g, cfg, layout, providers=["CPUExecutionProvider"])
    return out


@pytest.fixture(scope="module")
def expected(references):
    """(precision, prompt length) -> (prefill logits, greedy tokens to the end of the context), computed once."""
    memo = {}

    def get(precision: str, length: int):
        if (precision, length) not in memo:
            ref, prompt = references[precision], _prompt(length)
            memo[precision, length] = ref.forward(prompt), ref.generate(prompt, N - length) if length < N else []
        return memo[precision, length]

    return get


@pytest.fixture
def device(monkeypatch):
    """The fake CUDA runtime and TensorRT, in place of the real ones inside runtime/trt.py."""
    from andrea_export.runtime import trt as trt_backend

    cudart = FakeCudart()
    monkeypatch.setattr(trt_backend, "_cudart", lambda: cudart)
    monkeypatch.setattr(trt_backend, "_tensorrt", lambda: fake_tensorrt(cudart))
    return cudart


def _build_folder(folder, graph, **plan):
    """A build folder as the pipeline writes it: the decoder graph, an engine built from it, a manifest naming both."""
    folder.mkdir()
    shutil.copy(graph, folder / graph.name)
    write_plan(folder / "decoder.plan", folder / graph.name, optimization_profiles(read_kv_layout(graph)), **plan)
    artifacts = {role: {"path": name, "sha256": sha256_file(folder / name), "bytes": (folder / name).stat().st_size}
                 for role, name in (("decoder_onnx", graph.name), ("decoder_engine", "decoder.plan"))}
    manifest = {"schema_version": 1, "model": read_config(graph).to_dict(), "artifacts": artifacts}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _closed_clean(device: FakeCudart):
    assert device.sticky is None, device.fault
    assert device.live() == NOTHING_LIVE


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["growing-cache", "cuda-graph"])
@pytest.mark.parametrize("precision", FLOAT_PRECISIONS)  # int8/int4 engines: Q/DQ graphs, not run by the fake
def test_trt_session_matrix(device, graphs, expected, tmp_path, precision, cuda_graph, length):
    """forward(prompt) and greedy generation to the end of the context equal ONNX Runtime's on the same graph."""
    logits, tokens = expected(precision, length)
    prompt = _prompt(length)
    sess = runtime.load(_build_folder(tmp_path / "build", graphs[precision]), backend="tensorrt", cuda_graph=cuda_graph)
    assert sess.cuda_graph_active is cuda_graph, sess.cuda_graph_error
    got = sess.forward(prompt)
    assert got.dtype == np.float32 and got.shape == logits.shape
    np.testing.assert_allclose(got, logits, rtol=1e-5, atol=1e-5)  # the same prefill, through the same graph
    if length < N:
        assert sess.generate(prompt, N - length) == tokens
    sess.close()
    _closed_clean(device)


def test_no_allocation_per_step_and_the_graph_replays_one_enqueue(device, graphs, expected, tmp_path):
    sess = runtime.load(_build_folder(tmp_path / "build", graphs["fp16"]), backend="tensorrt")
    assert sess.cuda_graph_active
    assert device.graph_ops(sess._graph_exec) == ["enqueue profile 1"]  # exactly the decode step, nothing else
    allocated = device.mallocs
    for length in (5, 4):  # odd and even prompts, the second reusing every buffer and the graph
        assert sess.generate(_prompt(length), 30) == expected("fp16", length)[1][:30]
    assert device.mallocs == allocated
    assert device.launches == 29 + 29
    sess.close()
    _closed_clean(device)


def test_an_engine_plan_beside_the_fp32_graph_takes_its_dtypes_from_the_engine(device, graphs, expected, tmp_path):
    """bench.py loads `decoder.plan` directly; beside it lies decoder.onnx, the fp32 graph, even in an fp16 build."""
    folder = tmp_path / "build"
    folder.mkdir()
    shutil.copy(graphs["fp32"], folder / "decoder.onnx")
    shutil.copy(graphs["fp16"], folder / "decoder.fp16.onnx")
    write_plan(folder / "decoder.plan", folder / "decoder.fp16.onnx", optimization_profiles(read_kv_layout(graphs["fp16"])))
    for cuda_graph in (False, True):
        with runtime.load(folder / "decoder.plan", backend="tensorrt", cuda_graph=cuda_graph) as sess:
            assert sess.layout.cache_dtype == "float16"
            assert sess.generate(_prompt(64), 20) == expected("fp16", 64)[1][:20]
    _closed_clean(device)


def test_a_failed_capture_falls_back_and_frees_the_graph(device, graphs, expected, tmp_path):
    """An enqueue that fails during capture: the session decodes uncaptured, and the graph that
    cudaStreamEndCapture returned is destroyed at once (not only at close)."""
    sess = runtime.load(_build_folder(tmp_path / "build", graphs["fp32"], fail_capture=True), backend="tensorrt")
    assert not sess.cuda_graph_active and "execute_async_v3" in sess.cuda_graph_error
    assert device.live()["graphs"] == 0 and device.live()["graph_execs"] == 0
    assert sess.generate(_prompt(64), N - 64) == expected("fp32", 64)[1]
    assert device.launches == 0
    sess.close()
    _closed_clean(device)


def test_a_decode_into_the_last_position_then_no_further(device, graphs, references, tmp_path):
    """Generation never feeds its last token back, so only a direct decode reaches position n_positions - 1:
    it must compute right (the CUDA-graph past has no slot to keep it in, and needs none), then refuse more."""
    prompt = _prompt(N - 1)
    want = references["fp32"].forward(prompt + [5])[-1]
    for cuda_graph in (False, True):
        with runtime.load(_build_folder(tmp_path / f"b{cuda_graph}", graphs["fp32"]), backend="tensorrt",
                          cuda_graph=cuda_graph) as sess:
            sess.forward(prompt)
            np.testing.assert_allclose(sess._decode(5), want, rtol=1e-4, atol=1e-4)
            with pytest.raises(runtime.InputError, match=f"the context of {N} tokens is full"):
                sess._decode(1)
            sess.forward(_prompt(N))
            with pytest.raises(runtime.InputError, match=f"the context of {N} tokens is full"):
                sess._decode(1)
    _closed_clean(device)


# --- the stand-ins themselves: each contract can fail ------------------------------------------------

def test_fake_cuda_checks_sizes_pitches_and_directions():
    rt = FakeCudart()
    _, stream = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    _, a = rt.cudaMalloc(64)
    _, b = rt.cudaMalloc(64)
    assert a % 256 == 0 and b % 256 == 0
    host = np.arange(16, dtype=np.float32)
    K = rt.cudaMemcpyKind
    ok, bad_value = (cudaError_t.cudaSuccess,), (cudaError_t.cudaErrorInvalidValue,)
    assert rt.cudaMemcpyAsync(a, host.ctypes.data, 64, K.cudaMemcpyHostToDevice, stream) == ok
    assert rt.cudaMemcpyAsync(a + 4, host.ctypes.data, 64, K.cudaMemcpyHostToDevice, stream) == bad_value  # 4 B over
    assert rt.cudaMemcpyAsync(host.ctypes.data, a, 64, K.cudaMemcpyHostToDevice, stream) == (
        cudaError_t.cudaErrorInvalidMemcpyDirection,)
    assert rt.cudaMemsetAsync(b, 0, 65, stream) == bad_value
    # 2-D: 4 rows of 16 B, pitches 16 and 8 bytes
    d2d = K.cudaMemcpyDeviceToDevice
    assert rt.cudaMemcpy2DAsync(b, 16, a, 16, 16, 4, d2d, stream) == ok
    assert rt.cudaMemcpy2DAsync(b, 8, a, 16, 16, 4, d2d, stream) == (cudaError_t.cudaErrorInvalidPitchValue,)
    assert rt.cudaMemcpy2DAsync(b, 16, a, 8, 16, 4, d2d, stream) == (cudaError_t.cudaErrorInvalidPitchValue,)
    assert rt.cudaMemcpy2DAsync(b + 8, 16, a, 16, 16, 4, d2d, stream) == bad_value  # last row ends 8 B past b
    out = np.zeros(16, dtype=np.float32)
    assert rt.cudaMemcpyAsync(out.ctypes.data, b, 64, K.cudaMemcpyDeviceToHost, stream) == ok
    np.testing.assert_array_equal(out, host)
    with pytest.raises(_Fault, match="past the end"):
        rt.device_bytes(a + 60, 8)
    assert rt.cudaFree(a) == ok and rt.cudaFree(a) == bad_value
    assert rt.cudaFree(b) == ok and rt.cudaStreamDestroy(stream) == ok
    assert rt.live() == NOTHING_LIVE


def test_fake_cuda_graph_replays_exactly_what_was_recorded():
    rt = FakeCudart()
    _, stream = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    _, dev = rt.cudaMalloc(8)

    def pinned(value: int) -> np.ndarray:  # a captured copy's host side must be page-locked
        a = rt.device_bytes(rt.cudaMallocHost(8)[1], 8, pinned=True).view(np.int64)
        a[0] = value
        return a

    one, two, out = pinned(1), pinned(2), pinned(0)
    H2D, D2H = rt.cudaMemcpyKind.cudaMemcpyHostToDevice, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
    assert rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)[0] == 0
    rt.cudaMemcpyAsync(dev, one.ctypes.data, 8, H2D, stream)
    assert rt.cudaMalloc(8)[0] == cudaError_t.cudaErrorStreamCaptureUnsupported  # not while capturing
    err, graph = rt.cudaStreamEndCapture(stream)
    assert err == cudaError_t.cudaErrorStreamCaptureInvalidated and graph is None  # the malloc broke the capture
    rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)
    rt.cudaMemcpyAsync(dev, one.ctypes.data, 8, H2D, stream)  # recorded, not run
    rt.cudaMemcpyAsync(dev, two.ctypes.data, 8, H2D, stream)
    assert rt.cudaStreamSynchronize(stream)[0] == cudaError_t.cudaErrorStreamCaptureUnsupported
    assert rt.cudaStreamEndCapture(stream) == (cudaError_t.cudaErrorStreamCaptureInvalidated, None)
    rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)
    rt.cudaMemcpyAsync(dev, two.ctypes.data, 8, H2D, stream)
    rt.cudaMemcpyAsync(out.ctypes.data, dev, 8, D2H, stream)
    err, graph = rt.cudaStreamEndCapture(stream)
    assert err == 0 and out[0] == 0  # nothing ran yet
    _, exe = rt.cudaGraphInstantiate(graph, 0)
    assert rt.graph_ops(exe) == ["memcpy 8B", "memcpy 8B"]
    two[0] = 7  # the graph copies from the recorded address: it sees the host value at launch time
    rt.cudaGraphLaunch(exe, stream)
    assert out[0] == 7 and rt.launches == 1
    for r in (rt.cudaGraphDestroy(graph), rt.cudaGraphExecDestroy(exe), rt.cudaFree(dev), rt.cudaStreamDestroy(stream),
              *(rt.cudaFreeHost(a.ctypes.data) for a in (one, two, out))):
        assert r == (cudaError_t.cudaSuccess,)
    assert rt.live() == NOTHING_LIVE


def test_fake_cuda_refuses_pageable_host_memory_in_a_capture():
    """A copy between a device and pageable host memory cannot be captured: the call fails with
    cudaErrorStreamCaptureUnsupported and the capture is invalidated (a graph node would read or write that host
    address at every replay, with nothing keeping it alive). Page-locked memory (cudaMallocHost) is captured."""
    rt = FakeCudart()
    _, stream = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    _, dev = rt.cudaMalloc(64)
    K, mode = rt.cudaMemcpyKind, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
    pageable = np.arange(16, dtype=np.float32)
    unsupported = (cudaError_t.cudaErrorStreamCaptureUnsupported,)
    copies = [lambda: rt.cudaMemcpyAsync(dev, pageable.ctypes.data, 64, K.cudaMemcpyHostToDevice, stream),
              lambda: rt.cudaMemcpyAsync(pageable.ctypes.data, dev, 64, K.cudaMemcpyDeviceToHost, stream),
              lambda: rt.cudaMemcpy2DAsync(dev, 16, pageable.ctypes.data, 16, 16, 4, K.cudaMemcpyHostToDevice, stream)]
    for copy in copies:
        assert copy() == (cudaError_t.cudaSuccess,)  # outside a capture: a (staged) copy, legal
        assert rt.cudaStreamBeginCapture(stream, mode) == (cudaError_t.cudaSuccess,)
        assert copy() == unsupported
        assert rt.cudaStreamEndCapture(stream) == (cudaError_t.cudaErrorStreamCaptureInvalidated, None)
    err, pinned = rt.cudaMallocHost(64)
    assert err == cudaError_t.cudaSuccess and rt.live()["pinned"] == 1
    rt.cudaStreamBeginCapture(stream, mode)
    assert rt.cudaMemcpyAsync(dev, pinned, 64, K.cudaMemcpyHostToDevice, stream) == (cudaError_t.cudaSuccess,)
    assert rt.cudaMemcpyAsync(dev, pinned + 8, 64, K.cudaMemcpyHostToDevice, stream) == (  # past its end
        cudaError_t.cudaErrorInvalidValue,)
    err, graph = rt.cudaStreamEndCapture(stream)
    assert err == cudaError_t.cudaSuccess
    for r in (rt.cudaGraphDestroy(graph), rt.cudaFreeHost(pinned), rt.cudaFree(dev), rt.cudaStreamDestroy(stream)):
        assert r == (cudaError_t.cudaSuccess,)
    assert rt.live() == NOTHING_LIVE


def test_fake_cuda_graph_replay_faults_on_memory_freed_since_the_capture():
    """A graph keeps the addresses it was captured with, not the memory: a replay whose copy reads or writes an
    allocation freed since then faults (sticky cudaErrorIllegalAddress at the next synchronize) and touches
    nothing, as a kernel on unmapped device memory does."""
    rt = FakeCudart()
    _, stream = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    K, mode = rt.cudaMemcpyKind, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal

    def captured(*ops):
        rt.cudaStreamBeginCapture(stream, mode)
        for op in ops:
            assert op() == (cudaError_t.cudaSuccess,)
        err, graph = rt.cudaStreamEndCapture(stream)
        _, exe = rt.cudaGraphInstantiate(graph, 0)
        rt.cudaGraphDestroy(graph)
        return exe

    _, src = rt.cudaMalloc(64)
    _, dst = rt.cudaMalloc(64)
    rt.device_bytes(src, 64)[...] = 7
    exe = captured(lambda: rt.cudaMemcpyAsync(dst, src, 64, K.cudaMemcpyDeviceToDevice, stream))
    assert rt.cudaFree(src) == (cudaError_t.cudaSuccess,)
    assert rt.cudaGraphLaunch(exe, stream) == (cudaError_t.cudaSuccess,)  # launches are asynchronous
    assert rt.cudaStreamSynchronize(stream) == (cudaError_t.cudaErrorIllegalAddress,)
    assert "in no allocation" in rt.fault and (rt.device_bytes(dst, 64) == 0xFF).all()  # dst untouched

    for free in ("device", "pinned"):  # the destination freed, a page-locked source freed; each a fresh device
        rt = FakeCudart()
        _, stream = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
        _, dev = rt.cudaMalloc(64)
        _, host = rt.cudaMallocHost(64)
        exe = captured(lambda: rt.cudaMemcpyAsync(dev, host, 64, K.cudaMemcpyHostToDevice, stream),
                       lambda: rt.cudaMemsetAsync(dev, 0, 64, stream),
                       lambda: rt.cudaMemcpy2DAsync(dev, 16, host, 16, 16, 4, K.cudaMemcpyHostToDevice, stream))
        rt.cudaGraphLaunch(exe, stream)
        assert rt.cudaStreamSynchronize(stream) == (cudaError_t.cudaSuccess,)  # all alive: it runs
        assert (rt.cudaFree(dev) if free == "device" else rt.cudaFreeHost(host)) == (cudaError_t.cudaSuccess,)
        rt.cudaGraphLaunch(exe, stream)
        assert rt.cudaStreamSynchronize(stream) == (cudaError_t.cudaErrorIllegalAddress,), free


def test_fake_tensorrt_reports_the_graphs_dtypes_and_faults_out_of_bounds(graphs, tmp_path):
    rt = FakeCudart()
    trt = fake_tensorrt(rt)
    layout = read_kv_layout(graphs["bf16"])
    plan = write_plan(tmp_path / "p.plan", graphs["bf16"], optimization_profiles(layout))
    engine = trt.Runtime(trt.Logger()).deserialize_cuda_engine(plan.read_bytes())
    dtypes = {engine.get_tensor_name(i): engine.get_tensor_dtype(engine.get_tensor_name(i))
              for i in range(engine.num_io_tensors)}
    assert dtypes["input_ids"] == dtypes["attention_mask"] == DataType.INT64 and dtypes["logits"] == DataType.FLOAT
    assert {dtypes[n] for n in layout.past_names + layout.present_names} == {DataType.BF16}
    assert engine.get_tensor_shape("past_key_values.0.key") == (-1, layout.n_head, -1, layout.head_dim)
    # a prefill of 2 tokens whose logits buffer is one row short: the enqueue faults, the sync reports it
    _, stream = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    ctx = engine.create_execution_context()
    assert ctx.set_optimization_profile_async(0, stream)
    assert not ctx.set_input_shape("input_ids", (1, N + 1))  # outside the profile
    shapes = {"input_ids": (1, 2), "attention_mask": (1, 2), **{n: (1, layout.n_head, 0, layout.head_dim)
                                                               for n in layout.past_names}}
    for name, shape in shapes.items():
        assert ctx.set_input_shape(name, shape)
    _, ids = rt.cudaMalloc(16)
    ctypes.memset(ids, 0, 16)
    _, mask = rt.cudaMalloc(16)
    rt.device_bytes(mask, 16)[...] = np.ones(2, dtype=np.int64).view(np.uint8)
    _, logits = rt.cudaMalloc(layout.vocab_size * 4)  # room for one row of two
    _, kv = rt.cudaMalloc(layout.n_head * 2 * layout.head_dim * 2)  # exactly [1, H, 2, D] bf16
    assert not ctx.execute_async_v3(stream)  # no addresses yet
    for name, ptr in {"input_ids": ids, "attention_mask": mask, "logits": logits,
                      **{n: kv for n in layout.past_names + layout.present_names}}.items():
        assert ctx.set_tensor_address(name, ptr)
    assert not ctx.set_tensor_address("logits", logits + 2)  # not float32-aligned
    assert ctx.execute_async_v3(stream)
    assert rt.cudaStreamSynchronize(stream) == (cudaError_t.cudaErrorIllegalAddress,)
    assert "tensor 'logits'" in rt.fault and "past the end" in rt.fault


def test_the_runtimes_dtype_map_on_tensorrts_datatype():  # the stand-ins' DataType: tests/test_trt_enums.py
    trt = pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX (the 'rtx' extra) has the real DataType enum")
    from andrea_export.runtime.trt import _numpy_dtypes

    assert {d.name: t.name for d, t in _numpy_dtypes(trt).items()} == {  # the runtime's map, on the real enum
        "FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT32": "int32", "INT64": "int64"}


# --- the build's check of the decoder engine -----------------------------------------------------------

@pytest.fixture(scope="module")
def plugin_graphs(graphs, tmp_path_factory):
    """What a TensorRT build hands the builder for the decoder engine: each precision's decoder with every tanh-GELU
    a plugin call (fused with its bias Add too, as `build --fuse-bias` writes it). The fake engine runs the calls
    as the kernel computes them, with its tanh's error."""
    from andrea_export.graphs.gelu_plugin import apply_gelu_plugin

    d = tmp_path_factory.mktemp("plugin")
    out = {p: apply_gelu_plugin(g, d / f"decoder.{p}.plugin.onnx").path for p, g in graphs.items()}
    out["fp32-bias"] = apply_gelu_plugin(graphs["fp32"], d / "decoder.fp32.bias.plugin.onnx", fuse_bias=True).path
    return out


@pytest.fixture(scope="module")
def wrong_graphs(graphs, tmp_path_factory):
    """Each precision's decoder with one block's weights disturbed: an engine that decodes wrongly without an error."""
    from onnx import numpy_helper

    d, out = tmp_path_factory.mktemp("wrong"), {}
    rng = np.random.default_rng(0)
    for p, g in graphs.items():
        m = onnx.load(str(g))
        t = [t for t in m.graph.initializer if len(t.dims) == 2 and not t.name.startswith("wte")][-1]  # a block's
        a = numpy_helper.to_array(t)
        noisy = a.astype(np.float32) + rng.normal(0, 0.3, a.shape).astype(np.float32)
        t.CopyFrom(numpy_helper.from_array(noisy.astype(a.dtype), t.name))
        onnx.save(m, str(d / f"decoder.{p}.onnx"))
        out[p] = d / f"decoder.{p}.onnx"
    return out


def _last_position_wrong(graph, out):
    """The decoder with the position embedding of the context's last slot (n - 1) disturbed: an engine that
    is right everywhere but at the full-context boundary, which an 8-token prompt decoding 16 steps never reaches."""
    from onnx import numpy_helper

    m = onnx.load(str(graph))
    t = next(t for t in m.graph.initializer if t.name.startswith("wpe"))
    a = numpy_helper.to_array(t).astype(np.float32).copy()
    a[-1] += np.random.default_rng(1).normal(0, 2.0, a.shape[1]).astype(np.float32)
    t.CopyFrom(numpy_helper.from_array(a.astype(numpy_helper.to_array(t).dtype), t.name))
    onnx.save(m, str(out))
    return out


def _gate(folder, graph, engine_graph, lively_model, precision, **plan):
    """verify_folder's verdict on a folder whose decoder engine was "built" from `engine_graph`."""
    from andrea_export.verify import folder as verify_folder

    folder.mkdir()
    shutil.copy(graph, folder / graph.name)
    write_plan(folder / "decoder.plan", engine_graph, optimization_profiles(read_kv_layout(engine_graph)), **plan)
    engine = folder / "decoder.plan"  # a sidecar as the builder writes it (read, and checked, by verify_folder)
    (folder / "decoder.plan.json").write_text(json.dumps({
        "builder": "tensorrt", "builder_version": "10.13.3", "plan_bytes": engine.stat().st_size,
        "plan_sha256": sha256_file(engine), "compute_capabilities": ["9.0"]}))
    artifacts = {"onnx": "model.onnx", "onnx_plugin": "model.plugin.onnx", "engine": "model.plan",
                 "decoder_onnx": graph.name, "decoder_engine": "decoder.plan", "decoder_engine_info": "decoder.plan.json"}
    report = verify_folder.verify_folder(folder, lively_model, precision, artifacts, {}, None, 16)
    from andrea_export.verify.compare import print_summary

    print_summary(report)  # the summary reads the engine's paths as verify_folder writes them
    return verify_folder.build_status(report), report.decoder["engine"]


@pytest.fixture
def gate_only(monkeypatch):
    """verify_folder with only the decoder engine's check real (the other checks are not the subject), on the
    fake device as on a GPU host."""
    from andrea_export.verify import compare as verify_module
    from andrea_export.verify import folder as verify_folder
    from andrea_export.verify.thresholds import TOLERANCES

    monkeypatch.setattr(verify_module, "verify", lambda model, runners, *, precision, skipped, **_: verify_module.VerifyReport(
        True, precision, TOLERANCES[precision], verify_module.lm_thresholds(precision), [], [], skipped))
    monkeypatch.setattr(verify_folder, "engine_runner", lambda plan, info: (object(), ""))
    monkeypatch.setattr(verify_folder, "decoder_checks", lambda folder, model, precision, artifacts, *a, **k: {
        "artifact": artifacts["decoder_onnx"], "passed": True,  # decoder_checks' shape, as the summary reads it
        "steps": {"passed": True, "steps": 0, "per_step": [{"step": 0, "max_abs_logits": 0.0, "passed": True}]}})
    monkeypatch.setattr(verify_folder, "engine_blocker", lambda plan, info: None)
    from andrea_export.verify import openvino as verify_openvino  # another runtime's check: not the subject

    def not_here():
        raise MissingDependency("not the subject of these tests")

    monkeypatch.setattr(verify_openvino, "openvino_precision", not_here)


@pytest.mark.parametrize("precision", FLOAT_PRECISIONS)  # int8/int4 engines: Q/DQ graphs, not run by the fake
def test_the_builds_engine_check_fails_an_engine_that_decodes_wrongly(device, gate_only, graphs, plugin_graphs,
                                                                      wrong_graphs, lively_model, tmp_path, precision):
    """verify_folder on a GPU host: the decoder engine's checks through TrtSession gate the build's status in
    every precision, on both of the runtime's paths (CUDA graph and uncaptured), each with its boundary. The right
    engine is built from the plugin graph, as TensorRT's is, and runs the kernel's tanh with its error."""
    right, engine = _gate(tmp_path / "right", graphs[precision], plugin_graphs[precision], lively_model, precision)
    assert right == "passed" and engine["passed"]
    assert set(engine["paths"]) == {"cuda_graph", "capture_fallback", "uncaptured"}
    for r in engine["paths"].values():
        assert r["passed"] and r["greedy"]["steps"] == 16 and set(r["boundary"]) == {"prefill_n", "past_n-2_n-1"}
    assert engine["paths"]["cuda_graph"]["captured"] is True and engine["paths"]["cuda_graph"]["capture_error"] is None
    wrong, engine = _gate(tmp_path / "wrong", graphs[precision], wrong_graphs[precision], lively_model, precision)
    assert wrong == "failed" and not engine["passed"]
    _closed_clean(device)


def test_the_fp32_gate_passes_the_plugin_kernel_and_would_fail_tanh_approx_in_its_fp32_entry_points(
        device, gate_only, graphs, plugin_graphs, lively_model, tmp_path, monkeypatch):
    """An fp32 engine is held to fp32's 1e-4 on the logits. Its plugin calls run the float32 entry points, whose
    tanh is float32-accurate (2^-20): the engine passes, bias-fused calls too. With tanh.approx there (2^-10.9, the
    kernel's float32 numerics before), the same correct engine fails the gate: the verdict would have been
    wrong on a GPU host, and this stand-in sees it on a CPU."""
    from andrea_export.plugin import reference

    for name in ("fp32", "fp32-bias"):
        status, engine = _gate(tmp_path / name, graphs["fp32"], plugin_graphs[name], lively_model, "fp32")
        assert status == "passed" and engine["passed"], name
    monkeypatch.setitem(reference.TANH_REL_ERR, "float32", reference.TANH_APPROX_REL_ERR)
    status, engine = _gate(tmp_path / "approx", graphs["fp32"], plugin_graphs["fp32"], lively_model, "fp32")
    assert status == "failed" and not engine["passed"]
    worst = max(b["max_abs"] for r in engine["paths"].values() for b in r["boundary"].values())
    assert worst > 1e-4  # tanh.approx's error alone moves the logits past fp32's bound
    _closed_clean(device)


def test_the_engine_gate_checks_the_runtimes_capture_fallback(device, gate_only, graphs, lively_model, tmp_path,
                                                              monkeypatch):
    """When a capture fails the runtime runs the fixed-shape step through execute_async_v3: a path of its own,
    which an engine that captures never takes. The gate takes it on purpose, so a runtime whose fallback forgets
    to run the step (its logits those of the step before) fails the gate with an engine that captures."""
    from andrea_export.runtime import trt as trt_backend

    execute = trt_backend.TrtSession._execute

    def stale_fallback(self, ctx):  # the defect: the uncaptured fixed-shape decode step never runs
        if self.static and self._graph_exec is None and ctx is self.contexts["decode"] and self._len:
            return None
        return execute(self, ctx)

    monkeypatch.setattr(trt_backend.TrtSession, "_execute", stale_fallback)
    status, engine = _gate(tmp_path / "b", graphs["fp32"], graphs["fp32"], lively_model, "fp32")
    paths = engine["paths"]
    assert paths["cuda_graph"]["passed"] and paths["cuda_graph"]["captured"] and paths["uncaptured"]["passed"]
    assert not paths["capture_fallback"]["passed"] and "captured" not in paths["capture_fallback"]
    assert status == "failed"
    _closed_clean(device)


def test_the_engine_gate_checks_the_full_context_boundary(device, gate_only, graphs, lively_model, tmp_path):
    """An engine wrong only at the context's last slot: greedy decoding from 8 tokens for 16 steps agrees (the
    old gate's only check: it read `passed`), the boundary (prefill of n; decode at past n - 2, n - 1) fails it."""
    bad = _last_position_wrong(graphs["fp32"], tmp_path / "decoder.last-wrong.onnx")
    status, engine = _gate(tmp_path / "b", graphs["fp32"], bad, lively_model, "fp32")
    assert status == "failed"
    for r in engine["paths"].values():
        assert r["greedy"]["passed"] and r["greedy"]["agree"]  # blind there
        assert not r["boundary"]["prefill_n"]["passed"] and not r["boundary"]["past_n-2_n-1"]["passed"]
    _closed_clean(device)


def test_an_engine_whose_capture_fails_does_not_pass(device, gate_only, graphs, lively_model, tmp_path):
    """The runtime falls back to uncaptured steps when a CUDA-graph capture fails, and its tokens are right;
    the gate fails such an engine anyway and says why in verify.json (it used to read `passed`)."""
    status, engine = _gate(tmp_path / "c", graphs["fp32"], graphs["fp32"], lively_model, "fp32", fail_capture=True)
    graph_path = engine["paths"]["cuda_graph"]
    assert status == "failed" and graph_path["captured"] is False and "capture" in graph_path["capture_error"].lower() \
        or "execute_async_v3" in graph_path["capture_error"]
    assert graph_path["greedy"]["agree"] and engine["paths"]["uncaptured"]["passed"]
    _closed_clean(device)


def test_threads_and_batches_take_turns(device, graphs, references, tmp_path):
    """TrtSession is a SerialSession: threads take turns on its one cache and a batch runs prompt by prompt,
    each prompt with exactly the tokens ONNX Runtime gives it alone (without the lock the threads' tokens
    come out wrong, silently)."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [_prompt(5), _prompt(4), _prompt(1), _prompt(25)]
    alone = [references["fp32"].generate(p, 12, strategy="top-k", seed=i) for i, p in enumerate(prompts)]
    with runtime.load(_build_folder(tmp_path / "build", graphs["fp32"]), backend="tensorrt") as sess:
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda i: sess.generate(prompts[i], 12, strategy="top-k", seed=i), range(4))) == alone
        assert sess.generate(prompts, 12, strategy="top-k", seed=list(range(4))) == alone
    _closed_clean(device)


def test_close_waits_for_a_running_call_and_a_call_after_close_is_refused(device, graphs, expected, tmp_path):
    """close() from another thread while a call holds the session (an unfinished stream) waits for that call
    instead of freeing its buffers under it; the call finishes with the right tokens; a call after close (and a
    close from inside the thread's own unfinished call) gets a one-line InputError, and nothing leaks."""
    import threading

    sess = runtime.load(_build_folder(tmp_path / "build", graphs["fp32"]), backend="tensorrt")
    prompt = _prompt(5)
    events = sess.stream(prompt, 12)
    got = [next(events)[0]]  # the call now holds the session
    with pytest.raises(runtime.InputError, match="already in a call"):
        sess.close()  # from the same thread it would wait for itself
    closer = threading.Thread(target=sess.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive(), "close() returned while a call was running (it freed the call's buffers)"
    got += [token for token, _ in events]
    closer.join(30)
    assert not closer.is_alive()
    assert got == expected("fp32", 5)[1][:12]
    _closed_clean(device)
    for call in (lambda: sess.generate(prompt, 3), lambda: sess.forward(prompt), lambda: next(sess.stream(prompt, 3))):
        with pytest.raises(runtime.InputError, match="closed"):
            call()
    sess.close()  # a second close does nothing
    _closed_clean(device)


def test_a_session_that_fails_to_load_frees_what_it_took(device, graphs, tmp_path):
    """An engine refused after the stream (and buffers) exist: the InputError leaves nothing allocated."""
    from andrea_export.runtime.trt import TrtSession

    layout = read_kv_layout(graphs["fp32"])
    plan = write_plan(tmp_path / "decoder.plan", graphs["fp32"], optimization_profiles(layout)[:1])  # no decode profile
    with pytest.raises(runtime.InputError, match="optimization profile"):
        TrtSession(plan, read_config(graphs["fp32"]), layout)
    _closed_clean(device)


def test_a_replay_after_its_buffers_are_freed_faults(device, graphs, tmp_path):
    """The captured decode step keeps its tensor addresses: freed under it, the replay's enqueue faults and the
    step reports the device error (it does not read or write freed memory)."""
    sess = runtime.load(_build_folder(tmp_path / "build", graphs["fp32"]), backend="tensorrt")
    assert sess.cuda_graph_active
    sess.forward(_prompt(4))
    device.cudaFree(sess._present[0])
    sess._buffers.remove(sess._present[0])
    with pytest.raises(CudaError):  # the copy after the launch, or the synchronize, reports it
        sess._decode(1)
    assert device.sticky == cudaError_t.cudaErrorIllegalAddress
    assert "tensor 'present.0.key'" in device.fault


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["growing-cache", "cuda-graph"])
def test_close_lets_go_of_the_engine_and_a_forgotten_session_frees_its_memory(device, graphs, tmp_path, cuda_graph):
    """A service that reloads sessions must not grow device memory: 20 load/close cycles leave nothing
    allocated and no engine, runtime or context referenced; a session never closed frees everything when it
    is collected; close() waits for the stream before it frees (a step that raised part-way may have work
    queued on it)."""
    import gc
    import weakref

    from andrea_export.runtime.trt import TrtSession

    layout, cfg = read_kv_layout(graphs["fp32"]), read_config(graphs["fp32"])
    plan = write_plan(tmp_path / "decoder.plan", graphs["fp32"], optimization_profiles(layout))
    calls = []
    for name in ("cudaStreamSynchronize", "cudaFree"):
        real = getattr(device, name)
        setattr(device, name, lambda *a, _real=real, _name=name: (calls.append(_name), _real(*a))[1])
    for _ in range(20):
        sess = TrtSession(plan, cfg, layout, cuda_graph=cuda_graph)
        sess.generate(_prompt(3), 2)
        held = [weakref.ref(x) for x in (sess.engine, sess._runtime, *sess.contexts.values())]
        calls.clear()
        sess.close()
        assert "cudaFree" in calls and calls.index("cudaStreamSynchronize") < calls.index("cudaFree"), calls
        gc.collect()
        assert [r() for r in held] == [None] * len(held), "close() keeps TensorRT objects referenced"
        _closed_clean(device)
    forgotten = TrtSession(plan, cfg, layout, cuda_graph=cuda_graph)
    forgotten.generate(_prompt(3), 2)
    assert device.live()["allocations"] > 0
    del forgotten
    gc.collect()
    _closed_clean(device)


def test_a_tensor_address_off_256_bytes_is_refused(device, graphs, tmp_path):
    """TensorRT wants every tensor address 256-byte aligned (NvInferRuntime.h, setTensorAddress); the stand-in
    refuses one that is only element-aligned, and the runtime's `bind` turns the refusal into an error."""
    from andrea_export.runtime.trt import bind

    trt = fake_tensorrt(device)
    plan = write_plan(tmp_path / "decoder.plan", graphs["fp32"], optimization_profiles(read_kv_layout(graphs["fp32"])))
    ctx = trt.Runtime(trt.Logger()).deserialize_cuda_engine(plan.read_bytes()).create_execution_context()
    _, ptr = device.cudaMalloc(4096)
    assert not ctx.set_tensor_address("logits", ptr + 4) and not ctx.set_tensor_address("logits", ptr + 128)
    with pytest.raises(CudaError, match="refused the address of 'logits'.*256-byte"):
        bind(ctx, {}, {"logits": ptr + 4})
    bind(ctx, {}, {"logits": ptr + 256})
    device.cudaFree(ptr)


# --- where an engine loads: TensorRT's refusals, and what the runtime says about them -------------------------

JIT_GELU = [{"name": "TanhGelu", "namespace": "andrea", "version": "1", "aot": False}]  # a plugin that is not AOT


def _deserialize(trt, plan):
    logger = trt.Logger()
    return trt.Runtime(logger).deserialize_cuda_engine(plan.read_bytes()), [m for _, m in logger.messages]


def test_fake_tensorrt_refuses_what_tensorrt_refuses_and_loads_an_aot_plugin_engine_with_nothing_registered(
        graphs, plugin_graphs, tmp_path, capsys):
    """deserialize_cuda_engine returns None, TensorRT's reason in its log (printed, as trt.Logger prints), for a plan of
    another TensorRT version, one built for another compute capability (unless hardware-compatible), and one with a
    plugin layer whose creator this process has not registered; an AOT plugin's plan needs no creator (its kernel is
    in the engine), so it loads in a process where nothing was registered."""
    profiles = optimization_profiles(read_kv_layout(graphs["fp32"]))
    trt = fake_tensorrt(FakeCudart())
    assert trt.get_plugin_registry().get_creator("TanhGelu", "1", "andrea") is None  # nothing registered here
    aot = write_plan(tmp_path / "aot.plan", plugin_graphs["fp32-bias"], profiles)
    assert json.loads(aot.read_text())["plugins"] == [
        {"name": "TanhGeluBias", "namespace": "andrea", "version": "1", "aot": True}]  # what the build embeds
    assert _deserialize(trt, aot)[0] is not None

    engine, log = _deserialize(trt, write_plan(tmp_path / "v.plan", graphs["fp32"], profiles, trt_version="10.9.0"))
    assert engine is None and "expecting library version 10.13.3 got 10.9.0" in log[0]
    assert log[-1] == "4: Internal Error (Engine deserialization failed.)"
    assert "[TRT] [E] 6: The engine plan file is not compatible with this version of TensorRT" in capsys.readouterr().err

    sm89 = fake_tensorrt(FakeCudart(compute_capability="8.9"))
    engine, log = _deserialize(sm89, write_plan(tmp_path / "cc.plan", graphs["fp32"], profiles))  # built for 9.0
    assert engine is None and "incompatible device, expecting compute 8.9 got compute 9.0" in log[0]
    same = write_plan(tmp_path / "same.plan", graphs["fp32"], profiles, hardware_compatibility="SAME_COMPUTE_CAPABILITY")
    assert _deserialize(sm89, same)[0] is None
    ampere = write_plan(tmp_path / "ampere.plan", graphs["fp32"], profiles, hardware_compatibility="AMPERE_PLUS")
    assert _deserialize(sm89, ampere)[0] is not None
    assert _deserialize(fake_tensorrt(FakeCudart(compute_capability="7.5")), ampere)[0] is None

    jit = write_plan(tmp_path / "jit.plan", plugin_graphs["fp32"], profiles, plugins=JIT_GELU)
    engine, log = _deserialize(trt, jit)
    assert engine is None and "could not find plugin TanhGelu version 1 namespace andrea" in log[0]
    assert "IPluginCreator not found in Plugin Registry" in log[1]
    registered = fake_tensorrt(FakeCudart(), plugin_creators=[("TanhGelu", "1", "andrea")])
    assert _deserialize(registered, jit)[0] is not None

    (tmp_path / "junk.plan").write_bytes(b"\x00not an engine")
    assert _deserialize(trt, tmp_path / "junk.plan")[0] is None


def _sidecar(folder, **fields):
    """decoder.plan.json as the builder writes it beside decoder.plan (what built it, for which GPU)."""
    plan = folder / "decoder.plan"
    info = {"builder": "tensorrt", "builder_version": "10.13.3", "plan_bytes": plan.stat().st_size,
            "plan_sha256": sha256_file(plan), "compute_capabilities": ["9.0"], **fields}
    (folder / "decoder.plan.json").write_text(json.dumps(info))
    return info


def test_an_engine_of_another_tensorrt_version_is_refused_by_name(device, graphs, tmp_path, capsys):
    """Built by TensorRT 10.9.0, loaded where 10.13.3 is installed: with the build's sidecar the runtime says so before
    TensorRT is asked; without one, TensorRT returns no engine and the message names the version installed here as
    the first likely cause. Nothing is left allocated either way."""
    folder = _build_folder(tmp_path / "b", graphs["fp32"], trt_version="10.9.0")
    with pytest.raises(runtime.InputError) as e:
        runtime.load(folder, backend="tensorrt")
    msg = str(e.value)
    assert "could not deserialize" in msg and "(TensorRT's own error is in the log above)" in msg
    assert "built by another TensorRT version (this is TensorRT 10.13.3;" in msg
    assert "expecting library version 10.13.3 got 10.9.0" in capsys.readouterr().err  # the log above, really there
    _closed_clean(device)
    _sidecar(folder, builder_version="10.9.0")
    with pytest.raises(runtime.InputError, match=r"decoder.plan: built with TensorRT 10.9.0 \(decoder.plan.json says\), "
                                                 r"but this process has TensorRT 10.13.3; .*install tensorrt==10.9.0"):
        runtime.load(folder, backend="tensorrt")
    assert "[TRT]" not in capsys.readouterr().err  # said before TensorRT was asked
    _closed_clean(device)


def test_an_engine_for_another_gpu_is_refused_by_name(device, graphs, tmp_path, capsys):
    """Built for compute capability 9.0 (H100/H200), loaded on an 8.9 GPU (L4/L40/RTX 40): named from the sidecar before
    TensorRT is asked, else as the likely cause after TensorRT refuses; built hardware-compatible, it loads."""
    device.compute_capability = "8.9"
    folder = _build_folder(tmp_path / "b", graphs["fp32"])
    with pytest.raises(runtime.InputError) as e:
        runtime.load(folder, backend="tensorrt")
    assert "for another GPU (this one is compute capability 8.9;" in str(e.value)
    assert "expecting compute 8.9 got compute 9.0" in capsys.readouterr().err
    _closed_clean(device)
    _sidecar(folder)
    with pytest.raises(runtime.InputError, match=r"decoder.plan: built for compute capability 9.0 \(decoder.plan.json "
                                                 r"says\), but this GPU is 8.9; .*rebuild it on this GPU"):
        runtime.load(folder, backend="tensorrt")
    _closed_clean(device)
    portable = _build_folder(tmp_path / "p", graphs["fp32"], hardware_compatibility="AMPERE_PLUS")
    with runtime.load(portable, backend="tensorrt") as sess:
        assert sess.forward(_prompt(4)).shape == (4, ANDREA_TINY.vocab_size)
    _closed_clean(device)


def test_an_engine_whose_plugin_creator_is_missing_names_the_creators(device, graphs, plugin_graphs, expected, tmp_path,
                                                                      monkeypatch):
    """A plugin engine whose plugin is not AOT needs its creator registered in the loading process: the sidecar's
    version and GPU match, TensorRT returns no engine, and the message names the creators it needs. With them
    registered it loads. This project's AOT engine loads and decodes in a process that registered nothing."""
    from andrea_export.runtime import trt as trt_backend

    folder = _build_folder(tmp_path / "jit", plugin_graphs["fp32"], plugins=JIT_GELU)
    layers = sum(n.domain == "andrea" for n in onnx.load(str(plugin_graphs["fp32"])).graph.node)
    _sidecar(folder, plugin_layers=layers)
    with pytest.raises(runtime.InputError) as e:
        runtime.load(folder, backend="tensorrt")
    msg = str(e.value)
    assert "matches this process (TensorRT 10.13.3, compute capability 9.0)" in msg
    assert (f"its {layers} plugin layers need their plugin creators (andrea::TanhGelu, andrea::TanhGeluBias, "
            "version 1) registered in this process") in msg
    _closed_clean(device)
    monkeypatch.setattr(trt_backend, "_tensorrt",
                        lambda: fake_tensorrt(device, plugin_creators=[("TanhGelu", "1", "andrea")]))
    runtime.load(folder, backend="tensorrt").close()
    monkeypatch.setattr(trt_backend, "_tensorrt", lambda: fake_tensorrt(device))  # nothing registered
    aot = _build_folder(tmp_path / "aot", plugin_graphs["fp32"])
    _sidecar(aot, plugin_layers=layers)
    with runtime.load(aot, backend="tensorrt") as sess:
        assert sess.engine.get_tensor_name(0) == "input_ids"
        np.testing.assert_allclose(sess.forward(_prompt(64)), expected("fp32", 64)[0], rtol=1e-3, atol=1e-3)
    _closed_clean(device)
