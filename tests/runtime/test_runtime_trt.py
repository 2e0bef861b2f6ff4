"""The TensorRT session (GPU hosts only): builds the tiny decoder engine with both profiles, then greedy
decoding through TensorRT (growing cache, and the fixed-shape CUDA-graph decode) must match ONNX Runtime
token for token. Skipped with the reason where TensorRT or a GPU is missing. The same session on the CPU,
over strict stand-ins for CUDA and TensorRT: test_runtime_trt_fake.py."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from andrea_export import runtime
from andrea_export.config import ANDREA_TINY
from andrea_export.graphs.kvcache import optimization_profiles


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
        return "cuda-python is not installed (pip install 'andrea-export[tensorrt]')"
    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess or count == 0:
        return f"no usable NVIDIA GPU ({err})"
    return None


SKIP = _gpu_with_tensorrt()


def _build_engine(onnx_path, plan_path):
    """decoder.plan from a decoder graph with TensorRT: strongly typed (the graph's precision), both profiles."""
    import tensorrt as trt

    from andrea_export.engine.backends import network_flags

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(onnx_path))
    config = builder.create_builder_config()
    for prof in optimization_profiles(ANDREA_TINY):
        p = builder.create_optimization_profile()
        for name, s in prof["shapes"].items():
            p.set_shape(name, s["min"], s["opt"], s["max"])
        config.add_optimization_profile(p)
    plan = builder.build_serialized_network(network, config)
    assert plan is not None
    plan_path.write_bytes(bytes(plan))


@pytest.fixture(scope="module")
def trt_build_dir(build_dir, tmp_path_factory):
    """The ORT build folder plus decoder.plan, built here with TensorRT from the two profiles."""
    folder = tmp_path_factory.mktemp("trt")
    shutil.copy(build_dir / "decoder.onnx", folder / "decoder.onnx")
    _build_engine(folder / "decoder.onnx", folder / "decoder.plan")
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


@pytest.mark.gpu
@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_trt_full_context(trt_build_dir, session, cuda_graph):
    """A prompt of n_positions tokens (the CUDA-graph past holds n_positions - 1), and decoding to the last slot."""
    n = ANDREA_TINY.n_positions
    prompt = np.random.default_rng(0).integers(0, ANDREA_TINY.vocab_size, n).tolist()
    with runtime.load(trt_build_dir, backend="tensorrt", cuda_graph=cuda_graph) as trt_sess:
        np.testing.assert_allclose(trt_sess.forward(prompt), session.forward(prompt), rtol=1e-3, atol=1e-3)
        assert trt_sess.generate(prompt[:2], n - 2) == session.generate(prompt[:2], n - 2)


@pytest.mark.gpu
@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_trt_half_precision_engine_decodes_like_pytorch(build_dir, lively_model, tmp_path, precision, cuda_graph):
    """An fp16/bf16 engine (2-byte cache elements), loaded as bench.py does (the .plan beside the fp32
    decoder.onnx), passes the build's engine check: every logit up to any divergence within the precision's
    tolerance of PyTorch. (ONNX Runtime's CPU provider has no bf16 kernels to compare with directly.)"""
    from andrea_export.graphs.precision import convert_precision
    from andrea_export.verify.agreement import greedy_agreement
    from andrea_export.verify.thresholds import TOLERANCES

    shutil.copy(build_dir / "decoder.onnx", tmp_path / "decoder.onnx")
    graph = convert_precision(tmp_path / "decoder.onnx", tmp_path / f"decoder.{precision}.onnx", precision)
    _build_engine(graph, tmp_path / "decoder.plan")
    with runtime.load(tmp_path / "decoder.plan", backend="tensorrt", cuda_graph=cuda_graph) as trt_sess:
        assert trt_sess.layout.cache_dtype == {"fp16": "float16", "bf16": "bfloat16"}[precision]
        report = greedy_agreement(lively_model, trt_sess, list(range(1, 9)), 64, **TOLERANCES[precision])
    assert report["passed"], {k: v for k, v in report.items() if "tokens" not in k}
