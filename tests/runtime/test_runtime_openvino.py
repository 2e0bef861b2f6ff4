"""The OpenVINO backend (runtime/openvino.py) on the lively tiny model's decoder.onnx: the same Session
contract as ONNX Runtime, in f32 (tokens equal ONNX Runtime's) and in bf16 where the CPU has it (logits
near PyTorch's; bf16 rounding measured, not assumed)."""

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("openvino", reason="OpenVINO (the 'openvino' extra) is not installed")

from andrea_export import runtime  # noqa: E402
from andrea_export.cli import main  # noqa: E402
from andrea_export.errors import AndreaExportError, InputError  # noqa: E402
from andrea_export.runtime.openvino import cpu_has_bf16  # noqa: E402


@pytest.fixture(scope="module")
def ov_f32(build_dir):
    return runtime.load(build_dir, backend="openvino", inference_precision="f32", intra_op_threads=2)


@pytest.fixture(scope="module")
def prompt(lively_prompt):
    return list(lively_prompt)


def test_f32_forward_matches_pytorch_and_reports_its_precision(ov_f32, lively_model, prompt):
    assert ov_f32.backend == "openvino" and ov_f32.inference_precision == "f32"
    logits = ov_f32.forward(prompt)
    with torch.inference_mode():
        ref = lively_model(torch.tensor([prompt]))[0].numpy()
    assert logits.shape == ref.shape and logits.dtype == np.float32
    np.testing.assert_allclose(logits, ref, atol=2e-4, rtol=1e-4)


def test_f32_tokens_equal_onnx_runtime_greedy_and_seeded(ov_f32, session, prompt):
    assert ov_f32.generate(prompt, 48) == session.generate(prompt, 48)
    kw = dict(strategy="top-p", top_p=0.9, temperature=1.2, seed=7)
    assert ov_f32.generate(prompt, 32, **kw) == session.generate(prompt, 32, **kw)


def test_a_left_padded_batch_gives_each_prompt_its_own_tokens(ov_f32, prompt):
    prompts = [prompt, prompt[:2], prompt + [5, 9, 11]]
    batch = ov_f32.generate(prompts, [12, 20, 6])
    assert batch == [ov_f32.generate(p, n) for p, n in zip(prompts, [12, 20, 6])]


def test_stepwise_decode_through_the_state_equals_one_prefill(ov_f32, prompt):
    ids = (prompt * 8)[:24]
    np.testing.assert_allclose(ov_f32.forward_stepwise(ids, 3), ov_f32.forward(ids), atol=1e-4)


def test_calls_from_threads_keep_their_own_cache(ov_f32, prompt):
    from concurrent.futures import ThreadPoolExecutor

    want = {n: ov_f32.generate(prompt[:n], 16) for n in (1, 2, len(prompt))}
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda n: (n, ov_f32.generate(prompt[:n], 16)), [1, 2, len(prompt)] * 3))
    assert all(tokens == want[n] for n, tokens in got)


@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no bf16 instructions (OpenVINO reports no BF16)")
def test_bf16_default_on_a_bf16_cpu_is_close_but_not_bit_equal(build_dir, lively_model, prompt):
    sess = runtime.load(build_dir, backend="openvino", intra_op_threads=2)
    assert sess.inference_precision == "bf16"
    ids = (prompt * 16)[:48]
    with torch.inference_mode():
        ref = torch.log_softmax(lively_model(torch.tensor([ids]))[0], -1).numpy()
    got = torch.log_softmax(torch.from_numpy(sess.forward(ids)), -1).numpy()
    err = np.abs(got - ref).max()
    assert 1e-4 < err < 0.5, f"bf16 max |log p error| {err}: 0 would mean it did not compute in bf16"
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_refusals(build_dir, tmp_path):
    with pytest.raises(InputError, match="inference_precision"):
        runtime.load(build_dir, backend="openvino", inference_precision="fp8")
    with pytest.raises(InputError, match="OpenVINO setting"):
        runtime.load(build_dir, backend="onnxruntime", inference_precision="f32")
    bad = tmp_path / "decoder.onnx"
    bad.write_bytes(b"not an onnx file")
    with pytest.raises(AndreaExportError, match="decoder.onnx"):
        runtime.load(bad, backend="openvino")
    closed = runtime.load(build_dir, backend="openvino", inference_precision="f32")
    closed.close()
    with pytest.raises(InputError, match="closed"):
        closed.forward([1, 2])


