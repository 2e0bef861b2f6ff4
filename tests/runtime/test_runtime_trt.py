"""The TensorRT session (GPU hosts only): builds the tiny decoder engine with both profiles, then greedy
decoding through TensorRT (growing cache, and the fixed-shape CUDA-graph decode) must match ONNX Runtime
token for token. Skipped with the reason where TensorRT or a GPU is missing."""

from __future__ import annotations

import ctypes
import enum
import shutil
import types

import numpy as np
import pytest

from andrea_export import runtime
from andrea_export.config import ANDREA_TINY
from andrea_export.kvcache import optimization_profiles


def _gpu_with_tensorrt() -> str | None:
    """None when the TensorRT tests can run here, else the reason they cannot."""
    try:
        import tensorrt as trt
    except ImportError:
        return "TensorRT is not installed (GPU hosts: pip install 'andrea-export[tensorrt]'); not installable on the CPU machines"
    if not hasattr(trt, "Builder"):
        return "only tensorrt-stubs is installed (an empty 'tensorrt' namespace), not TensorRT itself"
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return "cuda-python is not installed (pip install 'andrea-export[gpu]')"
    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess or count == 0:
        return f"no usable NVIDIA GPU ({err})"
    return None


SKIP = _gpu_with_tensorrt()


@pytest.fixture(scope="module")
def trt_build_dir(build_dir, tmp_path_factory):
    """The ORT build folder plus decoder.plan, built here with TensorRT from the two profiles."""
    import tensorrt as trt

    folder = tmp_path_factory.mktemp("trt")
    shutil.copy(build_dir / "decoder.onnx", folder / "decoder.onnx")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(folder / "decoder.onnx"))
    config = builder.create_builder_config()
    for prof in optimization_profiles(ANDREA_TINY):
        p = builder.create_optimization_profile()
        for name, s in prof["shapes"].items():
            p.set_shape(name, s["min"], s["opt"], s["max"])
        config.add_optimization_profile(p)
    plan = builder.build_serialized_network(network, config)
    assert plan is not None
    (folder / "decoder.plan").write_bytes(bytes(plan))
    return folder


@pytest.mark.gpu
@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_trt_greedy_matches_onnxruntime(trt_build_dir, session, cuda_graph):
    prompt = [1, 2, 3, 4, 5]
    with runtime.load(trt_build_dir, backend="tensorrt", cuda_graph=cuda_graph) as trt_sess:
        assert trt_sess.backend == "tensorrt"
        if cuda_graph:
            assert trt_sess.cuda_graph_active, trt_sess.cuda_graph_error
        np.testing.assert_allclose(trt_sess.forward(prompt), session.forward(prompt), rtol=1e-3, atol=1e-3)
        assert trt_sess.generate(prompt, 64) == session.generate(prompt, 64)
        # a second generation reuses every buffer (and the captured graph)
        assert trt_sess.generate([9, 8, 7], 40) == session.generate([9, 8, 7], 40)


@pytest.mark.gpu
@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
def test_auto_picks_tensorrt_when_an_engine_is_there(trt_build_dir):
    with runtime.load(trt_build_dir) as sess:
        assert sess.backend == "tensorrt"


# --- the session's bookkeeping on the CPU ------------------------------------------------------------
# A stand-in for TensorRT and the CUDA runtime: "device memory" is host memory (so every copy is a memmove),
# and the engine runs the decoder graph through ONNX Runtime on whatever its tensor addresses hold. This
# checks what the GPU cannot be asked here: buffer sizes, addresses, the alternating cache sets, the
# fixed-length past with its mask and slot copies, and graph capture and replay.

class _Err(enum.Enum):
    cudaSuccess = 0


