"""Shared fixtures, made once per session: the tiny model and its ONNX export; the "lively" tiny model,
whose output varies: andrea-tiny trained on the Python documentation, shipped in models/andrea-tiny-demo
(trained once by `andrea-export train-demo`; its folder's README says how), its KV-cache decoder graph
and a whole build folder of it; the tiny build with a stand-in slot engine (slot_build) and the stand-ins
that run it (stand_ins).

The trained weights are a file, not a training run: training's float rounding differs from CPU to CPU
(the same recipe reached held-out perplexity 343.8, 301.2 and 294.6 on three CPUs of this machine kind),
and a test that trained its own model would read figures that the CPU chose."""

import json
from pathlib import Path

import pytest
import torch

from andrea_export.config import ANDREA_TINY
from andrea_export.model.checkpoint import random_init

DEMO_DIR = Path(__file__).resolve().parents[1] / "models" / "andrea-tiny-demo"
# The lively prompt: the shipped demo's greedy continuation of it varies (lively_prompt checks that it does).
LIVELY_WORDS = "Create a new"


@pytest.fixture(scope="session")
def tiny_model():
    return random_init(ANDREA_TINY, seed=0, announce=False)


@pytest.fixture(scope="session")
def tiny_onnx(tiny_model, tmp_path_factory):
    from andrea_export.graphs.export import export_onnx

    return export_onnx(tiny_model, tmp_path_factory.mktemp("tiny") / "model.onnx", quiet=True)


@pytest.fixture(scope="session")
def demo_dir():
    """The shipped trained demo: tokenizer.json, model.safetensors, heldout.txt, train.json, loss.png."""
    pytest.importorskip("tokenizers", reason="the 'text' extra (Hugging Face tokenizers) reads the tokenizer")
    return DEMO_DIR


@pytest.fixture(scope="session")
def demo_log(demo_dir):
    return json.loads((demo_dir / "train.json").read_text())


@pytest.fixture(scope="session")
def lively_model(demo_dir):
    """andrea-tiny trained on real text (a GPT-2 init at tiny size only repeats the last token)."""
    from andrea_export.model.checkpoint import load_checkpoint

    return load_checkpoint(demo_dir / "model.safetensors")


@pytest.fixture(scope="session")
def lively_prompt(demo_dir, lively_model):
    """Token ids of words whose greedy continuation by the trained model varies: more than 10 distinct ids
    in 64 tokens (many prompts, random ids among them, fall into one repeated token), so that a runtime
    that decodes wrongly cannot agree with PyTorch by luck."""
    from andrea_export.model.text import encode, load_tokenizer

    ids = encode(load_tokenizer(demo_dir / "tokenizer.json"), LIVELY_WORDS)
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(64):
            seq.append(int(lively_model(torch.tensor([seq]))[0, -1].argmax()))
    distinct = len(set(seq[len(ids):]))
    assert distinct > 10, f"the demo's greedy continuation of {LIVELY_WORDS!r} has {distinct} distinct ids"
    return ids


@pytest.fixture(scope="session")
def lively_decoder(lively_model, tmp_path_factory):
    """decoder.onnx of the trained model, alone in its folder (a folder `runtime.load` accepts)."""
    from andrea_export.graphs.kvcache import export_decoder_onnx
    from andrea_export.names import DECODER_FILE

    return export_decoder_onnx(lively_model, tmp_path_factory.mktemp("decoder") / DECODER_FILE, quiet=True)


