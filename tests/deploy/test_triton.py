"""Triton model repositories from build folders: layout, config.pbtxt parsed back into Triton's own
ModelConfig message, the packaged ONNX run by ONNX Runtime, and every refusal with its message.

There is no Triton server and no GPU here. The ONNX files are real (the tiny model's export); an
"engine" is a placeholder file, named as such, used only where the layout and the config are the
point: a plan's names, types and dims come from the manifest and the build's ONNX, never from the plan.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from google.protobuf import text_format
from onnx import TensorProto, helper

from andrea_export.config import ANDREA_TINY
from andrea_export.deploy.triton.common import parse_config
from andrea_export.deploy.triton.stateless import write_triton_repo
from andrea_export.errors import MissingDependency, PackageError
from andrea_export.graphs.layout import check_onnx

pb = pytest.importorskip("tritonclient.grpc.model_config_pb2")

PLACEHOLDER_ENGINE = b"PLACEHOLDER: not a TensorRT engine; for repository-layout tests only\n"
PROFILE = {"input_ids": {"min": [1, 1], "opt": [4, 64], "max": [16, 128]}}


def make_build(
    folder: Path,
    onnx_src: Path | None = None,
    *,
    engine: bool = False,
    builder: str = "tensorrt",
    profiles: list | None = None,
    status: str = "passed",
    precision: str = "fp32",
    model: dict | None = None,
    extra: dict | None = None,
) -> Path:
    """A build folder as the build writes it: manifest.json + the artifacts it lists."""
    folder.mkdir(parents=True, exist_ok=True)
    artifacts = {}

    def add(role: str, path: Path):
        data = path.read_bytes()
        artifacts[role] = {"path": path.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}

    if onnx_src is not None:
        for f in onnx_src.parent.iterdir():  # the .onnx and any external weight file beside it
            shutil.copyfile(f, folder / f.name)
            if f.name != onnx_src.name:  # the build records the weights files too (their sha256 is checked)
                add(f"weights_{f.name}", folder / f.name)
        add("onnx", folder / onnx_src.name)
    if engine:
        (folder / "engine-PLACEHOLDER.plan").write_bytes(PLACEHOLDER_ENGINE)
        add("engine", folder / "engine-PLACEHOLDER.plan")
    manifest = {
        "schema_version": 1,
        "tool": {"name": "andrea-export", "version": "0.1.0"},
        "model": model or ANDREA_TINY.to_dict(),
        "precision": precision,
        "status": status,
        "artifacts": artifacts,
        "builder": {"name": builder, "version": "10.13.3", "compute_capabilities": ["9.0"], "plugin_layers": 2},
        "profiles": [PROFILE] if profiles is None else profiles,
        "plugin": {"id": "andrea::TanhGelu", "version": "1", "calls": 2, "in_engine": True, "embedded": True},
    }
    manifest.update(extra or {})
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return folder


def read_config(model_dir: Path):
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), pb.ModelConfig())


@pytest.fixture(scope="module")
def onnx_only(tiny_onnx, tmp_path_factory):
    """The tiny export alone in a folder (make_build copies everything beside the .onnx)."""
    d = tmp_path_factory.mktemp("onnx_only")
    shutil.copyfile(tiny_onnx, d / "model.onnx")
    return d / "model.onnx"


@pytest.fixture(scope="module")
def onnx_external(tiny_onnx, tmp_path_factory):
    """The tiny export re-saved with its weights in a separate file, as large exports are."""
    d = tmp_path_factory.mktemp("onnx_external")
    m = onnx.load(str(tiny_onnx))
    onnx.save_model(m, str(d / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    return d / "model.onnx"


def _ids(batch=2, seq=7):
    return np.random.default_rng(0).integers(0, ANDREA_TINY.vocab_size, size=(batch, seq), dtype=np.int64)


# ------------------------------------------------------------------------------------------ ONNX Runtime


def test_onnxruntime_repo_layout_config_and_model_runs(tmp_path, onnx_only):
    build = make_build(tmp_path / "build", onnx_only)
    model_dir = write_triton_repo(build, tmp_path / "repo", backend="onnxruntime", kind="cpu", instances=2)

    assert model_dir == tmp_path / "repo" / "andrea-tiny-fp32-onnx"
    assert sorted(p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*")) == [
        "1", "1/model.onnx", "andrea-build.json", "config.pbtxt",
    ]
    text = (model_dir / "config.pbtxt").read_text()
    assert text.startswith("# Triton model configuration written by andrea-export")
    cfg = parse_config(text)  # the same parse Triton does (protobuf text format)
    assert cfg == read_config(model_dir)
    assert (cfg.name, cfg.platform, cfg.max_batch_size) == ("andrea-tiny-fp32-onnx", "onnxruntime_onnx", 16)
    assert [(i.name, pb.DataType.Name(i.data_type), list(i.dims)) for i in cfg.input] == [("input_ids", "TYPE_INT64", [-1])]
    assert [(o.name, pb.DataType.Name(o.data_type), list(o.dims)) for o in cfg.output] == [
        ("logits", "TYPE_FP32", [-1, ANDREA_TINY.vocab_size])
    ]
    assert cfg.HasField("dynamic_batching")
    assert list(cfg.dynamic_batching.preferred_batch_size) == []
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 0
    assert [(g.count, pb.ModelInstanceGroup.Kind.Name(g.kind), list(g.profile)) for g in cfg.instance_group] == [
        (2, "KIND_CPU", [])
    ]
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["andrea.precision"] == "fp32" and params["andrea.verification"] == "passed"
    assert params["andrea.sha256"] == hashlib.sha256(onnx_only.read_bytes()).hexdigest()
    assert "andrea.plugin" not in params
    assert json.loads((model_dir / "andrea-build.json").read_text()) == json.loads((build / "manifest.json").read_text())

    # what Triton's ONNX Runtime backend would load gives the build's numbers
    ids = _ids()
    served = ort.InferenceSession(str(model_dir / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    original = ort.InferenceSession(str(onnx_only), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(served.run(["logits"], {"input_ids": ids})[0], original.run(["logits"], {"input_ids": ids})[0])


def test_external_weights_go_into_a_model_onnx_folder(tmp_path, onnx_external):
    build = make_build(tmp_path / "build", onnx_external)
    model_dir = write_triton_repo(build, tmp_path / "repo", kind="cpu", name="tiny")
    version = model_dir / "1"
    assert sorted(p.relative_to(version).as_posix() for p in version.rglob("*")) == [
        "model.onnx", "model.onnx/model.onnx", "model.onnx/model.onnx.data",
    ]
    sess = ort.InferenceSession(str(version / "model.onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert sess.run(["logits"], {"input_ids": _ids(1, 5)})[0].shape == (1, 5, ANDREA_TINY.vocab_size)


def test_output_type_is_read_from_the_onnx_file(tmp_path):
    """An fp16-output graph (built by hand: a Gather from an fp16 table) gives TYPE_FP16."""
    vocab = 16
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["logits"])],
        "fp16_logits",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT16, ["batch", "seq", vocab])],
        [helper.make_tensor("table", TensorProto.FLOAT16, [vocab, vocab], np.eye(vocab, dtype=np.float16).tobytes(), raw=True)],
    )
    src = tmp_path / "src" / "model.onnx"
    src.parent.mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(src))
    model = {**ANDREA_TINY.to_dict(), "vocab_size": vocab}
    build = make_build(tmp_path / "build", src, precision="fp16", model=model, profiles=[])
    cfg = read_config(write_triton_repo(build, tmp_path / "repo", kind="cpu"))
    assert cfg.name == "andrea-tiny-fp16-onnx"
    assert cfg.max_batch_size == 8  # no profiles in the manifest: ONNX Runtime's default
    assert [(o.name, pb.DataType.Name(o.data_type), list(o.dims)) for o in cfg.output] == [("logits", "TYPE_FP16", [-1, vocab])]


def test_max_batch_size_zero_gives_full_shapes_and_no_batcher(tmp_path, onnx_only):
    build = make_build(tmp_path / "build", onnx_only)
    cfg = read_config(write_triton_repo(build, tmp_path / "repo", kind="cpu", max_batch_size=0))
    assert cfg.max_batch_size == 0
    assert list(cfg.input[0].dims) == [-1, -1]
    assert list(cfg.output[0].dims) == [-1, -1, ANDREA_TINY.vocab_size]
    assert not cfg.HasField("dynamic_batching")


# -------------------------------------------------------------------------------------------- TensorRT


def test_tensorrt_repo_layout_and_config(tmp_path, onnx_only):
    build = make_build(tmp_path / "build", onnx_only, engine=True)
    model_dir = write_triton_repo(build, tmp_path / "repo", max_queue_delay_us=100)  # auto -> the engine
    assert sorted(p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*")) == [
        "1", "1/model.plan", "andrea-build.json", "config.pbtxt",
    ]
    assert (model_dir / "1" / "model.plan").read_bytes() == PLACEHOLDER_ENGINE
    assert os.path.samefile(model_dir / "1" / "model.plan", build / "engine-PLACEHOLDER.plan")  # hard link
    cfg = read_config(model_dir)
    assert (cfg.name, cfg.platform, cfg.max_batch_size) == ("andrea-tiny-fp32-trt", "tensorrt_plan", 16)
    assert [(i.name, pb.DataType.Name(i.data_type), list(i.dims)) for i in cfg.input] == [("input_ids", "TYPE_INT64", [-1])]
    assert [(o.name, pb.DataType.Name(o.data_type), list(o.dims)) for o in cfg.output] == [
        ("logits", "TYPE_FP32", [-1, ANDREA_TINY.vocab_size])
    ]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 100
    assert [(g.count, pb.ModelInstanceGroup.Kind.Name(g.kind)) for g in cfg.instance_group] == [(1, "KIND_GPU")]
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["andrea.builder"] == "tensorrt 10.13.3"
    assert params["andrea.compute_capabilities"] == "9.0"
    assert params["andrea.plugin"] == "andrea::TanhGelu v1: AOT plugin, kernel embedded in the engine; no plugin library to load"
    text = (model_dir / "config.pbtxt").read_text()
    assert "# TensorRT plan built by tensorrt 10.13.3 for compute capability 9.0" in text
    assert "# optimization profile 0: input_ids min [1, 1] opt [4, 64] max [16, 128]" in text


@pytest.mark.parametrize("plugin", [None, {"id": "andrea::TanhGelu", "version": "1", "calls": 2, "in_engine": False, "embedded": False}])
def test_engine_without_plugin_says_nothing_to_load(tmp_path, onnx_only, plugin):
    build = make_build(tmp_path / "build", onnx_only, engine=True, extra={"plugin": plugin}, status="engine-unverified")
    model_dir = write_triton_repo(build, tmp_path / "repo", backend="tensorrt", max_batch_size=4, hardlink=False)
    assert not os.path.samefile(model_dir / "1" / "model.plan", build / "engine-PLACEHOLDER.plan")  # a copy
    cfg = read_config(model_dir)
    assert cfg.parameters["andrea.plugin"].string_value == "none: native TensorRT GELU layers, nothing to load"
    assert cfg.parameters["andrea.verification"].string_value == "engine-unverified"
    assert cfg.max_batch_size == 4


def test_several_profiles_become_preferred_sizes_and_instance_profiles(tmp_path, onnx_only):
    profiles = [
        {"input_ids": {"min": [1, 1], "opt": [1, 64], "max": [4, 128]}},
        {"input_ids": {"min": [1, 1], "opt": [16, 64], "max": [32, 128]}},
    ]
    build = make_build(tmp_path / "build", onnx_only, engine=True, profiles=profiles)
    cfg = read_config(write_triton_repo(build, tmp_path / "repo", instances=2))
    assert cfg.max_batch_size == 32
    assert list(cfg.dynamic_batching.preferred_batch_size) == [4, 32]
    assert [(g.count, list(g.profile)) for g in cfg.instance_group] == [(2, ["0", "1"])]


def test_auto_serves_onnx_for_tensorrt_rtx_engines_and_cpu(tmp_path, onnx_only):
    rtx = make_build(tmp_path / "rtx", onnx_only, engine=True, builder="tensorrt-rtx")
    assert read_config(write_triton_repo(rtx, tmp_path / "repo")).platform == "onnxruntime_onnx"
    trt = make_build(tmp_path / "trt", onnx_only, engine=True)
    cfg = read_config(write_triton_repo(trt, tmp_path / "repo", kind="cpu", name="cpu"))
    assert (cfg.platform, pb.ModelInstanceGroup.Kind.Name(cfg.instance_group[0].kind)) == ("onnxruntime_onnx", "KIND_CPU")


# --------------------------------------------------------------- the TensorRT version pin and the driver floor

PTX = {"arch": "sm_80", "ptx_isa": "9.0", "driver_floor": "R580 (CUDA 13.0) or newer"}  # pipeline._plugin_info's
MATRIX = "https://docs.nvidia.com/deeplearning/frameworks/support-matrix/index.html"


def pinned_build(folder: Path, onnx_src: Path, version: str, plugin: dict | None = None) -> Path:
    """A TensorRT build made by TensorRT `version`, its plugin's PTX record as the pipeline writes it."""
    builder = {"name": "tensorrt", "version": version, "compute_capabilities": ["9.0"], "plugin_layers": 2}
    plugin = plugin or {"id": "andrea::TanhGelu", "version": "1", "calls": 2, "in_engine": True, "embedded": True,
                        "kernel": PTX}
    return make_build(folder, onnx_src, engine=True, extra={"builder": builder, "plugin": plugin})


