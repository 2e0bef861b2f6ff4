"""The generate model on the TensorRT slot engine (deploy/triton/generate.py, served.py) and which engine `serve`
and `package` choose (deploy/server.py serve_engine, deploy/triton generate_engine). Here on the strict stand-ins
(tests/runtime/fake_cuda.py: TensorRT 10.15's KV-cache contracts, CUDA's capture rules): the packaged model's
config and files, and its `initialize`, from that config, stepping the stand-in slot cache to the tokens each
request gets alone. A real Triton on the slot engine needs a GPU (docs/gpu-hosts.md)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import python_backend

from andrea_export import runtime
from andrea_export.deploy import server as server_mod
from andrea_export.deploy.triton import generate_engine, parse_config, write_generate_model
from andrea_export.deploy.triton.generate import DEFAULT_SLOTS
from andrea_export.errors import PackageError

TRT, ROWS = "10.15.1", 4  # slot_build's (tests/conftest.py): the TensorRT that "built" it, its decoding rows


def test_the_packaged_tensorrt_generate_model_is_a_gpu_model_of_the_slot_engine(slot_build, tmp_path):
    model = write_generate_model(slot_build, tmp_path, engine="tensorrt")
    cfg = parse_config((model / "config.pbtxt").read_text())
    assert model.name == "andrea-tiny-fp32-generate"
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["engine"] == "tensorrt" and params["slots"] == str(ROWS)  # as many as the engine has rows
    (group,) = cfg.instance_group
    assert group.kind == group.KIND_GPU and list(group.gpus) == [0]
    files = {p.name for p in (model / "1" / "build").iterdir()}
    assert {"decoder.slots.onnx", "decoder.slots.two.onnx", "decoder.slots.plan", "decoder.slots.plan.json",
            "manifest.json"} <= files
    assert "decoder.inplace.onnx" not in files and any(f.endswith(".data") for f in files)
    onnx_model = write_generate_model(slot_build, tmp_path / "cpu")  # the default: ONNX Runtime, CPU instances
    cfg = parse_config((onnx_model / "config.pbtxt").read_text())
    assert cfg.parameters["engine"].string_value == "onnxruntime" and cfg.parameters["slots"].string_value == str(DEFAULT_SLOTS)
    assert cfg.instance_group[0].kind == cfg.instance_group[0].KIND_CPU


def test_a_tensorrt_generate_model_is_refused_without_a_slot_engine_or_beyond_its_rows(slot_build, tiny_build,
                                                                                      tmp_path):
    with pytest.raises(PackageError, match=r"no in-flight batching engine .*build --max-slots N"):
        write_generate_model(tiny_build[0], tmp_path / "a", engine="tensorrt")
    with pytest.raises(PackageError, match=rf"at most {ROWS} decoding rows .*not {ROWS + 1}"):
        write_generate_model(slot_build, tmp_path / "b", engine="tensorrt", slots=ROWS + 1)
    with pytest.raises(PackageError, match="engine must be one of"):
        write_generate_model(slot_build, tmp_path / "c", engine="cuda")
    assert not any(tmp_path.iterdir())


def test_the_generate_model_steps_the_slot_engine_to_each_requests_own_tokens(slot_build, tmp_path, stand_ins,
                                                                             monkeypatch):
    """TritonPythonModel.initialize from the packaged config: its session is the slot engine (TensorRT, CUDA
    graphs), and four requests batched through its batcher get the tokens ONNX Runtime's generate gives each alone."""
    from andrea_export.deploy.triton.served import TritonPythonModel
    from andrea_export.runtime import Request
    from andrea_export.runtime.trt_slots import TrtSlotSession

    model = write_generate_model(slot_build, tmp_path, engine="tensorrt")
    log: list[str] = []
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", python_backend.module(log))
    served = TritonPythonModel()
    config = json.dumps({"parameters": {k: {"string_value": v.string_value} for k, v in
                                        parse_config((model / "config.pbtxt").read_text()).parameters.items()}})
    served.initialize({"model_config": config, "model_repository": str(model), "model_version": "1",
                       "model_name": model.name})
    try:
        assert isinstance(served.session, TrtSlotSession) and served.session.capture
        assert "TensorRT 10.15.1 (the slot engine, up to 4 decoding rows" in log[-1]
        prompts = [[1, 2, 3], [7] * 20, [5, 9], [11, 4, 6, 8]]  # one longer than a chunk (16)
        got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        finished = [threading.Event() for _ in prompts]
        errors: list[str] = []

        def collect(i):
            def on(event):  # on the batcher's thread: record, never block it
                if event.token is not None:
                    got[i].append(event.token)
                if event.final:
                    if event.error:
                        errors.append(str(event.error))
                    finished[i].set()
            return on

        for i, p in enumerate(prompts):
            served.batcher.submit(Request(p, 6, "greedy", ignore_eos=True), collect(i))
        assert all(f.wait(120) for f in finished), got
        assert not errors, errors
    finally:
        served.finalize()
    assert stand_ins.live() == {"allocations": 0, "pinned": 0, "streams": 0, "graphs": 0, "graph_execs": 0}
    ref = runtime.load(slot_build / "decoder.slots.onnx", backend="onnxruntime")
    assert got == {i: ref.generate(p, 6) for i, p in enumerate(prompts)}
    assert np.unique([len(v) for v in got.values()]).tolist() == [6]