@pytest.fixture(scope="session")
def lively_build(lively_model, tmp_path_factory):
    """A real build folder of the lively model: its checkpoint in, TensorRT-RTX engines built on the CPU."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX (the 'rtx' extra) builds the engines on a CPU")
    from andrea_export.model.checkpoint import save_checkpoint
    from andrea_export.pipeline import BuildOptions, run_build

    ckpt = save_checkpoint(lively_model, tmp_path_factory.mktemp("ckpt") / "lively.safetensors")
    out = tmp_path_factory.mktemp("build") / "lively"
    run_build(BuildOptions(checkpoint=str(ckpt), builder="tensorrt-rtx", out=str(out), greedy_steps=4,
                           verify_shapes=[[1, 3]]))
    return out


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def _no_server_outlives_the_suite():
    """Fails the run if a tritonserver or Python-backend stub that this run started is alive at its end (a stub
    orphaned by a killed tritonserver once held its model's memory for good). This run's processes carry a mark
    in their environment, which every child inherits (serve, tritonserver, the stubs), so a server a person
    runs beside the suite is never taken for a leak. First set up, last torn down: after every server fixture."""
    import os
    import time
    import uuid

    from servers import MARK, kill, marked  # tests/ is on the path, as for trt_enums

    os.environ[MARK] = uuid.uuid4().hex
    yield
    deadline = time.monotonic() + 10  # a server stopped by the last test may still be exiting
    while (left := marked(os.environ[MARK])) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        kill(left)
        pytest.fail("processes started by the tests outlived them (killed now): "
                    + "; ".join(f"pid {pid} {name} (parent {ppid})" for pid, name, ppid in left), pytrace=False)


@pytest.fixture(scope="session")
def long_build(tmp_path_factory):
    """A random tiny model with a context of 2048 tokens, for the servers' tests: its long generations (about a
    second) outlast a client that leaves, a shutdown or a crash (the demo's 128-token context decodes in a blink)."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX (the 'rtx' extra) builds the engines on a CPU")
    import json

    from andrea_export.pipeline import BuildOptions, run_build

    d = tmp_path_factory.mktemp("long")
    (d / "long.json").write_text(json.dumps({"name": "andrea-long", "vocab_size": 8449, "n_positions": 2048,
                                             "n_embd": 64, "n_layer": 2, "n_head": 4}))
    run_build(BuildOptions(config=str(d / "long.json"), builder="tensorrt-rtx", out=str(d / "build"), greedy_steps=2,
                           verify_shapes=[[1, 3]]))
    return d / "build"


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory):
    """A finished tiny build folder (TensorRT-RTX engines, decoder included) and its manifest. Tests that
    change a build work on a copy (`shutil.copytree`)."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX (the 'rtx' extra) builds the engines on a CPU")
    from andrea_export.pipeline import BuildOptions, run_build

    out = tmp_path_factory.mktemp("build") / "tiny"
    opts = BuildOptions(config="andrea-tiny", builder="tensorrt-rtx", out=str(out), greedy_steps=4,
                        verify_shapes=[[1, 3], [2, 128]])
    return out, run_build(opts)


RUNTIME_TESTS = Path(__file__).resolve().parent / "runtime"  # fake_cuda.py: the strict CUDA and TensorRT stand-ins
SLOT_BUILD_TRT = "10.15.1"  # the stand-in TensorRT, and what "built" slot_build's slot engine
SLOT_BUILD_ROWS, SLOT_BUILD_CHUNK = 4, 16  # its profiles: decoding rows, a prompt's chunk


@pytest.fixture(scope="session")
def slot_build(tiny_build, tmp_path_factory):
    """A copy of the tiny build with a slot engine as `build --builder tensorrt --max-slots 4` records it: the
    two-group graph, a stand-in plan of it with the slot profiles, its sidecar, and the manifest's entries."""
    import shutil
    import sys

    import onnx
    import onnx_ir as ir

    from andrea_export.catalog import Role
    from andrea_export.folder.atomic import sha256_file

    sys.path.insert(0, str(RUNTIME_TESTS))
    try:
        from fake_cuda import COMPUTE_CAPABILITY, write_plan
    finally:
        sys.path.remove(str(RUNTIME_TESTS))
    from andrea_export.graphs.layout import read_kv_layout
    from andrea_export.graphs.slot_decoder import slot_profiles
    from andrea_export.graphs.two_groups import two_group_decoder

    folder = tmp_path_factory.mktemp("slot-build") / "tiny"
    shutil.copytree(tiny_build[0], folder)
    m = json.loads((folder / "manifest.json").read_text())
    one = folder / m["artifacts"][Role.DECODER_ONNX_SLOTS]["path"]
    two, plan = folder / "decoder.slots.two.onnx", folder / "decoder.slots.plan"
    ir.save(two_group_decoder(ir.from_proto(onnx.load(str(one)))), two)  # its weights inline
    write_plan(plan, two, slot_profiles(read_kv_layout(one), SLOT_BUILD_ROWS, SLOT_BUILD_CHUNK), trt_version=SLOT_BUILD_TRT)
    info = {"builder": "tensorrt", "builder_version": SLOT_BUILD_TRT, "plan_bytes": plan.stat().st_size,
            "plan_sha256": sha256_file(plan), "compute_capabilities": [COMPUTE_CAPABILITY]}
    plan.with_suffix(".plan.json").write_text(json.dumps(info))
    for role, f in ((Role.SLOT_ENGINE_ONNX, two), (Role.SLOT_ENGINE, plan), (Role.SLOT_ENGINE_INFO,
                                                                               plan.with_suffix(".plan.json"))):
        m["artifacts"][role] = {"path": f.name, "sha256": sha256_file(f), "bytes": f.stat().st_size}
    m["builder"].update(name="tensorrt", version=SLOT_BUILD_TRT)
    m["options"]["max_slots"] = SLOT_BUILD_ROWS
    (folder / "manifest.json").write_text(json.dumps(m))
    return folder


@pytest.fixture
def stand_ins(monkeypatch):
    """The runtime's CUDA and TensorRT, stand-ins for this test (each its own device)."""
    monkeypatch.syspath_prepend(str(RUNTIME_TESTS))
    from fake_cuda import FakeCudart, fake_tensorrt

    from andrea_export.runtime import trt as trt_backend

    cudart = FakeCudart()
    monkeypatch.setattr(trt_backend, "_cudart", lambda: cudart)
    monkeypatch.setattr(trt_backend, "_tensorrt", lambda: fake_tensorrt(cudart, version=SLOT_BUILD_TRT))
    return cudart