class _FakeCudart:
    cudaError_t = _Err
    cudaStreamNonBlocking = 1
    cudaMemcpyKind = types.SimpleNamespace(cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2, cudaMemcpyDeviceToDevice=3)
    cudaStreamCaptureMode = types.SimpleNamespace(cudaStreamCaptureModeThreadLocal=1)
    OK = (_Err.cudaSuccess,)

    def __init__(self):
        self.arrays, self.capturing, self.launches, self.mallocs = [], None, 0, 0

    def cudaStreamCreateWithFlags(self, flags):
        return _Err.cudaSuccess, 7

    def cudaMalloc(self, n):
        self.mallocs += 1
        a = np.full(n, 0xFF, dtype=np.uint8)  # NaN-filled floats: unset memory must never be read unmasked
        self.arrays.append(a)
        return _Err.cudaSuccess, a.ctypes.data

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        ctypes.memmove(dst, src, n)
        return self.OK

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
        return self.OK

    def cudaMemsetAsync(self, ptr, value, n, stream):
        ctypes.memset(ptr, value, n)
        return self.OK

    def cudaStreamSynchronize(self, stream):
        return self.OK

    def cudaStreamBeginCapture(self, stream, mode):
        self.capturing = []
        return self.OK

    def cudaStreamEndCapture(self, stream):
        graph, self.capturing = self.capturing, None
        return _Err.cudaSuccess, graph

    def cudaGraphInstantiate(self, graph, flags):
        return _Err.cudaSuccess, list(graph)

    def cudaGraphLaunch(self, graph_exec, stream):
        self.launches += 1
        for run in graph_exec:
            run()
        return self.OK

    def cudaGraphDestroy(self, graph):
        return self.OK

    cudaGraphExecDestroy = cudaFree = cudaStreamDestroy = cudaGraphDestroy

    def cudaGetLastError(self):
        return self.OK


def _fake_tensorrt(cudart, layout):
    import onnxruntime as ort

    dtypes = {t.name: np.dtype(t.dtype) for t in layout.inputs + layout.outputs}
    profiles = optimization_profiles(layout)

    class Context:
        def __init__(self, sess):
            self.sess, self.shapes, self.addr, self.profile = sess, {}, {}, None

        def set_optimization_profile_async(self, index, stream):
            self.profile = index
            return True

        def set_input_shape(self, name, shape):
            s = profiles[self.profile]["shapes"][name]
            ok = all(lo <= x <= hi for lo, x, hi in zip(s["min"], shape, s["max"]))
            self.shapes[name] = tuple(shape)
            return ok

        def set_tensor_address(self, name, ptr):
            self.addr[name] = ptr
            return True

        def _view(self, name, shape):
            n = int(np.prod(shape)) * dtypes[name].itemsize
            return np.frombuffer((ctypes.c_char * max(n, 1)).from_address(self.addr[name]), dtype=np.uint8)[:n].view(
                dtypes[name]).reshape(shape)

        def _run(self):
            feed = {n: self._view(n, s).copy() for n, s in self.shapes.items()}
            outs = self.sess.run(None, feed)
            for t, out in zip(layout.outputs, outs):
                self._view(t.name, out.shape)[...] = out

        def execute_async_v3(self, stream):
            if cudart.capturing is not None:
                cudart.capturing.append(self._run)
            else:
                self._run()
            return True

    class Engine:
        def __init__(self, onnx_path):
            self.sess = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
            self.names = [t.name for t in layout.inputs + layout.outputs]
            self.num_io_tensors, self.num_optimization_profiles = len(self.names), 2

        def get_tensor_name(self, i):
            return self.names[i]

        def get_tensor_profile_shape(self, name, i):
            s = profiles[i]["shapes"][name]
            return s["min"], s["opt"], s["max"]

        def create_execution_context(self):
            return Context(self.sess)

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, data):
            return Engine(data.decode())

    class Logger:
        WARNING = 2

        def __init__(self, level):
            pass

    return types.SimpleNamespace(Runtime=Runtime, Logger=Logger)


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_trt_session_logic_on_a_fake_device(build_dir, session, tmp_path, monkeypatch, cuda_graph):
    from andrea_export.runtime import trt as trt_backend

    cudart = _FakeCudart()
    fake = _fake_tensorrt(cudart, session.layout)
    monkeypatch.setattr(trt_backend, "_cudart", lambda: cudart)
    monkeypatch.setattr(trt_backend, "_tensorrt", lambda: fake)
    shutil.copy(build_dir / "decoder.onnx", tmp_path / "decoder.onnx")
    (tmp_path / "decoder.plan").write_bytes(str(tmp_path / "decoder.onnx").encode())
    sess = runtime.load(tmp_path, backend="tensorrt", cuda_graph=cuda_graph)
    assert sess.cuda_graph_active is cuda_graph
    allocated = cudart.mallocs
    prompt = [1, 2, 3, 4, 5]
    np.testing.assert_allclose(sess.forward(prompt), session.forward(prompt), rtol=1e-4, atol=1e-4)
    assert sess.generate(prompt, 40) == session.generate(prompt, 40)
    assert sess.generate([9, 8, 7, 6], 33) == session.generate([9, 8, 7, 6], 33)  # odd and even prompt lengths
    assert cudart.mallocs == allocated  # nothing allocated per step
    assert cudart.launches == (39 + 32 if cuda_graph else 0)
    sess.close()