def listing(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def test_tensorrt_config_names_its_tensorrt_version_triton_releases_and_driver_floor(tmp_path, onnx_only):
    model_dir = write_triton_repo(pinned_build(tmp_path / "build", onnx_only, "10.0.1.6"), tmp_path / "repo")
    params = {k: v.string_value for k, v in read_config(model_dir).parameters.items()}
    assert params["andrea.tensorrt_version"] == "10.0.1.6"
    assert params["andrea.triton_releases"] == "24.05"
    assert params["andrea.driver_floor"] == "R580 (CUDA 13.0) or newer (plugin PTX ISA 9.0)"
    assert "andrea.triton_release" not in params  # not asked for
    text = (model_dir / "config.pbtxt").read_text()
    assert "# Triton releases that ship TensorRT 10.0.1.6: 24.05 (nvcr.io/nvidia/tritonserver:<release>-py3)\n" in text
    assert "# GPU driver: R580 (CUDA 13.0) or newer (plugin PTX ISA 9.0)\n" in text


def test_an_unknown_tensorrt_version_and_a_missing_ptx_record_are_said_not_guessed(tmp_path, onnx_only):
    no_ptx = {"id": "andrea::TanhGelu", "version": "1", "calls": 2, "in_engine": True, "embedded": True}
    build = pinned_build(tmp_path / "build", onnx_only, "10.99.0.1", plugin=no_ptx)
    model_dir = write_triton_repo(build, tmp_path / "repo")
    params = {k: v.string_value for k, v in read_config(model_dir).parameters.items()}
    unknown = f"no Triton release known to ship TensorRT 10.99.0.1: check NVIDIA's support matrix ({MATRIX})"
    assert params["andrea.triton_releases"] == unknown
    assert params["andrea.driver_floor"] == "unknown: the build recorded no driver floor for the plugin's PTX"
    assert f"# {unknown}\n" in (model_dir / "config.pbtxt").read_text()

    native = make_build(tmp_path / "native", onnx_only, engine=True, extra={"plugin": None})  # native GELU layers
    cfg = read_config(write_triton_repo(native, tmp_path / "repo2"))
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["andrea.driver_floor"] == "no plugin PTX"


def test_tensorrt_versions_match_to_the_precision_both_give():
    from andrea_export.deploy.triton.common import same_tensorrt

    assert same_tensorrt("10.0.1.6", "10.0.1.6") and same_tensorrt("10.0.1", "10.0.1.6")
    assert not same_tensorrt("10.0.1.5", "10.0.1.6")  # the build number counts when both give one
    assert not same_tensorrt("10.0", "10.0.1.6") and not same_tensorrt("unknown", "10.0.1.6")


def test_a_triton_release_shipping_another_tensorrt_is_refused_and_nothing_is_written(tmp_path, onnx_only, monkeypatch):
    from andrea_export.deploy.triton import common, package

    build = pinned_build(tmp_path / "build", onnx_only, "10.99.0.1")
    repo = tmp_path / "repo"
    (repo / "other" / "1").mkdir(parents=True)
    (repo / "other" / "config.pbtxt").write_text('name: "other"\n')
    before = listing(repo)
    with pytest.raises(PackageError) as e:
        write_triton_repo(build, repo, triton_release="24.05")
    assert str(e.value) == (
        f"{build}: the TensorRT plan was built by TensorRT 10.99.0.1, but Triton release 24.05 ships TensorRT "
        f"10.0.1.6, which cannot load it; no Triton release known to ship TensorRT 10.99.0.1: check NVIDIA's "
        f"support matrix ({MATRIX}). Package for a release that ships 10.99.0.1, or rebuild the engine with "
        "TensorRT 10.0.1.6"
    )
    fictional = {"24.05": "10.0.1.6", "99.01": "10.99.0.1", "99.02": "10.99.0"}  # 99.02: three parts match three
    monkeypatch.setattr(common, "TRITON_RELEASE_TENSORRT", fictional)
    with pytest.raises(PackageError, match=r"releases that ship TensorRT 10\.99\.0\.1: 99\.01, 99\.02\. Package for"):
        package(build, repo, triton_release="24.05", kind="gpu")
    assert listing(repo) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build", "repo"]  # no staging folder left beside it


def test_an_unknown_triton_release_is_recorded_as_not_checked_and_a_malformed_one_refused(tmp_path, onnx_only):
    """A release whose TensorRT this toolkit does not know contradicts nothing: the plan is packaged, and its config
    says plainly that the release was not checked (the table holds confirmed releases only)."""
    build = pinned_build(tmp_path / "build", onnx_only, "10.0.1.6")
    with pytest.raises(PackageError, match=r"a Triton release is written YY\.MM \(e\.g\. 24\.05\), got 'latest'"):
        write_triton_repo(build, tmp_path / "repo", triton_release="latest")
    assert not (tmp_path / "repo").exists()
    model = write_triton_repo(build, tmp_path / "repo", triton_release="25.13")
    config = (model / "config.pbtxt").read_text()
    assert "Packaged for Triton release 25.13 (nvcr.io/nvidia/tritonserver:25.13-py3): NOT checked" in config
    assert f"NVIDIA's support matrix: {MATRIX}" in config


def test_a_matching_triton_release_is_accepted_and_recorded(tmp_path, onnx_only):
    model_dir = write_triton_repo(pinned_build(tmp_path / "build", onnx_only, "10.0.1.6"), tmp_path / "repo",
                                  triton_release="24.05")
    assert read_config(model_dir).parameters["andrea.triton_release"].string_value == "24.05"
    assert ("# Packaged for Triton release 24.05 (nvcr.io/nvidia/tritonserver:24.05-py3), which ships TensorRT "
            "10.0.1.6.\n") in (model_dir / "config.pbtxt").read_text()


def test_an_onnxruntime_model_records_the_triton_release_with_nothing_to_contradict(tmp_path, onnx_only):
    build = pinned_build(tmp_path / "build", onnx_only, "10.99.0.1")  # the engine's TensorRT: no concern of ORT
    model_dir = write_triton_repo(build, tmp_path / "repo", backend="onnxruntime", kind="cpu", triton_release="99.12")
    params = {k: v.string_value for k, v in read_config(model_dir).parameters.items()}
    assert params["andrea.triton_release"] == "99.12"
    assert "andrea.triton_releases" not in params and "andrea.driver_floor" not in params
    text = (model_dir / "config.pbtxt").read_text()
    assert "# Packaged for Triton release 99.12 (nvcr.io/nvidia/tritonserver:99.12-py3).\n" in text


def test_package_cli_takes_triton_release_and_prints_the_pin(tmp_path, onnx_only):
    from click.testing import CliRunner

    from andrea_export.cli import main

    build = pinned_build(tmp_path / "build", onnx_only, "10.0.1.6")
    r = CliRunner().invoke(main, ["package", str(build), "--triton", str(tmp_path / "repo"), "--kind", "gpu",
                                  "--triton-release", "24.05"])
    assert r.exit_code == 0, r.output
    cfg = read_config(tmp_path / "repo" / "andrea-tiny-fp32-trt")
    assert cfg.parameters["andrea.triton_release"].string_value == "24.05"
    assert ("andrea-tiny-fp32-trt: TensorRT 10.0.1.6 plan; Triton releases that ship it: 24.05; GPU driver: R580 "
            "(CUDA 13.0) or newer (plugin PTX ISA 9.0)") in " ".join(r.output.split())

    other = pinned_build(tmp_path / "other", onnx_only, "10.99.0.1")
    r = CliRunner().invoke(main, ["package", str(other), "--triton", str(tmp_path / "repo2"), "--kind", "gpu",
                                  "--triton-release", "24.05"])
    said = " ".join(r.output.split())
    assert r.exit_code == 1 and "but Triton release 24.05 ships TensorRT 10.0.1.6" in said, r.output
    assert "Traceback" not in r.output and not (tmp_path / "repo2").exists()


# ------------------------------------------------------------------------------------------- refusals


def test_folder_without_manifest(tmp_path):
    (tmp_path / "build").mkdir()
    with pytest.raises(PackageError) as e:
        write_triton_repo(tmp_path / "build", tmp_path / "repo")
    assert str(e.value) == f"{tmp_path / 'build'}: no manifest.json; not an andrea-export build folder (make one with `andrea-export build`)"
    assert not (tmp_path / "repo").exists()


def test_manifest_without_the_artifact_the_backend_needs(tmp_path, onnx_only):
    build = make_build(tmp_path / "build", onnx_only)
    with pytest.raises(PackageError) as e:
        write_triton_repo(build, tmp_path / "repo", backend="tensorrt")
    assert str(e.value) == f"{build / 'manifest.json'}: no 'engine' artifact, which backend 'tensorrt' needs; artifacts: onnx"

    engine_only = make_build(tmp_path / "engine_only", engine=True)
    with pytest.raises(PackageError) as e:
        write_triton_repo(engine_only, tmp_path / "repo", backend="onnxruntime")
    assert str(e.value) == f"{engine_only / 'manifest.json'}: no 'onnx' artifact, which backend 'onnxruntime' needs; artifacts: engine"
    with pytest.raises(PackageError) as e:  # the engine's I/O types come from the build's ONNX
        write_triton_repo(engine_only, tmp_path / "repo")
    assert str(e.value) == (
        f"{engine_only / 'manifest.json'}: the engine's input/output types are read from the build's ONNX file, "
        "but it lists neither 'onnx' nor 'onnx_plugin'"
    )


def test_kv_cache_decoder_is_refused_with_a_reason(tmp_path, onnx_only):
    build = make_build(tmp_path / "build", onnx_only)
    manifest = json.loads((build / "manifest.json").read_text())
    manifest["artifacts"] = {"decoder_onnx": manifest["artifacts"]["onnx"]}
    (build / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageError) as e:
        write_triton_repo(build, tmp_path / "repo")
    assert str(e.value) == (
        f"{build}: the build has only a KV-cache decoder ('decoder_onnx') for this backend; package it as a "
        "stateful model with andrea_export.deploy.triton.write_triton_decoder, or package a build with the "
        "full-sequence 'onnx' or 'engine' artifact"
    )


def test_tensorrt_backend_refuses_rtx_engines_and_cpu_instances(tmp_path, onnx_only):
    rtx = make_build(tmp_path / "rtx", onnx_only, engine=True, builder="tensorrt-rtx")
    with pytest.raises(PackageError) as e:
        write_triton_repo(rtx, tmp_path / "repo", backend="tensorrt")
    assert str(e.value) == (
        f"{rtx}: the engine was built by TensorRT-RTX, which Triton's TensorRT backend (libnvinfer) cannot load; "
        "serve the ONNX file with backend='onnxruntime' (--backend onnxruntime) instead"
    )
    with pytest.raises(PackageError) as e:
        write_triton_repo(rtx, tmp_path / "repo", backend="tensorrt", kind="cpu")
    assert str(e.value) == "a TensorRT engine runs on GPUs only: use kind='gpu' (--kind gpu) or backend='onnxruntime'"


def test_existing_model_folder_is_refused_unless_overwrite(tmp_path, onnx_only):
    build = make_build(tmp_path / "build", onnx_only, engine=True)
    repo = tmp_path / "repo"
    (repo / "m" / "7").mkdir(parents=True)
    (repo / "m" / "7" / "model.plan").write_bytes(b"someone else's model")
    with pytest.raises(PackageError) as e:
        write_triton_repo(build, repo, name="m")
    assert str(e.value) == f"{repo / 'm'} already exists and is not empty; replace it with --overwrite (overwrite=True from Python)"
    assert (repo / "m" / "7" / "model.plan").read_bytes() == b"someone else's model"

    write_triton_repo(build, repo, name="m", overwrite=True)
    assert sorted(p.name for p in (repo / "m").iterdir()) == ["1", "andrea-build.json", "config.pbtxt"]
    assert sorted(p.name for p in repo.iterdir()) == ["m"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]

    (repo / "empty").mkdir()  # an empty folder is simply filled
    assert read_config(write_triton_repo(build, repo, name="empty")).name == "empty"


def test_max_batch_size_beyond_the_engine_profile(tmp_path, onnx_only):
    build = make_build(tmp_path / "build", onnx_only, engine=True)
    with pytest.raises(PackageError) as e:
        write_triton_repo(build, tmp_path / "repo", max_batch_size=17)
    assert str(e.value) == (
        "max_batch_size 17 is larger than the engine's optimization profiles allow (largest batch 16); Triton would "
        "refuse to load the model. Use max_batch_size <= 16 or rebuild the engine with a larger maximum batch"
    )
    # ONNX Runtime has no such limit
    assert read_config(write_triton_repo(build, tmp_path / "repo", backend="onnxruntime", max_batch_size=64)).max_batch_size == 64


def test_changed_artifact_failed_build_and_bad_arguments(tmp_path, onnx_only):
    build = make_build(tmp_path / "build", onnx_only, engine=True)
    (build / "engine-PLACEHOLDER.plan").write_bytes(PLACEHOLDER_ENGINE.upper())
    with pytest.raises(PackageError) as e:
        write_triton_repo(build, tmp_path / "repo")
    assert str(e.value) == f"{build / 'engine-PLACEHOLDER.plan'}: sha256 differs from the manifest's: the file changed after the build"

    failed = make_build(tmp_path / "failed", onnx_only, status="failed")
    with pytest.raises(PackageError) as e:
        write_triton_repo(failed, tmp_path / "repo")
    assert str(e.value) == (
        f"{failed}: this build failed verification (manifest status 'failed'); refusing to package it for serving. "
        "Fix the build, or package it anyway with --allow-failed (allow_failed=True from Python)"
    )
    assert read_config(write_triton_repo(failed, tmp_path / "repo", kind="cpu", allow_failed=True)).parameters[
        "andrea.verification"
    ].string_value == "failed"

    for kwargs, message in [
        ({"backend": "tensorflow"}, "unknown backend 'tensorflow'; choose one of: auto, tensorrt, onnxruntime"),
        ({"kind": "tpu"}, "unknown instance kind 'tpu'; choose one of: gpu, cpu"),
        ({"instances": 0}, "instances must be a positive integer, got 0"),
        ({"max_batch_size": -1}, "max_batch_size must be an integer >= 0, got -1"),
        ({"name": "../x"}, "a Triton model name must be 1-128 letters, digits, '_', '-' or '.', starting with a letter or digit (it names a folder), got '../x'"),
        ({"preferred_batch_sizes": [4, 32]}, "preferred batch size 32 is outside 1..max_batch_size (16)"),
    ]:
        with pytest.raises(PackageError) as e:
            write_triton_repo(failed, tmp_path / "repo2", **{"kind": "cpu", "allow_failed": True, **kwargs})
        assert str(e.value) == message
    assert not (tmp_path / "repo2").exists() or not any((tmp_path / "repo2").iterdir())


def test_a_failed_write_leaves_nothing_behind(tmp_path, onnx_only, monkeypatch):
    from andrea_export.deploy.triton import common

    build = make_build(tmp_path / "build", onnx_only)

    def broken(src, dst, hardlink):
        dst.write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(common, "place_file", broken)
    with pytest.raises(OSError, match="disk full"):
        write_triton_repo(build, tmp_path / "repo", kind="cpu")
    assert list((tmp_path / "repo").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build", "repo"]  # no staging folder beside it


def test_missing_tritonclient_names_the_extra(tmp_path, onnx_only, monkeypatch):
    build = make_build(tmp_path / "build", onnx_only)
    monkeypatch.setitem(sys.modules, "tritonclient.grpc.model_config_pb2", None)  # import now fails
    with pytest.raises(MissingDependency, match=r"pip install 'andrea-export\[triton\]'"):
        write_triton_repo(build, tmp_path / "repo", kind="cpu")


# ------------------------------------------------------------------- a real build folder (the writer's)


@pytest.fixture(scope="module")
def real_build(tmp_path_factory):
    """A build folder made by the pipeline itself (TensorRT-RTX builds the engine on the CPU)."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX (the 'rtx' extra) builds the engines on a CPU")
    from andrea_export.pipeline import BuildOptions, run_build

    out = tmp_path_factory.mktemp("real") / "tiny"
    run_build(BuildOptions(config="andrea-tiny", builder="tensorrt-rtx", out=str(out), greedy_steps=2, verify_shapes=[[1, 3]]))
    return out


def test_a_real_build_folder_is_packaged(real_build, tmp_path):
    model_dir = write_triton_repo(real_build, tmp_path / "repo")  # a TensorRT-RTX engine: auto serves the ONNX
    cfg = read_config(model_dir)
    assert (cfg.name, cfg.platform, cfg.max_batch_size) == ("andrea-tiny-fp32-onnx", "onnxruntime_onnx", 8)
    assert [(o.name, pb.DataType.Name(o.data_type), list(o.dims)) for o in cfg.output] == [
        ("logits", "TYPE_FP32", [-1, ANDREA_TINY.vocab_size])
    ]
    # the build's graphs share one weights file: Triton's multi-file form. The graph is a hard link; the
    # weights file a copy: onnx.load and onnx-ir refuse external data with several hard links (a guard against
    # hard-link attacks), so a link would leave the build folder (and the package) unreadable to them
    version = model_dir / "1"
    assert sorted(p.relative_to(version).as_posix() for p in version.rglob("*")) == [
        "model.onnx", "model.onnx/model.onnx", "model.onnx/weights.fp32.data",
    ]
    assert os.path.samefile(version / "model.onnx" / "model.onnx", real_build / "model.onnx")
    weights = version / "model.onnx" / "weights.fp32.data"
    assert weights.read_bytes() == (real_build / "weights.fp32.data").read_bytes()
    assert os.stat(real_build / "weights.fp32.data").st_nlink == 1
    for graph in (real_build / "model.onnx", real_build / "decoder.onnx", version / "model.onnx" / "model.onnx"):
        onnx.load(str(graph))  # weights included
        check_onnx(graph)
    sess = ort.InferenceSession(str(version / "model.onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = _ids(2, 4)
    original = ort.InferenceSession(str(real_build / "model.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(sess.run(["logits"], {"input_ids": ids})[0], original.run(["logits"], {"input_ids": ids})[0])
    with pytest.raises(PackageError, match="the engine was built by TensorRT-RTX"):
        write_triton_repo(real_build, tmp_path / "repo", backend="tensorrt")