# The heavy tier (pyproject's `heavy` marker): the minute-scale tests that `make test-quick` (`pytest -m "not heavy"`)
# leaves out, so that the rest runs in under two minutes on 2 cores while one works. A test is heavy when it is
# marked `slow`, named below, in a file below, or uses a fixture below (directly or through another fixture): with
# those tests deselected the fixtures are never built, which is where their time goes. Each entry was measured
# (`pytest --durations`): seconds to a minute here.
HEAVY_FIXTURES = {  # (the file that defines it, its name): fixtures that build a folder or export a peer's model
    ("tests/conftest.py", "lively_build"),  # a checkpoint build with its decoder engine
    ("tests/conftest.py", "long_build"),  # the servers' tests' model with a long context
    ("tests/bench/test_bench.py", "run"),  # a whole benchmark run
    ("tests/test_pipeline.py", "demo_fp16_build"),
    ("tests/engine/test_onnx_rules.py", "tensorrt_graphs"),  # every graph of a precision, the plugin pass included
    ("tests/graphs/test_quantize.py", "quantized_build"),
    ("tests/test_hostile_inputs.py", "tiny_build_src"),
    ("tests/deploy/test_triton.py", "real_build"),
    ("tests/verify/test_verify_openvino.py", "folder"),
    ("tests/model/test_text.py", "split"),  # the whole corpus, read and split
    ("tests/bench/test_bench.py", "fp16_decoder"),  # a decoder export and its fp16 conversion
}
HEAVY_FILES = {  # real Triton servers, and the peer runtimes' own exports (OpenVINO, CTranslate2, Optimum)
    "tests/deploy/test_serve.py", "tests/deploy/test_supervision.py", "tests/bench/test_bench_serve.py",
    "tests/bench/test_bench_cpu_peers.py", "tests/bench/test_bench_peers.py", "tests/deploy/test_optimum.py",
}
HEAVY_TESTS = {  # node ids without their parameters
    "tests/model/test_text.py::test_train_demo_trains_a_model_far_below_the_unigram_baseline",
    "tests/runtime/test_runtime_trt_fake.py::test_close_lets_go_of_the_engine_and_a_forgotten_session_frees_its_memory",
    "tests/model/test_gpt2.py::test_save_pretrained_folder_builds_and_matches_hugging_face",
    "tests/test_pipeline.py::test_bf16_build_perplexity_within_one_percent",
    "tests/engine/test_slot_engine.py::test_a_build_with_max_slots_writes_the_slot_engine_and_its_graph",
    # each runs a build of its own (the tiny model, engines included), or the benchmark's command line
    "tests/test_pipeline.py::test_fp16_build_without_decoder",
    "tests/deploy/test_gguf.py::test_the_tokenizer_is_llama_cpps_gpt2_vocabulary",
    "tests/test_pipeline.py::test_failed_build_leaves_nothing",
    "tests/test_pipeline.py::test_force_replaces_a_build_and_removes_its_leftovers",
    "tests/test_pipeline.py::test_ctrl_c_mid_build_leaves_nothing",
    "tests/test_careless_inputs.py::test_ctrl_c_during_the_engine_build_is_an_interruption_not_a_failure",
    "tests/test_careless_inputs.py::test_out_on_a_read_only_or_full_file_system",
    "tests/bench/test_bench.py::test_cli_spin_reaches_every_ort_backend",
    "tests/verify/test_verify_openvino.py::test_a_cpu_without_bf16_verifies_openvino_in_f32_not_unverified",
    # a build killed in a subprocess, and the GPU host's scripts run whole in subprocesses
    "tests/test_crash_safety.py::test_kill_9_mid_build_then_a_rerun_cleans_up",
    "tests/plugin/test_gpu_scripts.py::test_gpu_checks_on_a_bare_host",
    "tests/plugin/test_gpu_scripts.py::test_kernel_lab_builds",
}


def is_heavy(item: pytest.Item, root: Path) -> bool:
    if item.get_closest_marker("slow") or item.nodeid.split("[")[0] in HEAVY_TESTS:
        return True
    if item.nodeid.split("::")[0] in HEAVY_FILES:
        return True
    info = getattr(item, "_fixtureinfo", None)  # every fixture the test needs, through other fixtures too
    for defs in (info.name2fixturedefs.values() if info else ()):
        for d in defs:
            where = Path(d.func.__code__.co_filename)
            if where.is_relative_to(root) and (where.relative_to(root).as_posix(), d.argname) in HEAVY_FIXTURES:
                return True
    return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_heavy(item, config.rootpath):
            item.add_marker(pytest.mark.heavy)
