"""The KV-cache decoder as a stateful Triton model. No Triton server runs here: the config is parsed back
with Triton's ModelConfig protobuf and checked against the decoder graph's I/O, and the protocol it
describes (implicit state fed from present to past, one zeroed masked slot at a sequence's start) is
replayed in ONNX Runtime on the packaged file and must decode like our runtime."""

import json
import os
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from andrea_export import runtime
from andrea_export.deploy.triton.common import parse_config
from andrea_export.deploy.triton.stateful import write_triton_decoder
from andrea_export.errors import PackageError
from andrea_export.graphs.kvcache import check_decoder_onnx

pb = pytest.importorskip("tritonclient.grpc.model_config_pb2")



@pytest.fixture(scope="module")
def packaged(lively_build, tmp_path_factory):
    model_dir = write_triton_decoder(lively_build, tmp_path_factory.mktemp("repo"))  # RTX engine: auto -> ONNX
    return model_dir, parse_config((model_dir / "config.pbtxt").read_text())


def _np_dtype(triton_type):
    return {"TYPE_FP32": np.float32, "TYPE_FP16": np.float16, "TYPE_INT64": np.int64}[pb.DataType.Name(triton_type)]


def test_config_names_exactly_the_decoder_io(packaged, lively_build):
    model_dir, cfg = packaged
    graph = model_dir / "1" / "model.onnx" / "model.onnx"  # Triton's multi-file form: the graph and its weights
    assert sorted(p.name for p in graph.parent.iterdir()) == ["model.onnx", "weights.fp32.data"]
    assert os.path.samefile(graph, lively_build / "decoder.onnx")  # a hard link; the weights a copy (onnx refuses links)
    assert (graph.parent / "weights.fp32.data").read_bytes() == (lively_build / "weights.fp32.data").read_bytes()
    layout = check_decoder_onnx(graph)
    m = onnx.load(str(graph), load_external_data=False)
    assert (cfg.name, cfg.platform, cfg.max_batch_size) == ("andrea-tiny-fp32-decoder-onnx", "onnxruntime_onnx", 1)
    seq = cfg.sequence_batching
    # the backend's rule: config inputs + control inputs + state inputs are all of the model's inputs
    assert not seq.control_input
    assert [i.name for i in cfg.input] + [s.input_name for s in seq.state] == [v.name for v in m.graph.input]
    assert [o.name for o in cfg.output] + [s.output_name for s in seq.state] == [v.name for v in m.graph.output]
    assert {s.output_name: s.input_name for s in seq.state} == layout.feedback  # present.i.* -> past_key_values.i.*
    assert [(i.name, pb.DataType.Name(i.data_type), list(i.dims)) for i in cfg.input] == [
        ("input_ids", "TYPE_INT64", [-1]), ("attention_mask", "TYPE_INT64", [-1])]
    assert [(o.name, pb.DataType.Name(o.data_type), list(o.dims)) for o in cfg.output] == [("logits", "TYPE_FP32", [-1, 8449])]
    for s in seq.state:
        assert (pb.DataType.Name(s.data_type), list(s.dims)) == ("TYPE_FP32", [layout.n_head, -1, layout.head_dim])
        (init,) = s.initial_state
        assert (init.zero_data, list(init.dims), init.data_type) == (True, [layout.n_head, 1, layout.head_dim], s.data_type)
    assert seq.max_sequence_idle_microseconds == 60_000_000
    assert cfg.parameters["andrea.artifact"].string_value == "decoder_onnx"