def _runtime_layers(sess) -> dict:
    from collections import Counter

    return Counter(op.get_rt_info()["layerType"].astype(str) for op in sess.compiled.get_runtime_model().get_ordered_ops())


def test_attention_and_its_cache_are_fused_and_compute_what_the_graph_does(build_dir, ov_f32, prompt, lively_model):
    from andrea_export.runtime.openvino import OpenVinoSession

    layers = _runtime_layers(ov_f32)
    assert ov_f32.fused and layers["ScaledDotProductAttention"] == lively_model.cfg.n_layer
    assert layers["Softmax"] == 0 and layers["MatMul"] == 0  # attention's ops are all in the fused node
    assert ov_f32.kv_cache_precision == "f32"  # f32 inference keeps the cache in f32 too
    plain = OpenVinoSession(build_dir / "decoder.onnx", ov_f32.cfg, ov_f32.layout, inference_precision="f32", fuse=False)
    assert not plain.fused and plain.kv_cache_precision is None and _runtime_layers(plain)["Softmax"] > 0
    ids = (prompt * 8)[:40]
    np.testing.assert_allclose(ov_f32.forward_stepwise(ids, 5), plain.forward_stepwise(ids, 5), atol=1e-4, rtol=1e-4)


def test_fusion_is_all_layers_or_none(build_dir, lively_model):
    import openvino as ov
    import openvino.opset13 as ops

    from andrea_export.graphs.layout import kv_layout
    from andrea_export.runtime.openvino import fuse_attention

    model = ov.Core().read_model(build_dir / "decoder.onnx")
    softmax = next(op for op in model.get_ordered_ops() if op.get_type_name() == "Softmax")
    scores = softmax.input_value(0)  # one layer's attention in another form: its scores times one
    softmax.input(0).replace_source_output(ops.multiply(scores, ops.constant(np.float32(1))).output(0))
    before = sorted(op.get_type_name() for op in model.get_ordered_ops())
    assert not fuse_attention(model, kv_layout(lively_model.cfg))
    assert sorted(op.get_type_name() for op in model.get_ordered_ops()) == before  # no layer was rewritten


@pytest.mark.parametrize("change", ["axis", "order", "not-a-past"])
def test_fusion_refuses_a_cache_that_is_not_the_past_concatenated_along_the_sequence(build_dir, lively_model, change):
    """The rewrite reads each past through a Gather and hands keys and values to ScaledDotProductAttention as
    the sequence: a layer whose key Concat joins along another axis, puts this step's keys first, or does not
    read a past input at all would be fused into other arithmetic (no error, other tokens), so it is refused
    and the graph left as it was."""
    import openvino as ov
    import openvino.opset13 as ops

    from andrea_export.graphs.layout import kv_layout
    from andrea_export.runtime.openvino import fuse_attention

    model = ov.Core().read_model(build_dir / "decoder.onnx")
    concat = next(op for op in model.get_ordered_ops() if op.get_type_name() == "Concat"
                  and op.input_value(0).get_node().get_type_name() == "Parameter")  # layer 0's past keys joined
    past, new = concat.input_value(0), concat.input_value(1)
    other = {"axis": lambda: ops.concat([past, new], 1), "order": lambda: ops.concat([new, past], 2),
             "not-a-past": lambda: ops.concat([ops.multiply(past, ops.constant(np.float32(1))), new], 2)}[change]()
    for target in list(concat.output(0).get_target_inputs()):
        target.replace_source_output(other.output(0))
    before = sorted(op.get_type_name() for op in model.get_ordered_ops())
    assert not fuse_attention(model, kv_layout(lively_model.cfg))
    assert sorted(op.get_type_name() for op in model.get_ordered_ops()) == before


@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no bf16 instructions (OpenVINO reports no BF16)")
def test_the_default_keeps_openvinos_cache_precision(build_dir):
    import openvino as ov

    sess = runtime.load(build_dir, backend="openvino", intra_op_threads=2)
    plugin_default = ov.Core().get_property("CPU", "KV_CACHE_PRECISION").get_type_name()  # u8 on x86 (2026.4)
    assert sess.fused and sess.kv_cache_precision == plugin_default
    bf16 = runtime.load(build_dir, backend="openvino", intra_op_threads=2, kv_cache_precision="bf16")
    assert bf16.kv_cache_precision == "bf16"
    with pytest.raises(InputError, match="kv_cache_precision"):
        runtime.load(build_dir, backend="openvino", kv_cache_precision="i4")