def test_package_gives_the_generate_model_the_slot_engine_for_tensorrt_gpu_instances_only(slot_build, tiny_build):
    m = json.loads((slot_build / "manifest.json").read_text())
    assert generate_engine(m, "auto", "gpu") == generate_engine(m, "tensorrt", "gpu") == "tensorrt"
    assert generate_engine(m, "auto", "cpu") == generate_engine(m, "onnxruntime", "gpu") == "onnxruntime"
    m["builder"]["name"] = "tensorrt-rtx"  # an RTX slot engine: not what the generate model runs
    assert generate_engine(m, "auto", "gpu") == "onnxruntime"
    assert generate_engine(tiny_build[1], "tensorrt", "gpu") == "onnxruntime"  # no slot engine: as before


def _host(monkeypatch, gpu, tensorrt, cuda=True):
    """This host as serve_engine sees it: GPU 0's compute capability, the serving Python's TensorRT and cuda-python."""
    import andrea_export.errors as errors

    monkeypatch.setattr(errors, "gpu_compute_capability", lambda: gpu)
    probes = []
    monkeypatch.setattr(server_mod, "serve_python", lambda env=None: Path(sys.executable))
    monkeypatch.setattr(server_mod, "triton_dist", lambda python: probes.append(python) or
                        {"tensorrt": tensorrt, "cuda": cuda})
    return probes


@pytest.mark.parametrize("gpu, tensorrt, cuda, reason", [
    (None, TRT, True, "no GPU"),
    ("9.0", None, True, "no TensorRT .*pip install tensorrt==10.15.1 cuda-python"),
    ("9.0", TRT, False, "no cuda-python"),
    ("9.0", "10.16.0", True, "built by TensorRT 10.15.1 and the serving Python has 10.16.0"),
])
def test_serve_runs_the_slot_engine_only_where_it_can_and_says_why_not(slot_build, monkeypatch, gpu, tensorrt, cuda,
                                                                      reason):
    from andrea_export.deploy.server import ServeError, serve_engine

    _host(monkeypatch, gpu, tensorrt, cuda)
    engine, why = serve_engine(slot_build)
    assert engine == "onnxruntime" and why.startswith("ONNX Runtime on the CPU: ")
    assert __import__("re").search(reason, why), why
    with pytest.raises(ServeError, match="cannot serve on TensorRT: .*" + reason):
        serve_engine(slot_build, "tensorrt")


def test_serve_chooses_the_slot_engine_on_a_gpu_host_that_can_load_it(slot_build, tiny_build, monkeypatch):
    from andrea_export.deploy.server import ServeError, serve_engine

    probes = _host(monkeypatch, "9.0", TRT)
    assert serve_engine(slot_build) == ("tensorrt", "TensorRT 10.15.1: the build's slot engine on GPU 0 (compute "
                                                    "capability 9.0)")
    assert serve_engine(slot_build, "onnxruntime")[0] == "onnxruntime"
    assert serve_engine(tiny_build[0]) == ("onnxruntime", "ONNX Runtime on the CPU: the build has no in-flight "
                                           "batching engine (build --max-slots N on a GPU host, TensorRT >= 10.15)")
    assert len(probes) == 1  # the serving Python is asked only when the rest would serve
    with pytest.raises(ServeError, match="engine must be one of"):
        serve_engine(slot_build, "cuda")


def test_the_serving_environments_probe_says_what_it_has_for_the_slot_engine(tmp_path, monkeypatch):
    """The real probe in the real serving environment (make serve-env): nvidia-pytriton's server, and which
    TensorRT and whether cuda-python are there. The CPU serving environment has neither; packages put on its
    path give their version (a `tensorrt` without a Runtime, as the bare meta-package, counts as none)."""
    try:
        python = server_mod.serve_python()
    except server_mod.ServeError as e:
        pytest.skip(str(e))
    import subprocess

    info = server_mod.triton_dist(python)
    assert Path(info["dist"], "bin", "tritonserver").is_file()
    ask = "import importlib.util as u; print(u.find_spec('tensorrt') is not None, u.find_spec('cuda') is not None)"
    found = subprocess.run([str(python), "-c", ask], capture_output=True, text=True, check=True).stdout.split()
    assert found == ["False", "False"]  # the CPU serving environment: the cases below are the stand-ins'
    assert (info["tensorrt"], info["cuda"]) == (None, False)
    (tmp_path / "tensorrt").mkdir()
    (tmp_path / "tensorrt" / "__init__.py").write_text("__version__ = '10.15.1'\nclass Runtime: pass\n")
    (tmp_path / "cuda" / "bindings").mkdir(parents=True)
    (tmp_path / "cuda" / "bindings" / "runtime.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    info = server_mod.triton_dist(python)
    assert (info["tensorrt"], info["cuda"]) == ("10.15.1", True)
    (tmp_path / "tensorrt" / "__init__.py").write_text("__version__ = '10.15.1'\n")  # no Runtime: not TensorRT
    assert server_mod.triton_dist(python)["tensorrt"] is None