def _replay(model_dir, cfg, prompt, n, mask_slot=True):
    """What Triton does with this config, request by request: state inputs start as the initial state
    (batch 1 prepended), each request's state outputs become the next request's state inputs."""
    sess = ort.InferenceSession(str(model_dir / "1" / "model.onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    seq = cfg.sequence_batching
    state = {s.input_name: np.zeros([1, *s.initial_state[0].dims], _np_dtype(s.data_type)) for s in seq.state}
    real, new, out = 0, list(prompt), []
    for _ in range(n):
        real += len(new)
        mask = [0 if mask_slot else 1] + [1] * real
        feeds = {"input_ids": np.array([new], np.int64), "attention_mask": np.array([mask], np.int64), **state}
        names = ["logits"] + [s.output_name for s in seq.state]
        logits, *present = sess.run(names, feeds)
        state = {s.input_name: p for s, p in zip(seq.state, present)}
        new = [int(logits[0, -1].argmax())]
        out += new
    return out


def test_triton_protocol_replayed_in_onnxruntime_decodes_like_our_runtime(packaged, lively_build, lively_prompt):
    model_dir, cfg = packaged
    with runtime.load(lively_build, "onnxruntime") as sess:
        ours = sess.generate(lively_prompt, 64)
    assert len(set(ours)) > 10
    assert _replay(model_dir, cfg, lively_prompt, 64) == ours
    assert _replay(model_dir, cfg, lively_prompt, 64, mask_slot=False) != ours  # the slot must be masked: the check bites


def test_tensorrt_backend_uses_the_engine_profiles(lively_build, tmp_path):
    with pytest.raises(PackageError, match="decoder engine was built by TensorRT-RTX, which Triton's TensorRT backend"):
        write_triton_decoder(lively_build, tmp_path / "repo", backend="tensorrt")
    trt = tmp_path / "trt-build"  # the same folder as a full-TensorRT build would describe it
    shutil.copytree(lively_build, trt)
    m = json.loads((trt / "manifest.json").read_text())
    m["builder"]["name"] = "tensorrt"
    (trt / "manifest.json").write_text(json.dumps(m))
    model_dir = write_triton_decoder(trt, tmp_path / "repo", backend="tensorrt")
    text = (model_dir / "config.pbtxt").read_text()
    cfg = parse_config(text)
    assert (cfg.platform, list(cfg.instance_group[0].profile)) == ("tensorrt_plan", ["0", "1"])
    assert (model_dir / "1" / "model.plan").read_bytes() == (trt / "decoder.plan").read_bytes()
    assert "profile 0 (prefill): input_ids min [1, 1] max [1, 128]; past_key_values.0.key min [1, 4, 0, 16]" in text
    assert "one token per request" in text
    with pytest.raises(PackageError, match="GPUs only"):
        write_triton_decoder(trt, tmp_path / "repo2", backend="tensorrt", kind="cpu")


def test_package_cli_writes_both_models(lively_build, tmp_path):
    from andrea_export.cli import main

    result = CliRunner().invoke(main, ["package", str(lively_build), "--triton", str(tmp_path / "repo"), "--kind", "cpu"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["andrea-tiny-fp32-decoder-onnx",
                                                                      "andrea-tiny-fp32-generate", "andrea-tiny-fp32-onnx"]
    for model in ("andrea-tiny-fp32-decoder-onnx", "andrea-tiny-fp32-onnx"):  # each with its copy of the weights
        weights = tmp_path / "repo" / model / "1" / "model.onnx" / "weights.fp32.data"
        assert weights.read_bytes() == (lively_build / "weights.fp32.data").read_bytes()
    runtime.load(lively_build, "onnxruntime").close()  # the build folder is still readable (no linked weights)
    cfg = parse_config((tmp_path / "repo" / "andrea-tiny-fp32-decoder-onnx" / "config.pbtxt").read_text())
    assert cfg.instance_group[0].kind == pb.ModelInstanceGroup.KIND_CPU


def test_package_holds_the_build_lock_from_the_first_model_to_the_last(lively_build, tmp_path, monkeypatch):
    """A build replacing the folder between the two models would leave a repository that mixes two builds:
    when the decoder is written, the folder is still locked (a build's exclusive lock is refused)."""
    from andrea_export.cli import main
    from andrea_export.deploy import triton
    from andrea_export.errors import BuildError
    from andrea_export.folder.atomic import locked_folder

    real = triton.write_triton_decoder
    refused = []

    def write_decoder(build_dir, *args, **kwargs):
        try:
            with locked_folder(build_dir):  # what `build` takes before it replaces the folder
                pass
        except BuildError as e:
            refused.append(str(e))
        return real(build_dir, *args, **kwargs)

    monkeypatch.setattr(triton, "write_triton_decoder", write_decoder)  # what package() calls
    result = CliRunner().invoke(main, ["package", str(lively_build), "--triton", str(tmp_path / "repo"), "--kind", "cpu"])
    assert result.exit_code == 0, result.output
    assert len(refused) == 1 and "in use by another andrea-export run" in refused[0], refused


def test_build_without_decoder_is_refused(lively_build, tmp_path):
    build = tmp_path / "b"
    shutil.copytree(lively_build, build)
    m = json.loads((build / "manifest.json").read_text())
    del m["artifacts"]["decoder_onnx"]
    (build / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PackageError, match="no KV-cache decoder"):
        write_triton_decoder(build, tmp_path / "repo")


def test_a_weight_stripped_decoder_engine_is_never_served_by_tensorrt(lively_build, tmp_path):
    """Triton's TensorRT backend does not refit: `auto` serves the graph, and asking for the engine is refused."""
    trt = tmp_path / "stripped-build"
    shutil.copytree(lively_build, trt)
    m = json.loads((trt / "manifest.json").read_text())
    m["builder"].update(name="tensorrt", weights_stripped=True)
    (trt / "manifest.json").write_text(json.dumps(m))
    model_dir = write_triton_decoder(trt, tmp_path / "repo", backend="auto", kind="gpu")
    assert parse_config((model_dir / "config.pbtxt").read_text()).platform == "onnxruntime_onnx"
    with pytest.raises(PackageError, match="weight-stripped"):
        write_triton_decoder(trt, tmp_path / "repo2", backend="tensorrt", kind="gpu")


def test_package_without_kind_on_a_machine_without_a_gpu_packages_for_the_cpu_and_says_so(lively_build, tmp_path):
    from andrea_export.cli import main
    from andrea_export.errors import gpu_compute_capability

    if gpu_compute_capability() is not None:
        pytest.skip("this machine has a GPU: the default kind is gpu there")
    repo = tmp_path / "repo"
    result = CliRunner().invoke(main, ["package", str(lively_build), "--triton", str(repo)])
    assert result.exit_code == 0, result.output
    assert "no GPU on this machine" in " ".join(result.output.split()), result.output
    configs = [p.read_text() for p in repo.glob("*/config.pbtxt")]
    assert len(configs) == 3 and all("KIND_CPU" in c and "KIND_GPU" not in c for c in configs)  # generate: always CPU


def test_a_tensorrt_decoder_names_its_triton_releases_and_a_contradicting_release_is_refused(lively_build, tmp_path):
    """The stateful model's header and parameters carry the same pin as the stateless one; --triton-release
    is checked against the decoder plan's TensorRT before anything is written."""
    trt = tmp_path / "trt-build"
    shutil.copytree(lively_build, trt)
    m = json.loads((trt / "manifest.json").read_text())
    m["builder"].update(name="tensorrt", version="10.0.1.6")  # the plugin record says: not in the engine (RTX build)
    (trt / "manifest.json").write_text(json.dumps(m))
    model_dir = write_triton_decoder(trt, tmp_path / "repo", backend="tensorrt", triton_release="24.05")
    text = (model_dir / "config.pbtxt").read_text()
    assert "# Triton releases that ship TensorRT 10.0.1.6: 24.05 (nvcr.io/nvidia/tritonserver:<release>-py3)\n" in text
    assert "# GPU driver: no plugin PTX\n" in text
    assert ("# Packaged for Triton release 24.05 (nvcr.io/nvidia/tritonserver:24.05-py3), which ships TensorRT "
            "10.0.1.6.\n") in text
    params = {k: v.string_value for k, v in parse_config(text).parameters.items()}
    assert (params["andrea.tensorrt_version"], params["andrea.triton_releases"], params["andrea.driver_floor"],
            params["andrea.triton_release"]) == ("10.0.1.6", "24.05", "no plugin PTX", "24.05")

    m["builder"]["version"] = "10.99.0.1"
    (trt / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PackageError, match="by TensorRT 10.99.0.1, but Triton release 24.05 ships TensorRT 10.0.1.6"):
        write_triton_decoder(trt, tmp_path / "repo2", backend="tensorrt", triton_release="24.05")
    assert not (tmp_path / "repo2").exists()