def test_generate_takes_openvino_only_where_the_build_measured_it_faster_in_bf16(tiny_build, tmp_path):
    """The build races OpenVINO against ONNX Runtime's decode (manifest "cpu_decode") and `generate` follows the
    record (on andrea-tiny ONNX Runtime wins: OpenVINO's per-step overhead is most of such a step). A build that
    measured OpenVINO faster in bf16 and verified it there gets OpenVINO, said on stderr, with OpenVINO's tokens;
    a record that claims it without the passed check, or with figures that are not numbers, gets ONNX Runtime."""
    from andrea_export.runtime.openvino import check_name

    out, manifest = tiny_build
    race = manifest["verification"]["cpu_decode"]
    name = next(iter(manifest["verification"]["runtimes"]))  # openvino-bf16, or openvino-f32 without bf16
    assert set(race["tokens_per_s"]) == {"onnxruntime", name} and all(v > 0 for v in race["tokens_per_s"].values())
    assert race["faster"] == max(race["tokens_per_s"], key=race["tokens_per_s"].get)  # the record, not a timing
    follows = "openvino" if race["faster"] == check_name("bf16") else "onnxruntime"  # tiny: ONNX Runtime, measured 2.8x
    assert runtime.default_backend(out)[0] == follows
    if not cpu_has_bf16():
        pytest.skip("this CPU has no bf16 instructions: OpenVINO is never the default here")
    faster = shutil.copytree(out, tmp_path / "faster")
    record = json.loads((faster / "manifest.json").read_text())
    record["verification"]["cpu_decode"].update(faster=check_name("bf16"), tokens_per_s={check_name("bf16"): 2.0,
                                                                                          "onnxruntime": 1.0})
    (faster / "manifest.json").write_text(json.dumps(record))
    backend, why = runtime.default_backend(faster)
    assert backend == "openvino" and "OpenVINO in bf16" in why and "--backend onnxruntime" in why
    result = CliRunner().invoke(main, ["generate", str(faster), "--prompt-ids", "5,6,7", "-n", "6"])
    assert result.exit_code == 0, result.output
    assert "running on OpenVINO in bf16" in result.stderr
    with runtime.load(faster, "openvino") as sess:
        assert result.stdout.split() == [str(t) for t in sess.generate([5, 6, 7], 6)]
    claimed = record["verification"]
    for lie in ({"runtimes": {check_name("bf16"): False}},
                {"cpu_decode": {**claimed["cpu_decode"], "tokens_per_s": {check_name("bf16"): "fast", "onnxruntime": 1}}}):
        (faster / "manifest.json").write_text(json.dumps({**record, "verification": {**claimed, **lie}}))
        assert runtime.default_backend(faster) == ("onnxruntime", None), lie


CTRL_C_AFTER_SESSIONS = """
import gc, signal, sys
from andrea_export import runtime
first = runtime.load(sys.argv[1], backend="openvino", intra_op_threads=1)
second = runtime.load(sys.argv[1], backend="openvino", intra_op_threads=1)
first.generate([1, 2, 3], 2), second.generate([1, 2, 3], 2)
first.close(); del first; gc.collect()  # the first made, the first gone: not the reverse of their making
second.close(); del second; gc.collect()
signal.signal(signal.SIGINT, signal.default_int_handler)  # not inherited: a runner may have started us ignoring it
try:
    signal.raise_signal(signal.SIGINT)  # Ctrl-C, as a user presses it
except KeyboardInterrupt:
    print("interrupted cleanly")
"""


def test_ctrl_c_after_openvino_sessions_come_and_go_is_a_keyboard_interrupt(build_dir):
    """Each OpenVINO Core's CPU plugin points the main thread's signal stack (sigaltstack) at memory of its own
    and, when the Core goes, back at the one before it: two Cores gone in the order they came leave it on freed
    memory, and the next signal Python handles (Ctrl-C, SIGTERM, an alarm) crashed the process (SIGSEGV, exit
    139). The runtime's sessions share one Core for the life of the process."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", CTRL_C_AFTER_SESSIONS, str(build_dir)], capture_output=True,
                         text=True, timeout=300)
    assert (run.returncode, run.stdout.strip()) == (0, "interrupted cleanly"), run.stderr[-2000:]
